"""Lightning's own demo classes, unmodified and unseeded, trained with strategy="ft_hsdp".

    boring_app.py boring      BoringModel + BoringDataModule (SGD, StepLR per epoch)
    boring_app.py transformer lightning.pytorch.demos LightningTransformer on generated tokens

Nothing here seeds anything: DDP users never do, because DDP broadcasts rank 0's weights.
A small callback sleeps a little per batch so that a test's random SIGKILL lands mid-run, and
longer while a replica is away, so that the run does not end before the restarted one is back
(a restart is a process start: seconds on a loaded machine).
"""
from __future__ import annotations

import os
import sys

import torch
from torch.utils.data import DataLoader, Dataset

import lightning_ft  # noqa: F401  (registers "ft_hsdp")
import lightning.pytorch as L
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from lightning.pytorch.demos.transformer import LightningTransformer
from pacing import Slow  # the test harness's pacing (next to this file), not part of the programs


class Tokens(Dataset):
    """A generated token dataset shaped like the demos' WikiText2: (input, target) blocks."""

    def __init__(self, vocab: int = 64, n: int = 256, block: int = 16) -> None:
        g = torch.Generator().manual_seed(7)  # the data is fixed; the model init is not
        base = torch.randint(0, vocab, (n * block + 1,), generator=g)
        self.x = base[:-1].view(n, block)
        self.y = base[1:].view(n, block)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class SmallTransformer(LightningTransformer):
    def prepare_data(self) -> None:  # the demo downloads WikiText2; these tokens are generated
        pass

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Tokens(), batch_size=4)


def main(argv: list[str]) -> int:
    which, steps = argv[0], int(argv[1]) if len(argv) > 1 else 60
    torch.set_num_threads(1)
    trainer = L.Trainer(strategy="ft_hsdp", accelerator="cpu", max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Slow(0.03)],
                        default_root_dir=os.environ.get("LFT_RUN_DIR", "."))
    if which == "boring":
        trainer.fit(BoringModel(), datamodule=BoringDataModule())
    else:
        trainer.fit(SmallTransformer(vocab_size=64))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
