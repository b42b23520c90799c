"""A LightningCLI app, written as Lightning's CLI guide writes one: a LightningModule and a
LightningDataModule whose __init__ arguments become `--model.*` and `--data.*`, and
everything else (`--trainer.strategy ft_hsdp` too) comes from the command line:

    cli_app.py fit --trainer.strategy ft_hsdp --trainer.max_steps 60 --model.hidden 24 ...

Nothing here seeds anything. The lines that are not the program's: the harness's callbacks
in `trainer_defaults` (Slow paces the batches; Args prints the arguments each process got).
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_ft  # noqa: F401  (registers "ft_hsdp")
import lightning.pytorch as L
from lightning.pytorch.cli import LightningCLI
from pacing import Slow  # the test harness's pacing (next to this file), not part of the program


class Regressor(L.LightningModule):
    def __init__(self, hidden: int = 32, lr: float = 0.05, momentum: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=25, gamma=0.5)}


class Data(L.LightningDataModule):
    def __init__(self, batch_size: int = 16, samples: int = 1024) -> None:
        super().__init__()
        self.batch_size, self.samples = batch_size, samples

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(3)  # the data is fixed; the model init is not
        x = torch.randn(self.samples, 8, generator=g)
        self.train = TensorDataset(x, x.sum(1, keepdim=True).sin())

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)


class Args(L.Callback):
    """Harness: the arguments this process trains with."""

    def on_train_start(self, trainer, pl_module):
        print(json.dumps({"event": "args", "replica": os.environ.get("LFT_REPLICA_ID"),
                          "strategy": type(trainer.strategy).__name__, "max_steps": trainer.max_steps,
                          "hidden": pl_module.hparams.hidden, "lr": pl_module.hparams.lr,
                          "momentum": pl_module.hparams.momentum, "batch_size": trainer.datamodule.batch_size}),
              flush=True)


def cli_main() -> None:
    torch.set_num_threads(1)
    LightningCLI(Regressor, Data, trainer_defaults={"callbacks": [Slow(0.03), Args()]})


if __name__ == "__main__":
    cli_main()
