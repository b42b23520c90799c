"""Train the byte-level GPT of examples/train_lm.py as a Hydra app (lightning-hydra-template layout).

    lightning-ft run --replicas 2 examples/hydra/src/train.py trainer.max_steps=100 model.lr=0.001 \\
        ft.lr_intervention=linear
    python examples/hydra/src/train.py trainer.strategy=auto          # one plain process, no lightning-ft

Nothing here is about fault tolerance except `trainer.strategy: ft_hsdp` in configs/trainer/ and
the optional `ft:` node (configs/ft/), which lightning-ft reads as its own config.
"""
from __future__ import annotations

import os
import sys

import hydra
import lightning.pytorch as L
import torch
from omegaconf import DictConfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # examples/: train_lm

import lightning_ft  # noqa: E402,F401  (registers strategy="ft_hsdp")


@hydra.main(version_base="1.3", config_path="../configs", config_name="train.yaml")
def main(cfg: DictConfig) -> None:
    L.seed_everything(cfg.seed, workers=True)
    torch.set_num_threads(cfg.threads)
    model: L.LightningModule = hydra.utils.instantiate(cfg.model)
    trainer: L.Trainer = hydra.utils.instantiate(cfg.trainer)
    trainer.fit(model)


if __name__ == "__main__":
    main()
