"""The simulator's clock, etcd and fault schedules (lightning_ft/sim/world.py, etcd.py, faults.py)."""
from __future__ import annotations

import pytest

from lightning_ft.coord.store import LeaseExpired, StoreError
from lightning_ft.sim.etcd import SimStore
from lightning_ft.sim.faults import KINDS, schedule, shrink
from lightning_ft.sim.world import World


def test_processes_run_in_time_order_and_wait_for_events_or_timeouts():
    w = World(0)
    ev = w.event()
    log = []

    def sleeper():
        yield 1.0
        log.append(("slept", w.now))
        got = yield ev, 5.0
        log.append(("event", got, w.now))
        got = yield ev, 0.5  # already set: at once
        log.append(("again", got, w.now))

    def setter():
        yield 2.5
        ev.set()

    def timed_out():
        other = w.event()
        got = yield other, 0.25
        log.append(("timeout", got, w.now))

    w.spawn("a", sleeper())
    w.spawn("b", setter())
    w.spawn("c", timed_out())
    w.run(10.0)
    assert log == [("timeout", False, 0.25), ("slept", 1.0), ("event", True, 2.5), ("again", True, 2.5)]


def test_a_stopped_process_runs_nothing_until_continued_and_a_killed_one_never_again():
    w = World(0)
    ticks = []

    def ticker():
        while True:
            yield 1.0
            ticks.append(w.now)

    p = w.spawn("t", ticker())
    w.at(2.5, w.stop, p)
    w.at(5.5, w.cont, p)
    w.at(7.5, w.kill, p)
    w.run(12.0)
    assert ticks == [1.0, 2.0, 5.5, 6.5] and not p.alive


def test_the_same_seed_gives_the_same_trace_and_another_seed_another():
    def run(seed):
        w = World(seed)

        def p():
            for _ in range(5):
                yield w.rng.random()
                w.note(f"at {w.now}")
        w.spawn("p", p())
        w.run(100)
        return w.trace
    assert run(3) == run(3) != run(4)


def test_leases_expire_at_their_deadline_and_outages_renew_them():
    w = World(0)
    s = SimStore(w)
    lease = s.lease_grant(1.0)
    s.put("/a", b"1", lease=lease)
    seen = []
    s.watch_prefix("/", lambda ev: seen.append((ev.kind, ev.key, w.now)))
    w.run(0.9)
    assert s.get("/a") is not None
    s.outage(3.0)  # the server is down: its leases start afresh when it is back
    with pytest.raises(StoreError, match="unreachable"):
        s.get("/a")
    w.run(4.0)
    assert s.get("/a") is not None and seen == []
    w.run(5.0)
    assert s.get("/a") is None and seen == [("delete", "/a", pytest.approx(4.9))]
    with pytest.raises(LeaseExpired):
        s.lease_keepalive(lease)
    lease2 = s.lease_grant(1.0)
    s.outage(2.0, renew_leases=False)  # the clients are cut from a running etcd: leases lapse
    w.run(7.5)
    with pytest.raises(LeaseExpired):
        s.lease_keepalive(lease2)


def test_fenced_writes_and_create_if_absent():
    w = World(0)
    s = SimStore(w)
    assert s.create("/k", b"a") and not s.create("/k", b"b")
    rev = s.get("/k").create_revision
    assert s.put_if("/x", b"1", {"/k": rev}) and not s.put_if("/x", b"2", {"/k": rev + 1})
    assert s.get("/x").value == b"1"
    kvs, r = s.get_prefix("/")
    assert [kv.key for kv in kvs] == ["/k", "/x"]
    s.put("/k", b"c")
    old, _ = s.get_prefix("/k", revision=r)
    assert old[0].value == b"a"  # a read at an old revision


def test_schedules_are_functions_of_the_seed_and_cover_every_kind():
    a, b = schedule(5, 3, 10.0, 10), schedule(5, 3, 10.0, 10)
    assert a == b and a != schedule(6, 3, 10.0, 10)
    assert sorted(f.t for f in a) == [f.t for f in a]
    kinds = {f.kind for s in range(200) for f in schedule(s, 3, 10.0, 10)}
    assert kinds == set(KINDS)


def test_shrink_finds_the_faults_a_failure_needs():
    faults = schedule(1, 3, 10.0, 12)
    need = {faults[2], faults[9]}
    got = shrink(faults, lambda fs: need <= set(fs))
    assert set(got) == need
    assert shrink(faults[:1], lambda fs: True) == faults[:1]
