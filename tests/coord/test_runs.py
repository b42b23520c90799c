"""Runs of a job id (lightning_ft/coord/runs.py): the pure rule, table-driven, and the CAS
I/O against the in-memory store (same contract as etcd)."""
from __future__ import annotations

import threading

import pytest

from lightning_ft.coord import keys
from lightning_ft.coord.runs import (RunConflict, RunHold, RunRecord, current_run, decide_run, is_live, open_run)
from lightning_ft.coord.store import MemoryStore

MINE, OTHER = "tag-mine", "tag-other"
REC = RunRecord("r1", MINE, started=100.0, by="host-a pid 1")


@pytest.mark.parametrize("record,want,live,first,action,run", [
    # nothing recorded: start (the given id, or a new one)
    (None, "", False, True, "start", "NEW"),
    (None, "slurm42", False, True, "start", "slurm42"),
    (None, "", False, False, "start", "NEW"),
    # our job, running: everyone joins
    (REC, "", True, True, "join", "r1"),
    (REC, "", True, False, "join", "r1"),
    (REC, "r1", True, True, "join", "r1"),
    (REC, "r1", False, False, "join", "r1"),
    # our job id, ended: a new start never inherits; a restarted replica rejoins
    (REC, "", False, True, "start", "NEW"),
    (REC, "", False, False, "join", "r1"),
    # a process of another run of ours
    (REC, "r2", True, True, "refuse", ""),
    (REC, "r2", False, True, "start", "r2"),
    # another job (another secret) holds the id
    (RunRecord("r1", OTHER), "", True, True, "refuse", ""),
    (RunRecord("r1", OTHER), "r1", True, True, "refuse", ""),
    (RunRecord("r1", OTHER), "", False, True, "start", "NEW"),
    (RunRecord("r1", OTHER), "r9", False, False, "start", "r9"),
])
def test_decide_run(record, want, live, first, action, run):
    got = decide_run("gpt", record, tag=MINE, want=want, live=live, first=first, new_id="NEW", now=160.0)
    assert (got.action, got.run_id) == (action, run), got.reason


def test_refusals_say_what_holds_the_id_and_what_to_do():
    other = decide_run("gpt", RunRecord("r1", OTHER, 100.0, "host-b pid 7"), tag=MINE, want="", live=True,
                       first=True, new_id="x", now=160.0)
    assert "job id 'gpt' is in use on this etcd by another job (run r1, started 60 s ago by host-b pid 7" in \
        other.reason and "give it the job's secret ($LFT_SECRET_FILE); else pick another job id" in other.reason
    assert OTHER not in other.reason and MINE not in other.reason, "tags are not shown"
    stale = decide_run("gpt", REC, tag=MINE, want="r2", live=True, first=True, new_id="x", now=160.0)
    assert "running as run r1" in stale.reason and "belongs to run r2" in stale.reason


def _store_with_run(store, rid: str, tag: str = MINE, live: bool = True) -> None:
    store.put(keys.run_record("/lft", "gpt"), RunRecord(rid, tag).to_json())
    if live:
        lease = store.lease_grant(30)
        store.put(keys.members(keys.root("/lft", "gpt", rid), 0), b"{}", lease=lease)


def test_open_run_starts_once_under_a_race_and_later_processes_join():
    store = MemoryStore()
    got, errors = [], []

    def one():
        hold = RunHold(store, ttl_s=30, keepalive=False)
        try:
            got.append(open_run(store, "/lft", "gpt", MINE, hold))
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors
    assert len({c.run_id for c in got}) == 1, got
    assert sorted(c.action for c in got) == ["join"] * 7 + ["start"]
    rid = got[0].run_id
    assert current_run(store, "/lft", "gpt", MINE) == rid
    assert is_live(store, keys.root("/lft", "gpt", rid)), "the starter holds the run before its replicas register"


def test_another_job_with_the_same_id_is_refused_while_it_runs_and_takes_over_after():
    store = MemoryStore()
    _store_with_run(store, "old", tag=OTHER)
    with pytest.raises(RunConflict, match="in use on this etcd by another job"):
        open_run(store, "/lft", "gpt", MINE, RunHold(store, keepalive=False))
    store.delete_prefix(keys.members(keys.root("/lft", "gpt", "old")))
    choice = open_run(store, "/lft", "gpt", MINE, RunHold(store, keepalive=False))
    assert choice.action == "start" and choice.run_id != "old"
    assert current_run(store, "/lft", "gpt", OTHER) is None, "the other job's view: not its run any more"


def test_a_reused_id_never_inherits_finished_cursors_or_evictions():
    store = MemoryStore()
    _store_with_run(store, "old", live=False)
    old = keys.root("/lft", "gpt", "old")
    for key in (keys.finished(old), keys.cursor(old, 0), keys.evict(old, 0, 0)):
        store.put(key, b"1")
    choice = open_run(store, "/lft", "gpt", MINE, RunHold(store, keepalive=False), first=True)
    new = keys.root("/lft", "gpt", choice.run_id)
    assert choice.action == "start" and new != old
    for key in (keys.finished(new), keys.cursor(new, 0), keys.evict(new, 0, 0)):
        assert store.get(key) is None
    # a restarted replica of the old run (not a first start) would rejoin it instead
    _store_with_run(store, "old", live=False)
    assert open_run(store, "/lft", "gpt", MINE, RunHold(store, keepalive=False), first=False).run_id == "old"


def test_run_hold_keeps_a_run_live_and_revokes_on_close():
    store = MemoryStore()
    root = keys.root("/lft", "gpt", "r1")
    hold = RunHold(store, ttl_s=0.3)
    hold.hold(root)
    assert is_live(store, root)
    store.delete_prefix(root)  # a whole-job restart clears the keyspace: the hold puts its key back
    deadline = threading.Event()
    for _ in range(50):
        if is_live(store, root):
            break
        deadline.wait(0.05)
    assert is_live(store, root)
    hold.close()
    assert not is_live(store, root)
