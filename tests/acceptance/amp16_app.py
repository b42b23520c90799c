"""A typical fp16 mixed-precision program: a classifier with a GradScaler (Lightning's
MixedPrecision plugin), gradient clipping and a OneCycle schedule, trained with
strategy="ft_hsdp". Nothing here seeds anything.

    amp16_app.py STEPS

On a GPU this would be `precision="16-mixed"`; on CPU Lightning turns that into bf16, so the
program names the plugin: `MixedPrecision("16-mixed", "cpu")` (fp16 autocast, a real
GradScaler). The only lines that are not the program's: the Slow callback (the test
harness's pacing).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_ft  # noqa: F401  (registers "ft_hsdp")
import lightning.pytorch as L
from lightning.pytorch.plugins.precision import MixedPrecision
from pacing import Slow  # the test harness's pacing (next to this file), not part of the program


class Classifier(L.LightningModule):
    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(),
                                 nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        sch = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=self.steps + 1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(5)  # the data is fixed; the model init is not
        x = torch.randn(4096, 32, generator=g)
        y = (x[:, :4] * 3).argmax(1)
        return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)


def main(argv: list[str]) -> int:
    steps = int(argv[0]) if argv else 60
    torch.set_num_threads(1)
    trainer = L.Trainer(strategy="ft_hsdp", accelerator="cpu", max_steps=steps, logger=False,
                        plugins=[MixedPrecision("16-mixed", "cpu")], gradient_clip_val=1.0,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Slow(0.03)], default_root_dir=os.environ.get("LFT_RUN_DIR", "."))
    trainer.fit(Classifier(steps))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
