"""The divergence guard's part in one replica (docs/ARCHITECTURE.md, "The divergence guard"):
every replica digests its state at the same steps (every `digest_every`, and at checkpoints).
A full round's report carries the digest and the quorum compares them (coord/quorum.py rule 9);
a steady round compares them on the ring instead, without etcd (`ring_vector`, `ring_verdict`):
every member adds its digest's 16 hex digits and their squares to one all-reduce after its
gradients, and all of them read the same verdict from the sums. Agreement makes the version
verified; a disagreement makes every member digest its next version and go to a full round,
where rule 9 names the diverged replicas.

`take` runs at a commit (training thread); `for_report` in the next round (on the thread that
runs the round: the quorum thread while overlapped), every rank of the replica; the round
starts after the commit, so the digest is handed over, never shared."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

import torch

from lightning_ft.replica.group import ReplicaGroup
from lightning_ft.replica.state import combine, fast_digest

if TYPE_CHECKING:
    from lightning_ft.coord.round_records import Quorum


DIGITS = 16
"""Hex digits of a replica digest (`combine`)."""
RING_LEN = 1 + 2 * DIGITS


class Digests:
    """This rank's state digests at the agreed steps."""

    def __init__(self, digest_every: int, checkpoint_every: int, group: ReplicaGroup) -> None:
        self.every, self.checkpoint_every = max(0, digest_every), max(0, checkpoint_every)
        self.group = group
        self._mine: Optional[tuple[int, int]] = None
        """(state version, this rank's 64-bit digest), reported with the next round."""
        self.last: Optional[tuple[int, str]] = None
        """The replica's digest the last round started with (`for_report`): a steady round's ring
        compares it."""
        self.forced = -1
        """A version every member digests because their digests disagreed on the ring: its round
        is a full one (rule 9 sorts it out)."""
        self.ring: tuple[int, bool] = (-1, False)
        """(round, agreed): the last round whose ring compared digests, and its verdict: the same
        on every member that read it, which is every member that committed that round."""

    def scheduled(self, step: int) -> bool:
        """Every replica digests at the same steps: every `digest_every`, and at checkpoints."""
        return step > 0 and bool((self.every and step % self.every == 0)
                                 or (self.checkpoint_every and step % self.checkpoint_every == 0))

    def due(self, step: int) -> bool:
        """This replica digests version `step`: a scheduled one, or the version after its digests
        disagreed on a ring."""
        return self.scheduled(step) or (step > 0 and step == self.forced)

    def take(self, step: int, named: dict[str, torch.Tensor]) -> float:
        """After a commit or an adoption that made state version `step`: digest it if due.
        Returns the seconds it took."""
        if not self.due(step):
            self._mine = None
            return 0.0
        t0 = time.perf_counter()
        self._mine = (step, fast_digest(sorted(named.items())))
        return time.perf_counter() - t0

    def for_report(self, step: int) -> Optional[tuple[int, str]]:
        """(version, the replica's digest) to report in the next round, or None (every rank
        calls it; with several ranks, a gather when one is due)."""
        mine, self._mine = self._mine, None
        out: Optional[tuple[int, str]] = None
        if self.group.world > 1:
            if self.due(step):  # the same answer on every rank: else no collective
                got = self.group.gather(mine)
                if all(g is not None and g[0] == got[0][0] for g in got):
                    out = got[0][0], combine(d for _, d in got)
        elif mine is not None:
            out = mine[0], combine([mine[1]])
        self.last = out
        return out

    # -- the comparison on the ring (steady rounds) ----------------------------------------------
    def ring_due(self, q: "Quorum") -> bool:
        """Whether round `q` compares digests on its ring: a steady round (every member committed
        the same versions) from a version replicas digest at by schedule. The same answer on every
        member."""
        return q.steady and self.scheduled(q.max_step)

    def ring_vector(self, q: "Quorum") -> list[float]:
        """This replica's part of round `q`'s digest all-reduce: 1 (it has a digest of version
        q.max_step), its 16 hex digits and their squares; zeros without one. Small integers: the
        sums are exact in float32 for up to 74,000 replicas."""
        d = self.last[1] if self.last is not None and self.last[0] == q.max_step else None
        if d is None:
            return [0.0] * RING_LEN
        digits = [float(int(c, 16)) for c in d]
        return [1.0, *digits, *(x * x for x in digits)]

    def ring_verdict(self, q: "Quorum", sums: list[float]) -> bool:
        """Read round `q`'s summed vectors (the same sums on every member): every member had a
        digest and all are equal (n * sum(x^2) == sum(x)^2 for each digit: equality in
        Cauchy-Schwarz). Agreement verifies version q.max_step; a disagreement makes the next
        version a digest step for every member, and its round a full one."""
        n = len(q.members)
        s = [round(x) for x in sums]
        agreed = s[0] == n and all(n * s[1 + DIGITS + i] == s[1 + i] ** 2 for i in range(DIGITS))
        self.ring = (q.round, agreed)
        if not agreed:
            self.forced = q.max_step + 1
        return agreed

    def after(self, q: "Quorum") -> tuple[bool, int]:
        """What round `q`'s ring says about the next round (quorum.LocalView): whether it must be
        a full round that compares digests, and the version it verified (-1: none)."""
        if self.ring[0] != q.round:
            return False, -1
        return (False, q.max_step) if self.ring[1] else (True, -1)


def keep_verified_checkpoints(root: str, verified_step: int, rid: int) -> None:
    """The job halted on diverged states: checkpoints after the last step whose digests agreed
    may hold a diverged state; their manifests are renamed so that no resume or rewind loads them."""
    from lightning_ft.replica.checkpoint import invalidate_after

    gone = invalidate_after(root, verified_step)
    if gone:
        print(f"lightning-ft: replica {rid}: checkpoints {gone} may hold diverged state; their manifests were "
              "renamed manifest.json.suspect", flush=True)
