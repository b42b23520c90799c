"""A Fabric loop's own state, carried to a late replica (docs/ARCHITECTURE.md, "Fabric").

A Fabric loop keeps its state in one dict, the one it passes to `fabric.save` and
`fabric.load`: LitGPT's is `{"model", "optimizer", "train_dataloader", "iter_num",
"step_count"}`, and it computes its learning rate from `iter_num`. The replica layer carries
the model and optimizer to a late replica (catch-up); this module carries the rest:

- **Registration.** The strategy learns the dict when the loop calls `fabric.save` or
  `fabric.load` with it (`register`).
- **Snapshots.** Once registered, at the first batch of every step (the top of the loop: the
  previous step's bookkeeping is done) the replica's leader writes the dict's plain values,
  the states of its other stateful objects (schedulers) and the optimizer's param-group
  hyperparameters (lr: a loop or scheduler sets them) to `{dir}/r{rid}.pt`, keyed by the job's
  committed step; the newest `KEEP` steps stay.
- **Fill.** A replica that took the job's state at committed step S (`fabric.load` on a
  restarted or late replica) waits for any replica's snapshot at S, which comes when that
  replica's loop starts step S+1 (the job waits for the new member's first report meanwhile),
  and puts the values in its own dict: the loop continues at the job's step, with its
  counters, hence the same learning rate.

Values travel through torch.save and load with `weights_only=True` (numbers, strings,
tensors, containers); an entry that cannot is left out, and a warning names it.
"""
from __future__ import annotations

import io
import logging
import os
import time
from typing import Any, Callable, Optional

import torch

log = logging.getLogger("lightning_ft.fabric")

KEEP = 16
"""Snapshots per replica file: a late replica reads the one at its step within this many steps."""


def _is_object(value: Any) -> bool:
    """A model, an optimizer or a data loader: the replica layer carries their state itself."""
    from torch.utils.data import DataLoader

    from lightning_ft.fabric import compat
    from lightning_ft.fabric.loader import TrainLoader

    value = compat.unwrap(value)
    return isinstance(value, (torch.nn.Module, torch.optim.Optimizer, DataLoader, TrainLoader))


def _travels(value: Any) -> bool:
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    except Exception:
        return False
    return True


def payload_of(state: dict, optimizer: Any, skip: set[str]) -> dict[str, Any]:
    """What a late replica takes from this loop: plain values, other stateful objects' states,
    the optimizer's param-group hyperparameters."""
    from lightning_ft.fabric import compat

    plain, stateful = {}, {}
    for key, value in state.items():
        if key in skip or _is_object(value):
            continue
        if isinstance(value, compat.Stateful):
            stateful[key] = value.state_dict()
        else:
            plain[key] = value
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"plain": plain, "stateful": stateful, "groups": groups}


def fill(target: dict, payload: dict[str, Any], optimizer: Any) -> list[str]:
    """Put a snapshot into the loop's dict (plain values replaced, stateful objects loaded) and
    its hyperparameters into the optimizer. Returns the keys it set."""
    done = []
    for key, value in payload["plain"].items():
        target[key] = value
        done.append(key)
    for key, value in payload["stateful"].items():
        if key in target and hasattr(target[key], "load_state_dict"):
            target[key].load_state_dict(value)
            done.append(key)
    for group, src in zip(optimizer.param_groups, payload["groups"], strict=False):
        group.update(src)
    return done


class LoopState:
    """The registered dict of one process and its snapshots (see the module docstring)."""

    def __init__(self, directory: str, rid: int, writes: bool) -> None:
        self.dir = directory
        self.rid = rid
        self.writes = writes
        """This process writes its replica's snapshots (the leader)."""
        self.state: Optional[dict] = None
        self._skip: set[str] = set()
        self._snaps: dict[int, dict] = {}
        self._changed = False
        self._warned = False

    @property
    def registered(self) -> bool:
        return self.state is not None

    def register(self, state: Optional[dict], optimizer: Any) -> None:
        """The loop's dict (from `fabric.save` / `fabric.load`); entries that cannot travel are
        named once."""
        if state is None or state is self.state:
            return
        self.state = state
        probe = payload_of(state, optimizer, set())
        bad = [k for part in ("plain", "stateful") for k, v in probe[part].items() if not _travels(v)]
        self._skip = set(bad)
        if bad and self.writes:
            log.warning("ft_hsdp: the loop's state entries %s cannot be carried to a late replica (torch.load with "
                        "weights_only=True refuses them); a restarted replica keeps its own values of them", bad)

    def snapshot(self, step: int, optimizer: Any) -> None:
        """The top of the loop at committed step `step`: keep (and, the leader, write) the values."""
        if self.state is None:
            return
        payload = payload_of(self.state, optimizer, self._skip)
        prev = self._snaps.get(max(self._snaps)) if self._snaps else None
        if prev is not None and max(self._snaps) < step:
            self._changed |= _encode(prev["plain"]) != _encode(payload["plain"]) or \
                _encode(prev["stateful"]) != _encode(payload["stateful"])
            if len(self._snaps) >= 2 and not self._changed and not self._warned and self.writes:
                self._warned = True
                log.warning("ft_hsdp: nothing in the state dict this loop passes to fabric.save/load changes from "
                            "step to step. A loop that keeps its step count (and the learning rate computed from "
                            "it) outside that dict cannot continue at the job's step on a restarted replica: put "
                            "the counters in the dict, as LitGPT does (iter_num, step_count)")
        self._snaps[step] = payload
        for old in sorted(self._snaps)[:-KEEP]:
            del self._snaps[old]
        if self.writes:
            os.makedirs(self.dir, exist_ok=True)
            path = os.path.join(self.dir, f"r{self.rid}.pt")
            tmp = f"{path}.tmp{os.getpid()}"
            torch.save({"snaps": self._snaps}, tmp)
            os.replace(tmp, path)

    def wait(self, step: int, timeout_s: float, abandon: Callable[[], Optional[str]]) -> dict[str, Any]:
        """Any replica's snapshot at committed step `step` (its loop starts step + 1 within one step
        time). `abandon()` returns a reason to stop waiting (the job finished), else None."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.read(step)
            if found is not None:
                return found
            why = abandon()
            if why or time.monotonic() > deadline:
                raise TimeoutError(why or f"no replica wrote its loop state at step {step} within {timeout_s:.0f}s")
            time.sleep(0.02)

    def read(self, step: int) -> Optional[dict[str, Any]]:
        names = sorted(os.listdir(self.dir)) if os.path.isdir(self.dir) else []
        for name in names:
            if not (name.startswith("r") and name.endswith(".pt")):
                continue
            try:
                snaps = torch.load(os.path.join(self.dir, name), weights_only=True)["snaps"]
            except (OSError, EOFError, RuntimeError, KeyError, ValueError):
                continue  # replaced while we read it: the next poll reads the new one
            if step in snaps:
                return snaps[step]
        return None


def _encode(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()
