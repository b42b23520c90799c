"""Several optimizers as one state (docs/ARCHITECTURE.md, "Manual optimization with several
optimizers").

Manual optimization may step several optimizers per batch (a GAN's discriminator, then its
generator). Each `optimizer.step()` is one round, which steps one of them (`active`); but
everything that moves, digests or saves a replica's state covers all of them: the catch-up
tensors (`state`), the param groups (their numbers travel in catch-up meta and the digest),
a fresh replica's optimizer state. `Optimizers` gives those readers one optimizer's face
(`param_groups`, `state`, `step`, `zero_grad`), so they are unchanged; with one optimizer the
manager holds the optimizer itself.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator, Optional, Sequence

import torch


class OptimizerError(ValueError):
    """Optimizers that cannot be one replica's state (shared parameters)."""


class _States(Mapping):
    """The optimizers' `state` dicts as one read-only mapping (their parameters are disjoint)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self._opts = optimizers

    def __getitem__(self, p: Any) -> Any:
        for o in self._opts:
            if p in o.state:
                return o.state[p]
        raise KeyError(p)

    def __iter__(self) -> Iterator[Any]:
        for o in self._opts:
            yield from o.state

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._opts)


class Optimizers:
    """K optimizers over disjoint parameters; `step` steps the `active` one (all when None)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        seen: dict[int, int] = {}
        for i, o in enumerate(self.optimizers):
            for g in o.param_groups:
                for p in g["params"]:
                    if id(p) in seen and seen[id(p)] != i:
                        raise OptimizerError(f"optimizers {seen[id(p)]} and {i} share a parameter (shape "
                                             f"{tuple(p.shape)}); ft_hsdp exchanges each optimizer's gradients as one "
                                             "buffer, so give every parameter to one optimizer")
                    seen[id(p)] = i
        self.active: Optional[int] = None
        self.state = _States(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    @property
    def param_groups(self) -> list[dict]:
        """Every optimizer's param groups, in optimizer order (the same list objects)."""
        return [g for o in self.optimizers for g in o.param_groups]

    def groups_of(self, i: int) -> list[dict]:
        return self.optimizers[i].param_groups

    def step(self) -> None:
        for i, o in enumerate(self.optimizers):
            if self.active is None or i == self.active:
                o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for i, o in enumerate(self.optimizers):
            if self.active is None or i == self.active:
                o.zero_grad(set_to_none=set_to_none)


def unwrap(optimizer: Any) -> Any:
    """What torch.distributed.checkpoint's state-dict helpers take: the list of optimizers, or
    the one optimizer."""
    return optimizer.optimizers if isinstance(optimizer, Optimizers) else optimizer
