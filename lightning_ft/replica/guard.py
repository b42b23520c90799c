"""The divergence guard's part in one replica (docs/ARCHITECTURE.md, "The divergence guard"):
every replica digests its state at the same steps (every `digest_every`, and at checkpoints),
and reports the digest with its next round; the quorum compares them (coord/quorum.py rule 9).

`take` runs at a commit (training thread); `for_report` in the next round (on the thread that
runs the round: the quorum thread while overlapped), every rank of the replica; the round
starts after the commit, so the digest is handed over, never shared."""
from __future__ import annotations

import time
from typing import Optional

import torch

from lightning_ft.replica.group import ReplicaGroup
from lightning_ft.replica.state import combine, fast_digest


class Digests:
    """This rank's state digests at the agreed steps."""

    def __init__(self, digest_every: int, checkpoint_every: int, group: ReplicaGroup) -> None:
        self.every, self.checkpoint_every = max(0, digest_every), max(0, checkpoint_every)
        self.group = group
        self._mine: Optional[tuple[int, int]] = None
        """(state version, this rank's 64-bit digest), reported with the next round."""

    def due(self, step: int) -> bool:
        """Every replica digests at the same steps: every `digest_every`, and at checkpoints."""
        return step > 0 and bool((self.every and step % self.every == 0)
                                 or (self.checkpoint_every and step % self.checkpoint_every == 0))

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
        if self.group.world > 1:
            if not self.due(step):  # the same answer on every rank: no collective
                return None
            got = self.group.gather(mine)
            if any(g is None or g[0] != got[0][0] for g in got):
                return None
            return got[0][0], combine(d for _, d in got)
        return None if mine is None else (mine[0], combine([mine[1]]))


def keep_verified_checkpoints(root: str, verified_step: int, rid: int) -> None:
    """The job halted on diverged states: checkpoints after the last step whose digests agreed
    may hold a diverged state; their manifests are renamed so that no resume or rewind loads them."""
    from lightning_ft.replica.checkpoint import invalidate_after

    gone = invalidate_after(root, verified_step)
    if gone:
        print(f"lightning-ft: replica {rid}: checkpoints {gone} may hold diverged state; their manifests were "
              "renamed manifest.json.suspect", flush=True)
