"""The end of the job (replica/catchup/ending.py): a member that failed to commit the last step ends
at it anyway, with the finisher's state, instead of leaving one step short."""
from __future__ import annotations

import json

import pytest

from lightning_ft.bench.localjob import Job
from lightning_ft.replica.catchup.ending import end_verdict, pending
from tests.replica.test_replica import SMALL, assert_exactly_once, assert_identical_every_step


@pytest.mark.parametrize("others, done, alive, want", [
    ([], {}, {}, []),                                    # alone in the last quorum
    ([(1, 0), (2, 0)], {1: 30, 2: 30}, {1: 0, 2: 0}, []),  # the usual end: everyone done
    ([(1, 0), (2, 0)], {1: 30}, {1: 0, 2: 0}, [2]),      # 2 behind and alive: wait for it
    ([(1, 0), (2, 0)], {2: 29}, {1: 0, 2: 0}, [1, 2]),   # done at an earlier step is not done
    ([(1, 0), (2, 0)], {}, {1: 0}, [1]),                 # 2 gone (lease expired, evicted or left)
    ([(1, 0), (2, 0)], {}, {1: 0, 2: 1}, [1]),           # 2 restarted: a new incarnation never trained with us
    ([(1, 0), (2, None)], {}, {1: 0, 2: 1}, [1, 2]),     # 2 sat out a probation: any incarnation of it
    ([(1, 0)], {1: 31}, {1: 0}, []),                     # (done later than us: not ours to wait for)
])
def test_a_finisher_waits_for_the_members_behind_it_that_live(others, done, alive, want):
    assert pending(30, others, done, alive) == want


def test_the_finishers_view_of_etcd_leaves_out_evicted_incarnations():
    from lightning_ft.coord import keys
    from lightning_ft.coord.store import MemoryStore
    from lightning_ft.replica.catchup.ending import _read, read_finished

    root = keys.root("/lft", "end")
    store = MemoryStore()
    assert read_finished(store, root) is None
    for rid, inc in ((0, 0), (1, 2), (2, 1)):
        store.put(keys.alive(root, rid), json.dumps({"incarnation": inc}).encode())
    store.put(keys.evict(root, 1, 2), b"hung")  # its live incarnation is evicted
    store.put(keys.evict(root, 2, 0), b"killed")  # an older incarnation's eviction: 2 lives on
    store.put(keys.done(root, 0), json.dumps({"step": 30, "incarnation": 0}).encode())
    store.put(keys.finished(root), json.dumps({"step": 30, "rid": 0, "incarnation": 0}).encode())
    assert _read(store, root) == ({0: 30}, {0: 0, 2: 1})
    assert read_finished(store, root) == {"step": 30, "rid": 0, "incarnation": 0}


def test_members_that_fail_to_commit_the_last_step_end_at_it_with_the_finishers_state(etcd_endpoint, tmp_path,
                                                                                     plain_loop_zygote):
    """CI saw it in a soak: the last step committed on replica 2 only (replicas 0 and 1 aborted
    it), replica 2 finished, and 0 and 1 left at step 1199 of 1200 without the final state.
    Here 0 and 1 vote 'failed' after the last step's exchange while 2 commits it."""
    steps = 30
    job = Job(etcd_endpoint, tmp_path, args=SMALL + ("--steps", str(steps), "--fail-commit-at", str(steps - 1),
                                                     "--fail-replicas", "0,1"),
              env={(r, 0): {"LFT_RUN_DIR": str(tmp_path)} for r in range(3)}, zygote=plain_loop_zygote)
    try:
        job.start_all()
        job.wait_done(120)
        finals = {rid: r.wait_for(lambda x: x.get("event") == "final", 5) for rid, r in job.replicas.items()}
        assert {f["step"] for f in finals.values()} == {steps}, finals
        assert_identical_every_step(job)
        assert_exactly_once(job)
        with open(tmp_path / "events.jsonl") as f:
            adopted = [e for e in map(json.loads, f) if e["event"] == "final_adopted"]
        # the first to adopt fetches from replica 2, the only finisher; a later one may fetch from
        # any replica that already holds the final state (2, or one that adopted it before)
        adopted.sort(key=lambda e: e["t"])
        assert {e["replica"] for e in adopted} == {0, 1} and adopted[0]["source"] == 2, adopted
        holders = {2}
        for e in adopted:
            assert e["source"] in holders and e["step"] == steps, adopted
            holders.add(e["replica"])
    finally:
        job.close()


@pytest.mark.parametrize("mine,records,want", [
    ("a", {1: {"step": 30, "digest": "a"}, 2: {"step": 30, "digest": "a"}}, ("agree", None)),
    ("a", {1: {"step": 30}, 2: {"step": 30, "digest": "a"}}, ("wait", None)),          # 1 has not compared yet
    ("a", {1: {"step": 29}, 2: {"step": 30, "digest": "a"}}, ("agree", None)),         # another step: not compared
    ("b", {1: {"step": 30, "digest": "a"}, 2: {"step": 30, "digest": "a"}}, ("heal", 1)),  # a minority: take 1's
    ("a", {1: {"step": 30, "digest": "b"}, 2: {"step": 30, "digest": "a"}}, ("wait", None)),  # 1 heals from us
    ("a", {1: {"step": 30, "digest": "b"}}, ("split", None)),                         # two, no majority
    ("a", {1: {"step": 30, "digest": "b"}, 2: {"step": 30, "digest": "c"}}, ("split", None)),
    ("a", {}, ("agree", None)),                                                       # alone
])
def test_end_verdict(mine, records, want):
    """The end of the job compares final digests (docs/ARCHITECTURE.md, "The end of the job")."""
    assert end_verdict(0, 30, mine, {0: {"step": 30, "digest": mine}, **records}) == want
