"""Policy "shrink" (coord/stragglers.py, quorum rule 14, replica/batch_policy.py), table-driven:
how much a straggler gives away, who may be shrunk, the split announced a round ahead and
applied in the next (full or steady), and the micro-batches dealt to the helpers."""
from __future__ import annotations

import itertools
import json

import pytest

from lightning_ft.coord import stragglers
from lightning_ft.coord.quorum import LocalView, steady_next
from lightning_ft.coord.round_records import JobSpec, Quorum, Report
from lightning_ft.coord.stragglers import SHRINK
from lightning_ft.replica.batch_policy import round_batches
from tests.coord.test_stragglers import FP, decide, prev

JOB_S = JobSpec(3, 1, 10.0, FP, straggler_threshold=1.3, straggler_policy=SHRINK)
SEEN = tuple((r, -1, -1) for r in range(3))
"""Every replica a suspect since round -1, so a flag by a measure of round >= 9 confirms it (window 10)."""


@pytest.mark.parametrize("n,ratio,helpers,g", [
    (4, 3.0, 2, 2),     # keeps 2 (6 units) while each helper trains 5: max 6 instead of 12
    (4, 1.3, 2, 1),     # 3.9 against 5, instead of 5.2
    (2, 1.3, 2, 0),     # giving one away makes a helper's round 3 > 2.6: no split
    (8, 3.0, 2, 5),     # max(9, 11) = 11 beats g=4's max(12, 10) = 12
    (4, 3.0, 1, 2),     # one helper: max(6, 6) = 6
    (4, 10.0, 2, 3),    # very slow: it keeps one micro-batch
    (1, 3.0, 2, 0),     # nothing to split
    (4, 3.0, 0, 0),     # nobody to take it
    (4, 1.0, 2, 0),     # not slower
])
def test_split_evens_the_stragglers_time_with_the_helpers(n, ratio, helpers, g):
    assert stragglers.split(n, ratio, helpers) == g
    if g:  # it is the best: no other g makes the round shorter
        cost = [max((n - x) * ratio, n + -(-x // helpers)) for x in range(n)]
        assert cost[g] == min(cost) and all(c > cost[g] for c in cost[:g])


@pytest.mark.parametrize("micro,want", [
    ({0: 4, 1: 4, 2: 4}, {0, 1, 2}),
    ({0: 4, 1: 0, 2: 0}, set()),          # nobody else can train its micro-batches
    ({0: 4, 1: 2, 2: 4}, {0, 2}),         # another split: it can neither give nor take
    ({0: 1, 1: 1, 2: 1}, set()),          # no accumulation: one micro-batch is not split
    ({}, set()),
])
def test_only_a_replica_that_splits_as_another_does_can_be_shrunk(micro, want):
    assert stragglers.splittable(micro) == want


ALL4 = {0: 4, 1: 4, 2: 4}


@pytest.mark.parametrize("flagged,suspects,before,micro,replicas,want", [
    ({2: 3.0}, ((2, 0, 9),), (), ALL4, 3, ((2, 2, 4),)),                 # confirmed: shrunk by its ratio
    ({2: 1.3}, ((2, 0, 9),), ((2, 2, 4),), ALL4, 3, ((2, 1, 4),)),       # a new flag moves g
    ({}, ((2, 0, 9),), ((2, 2, 4),), ALL4, 3, ((2, 2, 4),)),             # still a suspect: keeps its g
    ({}, (), ((2, 2, 4),), ALL4, 3, ()),                                 # cleared: whole again
    ({}, ((2, 0, 9),), ((2, 2, 4),), {0: 4, 1: 4, 2: 8}, 3, ()),         # its split changed: not kept
    ({1: 3.0, 2: 4.0}, ((1, 0, 9), (2, 0, 9)), (), ALL4, 3, ((2, 3, 4),)),  # one of three at most
    ({1: 3.0, 2: 4.0}, ((1, 0, 9), (2, 0, 9)), (), {r: 4 for r in range(5)}, 5,
     ((1, 3, 4), (2, 3, 4))),                                            # two of five
    ({2: 3.0}, ((2, 0, 9),), (), {0: 0, 1: 0, 2: 4}, 3, ()),             # no helper splits as it does
    ({2: 1.2}, ((2, 0, 9),), (), {0: 2, 1: 2, 2: 2}, 3, ()),             # a split would not help
])
def test_the_split_announced_for_the_next_rounds(flagged, suspects, before, micro, replicas, want):
    assert stragglers.shrink(flagged, suspects, before, micro, replicas) == want


def test_two_shrunk_of_three_would_leave_no_helper_so_one_is_not():
    # five replicas but only three present: the cap (2) allows two, the helpers do not
    micro = {0: 4, 1: 4, 2: 4}
    got = stragglers.shrink({1: 3.0, 2: 4.0}, ((1, 0, 9), (2, 0, 9)), (), micro, 5)
    assert [e[0] for e in got] == [1, 2] and stragglers.effective(got, (0, 1, 2)) == got
    assert stragglers.effective(((1, 2, 4), (2, 3, 4)), (1, 2)) == ()  # every contributor shrunk: none
    assert stragglers.effective(((1, 2, 4), (2, 3, 4)), (0, 2)) == ((2, 3, 4),)  # r1 does not train


def rep(rid, step, round, ms=-1.0, at=-1, micro=4):
    return Report(rid=rid, incarnation=0, step=step, round=round, fingerprint=FP, made=(round - 1, 0),
                  compute_ms=ms, compute_round=at, micro=micro)


def test_rule_14_shrink_announces_a_round_ahead_and_the_next_rounds_apply_it():
    p = prev((0, 1, 2), 50, 9, suspects=SEEN)
    d = decide(10, [rep(0, 50, 10, 10, 9), rep(1, 50, 10, 11, 9), rep(2, 50, 10, 30, 9)], p, JOB_S)
    q = d.quorum  # 30 / 10.5 = 2.86x: max(2 * 2.86, 4 + 1) is its best round
    assert q.members == q.contributors == (0, 1, 2) and q.slow == () and d.excluded_straggler is None
    assert list(d.stragglers) == [2] and q.shrink_next == ((2, 2, 4),) and q.shrunk == ()
    assert "shrink none (next: r2 2/4)" in d.reason
    q = Quorum.from_json(q.to_json())  # through the record
    assert q.shrink_next == ((2, 2, 4),)
    # the next full round applies it, and keeps announcing it while r2 stays a suspect
    p = Quorum(**{**q.__dict__, "round": 11, "max_step": 51})
    d = decide(12, [rep(0, 51, 12, 10, 11), rep(1, 51, 12, 11, 11), rep(2, 51, 12, -1, -1)], p, JOB_S)
    assert d.quorum.shrunk == ((2, 2, 4),) and d.quorum.shrink_next == ((2, 2, 4),)
    assert "shrink r2 trains 2 of 4 micro-batches" in d.reason
    # a steady round applies what its round announced
    s = steady_next(d.quorum, LocalView(committed=True, changed=False, digest_due=False))
    assert s is not None and s.shrunk == ((2, 2, 4),) and s.shrink_next == ((2, 2, 4),)
    # a round in which r2 lags (it catches up): nothing of its batch is dealt out
    p = Quorum(**{**d.quorum.__dict__, "round": 12, "max_step": 52})
    d = decide(13, [rep(0, 53, 13, 10, 12), rep(1, 53, 13, 11, 12), rep(2, 52, 13, 33, 12)], p, JOB_S)
    assert d.quorum.lagging == (2,) and d.quorum.shrunk == ()


def test_rule_14_shrink_excludes_a_straggler_that_cannot_split():
    p = prev((0, 1, 2), 50, 9, suspects=SEEN)
    reps = [rep(0, 50, 10, 10, 9, micro=1), rep(1, 50, 10, 11, 9, micro=1), rep(2, 50, 10, 33, 9, micro=1)]
    d = decide(10, reps, p, JOB_S)
    assert d.excluded_straggler is not None and d.excluded_straggler[0] == 2
    assert d.quorum.members == (0, 1) and d.quorum.shrink_next == ()


def test_rule_14_wait_and_exclude_announce_no_split():
    for policy in ("wait", "exclude"):
        job = JobSpec(3, 1, 10.0, FP, straggler_threshold=1.3, straggler_policy=policy)
        p = prev((0, 1, 2), 50, 9, suspects=SEEN, shrink_next=((2, 2, 4),))
        d = decide(10, [rep(0, 50, 10, 10, 9), rep(1, 50, 10, 11, 9), rep(2, 50, 10, 33, 9)], p, job)
        assert d.quorum.shrink_next == ()


def test_old_records_have_no_split():
    raw = json.loads(prev((0, 1), 5, 3).to_json())
    raw.pop("shrunk"), raw.pop("shrink_next")
    q = Quorum.from_json(json.dumps(raw).encode())
    assert q.shrunk == () and q.shrink_next == ()
    assert Report.from_json(json.dumps({"rid": 1, "incarnation": 0, "step": 3, "round": 4}).encode()).micro == 0


# -- the micro-batches of a shrunk round (replica/batch_policy.py) -------------------------------

def test_a_shrunk_slots_micro_batches_go_to_the_helpers_in_ring_order():
    rb = round_batches("shrink", (0, 1, 2), {0: 5, 1: 6, 2: 7}, 3, shrunk=((2, 2, 4),))
    assert rb.batches == {0: 5, 1: 6, 2: 7} and rb.divisor == 3 and rb.extra == {}
    assert rb.micro_of(0) == ((2, 7, 2),) and rb.micro_of(1) == ((2, 7, 3),) and rb.micro_of(2) == ()
    assert rb.skip_of(2) == (2, 3) and rb.skip_of(0) == ()
    # two shrunk: one round-robin over both
    rb = round_batches("shrink", (0, 1, 2, 3, 4), {r: 10 + r for r in range(5)}, 5, shrunk=((3, 1, 4), (4, 3, 4)))
    assert rb.micro == {0: ((3, 13, 3), (4, 14, 3)), 1: ((4, 14, 1),), 2: ((4, 14, 2),)}
    assert rb.skip == {3: (3,), 4: (1, 2, 3)}


def test_constant_deals_absent_slots_to_the_helpers_only():
    rb = round_batches("constant", (0, 2), {0: 5, 2: 7}, 3, slot_cursors=(5, 4, 7), shrunk=((2, 2, 4),))
    assert rb.batches == {0: 5, 1: 4, 2: 7} and rb.extra == {0: ((1, 4),)} and rb.divisor == 3
    assert rb.micro == {0: ((2, 7, 2), (2, 7, 3))}


@pytest.mark.parametrize("shrunk", [((3, 1, 4),), ((2, 0, 4),), ((2, 4, 4),), ((0, 1, 4), (2, 1, 4))])
def test_a_split_that_does_not_fit_the_round_is_refused(shrunk):
    with pytest.raises(ValueError, match="does not fit"):
        round_batches("shrink", (0, 2), {0: 5, 2: 7}, 3, shrunk=shrunk)


@pytest.mark.parametrize("n,g,helpers", list(itertools.product((2, 3, 4, 8), (1, 2, 3, 7), (1, 2, 3))))
def test_every_micro_batch_of_a_round_is_trained_once(n, g, helpers):
    if g >= n:
        return
    contributors = tuple(range(helpers + 1))
    rid = contributors[-1]
    cursors = {c: 100 + c for c in contributors}
    rb = round_batches("shrink", contributors, cursors, len(contributors), shrunk=((rid, g, n),))
    trained = [(c, cursors[c], j) for c in contributors for j in range(n) if j not in rb.skip_of(c)]
    trained += [m for c in contributors for m in rb.micro_of(c)]
    assert sorted(trained) == sorted((c, cursors[c], j) for c in contributors for j in range(n))
    loads = [len(rb.micro_of(c)) for c in contributors[:-1]]
    assert max(loads) - min(loads) <= 1


@pytest.mark.parametrize("done,skip,want", [
    ({0, 1}, (2, 3), (False, [])),            # as announced
    ({0, 1, 2, 3}, (), (False, [])),          # not shrunk
    ({0, 1}, (), (False, [2, 3])),            # the split ended: compute what it skipped
    ({0, 1}, (3,), (False, [2])),             # it gives fewer away
    ({0, 1, 2, 3}, (2, 3), (True, [0, 1])),   # newly shrunk while it computed all: start over
    ({0, 1, 2}, (1, 2, 3), (True, [0])),
])
def test_a_shrunk_replicas_own_micro_batches_after_the_plan(done, skip, want):
    from lightning_ft.replica.batch_policy import own_todo

    assert own_todo(done, 4, skip) == want
