"""The training step under `FTHSDPStrategy` (docs/ARCHITECTURE.md, "Lightning glue"): its hooks
hand Lightning's step to the replica layer and read back what it did.

- `on_train_start`: a resume's starting point, then `mgr.prepare()` (sync, catch-up, rewind);
- `optimizer_step`: the batch's accumulation window, `mgr.run_step(closure, ...)` with the
  recomputation a catch-up needs, the clip and hooks on the averaged gradients, batch_policy
  "constant"'s extra batches; then the job's stop decision, Lightning's counters from the
  committed step count, the checkpoint and the run log;
- `set_lightning_step`: Lightning's progress (steps, batches, epochs) from the committed count;
- `on_commit`: schedulers and stream loaders advance once per committed step;
- `route_should_stop`: `trainer.should_stop` becomes a job decision.

Functions over the strategy, as replica_start.py's are: they read and set its fields."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from lightning_ft.replica.batch_policy import own_todo
from lightning_ft.strategy import lightning_compat
from lightning_ft.strategy.errors import FTHSDPError
from lightning_ft.strategy.sampler import FTBatchSampler

if TYPE_CHECKING:
    from lightning_ft.strategy.ft_hsdp import FTHSDPStrategy


def on_train_start(s: FTHSDPStrategy) -> None:
    # Sync, catch-up and rewind rounds before any batch (no wasted compute, and accumulation
    # or manual optimization never trains on stale weights).
    if s._resume_point is not None:  # the job continues at the checkpoint's step, from one state
        from lightning_ft.strategy.resume import ResumeError, begin

        try:
            begin(s.mgr, s._resume_point, s.mgr.broadcast)
        except ResumeError as e:
            raise FTHSDPError(str(e)) from None
        s._resume_point = None
    t0 = time.perf_counter()
    res = s.last = s.mgr.prepare()
    set_lightning_step(s, res.step, in_batch=False)
    if res.committed or res.synced:
        log_step(s, None, True, time.perf_counter() - t0)


def batch_start(s: FTHSDPStrategy, batch: Any, batch_idx: int) -> None:
    """`on_train_batch_start`: the exactly-once loader's tag of the batch joins the accumulation
    window; the window's last batch starts the round (`begin_step`: its quorum overlaps
    forward/backward, and backward hooks send gradient buckets)."""
    if s.sampler is None or not s.sampler.tags:
        raise FTHSDPError("ft_hsdp could not tell which batch of the exactly-once stream this is: the train "
                          "loader must be the one the strategy installs (no custom data fetching)")
    s._window.append((s.sampler.tags.popleft(), batch, batch_idx))
    s._position = s._window[-1][0][:2]
    if len(s._window) == 1:  # a new slot batch: skip what the last quorum announced we give away
        s._own_done, s._skip = set(), set(s.mgr.planned_skip())
    if (s.overlap and s._pending is None and len(s._window) == micro_batches(s)
            and not s.mgr.multi):  # several optimizers: which one steps first is known at its step
        s._pending = s.mgr.begin_step()


def optimizer_step(s: FTHSDPStrategy, optimizer: Any, closure: Callable[[], Any]) -> Any:
    auto = s._module.automatic_optimization
    cont, index = False, 0
    if s.mgr.multi:
        index = next(i for i, o in enumerate(s.optimizers) if o is optimizer)
        window, cont = batch_window(s)
        if window is None:  # the rest of a batch the job trained without us: nothing to step
            set_lightning_step(s, s.mgr.step - 1)
            return None
    else:
        window, s._window = s._window, []
    if not window:
        raise FTHSDPError("optimizer_step without a training batch: ft_hsdp supports one optimizer step per "
                          "batch (or per accumulation window)")
    k = window[-1][0][0]
    if any(tag[0] != k for tag, _, _ in window):
        raise FTHSDPError(f"an accumulation window spans slot batches {[t for t, _, _ in window]}")
    s.committed_in_call = 0
    s._phase = {}
    t0 = time.perf_counter()
    pending, s._pending = s._pending, None
    loss, computed = None, not auto  # manual optimization: the user's backward already ran
    def compute(plan: Any = None) -> Any:
        out = closure()
        s.mgr.share = (len(s._own_done), micro_batches(s))  # the straggler measure: per whole slot batch
        return out

    if pending is not None and auto:  # forward/backward overlap the quorum; hooks send buckets
        loss, computed = compute(), True
        s._phase["closure_ms"] = (time.perf_counter() - t0) * 1e3
    t1 = time.perf_counter()

    def after_exchange() -> None:  # hooks and clipping on the averaged gradients, identically everywhere
        if s._manual_clip is not None:  # where the training_step asked, as under DDP: before the hooks
            s._manual_clip.apply(index, optimizer)
        lightning_compat.after_closure(s.precision_plugin, s.lightning_module, optimizer)

    s._extra_losses = []
    res = s.last = s.mgr.run_step(compute, batch=None if cont else k, pending=pending, computed=computed,
                            loss=loss,
                            recompute=(lambda plan: recompute(s, window, closure, optimizer, plan)) if auto else None,
                            after_exchange=after_exchange,
                            extra=((lambda plan: train_extra(s, plan, optimizer, window[-1][2])) if auto
                                   else None),
                            phase=(index, cont) if s.mgr.multi else None)
    if s.mgr.multi and not res.trained:
        assert s._batch is not None  # _batch_window set it (no window otherwise)
        s._batch[1] = False  # others trained this batch, or its rest: skip its remaining steps
    if s._manual_clip is not None:
        s._manual_clip.stepped(index, res.trained)
    s._phase["step_ms"] = (time.perf_counter() - t1) * 1e3
    if res.trained and s._extra_losses and res.loss is not None:  # the mean over the slots we trained
        res.loss = (float(res.loss) + sum(s._extra_losses)) / (1 + len(s._extra_losses))
    if res.stale:  # a rewind moved the slot's cursor back: restart the loader there
        assert s.sampler is not None  # on_train_batch_start checked it
        s.sampler.restart()
    if res.stop:
        s.stop_agreed = True  # the job decided to stop at this step: every replica stops now
        s._module.trainer.should_stop = True
    if auto and not res.trained and not computed:  # Lightning still wants the closure's result
        closure()
        optimizer.zero_grad(set_to_none=True)
    set_lightning_step(s, res.step - 1)  # Lightning adds the one it thinks it made
    if s._ckpt is not None:
        s._ckpt.maybe_save(s.lightning_module, s.mgr.optimizer, s._schedulers,
                              s.committed_in_call, s.global_rank)
        s._phase["ckpt_stage_ms"] = s._ckpt.stage_ms
    log_step(s, res.loss, res.caught_up or res.synced, time.perf_counter() - t0)
    return None


def batch_window(s: FTHSDPStrategy) -> tuple[Optional[list], bool]:
    """Several optimizers: (the batch's window, whether this step continues the batch); the
    window is None once the job trained the batch (or its rest) without us."""
    if s._window:  # the batch's first optimizer step
        s._batch = [s._window, True]
        s._window = []
        return s._batch[0], False
    if s._batch is None:
        return [], False
    window, live = s._batch
    return (window, True) if live else (None, True)


def log_step(s: FTHSDPStrategy, loss: Any, caught_up: bool, seconds: float) -> None:
    if s.global_rank == 0 and s._steplog is not None:
        s._steplog.write(s.mgr, loss, caught_up, seconds, s._phase)


def clip_catchup(s: FTHSDPStrategy) -> None:
    """A catch-up's optimizer step: clip the averaged gradients as the contributors did in
    `_after_closure` (Lightning's clipping and the module's configure_gradient_clipping),
    but run none of the on_before_optimizer_step hooks: a late replica runs no user hook.
    Manual optimization: the clip the contributors' training_step asked for that optimizer
    at its last committed step (strategy/manual_clip.py)."""
    if s._manual_clip is not None:
        opt = s.mgr.stepped_optimizer()
        s._manual_clip.catch_up(s._manual_clip.index(opt), opt)
        return
    module = s._module
    trainer = module.trainer
    lightning_compat.clip_as_configured(s.precision_plugin, module, s.mgr.stepped_optimizer(),
                                        trainer.gradient_clip_val, trainer.gradient_clip_algorithm)


def recompute(s: FTHSDPStrategy, window: list, closure: Callable[[], Any], optimizer: Any, plan: Any) -> Any:
    """Redo the window's forward/backward on the caught-up weights (automatic optimization),
    but for the micro-batches the round gives away (`plan.skip`: this replica is shrunk)."""
    s.recomputes += 1
    optimizer.zero_grad(set_to_none=True)
    n = len(window)
    s._own_done, s._skip = set(), set(plan.skip)
    for tag, batch, batch_idx in window[:-1]:
        if tag[1] in s._skip:
            continue
        _backward(s, batch, batch_idx, n, optimizer)
        s._own_done.add(tag[1])
    return closure()


def training_step(s: FTHSDPStrategy, step: Callable[[], Any]) -> Any:
    """Strategy.training_step inside Lightning's loop: a micro-batch this replica gives away (it
    is a shrunk straggler: `ReplicaManager.planned_skip`) runs no forward; Lightning gets a zero
    loss, and `backward` skips it. The others are counted (`_own_done`) for `train_extra`."""
    pos = s._position
    if s._direct or pos is None or s.mgr is None or not s.mgr.micro_batches:
        return step()
    if pos[1] in s._skip:
        s._skipped = True
        return torch.zeros((), device=s.root_device)
    s._own_done.add(pos[1])
    return step()


def _backward(s: FTHSDPStrategy, batch: Any, batch_idx: int, n: int, optimizer: Any) -> float:
    """Forward and backward of one micro-batch outside Lightning's loop (its loss scaled by 1/n,
    as Lightning's accumulation does); returns the loss."""
    s._direct = True
    try:
        out: Any = s.training_step(batch, batch_idx)  # the loss, or a dict with it
    finally:
        s._direct = False
    loss = out["loss"] if isinstance(out, dict) else out
    s.backward(loss / n, optimizer)
    return float(loss.detach())


def train_extra(s: FTHSDPStrategy, plan: Any, optimizer: Any, batch_idx: int) -> None:
    """What the round assigns besides (or instead of part of) our slot batch, built from the train
    dataset by sample index in this rank's micro-batches: batch_policy "constant"'s absent slots'
    batches (`plan.extra`) and shrunk stragglers' micro-batches (`plan.micro`), whose gradients
    add to ours; and, when this replica is or was shrunk, its own micro-batches as the round
    decided (`plan.skip`; batch_policy.own_todo: what it skipped and must compute after all, or a
    fresh start when it computed one it gives away)."""
    dataset, collate = s._train_data
    n = micro_batches(s)
    s._extra_losses = []
    assert isinstance(s.sampler, FTBatchSampler)  # _train_data is set with it (map-style data)

    def run(slot: int, k: int, js: Any) -> float:
        mbs = s.sampler.micro_batches(slot, k)  # type: ignore[union-attr]  # map-style: asserted above
        total = 0.0
        for j in js:
            batch = s.batch_to_device(collate([dataset[i] for i in mbs[j]]))
            total += _backward(s, batch, batch_idx, n, optimizer)
        return total

    if s.mgr.micro_batches:
        restart, todo = own_todo(s._own_done, n, plan.skip)
        if restart:
            s.recomputes += 1
            optimizer.zero_grad(set_to_none=True)
            s._own_done = set()
        run(s.rid, plan.batch_index, todo)
        s._own_done |= set(todo)
    for slot, k in plan.extra:
        s._extra_losses.append(run(slot, k, range(n)) / n)
    for slot, k, j in plan.micro:
        run(slot, k, (j,))


def set_lightning_step(s: FTHSDPStrategy, n: int, in_batch: bool = True) -> None:
    """Lightning's counters from the job: `n` optimizer steps (Lightning adds the one it
    thinks it made), and batch and epoch progress from the committed count, so that every
    replica, restarted ones included, is at the same epoch and batch position and runs
    validation, epoch ends and `max_epochs` at the same committed steps. An epoch is one
    pass of the slot streams (`steps_per_epoch` committed steps) for the whole job."""
    module = s._module
    spe = s.sampler.steps_per_epoch() if s.sampler is not None else 0
    if not spe:
        lightning_compat.set_progress(module.trainer, module.automatic_optimization, n)
        return
    done = s.mgr.batches if s.mgr.multi else s.mgr.step  # committed batches
    micro = micro_batches(s)
    pos = done % spe if done % spe or done == 0 else spe  # position within the job's epoch
    lag = 1 if in_batch else 0  # inside a batch, Lightning increments processed/completed after us
    lightning_compat.set_progress(module.trainer, module.automatic_optimization, n,
                                  batches=(done * micro, pos * micro, lag), epoch=(done - 1) // spe if done else 0)


def on_commit(s: FTHSDPStrategy, plan: Any) -> None:
    s.committed_in_call += 1
    if s._schedulers is not None:
        mgr = s.mgr
        if mgr.multi:  # a step scheduler follows its own optimizer; epochs count batches
            s._schedulers.committed(mgr.batches, optimizer=mgr.stepped_optimizer(plan), new_batch=not plan.cont)
        else:
            s._schedulers.committed(mgr.step)
    if s.sampler is not None and hasattr(s.sampler, "committed"):
        # a stream loader records its state at the new cursor
        s.sampler.committed(s.mgr.step, s.mgr.cursor)


def route_should_stop(s: FTHSDPStrategy, trainer: Any) -> None:
    """`trainer.should_stop` becomes a job decision: a replica that sets it (user code, a
    callback, EarlyStopping) asks the job to stop (`stop` in its next report), and it reads
    True on every replica once a round carrying the request committed, so that all stop
    after the same step. Lightning itself is unchanged; the attribute is a property on a
    per-trainer subclass."""
    cls = type(trainer)
    if getattr(cls, "_ft_routes_should_stop", False):
        return
    strategy = s

    def get(tr: Any) -> bool:
        if strategy.mgr is None:
            return bool(tr.__dict__.get("_ft_should_stop", False))
        return strategy.stop_agreed

    def put(tr: Any, value: bool) -> None:
        tr.__dict__["_ft_should_stop"] = bool(value)
        if value and strategy.mgr is not None and not strategy.stop_agreed:
            strategy.mgr.request_stop = True

    trainer.__class__ = type(cls.__name__, (cls,), {"should_stop": property(get, put),
                                                      "_ft_routes_should_stop": True,
                                                      "__module__": cls.__module__})


def micro_batches(s: FTHSDPStrategy) -> int:
    trainer = s._module.trainer
    return trainer.accumulate_grad_batches if s._module.automatic_optimization else 1
