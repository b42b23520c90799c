"""Exactly-once training from stream loaders (docs/ARCHITECTURE.md, "Exactly once: streams").

A train loader over an `IterableDataset` has no sample index, so the strategy cannot build
its batches as it does for map-style datasets (sampler.py). Instead each rank keeps the
user's loader, split to its own part of the stream (data_shards.py), and `StreamLoader`
wraps it:

- slot s's batch k is the k-th slot batch (N micro-batches under accumulation) of each rank's
  stream; every delivered micro-batch pushes its tag (k, j) for the strategy, as sampler.py does;
- right after a slot batch is delivered, the loader's `state_dict()` is the state to resume at
  cursor k + 1; when a step commits, the state at the slot's new cursor is written to the
  loader-state files (replica/loader_state.py) from a background thread, and pinned at
  checkpoint steps so that a rewind finds every slot's state at the checkpoint's cursors;
- before each delivery the stream is where `next_position` says the trainer needs it (the
  cursor, after what is already prefetched); when it is not (a restarted replica, a rewind, a
  catch-up that moved the cursor past prefetched batches), it is restored from the newest state
  at or below that position (in memory, or from the files) and skips the rest by reading;
- inner epochs are chained: when the user's loader ends, the next pass starts at once, so
  Lightning sees one endless stream (bound training with `max_steps`).

A loader without `state_dict()` cannot be put back where a slot left off: it is refused
unless `data.exactly_once=false`, which trains it at-least-once (a restarted replica reads its
part from the beginning again) and says so at start.
"""
from __future__ import annotations

import collections
import copy
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from torch.utils.data import DataLoader

from lightning_ft.replica.loader_state import StateFile, StateFiles, StateWriter, next_position
from lightning_ft.strategy.data_shards import _stateful, litdata_world, shard

log = logging.getLogger(__name__)

STATEFUL_LOADERS = ("torchdata.stateful_dataloader.StatefulDataLoader",
                    "litdata.StreamingDataLoader (over a litdata.StreamingDataset)")


class StreamDataError(RuntimeError):
    """A train stream that ft_hsdp cannot train exactly once, with what to do."""


class _Tags(collections.deque):
    """The FIFO of delivered tags (k, j); remembers the last one the trainer took."""

    def __init__(self) -> None:
        super().__init__()
        self.taken: Optional[tuple[int, int]] = None

    def popleft(self) -> tuple[int, int]:
        self.taken = super().popleft()
        return self.taken


@dataclass(frozen=True)
class StreamPart:
    """Which part of the stream one rank reads, and how its batches are counted: rank `rank` of
    the `world` ranks of slot `slot` of `slots` (data_shards.py), `micro` micro-batches per slot
    batch (gradient accumulation)."""

    slot: int
    rank: int
    world: int
    slots: int
    micro: int

    def __post_init__(self) -> None:
        if self.slots < 1 or self.world < 1 or self.micro < 1:
            raise ValueError(f"a stream part needs slots, world and micro >= 1, not slots={self.slots} "
                             f"world={self.world} micro={self.micro}")
        if not (0 <= self.slot < self.slots and 0 <= self.rank < self.world):
            raise ValueError(f"slot {self.slot} of {self.slots}, rank {self.rank} of {self.world}: "
                             f"out of range")


class StreamLoader:
    """One rank's exactly-once view of a stream loader (the strategy's `sampler`).

    Args:
        loader: the user's loader, already split to this rank's part (data_shards.shard).
        part: this rank's slot and rank, and the micro-batches per slot batch (`StreamPart`).
        cursor: the slot's cursor now (the next slot batch the trainer needs).
        files: the loader-state files (None: states are kept in memory only).
        state_every: write the state at steps divisible by this (0: at checkpoint steps only).
        checkpoint_every: pin the state at these steps (checkpoint.every_n_steps; 0: none).
        say: where messages to the user go.
    """

    def __init__(self, loader: Any, part: StreamPart, *, cursor: Callable[[], int], files: Optional[StateFiles],
                 state_every: int = 1, checkpoint_every: int = 0, say: Callable[[str], None] = print) -> None:
        self.loader, self.part = loader, part
        self.slot, self.rank, self.world, self.slots = part.slot, part.rank, part.world, part.slots
        self.micro, self._cursor = part.micro, cursor
        self.stateful = _stateful(loader)
        """False: at-least-once (`stream_loader` refuses such a loader unless data.exactly_once=false)."""
        self.files = files if self.stateful else None
        self.writer = StateWriter(self.files) if self.files is not None else None
        self.state_every, self.checkpoint_every = state_every, checkpoint_every
        self.say = say
        self.tags = _Tags()
        self._it: Optional[Iterator[Any]] = None
        self._pos: Optional[int] = None
        """The micro-batch position the live iterator delivers next (None: no iterator yet)."""
        self._mem: dict[int, Any] = {}
        """cursor -> loader state that resumes there (taken in this process)."""
        self._saved: set[StateFile] = set()
        self._pins: dict[int, Any] = {}
        """cursor -> the states pinned at the last checkpoint steps (a rewind in this process needs no file)."""
        self._pristine = _pristine_state(loader) if self.stateful else None
        self._warned = False
        self.restores = 0
        self.skipped = 0

    # -- the interface sampler.py's FTBatchSampler offers the strategy --------------------------------------------
    def steps_per_epoch(self) -> int:
        return 0  # an endless stream: epochs are not counted (the user loader's own passes are chained)

    def restart(self) -> None:
        """A rewind moved the cursor back: nothing to do here, every delivery checks the position."""

    # -- commits --------------------------------------------------------------------------------------------------
    def committed(self, step: int, cursor: int) -> None:
        """A step committed and the slot's cursor is `cursor`: write its state when due."""
        if self.writer is None:
            return
        pin = self.checkpoint_every > 0 and step % self.checkpoint_every == 0
        due = pin or (self.state_every > 0 and step % self.state_every == 0)
        state = self._mem.get(cursor)
        if due and state is not None:
            f = StateFile(cursor, step if pin else None)
            if f not in self._saved:
                self._saved.add(f)
                self.writer.submit(f, state)
            if pin:
                self._pins[cursor] = state
                for old in sorted(self._pins)[:-2]:
                    del self._pins[old]
        for k in [k for k in self._mem if k < cursor]:
            del self._mem[k]
        if len(self._saved) > 64:
            self._saved = {f for f in self._saved if f.cursor >= cursor}

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self._it = None

    # -- the stream -----------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        self.tags.clear()  # a new pass of Lightning's: what it held is gone
        self.tags.taken = None
        empty = 0
        while True:
            taken = self.tags.taken
            want = next_position(self._cursor(), self.micro, [k * self.micro + j for k, j in self.tags],
                                 None if taken is None else taken[0] * self.micro + taken[1])
            if self._pos != want:
                self._seek(want)
            assert self._it is not None and self._pos is not None  # _seek made the iterator; _pos is its position
            try:
                batch = next(self._it)
            except StopIteration:  # the user loader's pass ended: start its next one
                empty += 1
                if empty > 2:  # one empty pass is normal: a state taken at the end of a pass resumes there
                    raise StreamDataError(f"slot {self.slot} rank {self.rank}: the train loader delivers no batch "
                                          f"(three passes in a row were empty): is this process's part of the "
                                          f"stream empty?") from None
                self._it = iter(self.loader)
                continue
            empty = 0
            pos = self._pos
            self._pos = pos + 1
            self._remember(self._pos)
            self.tags.append(divmod(pos, self.micro))
            yield batch

    def _remember(self, pos: int) -> None:
        if self.stateful and pos % self.micro == 0:  # a slot batch ends: the state resumes at the next one
            self._mem[pos // self.micro] = copy.deepcopy(self.loader.state_dict())

    def _seek(self, want: int) -> None:
        """Put the stream at micro-batch position `want`."""
        k, j = divmod(want, self.micro)
        if not self.stateful:
            if self._it is None:
                self._it = iter(self.loader)
            elif not self._warned:
                self._warned = True
                self.say(f"lightning-ft: replica {self.slot}: data.exactly_once=false: the stream cannot go back to "
                         f"slot batch {k}; it continues where it is (at-least-once)")
            self._pos = want
            return
        t0 = time.perf_counter()
        mem = {**self._pins, **self._mem}
        c = max((c for c in mem if c <= k), default=-1)
        source: str | StateFile
        state, source = mem.get(c), f"the state kept in memory at slot batch {c}"
        found = self.files.newest_at_most(k) if self.files is not None and c < k else None
        if found is not None and found[0].cursor > c:
            c, state, source = found[0].cursor, found[1], found[0]
        if c < 0:
            c, state, source = 0, self._pristine, "the start"
        self._it = None  # let the old iterator (and its workers) go before the restore starts new ones
        with litdata_world(self.loader, self.slot, self.rank, self.slots, self.world):
            self.loader.load_state_dict(copy.deepcopy(state))
        self._it = iter(self.loader)
        self._pos = c * self.micro
        skip = want - self._pos
        last = time.monotonic()
        empty = 0
        while self._pos < want:
            try:
                next(self._it)
            except StopIteration:
                empty += 1
                if empty > 2:
                    raise StreamDataError(f"slot {self.slot} rank {self.rank}: the train loader ended while "
                                          f"skipping to slot batch {k}") from None
                self._it = iter(self.loader)
                continue
            empty = 0
            self._pos += 1
            self._remember(self._pos)
            if time.monotonic() - last > 10 and self.rank == 0:
                last = time.monotonic()
                self.say(f"lightning-ft: replica {self.slot}: skipping to slot batch {k}: "
                         f"{self._pos - c * self.micro}/{skip} micro-batches read")
        self.restores += 1
        self.skipped += skip
        if self.rank == 0 and (source != "the start" or skip):
            where = source if isinstance(source, str) else f"the state saved at slot batch {c}"
            self.say(f"lightning-ft: replica {self.slot}: train stream at slot batch {k}"
                     f"{'.' + str(j) if j else ''}: restored from {where}, skipped {skip} micro-batches "
                     f"({time.perf_counter() - t0:.2f}s)")


def _pristine_state(loader: Any) -> Any:
    """The state of a loader that has not started (slot batch 0)."""
    cls = type(loader)
    if cls.__module__.startswith("torchdata.stateful_dataloader"):
        return {}  # StatefulDataLoader.load_state_dict({}) starts afresh; its state_dict() would start workers
    return copy.deepcopy(loader.state_dict())


def refusal(loader: Any) -> str:
    ds = getattr(loader, "dataset", None)
    return (f"ft_hsdp trains every batch exactly once, and a restarted replica must resume at the next batch of "
            f"its slot that no replica trained; the train loader ({type(loader).__name__} over "
            f"{type(ds).__name__}) is an IterableDataset stream without state_dict()/load_state_dict(), so "
            f"its position cannot be saved or restored. Use a stateful loader ({'; '.join(STATEFUL_LOADERS)}), "
            f"a map-style dataset, or set data.exactly_once=false to train it at-least-once (a restarted "
            f"replica then reads its part of the stream from the beginning again)")


def stream_loader(loader: DataLoader, *, cfg: Any, slot: int, rank: int, world: int, slots: int, micro: int,
                  cursor: Callable[[], int], state_root: str) -> StreamLoader:
    """The strategy's train stream for a loader over an IterableDataset (see the module docstring)."""
    if not _stateful(loader) and cfg.data.exactly_once:
        raise StreamDataError(refusal(loader))
    try:
        how = shard(loader, slot, rank, slots, world, str(cfg.data.shard))
    except ValueError as e:
        raise StreamDataError(str(e)) from None
    files = StateFiles(state_root, slot, rank, slots=slots, world=world, pins=int(cfg.checkpoint.keep) + 1)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    out = StreamLoader(loader, StreamPart(slot, rank, world, slots, micro), cursor=cursor, files=files,
                       state_every=int(cfg.data.state_every_n_steps),
                       checkpoint_every=int(cfg.checkpoint.every_n_steps), say=say)
    if rank == 0:
        if out.stateful:
            say(f"lightning-ft: replica {slot}: exactly-once train stream: {how}; loader states of "
                f"{type(loader).__name__} in {os.path.dirname(files.dir)}")
        else:
            say(f"lightning-ft: replica {slot}: data.exactly_once=false: {type(loader).__name__} has no "
                f"state_dict(), so this stream trains AT-LEAST-ONCE: after a failure a restarted replica reads "
                f"its part from the beginning again and trains some samples twice ({how})")
    return out
