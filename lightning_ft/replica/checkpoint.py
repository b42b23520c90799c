"""Persistent checkpoints for whole-job restarts (docs/ARCHITECTURE.md, "Checkpoints").

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
from lightning_ft.threads import Thread

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


def fsync_dir(d: str) -> None:
    """Make the directory's entries (creations, renames) durable."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _atomic_write(path: str, data: bytes) -> None:
    """Write a file so that a crash leaves either the old one or the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def _atomic_torch_save(obj: Any, path: str) -> None:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    _atomic_write(path, buf.getvalue())


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
        if os.path.exists(path + ".suspect"):
            raise CheckpointInvalid(f"{d}: set aside when the job halted on diverged replica states "
                                    f"({MANIFEST}.suspect); it may hold the corruption")
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


def _signature(d: str, manifest: dict) -> Optional[tuple]:
    """(name, inode, size, mtime) of the manifest and of every file it names; None if one is gone."""
    out = []
    for name in [MANIFEST, *sorted(manifest["files"])]:
        try:
            st = os.stat(os.path.join(d, name))
        except OSError:
            return None
        out.append((name, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


_verified: dict[str, tuple] = {}
"""Checkpoint dir -> the signature of its files when this process last verified it (or wrote it)."""
_verified_lock = threading.Lock()


def verify_cached(d: str) -> dict:
    """verify(d), but trusting this process's own earlier verification of the same files: if
    the manifest and every file it names are the same inode, size and mtime as then, they are
    not hashed again. For pruning, which runs after every save and would otherwise rehash all
    K kept checkpoints each time; a restore always calls verify()."""
    path = os.path.join(d, MANIFEST)
    with _verified_lock:
        known = _verified.get(d)
    if known is not None:
        try:
            manifest = json.load(open(path))
        except (OSError, json.JSONDecodeError):
            manifest = None
        if manifest is not None and _signature(d, manifest) == known:
            return manifest
    manifest = verify(d)
    _remember(d, manifest)
    return manifest


def _remember(d: str, manifest: dict) -> None:
    sig = _signature(d, manifest)
    with _verified_lock:
        if sig is None:
            _verified.pop(d, None)
        else:
            _verified[d] = sig


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


def prune(root: str, keep: int, protect: int = -1) -> list[int]:
    """Delete all but the newest `keep` checkpoints that *verify* (and partial or corrupted
    ones older than them). A checkpoint is removed only once `keep` newer ones verified, and
    the newest verified one at or below `protect` (the newest step whose replica digests
    agreed) is never removed."""
    steps = list_steps(root)
    good = []
    for s in reversed(steps):
        try:
            verify_cached(step_dir(root, s))
            good.append(s)
        except CheckpointInvalid:
            continue
        if len(good) == keep:
            break
    if keep <= 0 or len(good) < keep:
        return []
    cutoff = good[-1]
    keep_too = None
    if protect >= 0 and not any(s <= protect for s in good):  # none of the kept ones is known consistent
        keep_too = max((s for s in steps if s <= protect and s < cutoff and _has_manifest(root, s)), default=None)
    gone = [s for s in steps if s < cutoff and s != keep_too]
    for s in gone:
        shutil.rmtree(step_dir(root, s), ignore_errors=True)
        with _verified_lock:
            _verified.pop(step_dir(root, s), None)
    if gone:
        fsync_dir(root)
    return gone


def _has_manifest(root: str, step: int) -> bool:
    return os.path.exists(os.path.join(step_dir(root, step), MANIFEST))


# -- publication in etcd, and what rewinds and halts do to checkpoints -------------------------------

def publish(store: Any, root: str, step: int, path: str, gen: int) -> None:
    """Announce a complete checkpoint: `ckpt/steps/{step}` (rewinds choose among these) and
    `ckpt/latest`."""
    from lightning_ft.coord import keys

    rec = json.dumps({"step": step, "path": os.path.abspath(path), "gen": gen}).encode()
    store.put(keys.ckpt(root, step), rec)
    store.put(keys.ckpt_latest(root), rec)


def unpublish_missing(store: Any, root: str, ckpt_root: str) -> None:
    """Drop the `ckpt/steps/` keys of checkpoints pruned from disk."""
    from lightning_ft.coord import keys

    kvs, _ = store.get_prefix(keys.ckpts(root))
    for kv in kvs:
        step = int(json.loads(kv.value)["step"])
        if not os.path.isdir(step_dir(ckpt_root, step)):
            store.delete(kv.key)


def supersede(store: Any, root: str, ckpt_root: str, to_step: int, gen: int) -> list[int]:
    """A rewind to `to_step` started generation `gen`: checkpoints of later steps hold a
    discarded history. Unpublish them and rename their directories out of the way
    (`step_N.superseded-gG`), so that neither a later rewind nor `--resume` picks them."""
    from lightning_ft.coord import keys

    kvs, _ = store.get_prefix(keys.ckpts(root))
    for kv in kvs:
        if int(json.loads(kv.value)["step"]) > to_step:
            store.delete(kv.key)
    moved = []
    for s in list_steps(ckpt_root):
        if s > to_step:
            d = step_dir(ckpt_root, s)
            try:
                os.replace(d, f"{d}.superseded-g{gen}")
                moved.append(s)
            except OSError as e:
                log.warning("could not set aside superseded checkpoint %s: %s", d, e)
    if moved:
        fsync_dir(ckpt_root)
    return moved


def invalidate_after(ckpt_root: str, verified_step: int) -> list[int]:
    """The job halted on diverged states: checkpoints newer than the last step whose digests
    agreed may hold the corruption. Rename their manifests (`manifest.json.suspect`), so
    `--resume` skips them and names why."""
    gone = []
    for s in list_steps(ckpt_root):
        m = os.path.join(step_dir(ckpt_root, s), MANIFEST)
        if s > verified_step and os.path.exists(m):
            try:
                os.replace(m, m + ".suspect")
                gone.append(s)
            except OSError:
                pass  # another replica renamed it first
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
        self.protect = -1
        """The newest step whose replica digests agreed (pruning keeps a checkpoint at or below it)."""
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
        if self.rank == 0 and os.path.isdir(d):  # a leftover (partial) checkpoint of this step
            shutil.rmtree(d, ignore_errors=True)
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
                for name in os.listdir(d):  # every rank makes its own shard durable
                    if name.endswith(".distcp") or name == ".metadata":
                        fsync_file(os.path.join(d, name))
                if self.pg is not None:
                    torch.distributed.barrier(group=self.pg)
                if self.rank == 0:
                    _atomic_torch_save(extra, os.path.join(d, "extra.pt"))
                    _atomic_write(os.path.join(d, "meta.json"), json.dumps(meta, indent=1, sort_keys=True).encode())
                    _remember(d, write_manifest(d, step))  # it hashed the files it just wrote
                    fsync_dir(self.root)
                    stats.bytes = sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d))
                    stats.write_s = time.perf_counter() - t1
                    prune(self.root, self.keep, self.protect)
                    if self.on_done is not None:
                        self.on_done(step, d, stats)
            except BaseException as e:  # reported, never raised into training
                self.error = e
                log.error("checkpoint of step %d failed: %s", step, e)

        self._thread = Thread(target=write, name=f"lft-ckpt-{step}", daemon=True)
        self._thread.start()
        return stats


def _clone(obj: Any) -> Any:
    if torch.is_tensor(obj):
        if hasattr(obj, "to_local"):  # DTensor: keep placement, copy the local shard
            from torch.distributed.tensor import DTensor

            assert isinstance(obj, DTensor)
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
    state: dict[str, Any] = {"model": msd, "optim": osd}
    no_dist = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    dcp.load(state, checkpoint_id=d, process_group=pg, no_dist=no_dist)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"meta": json.load(open(os.path.join(d, "meta.json"))),
            "extra": torch.load(os.path.join(d, "extra.pt"), weights_only=True)}


def restart_job(store: Any, root: str, ckpt: Optional[str]) -> dict:
    """A whole-job restart (`--resume`, or the restart-the-world baseline) in the job's keyspace.

    Everything about the running job goes (members, evictions, quorums, `finished`, `halt`,
    the config fingerprint); the ledger, its generations and the published checkpoints stay.
    A new history generation starts at the checkpoint's step with its slot cursors (step 0
    and zero cursors without a checkpoint), so commits after it are superseded and the final
    history stays exactly once across the restart. Returns the generation's record."""
    from lightning_ft.coord import keys
    from lightning_ft.replica.ledger import latest_gen, read_rewinds, seed_generation

    for prefix in (keys.members(root), keys.alive(root), keys.addrs(root), keys.evict(root), f"{root}left/",
                   keys.quorum(root), f"{root}eval/", keys.done(root)):
        store.delete_prefix(prefix)
    for key in (keys.finished(root), keys.halt(root), keys.config(root)):
        store.delete(key)
    old, _ = store.get_prefix(keys.commits(root))
    rewinds = read_rewinds(store, root)
    if ckpt is not None:
        meta = json.load(open(os.path.join(ckpt, "meta.json")))
    else:
        meta = {"step": 0, "cursors": {}}
    if not old and not rewinds:  # a fresh keyspace (e.g. a new etcd): generation 0 starts here
        gen, came_from = 0, None
    else:
        gen = latest_gen(store, root) + 1
        steps = [keys.parse_commit(root, kv.key)[1] for kv in old if keys.parse_commit(root, kv.key)[0] == gen - 1]
        came_from = max(steps) + 1 if steps else None
    info: dict[str, Any] = {"resumed_from": os.path.abspath(ckpt) if ckpt else "", "checkpoint": ckpt or ""}
    if came_from is not None:
        info["from"] = came_from
    seed_generation(store, root, gen, int(meta["step"]), {int(s): int(k) for s, k in meta.get("cursors", {}).items()},
                    **info)
    if ckpt is not None:  # the generation's base: a rewind before the next checkpoint finds it
        publish(store, root, int(meta["step"]), ckpt, gen)
    return {"gen": gen, "to": int(meta["step"]), **info}
