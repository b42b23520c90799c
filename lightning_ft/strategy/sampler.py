"""The exactly-once training sampler of one replica rank (docs/ARCHITECTURE.md, "Exactly once") for Lightning's loaders.

The replica's slot s trains, at each committed step, slot batch k = its cursor: the samples
`SlotStream.batch(s, k)` (size B·W·N for B per rank, W ranks, N accumulated micro-batches).
Rank r's micro-batch j of it is `batch[j·B·W:(j+1)·B·W][r::W]`.

Each `__iter__` starts at the replica's cursor *at that moment* (a callable), so a restarted
replica resumes where its slot left off. Loaders prefetch, so the strategy cannot infer
which slot batch it is training from a counter: every yielded micro-batch pushes its tag
(k, j) onto a FIFO, and the strategy pops one tag per batch it receives, in order.
"""
from __future__ import annotations

import collections
from typing import Callable, Iterator

from torch.utils.data import Sampler

from lightning_ft.replica.ledger import SlotStream


class FTBatchSampler(Sampler):
    def __init__(self, stream: SlotStream, slot: int, rank: int, world: int, micro_batches: int,
                 start: Callable[[], int]) -> None:
        if stream.batch_size % (world * micro_batches):
            raise ValueError(f"slot batch {stream.batch_size} is not divisible by W*N = {world}*{micro_batches}")
        self.stream, self.slot, self.rank, self.world = stream, slot, rank, world
        self.micro = micro_batches
        self._start = start
        self.tags: collections.deque[tuple[int, int]] = collections.deque()
        self.first = 0
        self._generation = 0

    @property
    def per_rank(self) -> int:
        return self.stream.batch_size // (self.world * self.micro)

    def steps_per_epoch(self) -> int:
        """Slot batches in one pass over the dataset (the global batches split over R slots)."""
        return max(1, self.stream.num_samples // self.stream.batch_size // self.stream.slots)

    def __len__(self) -> int:
        return self.steps_per_epoch() * self.micro

    def restart(self) -> None:
        """The slot's cursor moved back (a rewind): end the current pass at its next batch, so
        that the loader's next pass starts at the cursor. Batches already prefetched still
        arrive; the strategy sees from their tags that they are not the next to train."""
        self._generation += 1

    def micro_batches(self, slot: int, k: int) -> list[list[int]]:
        """This rank's sample ids of each micro-batch of batch k of `slot` (any slot: batch_policy
        "constant" trains absent slots' batches too)."""
        ids = self.stream.batch(slot, k)
        n = self.per_rank * self.world
        return [ids[j * n:(j + 1) * n][self.rank::self.world] for j in range(self.micro)]

    def __iter__(self) -> Iterator[list[int]]:
        self.tags.clear()
        self.first = k0 = self._start()
        gen = self._generation
        for k in range(k0, k0 + self.steps_per_epoch()):
            for j, ids in enumerate(self.micro_batches(self.slot, k)):
                if gen != self._generation:
                    return
                self.tags.append((k, j))
                yield ids
