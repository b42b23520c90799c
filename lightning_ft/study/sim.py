"""The in-process simulator of a study run: one model, the same batches, the same
contributors per step and the same LR factor as an FT-HSDP job (docs/study/, "Simulator").

FT-HSDP keeps every replica bitwise identical, so a job's state is one model. At each step
the simulator computes, like the job, the mean over the step's slot batches of each slot
batch's own loss gradient (each slot batch is a separate forward: the MoE balance loss is
not additive over batches), scales the LR by f(slot batches / R) around `optimizer.step`,
then steps the scheduler. What it does not do is communicate: the only differences from
a real run are the order of floating-point sums (FTAR's ring, FSDP) and time.

The script contract (examples/train_moe.py): `parser()` and `build(args)` make the
LightningModule; it has `configure_optimizers()` (optimizer and a step-interval
scheduler), `train_set()`, `val_set()`, `step_loss(batch)` (what training minimizes) and
`losses(batch)` (cross entropy first); `precision_plugin(name)` gives "32-true" or a
Lightning Precision plugin whose `forward_context()` the simulator enters around every
forward, as Lightning does.
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.utils.data import default_collate

from lightning_ft.replica.ledger import SlotStream
from lightning_ft.replica.plan import lr_factor


@dataclass
class SimSpec:
    """One simulated run."""

    script: str
    script_args: list[str]
    """The example's arguments (model size, --steps, --batch, --val-every, ...)."""
    seed: int
    """Model initialization (`--seed`) and data order (the job's `seed`), as in real runs."""
    precision: str
    """The example's --precision."""
    lr: str
    replicas: int
    batches: list[dict[int, int]]
    """Per step, the slot batches {slot: k} to train (the schedule or a real run's ledger)."""
    contributors: list[list[int]] = field(default_factory=list)
    """Per step, who trained (recorded in the result; the batches decide the math)."""


def load_script(path: str) -> Any:
    """Import the training script as a module (its directory first on sys.path)."""
    path = os.path.abspath(path)
    name = "_lft_study_" + os.path.splitext(os.path.basename(path))[0]
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, os.path.dirname(path))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the study script {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    for attr in ("parser", "build", "precision_plugin"):
        if not hasattr(mod, attr):
            raise AttributeError(f"{path} has no `{attr}`: the simulator needs parser(), build(args) and "
                                 "precision_plugin(name) (see lightning_ft/study/sim.py)")
    return mod


def forward_context(mod: Any, precision: str) -> Callable[[], Any]:
    plugin = mod.precision_plugin(precision)
    if isinstance(plugin, str):
        if plugin not in ("32-true", "32"):
            raise ValueError(f"the simulator runs 32-true or a Precision plugin with a forward_context, not {plugin!r}")
        return contextlib.nullcontext
    return plugin.forward_context


def simulate(spec: SimSpec, progress: Optional[Callable[[str], None]] = None) -> dict:
    """Train per `spec`; returns {"train_loss": per step, "eval": {step: bpb}, "seconds"}."""
    torch.set_num_threads(1)
    mod = load_script(spec.script)
    steps = len(spec.batches)
    a = mod.parser().parse_args([*spec.script_args, "--seed", str(spec.seed), "--precision", spec.precision,
                                 "--steps", str(steps)])
    model = mod.build(a)
    ctx = forward_context(mod, spec.precision)
    conf = model.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    train, val = model.train_set(), model.val_set()
    stream = SlotStream(len(train), a.batch, spec.replicas, seed=spec.seed)
    losses: list[float] = []
    evals: dict[int, float] = {}
    t0 = time.perf_counter()
    for n, batches in enumerate(spec.batches):
        opt.zero_grad(set_to_none=True)
        step = []
        for slot, k in sorted(batches.items()):
            with ctx():
                loss = model.step_loss(default_collate([train[i] for i in stream.batch(slot, k)]))
            (loss / len(batches)).backward()
            step.append(loss.item())
        factor = lr_factor(spec.lr, len(batches), spec.replicas)
        saved = [g["lr"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"] *= factor
        opt.step()
        for g, lr in zip(opt.param_groups, saved, strict=True):
            g["lr"] = lr
        sched.step()
        losses.append(sum(step) / len(step))
        if (n + 1) % a.val_every == 0:
            evals[n + 1] = evaluate(model, val, ctx)
            if progress is not None:
                progress(f"step {n + 1}/{steps}: loss {losses[-1]:.3f}, held-out {evals[n + 1]:.3f} bpb "
                         f"({time.perf_counter() - t0:.0f}s)")
    return {"train_loss": losses, "eval": evals, "seconds": time.perf_counter() - t0}


def evaluate(model: Any, val: Any, ctx: Callable[[], Any], batch: int = 64) -> float:
    """Held-out bits per byte over the whole validation set (mean over windows)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for lo in range(0, len(val), batch):
            x, y = default_collate([val[i] for i in range(lo, min(len(val), lo + batch))])
            with ctx():
                ce = model.losses((x, y))[0]
            total += float(ce) * len(x)
            count += len(x)
    return total / count / math.log(2)
