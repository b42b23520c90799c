"""LR schedulers stepped by the job's committed steps, identically on every replica
(docs/ARCHITECTURE.md, "Lightning glue").

Step interval: each scheduler steps inside the commit that counts the step, before anything
else can run an optimizer step, and Lightning's own `step` calls (after every `optimizer_step`
call, or the user's under manual optimization) do nothing. A call may commit zero steps (a
batch the job already trained) or several (a catch-up, then our own step): a scheduler
stepped only when Lightning asks would give the second of those the first one's learning
rate. That was the 100-fault soak's halt: a replica healed by a catch-up inside a step
trained the step's batch at the old rate, diverged by one step's difference, and did so again
after every heal.

Epoch interval: a replica's Lightning epochs are its own (a restarted replica counts from
0), so stepping at Lightning's epoch ends would give replicas different learning rates.
These schedulers step instead when the job's committed step count crosses a multiple of
`steps_per_epoch` (one pass of the slot streams), on every replica at the same step;
Lightning's own epoch-end calls are ignored. ReduceLROnPlateau is left to Lightning.

Several optimizers (manual optimization, docs/ARCHITECTURE.md "Manual optimization with several
optimizers"): every optimizer step is a commit; a step scheduler steps in the commits of its own
optimizer only, and epoch schedulers count batches (the commits that start one), not steps. A
schedule the program steps by hand (`self.lr_schedulers()`) follows its configured interval.
Under DDP a manual-optimization program's hand calls are the schedule, whatever the interval
says, and Lightning's default interval is "epoch": a program that steps such a scheduler every
batch would get a different schedule here, so its first hand call warns (`manual=True`) and
says to configure `{"interval": "step"}`.

The state travels with catch-ups and checkpoints (`state_dict` / `load_state_dict`): it is
always the state after the holder's last commit."""
from __future__ import annotations

from typing import Any, Callable, Sequence


class CommittedSchedulers:
    def __init__(self, configs: Sequence[Any], manual: bool = False) -> None:
        """`manual`: the program uses manual optimization (its `sch.step()` calls are its own)."""
        self.configs = list(configs)
        self._stepwise: list[tuple[Any, Callable]] = []
        """(the scheduler's optimizer, its own `step`)."""
        self._epochly: list[Callable] = []
        self.steps_per_epoch = 0
        """Set by the strategy from its exactly-once sampler (0: epoch schedulers never step)."""
        for c in self.configs:
            sch = c.scheduler
            if c.reduce_on_plateau:
                continue
            orig = type(sch).step.__get__(sch)
            if c.interval == "step":
                self._stepwise.append((getattr(sch, "optimizer", None), orig))
            else:
                self._epochly.append(orig)
            sch.__class__ = self._synced_class(type(sch), warn=manual and c.interval != "step")

    @staticmethod
    def _synced_class(cls: type, warn: bool = False) -> type:
        """A subclass whose `step` does nothing: the commits step it (keeps state_dict() free of
        wrappers). `warn`: its first call warns that an epoch schedule is not a hand schedule."""
        warned: list[bool] = []

        def step(sch: Any, *args: Any, **kwargs: Any) -> None:
            if warn and not warned:
                import warnings

                warned.append(True)
                warnings.warn(f"ft_hsdp steps LR schedulers itself, at the committed steps or the job's epochs, and "
                              f"ignores calls of scheduler.step(): {cls.__name__} is configured with interval "
                              f"'epoch' (Lightning's default), so it steps once per epoch of the job. If your "
                              f"training_step steps it every batch, return it from configure_optimizers as "
                              f"{{'scheduler': ..., 'interval': 'step'}}.", stacklevel=2)

        return type(cls.__name__, (cls,), {"step": step, "__module__": cls.__module__})

    def committed(self, step: int = 0, optimizer: Any = None, new_batch: bool = True) -> None:
        """A step committed (the optimizer stepped); `step` is the committed count after it (the
        committed batches, with several optimizers). `optimizer`: the one that stepped (None:
        the only one); `new_batch`: the step started a batch (False: it continued one)."""
        for opt, orig in self._stepwise:
            if optimizer is None or opt is None or opt is optimizer:
                orig()
        if (new_batch and self._epochly and self.steps_per_epoch and step
                and step % self.steps_per_epoch == 0):
            for orig in self._epochly:
                orig()

    def state_dict(self) -> list:
        return [c.scheduler.state_dict() for c in self.configs]

    def load_state_dict(self, states: list) -> None:
        for c, s in zip(self.configs, states, strict=True):
            c.scheduler.load_state_dict(s)
