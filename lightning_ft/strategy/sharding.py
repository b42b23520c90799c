"""FSDP2 inside a replica when the LightningModule did not apply it (docs/ARCHITECTURE.md)."""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch


class ShardingError(RuntimeError):
    pass


def auto_shard(module: torch.nn.Module, mesh: Any, world_size: int,
               shard_layers: Optional[Sequence[Union[type, str]]] = None) -> None:
    """`fully_shard` the members of every `nn.ModuleList` (or the given layer classes), then
    each top-level child with parameters. Nothing when W = 1 (FSDP2 would only add overhead)
    or when `configure_model` already parallelized the module."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in module.parameters()):
        return
    if world_size == 1:
        return
    if shard_layers is not None:
        names = {c if isinstance(c, str) else c.__name__ for c in shard_layers}
        layers = [m for m in module.modules() if type(m).__name__ in names and m is not module]
    else:
        layers = [m for ml in module.modules() if isinstance(ml, torch.nn.ModuleList) for m in ml]
    for m in layers:
        fully_shard(m, mesh=mesh)
    _shard_children(module, mesh)
    loose = [n for n, p in module.named_parameters() if not isinstance(p, DTensor)]
    if loose:
        raise ShardingError(f"parameters {loose[:5]} live directly on the LightningModule, so the strategy cannot "
                            "fully_shard them; put them in a submodule, or apply fully_shard in configure_model()")


def _shard_children(module: torch.nn.Module, mesh: Any) -> None:
    """`fully_shard` each child with parameters; a container (ModuleList, ModuleDict: no forward,
    which fully_shard refuses) is looked into instead, its members sharded but those already are
    (LitGPT's GPT keeps its embedding, blocks and final norm in a ModuleDict)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for _, child in module.named_children():
        if not any(True for _ in child.parameters()) or isinstance(child, FSDPModule):
            continue
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            _shard_children(child, mesh)
        else:
            fully_shard(child, mesh=mesh)


def reshard_on_toggle(module: Any) -> None:
    """FSDP2 and Lightning's `toggle_optimizer` / `untoggle_optimizer` (manual optimization with
    several optimizers): the toggles set `requires_grad` on the optimizers' (sharded) parameters,
    but a module FSDP2 keeps unsharded between forwards (a root: `reshard_after_forward` is False
    for it) goes on using its unsharded parameters, whose `requires_grad` FSDP2 copies only when
    it unshards. The generator's forward after `toggle_optimizer(opt_g)` then ran on parameters
    that did not require grad ("element 0 of tensors does not require grad", a GAN with W = 2).
    After each toggle, reshard every FSDP2 module: its next forward unshards with the new flags
    (one more all-gather per toggle of a root module)."""
    from torch.distributed.fsdp import FSDPModule

    fsdp = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not fsdp:
        return

    def then_reshard(fn: Any) -> Any:
        def toggled(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            for m in fsdp:
                m.reshard()
            return out
        return toggled

    module.toggle_optimizer = then_reshard(module.toggle_optimizer)
    module.untoggle_optimizer = then_reshard(module.untoggle_optimizer)
