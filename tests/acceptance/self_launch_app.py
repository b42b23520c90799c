"""A plain Lightning program run as `python self_launch_app.py ...`, with no launcher: with
strategy="ft_hsdp" it launches its own job (lightning_ft/strategy/self_launch.py).

    self_launch_app.py string STEPS DEVICES            Trainer(strategy="ft_hsdp"): config from $LFT_CONFIG
    self_launch_app.py code STEPS DEVICES R [K=V ...]  FTHSDPStrategy(replicas=R, overrides=[K=V ...])
    self_launch_app.py raise STEPS DEVICES R [K=V ...] as `code`, and training_step raises everywhere

BoringModel and BoringDataModule, unseeded. The harness's callbacks (not the program's) pace
the batches and print one line per training process: its pid and parent pid.
"""
from __future__ import annotations

import json
import os
import sys

import torch

import lightning_ft  # noqa: F401  (registers "ft_hsdp")
import lightning.pytorch as L
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from pacing import Slow  # the test harness's pacing (next to this file), not part of the program

from lightning_ft.strategy.ft_hsdp import FTHSDPStrategy


class Raises(BoringModel):
    def training_step(self, batch, batch_idx):
        raise RuntimeError("this program fails in every replica")


class WhoTrains(L.Callback):
    """Harness: which processes train (the one the user started must not)."""

    def on_train_start(self, trainer, pl_module):
        print(json.dumps({"event": "trains", "pid": os.getpid(), "ppid": os.getppid(),
                          "replica": os.environ.get("LFT_REPLICA_ID"), "rank": trainer.global_rank}), flush=True)


def main(argv: list[str]) -> int:
    mode, steps, devices = argv[0], int(argv[1]), int(argv[2])
    torch.set_num_threads(1)
    strategy = "ft_hsdp" if mode == "string" else FTHSDPStrategy(replicas=int(argv[3]), overrides=argv[4:])
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Slow(0.03), WhoTrains()],
                        default_root_dir=os.environ.get("LFT_RUN_DIR", "."))
    trainer.fit(Raises() if mode == "raise" else BoringModel(), datamodule=BoringDataModule())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
