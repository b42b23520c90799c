"""The step's protocol core: every decision one optimizer step makes, with no I/O, no thread and
no clock (docs/ARCHITECTURE.md, "A step").

One step of one replica rank is a conversation in the manner of etcd raft's `RawNode`: the
driver (replica/replica.py) feeds the core what happened, an *event*, and reads back what to
do next, an *action*. Some actions are the replica's own I/O (obtain a round, take part in a
sync round, exchange, vote, apply the optimizer step); the others are the caller's work
(compute, recompute, train extra micro-batches, check or clip the averaged gradients, keep
its books after a commit), which the driver hands to the caller as an `Ask`.

    core = StepCore(spec, cursor, synced)
    act = core.start()
    while act.do is not Do.DONE:
        act = core.on(perform(act))          # perform: the replica's I/O, or the caller's work
    core.result                              # what the step did

The rounds of one step (`prepare` is the same conversation with no batch: it ends at the
first train round, which it keeps for the first step):

- train:    compute (or recompute, when a sync or catch-up replaced the weights the gradients
            were computed on), train what the round adds (`plan.extras`), exchange, check, vote,
            apply; a failed vote retries the step in a new round, with the saved gradients or by
            recomputing;
- catchup:  exchange zeros and fetch the contributors' state meanwhile, vote, clip, apply; then
            the step's own batch is trained in a later round (or was trained by the job);
- sync:     take part in a sync round (the job's start, a resume, a rewind);
- bench:    a straggler benched by quorum rule 14 (not a member): recompute the batch to
            measure its pace (the probe), commit nothing, ask for a round again; a caller that
            cannot recompute, or `prepare`, only asks again;
- the job finished ahead of us: fetch a finisher's final state, or leave.

`own_optimizer` and `plan_of` are the pure parts of building a round's plan from its quorum.
tests/replica/test_core.py has the tables.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Optional, Union

from lightning_ft.constants import Role
from lightning_ft.coord.membership import JobFinished
from lightning_ft.coord.round_records import Quorum
from lightning_ft.replica.batch_policy import round_batches
from lightning_ft.replica.plan import (FAILED, LOST, OK, ReplicaStateLost, StaleManualStep, StepPlan, StepResult,
                                       lr_factor)


class Do(StrEnum):
    """What the core asks for next."""

    # the replica's own I/O
    ROUND = "round"
    """Obtain the next round's plan (the one started early first): report, quorum, ring."""
    PROBE = "probe"
    """`prepare`: whether the job's history is ahead of this replica (`Probed`)."""
    SYNC = "sync"
    """Take part in a sync round: publish as its source, or adopt the source's state."""
    EXCHANGE = "exchange"
    """Average gradients through FTAR (lagging: send zeros, fetch the state meanwhile); this
    rank's vote."""
    VOTE = "vote"
    """The replica's vote: MIN over its ranks."""
    RETRY = "retry"
    """A failed vote's books: zero the gradients, reset the loss scale, rebuild the ring."""
    RESTORE = "restore"
    """Put back the local gradients saved before the exchange (`Restored`)."""
    APPLY = "apply"
    """The optimizer step with the plan's LR factor; the replica's state advances (`Applied`)."""
    ADOPT_FINAL = "adopt_final"
    """The job finished at a later step: fetch a finisher's final state (`FinalAdopted`)."""
    # the caller's work (an `Ask`)
    COMPUTE = "compute"
    """Forward and backward of the slot batch (all micro-batches but `plan.skip`)."""
    RECOMPUTE = "recompute"
    """Zero the gradients and compute again: the weights they were computed on were replaced."""
    EXTRA = "extra"
    """Add what the round trains besides the slot batch (`plan.extra`, `plan.micro`) and make the
    own micro-batches those the round decided (`plan.skip`)."""
    CHECK = "check"
    """Hooks and clipping on the averaged gradients; the caller may veto (`Checked(False)`)."""
    CLIP = "clip"
    """A catch-up's optimizer step: clip the averaged gradients as the contributors did."""
    COMMITTED = "committed"
    """A step committed: the caller's books (schedulers, loaders, logs)."""
    RETRIED = "retried"
    """A round failed to commit and the step is retried (the caller may log it)."""
    # the end
    DONE = "done"


CALLER = frozenset({Do.COMPUTE, Do.RECOMPUTE, Do.EXTRA, Do.CHECK, Do.CLIP, Do.COMMITTED, Do.RETRIED})
"""The actions that are the caller's work: the driver hands them to the caller."""


@dataclass(frozen=True)
class Action:
    do: Do
    plan: Optional[StepPlan] = None
    disarm: bool = False
    """Drop the armed gradient hooks first: the coming backward is not this round's exchange."""
    vote: int = OK
    """VOTE: this rank's vote."""
    save_grads: bool = False
    """EXCHANGE: keep a copy of the local gradients for a retry without recomputation."""


# -- events: what happened ------------------------------------------------------------------------
@dataclass(frozen=True)
class Planned:
    plan: StepPlan


@dataclass(frozen=True)
class Ended:
    """ROUND: the job finished at a later step than ours."""

    error: JobFinished


@dataclass(frozen=True)
class Probed:
    behind: bool


@dataclass(frozen=True)
class Synced:
    ok: bool
    cursor: int


@dataclass(frozen=True)
class Exchanged:
    vote: int


@dataclass(frozen=True)
class Checked:
    ok: bool


@dataclass(frozen=True)
class Voted:
    result: int


@dataclass(frozen=True)
class Restored:
    ok: bool


@dataclass(frozen=True)
class Applied:
    cursor: int


@dataclass(frozen=True)
class FinalAdopted:
    ok: bool


@dataclass(frozen=True)
class Done:
    """The caller's work (or a bookkeeping action) is done."""


Event = Union[Planned, Ended, Probed, Synced, Exchanged, Checked, Voted, Restored, Applied, FinalAdopted, Done]


@dataclass(frozen=True)
class StepSpec:
    """What the caller brings to one step."""

    batch: Optional[int] = None
    """The slot batch its loader delivered (None: whatever the plan assigns). If the job already
    trained it (a catch-up moved the cursor past it) the step ends untrained; if a rewind moved
    the cursor before it, the step ends `stale`."""
    computed: bool = False
    """The caller computed the gradients already (before the round's plan arrived)."""
    recompute: bool = True
    """The caller can redo its forward/backward (automatic optimization); manual optimization
    cannot, and a step whose weights were replaced under its gradients ends the replica."""
    extras: bool = False
    """The caller trains micro-batches of any slot (`Do.EXTRA`): batch_policy "constant" and the
    stragglers policy "shrink" need it."""
    shrinkable: bool = False
    """The caller may give away micro-batches of its own slot batch (it reported `micro`): its
    gradients are checked against every plan."""
    multi: bool = False
    """Several optimizers (quorum rule 15): a step is one of them."""
    cont: bool = False
    """Several optimizers: this step continues a batch whose first step committed."""
    planned: bool = False
    """A round was started before the step (overlap, or the round `prepare` kept)."""
    prepare: bool = False
    """`prepare`: rounds until this replica holds the job's state; no batch is trained."""
    rid: int = -1
    """The replica (for errors)."""


@dataclass
class StepCore:
    """One step's decisions; see the module docstring."""

    spec: StepSpec
    cursor: int
    """The next batch of this replica's slot (the driver reports it after each state change)."""
    synced: bool
    """The replica's state comes from the job's history (`prepare` rounds until it does)."""
    result: StepResult = field(default_factory=StepResult)
    computed: bool = False
    replaced: bool = False
    """A sync or catch-up replaced the weights since the gradients were computed."""
    behind: bool = False
    """A catch-up or sync round failed: this replica is behind the job until one commits."""
    in_grads: Optional[tuple] = ()
    """What the local gradients hold besides the own slot batch (`StepPlan.extras`); None: not
    checked against a plan yet (a shrinkable caller decided what to skip before the plan)."""
    clean: bool = True
    """The step trained in its first round, with no retry, catch-up or recomputation: its time
    is compute time (the straggler measure)."""
    stash: Optional[StepPlan] = None
    """`prepare`: the train round it obtained, for the first step."""
    plan: Optional[StepPlan] = None
    _first: bool = False
    _error: Optional[JobFinished] = None
    _last: Do = Do.DONE

    def __post_init__(self) -> None:
        self.computed = self.spec.computed
        self._fresh: Optional[tuple] = None if self.spec.shrinkable and self.spec.extras else ()
        self.in_grads = self._fresh
        self._first = self.spec.planned

    @property
    def can_recompute(self) -> bool:
        return self.spec.recompute or not self.spec.computed

    # -- the conversation -----------------------------------------------------------------------
    def start(self) -> Action:
        """The first action of the step."""
        return self._remember(self._prepare_next() if self.spec.prepare else self._next_round())

    def on(self, ev: Event) -> Action:
        """The next action after `ev`, which answers the last action."""
        return self._remember(self._on(ev))

    def _remember(self, act: Action) -> Action:
        self._last = act.do
        return act

    def _on(self, ev: Event) -> Action:
        plan = self.plan
        if isinstance(ev, Planned):
            self._first = False
            return self._dispatch(ev.plan)
        if isinstance(ev, Ended):
            if self.spec.prepare:
                raise ev.error  # it finished while this replica was starting: nothing to train
            self._error = ev.error
            return Action(Do.ADOPT_FINAL, disarm=True)
        if isinstance(ev, FinalAdopted):
            if not ev.ok:
                assert self._error is not None  # ADOPT_FINAL answers Ended
                raise self._error
            self.result.caught_up = True
            return Action(Do.DONE)
        if isinstance(ev, Probed):
            return Action(Do.ROUND) if ev.behind else Action(Do.DONE)
        assert plan is not None, f"{ev} before any round"
        if isinstance(ev, Synced):
            self.cursor = ev.cursor
            self.result.synced |= ev.ok
            self.replaced |= ev.ok
            self.synced |= ev.ok
            self.behind = not ev.ok
            return self._after_state_replaced(ev.ok)
        if isinstance(ev, Exchanged):
            if ev.vote == OK and plan.contribute:
                return Action(Do.CHECK, plan)
            return Action(Do.VOTE, plan, vote=ev.vote)
        if isinstance(ev, Checked):
            return Action(Do.VOTE, plan, vote=OK if ev.ok else FAILED)
        if isinstance(ev, Voted):
            return self._voted(plan, ev.result)
        if isinstance(ev, Restored):
            if not ev.ok:
                self.replaced = True  # the gradients are gone (zeroed): recompute them next round
            return self._next_round()
        if isinstance(ev, Applied):
            self.cursor = ev.cursor
            self.synced = True
            return Action(Do.COMMITTED, plan)
        assert isinstance(ev, Done)
        return self._after_done(plan)

    # -- transitions ----------------------------------------------------------------------------
    def _prepare_next(self) -> Action:
        """`prepare`: another round while several optimizers (until a round starts a batch with
        us) or not synced; else ask whether the job is ahead of us."""
        if self.spec.multi or not self.synced:
            return Action(Do.ROUND)
        return Action(Do.PROBE)

    def _next_round(self) -> Action:
        if self.spec.prepare:
            return self._prepare_next()
        b = self.spec.batch
        if not self._first and b is not None and self.cursor > b and not self.behind:
            return Action(Do.DONE)  # the job trained our batch (a catch-up moved our cursor past it)
        return Action(Do.ROUND)

    def _dispatch(self, plan: StepPlan) -> Action:
        self.plan = plan
        if plan.role == Role.BENCH:  # a benched straggler (quorum rule 14): measure our pace, commit nothing
            self.clean = False
            if self.spec.prepare or not self.can_recompute:
                return Action(Do.ROUND, disarm=True)  # no batch to compute (or it cannot be redone): wait
            return Action(Do.RECOMPUTE, plan, disarm=True)
        if plan.sync:
            return Action(Do.SYNC, plan, disarm=True)
        if plan.role == "catchup":
            return Action(Do.EXCHANGE, plan)
        if self.spec.prepare:
            self.stash = plan  # the first step trains it
            return Action(Do.DONE)
        b = self.spec.batch
        if b is not None and plan.batch_index != b:
            if plan.batch_index < b:
                self.result.stale = True  # a rewind moved our cursor back: the caller re-positions
                return Action(Do.DONE, disarm=True)
            raise RuntimeError(f"replica {self.spec.rid}: the quorum assigns slot batch {plan.batch_index} but the "
                               f"loader delivered batch {b}")
        if self.computed and self.in_grads and self.in_grads != plan.extras:
            self.replaced = True  # they hold another round's extra batches: start over
        if self.computed and self.replaced:
            self.clean = False
            if self.spec.multi:
                # Several optimizers (rule 15): the rest of a batch is the job's, trained without us;
                # a batch's first step computed on replaced weights is delivered again (`stale`).
                self.result.stale = not self.spec.cont
                return Action(Do.DONE, disarm=True)
            if not self.can_recompute:
                raise StaleManualStep(f"replica {self.spec.rid} fell behind with a half-trained manual-optimization "
                                      "step; exiting so that the launcher restarts it and it catches up first")
            self.replaced, self.in_grads = False, self._fresh
            return Action(Do.RECOMPUTE, plan, disarm=True)
        if not self.computed:
            self.computed, self.replaced, self.in_grads = True, False, self._fresh
            return Action(Do.COMPUTE, plan)
        return self._extras_or_exchange(plan)

    def _extras_or_exchange(self, plan: StepPlan) -> Action:
        if self.in_grads != plan.extras and (plan.extras or self.in_grads is None):
            if not self.spec.extras:
                raise RuntimeError(f"replica {self.spec.rid}: the round assigns absent slots' batches "
                                   f"{list(plan.extra)} (batch_policy 'constant') or a shrunk straggler's "
                                   f"micro-batches {list(plan.micro)} (skipping {list(plan.skip)} of its own), but "
                                   "its caller trains no extras (StepSpec.extras)")
            self.in_grads = plan.extras
            return Action(Do.EXTRA, plan)
        # A retry recomputes when it can; only a caller that cannot pays for a saved copy.
        return Action(Do.EXCHANGE, plan, save_grads=not self.can_recompute)

    def _voted(self, plan: StepPlan, result: int) -> Action:
        if result == LOST:
            raise ReplicaStateLost(f"replica {self.spec.rid}: a catch-up failed midway; the state is partly "
                                   "overwritten, so this replica exits to restart fresh")
        if result != OK:
            return Action(Do.RETRY, plan)
        if plan.role == "catchup":
            return Action(Do.CLIP, plan)
        return Action(Do.APPLY, plan)

    def _after_done(self, plan: StepPlan) -> Action:
        """The last action (the caller's work, or the RETRY books) is done."""
        last = self._last
        if last is Do.RETRY:
            self.clean = False  # a retry: this step's time is not its compute time
            return Action(Do.RETRIED, plan)
        if last is Do.RETRIED:
            if plan.role == "catchup":
                self.behind = True
                return self._next_round()
            return Action(Do.RESTORE, plan)
        if last in (Do.COMPUTE, Do.RECOMPUTE):
            if plan.role == Role.BENCH:  # a probe: our whole slot batch's gradients, on our weights
                self.computed, self.replaced, self.in_grads = True, False, ()
                return Action(Do.ROUND)
            return self._extras_or_exchange(plan)
        if last is Do.EXTRA:
            return Action(Do.EXCHANGE, plan, save_grads=not self.can_recompute)
        if last is Do.CLIP:
            return Action(Do.APPLY, plan)
        assert last is Do.COMMITTED, f"Done answers {last}"
        self.result.committed += 1
        if plan.role == "train":
            self.result.trained = True
            return Action(Do.DONE)
        self.result.caught_up = True
        self.replaced, self.behind = True, False
        return self._after_state_replaced(True)

    def _after_state_replaced(self, ok: bool) -> Action:
        if ok and self.spec.cont:  # rule 15: the job went on without the rest of our batch
            return Action(Do.DONE)
        return self._next_round()


# -- the round's plan, from its quorum (pure) ----------------------------------------------------------
def plan_of(q: Quorum, rid: int, role: str, cursor: int, policy: str, lr_mode: str, replicas: int) -> StepPlan:
    """The plan of round `q` for replica `rid` in `role`, at its slot's `cursor`."""
    cont = q.kind == "train" and q.cont  # rule 15: the batch was counted at its first step
    rb = None if q.kind != "train" or cont else round_batches(
        policy, q.contributors, {c: q.cursor_of(c) for c in q.contributors}, replicas, q.slot_cursors, q.shrunk)
    trained = rb.divisor if rb is not None else len(q.contributors)
    mine = rb if rb is not None and role == "train" else None  # what this replica trains besides its batch
    return StepPlan(step=q.max_step, quorum=q, role=role, divisor=trained,
                    lr_factor=lr_factor(lr_mode, trained, replicas), batch_index=cursor,
                    batches=rb.batches if rb is not None else ({} if cont else None),
                    extra=mine.extra_of(rid) if mine is not None else (),
                    micro=mine.micro_of(rid) if mine is not None else (),
                    skip=mine.skip_of(rid) if mine is not None else (),
                    opt=q.opt, cont=cont)


def own_optimizer(plan: StepPlan, mine: int, rid: int) -> StepPlan:
    """Several optimizers: a contributor's plan with the optimizer it steps (`mine`, this
    replica's next one; a round no report named one for takes it); a round that steps another
    optimizer than ours is an error in the program (every replica steps them in one order)."""
    if plan.opt < 0 and mine >= 0:
        plan = replace(plan, opt=mine)
    if plan.opt != mine:
        raise RuntimeError(f"replica {rid}: round {plan.quorum.round} steps optimizer {plan.opt} but this "
                           f"replica's training_step stepped optimizer {mine}: every replica must step its "
                           "optimizers in the same order")
    return plan
