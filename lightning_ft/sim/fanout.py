"""The model of a replica leader's quorum fan-out to its W ranks (docs/ARCHITECTURE.md, "A step":
only the leader talks to etcd, then broadcasts), as pure functions.

The leader hands the round's quorum to its ranks with `dist.broadcast_object_list` over the
replica's gloo group: the pickled message's size goes out in one broadcast, its bytes in a
second. Gloo broadcasts along a binomial tree (gloo/broadcast.cc): with virtual ranks
(rank - root) mod W, in iteration i = 0 .. ceil(log2 W) - 1 every rank v < 2**i that holds
the data sends it to v + 2**i. So rank v receives from v minus its highest set bit, and then
posts its sends to v + 2**j for every j above that bit, one after the other.

A hop costs a latency (wake-up, transport, the receiver's copy) plus the bytes over the
link; a sender posting several sends is busy `bytes / bandwidth` per send. With the hop
latencies drawn from a distribution measured on real gloo processes (sim/gloo_probe.py),
`sample_fanout` gives the distribution of the time until the last of W ranks holds the
quorum. Nothing here does I/O; bench/scale.py measures the inputs and validates the model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np


def tree_depth(size: int) -> int:
    """Iterations of the binomial broadcast over `size` ranks: ceil(log2 size)."""
    if size < 1:
        raise ValueError(f"a broadcast needs at least one rank, got {size}")
    return (size - 1).bit_length()


def parent(v: int) -> int:
    """The virtual rank that sends to virtual rank v (> 0): v without its highest set bit."""
    if v <= 0:
        raise ValueError(f"virtual rank {v} has no parent (the root is 0)")
    return v ^ (1 << (v.bit_length() - 1))


def children(v: int, size: int) -> list[int]:
    """The virtual ranks v sends to, in the order gloo posts the sends."""
    first = v.bit_length()  # bits above v's highest set bit (all bits for the root)
    return [v + (1 << j) for j in range(first, tree_depth(size)) if v + (1 << j) < size]


def send_index(v: int) -> int:
    """Position of v among its parent's sends (0 = the parent's first send)."""
    p = parent(v)
    return (v.bit_length() - 1) - p.bit_length()


@dataclass(frozen=True)
class HopModel:
    """What one hop of the broadcast costs, from measurements (milliseconds and bytes/s)."""

    latency_ms: Sequence[float]
    """Samples of a one-hop latency of a tiny message (each edge draws one per broadcast)."""
    bytes_per_s: float
    """Point-to-point bandwidth: a hop carrying m bytes costs latency + m / bandwidth."""
    overhead_ms: float = 0.0
    """Fixed per-call cost of broadcast_object_list outside the two tree broadcasts (pickle
    at the root, tensor allocation, unpickle at the rank)."""

    def __post_init__(self) -> None:
        if not len(self.latency_ms):
            raise ValueError("a hop model needs at least one measured latency sample")
        if self.bytes_per_s <= 0:
            raise ValueError(f"bandwidth must be positive, got {self.bytes_per_s}")


def receive_times(size: int, edge_ms: np.ndarray, send_ms: float = 0.0) -> np.ndarray:
    """Time (ms) at which each virtual rank holds the data, the root starting at 0.

    `edge_ms` has shape (size,) or (n, size): entry v is the hop cost of the edge into v
    (entry 0 is ignored). The k-th send of a rank leaves k * send_ms after its first."""
    edge = np.atleast_2d(np.asarray(edge_ms, dtype=float))
    if edge.shape[-1] != size:
        raise ValueError(f"edge costs have {edge.shape[-1]} entries for {size} ranks")
    t = np.zeros_like(edge)
    for b in range(tree_depth(size)):  # ranks with highest bit b receive in iteration b
        v = np.arange(1 << b, min(1 << (b + 1), size))
        p = v - (1 << b)
        k = b - np.array([int(x).bit_length() for x in p])  # their index among the parent's sends
        t[:, v] = t[:, p] + k * send_ms + edge[:, v]
    return t if np.ndim(edge_ms) == 2 else t[0]


def tree_time(size: int, edge_ms: np.ndarray, send_ms: float = 0.0) -> np.ndarray:
    """Time until the last rank holds the data, per row of `edge_ms`."""
    return receive_times(size, edge_ms, send_ms).max(axis=-1)


def sample_fanout(size: int, model: HopModel, message_bytes: int, n: int,
                  rng: np.random.Generator) -> np.ndarray:
    """`n` samples (ms) of broadcast_object_list to `size` ranks: overhead + the size
    broadcast (8 bytes) + the data broadcast (`message_bytes`), edges drawn independently."""
    if size == 1:
        return np.zeros(n)
    lat = np.asarray(model.latency_ms, dtype=float)
    wire_ms = message_bytes / model.bytes_per_s * 1e3
    out = np.full(n, model.overhead_ms)
    chunk = max(1, 2_000_000 // size)  # bound the (rows, size) arrays to a few MB
    for lo in range(0, n, chunk):
        rows = min(chunk, n - lo)
        sizes = tree_time(size, rng.choice(lat, size=(rows, size)))
        data = tree_time(size, rng.choice(lat, size=(rows, size)) + wire_ms, send_ms=wire_ms)
        out[lo:lo + rows] += sizes + data
    return out


def percentile(xs: Iterable[float], q: float) -> float:
    """The q-quantile (0..1) by the nearest-rank rule, as the benchmarks report it."""
    s = sorted(xs)
    if not s:
        raise ValueError("percentile of no samples")
    return float(s[min(len(s) - 1, int(round(q * (len(s) - 1))))])
