"""`fabric.clip_gradients` on the averaged gradients (docs/ARCHITECTURE.md, "Fabric").

Under DDP a loop's `fabric.clip_gradients(model, optimizer, max_norm=...)` runs after the
backward that all-reduced the gradients, so it clips the average. Under ft_hsdp the gradients
are averaged inside `optimizer.step()`, so the call is recorded and applied after the exchange,
on every replica alike; a catch-up's step repeats the last one. The record travels with a
catch-up (`state_dict`), so that a replica that joins before its loop ran clips as the others.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Optional

import torch


class DeferredClip:
    """The loop's last `clip_gradients` call, applied to the averaged gradients."""

    def __init__(self, params: Callable[[], Any]) -> None:
        """`params()`: the optimizer's parameters as the precision plugin sees them (unscaled)."""
        self._params = params
        self.kind: Optional[str] = None
        """"norm" or "value" (None: the loop does not clip)."""
        self.value = 0.0
        self.norm_type = 2.0
        self.error_if_nonfinite = False
        self.pending = False
        """Recorded since the last step: the step applies it."""

    def record(self, kind: str, value: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> None:
        self.kind, self.value, self.norm_type = kind, float(value), float(norm_type)
        self.error_if_nonfinite = bool(error_if_nonfinite)
        self.pending = True

    def apply(self, last: bool = False) -> None:
        """After the exchange (the step's call, if the loop clipped this step) or in a catch-up's
        commit (`last`: the clip of the last step, as the contributors did)."""
        if self.kind is None or not (self.pending or last):
            return
        self.pending = False
        params = list(self._params())
        if self.kind == "norm":
            torch.nn.utils.clip_grad_norm_(params, max_norm=self.value, norm_type=self.norm_type,
                                           error_if_nonfinite=self.error_if_nonfinite)
        else:
            torch.nn.utils.clip_grad_value_(params, clip_value=self.value)

    def state_dict(self) -> Optional[str]:
        if self.kind is None:
            return None
        return json.dumps({"kind": self.kind, "value": self.value, "norm_type": self.norm_type,
                           "error_if_nonfinite": self.error_if_nonfinite})

    def load_state_dict(self, encoded: Optional[str]) -> None:
        if not encoded:
            return
        d = json.loads(encoded)
        self.kind, self.value, self.norm_type = d["kind"], float(d["value"]), float(d["norm_type"])
        self.error_if_nonfinite = bool(d.get("error_if_nonfinite", False))


def local_norm(params: Any, norm_type: float) -> torch.Tensor:
    """The norm of this replica's own gradients (what `fabric.clip_gradients` returns here: the
    averaged ones do not exist yet)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norm = torch.nn.utils.get_total_norm(grads, norm_type)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
