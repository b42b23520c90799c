"""`trainer.fit(model, ckpt_path=...)` under ft_hsdp (docs/ARCHITECTURE.md, "Resuming a Lightning checkpoint").

Lightning restores the model, optimizer, schedulers, precision plugin (the GradScaler) and its
loop counters from the file; then the job continues *at the checkpoint's step*: every replica
reports step S = the checkpoint's `global_step`, the first round is a sync round at S from the
lowest-id replica (so every replica starts from one state, identical), generation 0 of the
ledger starts at S (`seed_generation`, as `--resume` does), and the committed count, hence
Lightning's global step, epochs and step schedulers, goes on from S.

The data position: a checkpoint that ft_hsdp wrote (ModelCheckpoint under ft_hsdp) carries the
job's slot cursors (`checkpoint["lightning_ft"]`), so the exactly-once stream continues where it
stopped. A checkpoint from another strategy (a plain DDP run) has no position in ft_hsdp's slot
streams (its sampler ordered the data otherwise): every slot starts at the checkpoint's batch
count B (B = S with one optimizer; with several, Lightning's loop state counts the batches),
where a healthy ft_hsdp job is after B batches, so data epochs and Lightning's epochs turn at
the same step. ft_hsdp's entry records the batch count too. The
same holds for an ft_hsdp checkpoint of a job with another number of replicas.

A replica started again after the job moved on (a restart re-runs the script, ckpt_path and
all) ignores the checkpoint's step: the job's history has begun, and it catches up like any
restarted replica.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from lightning_ft.coord import keys
from lightning_ft.replica import ledger

if TYPE_CHECKING:
    from lightning_ft.replica.replica import Replica

KEY = "lightning_ft"
"""The checkpoint entry ft_hsdp adds: {"step", "replicas", "gen", "batches", "cursors": {slot: cursor}}."""


class ResumeError(RuntimeError):
    """A checkpoint that cannot start this job, with what to do."""


@dataclass
class ResumePoint:
    step: int
    cursors: dict[int, int]
    source: str
    """"ft_hsdp" (cursors from the checkpoint) or "foreign" (every slot at `step`)."""
    batches: int = -1
    """Committed batches: with several optimizers (manual optimization) `step` counts optimizer
    steps, and the batch count (slot cursors, epochs, schedulers) is another number: ft_hsdp's
    entry says it, a foreign checkpoint's loop state counts it; -1: unknown (= step)."""


def job_cursors(mgr: Replica) -> dict[int, int]:
    """Leader, right after a commit: every slot's cursor (contributors' from the round, the
    others' from the ledger, flushed first)."""
    assert mgr.last_plan is not None  # right after a commit
    q = mgr.last_plan.quorum
    mgr.flush_ledger()
    done = 0 if q.cont else 1  # a round continuing a batch advanced no cursor (quorum rule 15)
    return {slot: q.cursor_of(slot) + done if slot in q.contributors
            else ledger.read_cursor(mgr.store, mgr.root, slot, mgr.gen) for slot in range(mgr.R)}


def describe(mgr: Replica) -> dict:
    """What ft_hsdp adds to a Lightning checkpoint (written by the writer's rank 0)."""
    return {"step": mgr.step, "replicas": mgr.R, "gen": mgr.gen, "batches": mgr.batches,
            "cursors": {str(k): v for k, v in job_cursors(mgr).items()}}


def _batches(checkpoint: dict, ours: Any) -> int:
    """The committed batch count a checkpoint records (-1: it does not)."""
    if isinstance(ours, dict) and "batches" in ours:
        return int(ours["batches"])
    from lightning_ft.strategy.lightning_compat import checkpoint_batches

    return checkpoint_batches(checkpoint)  # Lightning's loop state (manual optimization: no accumulation)


def point_of(checkpoint: dict, replicas: int, path: str) -> ResumePoint:
    if "global_step" not in checkpoint:
        raise ResumeError(f"{path} has no 'global_step': not a Lightning training checkpoint; pass a checkpoint "
                          f"that ModelCheckpoint or trainer.save_checkpoint wrote")
    step = int(checkpoint["global_step"])
    ours = checkpoint.get(KEY)
    batches = _batches(checkpoint, ours)
    if isinstance(ours, dict) and int(ours.get("replicas", -1)) == replicas and int(ours.get("step", -1)) == step:
        return ResumePoint(step, {int(s): int(k) for s, k in ours["cursors"].items()}, "ft_hsdp", batches)
    return ResumePoint(step, {}, "foreign", batches)


def _has_dtensors(module: torch.nn.Module) -> bool:
    return any(hasattr(p, "to_local") for p in module.parameters())


def load(strategy: Any, path: Any, weights_only: Optional[bool], sharded_load: Callable[[], dict]) -> dict:
    """Load a Lightning checkpoint (a single `.ckpt` file: DDP and friends; or a distributed
    checkpoint directory: ModelParallelStrategy's) into the replica's model and optimizer.
    FSDP2-sharded models (W > 1) use ModelParallelStrategy's loader; a replica of one process
    has plain tensors, which that loader refuses, so it loads them here."""
    from lightning_ft.strategy.lightning_compat import (METADATA_FILENAME, distributed_checkpoint_load,
                                                        is_full_checkpoint, is_sharded_checkpoint)

    model = strategy.model
    if _has_dtensors(model):
        return sharded_load()
    p = Path(path)
    module = strategy.lightning_module
    strict = module.strict_loading
    if is_full_checkpoint(p):
        checkpoint = torch.load(p, map_location="cpu", weights_only=weights_only)
        module.load_state_dict(checkpoint.pop("state_dict"), strict=strict)
        for opt, state in zip(strategy.optimizers, checkpoint.get("optimizer_states", []), strict=False):
            opt.load_state_dict(state)
        return checkpoint
    if is_sharded_checkpoint(p):  # as ModelParallelStrategy loads it, without its demand for DTensors
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                             set_optimizer_state_dict)

        from lightning_ft.replica.state import materialize_optimizer_state

        state = {"state_dict": get_model_state_dict(module)}
        distributed_checkpoint_load(state, p)
        module.load_state_dict(state["state_dict"], strict=strict)
        for i, opt in enumerate(strategy.optimizers):
            materialize_optimizer_state(opt)  # DCP loads into existing tensors
            got = {f"optimizer_{i}": get_optimizer_state_dict(module, opt)}
            distributed_checkpoint_load(got, p)
            set_optimizer_state_dict(module, opt, optim_state_dict=got[f"optimizer_{i}"])
        return torch.load(p / METADATA_FILENAME, weights_only=weights_only)
    raise ResumeError(f"ckpt_path {str(path)!r} is neither a checkpoint file nor a distributed checkpoint directory")


def begin(mgr: Replica, point: ResumePoint, broadcast: Callable[[Any], Any]) -> bool:
    """Before the first round (every rank): start generation 0 at the checkpoint's step unless the
    job's history has begun. Returns whether this replica starts at the checkpoint's step."""
    decision: Any = None
    # one optimizer: a step is a batch; several: the checkpoint's batch count (foreign ones without
    # loop state: the step, as before)
    batches = point.batches if mgr.multi and point.batches >= 0 else point.step
    if mgr.is_leader:
        rewinds = ledger.read_rewinds(mgr.store, mgr.root)
        commits, _ = mgr.store.get_prefix(keys.commits(mgr.root))
        if not point.cursors:  # foreign: every slot where a healthy ft_hsdp job is after these batches
            point.cursors = {s: batches for s in range(mgr.R)}
        mine = {"to": point.step, "cursors": {str(s): k for s, k in sorted(point.cursors.items())}}
        if commits or any(g > 0 for g in rewinds):
            decision = "late"
        elif 0 in rewinds:
            theirs = {"to": int(rewinds[0].get("to", -1)), "cursors": rewinds[0].get("cursors", {})}
            decision = "ok" if theirs == mine else f"differs: {json.dumps(theirs)} != {json.dumps(mine)}"
        else:
            ledger.seed_generation(mgr.store, mgr.root, 0, point.step, point.cursors, resumed_from="ckpt_path",
                                   source=point.source)
            decision = "ok"
    decision, point.cursors = broadcast((decision, point.cursors))
    if decision == "late":
        return False
    if decision != "ok":
        raise ResumeError(f"replica {mgr.rid}: this job already started from another checkpoint position "
                          f"({decision}); every replica must resume from the same ckpt_path")
    mgr.continue_at(point.step, batches, point.cursors.get(mgr.rid, batches))
    if mgr.is_leader:
        print(f"lightning-ft: replica {mgr.rid} resumes at step {point.step} ({point.source} checkpoint; slot "
              f"cursor {mgr.cursor})", file=sys.stderr, flush=True)
    return True


def load_into(s: Any, path: Any, weights_only: Optional[bool], sharded_load: Callable[[], dict]) -> dict:
    """`load_checkpoint` of strategy `s`: the checkpoint into the replica (`load`); under fit, the
    job then continues at its step (`s.resume_point`, begun in `on_train_start`)."""
    from lightning.pytorch.trainer.states import TrainerFn

    from lightning_ft.strategy.errors import FTHSDPError

    try:
        checkpoint = load(s, path, weights_only, sharded_load)
        if s.replica is not None and s.module.trainer.state.fn == TrainerFn.FITTING:
            s.resume_point = point_of(checkpoint, s.num_replicas, str(path))
    except ResumeError as e:
        raise FTHSDPError(str(e)) from None
    return checkpoint
