"""The exactly-once train loader of a Fabric loop (docs/ARCHITECTURE.md, "Fabric", "Exactly once").

Fabric does not know how many loader batches make one optimizer step (the loop accumulates
with `no_backward_sync`), so the stream is cut in micro-batches: micro-batch m of slot s is
`SlotStream(n, B·W, R).batch(s, m)`, this rank's share every W-th sample of it. A step of N
micro-batches trains slot batch k = micro-batches [kN, (k+1)N) of the replica's slot; the
strategy learns N from the loop's first step and checks it at every step. The loader starts
at the micro-batch the strategy says (`start()`: the slot's cursor times N after `prepare`) and
tells it every micro-batch it hands the loop (`delivered(m)`), in order, even when the
DataLoader's workers prefetch.

One pass is the slot's share of the data set (`len`); a new `iter` goes on where the last
delivered micro-batch left off (LitGPT's CycleIterator iterates again at the end of a pass).
It is stateful, so that a loop can keep it in the dict it saves (LitGPT does): its
`state_dict` records the position, and `load_state_dict` does not move it: the job's cursor
decides (a replica restarted from an old checkpoint continues where its slot is).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

from torch.utils.data import DataLoader, Sampler

from lightning_ft.replica.ledger import SlotStream


class _MicroSampler(Sampler):
    def __init__(self, loader: TrainLoader, first: int) -> None:
        self.loader, self.first = loader, first

    def __iter__(self) -> Iterator[list[int]]:
        for m in range(self.first, self.first + len(self.loader)):
            yield self.loader.indices(m)

    def __len__(self) -> int:
        return len(self.loader)


class TrainLoader:
    """Micro-batches of this rank's share of the replica's slot stream (see the module docstring)."""

    def __init__(self, dataloader: DataLoader, slot: int, rank: int, world: int, slots: int, seed: int,
                 shuffle: bool, start: Callable[[], int], delivered: Callable[[int], None]) -> None:
        bs = dataloader.batch_size
        if bs is None:
            raise ValueError("the train DataLoader must set batch_size (per process): ft_hsdp builds its batches")
        n = len(dataloader.dataset)  # type: ignore[arg-type]  # map-style: checked by the caller
        self.stream = SlotStream(n, bs * world, slots, seed=seed, shuffle=shuffle)
        if n // self.stream.batch_size < slots:
            raise ValueError(f"{n} samples make fewer than one batch of {bs} x {world} ranks per replica for "
                             f"{slots} replicas")
        self.dataloader = dataloader
        self.batch_size = bs
        self.slot, self.rank, self.world = slot, rank, world
        self._start = start
        self._delivered = delivered
        self.next = 0
        """The next micro-batch this loader hands the loop."""
        self.loaded: Optional[dict] = None
        """The state a checkpoint gave `load_state_dict` (not applied: the cursor decides)."""

    def indices(self, m: int) -> list[int]:
        """This rank's sample ids of micro-batch m of the replica's slot."""
        return self.stream.batch(self.slot, m)[self.rank::self.world]

    def __len__(self) -> int:
        """Micro-batches in one pass: the slot's share of the data set."""
        return max(1, self.stream.num_samples // self.stream.batch_size // self.stream.slots)

    def __iter__(self) -> Iterator[Any]:
        self.next = first = self._start()
        dl = self.dataloader
        inner = DataLoader(dl.dataset, batch_sampler=_MicroSampler(self, first), num_workers=dl.num_workers,
                           collate_fn=dl.collate_fn, pin_memory=dl.pin_memory, worker_init_fn=dl.worker_init_fn,
                           multiprocessing_context=dl.multiprocessing_context)
        for m, batch in enumerate(inner, start=first):
            self._delivered(m)
            self.next = m + 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next, "slot": self.slot, "replicas": self.stream.slots, "rank": self.rank,
                "world": self.world, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = dict(state)
