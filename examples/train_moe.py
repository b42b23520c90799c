"""A small decoder-only mixture-of-experts transformer, byte-level on the Python stdlib source.

Plain Lightning code (the model of the failure study, docs/study/): 8 experts per layer,
top-2 routing, a load-balancing auxiliary loss, and held-out evaluation in bits per byte.
The only lines about fault tolerance are `import lightning_ft` and `strategy="ft_hsdp"`.

    lightning-ft run --replicas 4 examples/train_moe.py --steps 300 lr_intervention=sqrt

The corpus is train_lm.py's: a file is held out when the crc32 of its path relative to the
stdlib root is 0 mod 10. Each validation appends {"step", "val_bpb"} to
`$LFT_RUN_DIR/replica_{rid}/eval.jsonl` (every replica logs the same value: the strategy
reduces `sync_dist` metrics across replicas), which `lightning-ft study` reads.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_lm import Bytes, stdlib_corpus  # noqa: E402  (the same corpus and windows)

import lightning_ft  # noqa: F401,E402  (registers strategy="ft_hsdp")
import lightning.pytorch as L  # noqa: E402
from lightning.pytorch.plugins.precision import Precision  # noqa: E402

AUX_WEIGHT = 0.01
"""Weight of the load-balancing loss (Switch Transformer style; 1.0 when perfectly balanced)."""


_MATMULS = {F.linear, torch.matmul, torch.Tensor.__matmul__, torch.mm, torch.bmm, torch.addmm,
            F.scaled_dot_product_attention}


def _bf16(x: Any) -> Any:
    return x.to(torch.bfloat16).to(x.dtype) if torch.is_tensor(x) and x.is_floating_point() else x


class _RoundMatmuls(TorchFunctionMode):
    """Rounds the operands and the result of every matmul-like op to bf16; the op itself runs in
    fp32 (bf16 x bf16 products are exact in fp32, so this is bf16 with fp32 accumulation)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS:
            args = tuple(_bf16(a) for a in args)
            kwargs = {k: _bf16(v) for k, v in kwargs.items()}
            return _bf16(func(*args, **kwargs))
        return func(*args, **kwargs)


class BF16Emulated(Precision):
    """bf16 autocast numerics on CPUs without bf16 matmuls (there `bf16-mixed` is ~20x slower):
    matmul and attention operands and results are rounded to bf16 (forward and, through the
    casts' gradients, backward); norms, softmax, losses and the optimizer stay fp32."""

    precision = "bf16-emulated"

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        with _RoundMatmuls():
            yield


def precision_plugin(name: str) -> Any:
    """`--precision`: "bf16-emulated" gives the plugin above; anything else is Lightning's."""
    return BF16Emulated() if name == "bf16-emulated" else name


class MoE(nn.Module):
    """`experts` two-layer MLPs; each token goes to its top-k experts, weighted by the
    renormalized router probabilities. `aux` is the load-balancing loss of the last forward:
    experts * sum_i(fraction of routed slots to i * mean router probability of i)."""

    def __init__(self, d: int, experts: int = 8, top_k: int = 2, hidden: int = 128) -> None:
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.router = nn.Linear(d, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, d, hidden) / math.sqrt(d))
        self.b1 = nn.Parameter(torch.zeros(experts, hidden))
        self.w2 = nn.Parameter(torch.randn(experts, hidden, d) / math.sqrt(hidden))
        self.b2 = nn.Parameter(torch.zeros(experts, d))
        self.aux = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.reshape(-1, d)                                            # (N, d)
        probs = F.softmax(self.router(flat).float(), dim=-1)              # (N, E)
        weight, chosen = probs.topk(self.top_k, dim=-1)                    # (N, k)
        weight = (weight / weight.sum(-1, keepdim=True)).to(x.dtype)
        routed = F.one_hot(chosen, self.experts).sum(1).float()           # (N, E): 1 where routed
        self.aux = self.experts * (routed.mean(0) / self.top_k * probs.mean(0)).sum()
        out = torch.zeros_like(flat)
        for e in range(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            h = F.gelu(flat[rows] @ self.w1[e] + self.b1[e])                # (n_e, hidden)
            y = h @ self.w2[e] + self.b2[e]                                  # (n_e, d)
            out.index_add_(0, rows, y * weight[rows, slot].unsqueeze(1))
        return out.view(b, t, d)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.moe = MoE(d, experts, top_k, hidden=2 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, H, T, D/H)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.moe(self.ln2(x))


class MoELM(L.LightningModule):
    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4, experts: int = 8, top_k: int = 2,
                 context: int = 64, lr: float = 3e-3, warmup: int = 20, steps: int = 300, batch: int = 16,
                 max_bytes: int = 4_000_000, val_windows: int = 512, val_batch: int = 64, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(256, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads, experts, top_k) for _ in range(layers))
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)                                                # (B, T, 256)

    def losses(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(next-byte cross entropy in nats, mean load-balancing loss over layers)."""
        x, y = batch
        ce = F.cross_entropy(self(x).float().reshape(-1, 256), y.reshape(-1))
        aux = torch.stack([blk.moe.aux for blk in self.blocks]).mean()
        return ce, aux

    def step_loss(self, batch) -> torch.Tensor:
        """What training minimizes (and what lightning-ft's steps.jsonl records as `loss`)."""
        ce, aux = self.losses(batch)
        return ce + AUX_WEIGHT * aux

    def training_step(self, batch, batch_idx):
        ce, aux = self.losses(batch)
        self.log_dict({"train_ce": ce, "train_aux": aux}, prog_bar=True)
        return ce + AUX_WEIGHT * aux

    def validation_step(self, batch, batch_idx):
        ce, _ = self.losses(batch)
        self.log("val_bpb", ce / math.log(2), sync_dist=True, batch_size=batch[0].shape[0])

    def on_validation_end(self) -> None:
        value = self.trainer.callback_metrics.get("val_bpb")
        if self.trainer.sanity_checking or value is None or self.global_rank != 0:
            return
        rid = os.environ.get("LFT_REPLICA_ID", "0")
        d = os.path.join(os.environ.get("LFT_RUN_DIR", self.trainer.default_root_dir), f"replica_{rid}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "eval.jsonl"), "a") as f:
            f.write(json.dumps({"step": self.trainer.global_step, "val_bpb": float(value)}) + "\n")

    def configure_optimizers(self):
        hp = self.hparams
        opt = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=0.1, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_schedule(step, hp.warmup, hp.steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_set(self) -> Bytes:
        return Bytes(stdlib_corpus(False, self.hparams.max_bytes), self.hparams.context)

    def val_set(self) -> Bytes:
        return Bytes(stdlib_corpus(True, self.hparams.val_windows * self.hparams.context + 1), self.hparams.context)

    def train_dataloader(self):
        return DataLoader(self.train_set(), batch_size=self.hparams.batch, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set(), batch_size=self.hparams.val_batch)


def lr_schedule(step: int, warmup: int, steps: int) -> float:
    """Linear warmup, then cosine decay to 10% at `steps`."""
    if step < warmup:
        return (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, steps - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="per process")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0, help="model initialization")
    p.add_argument("--precision", default="32-true",
                   help="32-true, bf16-emulated (bf16 matmul numerics at fp32 speed) or any Lightning precision")
    p.add_argument("--val-every", type=int, default=50)
    p.add_argument("--val-windows", type=int, default=512, help="held-out windows of `context` bytes")
    p.add_argument("--val-batch", type=int, default=64, help="held-out windows per evaluation batch")
    p.add_argument("--strategy", default="ft_hsdp")
    return p


def build(a: argparse.Namespace) -> MoELM:
    return MoELM(d=a.d, layers=a.layers, experts=a.experts, context=a.context, lr=a.lr, steps=a.steps,
                 batch=a.batch, val_windows=a.val_windows, val_batch=a.val_batch, seed=a.seed)


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    torch.set_num_threads(1)
    model = build(a)
    prec = precision_plugin(a.precision)
    trainer = L.Trainer(strategy=a.strategy, accelerator="cpu", max_steps=a.steps,
                        **({"plugins": [prec]} if isinstance(prec, Precision) else {"precision": prec}),
                        val_check_interval=a.val_every, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=50,
                        enable_checkpointing=False, default_root_dir=os.environ.get("LFT_RUN_DIR", "."))
    trainer.fit(model)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
