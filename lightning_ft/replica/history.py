"""The replica's part of the job's history (docs/ARCHITECTURE.md, "The ledger"; "The divergence
guard"): recording commits in the ledger (fenced: a lapsed incarnation records nothing, and its
state is disowned), the digests every replica takes at the same steps, and what a halt keeps."""
from __future__ import annotations

import logging
import time
from typing import Optional


from lightning_ft.replica import ledger
from lightning_ft.replica.state import (combine, fast_digest, hyperparameters)

from lightning_ft.replica.base import ReplicaBase

log = logging.getLogger(__name__)


class History(ReplicaBase):
    """Ledger records and digests (over the replica's base)."""

    def flush_ledger(self) -> bool:
        """Record the unrecorded commits in the ledger and advance the cursors (leader;
        idempotent). The write is fenced: an evicted incarnation, or one whose lease lapsed,
        records nothing. Returns whether the ledger knows every step this replica committed
        (False once a write was refused, until a catch-up or sync replaces the state)."""
        with self._ledger_lock:
            recs, self._unrecorded = self._unrecorded, []
        if recs and self.is_leader:
            if not ledger.record_commits(self.store, self.root, self.rid, recs, fence=self.coord.fence()):
                # The 100-fault soak: a replica whose lease lapsed while its last ring completed (the
                # others' failed) kept its step S+1, re-registered and reported it next to theirs,
                # which they had redone without it: same step, other state. Majorities healed it;
                # with two replicas left the divergence guard halted the job.
                self.state = self.state.disown()
                log.warning("replica %d: the ledger refused our records of steps %d..%d (evicted or our lease "
                            "lapsed): the others may have redone them without us, so this replica adopts a "
                            "member's state before it trains again", self.rid, recs[0][0], recs[-1][0])
                self.event("disowned", steps=[recs[0][0], recs[-1][0]])
        return not self.state.disowned

    # -- the divergence guard --------------------------------------------------------------------
    def digest_due(self, step: int) -> bool:
        """Every replica digests at the same steps: every `digest_every`, and at checkpoints."""
        return step > 0 and bool((self.digest_every and step % self.digest_every == 0)
                                 or (self.checkpoint_every and step % self.checkpoint_every == 0))

    def _take_digest(self) -> None:
        if not self.digest_due(self.step):
            self._digest = None
            return
        t0 = time.perf_counter()
        named = {**self.state_tensors(), **hyperparameters(self.optimizer),  # the learning rate too
                 **(self.scaler.digest_tensors() if self.scaler is not None else {})}  # and the loss scale
        self._digest = (self.step, fast_digest(sorted(named.items())))
        self.stats.digest_s = time.perf_counter() - t0

    def _replica_digest(self) -> Optional[tuple[int, str]]:
        """(version, replica digest) to report now (every rank takes part), or None."""
        mine, self._digest = self._digest, None
        if self.world > 1:
            if not self.digest_due(self.step):  # the same answer on every rank: no collective
                return None
            got = self.group.gather(mine)
            if any(g is None or g[0] != got[0][0] for g in got):
                return None
            return got[0][0], combine(d for _, d in got)
        return None if mine is None else (mine[0], combine([mine[1]]))

    def on_halt(self) -> None:
        """The job halted (diverged states): keep only checkpoints whose digests agreed."""
        from lightning_ft.replica.checkpoint import invalidate_after

        plan = self.last_plan
        if self.is_leader and self.checkpoint_root and plan is not None:
            gone = invalidate_after(self.checkpoint_root, plan.quorum.verified_step)
            if gone:
                print(f"lightning-ft: replica {self.rid}: checkpoints {gone} may hold diverged state; their "
                      f"manifests were renamed manifest.json.suspect", flush=True)
