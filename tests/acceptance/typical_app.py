"""A typical Lightning training script, as people write them for DDP: a LightningDataModule,
AdamW with a OneCycle schedule, `self.log(..., sync_dist=True)`, ModelCheckpoint,
EarlyStopping, LearningRateMonitor, gradient clipping, accumulation, bf16 autocast, and
`trainer.test` after `fit`. Nothing here knows about fault tolerance but the strategy name,
and nothing seeds the model.

    typical_app.py STEPS [--stop-below X] [--precision P]

The rank-0 process of each replica prints JSON lines: {"event": "val", ...} at every
validation end (the logged val_loss and a single-process evaluation of the same weights on
the whole validation set), and {"event": "test", ...} after trainer.test.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_ft  # noqa: F401
import lightning.pytorch as L
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from pacing import Slow  # the test harness's pacing (next to this file), not part of the program


class Regression(L.LightningDataModule):
    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(2024)  # the data is fixed (a dataset on disk would be)
        x = torch.randn(1600, 12, generator=g)
        w = torch.randn(12, 1, generator=g)
        y = torch.sin(x @ w) + 0.05 * torch.randn(1600, 1, generator=g)
        self.train_set = TensorDataset(x[:1200], y[:1200])
        self.val_set = TensorDataset(x[1200:1400], y[1200:1400])
        self.test_set = TensorDataset(x[1400:], y[1400:])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=25)

    def test_dataloader(self):
        return DataLoader(self.test_set, batch_size=25)

    def predict_dataloader(self):
        return DataLoader(self.test_set, batch_size=50)


class Net(L.LightningModule):
    def __init__(self, lr: float = 3e-3, total_steps: int = 100) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(12, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x).float(), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self.net(x).float(), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def on_validation_end(self):
        if self.trainer.sanity_checking or self.global_rank != 0:
            return
        dm = self.trainer.datamodule
        with torch.no_grad():  # the same weights on the whole validation set, in one process
            x, y = dm.val_set.tensors
            full = nn.functional.mse_loss(self.net(x).float(), y).item()
        print(json.dumps({"event": "val", "step": self.trainer.global_step, "epoch": self.current_epoch,
                          "val_loss": float(self.trainer.callback_metrics["val_loss"]), "full": full,
                          "rid": int(os.environ.get("LFT_REPLICA_ID", -1))}), flush=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.hparams.lr, total_steps=self.hparams.total_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("steps", type=int)
    p.add_argument("--stop-below", type=float, default=None, help="EarlyStopping stopping_threshold")
    p.add_argument("--precision", default="bf16-mixed")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    root = os.environ.get("LFT_RUN_DIR", ".")
    stop = EarlyStopping(monitor="val_loss", patience=1000, stopping_threshold=a.stop_below, mode="min")
    ckpt = ModelCheckpoint(dirpath=os.path.join(root, "lightning_ckpts"), monitor="val_loss", save_top_k=2)
    trainer = L.Trainer(strategy="ft_hsdp", accelerator="cpu", max_steps=a.steps, precision=a.precision,
                        gradient_clip_val=0.5, accumulate_grad_batches=2, val_check_interval=10,
                        check_val_every_n_epoch=None, num_sanity_val_steps=2, log_every_n_steps=5,
                        callbacks=[ckpt, stop, LearningRateMonitor(logging_interval="step"), Slow(0.0)],
                        logger=CSVLogger(root, name="csv"), enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=root)
    dm = Regression()
    model = Net(total_steps=a.steps + 10)
    trainer.fit(model, datamodule=dm)
    out = trainer.test(model, datamodule=dm, verbose=False)
    val = trainer.validate(model, datamodule=dm, verbose=False)
    preds = trainer.predict(model, datamodule=dm)
    if trainer.global_rank == 0:
        print(json.dumps({"event": "test", "test_loss": out[0]["test_loss"], "val_loss": val[0]["val_loss"],
                          "predicted": sum(int(p.shape[0]) for p in preds), "pred_sum": float(sum(p.float().sum()
                                                                                               for p in preds)),
                          "step": trainer.global_step, "rid": int(os.environ.get("LFT_REPLICA_ID", -1))}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
