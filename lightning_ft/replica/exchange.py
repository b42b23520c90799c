"""One rank's gradient exchange (docs/ARCHITECTURE.md, "The exchange"): a flat gradient buffer per
optimizer (buckets.py), the FTAR all-reduce of its buckets, and the bounded wait for them.

Owned by the training thread. The gradient hooks (backward) and the quorum thread (`plan_known`,
once an overlapped round's plan is in) reach the buffers only through `GradBuckets`' lock."""
from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch

from lightning_ft.coord.coordinator import Coordinator
from lightning_ft.ftar.engine import FTAR
from lightning_ft.ftar.ring import neighbours
from lightning_ft.ftar.transport.base import FatalError, FTARError
from lightning_ft.replica.buckets import GradBuckets
from lightning_ft.replica.plan import StepPlan
from lightning_ft.replica.state import opt_params

log = logging.getLogger(__name__)


class Exchange:
    """The gradient buffers of one rank and their exchange through FTAR."""

    def __init__(self, ftar: FTAR, optimizers: list[Any], rid: int, rank: int, hang_timeout_s: float,
                 report_after_s: float) -> None:
        self.ftar = ftar
        self.rid, self.rank = rid, rank
        self.hang_timeout_s, self.report_after_s = hang_timeout_s, report_after_s
        # One flat buffer per optimizer: a round exchanges the one it steps.
        self.all = [GradBuckets(opt_params(o), self._send, f"replica {rid}") for o in optimizers]
        for o, b in zip(optimizers, self.all, strict=True):
            b.attach()
            o.zero_grad = b.zero  # keep .grad as views of the exchange buffer
        self.buckets = self.all[0]
        """The buffer of the optimizer this round steps."""
        self.coord: Optional[Coordinator] = None
        """The leader's coordinator, once registered: where an exchange that waits too long is
        reported (coord/hang.py)."""
        self.seconds = 0.0
        """How long the last exchange took."""

    def select(self, opt: int) -> None:
        """The round steps optimizer `opt` (several optimizers; -1: not known, the first)."""
        self.buckets = self.all[max(opt, 0)]

    def _send(self, view: Any, plan: StepPlan) -> Any:
        return self.ftar.allreduce([view], divisor=float(plan.divisor))

    # -- the hooks: overlap with backward ----------------------------------------------------------
    def enable_overlap(self, bucket_bytes: int) -> None:
        """Exchange gradient buckets from backward hooks; the same `bucket_bytes` on every replica."""
        for b in self.all:
            b.enable_overlap(bucket_bytes)

    def arm(self, save: bool) -> None:
        self.buckets.arm(save)

    def plan_known(self, plan: StepPlan) -> None:
        self.buckets.plan_known(plan)

    def disarm(self) -> None:
        """Drop the armed gradient hooks (the coming backward's gradients are not sent)."""
        for b in self.all:
            b.disarm()

    # -- one exchange ---------------------------------------------------------------------------
    def send(self, plan: StepPlan, save_grads: bool) -> list:
        """Send every bucket the hooks did not (zeros when lagging); with `save_grads`, keep a
        copy of the local gradients for `restore`. Returns the round's Works."""
        self._t0 = time.perf_counter()
        return self.buckets.send_all(plan, save_grads)

    def wait(self, plan: StepPlan, works: list) -> Optional[FTARError]:
        """Wait for the round's Works (bounded by the engine's deadlines; this guards a stuck
        engine). Returns the exchange's error, or None when every bucket is averaged (then the
        parameters' gradients hold the averages)."""
        nbytes = self.buckets.nbytes
        start = time.monotonic()
        deadline = start + self.hang_timeout_s + self.ftar.timeout_s * 4 + nbytes / 1e7
        stall_at = start + self.report_after_s if self.coord is not None else None
        err: Optional[FTARError] = None
        try:
            for work in works:
                if stall_at is not None and not work.wait_done(max(0.0, stall_at - time.monotonic())):
                    self._report_stall(plan, time.monotonic() - start)
                    stall_at = None
                work.wait(max(0.1, deadline - time.monotonic()))
        except FatalError:
            raise
        except FTARError as e:
            log.warning("replica %d rank %d: exchange of step %d failed: %s", self.rid, self.rank, plan.step, e)
            err = e
        self.seconds = time.perf_counter() - self._t0
        return err

    def send_digest(self, vector: list[float]) -> tuple[Any, Any]:
        """A steady round's digest comparison (replica/guard.py): sum `vector` over the ring after
        the gradients. Returns (the tensor the sums land in, its Work)."""
        t = torch.tensor(vector, dtype=torch.float32, device=self.buckets.flat.device)
        return t, self.ftar.allreduce([t])

    def write_grads(self) -> None:
        """The averaged gradients as the parameters' gradients (nothing to copy: views)."""
        self.buckets.write_grads()

    def restore(self) -> bool:
        """After a failed commit: put back this rank's local gradients as they were before the
        exchange, so the step is retried without recomputing them."""
        return self.buckets.restore()

    def _report_stall(self, plan: StepPlan, waited_s: float) -> None:
        """Leader: the exchange has waited hang.report_after_s; say where (coord/hang.py): our
        ring neighbours and the FTAR link counters, in etcd and the log."""
        q = plan.quorum
        if self.rid not in q.members or self.coord is None:
            return
        lj, rj = neighbours(len(q.members), q.index(self.rid))
        links = self.ftar.links.snapshot()
        stall = {"round": q.round, "epoch": q.epoch, "step": plan.step, "rank": self.rank,
                 "waited_s": round(waited_s, 3), "left": q.members[lj], "right": q.members[rj], "links": links}
        log.warning("replica %d: exchange of step %d waiting %.1fs: from r%d %d bytes outstanding, to r%d %d",
                    self.rid, plan.step, waited_s, stall["left"], links["rx_outstanding"], stall["right"],
                    links["tx_outstanding"])
        self.coord.report_stall(stall)
