"""Exactly-once data (DESIGN §7): slot streams, cursors advanced at commit, the ledger.

The global order of batches is split round-robin over the R replica *slots*: batch k of
slot s is global batch k·R + s. Slot s's cursor (the next batch index) advances only when
some replica commits a step that lists s among its contributors, to one past the batch s
trained in that step (a monotonic max, via CAS, so racing committers agree). A replica
resumes at its slot's cursor after a restart or catch-up, so the batches of a dead slot
wait for it rather than being skipped.

Every commit is recorded at `commits/{step}/{rid}` = {"epoch", "round", "batches": {slot: k}}.
`verify_ledger` checks that these records form an exact partition of each slot's consumed
prefix: no batch twice, none missing.

Scaling note (not done yet): every committer advances every contributor's cursor (get + CAS
each), O(R^2) etcd requests per step. A cheaper design: each replica writes only its own
cursor together with its commit record, and a replica that (re)starts or fails a commit
derives its cursor as max(own cursor, 1 + its batch in any commit record since that cursor
was written): the records since then are few (the steps around its failure).
"""
from __future__ import annotations

import functools
import json
import os
import random
import tempfile
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional, Sequence

from lightning_ft.coord.store import Store


@functools.lru_cache(maxsize=4)
def _permutation(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The sample order of one epoch (cached: a slot batch is asked for at every step)."""
    order = list(range(n))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


@dataclass(frozen=True)
class SlotStream:
    """Deterministic batches of sample ids for R slots over a (possibly endless) stream."""

    num_samples: int
    batch_size: int
    slots: int
    seed: int = 0
    shuffle: bool = True

    def global_batch(self, g: int) -> list[int]:
        """Sample ids of global batch g; epochs repeat with a fresh permutation each."""
        per_epoch = self.num_samples // self.batch_size
        if per_epoch == 0:
            raise ValueError(f"batch_size {self.batch_size} exceeds the {self.num_samples} samples")
        epoch, b = divmod(g, per_epoch)
        order = self._order(epoch)
        return order[b * self.batch_size:(b + 1) * self.batch_size]

    def _order(self, epoch: int) -> list[int]:
        return _permutation(self.num_samples, self.seed, epoch, self.shuffle)

    def batch(self, slot: int, k: int) -> list[int]:
        """Batch k of `slot`."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} out of range for {self.slots} slots")
        return self.global_batch(k * self.slots + slot)

    def iter_slot(self, slot: int, start: int = 0) -> Iterator[list[int]]:
        k = start
        while True:
            yield self.batch(slot, k)
            k += 1


class SlotSampler:
    """A batch sampler for one slot that can be re-positioned at any time.

    Data loaders prefetch: an iterator created before a `seek` may already have handed out
    batches past the new position. Each `seek` bumps a generation; iterators of an old
    generation stop, and the consumer asks for a new one (Lightning re-creates it)."""

    def __init__(self, stream: SlotStream, slot: int, start: int = 0) -> None:
        self.stream = stream
        self.slot = slot
        self.cursor = start
        self._generation = 0

    def seek(self, k: int) -> None:
        self.cursor = k
        self._generation += 1

    def __iter__(self) -> Iterator[list[int]]:
        gen = self._generation
        k = self.cursor
        while gen == self._generation:
            yield self.stream.batch(self.slot, k)
            k += 1

    def __len__(self) -> int:
        return max(0, self.stream.num_samples // self.stream.batch_size // self.stream.slots - self.cursor)


# -- cursors and the ledger in the store --------------------------------------------------------

def cursor_key(root: str, slot: int) -> str:
    return f"{root}cursor/{slot}"


def read_cursor(store: Store, root: str, slot: int) -> int:
    kv = store.get(cursor_key(root, slot))
    return int(kv.value) if kv else 0


def advance_cursor(store: Store, root: str, slot: int, value: int) -> int:
    """Set the slot's cursor to max(current, value) with CAS; returns the cursor after."""
    key = cursor_key(root, slot)
    while True:
        kv = store.get(key)
        cur = int(kv.value) if kv else 0
        if cur >= value:
            return cur
        if store.cas(key, kv.mod_revision if kv else 0, str(value).encode()):
            return value


def record_commit(store: Store, root: str, step: int, rid: int, epoch: int, round: int,
                  batches: Mapping[int, int]) -> None:
    """Write the ledger entry for `rid` committing `step`, then advance every contributor's
    cursor past the batch it trained."""
    rec = {"epoch": epoch, "round": round, "batches": {str(s): k for s, k in sorted(batches.items())}}
    store.put(f"{root}commits/{step:012d}/{rid}", json.dumps(rec, sort_keys=True).encode())
    for slot, k in batches.items():
        advance_cursor(store, root, slot, k + 1)


@dataclass
class LedgerReport:
    steps: int
    trained: dict[int, list[int]]
    """Slot -> batch indices trained, in step order."""
    duplicates: list[tuple[int, int]]
    gaps: list[tuple[int, int]]
    conflicts: list[str]

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.gaps or self.conflicts)


def verify_ledger(store: Store, root: str, cursors: Optional[Mapping[int, int]] = None) -> LedgerReport:
    """Check the exactly-once invariant over every `commits/` record.

    Records of one step must agree (every committer of step n saw the same quorum). Per
    slot, the trained batch indices must be exactly 0..cursor-1, each once."""
    kvs, _ = store.get_prefix(f"{root}commits/")
    by_step: dict[int, list[dict]] = {}
    for kv in kvs:
        step = int(kv.key[len(root) + len("commits/"):].split("/")[0])
        by_step.setdefault(step, []).append(json.loads(kv.value))
    conflicts, trained = [], {}
    for step in sorted(by_step):
        recs = by_step[step]
        batches = [r["batches"] for r in recs]
        if any(b != batches[0] for b in batches):
            conflicts.append(f"step {step}: committers disagree on its batches: {batches}")
        for slot, k in batches[0].items():
            trained.setdefault(int(slot), []).append(int(k))
    duplicates, gaps = [], []
    for slot, ks in trained.items():
        seen = set()
        for k in ks:
            if k in seen:
                duplicates.append((slot, k))
            seen.add(k)
        end = cursors[slot] if cursors and slot in cursors else (max(ks) + 1 if ks else 0)
        gaps += [(slot, k) for k in range(end) if k not in seen]
    return LedgerReport(len(by_step), trained, duplicates, gaps, conflicts)


def write_loader_state(path: str, cursors: Mapping[int, int]) -> None:
    """Atomically write all cursors (loader_state) as JSON."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".loader_state.")
    with os.fdopen(fd, "w") as f:
        json.dump({str(k): v for k, v in sorted(cursors.items())}, f)
    os.replace(tmp, path)


def read_cursors(store: Store, root: str, slots: Sequence[int]) -> dict[int, int]:
    return {s: read_cursor(store, root, s) for s in slots}
