"""Every Lightning Fabric private (and the one Python private) the Fabric strategy uses, in one
place (docs/ARCHITECTURE.md, "Fabric"). A release that moves one breaks us here only, and
tests/fabric/test_fabric_units.py::test_fabric_privates_exist names it.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Optional

from lightning.fabric import Fabric
from lightning.fabric.strategies.model_parallel import (_METADATA_FILENAME, _is_full_checkpoint,
                                                        _is_sharded_checkpoint, _load_checkpoint, _save_checkpoint)
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.types import _Stateful
from lightning.fabric.wrappers import _unwrap_objects
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

METADATA_FILENAME = _METADATA_FILENAME
is_full_checkpoint = _is_full_checkpoint
is_sharded_checkpoint = _is_sharded_checkpoint
save_sharded = _save_checkpoint
"""ModelParallelStrategy's save of an FSDP2 model, called with the replica's own rank."""
load_sharded = _load_checkpoint
materialize = _materialize_distributed_module
Stateful = _Stateful
unwrap = _unwrap_objects

PRIVATES: dict[str, str] = {
    "model_parallel._save_checkpoint / _load_checkpoint": "fabric.save / load of an FSDP2 model by the replica's "
                                                         "own ranks (the strategy's global rank is the job's)",
    "model_parallel._is_full_checkpoint / _is_sharded_checkpoint / _METADATA_FILENAME": "a checkpoint's layout",
    "utilities.init._materialize_distributed_module": "fabric.init_module(empty_init=True) models",
    "utilities.types._Stateful": "which entries of a loop's state have state_dict/load_state_dict",
    "wrappers._unwrap_objects": "the loop's objects behind Fabric's wrappers",
    "Fabric.save / Fabric.load: their local `state`": "the loop's own state dict (Fabric hands strategies a copy)",
    "threading._register_atexit": "the end of the loop: close the replica before Python joins its threads",
}


def caller_state(method: str) -> Optional[dict]:
    """The state dict the program passed to `Fabric.save` or `Fabric.load` (`method`): Fabric gives
    the strategy a copy with its wrappers removed, and a loop's counters change in its own dict.
    None when the strategy was not called from there."""
    code = getattr(Fabric, method).__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            state = frame.f_locals.get("state")
            return state if isinstance(state, dict) else None
        frame = frame.f_back  # type: ignore[assignment]
    return None


def set_rank_zero(zero: bool, rank: int) -> None:
    """Whether this process logs (`fabric.log_dict`, rank-zero warnings): Fabric's loggers ask
    `rank_zero_only.rank`."""
    rank_zero_only.rank = utils_rank_zero_only.rank = 0 if zero else max(1, rank)  # type: ignore[attr-defined]


def at_main_exit(fn: Callable[[], Any]) -> None:
    """Call `fn` when the main thread ends, before Python joins the other threads (the replica
    layer's pools would hold the exit); `atexit` runs only after that join."""
    threading._register_atexit(fn)  # type: ignore[attr-defined]


def exited_by_exception() -> bool:
    """At the main thread's end: did an exception end the program? (Python sets sys.last_value
    when it prints an unhandled one.)"""
    return getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None


def missing() -> list[str]:
    """The privates above that the installed Lightning lacks."""
    out = []
    for name in ("save", "load"):
        if "state" not in getattr(Fabric, name).__code__.co_varnames:
            out.append(f"Fabric.{name} has no local `state`")
    if not hasattr(threading, "_register_atexit"):
        out.append("threading._register_atexit")
    return out
