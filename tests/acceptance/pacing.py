"""Pacing for the acceptance programs (the test harness's, not theirs): a little sleep per
batch so that a test's random SIGKILL lands mid-run, and longer while a replica is away, so
that the run does not end before the restarted one is back (a restart is a process start:
seconds on a loaded machine)."""
from __future__ import annotations

import os
import time

import lightning.pytorch as L


class Slow(L.Callback):
    def __init__(self, seconds: float, degraded: float = 0.5) -> None:
        self.seconds, self.degraded = seconds, degraded

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        plan = getattr(getattr(trainer.strategy, "replica", None), "last_plan", None)
        away = plan is not None and len(plan.quorum.members) < int(os.environ.get("LFT_NUM_REPLICAS", "1"))
        time.sleep(self.degraded if away else self.seconds)
