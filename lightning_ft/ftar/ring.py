"""The ring all-reduce schedule, as pure functions (docs/ARCHITECTURE.md, "The exchange").

A flat buffer of `numel` elements is cut into *partitions* of at most S·C·N bytes. Each
partition is cut into N balanced *segments* (sizes differ by at most one element), and each
segment into at most C *chunks* of at most S bytes, so at most S·C bytes are in flight per
peer. Ring index i sends to (i+1) % N and receives from (i-1) % N:

  reduce-scatter step k (k = 0..N-2): send segment (i-k) % N, receive (i-k-1) % N, reduce it.
      After the last step, index i holds the full sum of segment (i+1) % N.
  all-gather step k (k = 0..N-2): send segment (i+1-k) % N, receive (i-k) % N, copy it.

Every rank's final bits for a segment come from its one owner, so all ranks end bitwise
identical.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """A range of elements: [start, start + numel)."""

    start: int
    numel: int

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class RingStep:
    phase: str  # "rs" (reduce-scatter) | "ag" (all-gather)
    k: int
    """Step within the phase, 0..N-2."""
    send_seg: int
    recv_seg: int
    last_rs: bool = False
    """The final reduce-scatter step: the received segment is now complete (fused write to
    the user's buffer)."""
    last_ag: bool = False
    """The final all-gather step: the received segment is not forwarded."""


def partition_numel(elem_size: int, n: int, chunk_bytes: int, num_chunks: int) -> int:
    """Elements per partition: at most S·C·N bytes, and at least one element per segment."""
    if elem_size <= 0 or n <= 0 or chunk_bytes <= 0 or num_chunks <= 0:
        raise ValueError(f"invalid ring geometry: elem_size={elem_size} n={n} S={chunk_bytes} C={num_chunks}")
    per_seg = max(1, (chunk_bytes * num_chunks) // elem_size)
    return per_seg * n


def partitions(numel: int, elem_size: int, n: int, chunk_bytes: int, num_chunks: int) -> list[Span]:
    """Consecutive partitions covering [0, numel); none for an empty buffer."""
    size = partition_numel(elem_size, n, chunk_bytes, num_chunks)
    return [Span(s, min(size, numel - s)) for s in range(0, numel, size)]


def segments(part: Span, n: int) -> list[Span]:
    """N balanced segments of a partition; the first `numel % n` get one extra element."""
    base, extra = divmod(part.numel, n)
    out, pos = [], part.start
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append(Span(pos, size))
        pos += size
    return out


def chunks(seg: Span, elem_size: int, chunk_bytes: int) -> list[Span]:
    """Chunks of at most S bytes (at least one element each) covering a segment."""
    per = max(1, chunk_bytes // elem_size)
    return [Span(s, min(per, seg.end - s)) for s in range(seg.start, seg.end, per)]


def schedule(n: int, index: int) -> list[RingStep]:
    """The 2(N-1) steps ring index `index` runs for one partition."""
    if not 0 <= index < n:
        raise ValueError(f"ring index {index} out of range for a ring of {n}")
    steps = []
    for k in range(n - 1):
        steps.append(RingStep("rs", k, (index - k) % n, (index - k - 1) % n, last_rs=(k == n - 2)))
    for k in range(n - 1):
        steps.append(RingStep("ag", k, (index + 1 - k) % n, (index - k) % n, last_ag=(k == n - 2)))
    return steps


def neighbours(n: int, index: int) -> tuple[int, int]:
    """(left, right): the index we receive from and the one we send to."""
    return (index - 1) % n, (index + 1) % n
