"""Every Lightning private the strategy uses, in one place (docs/ARCHITECTURE.md, "Lightning glue").

A Lightning release that moves one of these breaks us here only, and
tests/strategy/test_lightning_compat.py says which one and where it went: each entry of
`PRIVATES` names what we use, and `missing()` lists those the installed Lightning lacks.
Nothing else in lightning_ft reaches into Lightning's underscored names or its loops'
progress trackers.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from lightning.fabric.strategies.model_parallel import (_METADATA_FILENAME, _distributed_checkpoint_load,
                                                        _is_full_checkpoint, _is_sharded_checkpoint)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.model_parallel import _materialize_distributed_module
from lightning.pytorch.trainer import call as _call

Launcher = _Launcher
"""The base of a strategy's launcher (strategy/self_launch.py)."""
METADATA_FILENAME = _METADATA_FILENAME
is_full_checkpoint = _is_full_checkpoint
is_sharded_checkpoint = _is_sharded_checkpoint
distributed_checkpoint_load = _distributed_checkpoint_load
optimizers_to_device = _optimizers_to_device
materialize_distributed_module = _materialize_distributed_module

PRIVATES: dict[str, str] = {
    "Precision._after_closure": "the optimizer-step hooks and clipping, run on the averaged gradients",
    "Precision._clip_gradients": "a catch-up's clipping, as configured (configure_gradient_clipping)",
    "_EvaluationLoop._combined_loader": "the validation loader, rebuilt when the live replicas change",
    "_TrainingEpochLoop._batches_that_stepped": "Lightning's step count for loggers, set from the job's",
    "_TrainingEpochLoop.batch_progress / FitLoop.epoch_progress": "batch and epoch positions from the job's",
    "_AutomaticOptimization.optim_progress / _ManualOptimization.optim_step_progress": "global_step",
    "Logger._version": "each replica logs to its own version directory",
    "trainer.call._call_callbacks_state_dict / _call_callbacks_load_state_dict": "callbacks' state in catch-up",
    "Trainer._logger_connector.should_update_logs": "FT metrics only when loggers write",
    "lightning.fabric.strategies.model_parallel checkpoint helpers": "fit(ckpt_path=...) with W = 1",
    "_optimizers_to_device, _materialize_distributed_module": "ModelParallelStrategy.setup without its demands",
    "Trainer.should_stop (a property on a per-trainer subclass)": "the job's stop decision on every replica",
    "LRScheduler.step (a per-scheduler subclass)": "schedulers stepped by committed steps",
    "checkpoint['loops']['fit_loop']['epoch_loop.batch_progress']": "a foreign checkpoint's batch count",
    "strategies.launchers.launcher._Launcher": "self-launch (python train.py)",
}


def after_closure(plugin: Any, module: Any, optimizer: Any) -> None:
    """What Lightning's precision plugin runs between the closure and the optimizer step:
    on_before_optimizer_step hooks and gradient clipping."""
    plugin._after_closure(module, optimizer)


def clip_as_configured(plugin: Any, module: Any, optimizer: Any, clip_val: Any, algorithm: Any) -> None:
    """Lightning's clipping as configured (the module's configure_gradient_clipping), no hooks."""
    plugin._clip_gradients(module, optimizer, clip_val, gradient_clip_algorithm=algorithm)


def rebuild_val_loader(trainer: Any) -> None:
    """Lightning keeps the validation loader (and its length) of the first validation: drop it."""
    trainer.fit_loop.epoch_loop.val_loop._combined_loader = None


def name_unversioned_loggers(trainer: Any, version: str) -> None:
    """Loggers without an explicit version log to `version` (one directory per replica)."""
    for lg in trainer.loggers:
        if hasattr(lg, "_version") and lg._version is None:
            lg._version = version


def save_cli_config_once(trainer: Any, writer: bool, overwrite: bool) -> int:
    """LightningCLI's SaveConfigCallback under ft_hsdp: every replica's rank 0 is Lightning's
    global zero, and each would write the job's config.yaml and refuse to start where it
    exists, so the second replica, and every restarted one, failed. The job writes it once:
    only `writer` (replica 0, never a spare) saves it; `overwrite` when that is the job's own
    file again (a restarted incarnation, a resumed job). A first start over another run's
    file still refuses, as under DDP. Returns how many callbacks it set (none without the CLI)."""
    import sys

    cli = sys.modules.get("lightning.pytorch.cli")
    if cli is None:
        return 0
    found = [cb for cb in trainer.callbacks if isinstance(cb, cli.SaveConfigCallback)]
    for cb in found:
        if not writer:
            cb.already_saved = True  # its setup then returns at once
        elif overwrite:
            cb.overwrite = True
    return len(found)


def should_update_logs(trainer: Any) -> bool:
    return bool(trainer._logger_connector.should_update_logs)


def callbacks_state_dict(trainer: Any) -> dict:
    return _call._call_callbacks_state_dict(trainer)


def load_callbacks_state(trainer: Any, states: dict) -> None:
    _call._call_callbacks_load_state_dict(trainer, {"callbacks": states})


def set_progress(trainer: Any, automatic: bool, steps: int, batches: Optional[tuple[int, int, int]] = None,
                 epoch: Optional[int] = None, in_batch: bool = True) -> None:
    """Lightning's counters: `steps` optimizer steps (global_step), and, when given, `batches` =
    (total micro-batches, micro-batches into the current epoch, lag: 1 inside a batch, whose
    processed/completed Lightning increments after us) and the current `epoch`."""
    fit = trainer.fit_loop
    loop = fit.epoch_loop
    if automatic:
        t = loop.automatic_optimization.optim_progress.optimizer.step.total
    else:
        t = loop.manual_optimization.optim_step_progress.total
    t.ready = max(t.ready - t.completed + steps, steps)
    t.completed = steps
    loop._batches_that_stepped = steps
    if batches is None or epoch is None:
        return
    total, current, lag = batches
    for tracker, count in ((loop.batch_progress.total, total), (loop.batch_progress.current, current)):
        tracker.ready = tracker.started = count
        tracker.processed = tracker.completed = max(0, count - lag)
    ep = fit.epoch_progress.current
    ep.ready = ep.started = epoch + 1
    ep.processed = ep.completed = epoch


def checkpoint_batches(checkpoint: dict) -> int:
    """Batches completed, from a Lightning checkpoint's loop state (-1: it has none)."""
    try:
        return int(checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"])
    except (KeyError, TypeError, ValueError):
        return -1


def missing(trainer: Any) -> list[str]:
    """The privates this Lightning lacks, on a (fresh) `trainer` with a CSVLogger
    (tests/strategy/test_lightning_compat.py)."""
    from lightning.pytorch.plugins.precision import Precision

    out = []
    for owner, name in ((Precision, "_after_closure"), (Precision, "_clip_gradients"),
                        (_call, "_call_callbacks_state_dict"), (_call, "_call_callbacks_load_state_dict")):
        if not hasattr(owner, name):
            out.append(f"{getattr(owner, '__name__', owner)}.{name}")
    fit = trainer.fit_loop
    loop = fit.epoch_loop
    for obj, path in ((trainer, "_logger_connector.should_update_logs"), (loop, "val_loop._combined_loader"),
                      (loop, "_batches_that_stepped"), (loop, "batch_progress.total.completed"),
                      (loop, "batch_progress.current.completed"), (fit, "epoch_progress.current.completed"),
                      (loop, "automatic_optimization.optim_progress.optimizer.step.total.completed"),
                      (loop, "manual_optimization.optim_step_progress.total.completed"),
                      (trainer.loggers[0] if trainer.loggers else None, "_version")):
        cur = obj
        for part in path.split("."):
            if cur is None or not hasattr(cur, part):
                out.append(f"{type(obj).__name__}.{path}")
                break
            cur = getattr(cur, part)
    return out


def route_should_stop(trainer: Any, decided: Callable[[Any], Optional[bool]], ask: Callable[[], None]) -> None:
    """Make `trainer.should_stop` a job decision (a run-time class swap: the attribute becomes a
    property on a per-trainer subclass; Lightning itself is unchanged). Reading it gives
    `decided(trainer)` (None: the trainer's own value, before the replica exists); setting it
    True calls `ask()` as well (the replica asks the job to stop in its next report)."""
    cls = type(trainer)
    if getattr(cls, "_ft_routes_should_stop", False):
        return

    def get(tr: Any) -> bool:
        got = decided(tr)
        return bool(tr.__dict__.get("_ft_should_stop", False)) if got is None else got

    def put(tr: Any, value: bool) -> None:
        tr.__dict__["_ft_should_stop"] = bool(value)
        if value:
            ask()

    trainer.__class__ = type(cls.__name__, (cls,), {"should_stop": property(get, put), "_ft_routes_should_stop": True,
                                                    "__module__": cls.__module__})
