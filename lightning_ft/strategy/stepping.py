"""The optimizer step under Lightning's loop (docs/ARCHITECTURE.md, "Lightning glue"):
`LightningStep` holds the step in progress (`StepState`: the accumulation window, what this
replica computed of it) and answers what the replica asks of it (replica/step.py).

- `on_train_start`: a resume's starting point, then the replica's `prepare` rounds;
- `batch_start`: the exactly-once loader's batch joins the window; the window's last batch
  starts the round early (its quorum overlaps forward/backward; backward hooks send buckets);
- `optimizer_step`: one step of the protocol, read top to bottom: compute (or recompute, or
  train the round's extra micro-batches), check the averaged gradients (clipping and
  Lightning's hooks), keep the books of each commit (schedulers, stream loaders), then the
  job's stop decision, Lightning's counters from the committed count, the checkpoint and the log;
- `training_step` / `backward`: a micro-batch this replica gives away (a shrunk straggler) is
  not computed;
- `set_progress`: Lightning's progress (steps, batches, epochs) from the committed count."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from lightning_ft.replica.batch_policy import own_todo
from lightning_ft.replica.core import Do
from lightning_ft.replica.plan import StepPlan, StepResult
from lightning_ft.replica.replica import Replica
from lightning_ft.replica.step import Step
from lightning_ft.strategy import lightning_compat
from lightning_ft.strategy.errors import FTHSDPError
from lightning_ft.strategy.sampler import FTBatchSampler

if TYPE_CHECKING:
    from lightning_ft.strategy.ft_hsdp import FTHSDPStrategy

Window = list[tuple[tuple[int, int], Any, int]]
"""The accumulation window's batches: ((slot batch k, micro-batch j), batch, batch_idx)."""


@dataclass
class StepState:
    """The optimizer step in progress (reset at each step, one per strategy)."""

    window: Window = field(default_factory=list)
    """The batches of the accumulation window so far."""
    batch: Optional[tuple[Window, bool]] = None
    """Several optimizers: (the batch's window, whether its remaining steps are still ours)."""
    position: Optional[tuple[int, int]] = None
    """(slot batch k, micro-batch j) of the batch in training."""
    own_done: set[int] = field(default_factory=set)
    """Micro-batches of our slot batch whose gradients we hold."""
    skip: set[int] = field(default_factory=set)
    """Micro-batches of our slot batch we give away (a shrunk straggler)."""
    skipped: bool = False
    """The current micro-batch is given away: its backward is skipped."""
    direct: bool = False
    """A forward/backward outside Lightning's loop (recomputation, extra micro-batches)."""
    began: bool = False
    """The window's round was started early (`Replica.begin_step`)."""
    extra_losses: list[float] = field(default_factory=list)
    committed: int = 0
    """Steps committed in this optimizer_step call (catch-ups included)."""
    timings: dict[str, float] = field(default_factory=dict)


class LightningStep:
    """The step glue of one `FTHSDPStrategy` over its `Replica`."""

    def __init__(self, s: FTHSDPStrategy, replica: Replica) -> None:
        self.s, self.replica = s, replica
        self.st = StepState()
        self.last: Optional[StepResult] = None
        """What the replica's last step (or `prepare`) did: the glue reads nothing else."""
        self.recomputes = 0
        self.stop_agreed = False
        """The job decided to stop at a step this replica committed (`trainer.should_stop`)."""

    @property
    def micro_batches(self) -> int:
        module = self.s.module
        return module.trainer.accumulate_grad_batches if module.automatic_optimization else 1

    # -- the start --------------------------------------------------------------------------------
    def on_train_start(self) -> None:
        """Sync, catch-up and rewind rounds before any batch (no wasted compute, and accumulation
        or manual optimization never trains on stale weights)."""
        s = self.s
        if s.resume_point is not None:  # the job continues at the checkpoint's step, from one state
            from lightning_ft.strategy.resume import ResumeError, begin

            try:
                begin(self.replica, s.resume_point, self.replica.broadcast)
            except ResumeError as e:
                raise FTHSDPError(str(e)) from None
            s.resume_point = None
        t0 = time.perf_counter()
        self.st = StepState()
        step = self.replica.prepare()
        for ask in step:
            self._books(ask.do, ask.plan)
        res = self.last = step.result
        self.set_progress(res.step, in_batch=False)
        if res.committed or res.synced:
            self._log(None, True, time.perf_counter() - t0)

    # -- inside Lightning's loop -------------------------------------------------------------------
    def batch_start(self, batch: Any, batch_idx: int) -> None:
        """`on_train_batch_start`: the exactly-once loader's tag of the batch joins the window; the
        window's last batch starts the round (`begin_step`)."""
        s, st = self.s, self.st
        if s.sampler is None or not s.sampler.tags:
            raise FTHSDPError("ft_hsdp could not tell which batch of the exactly-once stream this is: the train "
                              "loader must be the one the strategy installs (no custom data fetching)")
        st.window.append((s.sampler.tags.popleft(), batch, batch_idx))
        st.position = st.window[-1][0]
        if len(st.window) == 1:  # a new slot batch: skip what the last quorum announced we give away
            st.own_done, st.skip = set(), set(self.replica.planned_skip())
        if (s.overlap and not st.began and len(st.window) == self.micro_batches
                and not self.replica.multi):  # several optimizers: which one steps first is known at its step
            self.replica.begin_step()
            st.began = True

    def training_step(self, step: Callable[[], Any]) -> Any:
        """A micro-batch this replica gives away (it is a shrunk straggler) runs no forward;
        Lightning gets a zero loss, and `backward` skips it. The others are counted (`own_done`)."""
        st = self.st
        if st.direct or st.position is None or not self.replica.micro_batches:
            return step()
        if st.position[1] in st.skip:
            st.skipped = True
            return torch.zeros((), device=self.s.root_device)
        st.own_done.add(st.position[1])
        return step()

    def skip_backward(self) -> bool:
        """Whether this backward is a given-away micro-batch's (then it is skipped)."""
        skipped, self.st.skipped = self.st.skipped, False
        return skipped

    # -- the step ----------------------------------------------------------------------------------
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any]) -> Any:
        s, r, st = self.s, self.replica, self.st
        auto = s.module.automatic_optimization
        index, cont = 0, False
        if r.multi:
            index = next(i for i, o in enumerate(s.optimizers) if o is optimizer)
            window, cont = self._batch_window()
            if window is None:  # the rest of a batch the job trained without us: nothing to step
                self.set_progress(r.step - 1)
                return None
        else:
            window, st.window = st.window, []
        if not window:
            raise FTHSDPError("optimizer_step without a training batch: ft_hsdp supports one optimizer step per "
                              "batch (or per accumulation window)")
        k = window[-1][0][0]
        if any(tag[0] != k for tag, _, _ in window):
            raise FTHSDPError(f"an accumulation window spans slot batches {[t for t, _, _ in window]}")
        st.committed, st.timings, st.extra_losses = 0, {}, []
        t0 = time.perf_counter()
        loss, computed = None, not auto  # manual optimization: the user's backward already ran
        if st.began and auto:  # forward/backward overlap the round; the hooks send buckets
            loss, computed = closure(), True
            st.timings["closure_ms"] = (time.perf_counter() - t0) * 1e3
        st.began = False
        t1 = time.perf_counter()
        step = r.begin(batch=None if cont else k, computed=computed, recompute=auto, extras=auto,
                       phase=(index, cont) if r.multi else None)
        step.share = self._share()
        for ask in step:
            if ask.do is Do.COMPUTE:
                loss = closure()
                step.share = self._share()
            elif ask.do is Do.RECOMPUTE:
                loss = self._recompute(window, closure, optimizer, ask.plan)
            elif ask.do is Do.EXTRA:
                self._train_extra(ask.plan, optimizer, window[-1][2])
            elif ask.do is Do.CHECK:  # hooks and clipping on the averaged gradients, identically everywhere
                if s.manual_clip is not None:  # where the training_step asked, as under DDP: before the hooks
                    s.manual_clip.apply(index, optimizer)
                lightning_compat.after_closure(s.precision_plugin, s.module, optimizer)
            else:
                self._books(ask.do, ask.plan)
        res = self.last = step.result
        self._after_step(res, step, optimizer, closure, index, computed, loss, auto)
        st.timings["step_ms"] = (time.perf_counter() - t1) * 1e3
        if s.ckpt is not None:
            s.ckpt.maybe_save(s.module, r.optimizer, s.schedulers, st.committed, s.global_rank)
            st.timings["ckpt_stage_ms"] = s.ckpt.stage_ms
        if res.trained and st.extra_losses and loss is not None:  # the mean over the slots we trained
            loss = (float(loss) + sum(st.extra_losses)) / (1 + len(st.extra_losses))
        self._log(loss if res.trained else None, res.caught_up or res.synced, time.perf_counter() - t0)
        return None

    def _after_step(self, res: StepResult, step: Step, optimizer: Any, closure: Callable[[], Any], index: int,
                    computed: bool, loss: Any, auto: bool) -> None:
        """What the step's result means for Lightning's loop."""
        s, r = self.s, self.replica
        if r.multi and not res.trained:
            assert self.st.batch is not None  # _batch_window set it (no window otherwise)
            self.st.batch = (self.st.batch[0], False)  # others trained this batch, or its rest
        if s.manual_clip is not None:
            s.manual_clip.stepped(index, res.trained)
        if res.stale:  # a rewind moved the slot's cursor back: restart the loader there
            assert s.sampler is not None  # batch_start checked it
            s.sampler.restart()
        if res.stop:
            self.stop_agreed = True  # the job decided to stop at this step: every replica stops now
            s.module.trainer.should_stop = True
        if auto and not res.trained and not step.core.computed and not computed:
            closure()  # Lightning still wants the closure's result
            optimizer.zero_grad(set_to_none=True)
        self.set_progress(res.step - 1)  # Lightning adds the one it thinks it made

    def _share(self) -> tuple[int, int]:
        """(micro-batches of our slot batch computed, of how many): the straggler measure counts
        a whole slot batch."""
        return len(self.st.own_done), self.micro_batches

    def _books(self, do: Do, plan: StepPlan) -> None:
        """What the strategy does at a catch-up's optimizer step (CLIP) and after any commit."""
        if do is Do.CLIP:
            self._clip_catchup(plan)
        elif do is Do.COMMITTED:
            self._on_commit(plan)

    def _batch_window(self) -> tuple[Optional[Window], bool]:
        """Several optimizers: (the batch's window, whether this step continues the batch); the
        window is None once the job trained the batch (or its rest) without us."""
        st = self.st
        if st.window:  # the batch's first optimizer step
            st.batch, st.window = (st.window, True), []
            return st.batch[0], False
        if st.batch is None:
            return [], False
        window, live = st.batch
        return (window, True) if live else (None, True)

    def _on_commit(self, plan: StepPlan) -> None:
        """After each commit: schedulers and stream loaders advance once per committed step."""
        s, r = self.s, self.replica
        self.st.committed += 1
        if s.schedulers is not None:
            if r.multi:  # a step scheduler follows its own optimizer; epochs count batches
                s.schedulers.committed(r.batches, optimizer=r.stepped_optimizer(plan), new_batch=not plan.cont)
            else:
                s.schedulers.committed(r.step)
        if s.sampler is not None and hasattr(s.sampler, "committed"):
            s.sampler.committed(r.step, r.cursor)  # a stream loader records its state at the new cursor

    def _clip_catchup(self, plan: StepPlan) -> None:
        """A catch-up's optimizer step: clip the averaged gradients as the contributors did (their
        CHECK: Lightning's clipping and the module's configure_gradient_clipping), but run none of
        the on_before_optimizer_step hooks: a late replica runs no user hook. Manual optimization:
        the clip the contributors' training_step asked for that optimizer at its last committed
        step (strategy/manual_clip.py)."""
        s = self.s
        opt = self.replica.stepped_optimizer(plan)
        if s.manual_clip is not None:
            s.manual_clip.catch_up(s.manual_clip.index(opt), opt)
            return
        trainer = s.module.trainer
        lightning_compat.clip_as_configured(s.precision_plugin, s.module, opt,
                                            trainer.gradient_clip_val, trainer.gradient_clip_algorithm)

    # -- what the round adds to the window's gradients ------------------------------------------------
    def _recompute(self, window: Window, closure: Callable[[], Any], optimizer: Any, plan: StepPlan) -> Any:
        """Redo the window's forward/backward on the caught-up weights (automatic optimization),
        but for the micro-batches the round gives away (`plan.skip`: this replica is shrunk)."""
        st = self.st
        self.recomputes += 1
        optimizer.zero_grad(set_to_none=True)
        n = len(window)
        st.own_done, st.skip = set(), set(plan.skip)
        for tag, batch, batch_idx in window[:-1]:
            if tag[1] in st.skip:
                continue
            self._backward(batch, batch_idx, n, optimizer)
            st.own_done.add(tag[1])
        return closure()

    def _backward(self, batch: Any, batch_idx: int, n: int, optimizer: Any) -> float:
        """Forward and backward of one micro-batch outside Lightning's loop (its loss scaled by 1/n,
        as Lightning's accumulation does); returns the loss."""
        self.st.direct = True
        try:
            out: Any = self.s.training_step(batch, batch_idx)  # the loss, or a dict with it
        finally:
            self.st.direct = False
        loss = out["loss"] if isinstance(out, dict) else out
        self.s.backward(loss / n, optimizer)
        return float(loss.detach())

    def _train_extra(self, plan: StepPlan, optimizer: Any, batch_idx: int) -> None:
        """What the round assigns besides (or instead of part of) our slot batch, built from the
        train dataset by sample index in this rank's micro-batches: batch_policy "constant"'s absent
        slots' batches (`plan.extra`) and shrunk stragglers' micro-batches (`plan.micro`), whose
        gradients add to ours; and, when this replica is or was shrunk, its own micro-batches as the
        round decided (`plan.skip`; batch_policy.own_todo: what it skipped and must compute after
        all, or a fresh start when it computed one it gives away)."""
        s, st = self.s, self.st
        dataset, collate = s.train_data
        n = self.micro_batches
        st.extra_losses = []
        sampler = s.sampler
        assert isinstance(sampler, FTBatchSampler)  # train_data is set with it (map-style data)

        def run(slot: int, k: int, js: Any) -> float:
            mbs = sampler.micro_batches(slot, k)
            total = 0.0
            for j in js:
                batch = s.batch_to_device(collate([dataset[i] for i in mbs[j]]))
                total += self._backward(batch, batch_idx, n, optimizer)
            return total

        if self.replica.micro_batches:
            restart, todo = own_todo(st.own_done, n, plan.skip)
            if restart:
                self.recomputes += 1
                optimizer.zero_grad(set_to_none=True)
                st.own_done = set()
            run(s.rid, plan.batch_index, todo)
            st.own_done |= set(todo)
        for slot, k in plan.extra:
            st.extra_losses.append(run(slot, k, range(n)) / n)
        for slot, k, j in plan.micro:
            run(slot, k, (j,))

    # -- Lightning's counters and the log ---------------------------------------------------------------
    def set_progress(self, n: int, in_batch: bool = True) -> None:
        """Lightning's counters from the job: `n` optimizer steps (Lightning adds the one it
        thinks it made), and batch and epoch progress from the committed count, so that every
        replica, restarted ones included, is at the same epoch and batch position and runs
        validation, epoch ends and `max_epochs` at the same committed steps. An epoch is one pass
        of the slot streams (`steps_per_epoch` committed steps) for the whole job."""
        s, r = self.s, self.replica
        module = s.module
        spe = s.sampler.steps_per_epoch() if s.sampler is not None else 0
        if not spe:
            lightning_compat.set_progress(module.trainer, module.automatic_optimization, n)
            return
        done = r.batches if r.multi else r.step  # committed batches
        micro = self.micro_batches
        pos = done % spe if done % spe or done == 0 else spe  # position within the job's epoch
        lag = 1 if in_batch else 0  # inside a batch, Lightning increments processed/completed after us
        lightning_compat.set_progress(module.trainer, module.automatic_optimization, n,
                                      batches=(done * micro, pos * micro, lag), epoch=(done - 1) // spe if done else 0)

    def _log(self, loss: Any, caught_up: bool, seconds: float) -> None:
        s = self.s
        if s.global_rank == 0 and s.steplog is not None:
            s.steplog.write(self.replica, loss, caught_up, seconds, self.st.timings)
