"""An unmodified Lightning program that trains from a stream loader under strategy="ft_hsdp".

    stream_app.py KIND STEPS [--samples N] [--workers W] [--data DIR] [--step-sleep S] [--degraded-sleep S]

KIND: torchdata | litdata | plain (see id_streams.make_loader). Every process prints one JSON
line per training batch: {"event": "ids", "rid", "rank", "pos": [k, j], "ids": [...]}, where
pos is the strategy's `batch_position` (the slot batch and micro-batch it trains).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import lightning_ft  # noqa: E402,F401  (registers "ft_hsdp")
import lightning.pytorch as L  # noqa: E402
from id_streams import make_loader  # noqa: E402
from lit_script import pace  # noqa: E402


class Model(L.LightningModule):
    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__()
        self.a = a
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x = batch["x"].float()
        loss = (self.net(x).squeeze(-1) - x.sum(-1)).pow(2).mean()
        pos = getattr(self.trainer.strategy, "batch_position", None)
        print(json.dumps({"event": "ids", "rid": int(os.environ.get("LFT_REPLICA_ID", "-1")),
                          "rank": self.global_rank, "pos": list(pos) if pos else None,
                          "ids": [int(i) for i in batch["id"]]}), flush=True)
        pace(self.a, self.trainer)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return make_loader(self.a.kind, self.a.samples, self.a.workers, self.a.data)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("kind")
    p.add_argument("steps", type=int)
    p.add_argument("--samples", type=int, default=600)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--data", default="")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--degraded-sleep", type=float, default=0.0, help="sleep per step while replicas are missing")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    trainer = L.Trainer(strategy="ft_hsdp", accelerator="cpu", max_steps=a.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=os.environ.get("LFT_RUN_DIR", "."))
    trainer.fit(Model(a))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
