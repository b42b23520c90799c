"""Loader-state files and their pure decisions (lightning_ft/replica/loader_state.py)."""
from __future__ import annotations

import itertools
import os

import pytest

from lightning_ft.replica.loader_state import (StateFile, StateFiles, StateWriter, file_name, next_position,
                                               parse_name, pick, to_prune)


def test_file_names_round_trip_and_foreign_names_are_ignored():
    for f in (StateFile(0), StateFile(17), StateFile(12, 100), StateFile(10**11, 5)):
        assert parse_name(file_name(f)) == f
    assert file_name(StateFile(3, 20)) == "c000000000003.step000000000020.pt"
    for name in (".tmp.abc", "c12.pt", "c000000000003.pt.tmp", "x000000000003.pt"):
        assert parse_name(name) is None


def test_pick_takes_the_newest_state_at_or_below_the_wanted_cursor():
    files = [StateFile(4), StateFile(8), StateFile(10, 10), StateFile(12)]
    assert pick(files, 12) == StateFile(12)
    assert pick(files, 11) == StateFile(10, 10)
    assert pick(files, 10) == StateFile(10, 10)
    assert pick(files, 9) == StateFile(8)
    assert pick(files, 3) is None
    assert pick([StateFile(10), StateFile(10, 10)], 10) == StateFile(10, 10)  # same cursor: either resumes there


def test_pick_is_the_maximum_below_for_every_set_of_cursors():
    for r in range(5):
        for cursors in itertools.combinations(range(6), r):
            files = [StateFile(c) for c in cursors]
            for want in range(7):
                below = [c for c in cursors if c <= want]
                got = pick(files, want)
                assert (got.cursor if got else None) == (max(below) if below else None)


def test_prune_keeps_the_newest_rolling_states_below_the_cursor_the_future_and_the_newest_pins():
    files = [StateFile(c) for c in range(1, 9)] + [StateFile(20), StateFile(5, 10), StateFile(7, 20),
                                                   StateFile(8, 30)]
    gone = set(to_prune(files, current=8, keep=3, pins=2))
    assert gone == {StateFile(c) for c in range(1, 6)} | {StateFile(5, 10)}
    # after a rewind to cursor 3, the states above it stay (a deterministic stream: still valid)
    gone = set(to_prune(files, current=3, keep=2, pins=5))
    assert gone == {StateFile(1)}


def test_next_position_continues_the_valid_chain_of_prefetched_batches():
    # nothing prefetched: the cursor; a valid chain: after it
    assert next_position(5, 1, []) == 5
    assert next_position(5, 1, [5]) == 6
    assert next_position(5, 1, [5, 6]) == 7
    # a rewind moved the cursor back below what was prefetched: restart at the cursor
    assert next_position(2, 1, [6, 7]) == 2
    # a catch-up moved it past: the stale ones are skipped, the stream continues at the cursor
    assert next_position(9, 1, [6, 7]) == 9
    # a chain valid at first, then broken: continue where it breaks
    assert next_position(5, 1, [5, 9]) == 6
    # accumulation (4 micro-batches per slot batch): positions k*4 + j, an open window counts
    assert next_position(3, 4, [], in_window=13) == 14
    assert next_position(3, 4, [14], in_window=13) == 15
    assert next_position(3, 4, [], in_window=11) == 12  # the window of slot batch 2 is closed (committed)
    assert next_position(3, 4, [15], in_window=13) == 14


def test_next_position_never_asks_for_a_batch_the_trainer_would_discard():
    # randomized: whatever was prefetched, the answer is >= the cursor's first position and
    # every prefetched position below it is exactly the contiguous chain from there
    import random

    rng = random.Random(3)
    for _ in range(2000):
        micro = rng.choice([1, 2, 4])
        cursor = rng.randrange(0, 6)
        pending = sorted(rng.sample(range(0, 30), rng.randrange(0, 4)))
        got = next_position(cursor, micro, pending)
        assert got >= cursor * micro
        chain = list(range(cursor * micro, got))
        assert pending[:len(chain)] == chain


def test_state_files_save_load_and_refuse_another_jobs_shape(tmp_path):
    sf = StateFiles(str(tmp_path), slot=1, rank=0, slots=3, world=2)
    sf.save(StateFile(4), {"pos": 16, "nested": {"a": [1, 2]}})
    sf.save(StateFile(10, 10), {"pos": 40})
    sf.save(StateFile(10), {"pos": 40})  # the same cursor, rolling and pinned
    assert sf.list() == [StateFile(4), StateFile(10), StateFile(10, 10)]
    assert sf.newest_at_most(9) == (StateFile(4), {"pos": 16, "nested": {"a": [1, 2]}})
    assert sf.newest_at_most(12) == (StateFile(10, 10), {"pos": 40})
    assert sf.newest_at_most(3) is None
    other = StateFiles(str(tmp_path), slot=1, rank=0, slots=4, world=2)  # same dir layout, another R
    with pytest.raises(ValueError, match="another shape"):
        other.load(StateFile(4))


def test_an_unreadable_state_falls_back_to_an_older_one(tmp_path):
    sf = StateFiles(str(tmp_path), slot=0, rank=0, slots=1, world=1)
    sf.save(StateFile(2), {"pos": 2})
    sf.save(StateFile(5), {"pos": 5})
    with open(os.path.join(sf.dir, file_name(StateFile(5))), "wb") as f:
        f.write(b"not a torch file")
    assert sf.newest_at_most(7) == (StateFile(2), {"pos": 2})


def test_writer_writes_every_pin_coalesces_rolling_states_and_prunes(tmp_path):
    sf = StateFiles(str(tmp_path), slot=0, rank=0, slots=1, world=1, keep=2, pins=2)
    w = StateWriter(sf)
    for c in range(1, 30):
        w.submit(StateFile(c, c if c % 10 == 0 else None), {"pos": c})
    assert w.flush(30)
    w.close()
    files = sf.list()
    assert [f for f in files if f.step is not None] == [StateFile(10, 10), StateFile(20, 20)]
    rolling = [f.cursor for f in files if f.step is None]
    assert rolling[-1] == 29 and len(rolling) <= 2
    assert sf.load(StateFile(29)) == {"pos": 29}
    assert w.errors == 0 and 3 <= w.written <= 29
