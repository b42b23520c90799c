"""A Fabric loop written as LitGPT writes its pretraining loop (acceptance program b of issue 41),
with nothing of lightning-ft in it but the strategy's name: its state in one dict, resume from
the newest `step-*/lit_model.pth` with `fabric.load`, gradient accumulation with
`no_backward_sync`, a cosine learning rate with warm-up computed from its own `iter_num`,
clipping, `fabric.save` every --save-every steps. The model is a small causal language model
over a synthetic token stream (a noisy fixed-order Markov chain), so the loss falls quickly.

    lightning-ft run --replicas 3 tests/fabric/litgpt_shape_app.py --out OUT
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import lightning_ft  # noqa: F401  (registers "ft_hsdp" with Fabric)
import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class Tokens(Dataset):
    """Sequences of a fixed Markov chain over `vocab` tokens (the next token is a fixed function of
    the two before it, 90% of the time)."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        table = torch.randint(0, vocab, (vocab, vocab), generator=torch.Generator().manual_seed(7))
        x = torch.zeros(n, seq + 1, dtype=torch.long)
        x[:, :2] = torch.randint(0, vocab, (n, 2), generator=g)
        noise = torch.rand(n, seq + 1, generator=g) < 0.1
        rand = torch.randint(0, vocab, (n, seq + 1), generator=g)
        for t in range(2, seq + 1):
            x[:, t] = torch.where(noise[:, t], rand[:, t], table[x[:, t - 2], x[:, t - 1]])
        self.x = x

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))  # (B, T, C)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


def get_lr(lr: float, it: int, warmup: int, max_iters: int, min_lr: float) -> float:
    """LitGPT's: linear warm-up, then cosine decay to min_lr."""
    if it < warmup:
        return lr * it / warmup
    if it > max_iters:
        return min_lr
    ratio = (it - warmup) / (max_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


class CycleIterator:
    """LitGPT's (litgpt/utils.py): iterate again at the end of a pass."""

    def __init__(self, iterable) -> None:
        self.iterable, self.epoch, self._it = iterable, 0, None

    def __next__(self):
        if self._it is None:
            self._it = iter(self.iterable)
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.iterable)
            self.epoch += 1
            return next(self._it)

    def __iter__(self):
        return self


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategy", default="ft_hsdp")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra 'compute' per optimizer step")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out)
    fabric = L.Fabric(accelerator="cpu", devices=a.devices, strategy=a.strategy, precision="32-true")
    fabric.launch()
    fabric.seed_everything(42)
    vocab, seq = 32, 16
    with fabric.init_module(empty_init=False):
        model = GPT(vocab, seq, d=32, layers=2, heads=2)
    model = fabric.setup_module(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1, betas=(0.9, 0.95))
    optimizer = fabric.setup_optimizers(optimizer)
    train_loader = DataLoader(Tokens(4096, seq, vocab, seed=1), batch_size=a.micro_batch, shuffle=True)
    val_loader = DataLoader(Tokens(256, seq, vocab, seed=2), batch_size=32)
    train_loader, val_loader = fabric.setup_dataloaders(train_loader, val_loader)
    state = {"model": model, "optimizer": optimizer, "train_dataloader": train_loader, "iter_num": 0,
             "step_count": 0}
    resume = max(out.rglob("step-*/*.pth"), key=lambda p: int(p.parent.name.split("-")[1]), default=None)
    if resume:
        fabric.print(f"Resuming training from {resume}")
        fabric.load(resume, state)
    max_iters = a.steps * a.accumulate
    warmup = 10 * a.accumulate
    it = CycleIterator(train_loader)
    for batch in it:
        if state["iter_num"] >= max_iters:
            break
        lr = get_lr(a.lr, state["iter_num"], warmup, max_iters, a.lr / 10)
        for group in optimizer.param_groups:
            group["lr"] = lr
        state["iter_num"] += 1
        x, y = batch[:, :-1], batch[:, 1:]
        is_accumulating = state["iter_num"] % a.accumulate != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
            fabric.backward(loss / a.accumulate)
        if not is_accumulating:
            time.sleep(a.step_sleep)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            state["step_count"] += 1
            if fabric.local_rank == 0:
                print(json.dumps({"event": "loop", "iter": state["iter_num"], "step": state["step_count"],
                                  "loss": loss.item(), "lr": lr}), flush=True)
            if state["step_count"] % a.save_every == 0:
                path = out / f"step-{state['step_count']:08d}" / "lit_model.pth"
                path.parent.mkdir(parents=True, exist_ok=True)
                fabric.save(path, state)
    model.eval()
    with torch.no_grad():
        losses = [F.cross_entropy(model(b[:, :-1]).reshape(-1, vocab), b[:, 1:].reshape(-1)) for b in val_loader]
    val = fabric.all_reduce(torch.stack(losses).mean(), reduce_op="mean")
    if fabric.local_rank == 0:
        print(json.dumps({"event": "end", "step": state["step_count"], "iter": state["iter_num"],
                          "val_loss": float(val), "pid": os.getpid()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
