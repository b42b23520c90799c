"""fp16 loss scaling across replicas (docs/ARCHITECTURE.md, "16-bit: the loss scale").

`torch.amp.GradScaler` decides per process: unscale the local gradients, skip the optimizer
step if they hold an inf or a NaN, then shrink or grow the scale. Under ft_hsdp the decision
must be the job's: every rank of every replica skips the same steps and keeps the same scale,
or the replicas part ways (a skipped step on one replica, a step on another). So the decision
is taken where the gradients are the same everywhere: on the *averaged* gradients after the
exchange, inside the two-phase commit.

- `unscale(optimizer)`: after the exchange (a contributor, before Lightning's clipping and
  on_before_optimizer_step hooks, as Lightning's `MixedPrecision.optimizer_step` orders them;
  a catch-up in its commit, before `clip_catchup`): divide this rank's averaged gradient
  shards by the scale and note whether they hold a non-finite value. FTAR hands every replica
  the same bytes, so rank r of every replica notes the same.
- `overflowed(any_rank)`: in the commit, after the vote (every rank of the replica is there):
  the OR over the replica's ranks (FSDP: an inf may sit in one rank's shard only).
- `update(found)`: torch's own scale update (`torch._amp_update_scale_`, what
  `GradScaler.update` runs) with that flag: backoff on overflow, growth after
  `growth_interval` clean steps.

The scale and growth tracker are training state: catch-up carries them (meta `scaler`),
checkpoints store them (`extra.pt`; Lightning's own checkpoints store the precision plugin's
`state_dict`, the same GradScaler), and the divergence guard digests them (`digest_tensors`).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from lightning_ft.replica.state import local, opt_params


class ScalerStateError(ValueError):
    """A scaler state from a peer or a checkpoint that cannot be ours."""


def check_state(state: object) -> dict:
    """A GradScaler `state_dict()` from elsewhere (a catch-up's meta, a checkpoint), validated:
    a positive finite scale, a non-negative integer growth tracker, numeric factors."""
    if not isinstance(state, dict):
        raise ScalerStateError(f"the GradScaler state is a {type(state).__name__}, not a mapping")
    if not state:
        return {}
    scale = state.get("scale")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ScalerStateError(f"GradScaler scale {scale!r} is not a positive finite number")
    tracker = state.get("_growth_tracker", 0)
    if isinstance(tracker, bool) or not isinstance(tracker, int) or tracker < 0:
        raise ScalerStateError(f"GradScaler growth tracker {tracker!r} is not a non-negative integer")
    out = {"scale": float(scale), "_growth_tracker": int(tracker)}
    for key in ("growth_factor", "backoff_factor", "growth_interval"):
        if key in state:
            v = state[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ScalerStateError(f"GradScaler {key} {v!r} is not a number")
            out[key] = v
    return out


class ReplicaScaler:
    """One per rank, around the GradScaler that scales the loss (Lightning's precision plugin's)."""

    def __init__(self, scaler: "torch.amp.GradScaler") -> None:
        self.scaler = scaler
        self._found: Optional[torch.Tensor] = None
        """This rank's non-finite flag of the round's averaged gradients (None: not unscaled yet)."""
        self.skipped = 0
        """Committed steps whose optimizer step the overflow skipped."""
        self.last_skipped = False

    @property
    def enabled(self) -> bool:
        return bool(self.scaler.is_enabled())

    def _tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The scale and growth tracker tensors (created on `device` if the scaler never scaled:
        a replica whose first step is a catch-up)."""
        s = self.scaler
        if s._scale is None:
            s._lazy_init_scale_growth_tracker(device)
        assert s._scale is not None and s._growth_tracker is not None  # initialized together, just above
        return s._scale, s._growth_tracker

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide this rank's (averaged) gradients by the scale in place; note any inf/NaN.
        Once per round: a second call before `update` (or `reset`) does nothing."""
        if not self.enabled or self._found is not None:
            return
        grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in opt_params(optimizer):
            if p.grad is None:
                continue
            g = local(p.grad)
            if g.is_sparse:
                raise ValueError("ft_hsdp's loss scaling does not support sparse gradients")
            grads.setdefault((g.device, g.dtype), []).append(g)
        device = next(iter(grads))[0] if grads else torch.device("cpu")
        scale, _ = self._tensors(device)
        found = torch.zeros(1, dtype=torch.float32, device=scale.device)
        inv = scale.double().reciprocal().float()
        for (dev, _), gs in grads.items():
            f = torch.zeros(1, dtype=torch.float32, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(gs, f, inv.to(dev))
            found += f.to(found.device)
        self._found = found

    def overflowed(self, any_rank: Callable[[bool], bool]) -> bool:
        """Whether the round's averaged gradients overflowed on any rank of the replica
        (`any_rank`: an OR over the replica's ranks; every rank calls it). The same answer on
        every rank of every replica."""
        if not self.enabled:
            return False
        mine = self._found is not None and bool(self._found.item() > 0)
        return any_rank(mine)

    def update(self, found: bool) -> None:
        """The scale update GradScaler.update runs, with the replica's decision."""
        self._found = None
        self.last_skipped = found
        if not self.enabled:
            return
        self.skipped += int(found)
        s = self.scaler
        scale, tracker = self._tensors(torch.device("cpu"))
        flag = torch.full((1,), float(found), dtype=torch.float32, device=scale.device)
        torch._amp_update_scale_(scale, tracker, flag, s._growth_factor, s._backoff_factor, s._growth_interval)
        s._per_optimizer_states.clear()  # nothing of torch's own unscale_/step bookkeeping is used

    def reset(self) -> None:
        """A failed commit: the gradients are restored or recomputed, and unscaled again."""
        self._found = None

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.enabled else {}

    def load_state_dict(self, state: dict) -> None:
        state = check_state(state)
        if not state or not self.enabled:
            return
        full = {**self.scaler.state_dict(), **state}
        self.scaler.load_state_dict(full)
        self._found = None

    def digest_tensors(self) -> dict[str, torch.Tensor]:
        """The scale and growth tracker, for the divergence guard: replicas with other scales
        would average differently scaled gradients and skip different steps."""
        if not self.enabled:
            return {}
        st = self.scaler.state_dict()
        return {"amp.scale": torch.tensor([float(st["scale"])], dtype=torch.float64),
                "amp.growth_tracker": torch.tensor([int(st["_growth_tracker"])], dtype=torch.int64)}
