"""`ReplicaState`'s transitions (replica/replica_state.py): pure, one value each."""
from __future__ import annotations

import dataclasses

import pytest

from lightning_ft.replica.replica_state import ReplicaState


def test_a_new_replica_is_at_step_zero_unsynced_and_reports_its_generation():
    s = ReplicaState()
    assert (s.step, s.gen, s.synced, s.disowned, s.made, s.cursor, s.batches) == (0, 0, False, False, (-1, -1), 0, 0)
    assert s.report() == {"gen": 0, "synced": False, "made": (-1, -1)}


@pytest.mark.parametrize("disowned", [False, True])
@pytest.mark.parametrize("trained", [False, True])
def test_a_commit_moves_to_the_next_step_in_the_rounds_generation(trained, disowned):
    s = ReplicaState(step=4, gen=1, synced=False, disowned=disowned, made=(2, 1), cursor=3, batches=4)
    t = s.committed(4, 2, (9, 3), trained=trained, new_batch=True, mine=None)
    assert (t.step, t.gen, t.synced, t.made, t.batches, t.cursor) == (5, 2, True, (9, 3), 5, 3)
    # a catch-up's state is the contributors': no longer disowned; training keeps what it was
    assert t.disowned is (disowned if trained else False)
    assert s.step == 4  # a value: the old one is untouched


@pytest.mark.parametrize(("cursor", "mine", "want"), [(3, None, 3), (3, 3, 4), (3, 7, 8), (9, 3, 9)])
def test_a_commit_moves_the_cursor_past_the_slot_batch_it_trained_for_us_never_back(cursor, mine, want):
    t = ReplicaState(cursor=cursor).committed(0, 0, (0, 0), trained=True, new_batch=True, mine=mine)
    assert t.cursor == want


def test_a_round_that_continues_a_batch_counts_a_step_but_no_batch():
    t = ReplicaState(step=2, batches=1).committed(2, 0, (5, 1), trained=True, new_batch=False, mine=None)
    assert (t.step, t.batches) == (3, 1)


def test_adopting_a_state_takes_the_rounds_step_generation_and_provenance_and_clears_disowned():
    s = ReplicaState(step=9, gen=0, disowned=True, cursor=5, batches=9)
    t = s.adopted(6, 3, (12, 4))
    assert (t.step, t.gen, t.synced, t.disowned, t.made, t.cursor, t.batches) == (6, 3, True, False, (12, 4), 5, 9)


def test_a_disowned_state_reports_no_generation_and_not_synced():
    s = ReplicaState(step=6, gen=2, synced=True).disown()
    assert s.disowned and s.report() == {"gen": -1, "synced": False, "made": (-1, -1)}
    assert s.adopted(6, 2, (1, 1)).report() == {"gen": 2, "synced": True, "made": (1, 1)}


def test_the_state_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ReplicaState().step = 1  # type: ignore[misc]
