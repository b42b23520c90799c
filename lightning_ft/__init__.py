"""lightning-ft: fault-tolerant HSDP (FT-HSDP) for PyTorch Lightning.

`import lightning_ft` registers the strategy name "ft_hsdp" with Lightning, so that
`Trainer(strategy="ft_hsdp")` and `Fabric(strategy="ft_hsdp")` work. Importing Lightning costs
seconds, so the launcher and the coordination code do not: if Lightning is not imported yet,
registration waits for it.
"""
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

def _register() -> None:
    # The strategy module registers itself when it finishes executing; if it is importing
    # right now (it imports Lightning, which triggered this hook), it will.
    if "lightning_ft.strategy.ft_hsdp" not in sys.modules:
        import lightning_ft.strategy.ft_hsdp  # noqa: F401


def _register_fabric() -> None:
    from lightning_ft.fabric import register

    register()


_HOOKS = {"lightning.pytorch.strategies": _register, "lightning.fabric.strategies": _register_fabric}
"""Lightning's strategy registry modules, and what registers ft_hsdp with each once it executed."""


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers ft_hsdp right after one of Lightning's strategy registry modules executes."""

    def __init__(self, hooked: str) -> None:
        self.hooked = hooked

    def find_spec(self, fullname, path, target=None):
        if fullname != self.hooked:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "hooked", None) != fullname]
            _HOOKS[fullname]()

        spec.loader.exec_module = exec_and_register
        return spec


class _MarkTorch(importlib.abc.MetaPathFinder):
    """Marks `torch` in the start-up breakdown (replica/startup.py) once `import torch` finishes."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_mark(module):
            exec_module(module)
            startup.mark("torch")

        spec.loader.exec_module = exec_and_mark
        return spec


from lightning_ft.replica import startup  # noqa: E402  (os and time only)

if "torch" in sys.modules:  # imported before us: python and torch are one part
    startup.mark("torch")
else:
    startup.mark("python")
    sys.meta_path.insert(0, _MarkTorch())

for _name, _hook in _HOOKS.items():
    if _name in sys.modules:
        _hook()
    elif not any(getattr(f, "hooked", None) == _name for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport(_name))
