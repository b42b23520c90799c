"""Rule 15 (coord/quorum.py): the optimizer steps of one batch under manual optimization with
several optimizers. Which round a replica may join, the round's optimizer, steady rounds."""
from __future__ import annotations

import dataclasses

import pytest

from lightning_ft.coord.quorum import LocalView, compute_quorum, phase_of, steady_next
from lightning_ft.coord.round_records import JobSpec, Quorum, Report

FP = {"job": "j", "replicas": 3, "nproc_per_replica": 1}
JOB = JobSpec(replicas=3, min_replicas=1, init_timeout_s=10.0, fingerprint=FP)


def rep(rid, step=4, round=5, opt=0, cont=False, made=(4, 0)):
    return Report(rid=rid, incarnation=0, step=step, round=round, fingerprint=FP, opt=opt, cont=cont, made=made,
                  cursor=10 + rid)


def decide(reports, previous=None):
    return compute_quorum(5, {r.rid: r for r in reports}, frozenset(), previous, JOB, 99.0)


# phase_of: (opt, cont) of each contributor -> (round's optimizer, continues, who sits out)
PHASES = [
    ({0: (0, False), 1: (0, False), 2: (0, False)}, (0, False, ())),       # one optimizer: nothing changes
    ({0: (1, True), 1: (1, True), 2: (1, True)}, (1, True, ())),           # the batch's second step
    ({0: (0, False), 1: (1, True), 2: (1, True)}, (1, True, (0,))),        # r0 restarted: sits the batch out
    ({0: (-1, False), 1: (1, True)}, (1, True, (0,))),                     # before its first batch, too
    ({0: (1, True), 1: (2, True)}, (1, True, (1,))),                       # disagreeing continuers: lowest id
    ({0: (-1, False), 1: (0, False), 2: (-1, False)}, (0, False, ())),     # unknown ones train the batch start
    ({0: (-1, False), 1: (-1, False)}, (-1, False, ())),                   # nobody knows yet
    ({0: (1, False), 1: (0, False)}, (1, False, (1,))),                    # another first optimizer sits out
    ({2: (0, False)}, (0, False, ())),
]


@pytest.mark.parametrize("phases,expected", PHASES)
def test_phase_of_table(phases, expected):
    assert phase_of(phases) == expected


def test_a_batch_start_nobody_named_steps_the_optimizer_batches_started_with():
    assert phase_of({0: (-1, False), 1: (-1, False)}, first=1) == (1, False, ())
    assert phase_of({0: (-1, False), 1: (0, False)}, first=1) == (0, False, ())  # a report wins
    assert phase_of({0: (1, True)}, first=0) == (1, True, ())


def test_rounds_carry_the_first_optimizer_so_a_lagging_replica_knows_the_step():
    start = decide([rep(0, opt=1), rep(1, opt=1), rep(2, opt=1)]).quorum  # d_opt (index 1) steps first
    assert (start.opt, start.first) == (1, 1)
    mid = decide([rep(0, opt=0, cont=True), rep(1, opt=0, cont=True)], previous=start).quorum
    assert (mid.opt, mid.cont, mid.first) == (0, True, 1)
    # replicas back from a restart, before their first batch, and one behind: it applies optimizer 1
    nxt = compute_quorum(6, {r.rid: r for r in [rep(0, step=6, round=6, opt=-1), rep(1, step=6, round=6, opt=-1),
                                              rep(2, step=5, round=6, opt=-1)]}, frozenset(), mid, JOB, 99.0).quorum
    assert (nxt.opt, nxt.cont, nxt.lagging) == (1, False, (2,))


def test_single_optimizer_reports_make_the_same_quorum_as_before():
    d = decide([rep(0), rep(1), rep(2)])
    q = d.quorum
    assert (q.opt, q.cont, q.contributors, q.lagging) == (0, False, (0, 1, 2), ())
    assert "sit out" not in d.reason


def test_a_replica_at_a_batch_boundary_sits_out_a_round_that_continues_the_batch():
    d = decide([rep(0, opt=0, cont=False), rep(1, opt=1, cont=True), rep(2, opt=1, cont=True)])
    q = d.quorum
    assert (q.opt, q.cont) == (1, True)
    assert q.contributors == (1, 2) and q.lagging == (0,)
    assert "r0 sit out optimizer 1's step continuing a batch (they are at a batch boundary)" in d.reason


def test_a_batch_start_round_names_the_first_known_optimizer():
    d = decide([rep(0, opt=-1), rep(1, opt=0), rep(2, opt=0)])
    q = d.quorum
    assert (q.opt, q.cont, q.contributors, q.lagging) == (0, False, (0, 1, 2), ())


def test_a_replica_behind_is_lagging_whatever_its_phase():
    d = decide([rep(0, step=2, opt=0, cont=True), rep(1, opt=1, cont=True), rep(2, opt=1, cont=True)])
    assert d.quorum.contributors == (1, 2) and d.quorum.lagging == (0,) and d.quorum.opt == 1


def test_when_every_continuer_died_the_survivors_start_the_next_batch():
    # The state is mid-batch, but nobody holds that batch's rest: the job goes on with a new batch.
    d = decide([rep(0, opt=0), rep(2, opt=0)])
    assert (d.quorum.opt, d.quorum.cont, d.quorum.contributors) == (0, False, (0, 2))


def test_quorum_and_report_carry_the_phase_through_json():
    q = decide([rep(0, opt=1, cont=True), rep(1, opt=1, cont=True)]).quorum
    assert Quorum.from_json(q.to_json()) == q
    r = rep(1, opt=1, cont=True)
    assert Report.from_json(r.to_json()) == r
    legacy = {k: v for k, v in dataclasses.asdict(q).items() if k not in ("opt", "cont")}
    import json

    assert (lambda x: (x.opt, x.cont))(Quorum.from_json(json.dumps(legacy).encode())) == (0, False)


def _settled(opt=0, cont=False):
    q = decide([rep(0, opt=opt, cont=cont), rep(1, opt=opt, cont=cont), rep(2, opt=opt, cont=cont)]).quorum
    assert not q.lagging
    return q


def view(opt=0, cont=False):
    return LocalView(committed=True, changed=False, digest_due=False, opt=opt, cont=cont)


# steady_next across the steps of a batch: (round's phase) -> (next phase) -> cursor advance
STEADY = [
    ((0, False), (0, False), 1),   # one optimizer: every round is a batch
    ((0, False), (1, True), 1),    # the batch's first step counted it; the next continues
    ((1, True), (0, False), 0),    # the continuing step counted nothing; the next starts a batch
    ((1, True), (2, True), 0),     # a third optimizer
]


@pytest.mark.parametrize("now,nxt,advance", STEADY)
def test_steady_rounds_advance_cursors_only_after_a_batch_start(now, nxt, advance):
    q = _settled(*now)
    n = steady_next(q, view(*nxt))
    assert n is not None and n.steady and n.max_step == q.max_step + 1
    assert (n.opt, n.cont) == nxt
    assert n.cursors == tuple(c + advance for c in q.cursors)


def test_steady_rounds_learn_the_first_optimizer_from_a_batch_start():
    q = dataclasses.replace(_settled(1, True), first=-1)
    start = steady_next(q, view(1, False))
    assert (start.opt, start.cont, start.first) == (1, False, 1)
    assert steady_next(start, view(0, True)).first == 1


def test_no_steady_round_for_a_replica_that_does_not_know_its_optimizer():
    assert steady_next(_settled(), view(-1, False)) is None
