"""Gradient clipping under manual optimization (docs/ARCHITECTURE.md, "Manual optimization with
several optimizers").

Under DDP the gradients are averaged during `manual_backward`, so `self.clip_gradients(opt,
...)` before `opt.step()` clips the averaged gradients. Under ft_hsdp they are averaged inside
`opt.step()` (the round's exchange): clipping where the user calls it clipped each replica's
local gradients, and the job trained on the mean of clipped gradients instead of the clipped
mean. So `DeferredClip` records the call (the precision plugin's `clip_gradients`, which
`LightningModule.clip_gradients` ends in) and `apply` runs it on the averaged gradients after
the exchange, before the `on_before_optimizer_step` hooks, as DDP's order has it, on every
rank of every replica.

A catch-up's step runs no training_step: `catch_up` applies the clip last recorded for the
round's optimizer, and `state_dict` carries those in the catch-up meta (a restarted replica
has recorded none yet).
"""
from __future__ import annotations

from typing import Any, Callable, Optional


class DeferredClip:
    """Installs itself as `plugin.clip_gradients` (see the module docstring)."""

    def __init__(self, plugin: Any, optimizers: Callable[[], list]) -> None:
        self._plugin = plugin
        self._orig = plugin.clip_gradients
        self._optimizers = optimizers
        self.pending: dict[int, tuple[float, str]] = {}
        """optimizer index -> (clip value, algorithm) asked for in this training_step."""
        self.last: dict[int, tuple[float, str]] = {}
        """optimizer index -> the clip its last committed step applied (for catch-ups)."""
        self._applying = False
        plugin.clip_gradients = self._record

    def index(self, optimizer: Any) -> int:
        opt = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the torch one
        for i, o in enumerate(self._optimizers()):
            if o is opt or getattr(o, "_optimizer", None) is opt:
                return i
        return 0

    def _record(self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = "norm") -> None:
        if self._applying:
            self._orig(optimizer, clip_val, gradient_clip_algorithm)
            return
        algo = getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)
        self.pending[self.index(optimizer)] = (float(clip_val), str(algo))

    def _clip(self, optimizer: Any, spec: tuple[float, str]) -> None:
        from lightning.pytorch.utilities.enums import GradClipAlgorithmType

        self._applying = True
        try:
            self._orig(optimizer, spec[0], GradClipAlgorithmType(spec[1]))
        finally:
            self._applying = False

    def apply(self, index: int, optimizer: Any) -> None:
        """After the exchange: the clip this training_step asked for `optimizer`, if any."""
        spec = self.pending.get(index)
        if spec is not None:
            self._clip(optimizer, spec)

    def stepped(self, index: int, trained: bool) -> None:
        """The optimizer step returned: a committed step's clip is the one catch-ups repeat."""
        spec = self.pending.pop(index, None)
        if trained:
            if spec is None:
                self.last.pop(index, None)
            else:
                self.last[index] = spec

    def catch_up(self, index: int, optimizer: Any) -> None:
        spec = self.last.get(index)
        if spec is not None:
            self._clip(optimizer, spec)

    def state_dict(self) -> dict[int, tuple[float, str]]:
        return dict(self.last)

    def load_state_dict(self, state: Optional[dict]) -> None:
        self.last = {int(k): (float(v[0]), str(v[1])) for k, v in (state or {}).items()}
