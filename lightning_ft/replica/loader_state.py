"""Loader states of stateful train streams (docs/ARCHITECTURE.md, "Exactly once: streams").

A stream loader (torchdata's `StatefulDataLoader`, litdata's `StreamingDataLoader`, anything with
`state_dict()` / `load_state_dict()`) has no sample index to seek to, so slot s's batch k is "the
k-th slot batch of that rank's stream", and a rank resumes its stream at cursor k from the
loader's state taken right after it delivered batch k-1 (the paper's `loader_state`).

Where the states live: in files, one directory per (slot, rank), next to the checkpoints
(`{checkpoint dir}/loader_state/slot_SSS/rank_RRR/`), not in etcd:
- a state is whatever the user's dataset returns (a shuffle buffer, a tokenizer's carry-over):
  kilobytes to megabytes, while etcd values are small (1.5 MiB per request) and every byte in
  etcd goes through raft and stays in its history;
- every rank writes its own file, in parallel, from a background thread: no gather inside the
  replica and no leader on the step's path;
- a rewind needs every slot's state at the checkpoint's cursors, and every replica already reaches
  the checkpoint directory (a rewind's source loads a checkpoint another replica wrote).

A file is named by the cursor it resumes at, `c{cursor:012d}.pt`; at a checkpoint step T each
replica also pins its slot's state at its cursor as `c{cursor:012d}.step{T:012d}.pt`, so that a
checkpoint's `cursors` always have a state. The stream is deterministic (batch k of a slot is the
same batch whichever generation asks for it), so a state is valid for its cursor forever; a
restore takes the newest state at or below the wanted cursor and skips the difference by reading
(correct with any state, only slower: the etcd cursor, not the files, says where a slot is).

The decisions (which file, which files to prune, where the stream must be) are pure functions
below; `StateFiles` does the I/O and `StateWriter` moves it off the training thread.
"""
from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import torch

from lightning_ft.replica.checkpoint import _atomic_torch_save
from lightning_ft.threads import Thread

log = logging.getLogger(__name__)

FORMAT = 1
_NAME = re.compile(r"^c(\d{12})(?:\.step(\d{12}))?\.pt$")


@dataclass(frozen=True)
class StateFile:
    cursor: int
    """The slot batch this state resumes at (the state after batch cursor-1)."""
    step: Optional[int] = None
    """The checkpoint step this state is pinned for (None: a rolling state)."""


def _key(f: StateFile) -> tuple[int, int]:
    return f.cursor, -1 if f.step is None else f.step


def file_name(f: StateFile) -> str:
    return f"c{f.cursor:012d}" + ("" if f.step is None else f".step{f.step:012d}") + ".pt"


def parse_name(name: str) -> Optional[StateFile]:
    m = _NAME.match(name)
    if m is None:
        return None
    return StateFile(int(m.group(1)), None if m.group(2) is None else int(m.group(2)))


# -- pure decisions ---------------------------------------------------------------------------------------------


def pick(files: Iterable[StateFile], want: int) -> Optional[StateFile]:
    """The state to restore for cursor `want`: the newest at or below it (None: start fresh)."""
    best = [f for f in files if f.cursor <= want]
    return max(best, key=_key) if best else None


def to_prune(files: Iterable[StateFile], current: int, keep: int, pins: int) -> list[StateFile]:
    """Files to delete when the slot's cursor is `current`: rolling states at or below it except
    the newest `keep`, and pinned states except those of the newest `pins` checkpoint steps.
    Rolling states above `current` (a future a rewind discarded) stay: they are still valid."""
    files = list(files)
    rolling = sorted((f for f in files if f.step is None and f.cursor <= current), key=_key, reverse=True)
    steps = sorted({f.step for f in files if f.step is not None}, reverse=True)[:max(0, pins)]
    pinned = [f for f in files if f.step is not None and f.step not in steps]
    return rolling[max(0, keep):] + pinned


def next_position(cursor: int, micro: int, pending: Sequence[int], in_window: Optional[int] = None) -> int:
    """Where a rank's stream must deliver next, in micro-batch positions (slot batch k, micro j =
    position k*micro + j), so that what it delivers is trained rather than discarded.

    `cursor`: the slot's next batch to train; `pending`: positions already delivered to the
    trainer and not yet taken (prefetched), in order; `in_window`: the last position the
    trainer took, if its accumulation window is still open. The delivered positions that
    continue the slot's stream from the cursor will train; the first one that does not (a
    rewind moved the cursor back, or a catch-up moved it past) and everything after it will
    be discarded, so the stream continues where the valid chain ends."""
    expected = cursor * micro
    if in_window is not None and in_window // micro == cursor:
        expected = max(expected, in_window + 1)
    for p in pending:
        if p != expected:
            break
        expected += 1
    return expected


# -- files ------------------------------------------------------------------------------------------------------


class StateFiles:
    """The loader-state files of one (slot, rank) of a job."""

    def __init__(self, root: str, slot: int, rank: int, *, slots: int, world: int, keep: int = 3,
                 pins: int = 4) -> None:
        self.slot, self.rank, self.slots, self.world = slot, rank, slots, world
        self.keep, self.pins = keep, pins
        self.dir = os.path.join(root, f"slot_{slot:03d}", f"rank_{rank:03d}")

    def list(self) -> list[StateFile]:
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return sorted((f for f in map(parse_name, names) if f is not None), key=_key)

    def save(self, f: StateFile, state: Any) -> str:
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, file_name(f))
        _atomic_torch_save({"format": FORMAT, "slot": self.slot, "rank": self.rank, "slots": self.slots,
                            "world": self.world, "cursor": f.cursor, "step": f.step, "state": state}, path)
        return path

    def load(self, f: StateFile) -> Any:
        """The state of file `f`; ValueError if it belongs to another slot, rank or job shape."""
        path = os.path.join(self.dir, file_name(f))
        # The job's own files (like Lightning checkpoints): a loader state may hold any picklable object.
        rec = torch.load(path, map_location="cpu", weights_only=False)
        want = {"format": FORMAT, "slot": self.slot, "rank": self.rank, "slots": self.slots, "world": self.world,
                "cursor": f.cursor}
        got = {k: rec.get(k) for k in want}
        if got != want:
            raise ValueError(f"loader state {path} is for {got}, not {want}: written by a job of another shape "
                             f"(replicas, nproc_per_replica); use a fresh data.state_dir for this job")
        return rec["state"]

    def newest_at_most(self, want: int) -> Optional[tuple[StateFile, Any]]:
        """The newest loadable state at or below cursor `want` (unreadable files are skipped, with a warning)."""
        files = self.list()
        while True:
            f = pick(files, want)
            if f is None:
                return None
            try:
                return f, self.load(f)
            except Exception as e:  # a foreign or damaged file: fall back to an older state, never fail the step
                log.warning("slot %d rank %d: cannot use loader state %s: %s", self.slot, self.rank, file_name(f), e)
                files = [g for g in files if g != f]

    def prune(self, current: int) -> None:
        for f in to_prune(self.list(), current, self.keep, self.pins):
            try:
                os.unlink(os.path.join(self.dir, file_name(f)))
            except FileNotFoundError:
                pass


class StateWriter:
    """Writes loader states from a background thread. Rolling states coalesce (only the newest
    pending one is written: a slow file system never holds up a step); pinned ones are all written."""

    def __init__(self, files: StateFiles) -> None:
        self.files = files
        self._cv = threading.Condition()
        self._rolling: Optional[tuple[StateFile, Any]] = None
        self._pinned: list[tuple[StateFile, Any]] = []
        self._busy = False
        self._closed = False
        self.written = 0
        self.errors = 0
        self._thread = Thread(target=self._run, name=f"lft-loader-state-s{files.slot}r{files.rank}",
                                        daemon=True)
        self._thread.start()

    def submit(self, f: StateFile, state: Any) -> None:
        with self._cv:
            if f.step is None:
                self._rolling = (f, state)
            else:
                self._pinned.append((f, state))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._rolling or self._pinned or self._closed):
                    self._cv.wait()
                if not (self._rolling or self._pinned):
                    return
                batch, self._pinned = self._pinned, []
                if self._rolling is not None:
                    batch.append(self._rolling)
                    self._rolling = None
                self._busy = True
            try:
                for f, state in batch:
                    self.files.save(f, state)
                    self.written += 1
                self.files.prune(max(f.cursor for f, _ in batch))
            except Exception as e:  # a full disk must not stop training: a restart then skips a little further
                self.errors += 1
                log.warning("slot %d rank %d: could not write loader state: %s", self.files.slot, self.files.rank, e)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything submitted is on disk; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not (self._rolling or self._pinned or self._busy), timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        self.flush(timeout_s)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout_s)
