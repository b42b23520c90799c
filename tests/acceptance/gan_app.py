"""A GAN with manual optimization, written as Lightning's documentation writes it (Manual
Optimization: `automatic_optimization = False`, `self.optimizers()`, `manual_backward`,
`toggle_optimizer` / `untoggle_optimizer`, a scheduler stepped by hand through
`self.lr_schedulers()`), trained with strategy="ft_hsdp". Nothing here seeds anything.

    gan_app.py STEPS

The only lines that are not the program's: the Slow callback (the test harness's pacing).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_ft  # noqa: F401  (registers "ft_hsdp")
import lightning.pytorch as L
from pacing import Slow  # the test harness's pacing (next to this file), not part of the program

LATENT, IMAGE = 8, 64


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(LATENT, 64), nn.LeakyReLU(0.2), nn.Linear(64, IMAGE), nn.Tanh())

    def forward(self, z):
        return self.model(z)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(IMAGE, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))

    def forward(self, x):
        return self.model(x)


class SimpleGAN(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.G = Generator()
        self.D = Discriminator()
        # Important: This property activates manual optimization.
        self.automatic_optimization = False
        self.criterion = nn.BCEWithLogitsLoss()

    def sample_G(self, n: int) -> torch.Tensor:
        z = torch.randn(n, LATENT, device=self.device)
        return self.G(z)

    def training_step(self, batch, batch_idx):
        g_opt, d_opt = self.optimizers()
        X, _ = batch
        batch_size = X.shape[0]
        real_label = torch.ones((batch_size, 1), device=self.device)
        fake_label = torch.zeros((batch_size, 1), device=self.device)
        g_X = self.sample_G(batch_size)

        # Optimize Discriminator
        self.toggle_optimizer(d_opt)
        d_x = self.D(X)
        errD_real = self.criterion(d_x, real_label)
        d_z = self.D(g_X.detach())
        errD_fake = self.criterion(d_z, fake_label)
        errD = errD_real + errD_fake
        d_opt.zero_grad()
        self.manual_backward(errD)
        d_opt.step()
        self.untoggle_optimizer(d_opt)

        # Optimize Generator
        self.toggle_optimizer(g_opt)
        d_z = self.D(g_X)
        errG = self.criterion(d_z, real_label)
        g_opt.zero_grad()
        self.manual_backward(errG)
        g_opt.step()
        self.untoggle_optimizer(g_opt)

        g_sch, d_sch = self.lr_schedulers()
        g_sch.step()
        d_sch.step()
        self.log_dict({"g_loss": errG, "d_loss": errD}, prog_bar=True)

    def configure_optimizers(self):
        g_opt = torch.optim.Adam(self.G.parameters(), lr=2e-4, betas=(0.5, 0.999))
        d_opt = torch.optim.Adam(self.D.parameters(), lr=2e-4, betas=(0.5, 0.999))
        g_sch = {"scheduler": torch.optim.lr_scheduler.StepLR(g_opt, step_size=5, gamma=0.8), "interval": "step"}
        d_sch = {"scheduler": torch.optim.lr_scheduler.ExponentialLR(d_opt, gamma=0.97), "interval": "step"}
        return [g_opt, d_opt], [g_sch, d_sch]

    def train_dataloader(self):
        g = torch.Generator().manual_seed(3)  # the data is fixed; the model init and the noise are not
        centers = torch.randn(4, IMAGE, generator=g)
        X = (centers[torch.randint(0, 4, (2048,), generator=g)] + 0.1 * torch.randn(2048, IMAGE, generator=g)).tanh()
        return DataLoader(TensorDataset(X, torch.zeros(2048)), batch_size=16, shuffle=True)


def main(argv: list[str]) -> int:
    steps = int(argv[0]) if argv else 60
    torch.set_num_threads(1)
    trainer = L.Trainer(strategy="ft_hsdp", accelerator="cpu", max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Slow(0.03, 1.0)], default_root_dir=os.environ.get("LFT_RUN_DIR", "."))
    trainer.fit(SimpleGAN())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
