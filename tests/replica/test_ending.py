"""The end of the job, pure (replica/catchup/ending.py): who waits for whom, and the comparison
of final digests."""
from __future__ import annotations

import pytest

from lightning_ft.replica.catchup import ending


def test_pending_waits_only_for_live_members_not_done_at_the_step():
    alive = {1: 0, 2: 3}
    assert ending.pending(30, [(1, 0), (2, None), (3, 0)], {1: 30}, alive) == [2]   # 3 is gone, 1 is done
    assert ending.pending(30, [(2, 2)], {}, alive) == []                             # another incarnation lives


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
    assert ending.end_verdict(0, 30, mine, {0: {"step": 30, "digest": mine}, **records}) == want
