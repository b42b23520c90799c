"""Files of a Fabric job under ft_hsdp (docs/ARCHITECTURE.md, "Fabric"): `fabric.save` of a
replica of one process (whole tensors, one file, as Fabric's single-device strategies write),
the job's position in such a checkpoint (`KEY`), and the small JSON records the replicas share
in `{checkpoint dir}/fabric/`: `micro.json` (loader batches per optimizer step) and `saved.json`
(the job's newest `fabric.save`)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from lightning_ft.fabric import compat

KEY = "lightning_ft"
"""The entry a checkpoint written by `fabric.save` under ft_hsdp carries: the job's position
(strategy/resume.py::describe: step, replicas, gen, batches, cursors)."""


def point_of(entry: Any, replicas: int) -> Optional[tuple[int, dict[int, int], str]]:
    """(step, slot cursors, source) of a checkpoint's KEY entry for a job of `replicas`: another R
    has no position in this job's slot streams ("foreign": every slot at the step)."""
    if not isinstance(entry, dict) or "step" not in entry:
        return None
    same = int(entry.get("replicas", -1)) == replicas
    cursors = {int(s): int(k) for s, k in entry.get("cursors", {}).items()} if same else {}
    return int(entry["step"]), cursors, "ft_hsdp" if same else "foreign"


def plain_state(state: dict, filter: Optional[dict[str, Callable[[str, Any], bool]]]) -> dict[str, Any]:
    """What `fabric.save` writes for a replica of one process (no DTensors)."""
    out: dict[str, Any] = {}
    for key, obj in state.items():
        value = obj.state_dict() if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, compat.Stateful)) else obj
        keep = (filter or {}).get(key)
        if keep is not None and isinstance(value, dict):
            value = {k: v for k, v in value.items() if keep(k, v)}
        out[key] = value
    return out


def load_plain(path: Path, state: Any, strict: bool, weights_only: Optional[bool]) -> dict[str, Any]:
    """`fabric.load` of such a file into `state` (a module, or a dict of objects and values);
    returns what the state did not ask for."""
    kwargs = {} if weights_only is None else {"weights_only": weights_only}
    checkpoint = torch.load(path, map_location="cpu", **kwargs)
    if isinstance(state, torch.nn.Module):
        state.load_state_dict(checkpoint, strict=strict)
        return {}
    for key in list(state):
        if key not in checkpoint:
            if strict:
                raise KeyError(f"'{key}' is in the state to load but not in the checkpoint {path}")
            continue
        obj = state[key]
        if isinstance(obj, torch.nn.Module):
            obj.load_state_dict(checkpoint.pop(key), strict=strict)
        elif isinstance(obj, (torch.optim.Optimizer, compat.Stateful)):
            obj.load_state_dict(checkpoint.pop(key))
        else:
            state[key] = checkpoint.pop(key)
    return checkpoint


def write_json(directory: str, name: str, obj: dict) -> None:
    """One record, replaced atomically (its time added)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({**obj, "t": time.time()}, f)
    os.replace(tmp, path)


def read_json(directory: str, name: str) -> dict[str, Any]:
    """A record, or {} when there is none yet."""
    try:
        with open(os.path.join(directory, name)) as f:
            out = json.load(f)
        return out if isinstance(out, dict) else {}
    except (OSError, ValueError):
        return {}
