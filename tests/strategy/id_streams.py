"""Train streams whose samples carry their id, and the sample-id check of a run.

- `IdStream`: a stateful IterableDataset of ids 0..n-1 split over DataLoader workers (the
  shape torchdata's StatefulDataLoader expects of a resumable dataset);
- `PlainIdStream`: the same without state (refused unless data.exactly_once=false);
- `build_litdata(dir, n)`: the same ids written by `litdata.optimize`;
- `make_loader(kind, ...)`: the train loader the test app and the reference reading share;
- `check_sample_ids(...)`: every sample id the final history consumed, exactly once.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info

BATCH = 4


def features(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + int(i))
    return torch.randn(8, generator=g)


class PlainIdStream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n
        self.pos = 0
        self._resume = False

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        w, nw = (info.id, info.num_workers) if info else (0, 1)
        if not self._resume:
            self.pos = 0  # a new pass
        self._resume = False
        while self.pos < self.n:
            i = self.pos
            self.pos += 1
            if i % nw == w:
                yield {"id": i, "x": features(i)}


class IdStream(PlainIdStream):
    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = int(state["pos"])
        self._resume = True


def _item(i: int) -> dict:
    return {"id": int(i), "x": features(i).numpy()}


def build_litdata(out_dir: str, n: int) -> str:
    """A litdata dataset of ids 0..n-1 (litdata.optimize, in this process's children)."""
    import litdata

    litdata.optimize(fn=_item, inputs=list(range(n)), output_dir=out_dir, chunk_size=32, num_workers=1,
                     start_method="fork", mode="overwrite")
    return out_dir


def make_loader(kind: str, n: int, workers: int, data_dir: str = "") -> Any:
    """kind: torchdata (StatefulDataLoader over IdStream), litdata (StreamingDataLoader over a
    shuffled StreamingDataset of `data_dir`), plain (a DataLoader over PlainIdStream)."""
    if kind == "torchdata":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(IdStream(n), batch_size=BATCH, num_workers=workers,
                                  prefetch_factor=2 if workers else None)
    if kind == "litdata":
        import litdata

        ds = litdata.StreamingDataset(data_dir, shuffle=True, seed=11)
        return litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers)
    if kind == "plain":
        from torch.utils.data import DataLoader

        return DataLoader(PlainIdStream(n), batch_size=BATCH, num_workers=workers)
    raise ValueError(kind)


def reference(kind: str, n: int, workers: int, slots: int, world: int, data_dir: str = "",
              batches: int = 0) -> Callable[[int, int], list[list[int]]]:
    """(slot, rank) -> the ids of its first `batches` batches read in one go (no failures)."""
    from lightning_ft.strategy.data_shards import shard

    def read(slot: int, rank: int) -> list[list[int]]:
        loader = make_loader(kind, n, workers, data_dir)
        shard(loader, slot, rank, slots, world, "processes")
        out: list[list[int]] = []
        while len(out) < batches:
            for b in loader:
                out.append([int(i) for i in b["id"]])
                if len(out) == batches:
                    break
        return out

    return read


def id_rows(run_dir: str) -> list[dict]:
    """The app's per-batch rows of every process log: {"rid", "rank", "pos": [k, j], "ids"}."""
    logs = os.path.join(run_dir, "logs")
    out = []
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        if name.endswith(".log"):
            out += [json.loads(line) for line in open(os.path.join(logs, name), errors="replace")
                    if line.startswith('{"event": "ids"')]
    return out


@dataclass
class IdReport:
    samples: int = 0
    batches: int = 0
    duplicates: list[int] = field(default_factory=list)
    """Ids trained more than once by the final history."""
    missing: list[tuple] = field(default_factory=list)
    """(slot, rank, k, j) committed by the ledger but never delivered by that process."""
    conflicts: list[tuple] = field(default_factory=list)
    """(slot, rank, k, j) delivered with different ids at different times."""
    mismatches: list[tuple] = field(default_factory=list)
    """(slot, rank, k, j, delivered, expected): not the batch an uninterrupted reading delivers there."""

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.missing or self.conflicts or self.mismatches)

    def __str__(self) -> str:
        return (f"sample ids: {self.samples} trained by the final history in {self.batches} batches, "
                f"{len(self.duplicates)} twice, {len(self.missing)} batches missing, "
                f"{len(self.conflicts)} delivered differently, {len(self.mismatches)} not the stream's")


def check_sample_ids(rows: list[dict], trained: dict[int, list[int]], world: int, micro: int = 1,
                     expected: Callable[[int, int], list[list[int]]] | None = None) -> IdReport:
    """Every sample id of the batches the final history trained (the ledger's `trained`:
    slot -> batch indices), exactly once: each committed (slot, k) was delivered by each rank
    of that slot, every delivery of it carried the same ids (a restore resumed the stream at
    the same place), those are the ids an uninterrupted reading of the stream has there
    (`expected`), and no id is trained twice (size the run to stay within one pass of every
    process's part: a second pass trains the same ids again, by design)."""
    seen: dict[tuple, set] = {}
    for r in rows:
        key = (int(r["rid"]), int(r["rank"]), int(r["pos"][0]), int(r["pos"][1]))
        seen.setdefault(key, set()).add(tuple(r["ids"]))
    rep = IdReport()
    count: dict[int, int] = {}
    refs: dict[tuple[int, int], list[list[int]]] = {}
    for slot, ks in sorted(trained.items()):
        for k in ks:
            for rank in range(world):
                for j in range(micro):
                    key = (slot, rank, k, j)
                    got = seen.get(key)
                    if not got:
                        rep.missing.append(key)
                        continue
                    if len(got) > 1:
                        rep.conflicts.append(key)
                    ids = list(sorted(got)[0])
                    if expected is not None:
                        if (slot, rank) not in refs:
                            refs[(slot, rank)] = expected(slot, rank)
                        ref = refs[(slot, rank)]
                        want = ref[k * micro + j] if k * micro + j < len(ref) else None
                        if ids != want:
                            rep.mismatches.append((*key, ids, want))
                    rep.batches += 1
                    for i in ids:
                        count[i] = count.get(i, 0) + 1
    rep.samples = sum(count.values())
    rep.duplicates = sorted(i for i, c in count.items() if c > 1)
    return rep
