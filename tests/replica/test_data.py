"""Exactly-once data: slot streams, monotonic cursors, the ledger check."""
from __future__ import annotations

import threading

import pytest

from lightning_ft.coord.store import MemoryStore
from lightning_ft.replica.data import (SlotSampler, SlotStream, advance_cursor, read_cursor, record_commit,
                                       verify_ledger, write_loader_state)

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


def test_sampler_reposition_stops_stale_iterators():
    s = SlotStream(64, 4, 2, shuffle=False)
    sampler = SlotSampler(s, slot=1, start=2)
    it = iter(sampler)
    assert next(it) == s.batch(1, 2)
    assert next(it) == s.batch(1, 3)  # prefetched one ahead
    sampler.seek(3)
    with pytest.raises(StopIteration):
        next(it)
    assert next(iter(sampler)) == s.batch(1, 3)


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
    assert verify_ledger(store, ROOT).conflicts[0].startswith("step 3: committers disagree")


def test_loader_state_is_written_atomically(tmp_path):
    path = tmp_path / "d" / "loader_state.json"
    write_loader_state(str(path), {1: 4, 0: 7})
    assert path.read_text() == '{"0": 7, "1": 4}'
    assert [p.name for p in path.parent.iterdir()] == ["loader_state.json"]
