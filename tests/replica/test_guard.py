"""The divergence guard's comparison on a steady round's ring (replica/guard.py), as tables: what
each member adds to the all-reduce, and what every member reads from the sums."""
from __future__ import annotations

import pytest

from lightning_ft.coord.round_records import Quorum
from lightning_ft.replica.group import ReplicaGroup
from lightning_ft.replica.guard import RING_LEN, Digests


def _quorum(round: int = 11, max_step: int = 10, members: tuple[int, ...] = (0, 1, 2), steady: bool = True) -> Quorum:
    return Quorum(round=round, epoch=0, members=members, incarnations=tuple(0 for _ in members),
                  max_step=max_step, contributors=members, lagging=(), steady=steady)


def _digests(every: int = 10) -> Digests:
    return Digests(every, 100, ReplicaGroup(0, 1, None))


def _holding(d: Digests, step: int, value: int) -> Digests:
    d._mine = (step, value)  # this rank's digest of `step` (what `take` computes from the tensors)
    d.for_report(step)
    return d


def _sums(*vectors: list[float]) -> list[float]:
    return [sum(col) for col in zip(*vectors, strict=True)]


@pytest.mark.parametrize("steady,max_step,due", [
    (True, 10, True),     # a steady round from a digest step compares on the ring
    (True, 100, True),    # a checkpoint step is a digest step
    (True, 11, False),    # not a digest step
    (False, 10, False),   # a full round compares the reports in etcd (quorum rule 9)
])
def test_which_rounds_compare_on_the_ring(steady, max_step, due):
    assert _digests().ring_due(_quorum(max_step=max_step, steady=steady)) is due


def test_a_forced_digest_never_changes_which_rounds_use_the_ring():
    # every member must issue the same all-reduces: the schedule decides, not a member's own state
    d = _digests()
    d.forced = 11
    assert d.due(11) and not d.ring_due(_quorum(max_step=11))


@pytest.mark.parametrize("values,agreed", [
    ((7, 7, 7), True),
    ((7, 7, 8), False),
    ((1, 2, 3), False),          # the mean equals one member's digest: still a disagreement
    ((5, 5, None), False),       # a member without a digest of the step
    ((None, None, None), False),  # nobody has one: nothing verified
])
def test_the_verdict_every_member_reads_from_the_sums(values, agreed):
    q = _quorum()
    members = [_holding(_digests(), 10, v) if v is not None else _digests() for v in values]
    vectors = [m.ring_vector(q) for m in members]
    assert all(len(v) == RING_LEN for v in vectors)
    sums = _sums(*vectors)
    verdicts = [m.ring_verdict(q, sums) for m in members]
    assert verdicts == [agreed] * 3  # the same on every member
    for m in members:
        assert m.after(q) == ((False, 10) if agreed else (True, -1))
        assert m.due(11) is (not agreed)  # a disagreement: every member digests the next version


def test_digests_that_differ_in_every_hex_digit_are_told_apart():
    q = _quorum(members=(0, 1))
    a, b = _holding(_digests(), 10, 0), _holding(_digests(), 10, 2 ** 64 - 1)
    assert a.last != b.last
    sums = _sums(a.ring_vector(q), b.ring_vector(q))
    assert not a.ring_verdict(q, sums)


def test_the_verdict_speaks_only_for_its_round():
    q = _quorum(round=11)
    d = _holding(_digests(), 10, 3)
    d.ring_verdict(q, _sums(d.ring_vector(q), d.ring_vector(q), d.ring_vector(q)))
    assert d.after(q) == (False, 10)
    assert d.after(_quorum(round=12, max_step=11)) == (False, -1)


def test_the_sums_stay_exact_in_float32_for_many_replicas():
    import torch

    n = 70_000
    q = _quorum(members=tuple(range(n)))
    v = _holding(_digests(), 10, 2 ** 64 - 1).ring_vector(q)
    sums = (torch.tensor(v, dtype=torch.float32) * n).tolist()
    assert _digests().ring_verdict(q, sums)
