"""Warm standby (coord/standby.py): which spare takes which replica (pure, table tests), and a
spare's registration and promotion against the in-memory store."""
from __future__ import annotations

import json
import threading
import time

import pytest

from lightning_ft.coord import keys
from lightning_ft.coord.membership import ConfigMismatch, JobFinished
from lightning_ft.coord.runs import RunConflict, RunRecord
from lightning_ft.coord.standby import Spare, Vacancy, Waiter, WaiterSettings, assign, promote, spares
from lightning_ft.coord.store import MemoryStore

A, B = "host-a", "host-b"


@pytest.mark.parametrize("vacancies, pool, world, want", [
    # one vacancy, one spare
    ([Vacancy(1, 1, A)], [Spare("s0", A, 1, 5.0)], 1, {1: "s0"}),
    # no spare: the vacancy restarts cold
    ([Vacancy(1, 1, A)], [], 1, {}),
    # the spare on the replica's own host first, even if another waited longer
    ([Vacancy(1, 1, B)], [Spare("s0", A, 1, 1.0), Spare("s1", B, 1, 9.0)], 1, {1: "s1"}),
    # no spare on its host: the longest-waiting anywhere
    ([Vacancy(1, 1, B)], [Spare("s0", A, 1, 9.0), Spare("s1", A, 1, 1.0)], 1, {1: "s1"}),
    # unknown host: the longest-waiting; ties go by token
    ([Vacancy(2, 3, "")], [Spare("sb", A, 1, 1.0), Spare("sa", B, 1, 1.0)], 1, {2: "sa"}),
    # two evictions at once take two spares, in replica order
    ([Vacancy(2, 1, A), Vacancy(0, 4, A)], [Spare("s0", A, 1, 1.0), Spare("s1", A, 1, 2.0)], 1,
     {0: "s0", 2: "s1"}),
    # more vacancies than spares: the lowest ids take them
    ([Vacancy(2, 1), Vacancy(0, 1), Vacancy(1, 1)], [Spare("s0", A, 1, 1.0)], 1, {0: "s0"}),
    # a spare of another size never replaces a replica
    ([Vacancy(1, 1, A)], [Spare("s0", A, 2, 1.0)], 1, {}),
    ([Vacancy(1, 1, A)], [Spare("s0", A, 2, 1.0), Spare("s1", B, 4, 0.0)], 2, {1: "s0"}),
    # a same-host spare taken by an earlier vacancy leaves the next one the rest
    ([Vacancy(0, 1, A), Vacancy(1, 1, A)], [Spare("s0", A, 1, 3.0), Spare("s1", B, 1, 1.0)], 1,
     {0: "s0", 1: "s1"}),
])
def test_assign(vacancies, pool, world, want):
    assert assign(vacancies, pool, world) == want


def test_assign_never_uses_a_spare_twice_and_is_order_independent():
    pool = [Spare(f"s{i}", (A, B)[i % 2], 1, float(i)) for i in range(5)]
    vac = [Vacancy(r, 1, (B, A)[r % 2]) for r in range(7)]
    got = assign(vac, pool, 1)
    assert len(set(got.values())) == len(got) == 5
    assert got == assign(list(reversed(vac)), list(reversed(pool)), 1)


def _job(store: MemoryStore, tag: str = "tag", run: str = "run0", fp: dict | None = None) -> str:
    store.put(keys.run_record("/lft", "j"), RunRecord(run, tag).to_json())
    root = keys.root("/lft", "j", run)
    if fp is not None:
        store.put(keys.config(root), json.dumps(fp).encode())
    return root


def test_a_spare_registers_waits_and_takes_the_replica_it_is_given():
    store = MemoryStore()
    root = _job(store, fp={"replicas": 3})
    w = Waiter(store, "j", "tag", {"replicas": 3}, "s0", WaiterSettings(prefix="/lft", ttl_s=3.0), host=A, world=1)
    assert w.wait(timeout_s=0.05) is None  # registered, not promoted yet
    (s,) = spares(store, root)
    assert (s.token, s.host, s.world) == ("s0", A, 1)
    out: list = []
    t = threading.Thread(target=lambda: out.append(w.wait(timeout_s=10)))
    t.start()
    time.sleep(0.05)
    assert promote(store, root, "s0", rid=1, incarnation=2)
    assert not promote(store, root, "s0", rid=2, incarnation=1)  # promoted once
    t.join(5)
    assert out and (out[0].rid, out[0].incarnation, out[0].run_id) == (1, 2, "run0")
    assert spares(store, root) == []  # withdrawn: no one else may take it


def test_a_spare_gone_cannot_be_promoted():
    store = MemoryStore()
    root = _job(store)
    assert not promote(store, root, "ghost", 1, 1)
    assert store.get(keys.promote(root, "ghost")) is None


@pytest.mark.parametrize("case", ["secret", "config", "finished"])
def test_a_spare_that_does_not_belong_is_refused_before_it_registers(case):
    store = MemoryStore()
    root = _job(store, tag="other" if case == "secret" else "tag",
                fp={"replicas": 4 if case == "config" else 3})
    if case == "finished":
        store.put(keys.finished(root), b'{"step": 10}')
    w = Waiter(store, "j", "tag", {"replicas": 3}, "s0", WaiterSettings(prefix="/lft"))
    err = {"secret": RunConflict, "config": ConfigMismatch, "finished": JobFinished}[case]
    with pytest.raises(err):
        w.wait(timeout_s=0.1)
    assert spares(store, root) == []


def test_a_waiting_spare_notices_the_job_finish():
    store = MemoryStore()
    root = _job(store)
    w = Waiter(store, "j", "tag", {}, "s0", WaiterSettings(prefix="/lft", ttl_s=0.3))
    assert w.wait(timeout_s=0.05) is None
    store.put(keys.finished(root), b'{"step": 10}')
    with pytest.raises(JobFinished):
        w.wait(timeout_s=5)
    w.close()
    assert spares(store, root) == []


def test_a_spare_whose_launcher_died_stops_waiting(monkeypatch):
    """Nobody would promote it: it leaves (the soak kills a whole job, launcher first)."""
    import os

    from lightning_ft.coord.standby import LauncherGone

    store = MemoryStore()
    root = _job(store)
    w = Waiter(store, "j", "tag", {}, "s0", WaiterSettings(prefix="/lft", ttl_s=0.3))
    assert w.wait(timeout_s=0.05) is None
    monkeypatch.setattr(os, "getppid", lambda: 1)  # reparented to init
    with pytest.raises(LauncherGone, match="launcher"):
        w.wait(timeout_s=5)
    w.close()
    assert spares(store, root) == []


def test_waiter_settings_refuse_a_timing_that_is_not_positive():
    with pytest.raises(ValueError, match="standby setting ttl_s=0 must be > 0"):
        WaiterSettings(ttl_s=0)
    with pytest.raises(ValueError, match="standby setting poll_s=-1 must be > 0"):
        WaiterSettings(poll_s=-1)
