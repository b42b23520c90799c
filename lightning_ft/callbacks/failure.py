"""`FailureInjector`: make this replica fail on schedule (kill, exception, hang or corrupt).

The schedule is the job's `failure` config (explicit events and/or random ones by MTBF, in
steps), shared by every replica; the launcher restarts a failed replica after its delay, or
after `downtime_steps` of the others' progress. The k-th injection of a replica fires in
its k-th incarnation, when its committed step reaches the injection's step. `corrupt` flips
a bit of one parameter and training goes on (the divergence guard must catch it); the
replica keeps its incarnation, so its later injections do not fire."""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, Optional

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_ft.launch.failure import FailureSchedule, Injection


class InjectedFailure(RuntimeError):
    pass


class FailureInjector(Callback):
    def __init__(self, schedule: Optional[FailureSchedule] = None) -> None:
        self.schedule = schedule
        self._mine: Optional[Injection] = None
        self._fired = False

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        strategy = trainer.strategy
        cfg = strategy.load_ft_config().failure
        if self.schedule is None:
            self.schedule = FailureSchedule.from_config(cfg, strategy.num_replicas)
        self._signalled = False
        if cfg.signal_exception:
            signal.signal(signal.SIGUSR1, self._on_signal)
        self._mine = self._of(strategy)

    def _of(self, strategy: Any) -> Optional[Injection]:
        """This incarnation's injection (a warm spare learns its replica and incarnation only when
        promoted, in the strategy's setup, after this callback's: `on_train_start` asks again)."""
        assert self.schedule is not None
        mine = [e for e in self.schedule.events() if e.replica == strategy.rid]
        inc = strategy.incarnation
        return mine[inc] if 0 <= inc < len(mine) else None

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.schedule is not None:
            self._mine = self._of(trainer.strategy)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signalled = True

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if getattr(self, "_signalled", False):
            self._signalled = False
            raise InjectedFailure(f"injected exception (SIGUSR1) in replica {trainer.strategy.rid}")
        inj = self._mine
        mgr = trainer.strategy.replica
        if inj is None or self._fired or mgr is None or mgr.step < inj.step:
            return
        self._fired = True
        rank = trainer.strategy.global_rank
        if rank == 0:
            print(f"lightning-ft: injecting {inj.kind} into replica {inj.replica} at step {mgr.step}",
                  file=sys.stderr, flush=True)
        if inj.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif inj.kind == "corrupt":
            if rank == 0:
                from lightning_ft.replica.state import flip_bit

                name = flip_bit(pl_module)
                print(f"lightning-ft: flipped a bit of {name} in replica {inj.replica}", file=sys.stderr, flush=True)
        elif inj.kind == "hang":
            if rank == 0:  # the leader stops: no progress, no keepalive; the others block on it
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                time.sleep(3600)
        else:
            raise InjectedFailure(f"injected exception in replica {inj.replica} at step {mgr.step}")
