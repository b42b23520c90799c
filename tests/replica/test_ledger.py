"""Exactly-once data: slot streams, monotonic cursors, the ledger check."""
from __future__ import annotations

import threading

import pytest

from lightning_ft.coord.store import MemoryStore
from lightning_ft.replica.ledger import (SlotStream, advance_cursor, cursors_at, read_cursor, read_cursors,
                                       record_commit, recorded, seed_generation, verify_ledger)

ROOT = "/lft/j/"


def test_slots_split_the_global_order_round_robin_without_overlap():
    s = SlotStream(num_samples=120, batch_size=4, slots=3, seed=1)
    seen = []
    for k in range(10):  # 30 global batches = exactly one epoch
        for slot in range(3):
            assert s.batch(slot, k) == s.global_batch(k * 3 + slot)
            seen += s.batch(slot, k)
    assert sorted(seen) == list(range(120))
    assert s.batch(0, 10) != s.batch(0, 0)  # the next epoch reshuffles
    with pytest.raises(ValueError, match="slot 3 out of range"):
        s.batch(3, 0)


def test_cursor_advances_monotonically_under_races():
    store = MemoryStore()
    ts = [threading.Thread(target=advance_cursor, args=(store, ROOT, 0, v)) for v in [5, 3, 9, 7, 9, 1]]
    [t.start() for t in ts]
    [t.join(5) for t in ts]
    assert read_cursor(store, ROOT, 0) == 9
    assert advance_cursor(store, ROOT, 0, 4) == 9


def test_ledger_accepts_an_exact_partition_and_names_duplicates_and_gaps():
    store = MemoryStore()
    record_commit(store, ROOT, 0, 0, 0, 0, {0: 0, 1: 0, 2: 0})
    record_commit(store, ROOT, 0, 1, 0, 0, {0: 0, 1: 0, 2: 0})  # a second committer, same step
    record_commit(store, ROOT, 1, 0, 1, 1, {0: 1, 2: 1})        # replica 1 away
    record_commit(store, ROOT, 2, 0, 2, 2, {0: 2, 1: 1, 2: 2})  # it is back at its cursor
    assert read_cursor(store, ROOT, 1) == 2
    rep = verify_ledger(store, ROOT, {0: 3, 1: 2, 2: 3})
    assert rep.ok and rep.steps == 3 and rep.trained[1] == [0, 1]

    record_commit(store, ROOT, 3, 0, 2, 3, {0: 2, 1: 3, 2: 3})  # slot 0 batch 2 again; slot 1 skipped 2
    rep = verify_ledger(store, ROOT)
    assert rep.duplicates == [(0, 2)] and rep.gaps == [(1, 2)]
    record_commit(store, ROOT, 3, 1, 2, 3, {0: 3, 1: 2, 2: 3})
    assert verify_ledger(store, ROOT).conflicts[0].startswith("generation 0 step 3: committers disagree")


def _train(store, gen, steps, slots, start=None, rid=0):
    """Commit `steps` (step -> batch of every slot) in generation `gen`."""
    for step, k in steps.items():
        record_commit(store, ROOT, step, rid, 0, step, {s: k for s in slots}, gen=gen)


def test_a_rewind_supersedes_later_commits_and_the_history_stays_exact():
    store = MemoryStore()
    _train(store, 0, {n: n for n in range(10)}, (0, 1))          # steps 0..9 trained batches 0..9
    assert cursors_at(store, ROOT, 6, (0, 1)) == {0: 6, 1: 6}
    seed_generation(store, ROOT, 1, 6, cursors_at(store, ROOT, 6, (0, 1)), **{"from": 10})
    assert read_cursors(store, ROOT, (0, 1)) == {0: 6, 1: 6}     # the newest generation's cursors
    _train(store, 1, {n: n for n in range(6, 12)}, (0, 1))       # batches 6..11 again, once each in the end
    rep = verify_ledger(store, ROOT)
    assert rep.ok, (rep.duplicates, rep.gaps, rep.conflicts)
    assert rep.steps == 12 and rep.superseded == 4 and rep.trained[0] == list(range(12))
    assert rep.rewinds == [{"from": 10, "to": 6, "cursors": {"0": 6, "1": 6}, "gen": 1}]


def test_a_rewind_with_the_wrong_cursors_is_caught():
    store = MemoryStore()
    _train(store, 0, {n: n for n in range(10)}, (0,))
    seed_generation(store, ROOT, 1, 6, {0: 4})  # would train batches 4 and 5 twice
    _train(store, 1, {n: n - 2 for n in range(6, 9)}, (0,))
    assert verify_ledger(store, ROOT).duplicates == [(0, 4), (0, 5)]
    store2 = MemoryStore()
    _train(store2, 0, {n: n for n in range(10)}, (0,))
    seed_generation(store2, ROOT, 1, 6, {0: 8})  # would skip batches 6 and 7
    _train(store2, 1, {n: n + 2 for n in range(6, 9)}, (0,))
    assert verify_ledger(store2, ROOT).gaps == [(0, 6), (0, 7)]


def test_an_abandoned_rewind_to_a_later_step_is_itself_superseded():
    store = MemoryStore()
    _train(store, 0, {n: n for n in range(10)}, (0,))
    seed_generation(store, ROOT, 1, 8, {0: 8})          # rewind to a live state at 8 ...
    _train(store, 1, {8: 8}, (0,))                      # ... one step, then everyone died again
    seed_generation(store, ROOT, 2, 5, {0: 5})          # rewind to the checkpoint at 5
    _train(store, 2, {n: n for n in range(5, 11)}, (0,))
    rep = verify_ledger(store, ROOT)
    assert rep.ok and rep.trained[0] == list(range(11)) and rep.superseded == 6


def test_resume_base_counts_from_the_checkpoint_cursors():
    store = MemoryStore()
    seed_generation(store, ROOT, 0, 20, {0: 20, 1: 19})
    _train(store, 0, {20: 20}, (0,))
    record_commit(store, ROOT, 21, 0, 0, 21, {0: 21, 1: 19})
    rep = verify_ledger(store, ROOT)
    assert rep.ok and rep.trained == {0: [20, 21], 1: [19]}
    assert read_cursors(store, ROOT, (0, 1)) == {0: 22, 1: 20}


def test_fenced_record_is_refused_after_eviction():
    store = MemoryStore()
    store.put(ROOT + "members/0", b"r")
    fence = {ROOT + "members/0": store.get(ROOT + "members/0").create_revision, ROOT + "evict/0/0": 0}
    assert record_commit(store, ROOT, 0, 0, 0, 0, {0: 0}, fence=fence)
    store.put(ROOT + "evict/0/0", b"dead")
    assert not record_commit(store, ROOT, 1, 0, 0, 1, {0: 1}, fence=fence)
    assert read_cursor(store, ROOT, 0) == 1 and not recorded(store, ROOT, 0, 1) and recorded(store, ROOT, 0, 0)


def test_batched_records_are_fenced_together_and_advance_each_cursor_once():
    from lightning_ft.replica.ledger import record_commits

    store = MemoryStore()
    store.put(ROOT + "members/1", b"r")
    fence = {ROOT + "members/1": store.get(ROOT + "members/1").create_revision}
    recs = [(n, 0, n, 0, {0: n, 1: n + 3}) for n in range(5)]  # steady rounds: every slot trains each step
    assert record_commits(store, ROOT, 1, recs, fence)
    assert read_cursors(store, ROOT, (0, 1)) == {0: 5, 1: 8}
    rep = verify_ledger(store, ROOT)
    assert rep.steps == 5 and rep.trained[0] == [0, 1, 2, 3, 4]
    store.delete(ROOT + "members/1")
    assert not record_commits(store, ROOT, 1, [(5, 0, 5, 0, {0: 5}), (6, 0, 6, 0, {0: 6})], fence)
    assert read_cursors(store, ROOT, (0,)) == {0: 5} and not recorded(store, ROOT, 0, 5)


def test_a_resume_publishes_its_checkpoint_as_the_new_generations_base(tmp_path):
    """`--resume` (restart_job) starts a generation at the checkpoint and publishes it, so a
    rewind before the next checkpoint can find it (a fresh keyspace had no record of it)."""
    import json as _json

    from lightning_ft.coord import keys
    from lightning_ft.replica.checkpoint import restart_job

    ckpt = tmp_path / "step_00000040"
    ckpt.mkdir()
    (ckpt / "meta.json").write_text(_json.dumps({"step": 40, "cursors": {"0": 40, "1": 40}}))
    store = MemoryStore()
    rec = restart_job(store, ROOT, str(ckpt))
    assert rec["gen"] == 0 and rec["to"] == 40
    assert _json.loads(store.get(keys.ckpt(ROOT, 40)).value)["path"] == str(ckpt)
    assert read_cursors(store, ROOT, (0, 1)) == {0: 40, 1: 40}
