"""LR schedulers stepped by the job's committed steps, identically on every replica
(docs/ARCHITECTURE.md, "Lightning glue").

Step interval: Lightning steps each scheduler once after every `optimizer_step` call. A call
may commit zero steps (a batch the job already trained) or several (a catch-up, then our
own step), so each scheduler's `step` is wrapped: it applies the steps owed since the last
call.

Epoch interval: a replica's Lightning epochs are its own (a restarted replica counts from
0), so stepping at Lightning's epoch ends would give replicas different learning rates.
These schedulers step instead when the job's committed step count crosses a multiple of
`steps_per_epoch` (one pass of the slot streams), on every replica at the same step;
Lightning's own epoch-end calls are ignored. ReduceLROnPlateau is left to Lightning.

The state travels with catch-ups and checkpoints (`state_dict` / `load_state_dict`)."""
from __future__ import annotations

from typing import Any, Callable, Sequence


class CommittedSchedulers:
    def __init__(self, configs: Sequence[Any]) -> None:
        self.configs = list(configs)
        self._owed: dict[int, int] = {}
        self._orig: dict[int, Callable] = {}
        self._epochly: dict[int, Callable] = {}
        self.steps_per_epoch = 0
        """Set by the strategy from its exactly-once sampler (0: epoch schedulers never step)."""
        for c in self.configs:
            sch = c.scheduler
            if c.reduce_on_plateau:
                continue
            if c.interval == "step":
                self._owed[id(sch)] = 0
                self._orig[id(sch)] = type(sch).step.__get__(sch)
            else:
                self._epochly[id(sch)] = type(sch).step.__get__(sch)
            sch.__class__ = self._synced_class(type(sch))

    def _synced_class(self, cls: type) -> type:
        """A subclass whose `step` pays the steps owed (keeps state_dict() free of wrappers)."""
        sync = self

        def step(sch: Any, *args: Any, **kwargs: Any) -> None:
            if id(sch) in sync._owed:
                sync._pay(id(sch))

        return type(cls.__name__, (cls,), {"step": step, "__module__": cls.__module__})

    def _pay(self, sid: int) -> None:
        while self._owed[sid] > 0:
            self._orig[sid]()
            self._owed[sid] -= 1

    def committed(self, step: int = 0) -> None:
        """A step committed; `step` is the committed count after it."""
        for sid in self._owed:
            self._owed[sid] += 1
        if self._epochly and self.steps_per_epoch and step and step % self.steps_per_epoch == 0:
            for orig in self._epochly.values():
                orig()

    def flush(self) -> None:
        for sid in self._owed:
            self._pay(sid)

    def state_dict(self) -> list:
        return [c.scheduler.state_dict() for c in self.configs]

    def load_state_dict(self, states: list) -> None:
        for c, s in zip(self.configs, states):
            c.scheduler.load_state_dict(s)
        for sid in self._owed:  # the source replica's state already includes its steps
            self._owed[sid] = 0
