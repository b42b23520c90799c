"""lightning-ft for Lightning Fabric: `Fabric(strategy="ft_hsdp")` (docs/ARCHITECTURE.md, "Fabric").

`import lightning_ft` registers the name with Fabric's strategy registry (as it does with the
Trainer's); the strategy module itself is imported when a Fabric builds it, since the registry
hook runs while `lightning.fabric` is still importing.
"""
from __future__ import annotations

from typing import Any

NAME = "ft_hsdp"


def _build(**kwargs: Any) -> Any:
    from lightning_ft.fabric.strategy import FTHSDPStrategy

    return FTHSDPStrategy(**kwargs)


def register(registry: Any = None) -> None:
    """Register "ft_hsdp" with Fabric's STRATEGY_REGISTRY (once)."""
    if registry is None:
        from lightning.fabric.strategies import STRATEGY_REGISTRY as registry
    if NAME not in registry:
        registry.register(NAME, _build, description="fault-tolerant HSDP: FSDP2 per replica, FTAR + per-step quorum "
                                                    "across replicas")

