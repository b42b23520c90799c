"""Gradient buckets of one rank: the flat exchange buffer and its overlap with backward
(docs/ARCHITECTURE.md, "The exchange").

The optimizer's parameters (their local shards under FSDP2) are laid out back to back in
one flat buffer, and each parameter's `.grad` is a view into it (`attach`): backward
accumulates straight into the exchange buffer, FTAR reduces it in place, and the optimizer
reads the result, with no copy in or out. The optimizer's `zero_grad` is routed to `zero`
(one memset, views kept). Where something replaced a `.grad` with a tensor of its own, the
hooks fall back to copying. With overlap enabled, buckets of about `bucket_bytes` are all-reduced as
soon as backward produced every gradient in them (post-accumulate-grad hooks; FSDP2 calls
them after its reduce-scatter) and the round's plan is known. Buckets go out in one
canonical order, reverse parameter order, whatever order the gradients arrive in, so every
replica sends the same sequence of all-reduces.

The flat buffer lives on the parameters' device: CUDA gradients stay on the GPU and FTAR
reduces them there (its device path; docs/ARCHITECTURE.md, "The device data plane").
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from lightning_ft.ftar.transport.base import FatalError
from lightning_ft.replica.state import local


@dataclass
class Round:
    """Bucket bookkeeping of one exchange."""

    save: bool
    buckets: int
    plan: Any = None
    """The round's plan once known; buckets are sent only for a contributing plan."""
    submitted: int = 0
    works: list = field(default_factory=list)
    filled: set = field(default_factory=set)
    count: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.count = [0] * self.buckets


class GradBuckets:
    """The flat gradient buffer of one rank and the hooks that fill and send it."""

    def __init__(self, params: list[torch.nn.Parameter], send: Callable[[torch.Tensor, Any], Any], who: str) -> None:
        """`send(view_of_flat, plan) -> Work` all-reduces one bucket in place."""
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise FatalError(f"{who}: parameters of mixed dtypes {sorted(map(str, dtypes))}; FTAR exchanges one "
                             "flat buffer per step, so use one parameter dtype")
        devices = {local(p).device for p in params}
        if len(devices) > 1:
            raise FatalError(f"{who}: parameters on several devices {sorted(map(str, devices))}; FTAR exchanges one "
                             "flat buffer per rank, so keep a rank's parameters on one device")
        self.params = params
        self._send = send
        self.offsets: list[tuple[int, int]] = []
        off = 0
        for p in params:
            n = local(p).numel()
            self.offsets.append((off, off + n))
            off += n
        self.device = next(iter(devices)) if devices else torch.device("cpu")
        """Where the flat buffer lives: the parameters' device (CUDA gradients stay on the GPU
        and take FTAR's device path)."""
        self.flat = torch.zeros(off, dtype=params[0].dtype, device=self.device)
        self.views = [self.flat[lo:hi].view(local(p).shape) for p, (lo, hi) in zip(params, self.offsets, strict=True)]
        self._clean = True
        """The flat buffer is all zeros (nothing accumulated or exchanged since `zero`)."""
        self.saved: Optional[torch.Tensor] = None
        self.saved_ok = False
        self.buckets: list[tuple[int, int]] = [(0, off)]
        self.need: list[int] = [len(params)]
        self.bucket_of: dict[int, int] = {i: 0 for i in range(len(params))}
        self._index: dict[int, int] = {id(p): i for i, p in enumerate(params)}
        self._lock = threading.Lock()
        self._armed = False
        self._round: Optional[Round] = None
        for p in params:  # also how we know that backward wrote into the buffer (not `_clean`)
            p.register_post_accumulate_grad_hook(self._grad_ready)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    # -- gradients as views of the flat buffer -------------------------------------------------------
    def _ours(self, i: int, p: torch.Tensor) -> bool:
        g = p.grad
        return g is not None and local(g).data_ptr() == self.views[i].data_ptr()

    def attach(self) -> None:
        """Make every parameter's `.grad` (its local shard) a view of the flat buffer."""
        for i, p in enumerate(self.params):
            if self._ours(i, p):
                continue
            view = self.views[i]
            if hasattr(p, "to_local"):  # an FSDP2 DTensor: a DTensor grad over our local view
                from torch.distributed.tensor import DTensor

                assert isinstance(p, DTensor)
                p.grad = DTensor.from_local(view, p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())
            else:
                p.grad = view

    def zero(self, set_to_none: Optional[bool] = True) -> None:
        """The optimizer's zero_grad: zero the flat buffer (once) and keep the views."""
        if not self._clean:
            self.flat.zero_()
            self._clean = True
        self.attach()

    def enable_overlap(self, bucket_bytes: int) -> None:
        """Split into buckets of >= bucket_bytes (reverse parameter order) and hook backward."""
        buckets: list[tuple[int, int]] = []
        members: list[list[int]] = []
        hi = self.flat.numel()
        cur: list[int] = []
        for i in reversed(range(len(self.params))):
            cur.append(i)
            lo = self.offsets[i][0]
            if (hi - lo) * self.flat.element_size() >= bucket_bytes or i == 0:
                buckets.append((lo, hi))
                members.append(cur)
                hi, cur = lo, []
        self.buckets = buckets
        self.bucket_of = {i: b for b, ms in enumerate(members) for i in ms}
        self.need = [len(ms) for ms in members]

    # -- a round ---------------------------------------------------------------------------------
    def arm(self, save: bool) -> None:
        """The coming backward completes a step: hooks copy and send buckets once the plan is in."""
        with self._lock:
            self._armed = True
            self._round = Round(save, len(self.buckets))

    def disarm(self) -> None:
        """Hooks stop exchanging (recomputation, retries): `exchange` sends everything."""
        with self._lock:
            self._armed = False
            self._round = None

    def plan_known(self, plan: Any) -> None:
        """The round's plan arrived (quorum thread): send the buckets already complete."""
        with self._lock:
            if self._round is not None:
                self._round.plan = plan
                self._submit_ready(self._round)

    def _grad_ready(self, p: torch.Tensor) -> None:
        self._clean = False
        with self._lock:
            r = self._round
            if not self._armed or r is None:
                return
            i = self._index[id(p)]
            if not self._ours(i, p):
                lo, hi = self.offsets[i]
                assert p.grad is not None  # a post-accumulate-grad hook: the gradient is in
                self.flat[lo:hi].copy_(local(p.grad).reshape(-1))
            if i not in r.filled:
                r.filled.add(i)
                r.count[self.bucket_of[i]] += 1
            self._submit_ready(r)

    def _submit_ready(self, r: Round) -> None:
        """Submit, in canonical order, the buckets whose gradients are all in (lock held)."""
        plan = r.plan
        if plan is None or not plan.contribute or getattr(plan, "extras", None):
            # extra slot batches (batch_policy "constant") or micro-batches (a shrunk straggler's) are
            # computed after this backward, and a shrunk one's own micro-batches may need recomputing
            return
        while r.submitted < len(self.buckets) and r.count[r.submitted] == self.need[r.submitted]:
            self._submit(r, r.submitted, plan)

    def _submit(self, r: Round, b: int, plan: Any) -> None:
        lo, hi = self.buckets[b]
        if r.save:
            if self.saved is None:
                self.saved = torch.empty_like(self.flat)
            self.saved[lo:hi].copy_(self.flat[lo:hi])
        r.works.append(self._send(self.flat[lo:hi], plan))
        r.submitted += 1

    def send_all(self, plan: Any, save: bool) -> list:
        """Fill what the hooks did not (zeros for a lagging plan) and send every bucket not
        sent yet; returns the Works of this round."""
        with self._lock:
            r = self._round if (self._armed and self._round is not None and self._round.plan is plan) else None
            self._armed, self._round = False, None
            if r is None:
                r = Round(save, len(self.buckets))
                r.plan = plan
            r.save = save and plan.contribute
            self.saved_ok = r.save
            if not plan.contribute:
                if not self._clean:
                    self.flat.zero_()
            else:
                for i, p in enumerate(self.params):
                    if i not in r.filled and not self._ours(i, p):
                        lo, hi = self.offsets[i]
                        if p.grad is None:
                            self.flat[lo:hi].zero_()
                        else:
                            self.flat[lo:hi].copy_(local(p.grad).reshape(-1))
            self._clean = False
            for b in range(r.submitted, len(self.buckets)):
                self._submit(r, b, plan)
            return r.works

    # -- gradients in and out --------------------------------------------------------------------
    def write_grads(self, src: Optional[torch.Tensor] = None) -> None:
        """The exchanged gradients (or `src`, a flat buffer of the same layout) as the
        parameters' local grads: nothing to do where the grads are our views."""
        self.attach()
        if src is not None:
            self.flat.copy_(src)
        self._clean = False

    def restore(self) -> bool:
        """Put back the local gradients saved before the exchange; False if none were saved."""
        if not self.saved_ok or self.saved is None:
            return False
        self.write_grads(self.saved)
        return True
