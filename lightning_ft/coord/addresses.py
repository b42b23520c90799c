"""Per-rank listener addresses in etcd, out of every round's messages (docs/ARCHITECTURE.md,
"Addresses").

A replica of W ranks has W FTAR listeners and W catch-up state servers. Its leader publishes
their addresses once per lease of an incarnation, in blocks of `BLOCK_RANKS` ranks under
`addrs/{rid}/{inc}/{block}` (bound to the replica's lease, so they vanish with it). Reports
and quorums carry none: a round's messages stay O(1) bytes per member whatever W is.

When a ring changes, a leader reads the blocks of the (replica, incarnation)s its ranks
need: its two ring neighbours, and the catch-up sources of a round it catches up in. It
hands each rank only its own entries (`ReplicaManager`'s scatter), so a rank receives O(1)
addresses. Blocks keep every etcd message small: 256 ranks of two host:port strings are
about 10 KB, where one record of a whole 8192-rank replica would be 320 KB and a quorum
holding every member's would be megabytes (etcd refuses requests above 1.5 MiB by default).

`encode_blocks` and `decode_blocks` are pure; `publish` and `fetch` are the I/O.
"""
from __future__ import annotations

import json
from typing import Optional, Sequence

from . import keys
from .store import Store

BLOCK_RANKS = 256
"""Ranks per address block (one etcd key)."""

Addresses = tuple[tuple[str, ...], tuple[str, ...]]
"""(FTAR addresses, state-server addresses) of one replica incarnation, by local rank."""


class AddressesMissing(LookupError):
    """A replica incarnation's addresses are not (or no longer) in etcd: it died or left."""


def blocks_of(world: int) -> int:
    return max(1, -(-world // BLOCK_RANKS))


def encode_blocks(ftar: Sequence[str], state: Sequence[str]) -> list[bytes]:
    """The blocks of one incarnation: block b holds ranks [b*BLOCK_RANKS, (b+1)*BLOCK_RANKS)
    as {"first": rank, "ftar": [...], "state": [...]}."""
    if len(ftar) != len(state):
        raise ValueError(f"{len(ftar)} FTAR addresses but {len(state)} state-server addresses")
    out = []
    for b in range(blocks_of(len(ftar))):
        lo, hi = b * BLOCK_RANKS, (b + 1) * BLOCK_RANKS
        out.append(json.dumps({"first": lo, "ftar": list(ftar[lo:hi]), "state": list(state[lo:hi])},
                              separators=(",", ":")).encode())
    return out


def decode_blocks(blocks: Sequence[bytes], world: int) -> Addresses:
    """Inverse of `encode_blocks`, checked: every rank 0..world-1 exactly once, in order."""
    ftar: list[str] = []
    state: list[str] = []
    for b, raw in enumerate(blocks):
        d = json.loads(raw)
        if d["first"] != len(ftar) or d["first"] != b * BLOCK_RANKS or len(d["ftar"]) != len(d["state"]):
            raise ValueError(f"address block {b} is malformed (first rank {d.get('first')}, "
                             f"{len(d.get('ftar', ()))} FTAR and {len(d.get('state', ()))} state addresses)")
        ftar += d["ftar"]
        state += d["state"]
    if len(ftar) != world:
        raise ValueError(f"address blocks hold {len(ftar)} ranks, not {world}")
    return tuple(ftar), tuple(state)


def publish(store: Store, root: str, rid: int, inc: int, blocks: Sequence[bytes], lease: int) -> None:
    """Write an incarnation's blocks on its lease (one put each: every request stays small)."""
    for b, raw in enumerate(blocks):
        store.put(keys.addrs(root, rid, inc, b), raw, lease=lease)


def fetch(store: Store, root: str, rid: int, inc: int, world: int) -> Addresses:
    """Read an incarnation's addresses (one get per block). AddressesMissing if any is gone."""
    raws = []
    for b in range(blocks_of(world)):
        kv = store.get(keys.addrs(root, rid, inc, b))
        if kv is None:
            raise AddressesMissing(f"replica {rid} incarnation {inc} has no published addresses "
                                   f"(block {b}): it died or left")
        raws.append(kv.value)
    return decode_blocks(raws, world)


class AddressBook:
    """A leader's cache of fetched addresses, by (replica, incarnation): an incarnation's
    listeners never move, so each is read once (while it lives)."""

    def __init__(self, store: Store, root: str, world: int, capacity: int = 64) -> None:
        self.store, self.root, self.world, self.capacity = store, root, world, capacity
        self._cache: dict[tuple[int, int], Addresses] = {}
        self.fetches = 0

    def get(self, rid: int, inc: int) -> Optional[Addresses]:
        """The addresses of (rid, inc), or None when it has none (gone)."""
        hit = self._cache.get((rid, inc))
        if hit is not None:
            return hit
        try:
            got = fetch(self.store, self.root, rid, inc, self.world)
        except AddressesMissing:
            return None
        self.fetches += 1
        if len(self._cache) >= self.capacity:
            self._cache.pop(next(iter(self._cache)))
        self._cache[(rid, inc)] = got
        return got

    def put(self, rid: int, inc: int, addrs: Addresses) -> None:
        """Our own addresses (known without a read)."""
        self._cache[(rid, inc)] = addrs
