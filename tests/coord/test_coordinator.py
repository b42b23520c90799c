"""Coordinator against a real etcd: leader *processes*, SIGKILL, SIGSTOP, evictions, joins,
races and an etcd restart. Every wait is bounded; every process is killed by PID at the end."""
from __future__ import annotations

import collections
import contextlib
import json
import signal
import threading
import time
import uuid
from itertools import pairwise

import pytest

from lightning_ft.coord import keys
from lightning_ft.coord.coordinator import Coordinator
from lightning_ft.coord.membership import ConfigMismatch, CoordinatorClosed, MembershipSettings, QuorumTimeout
from lightning_ft.coord.demo import LeaderProc
from lightning_ft.coord.round_records import JobSpec
from lightning_ft.coord.etcd_store import EtcdStore
from lightning_ft.coord.store import MemoryStore

TTL = 1.0


@pytest.fixture
def leaders():
    started: list[LeaderProc] = []
    yield started
    for l in started:
        l.kill()


def job_args(job, replicas=3, **kw):
    args = ["--job", job, "--replicas", str(replicas), "--ttl", str(TTL)]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return tuple(args)


def start(leaders, etcd, rids, args, inc=0):
    for r in rids:
        leaders.append(LeaderProc(etcd, r, inc, args))
    return leaders[-len(rids):]


def decided(l: LeaderProc, pred, timeout_s):
    got = l.wait_for(lambda x: "round" in x and pred(x), timeout_s)
    assert got is not None, f"leader r{l.rid} never matched; last lines: {l.lines[-3:]}; stderr: " + (
        l.proc.stderr.read() if l.proc.poll() is not None else "(running)")
    return got


def comparable(row):
    return {k: row[k] for k in ("round", "epoch", "members", "incarnations", "contributors", "lagging",
                                "max_step", "reason")}


def assert_all_agree(procs):
    by_round = collections.defaultdict(list)
    for l in procs:
        for row in l.rounds():
            by_round[row["round"]].append(comparable(row))
    assert by_round, "no rounds were decided"
    for rnd, rows in by_round.items():
        assert all(r == rows[0] for r in rows), f"round {rnd}: leaders disagree: {rows}"
    return by_round


def test_identical_quorums_over_50_rounds_with_random_delays(etcd_endpoint, leaders):
    job = uuid.uuid4().hex[:8]
    procs = start(leaders, etcd_endpoint, range(4),
                  job_args(job, 4, rounds=50, step_ms=2, jitter_ms=25, init_timeout=20))
    for l in procs:
        assert l.proc.wait(60) == 0, l.proc.stderr.read()
    by_round = assert_all_agree(procs)
    assert sorted(by_round) == list(range(50))
    assert all(len(rows) == 4 for rows in by_round.values())  # nobody was left out
    assert [by_round[r][0]["max_step"] for r in range(50)] == list(range(50))


def _first_round_without(l, rid, after_t, timeout_s):
    return decided(l, lambda x: x["t"] > after_t and rid not in x["members"], timeout_s)


def test_sigkilled_leader_is_excluded_within_lease_ttl(etcd_endpoint, leaders):
    job = uuid.uuid4().hex[:8]
    procs = start(leaders, etcd_endpoint, range(3), job_args(job, rounds=100000, step_ms=20))
    decided(procs[0], lambda x: x["round"] >= 5, 20)
    t_kill = time.time()
    procs[2].signal(signal.SIGKILL)
    row = _first_round_without(procs[0], 2, t_kill, 10)
    # A lease lapses TTL after its last keepalive (at most TTL/3 before the kill); etcd's
    # lessor checks expiry every 500 ms.
    assert row["t"] - t_kill < TTL + 0.6, row
    assert row["members"] == [0, 1] and row["epoch"] == 1
    assert "left r2" in row["reason"]


def test_eviction_excludes_a_killed_leader_within_100ms(etcd_endpoint, leaders):
    job = uuid.uuid4().hex[:8]
    procs = start(leaders, etcd_endpoint, range(3), job_args(job, rounds=100000, step_ms=20))
    decided(procs[0], lambda x: x["round"] >= 5, 20)
    store = EtcdStore(etcd_endpoint)
    try:
        procs[2].signal(signal.SIGKILL)
        t_evict = time.time()
        store.put(f"/lft/{job}/evict/2/0", b"killed by test")
        rows = [_first_round_without(l, 2, t_evict, 5) for l in procs[:2]]
    finally:
        store.close()
    for row in rows:
        # Whoever was waiting for r2 is woken by the watch; the rest only need their next round.
        assert row["t"] - t_evict < 0.1, (row["t"] - t_evict, row)


def test_sigstopped_leader_is_excluded_then_rejoins_lagging(etcd_endpoint, leaders):
    job = uuid.uuid4().hex[:8]
    procs = start(leaders, etcd_endpoint, range(3), job_args(job, rounds=100000, step_ms=20))
    decided(procs[0], lambda x: x["round"] >= 5, 20)
    t_stop = time.time()
    procs[1].signal(signal.SIGSTOP)
    row = _first_round_without(procs[0], 1, t_stop, 10)
    assert row["t"] - t_stop <= TTL + 1.0, row
    time.sleep(0.5)
    t_cont = time.time()
    procs[1].signal(signal.SIGCONT)
    back = decided(procs[0], lambda x: x["t"] > t_cont and 1 in x["members"], 10)
    assert back["lagging"] == [1] and "joined r1" in back["reason"]
    assert_all_agree(procs)


def test_late_joiner_is_added_as_lagging_and_nobody_waits(etcd_endpoint, leaders):
    job = uuid.uuid4().hex[:8]
    args = job_args(job, rounds=100000, step_ms=20, init_timeout=0.3)
    procs = start(leaders, etcd_endpoint, [0, 1], args)
    decided(procs[0], lambda x: x["round"] >= 20 and x["members"] == [0, 1], 20)
    t_join = time.time()
    joiner = start(leaders, etcd_endpoint, [2], args)[0]
    row = decided(procs[0], lambda x: 2 in x["members"], 20)
    assert row["lagging"] == [2] and row["contributors"] == [0, 1]
    decided(procs[0], lambda x: x["round"] >= row["round"] + 5, 10)
    assert_all_agree(procs + [joiner])
    # The healthy leaders kept their pace while the joiner started (Python start-up takes seconds).
    ts = [x["t"] for x in procs[0].rounds() if t_join - 0.5 < x["t"] <= row["t"] + 0.5]
    gaps = [b - a for a, b in pairwise(ts)]
    assert max(gaps) < 0.25, gaps


def test_quorums_survive_an_etcd_restart(etcd_server, leaders):
    job = uuid.uuid4().hex[:8]
    procs = start(leaders, etcd_server.endpoint, range(3), job_args(job, rounds=100000, step_ms=20))
    first = decided(procs[0], lambda x: x["round"] >= 5, 20)
    etcd_server.restart(down_s=0.3)
    t_up = time.time()
    later = decided(procs[0], lambda x: x["t"] > t_up and x["round"] >= first["round"] + 10, 20)
    assert later["members"] == [0, 1, 2]
    for l in procs:
        assert l.proc.poll() is None, l.proc.stderr.read()
    assert_all_agree(procs)


def test_racing_leaders_never_produce_two_quorums_for_one_round(etcd_endpoint):
    """Leaders as threads with their own clients, a joiner arriving and a leaver leaving while
    rounds run back to back with no delay: every round has one decision, adopted by all."""
    job = uuid.uuid4().hex[:8]
    spec = JobSpec(5, 1, 0.2, {"job": job})
    got: dict[int, dict[int, tuple]] = collections.defaultdict(dict)
    errors: list[BaseException] = []
    joiner_done = threading.Event()

    def run(rid, rounds, delay_s=0.0, until=None, done=None):
        try:
            time.sleep(delay_s)
            store = EtcdStore(etcd_endpoint)
            c = Coordinator(store, job, rid, 0, spec, MembershipSettings(lease_ttl_s=1.0, poll_interval_s=0.01))
            c.register(0)
            step = 0
            n = 0
            # the long-lived leaders also outlast the joiner (a loaded machine can finish their
            # 40 rounds before it is through: alone, it holds no usable state and waits forever)
            while n < rounds or (until is not None and not until.is_set() and n < 20 * rounds):
                q = c.quorum(step, timeout_s=20)
                got[q.round][rid] = (q.epoch, q.members, q.contributors, q.lagging)
                step = q.max_step + 1
                n += 1
            if done is not None:
                done.set()
            c.close()
            store.close()
        except BaseException as e:  # surfaced below
            errors.append(e)
            if done is not None:
                done.set()

    ts = [threading.Thread(target=run, args=(r, 40, 0.0, joiner_done)) for r in range(3)]
    ts.append(threading.Thread(target=run, args=(3, 10)))       # leaves early
    ts.append(threading.Thread(target=run, args=(4, 15, 0.5, None, joiner_done)))  # joins late
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    assert not errors, errors
    assert len(got) >= 40
    for rnd, by_rid in got.items():
        views = set(by_rid.values())
        assert len(views) == 1, f"round {rnd}: {by_rid}"
        (epoch, members, *_), = views
        assert set(by_rid) == set(members), f"round {rnd}: adopted by {set(by_rid)} but members {members}"
    assert any(4 in v[1] for r in got.values() for v in r.values())


def test_joiner_with_different_config_is_refused_by_name(etcd_endpoint):
    job = uuid.uuid4().hex[:8]
    s = EtcdStore(etcd_endpoint)
    try:
        a = Coordinator(s, job, 0, 0, JobSpec(3, 1, 1.0, {"job": job, "replicas": 3, "nproc_per_replica": 2}))
        a.register(0)
        b = Coordinator(s, job, 1, 0, JobSpec(4, 1, 1.0, {"job": job, "replicas": 4, "nproc_per_replica": 2}))
        with pytest.raises(ConfigMismatch, match=r"replica 1 \(incarnation 0\) refused: job config differs in "
                                                 r"replicas \(4 != 3\)"):
            b.register(0)
        a.close()
    finally:
        s.close()


# -- in-process behaviour on MemoryStore (fast) --------------------------------------------------

def test_eviction_watch_calls_on_failure_for_a_current_member():
    s = MemoryStore()
    spec = JobSpec(2, 1, 5.0, {"job": "j"})
    failures = []
    a = Coordinator(s, "j", 0, 0, spec, MembershipSettings(lease_ttl_s=1),
                    on_failure=lambda r, why: failures.append((r, why, time.monotonic())))
    b = Coordinator(s, "j", 1, 0, spec, MembershipSettings(lease_ttl_s=1))
    a.register(0)
    b.register(0)
    tb = threading.Thread(target=b.quorum, args=(0, 5))
    tb.start()
    a.quorum(0, timeout_s=5)
    tb.join(5)
    t0 = time.monotonic()
    a.evict(1, 0, "process exited with -9")
    assert failures and failures[0][:2] == (1, "evicted: process exited with -9")
    assert failures[0][2] - t0 < 0.1
    a.close(), b.close(), s.close()


def test_hung_training_loop_lets_the_lease_lapse():
    s = MemoryStore()
    spec = JobSpec(1, 1, 0.0, {"job": "j"})
    c = Coordinator(s, "j", 0, 0, spec, MembershipSettings(lease_ttl_s=0.3, hang_timeout_s=0.4))
    c.register(0)
    c.quorum(0, timeout_s=2)
    deadline = time.monotonic() + 0.4 + 0.3 + 1.0
    while s.get("/lft/j/members/0") is not None:
        assert time.monotonic() < deadline, "a hung replica kept its lease"
        time.sleep(0.02)
    # Back from the hang: the next quorum call re-registers it as a joiner.
    q = c.quorum(1, timeout_s=2)
    assert q.members == (0,) and s.get("/lft/j/members/0") is not None
    c.close(), s.close()


def test_below_min_replicas_times_out_with_the_reason():
    s = MemoryStore()
    c = Coordinator(s, "j", 0, 0, JobSpec(3, 2, 0.0, {"job": "j"}), MembershipSettings(lease_ttl_s=1))
    c.register(0)
    with pytest.raises(QuorumTimeout, match="below min_replicas: 1 of 2 needed"):
        c.quorum(0, timeout_s=0.3)
    c.close(), s.close()


def test_close_ends_a_quorum_call_that_waits_for_a_missing_member():
    """A replica that exits (an exception in the user's code) closes its coordinator while its
    overlapped quorum call for the next round still waits for a hung member: that call ends at
    once. Before, it waited out its timeout, and Python's exit joins the pool thread it runs
    in: the soak saw a replica "hung on exit" for supervisor.exit_timeout_s (20 s)."""
    s = MemoryStore()
    c = Coordinator(s, "j", 0, 0, JobSpec(2, 2, 0.0, {"job": "j"}), MembershipSettings(lease_ttl_s=1))
    c.register(0)
    out: dict = {}

    def call():
        try:
            c.quorum(0, timeout_s=30)
        except Exception as e:  # noqa: BLE001 -- the test reads what ended the call
            out["error"] = e

    t = threading.Thread(target=call, daemon=True)
    t.start()
    time.sleep(0.3)
    assert t.is_alive(), out  # waiting for replica 1 (min_replicas 2)
    t0 = time.monotonic()
    c.close()
    t.join(5)
    assert not t.is_alive(), "quorum() still waits after close()"
    assert time.monotonic() - t0 < 1.0
    assert isinstance(out.get("error"), CoordinatorClosed), out
    s.close()


def _both(a, b, step_a, step_b, **kw):
    """Both leaders call quorum() at once; returns their quorums."""
    out = {}
    tb = threading.Thread(target=lambda: out.__setitem__("b", b.quorum(step_b, timeout_s=5, **kw)))
    tb.start()
    out["a"] = a.quorum(step_a, timeout_s=5, **kw)
    tb.join(6)
    return out["a"], out["b"]


@pytest.mark.parametrize("recorded", [False, True])
def test_a_failed_steady_round_is_retracted_unless_it_was_recorded(recorded):
    """b went steady at round R while a went to a full round R (it saw a change) and aborted b's
    ring. b's steady R never happened: retracted, b reports for R again and both are in the
    full round R. Without the retraction b's report for R+1 also counts for R, so a's round R
    would have a ring with b, which waits for R+1 (tests/launch/test_partitions.py found it).
    If b's steady R is already recorded in etcd (its lowest-id member records it), R stands as
    the failed steady round and both meet at R+1."""
    from lightning_ft.coord.quorum import LocalView, steady_next

    s = MemoryStore()
    spec = JobSpec(2, 1, 5.0, {"job": "j"})
    a = Coordinator(s, "j", 0, 0, spec, MembershipSettings(lease_ttl_s=2))
    b = Coordinator(s, "j", 1, 0, spec, MembershipSettings(lease_ttl_s=2))
    try:
        for c in (a, b):
            c.register(0, synced=True)
        for step in range(3):  # train rounds with both contributing
            qa, qb = _both(a, b, step, step)
            assert qa == qb and qa.kind == "train" or step == 0
        r = qa.round + 1
        steady = steady_next(qb, LocalView(committed=True, changed=False, digest_due=False))
        assert steady is not None and steady.round == r
        b.adopt_steady(steady)
        if recorded:
            b.record_steady(steady)
        b.retract_steady()  # b's exchange was aborted: its steady round failed
        if recorded:  # a finds round R decided (the steady record) and adopts it; it fails for a too
            q = a.quorum(3, timeout_s=5)
            assert q.round == r and q.steady
            a.retract_steady()  # no-op: it stands
        qa, qb = _both(a, b, 3, 3)
        want = r + 1 if recorded else r
        assert qa.round == qb.round == want and qa == qb and set(qa.members) == {0, 1}, (qa, qb)
    finally:
        a.close(), b.close(), s.close()


def test_a_member_whose_steady_round_failed_meets_the_committers_record_and_moves_on():
    """Steady rounds are recorded lazily. a committed steady round R, b's exchange of it failed: b
    retracts R (not recorded yet) and reports for R. a's next steady round fails too (b aborted
    the ring on its way to a full round); a retracts R+1, records R, the steady round it
    committed, before its full report (`record_committed`), and reports for R+1. b meets the
    record of R, which it failed, as that round's decision: R is over for it, and both meet at
    R+1 with b lagging one step (a committed R, b did not)."""
    from lightning_ft.coord.quorum import LocalView, steady_next

    s = MemoryStore()
    spec = JobSpec(2, 1, 5.0, {"job": "j"})
    a = Coordinator(s, "j", 0, 0, spec, MembershipSettings(lease_ttl_s=2))
    b = Coordinator(s, "j", 1, 0, spec, MembershipSettings(lease_ttl_s=2))
    try:
        for c in (a, b):
            c.register(0, synced=True)
        for step in range(3):
            qa, qb = _both(a, b, step, step)
        r = qa.round + 1
        steady = steady_next(qa, LocalView(committed=True, changed=False, digest_due=False))
        assert steady is not None and steady.round == r and not s.get(a._round_key(r))
        for c in (a, b):
            c.adopt_steady(steady)
        b.retract_steady()  # b's exchange of R failed; nothing recorded it: b reports for R
        nxt = steady_next(steady, LocalView(committed=True, changed=False, digest_due=False))
        assert nxt is not None
        a.adopt_steady(nxt)  # a committed R and went steady to R+1, whose exchange b aborted
        a.retract_steady()
        a.record_committed(r)  # what rounds.py does before a full round's report
        assert s.get(a._round_key(r)) is not None
        qa, qb = _both(a, b, 4, 3)
        assert qa.round == qb.round == r + 1 and qa == qb, (qa, qb)
        assert qa.contributors == (0,) and qa.lagging == (1,) and qa.max_step == 4
    finally:
        a.close(), b.close(), s.close()


def test_a_state_made_by_an_older_round_is_decided_stale_with_an_event():
    """Provenance through the store: both report step 4 of the same generation, r1's made by an
    older round. The decider makes r1 lagging and records a `stale` event naming both rounds."""
    s = MemoryStore()
    spec = JobSpec(2, 1, 5.0, {"job": "j"})
    events = []
    a = Coordinator(s, "j", 0, 0, spec, MembershipSettings(lease_ttl_s=1),
                    on_event=lambda name, **f: events.append((name, f)))
    b = Coordinator(s, "j", 1, 0, spec, MembershipSettings(lease_ttl_s=1),
                    on_event=lambda name, **f: events.append((name, f)))
    a.register(4, gen=0, synced=True, made=(5, 2))  # whoever decides round 0 sees both reports as made
    b.register(4, gen=0, synced=True, made=(3, 1))
    out = {}
    tb = threading.Thread(target=lambda: out.__setitem__("b", b.quorum(4, timeout_s=5, gen=0, synced=True,
                                                                        made=(3, 1))))
    tb.start()
    qa = a.quorum(4, timeout_s=5, gen=0, synced=True, made=(5, 2))
    tb.join(6)
    assert qa == out["b"] and qa.contributors == (0,) and qa.lagging == (1,), qa.reason
    stale = [f for name, f in events if name == "stale"]
    assert stale == [dict(replica=1, step=4, made=[3, 1], newest=[5, 2], round=0)], events
    a.close(), b.close(), s.close()


class _PerLeader:
    """A leader's view of a shared MemoryStore that counts the watch events it is delivered, by
    top-level key kind (members, alive, quorum, evict)."""

    def __init__(self, inner):
        self._inner = inner
        self.events = collections.Counter()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def watch_prefix(self, prefix, callback, start_revision=0):
        def counted(ev):
            self.events[ev.key.split("/")[3]] += 1
            callback(ev)

        return self._inner.watch_prefix(prefix, counted, start_revision)


def test_only_the_decider_receives_the_reports_and_it_evaluates_about_once_a_round():
    """Work per round is O(R): R leaders x 12 rounds; each report reaches the decider alone, and
    it reads etcd for the decision once the watched reports could decide it, not per report."""
    R, rounds = 6, 12
    s = MemoryStore()
    spec = JobSpec(R, 1, 5.0, {"job": "j"})
    views = [_PerLeader(s) for _ in range(R)]
    cs = [Coordinator(v, "j", rid, 0, spec, MembershipSettings(lease_ttl_s=5)) for rid, v in enumerate(views)]
    for rid, c in enumerate(cs):
        c.register(0, addrs=(f"h{rid}:1", f"h{rid}:2"), state_addrs=(f"h{rid}:3", f"h{rid}:4"))
    seen: dict[int, list] = collections.defaultdict(list)
    errors = []

    def run(c):
        try:
            step = 0
            for _ in range(rounds):
                q = c.quorum(step, timeout_s=10)
                seen[c.rid].append((q.round, q.members))
                step = q.max_step + 1
        except BaseException as e:  # surfaced below
            errors.append(e)

    before = [v.events.copy() for v in views]
    ts = [threading.Thread(target=run, args=(c,)) for c in cs]
    [t.start() for t in ts]
    [t.join(30) for t in ts]
    assert not errors, errors
    assert all(seen[r] == seen[0] for r in range(R)) and len(seen[0]) == rounds
    members_events = [v.events["members"] - b["members"] for v, b in zip(views, before, strict=True)]
    # round 0 has no decider yet (everyone may decide it, and watches); from round 1 on only r0
    assert all(n <= 2 * R for n in members_events[1:]), members_events
    assert members_events[0] >= R * (rounds - 1), members_events
    assert cs[0].watching_reports and not any(c.watching_reports for c in cs[1:])
    assert cs[0].evaluations <= 2 * rounds, cs[0].evaluations
    total = sum(sum(v.events.values()) - sum(b.values()) for v, b in zip(views, before, strict=True))
    assert total <= 4 * R * rounds, total  # O(R) a round: R reports to one leader, one decision to each
    # the addresses are out of the round's messages, in etcd once per incarnation
    q = cs[1].current
    assert b"h0:1" not in q.to_json() and "addrs" not in json.loads(q.to_json())
    assert cs[1].addresses(0, 0) == (("h0:1", "h0:2"), ("h0:3", "h0:4"))
    for c in cs:
        c.close()
    s.close()


def test_a_new_decider_takes_over_the_reports_when_the_old_one_dies():
    s = MemoryStore()
    spec = JobSpec(3, 1, 5.0, {"job": "j"})
    cs = [Coordinator(s, "j", rid, 0, spec, MembershipSettings(lease_ttl_s=5)) for rid in range(3)]
    for c in cs:
        c.register(0)
    out = {}

    def rounds(cs_, step):
        ts = [threading.Thread(target=lambda c=c: out.__setitem__(c.rid, c.quorum(step, timeout_s=10))) for c in cs_]
        [t.start() for t in ts]
        [t.join(15) for t in ts]
        return [out[c.rid] for c in cs_]

    rounds(cs, 0)
    assert [c.watching_reports for c in cs] == [True, False, False]
    cs[0].close()  # a clean exit: its lease is revoked
    q1, q2 = rounds(cs[1:], 1)
    assert q1 == q2 and q1.members == (1, 2)
    assert [c.watching_reports for c in cs[1:]] == [True, False]
    for c in cs[1:]:
        c.close()
    s.close()


@contextlib.contextmanager
def _joiner_after_unrecorded_steady_rounds(ttl):
    """Members r0 and r2 decide three full rounds, then run 50 steady rounds nobody records;
    r1 (incarnation 4) registers as a joiner. Yields (store, a, b, j, the last full quorum, the
    stale round the joiner reports for)."""
    from lightning_ft.coord.quorum import LocalView, steady_next

    s = MemoryStore()
    spec = JobSpec(3, 1, 1.0, {"job": "j"})  # round 0 starts without r1 after 1 s (the calls time out at 5 s)
    a, b, j = (Coordinator(s, "j", rid, inc, spec, MembershipSettings(lease_ttl_s=ttl))
               for rid, inc in ((0, 0), (2, 0), (1, 4)))
    try:
        for c in (a, b):
            c.register(0, synced=True)
        for step in range(3):
            qa, _ = _both(a, b, step, step)
        for _ in range(50):  # steady rounds, adopted by both, recorded by nobody
            for c in (a, b):
                c.adopt_steady(steady_next(c.current, LocalView(committed=True, changed=False, digest_due=False)))
        j.register(0, synced=False)
        assert j.membership.report.round == qa.round + 1 and j.membership.report.joining
        yield s, a, b, j, qa, qa.round + 1
    finally:
        a.close(), b.close(), j.close(), s.close()


def test_a_joiner_is_taken_in_while_the_others_ran_steady_rounds_nobody_recorded():
    """The survivors ran rounds without etcd (steady) that were never recorded, so the joiner
    reports for a round they passed long ago. Its report still counts (rule 1: joining); the
    next full round takes it in, and it adopts that round instead of deciding its stale round
    alone after the fallback (a quorum the others never join: 10-33 s per heal at 4 ms steps)."""
    with _joiner_after_unrecorded_steady_rounds(1) as (s, a, b, j, qa, stale):
        out: dict = {}
        tj = threading.Thread(target=lambda: out.__setitem__("j", j.quorum(0, timeout_s=5)))
        tj.start()
        time.sleep(0.05)
        assert a.changed  # the decider's members watch saw the joiner
        step = qa.max_step + 51
        qa, qb = _both(a, b, step, step)
        tj.join(6)
        qj = out["j"]
        assert qa == qb == qj and qj.members == (0, 1, 2) and qj.lagging == (1,), (qa, qj)
        assert qj.round == stale + 50
        assert s.get(keys.quorum(keys.root("/lft", "j"), stale)) is None  # it never decided the stale round
        assert not j.membership.report.joining


def test_a_joiner_whose_fallback_comes_first_reports_for_the_round_the_others_report_for():
    """As above, but the members' own decision is slow to come (they are busy in a step): the
    joiner's fallback comes first. It must not decide its stale round from the members' reports
    for a later round (the recovery bench once froze for minutes: the joiner decided round 1120,
    the others round 1137, with the same members, and each side then followed its own rounds);
    it reports for theirs (round_log.passed) and that round takes it in."""
    from dataclasses import replace

    with _joiner_after_unrecorded_steady_rounds(1) as (s, a, b, j, qa, stale):
        step, later = qa.max_step + 51, stale + 50
        for c in (a, b):  # they report for their next round, and do not decide it yet
            c.membership.publish(replace(c.membership.report, step=step, round=later))
        qj = j.quorum(0, timeout_s=15)  # two fallbacks of 2 x TTL: the stale round's, then the later one's
        assert s.get(keys.quorum(keys.root("/lft", "j"), stale)) is None  # the passed round stays undecided
        assert qj.round == later and qj.members == (0, 1, 2) and qj.lagging == (1,), qj
        assert j.membership.report.round == later


@pytest.mark.parametrize("name", ["lease_ttl_s", "hang_timeout_s", "poll_interval_s"])
def test_membership_settings_refuse_a_timing_that_is_not_positive(name):
    with pytest.raises(ValueError, match=f"membership setting {name}=0 must be > 0"):
        MembershipSettings(**{name: 0})
