"""lightning-ft: fault-tolerant HSDP (FT-HSDP) for PyTorch Lightning.

`import lightning_ft` registers the strategy name "ft_hsdp" with Lightning, so that
`Trainer(strategy="ft_hsdp")` and `Fabric(strategy="ft_hsdp")` work, and does nothing else.
Importing Lightning costs seconds, so the launcher and the coordination code do not: when
Lightning's strategy registries are not imported yet, one import hook registers ft_hsdp with
each right after it loads (and then removes itself).
"""
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"


def _register_trainer() -> None:
    # The strategy module registers itself when it finishes executing; if it is importing
    # right now (it imports Lightning, which triggered this hook), it will.
    if "lightning_ft.strategy.ft_hsdp" not in sys.modules:
        import lightning_ft.strategy.ft_hsdp  # noqa: F401


def _register_fabric() -> None:
    from lightning_ft.fabric import register

    register()


_REGISTRIES = {"lightning.pytorch.strategies": _register_trainer, "lightning.fabric.strategies": _register_fabric}
"""Lightning's strategy registry modules, and what registers ft_hsdp with each once it executed."""


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers ft_hsdp right after one of Lightning's strategy registry modules executes."""

    def __init__(self) -> None:
        self.pending = {name for name in _REGISTRIES if name not in sys.modules}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)
        if not self.pending:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            _REGISTRIES[fullname]()

        spec.loader.exec_module = exec_and_register
        return spec


for _name, _register in _REGISTRIES.items():
    if _name in sys.modules:
        _register()
if any(name not in sys.modules for name in _REGISTRIES) and not any(
        isinstance(f, _RegisterOnImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterOnImport())
