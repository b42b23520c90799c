"""Lightning callbacks for ft_hsdp: the LR intervention and failure injection."""
from lightning_ft.callbacks.failure import FailureInjector
from lightning_ft.callbacks.lr import LRIntervention

__all__ = ["FailureInjector", "LRIntervention"]
