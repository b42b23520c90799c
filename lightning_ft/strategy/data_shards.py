"""How a train stream is split over the job's slots and a replica's ranks (docs/ARCHITECTURE.md,
"Exactly once: streams").

Process p = slot * W + rank of the job's R * W reads its own part of the stream:

- litdata's `StreamingDataset` is split natively: its distributed environment becomes
  (world R * W, rank p), so litdata assigns chunks, shuffles and saves its state as in a job of
  R * W processes (its own world detection would see only the replica's W).
- any other `IterableDataset` is split by position with `ShardedIterable`:
  - `data.shard=processes` (default): the dataset yields one stream (split over DataLoader
    workers if it likes, not over ranks), and process p keeps its positions i with i % (R * W) == p;
  - `data.shard=slots`: the dataset already splits over the replica's ranks, as under plain
    DDP (it sees the replica's torch.distributed rank and world size), and slot s keeps
    positions i % R == s of it.
  Every process reads the whole stream (or its rank's part) and keeps its share: simple and
  exact for any dataset; a dataset that can skip cheaply should split itself and use `slots`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Protocol, TypeGuard

from torch.utils.data import DataLoader, IterableDataset

from lightning_ft.config import DATA_SHARDS


class Stateful(Protocol):
    """What torchdata's StatefulDataLoader expects of a stateful loader or dataset."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _stateful(obj: object) -> TypeGuard[Stateful]:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class ShardedIterable(IterableDataset):
    """Positions i with i % count == index of `inner`'s stream (per DataLoader worker, as the
    inner dataset splits over workers). Stateful like torchdata expects of a dataset: its state
    is the inner dataset's (if it has one) and the position reached; an inner dataset without
    state is fast-forwarded to that position on restore."""

    def __init__(self, inner: IterableDataset, index: int, count: int) -> None:
        if not 0 <= index < count:
            raise ValueError(f"shard index {index} out of range for {count} shards")
        self.inner, self.index, self.count = inner, index, count
        self.pos = 0
        self._resume = False

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.inner)
        if self._resume:  # a loaded state: continue at its position (the inner dataset's own, or by skipping)
            self._resume = False
            if not _stateful(self.inner):
                for _ in range(self.pos):
                    next(it)
        else:
            self.pos = 0
        for item in it:
            p = self.pos
            self.pos = p + 1
            if p % self.count == self.index:
                yield item

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos, "inner": self.inner.state_dict() if _stateful(self.inner) else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("inner") is not None and _stateful(self.inner):
            self.inner.load_state_dict(state["inner"])
        self.pos = int(state["pos"])
        self._resume = True

    def __repr__(self) -> str:
        return f"ShardedIterable({self.inner!r}, {self.index}/{self.count})"


def is_litdata(dataset: Any) -> bool:
    mod = type(dataset).__module__ or ""
    return mod.startswith("litdata.")


def shard(loader: DataLoader, slot: int, rank: int, slots: int, world: int, mode: str) -> str:
    """Make `loader` read process (slot, rank)'s part of its IterableDataset, in place; returns a
    description for the start-up message."""
    ds = loader.dataset
    p, n = slot * world + rank, slots * world
    if is_litdata(ds):
        from litdata import StreamingDataset
        from litdata.utilities.env import _DistributedEnv

        if not isinstance(ds, StreamingDataset):
            raise ValueError(f"ft_hsdp splits litdata's StreamingDataset over slots and ranks; {type(ds).__name__} "
                            "is not supported yet: train from one StreamingDataset")
        ds.distributed_env = _DistributedEnv(n, p, _litdata_nodes(n))
        return f"litdata StreamingDataset split natively: process {p} of {n}"
    if mode not in DATA_SHARDS:
        raise ValueError(f"data.shard={mode!r}: allowed values are {', '.join(map(repr, DATA_SHARDS))}")
    index, count = (p, n) if mode == "processes" else (slot, slots)
    if not isinstance(ds, IterableDataset):
        raise ValueError(f"{type(ds).__name__} is not an IterableDataset: a map-style dataset needs no stream split")
    # DataLoader refuses a new dataset after __init__ because its sampler depends on it; an
    # iterable dataset's sampler does not, and replacing it keeps every argument of the user's loader.
    object.__setattr__(loader, "dataset", ShardedIterable(ds, index, count))
    return f"{type(ds).__name__} split by position (data.shard={mode}): positions i % {count} == {index}"


def _litdata_nodes(world: int) -> int:
    """litdata's own rule for the number of nodes of a world (GPUs per node, else one node)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return max(1, world // gpus) if gpus and world >= gpus else 1


@contextlib.contextmanager
def litdata_world(loader: Any, slot: int, rank: int, slots: int, world: int) -> Iterator[None]:
    """While loading a state into a litdata loader, its world detection answers the job's world
    (litdata compares a state's world size with `_DistributedEnv.detect()`, which sees the
    replica's W, and would otherwise take the state for another topology)."""
    if not is_litdata(getattr(loader, "dataset", None)):
        yield
        return
    from litdata.streaming import dataloader as ldl

    env = loader.dataset.distributed_env
    orig = ldl._DistributedEnv

    class _JobEnv(orig):  # type: ignore[misc, valid-type]
        @classmethod
        def detect(cls) -> Any:
            return env

    ldl._DistributedEnv = _JobEnv
    try:
        yield
    finally:
        ldl._DistributedEnv = orig
