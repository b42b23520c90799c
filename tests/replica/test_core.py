"""The step's protocol core (replica/core.py), as tables: a script of events in, the actions out.

Each row is one conversation of the core with its driver: the events the driver feeds it, the
actions the core answers with (the first is `start()`'s), and what the step did."""
from __future__ import annotations

from typing import Any

import pytest

from lightning_ft.coord.membership import JobFinished
from lightning_ft.coord.round_records import Quorum
from lightning_ft.replica.core import (Applied, Checked, Do, Done, Ended, Exchanged, FinalAdopted, Planned, Probed,
                                       Restored, StepCore, StepSpec, Synced, Voted, own_optimizer, plan_of)
from lightning_ft.replica.plan import FAILED, LOST, OK, ReplicaStateLost, StaleManualStep, StepPlan

D = Do


def plan(role: str = "train", batch: int = 5, step: int = 10, extra: tuple = (), micro: tuple = (),
         skip: tuple = (), opt: int = 0, cont: bool = False) -> StepPlan:
    q = Quorum(round=step, epoch=1, members=(0, 1), incarnations=(0, 0), max_step=step,
               contributors=(0, 1) if role == "train" else (0,), lagging=() if role == "train" else (1,), gen=0)
    return StepPlan(step=step, quorum=q, role=role, divisor=2, lr_factor=1.0, batch_index=batch,
                    batches={0: batch, 1: batch}, extra=extra, micro=micro, skip=skip, opt=opt, cont=cont)


TRAIN, CATCHUP, ADOPT, BENCH = plan(), plan("catchup"), plan("adopt"), plan("bench")
COMMIT = [Exchanged(OK), Checked(True), Voted(OK), Applied(6), Done()]
"""A train round's exchange through its commit (after the gradients are in)."""
COMMIT_ACTS = [D.CHECK, D.VOTE, D.APPLY, D.COMMITTED, D.DONE]
CATCH_UP = [Exchanged(OK), Voted(OK), Done(), Applied(5), Done()]
"""A catch-up round through its commit: zeros out, state in, clip, apply, books."""
CATCH_UP_ACTS = [D.VOTE, D.CLIP, D.APPLY, D.COMMITTED]


def talk(spec: StepSpec, events: list, cursor: int = 5, synced: bool = True) -> tuple[list[Do], StepCore]:
    core = StepCore(spec, cursor, synced)
    acts = [core.start().do]
    for ev in events:
        acts.append(core.on(ev).do)
    return acts, core


STEP = StepSpec(batch=5, recompute=True)
ROWS: list[tuple[str, StepSpec, list, list[Do], dict[str, Any]]] = [
    ("a clean train round", STEP,
     [Planned(TRAIN), Done(), *COMMIT],
     [D.ROUND, D.COMPUTE, D.EXCHANGE, *COMMIT_ACTS], dict(trained=True, committed=1, clean=True)),
    ("computed during the overlapped round: straight to the exchange",
     StepSpec(batch=5, computed=True, planned=True),
     [Planned(TRAIN), *COMMIT],
     [D.ROUND, D.EXCHANGE, *COMMIT_ACTS], dict(trained=True, clean=True)),
    ("the caller's check fails: retried with the saved gradients, no recomputation", STEP,
     [Planned(TRAIN), Done(), Exchanged(OK), Checked(False), Voted(FAILED), Done(), Done(), Restored(True),
      Planned(TRAIN), *COMMIT],
     [D.ROUND, D.COMPUTE, D.EXCHANGE, D.CHECK, D.VOTE, D.RETRY, D.RETRIED, D.RESTORE, D.ROUND, D.EXCHANGE,
      *COMMIT_ACTS], dict(trained=True, committed=1, clean=False)),
    ("an exchange fails and the gradients are gone: the next round recomputes", STEP,
     [Planned(TRAIN), Done(), Exchanged(FAILED), Voted(FAILED), Done(), Done(), Restored(False),
      Planned(TRAIN), Done(), *COMMIT],
     [D.ROUND, D.COMPUTE, D.EXCHANGE, D.VOTE, D.RETRY, D.RETRIED, D.RESTORE, D.ROUND, D.RECOMPUTE, D.EXCHANGE,
      *COMMIT_ACTS], dict(trained=True, clean=False)),
    ("a catch-up first, then our batch is still ours to train", STEP,
     [Planned(CATCHUP), *CATCH_UP, Planned(TRAIN), Done(), *COMMIT],
     [D.ROUND, D.EXCHANGE, *CATCH_UP_ACTS, D.ROUND, D.COMPUTE, D.EXCHANGE, *COMMIT_ACTS],
     dict(trained=True, caught_up=True, committed=2)),
    ("a catch-up moved our cursor past the batch: the job trained it", STEP,
     [Planned(CATCHUP), Exchanged(OK), Voted(OK), Done(), Applied(6), Done()],
     [D.ROUND, D.EXCHANGE, *CATCH_UP_ACTS, D.DONE], dict(trained=False, caught_up=True, committed=1)),
    ("computed during the round, then caught up: recompute on the new weights",
     StepSpec(batch=5, computed=True, planned=True),
     [Planned(CATCHUP), *CATCH_UP, Planned(TRAIN), Done(), *COMMIT],
     [D.ROUND, D.EXCHANGE, *CATCH_UP_ACTS, D.ROUND, D.RECOMPUTE, D.EXCHANGE, *COMMIT_ACTS],
     dict(trained=True, caught_up=True, clean=False)),
    ("a failed catch-up: behind until one commits (the cursor check waits)", STEP,
     [Planned(CATCHUP), Exchanged(FAILED), Voted(FAILED), Done(), Done(), Planned(CATCHUP), *CATCH_UP,
      Planned(TRAIN), Done(), *COMMIT],
     [D.ROUND, D.EXCHANGE, D.VOTE, D.RETRY, D.RETRIED, D.ROUND, D.EXCHANGE, *CATCH_UP_ACTS, D.ROUND, D.COMPUTE,
      D.EXCHANGE, *COMMIT_ACTS], dict(trained=True, caught_up=True, committed=2)),
    ("a sync round adopts the job's state, then we train", STEP,
     [Planned(ADOPT), Synced(True, 5), Planned(TRAIN), Done(), *COMMIT],
     [D.ROUND, D.SYNC, D.ROUND, D.COMPUTE, D.EXCHANGE, *COMMIT_ACTS], dict(trained=True, synced=True)),
    ("a rewind moved the cursor before our batch: stale, the loader re-positions", STEP,
     [Planned(plan(batch=3))],
     [D.ROUND, D.DONE], dict(stale=True, trained=False)),
    ("the round assigns absent slots' batches: computed after ours", StepSpec(batch=5, extras=True),
     [Planned(plan(extra=((2, 5),))), Done(), Done(), *COMMIT],
     [D.ROUND, D.COMPUTE, D.EXTRA, D.EXCHANGE, *COMMIT_ACTS], dict(trained=True)),
    ("a shrinkable caller checks its micro-batches against every plan",
     StepSpec(batch=5, extras=True, shrinkable=True, computed=True, planned=True),
     [Planned(plan(skip=(3,))), Done(), *COMMIT],
     [D.ROUND, D.EXTRA, D.EXCHANGE, *COMMIT_ACTS], dict(trained=True)),
    ("gradients holding another round's extras start over",
     StepSpec(batch=5, extras=True),
     [Planned(plan(extra=((2, 5),))), Done(), Done(), Exchanged(FAILED), Voted(FAILED), Done(), Done(),
      Restored(True), Planned(plan(extra=((2, 6),))), Done(), Done(), *COMMIT],
     [D.ROUND, D.COMPUTE, D.EXTRA, D.EXCHANGE, D.VOTE, D.RETRY, D.RETRIED, D.RESTORE, D.ROUND, D.RECOMPUTE,
      D.EXTRA, D.EXCHANGE, *COMMIT_ACTS], dict(trained=True)),
    ("several optimizers: a step that continues a batch ends at a catch-up",
     StepSpec(batch=None, computed=True, recompute=False, multi=True, cont=True),
     [Planned(CATCHUP), *CATCH_UP],
     [D.ROUND, D.EXCHANGE, *CATCH_UP_ACTS, D.DONE], dict(caught_up=True, trained=False)),
    ("several optimizers: a batch's first step on replaced weights is delivered again",
     StepSpec(batch=5, computed=True, recompute=False, multi=True, planned=True),
     [Planned(ADOPT), Synced(True, 5), Planned(TRAIN)],
     [D.ROUND, D.SYNC, D.ROUND, D.DONE], dict(stale=True, synced=True)),
    ("the job finished ahead of us: we take a finisher's final state", STEP,
     [Ended(JobFinished("done at 12")), FinalAdopted(True)],
     [D.ROUND, D.ADOPT_FINAL, D.DONE], dict(caught_up=True)),
    ("prepare: not synced, a sync round, then the job is not ahead", StepSpec(prepare=True),
     [Planned(ADOPT), Synced(True, 0), Probed(False)],
     [D.ROUND, D.SYNC, D.PROBE, D.DONE], dict(synced=True)),
    ("prepare: a restarted replica catches up, then keeps the first train round", StepSpec(prepare=True),
     [Probed(True), Planned(CATCHUP), *CATCH_UP, Probed(True), Planned(TRAIN)],
     [D.PROBE, D.ROUND, D.EXCHANGE, *CATCH_UP_ACTS, D.PROBE, D.ROUND, D.DONE], dict(caught_up=True, committed=1)),
    ("benched (a straggler): each probe recomputes the batch and commits nothing; back, it catches up", STEP,
     [Planned(BENCH), Done(), Planned(BENCH), Done(), Planned(CATCHUP), *CATCH_UP, Planned(TRAIN), Done(), *COMMIT],
     [D.ROUND, D.RECOMPUTE, D.ROUND, D.RECOMPUTE, D.ROUND, D.EXCHANGE, *CATCH_UP_ACTS, D.ROUND, D.RECOMPUTE,
      D.EXCHANGE, *COMMIT_ACTS], dict(trained=True, caught_up=True, committed=2, clean=False)),
    ("benched, back in a train round of its own (nobody trained meanwhile): the probe's gradients stand", STEP,
     [Planned(BENCH), Done(), Planned(TRAIN), *COMMIT],
     [D.ROUND, D.RECOMPUTE, D.ROUND, D.EXCHANGE, *COMMIT_ACTS], dict(trained=True, committed=1, clean=False)),
    ("benched, a caller that cannot compute again (manual optimization) only asks again",
     StepSpec(batch=5, computed=True, recompute=False, planned=True),
     [Planned(BENCH), Planned(BENCH), Planned(TRAIN), *COMMIT],
     [D.ROUND, D.ROUND, D.ROUND, D.EXCHANGE, *COMMIT_ACTS], dict(trained=True, clean=False)),
    ("prepare: a restarted replica benched has no batch to probe: it asks again", StepSpec(prepare=True),
     [Probed(True), Planned(BENCH), Planned(BENCH), Planned(CATCHUP), *CATCH_UP, Probed(False)],
     [D.PROBE, D.ROUND, D.ROUND, D.ROUND, D.EXCHANGE, *CATCH_UP_ACTS, D.PROBE, D.DONE], dict(caught_up=True)),
    ("prepare with several optimizers: rounds until one starts a batch with us",
     StepSpec(prepare=True, multi=True), [Planned(TRAIN)], [D.ROUND, D.DONE], dict()),
]


@pytest.mark.parametrize("name,spec,events,acts,want", ROWS, ids=[r[0] for r in ROWS])
def test_step_conversations(name: str, spec: StepSpec, events: list, acts: list[Do], want: dict) -> None:
    got, core = talk(spec, events, synced=not spec.prepare or "restarted" in name or "several" in name)
    assert got == acts, name
    for k, v in want.items():
        assert (core.clean if k == "clean" else getattr(core.result, k)) == v, (name, k)


def test_prepare_keeps_the_train_round_for_the_first_step() -> None:
    _, core = talk(StepSpec(prepare=True, multi=True), [Planned(TRAIN)])
    assert core.stash is TRAIN


def test_actions_carry_what_the_driver_needs() -> None:
    core = StepCore(StepSpec(batch=5, computed=True, recompute=False, planned=True), 5, True)
    core.start()
    ex = core.on(Planned(TRAIN))
    assert ex.do is D.EXCHANGE and ex.save_grads  # manual optimization keeps a copy for a retry
    core = StepCore(STEP, 5, True)
    core.start()
    core.on(Planned(TRAIN))
    assert core.on(Done()).save_grads is False  # it can recompute: no copy
    core = StepCore(STEP, 5, True)
    core.start()
    assert core.on(Planned(ADOPT)).disarm  # a sync round replaces the weights the hooks would send
    core = StepCore(STEP, 5, True)
    core.start()
    core.on(Planned(TRAIN))
    core.on(Done())
    assert core.on(Exchanged(OK)).plan is TRAIN and core.on(Checked(False)).vote == FAILED


@pytest.mark.parametrize("spec,events,error", [
    (StepSpec(batch=5, computed=True, recompute=False, planned=True),
     [Planned(CATCHUP), *CATCH_UP, Planned(TRAIN)], StaleManualStep),
    (STEP, [Planned(plan(batch=7))], RuntimeError),  # the loader and the quorum disagree
    (STEP, [Planned(plan(extra=((2, 5),))), Done()], RuntimeError),  # extras the caller cannot train
    (STEP, [Planned(CATCHUP), Exchanged(LOST), Voted(LOST)], ReplicaStateLost),
    (STEP, [Ended(JobFinished("done")), FinalAdopted(False)], JobFinished),
    (StepSpec(prepare=True), [Ended(JobFinished("done"))], JobFinished),
])
def test_what_ends_a_step_with_an_error(spec: StepSpec, events: list, error: type) -> None:
    with pytest.raises(error):
        talk(spec, events)


def test_the_errors_name_the_replica() -> None:
    with pytest.raises(RuntimeError, match="replica 3: the quorum assigns slot batch 7 but the loader delivered"):
        talk(StepSpec(batch=5, rid=3), [Planned(plan(batch=7))])


def q(**kw: Any) -> Quorum:
    base: dict[str, Any] = dict(round=4, epoch=1, members=(0, 1, 2), incarnations=(0, 0, 0), max_step=9,
                                contributors=(0, 1), lagging=(2,), gen=0, cursors=(7, 7, 3))
    return Quorum(**{**base, **kw})


def test_plan_of_a_train_round_under_each_batch_policy() -> None:
    p = plan_of(q(), 0, "train", 7, "shrink", "sqrt", 3)
    assert (p.step, p.role, p.divisor, p.batch_index) == (9, "train", 2, 7)
    assert p.lr_factor == pytest.approx((2 / 3) ** 0.5) and p.extra == ()
    lag = plan_of(q(), 2, "catchup", 3, "shrink", "sqrt", 3)
    assert lag.lagging and lag.extra == () and lag.micro == ()
    const = plan_of(q(slot_cursors=(7, 7, 3)), 0, "train", 7, "constant", "sqrt", 3)
    assert const.divisor == 3 and const.lr_factor == 1.0 and const.extra == ((2, 3),)  # r0 trains absent slot 2


def test_own_optimizer_takes_an_unnamed_round_and_refuses_another() -> None:
    p = plan(opt=-1)
    assert own_optimizer(p, 1, 0).opt == 1
    assert own_optimizer(plan(opt=1), 1, 0).opt == 1
    with pytest.raises(RuntimeError, match="steps optimizer 0 but this replica's training_step stepped optimizer 1"):
        own_optimizer(plan(opt=0), 1, 0)
