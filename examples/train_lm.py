"""A small GPT trained byte-level on the Python standard library's source, with ft_hsdp.

Plain Lightning code: the only lines that are about fault tolerance are `import lightning_ft`
and `strategy="ft_hsdp"`. Run it as

    python examples/train_lm.py --steps 200

which launches the job itself (3 replicas, the config's default, of 1 process each), or with

    lightning-ft run --replicas 3 --nproc-per-replica 1 examples/train_lm.py --steps 200

Training files and held-out files are disjoint: a file is held out when the crc32 of its
path relative to the stdlib root is 0 mod 10. Validation reports the held-out loss in bits
per byte.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
import zlib

import lightning_ft  # noqa: F401  (registers strategy="ft_hsdp"; first: the restart breakdown times torch)
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as L


def stdlib_corpus(held_out: bool, max_bytes: int) -> bytes:
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if (zlib.crc32(rel.encode()) % 10 == 0) != held_out:
                continue
            with open(path, "rb") as f:
                data = f.read()
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"".join(chunks)[:max_bytes]
    return b"".join(chunks)


class Bytes(Dataset):
    """Non-overlapping windows of `context + 1` bytes: inputs and next-byte targets."""

    def __init__(self, data: bytes, context: int) -> None:
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.context = context

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.context

    def __getitem__(self, i: int):
        s = i * self.context
        chunk = self.data[s:s + self.context + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(L.LightningModule):
    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4, context: int = 64, lr: float = 3e-3,
                 warmup: int = 20, steps: int = 200, batch: int = 16, max_bytes: int = 4_000_000) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.embed = nn.Embedding(256, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, 256), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("val_bpb", loss / math.log(2), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        hp = self.hparams
        opt = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=0.1, betas=(0.9, 0.95))

        def schedule(step: int) -> float:  # linear warmup, cosine decay to 10%
            if step < hp.warmup:
                return (step + 1) / hp.warmup
            p = min(1.0, (step - hp.warmup) / max(1, hp.steps - hp.warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(Bytes(stdlib_corpus(False, self.hparams.max_bytes), self.hparams.context),
                          batch_size=self.hparams.batch, shuffle=True)

    def val_dataloader(self):
        return DataLoader(Bytes(stdlib_corpus(True, 64 * self.hparams.context * 16), self.hparams.context),
                          batch_size=64)


class StopFile(L.Callback):
    """Stop training once `path` exists (a scheduler's or a script's way to end a run early;
    Lightning's own `trainer.should_stop`, which ft_hsdp agrees across replicas)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if os.path.exists(self.path):
            trainer.should_stop = True


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="per process")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--val-every", type=int, default=100)
    p.add_argument("--strategy", default="ft_hsdp")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--stop-file", default="", help="stop training once this file exists")
    p.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    model = GPT(d=a.d, layers=a.layers, context=a.context, lr=a.lr, steps=a.steps, batch=a.batch)
    trainer = L.Trainer(strategy=a.strategy, accelerator=a.accelerator, max_steps=a.steps,
                        val_check_interval=a.val_every, accumulate_grad_batches=a.accumulate,
                        check_val_every_n_epoch=None, limit_val_batches=4, num_sanity_val_steps=0,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=10,
                        callbacks=[StopFile(a.stop_file)] if a.stop_file else None,
                        default_root_dir=os.environ.get("LFT_RUN_DIR", "."))
    trainer.fit(model)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
