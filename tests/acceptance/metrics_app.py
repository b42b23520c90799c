"""A classifier that measures itself with torchmetrics, written as torchmetrics' Lightning guide
writes one: `Accuracy` and `F1Score` objects as module attributes, updated in the steps and
logged as objects (`self.log("val_acc", self.val_acc)`), so Lightning computes and resets them
at the end of the epoch. Trained with strategy="ft_hsdp"; nothing here seeds the model.

    metrics_app.py STEPS

The lines that are not the program's: the Slow callback (the test harness's pacing) and
Report, the harness's reference: at every validation's end it prints what the program logged
beside the accuracy of the same weights on the whole validation set, computed here without
torchmetrics and without the strategy.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn as nn
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

import lightning_ft  # noqa: F401  (registers "ft_hsdp")
import lightning.pytorch as L
from pacing import Slow  # the test harness's pacing (next to this file), not part of the program

CLASSES, FEATURES = 4, 16


def _data(n: int, seed: int) -> TensorDataset:
    """`n` samples around the classes' centers (one set of centers; `seed` draws the samples)."""
    centers = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)  # the data is fixed; the model init is not
    y = torch.randint(0, CLASSES, (n,), generator=g)
    x = centers[y] + 1.5 * torch.randn(n, FEATURES, generator=g)
    return TensorDataset(x, y)


class Classifier(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)
        self.val_f1 = torchmetrics.F1Score(task="multiclass", num_classes=CLASSES, average="macro")

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc.update(logits, y)
        self.val_f1.update(logits, y)
        self.log("val_acc", self.val_acc, on_epoch=True)
        self.log("val_f1", self.val_f1, on_epoch=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(_data(1024, 1), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_data(203, 2), batch_size=16)  # 203: no split over replicas divides it evenly


class Report(L.Callback):
    """Harness: the logged metrics, once Lightning computed them, beside the whole validation
    set's accuracy with the same weights."""

    def on_validation_end(self, trainer, pl_module):
        x, y = _data(203, 2).tensors
        with torch.no_grad():
            whole = (pl_module(x).argmax(1) == y).float().mean().item()
        print(json.dumps({"event": "val", "step": trainer.global_step, "whole_acc": whole,
                          "val_acc": float(trainer.callback_metrics["val_acc"]),
                          "val_f1": float(trainer.callback_metrics["val_f1"]),
                          "replica": os.environ.get("LFT_REPLICA_ID")}), flush=True)


def main(argv: list[str]) -> int:
    steps = int(argv[0]) if argv else 60
    torch.set_num_threads(1)
    trainer = L.Trainer(strategy="ft_hsdp", accelerator="cpu", max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, val_check_interval=20, check_val_every_n_epoch=None,
                        callbacks=[Slow(0.03), Report()], default_root_dir=os.environ.get("LFT_RUN_DIR", "."))
    trainer.fit(Classifier())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
