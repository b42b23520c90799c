"""`LRIntervention`: scale the learning rate by f(healthy/total) while replicas are down.

The factor multiplies every param group's lr just around `optimizer.step` of each committed
step and is restored right after, before Lightning steps the LR schedulers, so it never
compounds into the schedule (the replica core applies it; docs/ARCHITECTURE.md, "A step", 5)."""
from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_ft.constants import LR_MODES


class LRIntervention(Callback):
    def __init__(self, mode: str = "sqrt") -> None:
        if mode not in LR_MODES:
            raise ValueError(f"LRIntervention mode {mode!r} is not one of {', '.join(LR_MODES)}")
        self.mode = mode

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        from lightning_ft.strategy.ft_hsdp import FTHSDPStrategy

        if not isinstance(trainer.strategy, FTHSDPStrategy):
            raise TypeError("LRIntervention needs Trainer(strategy='ft_hsdp')")
        trainer.strategy.lr_intervention = self.mode
