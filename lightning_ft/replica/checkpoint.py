"""Persistent checkpoints for whole-job restarts (DESIGN §8).

Layout of `{checkpoint_dir}/step_{n:08d}/`:
- `__{rank}_0.distcp` + `.metadata`: model and optimizer state, sharded, via
  torch.distributed.checkpoint (each rank of the writing replica writes its shard);
- `extra.pt`: everything else the trainer needs (scheduler states, param-group settings);
- `meta.json`: step, cursors of every slot, the quorum that committed the step;
- `manifest.json`, written last and atomically: the sha256 of every other file.

One replica writes: the lowest-id contributor of the step. Writing is asynchronous: the
step only waits while the state is staged (copied) in memory; a background thread writes
files, hashes them, writes the manifest, publishes `ckpt/latest` in etcd and prunes all but
the newest K. A checkpoint without a manifest, or whose files do not match it, does not
exist for `newest_valid`, which names the bad file in its warning.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _atomic_write(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(d: str, step: int) -> dict:
    files = {}
    for name in sorted(os.listdir(d)):
        if name == MANIFEST or name.startswith(".tmp."):
            continue
        files[name] = sha256_file(os.path.join(d, name))
    manifest = {"step": step, "files": files, "time": time.time()}
    _atomic_write(os.path.join(d, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True).encode())
    return manifest


class CheckpointInvalid(Exception):
    pass


def verify(d: str) -> dict:
    """The manifest of checkpoint dir `d`, if every file matches it; else CheckpointInvalid
    naming the bad or missing file."""
    path = os.path.join(d, MANIFEST)
    if not os.path.exists(path):
        raise CheckpointInvalid(f"{d}: no {MANIFEST} (a partial checkpoint: its writer died or is still writing)")
    try:
        manifest = json.load(open(path))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointInvalid(f"{path}: unreadable manifest: {e}") from e
    for name, digest in manifest["files"].items():
        f = os.path.join(d, name)
        if not os.path.exists(f):
            raise CheckpointInvalid(f"{f}: missing")
        if sha256_file(f) != digest:
            raise CheckpointInvalid(f"{f}: sha256 does not match the manifest (corrupted)")
    return manifest


def list_steps(root: str) -> list[int]:
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        if name.startswith("step_"):
            try:
                out.append(int(name[5:]))
            except ValueError:
                pass
    return sorted(out)


def newest_valid(root: str, warn: Callable[[str], None] = log.warning) -> Optional[tuple[int, str]]:
    """(step, dir) of the newest checkpoint under `root` that verifies; the others are skipped
    with a warning naming the bad file."""
    for step in reversed(list_steps(root)):
        d = step_dir(root, step)
        try:
            verify(d)
            return step, d
        except CheckpointInvalid as e:
            warn(f"skipping checkpoint step {step}: {e}")
    return None


def prune(root: str, keep: int) -> list[int]:
    """Delete all but the newest `keep` complete checkpoints (and partial ones older than them)."""
    steps = list_steps(root)
    complete = [s for s in steps if os.path.exists(os.path.join(step_dir(root, s), MANIFEST))]
    if keep <= 0 or len(complete) <= keep:
        return []
    cutoff = complete[-keep]
    gone = [s for s in steps if s < cutoff]
    for s in gone:
        shutil.rmtree(step_dir(root, s), ignore_errors=True)
    return gone


@dataclass
class SaveStats:
    step: int
    stage_s: float
    """Time the training step waited (staging the state in memory)."""
    write_s: float = 0.0
    bytes: int = 0


class CheckpointWriter:
    """Writes checkpoints of one replica (every rank has one; rank 0 finalizes)."""

    def __init__(self, root: str, keep: int, rank: int, pg: Any = None,
                 on_done: Optional[Callable[[int, str, SaveStats], None]] = None) -> None:
        self.root, self.keep, self.rank, self.pg = root, keep, rank, pg
        self.on_done = on_done
        self._thread: Optional[threading.Thread] = None
        self.last: Optional[SaveStats] = None
        self.error: Optional[BaseException] = None

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout_s: Optional[float] = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict,
             meta: dict) -> SaveStats:
        """Stage the state now (the caller's step waits for this), write in the background."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.wait()  # one checkpoint in flight at a time
        t0 = time.perf_counter()
        d = step_dir(self.root, step)
        os.makedirs(d, exist_ok=True)
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
        # Staging: a private CPU copy, so that training may change the live tensors at once.
        staged = _clone(state)
        stats = SaveStats(step, time.perf_counter() - t0)
        self.last = stats
        no_dist = not (torch.distributed.is_available() and torch.distributed.is_initialized())

        def write() -> None:
            t1 = time.perf_counter()
            try:
                dcp.save(staged, checkpoint_id=d, process_group=self.pg, no_dist=no_dist)
                if self.rank == 0:
                    torch.save(extra, os.path.join(d, "extra.pt"))
                    _atomic_write(os.path.join(d, "meta.json"), json.dumps(meta, indent=1, sort_keys=True).encode())
                    write_manifest(d, step)
                    stats.bytes = sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d))
                    stats.write_s = time.perf_counter() - t1
                    prune(self.root, self.keep)
                    if self.on_done is not None:
                        self.on_done(step, d, stats)
            except BaseException as e:  # reported, never raised into training
                self.error = e
                log.error("checkpoint of step %d failed: %s", step, e)

        self._thread = threading.Thread(target=write, name=f"lft-ckpt-{step}", daemon=True)
        self._thread.start()
        return stats


def _clone(obj: Any) -> Any:
    if torch.is_tensor(obj):
        if hasattr(obj, "to_local"):  # DTensor: keep placement, copy the local shard
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(obj.to_local().detach().clone(), obj.device_mesh, obj.placements,
                                      shape=obj.shape, stride=obj.stride())
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone(v) for v in obj)
    return obj


def load(d: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, pg: Any = None) -> dict:
    """Load checkpoint dir `d` into `model` and `optimizer` (in place, sharded as they are);
    returns {"meta": ..., "extra": ...}."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    no_dist = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    dcp.load(state, checkpoint_id=d, process_group=pg, no_dist=no_dist)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"meta": json.load(open(os.path.join(d, "meta.json"))),
            "extra": torch.load(os.path.join(d, "extra.pt"), weights_only=False)}


def seed_job(store: Any, root: str, ckpt: str) -> dict:
    """A whole-job restart from `ckpt` in a fresh job keyspace `root`: the slot cursors are the
    checkpoint's. Returns its meta."""
    from lightning_ft.replica.data import advance_cursor

    meta = json.load(open(os.path.join(ckpt, "meta.json")))
    for slot, k in meta.get("cursors", {}).items():
        advance_cursor(store, root, int(slot), int(k))
    return meta
