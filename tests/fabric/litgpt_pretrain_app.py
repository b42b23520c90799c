"""Acceptance (a) of issue 41: LitGPT's own pretraining loop, `litgpt.pretrain.main`, unmodified,
with a Fabric this script builds on strategy="ft_hsdp": a tiny `Config`, the script's own
`DataModule` (a synthetic token stream), `resume="auto"` (LitGPT loads the newest
`step-*/lit_model.pth` of the out dir when one exists).

Run it with the LitGPT venv (`make llm-venv`: litgpt 0.5.13 pins jsonargparse and
huggingface-hub below this project's dev pins):

    .venv-llm/bin/lightning-ft run --replicas 2 tests/fabric/litgpt_pretrain_app.py --out OUT

What LitGPT needs from a script that calls `main` itself: `save_checkpoint` re-parses
`sys.argv` against `litgpt pretrain`'s command line (so this sets one); its state dict holds
the train loader (under ft_hsdp the loader Fabric returns is stateful, so a plain DataLoader
works). torch.compile is off (TORCHDYNAMO_DISABLE=1): it compiles for minutes on this CPU.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import lightning_ft  # noqa: E402,F401  (registers "ft_hsdp" with Fabric)
import lightning as L  # noqa: E402
import torch  # noqa: E402
from litgpt import Config  # noqa: E402
from litgpt.args import EvalArgs, TrainArgs  # noqa: E402
from litgpt.data import DataModule  # noqa: E402
from litgpt.pretrain import main  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

VOCAB = 32


def markov_tokens(n: int, length: int, seed: int) -> torch.Tensor:
    """n sequences of a fixed order-2 Markov chain over VOCAB tokens (90% deterministic)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, VOCAB, (VOCAB, VOCAB), generator=torch.Generator().manual_seed(7))
    x = torch.zeros(n, length, dtype=torch.long)
    x[:, :2] = torch.randint(0, VOCAB, (n, 2), generator=g)
    noise = torch.rand(n, length, generator=g) < 0.1
    rand = torch.randint(0, VOCAB, (n, length), generator=g)
    for t in range(2, length):
        x[:, t] = torch.where(noise[:, t], rand[:, t], table[x[:, t - 2], x[:, t - 1]])
    return x


class Rows(torch.utils.data.Dataset):
    """The rows, each read in `delay_s` (a data set on a slow disk: the tests want steps that last)."""

    def __init__(self, rows: torch.Tensor, delay_s: float) -> None:
        self.rows, self.delay_s = rows, delay_s

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.rows[i]


@dataclass
class MarkovData(DataModule):
    """Rows of max_seq_length + 1 tokens, as LitGPT's pretraining data modules yield."""

    samples: int = 4096
    delay_s: float = 0.0
    batch_size: int = field(default=1, init=False, repr=False)
    max_seq_length: int = field(default=-1, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__init__()

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int | None = None, **kwargs) -> None:
        self.batch_size, self.max_seq_length = batch_size, int(max_seq_length or 16)

    def train_dataloader(self) -> DataLoader:
        rows = markov_tokens(self.samples, self.max_seq_length + 1, seed=1)
        return DataLoader(Rows(rows, self.delay_s), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(markov_tokens(128, self.max_seq_length + 1, seed=2), batch_size=self.batch_size)


def run(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps of the job")
    p.add_argument("--save-interval", type=int, default=25)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step, per process")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--strategy", default="ft_hsdp")
    p.add_argument("--sample-delay", type=float, default=0.0, help="seconds to read one training row")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=a.strategy, precision="32-true")
    fabric.launch()
    world = fabric.world_size  # ft_hsdp: the job's R x W processes, as DDP's world (LitGPT divides by it)
    config = Config(name="tiny", block_size=16, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=2,
                    n_embd=32, rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
                    mlp_class_name="LLaMAMLP", intermediate_size=64)
    per_step = a.micro_batch * a.accumulate * world  # samples of one optimizer step, over the job
    train = TrainArgs(save_interval=a.save_interval, log_interval=1, global_batch_size=per_step,
                      micro_batch_size=a.micro_batch, max_tokens=a.steps * per_step * config.block_size,
                      lr_warmup_steps=10, max_norm=1.0, min_lr=a.lr / 10, tie_embeddings=False)
    # save_checkpoint writes hyper_parameters.yaml by parsing sys.argv as `litgpt pretrain` would
    sys.argv = [sys.argv[0], "pythia-14m", "--resume", "auto"]
    main(fabric=fabric, devices=world, seed=42, initial_checkpoint_dir=None, resume="auto", config=config,
         data=MarkovData(delay_s=a.sample_delay), out_dir=Path(a.out), tokenizer_dir=None, tokenizer=None, train=train,
         eval=EvalArgs(interval=1000, max_iters=4, initial_validation=False, final_validation=True),
         optimizer={"class_path": "torch.optim.AdamW",
                    "init_args": {"lr": a.lr, "weight_decay": 0.1, "betas": (0.9, 0.95)}})
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
