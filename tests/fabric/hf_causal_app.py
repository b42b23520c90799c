"""Acceptance (c) of issue 41: a Hugging Face causal LM under the Trainer as an LLM user writes it:
`LlamaForCausalLM` from a tiny config, `gradient_checkpointing_enable()`, precision="bf16-mixed",
W = 2 processes per replica (FSDP2 inside the replica), strategy="ft_hsdp". Nothing else of
lightning-ft. Needs transformers (the LitGPT venv: `make llm-venv`).

    .venv-llm/bin/lightning-ft run --replicas 2 --nproc-per-replica 2 tests/fabric/hf_causal_app.py
"""
from __future__ import annotations

import argparse
import sys
import time

import lightning_ft  # noqa: F401  (registers "ft_hsdp")
import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

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


class CausalLM(L.LightningModule):
    def __init__(self, lr: float, step_sleep: float = 0.0) -> None:
        super().__init__()
        self.lr, self.step_sleep = lr, step_sleep
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
        self.model = LlamaForCausalLM(config)
        self.model.gradient_checkpointing_enable()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        time.sleep(self.step_sleep)  # a bigger model's compute (the tests want steps that last)
        loss = self.model(input_ids=batch, labels=batch).loss  # the model shifts the labels
        self.log("train_loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--strategy", default="ft_hsdp")
    p.add_argument("--step-sleep", type=float, default=0.0)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    L.seed_everything(0)
    trainer = L.Trainer(strategy=a.strategy, accelerator="cpu", devices=2, precision="bf16-mixed",
                        max_steps=a.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    loader = DataLoader(markov_tokens(2048, 16, seed=1), batch_size=4, shuffle=True)
    trainer.fit(CausalLM(a.lr, a.step_sleep), loader)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
