"""Exactly-once data (docs/ARCHITECTURE.md, "Exactly once"): slot streams, cursors advanced at commit, the ledger.

The global order of batches is split round-robin over the R replica *slots*: batch k of
slot s is global batch k·R + s. Slot s's cursor (the next batch index) advances only when
some replica commits a step that lists s among its contributors, to one past the batch s
trained in that step (a monotonic max, via CAS, so racing committers agree). A replica
resumes at its slot's cursor after a restart or catch-up, so the batches of a dead slot
wait for it rather than being skipped.

Every commit is recorded at `commits/{gen}/{step}/{rid}` = {"epoch", "round", "batches":
{slot: k}} (keys.py), written through a fence so that an evicted or lapsed replica cannot
record late. `verify_ledger` checks that the records of the final model's history (rewinds
supersede later commits of older generations) form an exact partition of each slot's
consumed prefix: no batch twice, none missing.

Scaling note (not done yet): every committer advances every contributor's cursor (get + CAS
each), O(R^2) etcd requests per step. A cheaper design: each replica writes only its own
cursor together with its commit record, and a replica that (re)starts or fails a commit
derives its cursor as max(own cursor, 1 + its batch in any commit record since that cursor
was written): the records since then are few (the steps around its failure).
"""
from __future__ import annotations

import functools
import json
import random
import threading
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

from lightning_ft.coord import keys
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


# -- cursors and the ledger in the store --------------------------------------------------------
#
# Generations. A rewind (docs/ARCHITECTURE.md, "Rewinds") starts history generation g+1 at
# step T: `rewinds/{g+1}` records {from, to: T, cursors at T}, the new generation's cursors
# are seeded from it, and commits of earlier generations at steps >= T are *superseded*:
# they trained a state that no longer exists. The final model's history is, newest
# generation first, each generation's commits from its base step up to the base of the
# next surviving generation.


def read_cursor(store: Store, root: str, slot: int, gen: int = 0) -> int:
    kv = store.get(keys.cursor(root, slot, gen))
    return int(kv.value) if kv else 0


def advance_cursor(store: Store, root: str, slot: int, value: int, gen: int = 0) -> int:
    """Set the slot's cursor to max(current, value) with CAS; returns the cursor after."""
    key = keys.cursor(root, slot, gen)
    while True:
        kv = store.get(key)
        cur = int(kv.value) if kv else 0
        if cur >= value:
            return cur
        if store.cas(key, kv.mod_revision if kv else 0, str(value).encode()):
            return value


def record_commit(store: Store, root: str, step: int, rid: int, epoch: int, round: int,
                  batches: Mapping[int, int], gen: int = 0, fence: Optional[dict[str, int]] = None) -> bool:
    """Write the ledger entry for `rid` committing `step` in generation `gen`, then advance
    every contributor's cursor past the batch it trained. With `fence` ({key: create
    revision}), nothing is written unless the fence holds (an evicted or lapsed replica
    must not record late); returns whether it was written."""
    rec = json.dumps({"epoch": epoch, "round": round, "batches": {str(s): k for s, k in sorted(batches.items())}},
                     sort_keys=True).encode()
    key = keys.commit(root, gen, step, rid)
    if fence is not None:
        if not store.put_if(key, rec, fence):
            return False
    else:
        store.put(key, rec)
    for slot, k in batches.items():
        advance_cursor(store, root, slot, k + 1, gen)
    return True


def record_commits(store: Store, root: str, rid: int, records: Sequence[tuple], fence: Optional[dict[str, int]] = None
                   ) -> bool:
    """Write several commit records of `rid` at once (one fenced transaction), then advance
    each slot's cursor once, to past the last batch it trained. `records`: (step, epoch,
    round, gen, batches). Returns whether they were written."""
    if len(records) == 1:
        step, epoch, round_, gen, batches = records[0]
        return record_commit(store, root, step, rid, epoch, round_, batches, gen=gen, fence=fence)
    puts = []
    top: dict[tuple[int, int], int] = {}
    for step, epoch, round_, gen, batches in records:
        rec = json.dumps({"epoch": epoch, "round": round_, "batches": {str(s): k for s, k in sorted(batches.items())}},
                         sort_keys=True).encode()
        puts.append((keys.commit(root, gen, step, rid), rec))
        for slot, k in batches.items():
            top[(gen, slot)] = max(top.get((gen, slot), 0), k + 1)
    if not store.put_many_if(puts, fence or {}):
        return False
    for (gen, slot), k in top.items():
        advance_cursor(store, root, slot, k, gen)
    return True


def recorded(store: Store, root: str, gen: int, step: int) -> bool:
    """Whether some replica recorded a commit of `step` in generation `gen`."""
    kvs, _ = store.get_prefix(keys.commits(root, gen, step))
    return bool(kvs)


def read_rewinds(store: Store, root: str) -> dict[int, dict]:
    """Generation -> its rewind record ({"from", "to", "cursors", ...}); generation 0's record,
    if any, is the base written by a `--resume` (see `seed_generation`)."""
    kvs, _ = store.get_prefix(keys.rewinds(root))
    return {int(kv.key.rsplit("/", 1)[1]): json.loads(kv.value) for kv in kvs}


def latest_gen(store: Store, root: str) -> int:
    return max(read_rewinds(store, root), default=0)


def seed_generation(store: Store, root: str, gen: int, base_step: int, cursors: Mapping[int, int],
                    **info: object) -> None:
    """Start generation `gen` at `base_step` with these slot cursors (a rewind, or the base of
    a `--resume`): the rewind record first, then the cursors."""
    rec = {"to": int(base_step), "cursors": {str(s): int(k) for s, k in sorted(cursors.items())}, **info}
    store.put(keys.rewinds(root, gen), json.dumps(rec, sort_keys=True).encode())
    for slot, k in cursors.items():
        advance_cursor(store, root, int(slot), int(k), gen)


def _history(store: Store, root: str) -> tuple[dict[int, tuple[int, int]], dict[int, dict], dict]:
    """(gen -> effective step range [lo, hi)), the rewinds, and gen -> step -> [records])."""
    rewinds = read_rewinds(store, root)
    kvs, _ = store.get_prefix(keys.commits(root))
    by_gen: dict[int, dict[int, list[dict]]] = {}
    for kv in kvs:
        gen, step, _ = keys.parse_commit(root, kv.key)
        by_gen.setdefault(gen, {}).setdefault(step, []).append(json.loads(kv.value))
    gens = sorted(set(by_gen) | set(rewinds) | {0})
    ranges: dict[int, tuple[int, int]] = {}
    limit = 1 << 62
    for g in reversed(gens):
        lo = int(rewinds[g]["to"]) if g in rewinds else 0
        if g > 0 and g not in rewinds:
            lo = limit  # a rewind that never got its record: nothing of it survives
        ranges[g] = (min(lo, limit), limit)
        limit = min(limit, lo)
    return ranges, rewinds, by_gen


def cursors_at(store: Store, root: str, step: int, slots: Sequence[int]) -> dict[int, int]:
    """The slot cursors of the final history's state at `step` (before step `step` trains):
    one past each slot's last batch committed below `step`, else the base's cursor."""
    ranges, rewinds, by_gen = _history(store, root)
    out = {s: int(rewinds.get(0, {}).get("cursors", {}).get(str(s), 0)) for s in slots}
    for g in sorted(ranges):
        lo, hi = ranges[g]
        if lo >= step:
            break
        if g in rewinds and g > 0:
            for s in slots:
                out[s] = int(rewinds[g]["cursors"].get(str(s), out[s]))
        for n in sorted(by_gen.get(g, {})):
            if lo <= n < min(hi, step):
                for slot, k in by_gen[g][n][0]["batches"].items():
                    if int(slot) in out:
                        out[int(slot)] = int(k) + 1
    return out


@dataclass
class LedgerReport:
    steps: int
    trained: dict[int, list[int]]
    """Slot -> batch indices trained by the final history, in step order."""
    duplicates: list[tuple[int, int]]
    gaps: list[tuple[int, int]]
    conflicts: list[str]
    superseded: int = 0
    """Commits of steps a later rewind discarded (their batches were trained again)."""
    rewinds: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.gaps or self.conflicts)


def verify_ledger(store: Store, root: str, cursors: Optional[Mapping[int, int]] = None) -> LedgerReport:
    """Check the exactly-once invariant over the final model's history.

    Records of one step must agree (every committer of step n saw the same quorum). Per
    slot, the batch indices the final history trained must be exactly base..cursor-1, each
    once, where base is the slot's cursor at the history's start (0, or a resume's) and
    cursor defaults to one past the last batch trained."""
    ranges, rewinds, by_gen = _history(store, root)
    base = {int(s): int(k) for s, k in rewinds.get(0, {}).get("cursors", {}).items()}
    conflicts: list[str] = []
    trained: dict[int, list[int]] = {}
    steps, superseded = 0, 0
    duplicates: list[tuple[int, int]] = []
    gaps: list[tuple[int, int]] = []
    for g in sorted(ranges):
        lo, hi = ranges[g]
        for n in sorted(by_gen.get(g, {})):
            recs = by_gen[g][n]
            if not lo <= n < hi:
                superseded += len(recs)
                continue
            steps += 1
            batches = [r["batches"] for r in recs]
            if any(b != batches[0] for b in batches):
                conflicts.append(f"generation {g} step {n}: committers disagree on its batches: {batches}")
            for slot, k in batches[0].items():
                trained.setdefault(int(slot), []).append(int(k))
    for slot, ks in trained.items():
        seen = set()
        for k in ks:
            if k in seen:
                duplicates.append((slot, k))
            seen.add(k)
        end = cursors[slot] if cursors and slot in cursors else (max(ks) + 1 if ks else 0)
        gaps += [(slot, k) for k in range(base.get(slot, 0), end) if k not in seen]
    return LedgerReport(steps, trained, duplicates, gaps, conflicts, superseded,
                        [dict(rewinds[g], gen=g) for g in sorted(rewinds) if g > 0])


def read_cursors(store: Store, root: str, slots: Sequence[int], gen: Optional[int] = None) -> dict[int, int]:
    """The slots' cursors in generation `gen` (default: the newest)."""
    g = latest_gen(store, root) if gen is None else gen
    return {s: read_cursor(store, root, s, g) for s in slots}


# -- this replica's records on their way to the ledger -----------------------------------------------
class LedgerWriter:
    """A replica leader's commit records on their way to the ledger (docs/ARCHITECTURE.md,
    "Exactly once"). A commit only appends (`add`, the training thread); `flush` writes what
    accumulated, fenced, before the leader reports for a full round, before a checkpoint, at
    the end of the job and at close: a steady round writes nothing to etcd. `flush` runs on
    the thread that runs the round (the quorum thread, while the training thread computes) or
    on the training thread; the lock orders the two."""

    def __init__(self, store: Store, root: str, rid: int, fence: Callable[[], dict[str, int]]) -> None:
        self.store, self.root, self.rid = store, root, rid
        self._fence = fence
        self._pending: list[tuple] = []
        self._lock = threading.Lock()
        self.flushes = 0

    def add(self, step: int, epoch: int, round: int, gen: int, batches: Mapping[int, int]) -> None:
        """A commit of `step` (in `round`, generation `gen`) that trained `batches` {slot: k}."""
        with self._lock:
            self._pending.append((step, epoch, round, gen, dict(batches)))

    @property
    def pending(self) -> int:
        return len(self._pending)

    def flush(self) -> Optional[tuple[int, int]]:
        """Record the pending commits (one fenced transaction) and advance the cursors. Returns
        None when they are recorded (or there were none), else the (first, last) steps the
        ledger refused: this incarnation was evicted or its lease lapsed, so the others may
        have redone those steps without it (the caller disowns its state)."""
        with self._lock:
            recs, self._pending = self._pending, []
            if not recs:
                return None
            self.flushes += 1
            if record_commits(self.store, self.root, self.rid, recs, fence=self._fence()):
                return None
        return recs[0][0], recs[-1][0]
