"""A small, unmodified LightningModule trained with strategy="ft_hsdp" (or Lightning's DDP).

Run by the strategy tests under `lightning-ft run`. The rank-0 process of each replica prints
one JSON line per training batch end: {"event": "batch", "step": global_step, "loss", "lr",
"rid"}; the strategy writes run_dir/replica_{rid}/final.json at the end.

    --ddp N       : Lightning's own DDP with N processes (the reference), same data order
    --accumulate N: accumulate_grad_batches
    --manual      : manual optimization
    --gan         : a GAN under manual optimization (two optimizers, toggle_optimizer, manual_backward; with
                    --steplr a StepLR per optimizer stepped by hand): every batch is two optimizer steps
    --kill-between R:S: (--gan) replica R's first incarnation SIGKILLs itself between the discriminator's and the
                    generator's steps of the first batch at or after committed step S
    --steplr      : a StepLR(step_size=3, gamma=0.5) stepped every step
    --decay       : a LambdaLR whose rate changes at every step (1 / (1 + step / 20))
    --unseeded    : no seed: replicas start from different weights (the strategy must sync them)
    --clip X      : gradient_clip_val
    --amp16 S     : fp16 autocast with a GradScaler(init_scale=S, growth_interval=--growth-interval): Lightning's
                    MixedPrecision("16-mixed", "cpu") plugin (Lightning turns precision="16-mixed" into bf16 on CPU)
    --save-every N: a ModelCheckpoint every N training steps into --ckpt-dir (save_top_k=-1)
    --ckpt-path P : trainer.fit(model, ckpt_path=P)
    --overflow-at : global steps at which replica (DDP: rank) --overflow-replica multiplies its loss by 1e38 (its local
                    gradients overflow; the averaged ones then do on every replica)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--exit-before-training" in sys.argv:  # a typo in user code: fail before the slow imports, every time
    _who = sys.argv[sys.argv.index("--exit-before-training") + 1]
    if _who == os.environ.get("LFT_REPLICA_ID"):
        print("a typo in user code", file=sys.stderr, flush=True)
        sys.exit(1)

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

import lightning_ft  # noqa: F401  (registers "ft_hsdp")
import lightning.pytorch as L


def pace(a: argparse.Namespace, trainer) -> None:
    """The test harness's pacing (`--step-sleep`, `--degraded-sleep`); stream_app.py uses it too."""
    mgr = getattr(trainer.strategy, "replica", None)
    if a.step_sleep:  # --slow-replica: that replica's "accelerator" is --slow-factor times slower
        slow = getattr(a, "slow_factor", 1.0) if getattr(a, "slow_replica", -9) == getattr(mgr, "rid", -2) else 1.0
        time.sleep(a.step_sleep * slow)
    if a.degraded_sleep and mgr is not None and mgr.last_plan is not None \
            and len(mgr.last_plan.quorum.contributors) < mgr.R:
        time.sleep(a.degraded_sleep)  # slow down while a replica is away, so that it rejoins mid-run


class Teacher(Dataset):
    def __init__(self, n: int = 1024, dim: int = 16) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, dim, generator=g)
        w = torch.randn(dim, 1, generator=g) / dim ** 0.5
        self.y = torch.tanh(self.x @ w)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class MLP(L.LightningModule):
    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__()
        self.a = a
        if not a.unseeded:
            torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
        self.automatic_optimization = not a.manual

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        who = self.global_rank if self.a.ddp else int(os.environ.get("LFT_REPLICA_ID", "-1"))
        if self.trainer.global_step in self.a.overflow_at and who == self.a.overflow_replica:
            loss = loss * 1e38  # finite in fp32; times the loss scale it is inf
        self.pace()
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            sch = self.lr_schedulers()
            if sch is not None:
                sch.step()
        return loss

    def pace(self) -> None:
        pace(self.a, self.trainer)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if (self.a.stop_at >= 0 and self.trainer.global_step >= self.a.stop_at
                and int(os.environ.get("LFT_REPLICA_ID", "-1")) == self.a.stop_replica):
            self.trainer.should_stop = True  # this replica alone asks to stop
        if self.global_rank == 0:
            loss = outputs["loss"].item() if isinstance(outputs, dict) else float(outputs)
            row = {"event": "batch", "step": self.trainer.global_step, "loss": loss,
                   "lr": self.trainer.optimizers[0].param_groups[0]["lr"], "applied_lr": self.applied_lr,
                   "rid": getattr(self.trainer.strategy, "rid", int(os.environ.get("LFT_REPLICA_ID", "-1"))),
                   "inc": getattr(self.trainer.strategy, "incarnation", 0)}  # a promoted spare's, not its env's
            scaler = getattr(self.trainer.precision_plugin, "scaler", None)
            if scaler is not None:
                p = next(self.parameters())
                p = p.to_local() if hasattr(p, "to_local") else p
                row.update(scale=scaler.get_scale(), growth=int(scaler._get_growth_tracker()),
                           psum=float(p.detach().double().sum()), finite=all(
                               bool(torch.isfinite(q.to_local() if hasattr(q, "to_local") else q).all())
                               for q in self.parameters()))
            mgr = getattr(self.trainer.strategy, "replica", None)
            if mgr is not None and mgr.last_plan is not None:
                row.update(contributors=list(mgr.last_plan.quorum.contributors), lr_factor=mgr.last_plan.lr_factor,
                           batch=mgr.last_plan.batch_index, lagging=mgr.last_plan.lagging)
                if mgr.last_plan.quorum.shrunk:  # stragglers.policy=shrink
                    row.update(shrunk=[list(e) for e in mgr.last_plan.quorum.shrunk], skip=list(mgr.last_plan.skip),
                               took=[list(m) for m in mgr.last_plan.micro])
            print(json.dumps(row), flush=True)

    def on_fit_start(self):
        self.applied_lr = None

        def record(opt, args, kwargs):  # the lr the optimizer actually steps with
            self.applied_lr = opt.param_groups[0]["lr"]

        self.trainer.optimizers[0].register_step_pre_hook(record)
        if self.a.fail_commit_at >= 0 and int(os.environ.get("LFT_REPLICA_ID", "0")) in self.a.fail_replicas:
            from lightning_ft.ftar.transport.base import RecoverableError

            exchange = self.trainer.strategy.replica.exchange
            wait = exchange.wait

            def failing(plan, works):  # a partial completion: this replica votes "failed" once
                err = wait(plan, works)
                if plan.step == self.a.fail_commit_at and not plan.lagging and self.a.fail_commit_at >= 0:
                    self.a.fail_commit_at = -1
                    return err or RecoverableError(None, "injected: this replica's exchange fails (--fail-commit-at)")
                return err

            exchange.wait = failing

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.a.lr)
        if self.a.steplr:
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(
                opt, step_size=3, gamma=0.5), "interval": "step"}}
        if self.a.decay:
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(
                opt, lambda s: 1.0 / (1.0 + s / 20.0)), "interval": "step"}}
        return opt

    def train_dataloader(self):
        if self.a.ddp:  # reference: the same slot order ft_hsdp uses, slot = DDP rank
            from lightning_ft.replica.ledger import SlotStream

            stream = SlotStream(len(self.data), self.a.batch * self.a.accumulate, self.a.ddp, seed=0)
            rank = self.global_rank
            n = self.a.accumulate
            sampler = [stream.batch(rank, k)[j * self.a.batch:(j + 1) * self.a.batch]
                       for k in range(self.a.steps) for j in range(n)]
            return DataLoader(self.data, batch_sampler=sampler)
        return DataLoader(self.data, batch_size=self.a.batch, shuffle=True)

    @property
    def data(self) -> Teacher:
        if not hasattr(self, "_data"):
            self._data = Teacher(self.a.samples)
        return self._data


class GAN(MLP):
    """Lightning's manual-optimization GAN pattern on the Teacher data: D tells real (x, y) pairs
    from (x, G(x)); two optimizers stepped once each per batch (global_step += 2)."""

    def __init__(self, a: argparse.Namespace) -> None:
        L.LightningModule.__init__(self)
        self.a = a
        if not a.unseeded:
            torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))  # the generator
        self.disc = nn.Sequential(nn.Linear(17, 32), nn.ReLU(), nn.Linear(32, 1))
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_d, opt_g = self.optimizers()
        self.pace()
        bce = nn.functional.binary_cross_entropy_with_logits
        # discriminator
        if not self.a.no_toggle:
            self.toggle_optimizer(opt_d)
        fake = self.net(x).detach()
        real_logit, fake_logit = self.disc(torch.cat([x, y], 1)), self.disc(torch.cat([x, fake], 1))
        d_loss = bce(real_logit, torch.ones_like(real_logit)) + bce(fake_logit, torch.zeros_like(fake_logit))
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        if self.a.clip:
            self.clip_gradients(opt_d, gradient_clip_val=self.a.clip, gradient_clip_algorithm="norm")
        opt_d.step()
        if not self.a.no_toggle:
            self.untoggle_optimizer(opt_d)
        if self.a.kill_between:
            rid, at = (int(v) for v in self.a.kill_between.split(":"))
            mgr = self.trainer.strategy.replica
            if (int(os.environ.get("LFT_REPLICA_ID", "-1")) == rid and int(os.environ.get("LFT_INCARNATION", "0")) == 0
                    and mgr.step >= at):
                print(json.dumps({"event": "kill_between", "step": mgr.step, "opt_d_steps": mgr.step}), flush=True)
                os.kill(os.getpid(), 9)
        # generator
        if not self.a.no_toggle:
            self.toggle_optimizer(opt_g)
        gen = self.net(x)
        g_logit = self.disc(torch.cat([x, gen], 1))
        g_loss = bce(g_logit, torch.ones_like(g_logit)) + nn.functional.mse_loss(gen, y)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        if not self.a.no_toggle:
            self.untoggle_optimizer(opt_g)
        if self.a.steplr:
            for sch in self.lr_schedulers():
                sch.step()
        return g_loss.detach()

    def configure_optimizers(self):
        opt_d = torch.optim.AdamW(self.disc.parameters(), lr=self.a.lr)
        opt_g = torch.optim.AdamW(self.net.parameters(), lr=self.a.lr * 2)
        if self.a.steplr:
            return [opt_d, opt_g], [
                {"scheduler": torch.optim.lr_scheduler.StepLR(opt_d, step_size=3, gamma=0.5), "interval": "step"},
                {"scheduler": torch.optim.lr_scheduler.StepLR(opt_g, step_size=2, gamma=0.7), "interval": "step"}]
        return [opt_d, opt_g]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        super().on_train_batch_end(outputs, batch, batch_idx)
        if self.global_rank == 0:
            print(json.dumps({"event": "gan", "step": self.trainer.global_step,
                              "lrs": [o.param_groups[0]["lr"] for o in self.trainer.optimizers],
                              "loss": float(outputs["loss"] if isinstance(outputs, dict) else outputs),
                              "epoch": self.current_epoch,
                              "rid": int(os.environ.get("LFT_REPLICA_ID", "-1"))}), flush=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--samples", type=int, default=1024, help="the train set's size (short epochs: small)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--manual", action="store_true")
    p.add_argument("--gan", action="store_true")
    p.add_argument("--kill-between", default="")
    p.add_argument("--no-toggle", action="store_true", help="(--gan) without toggle_optimizer/untoggle_optimizer")
    p.add_argument("--steplr", action="store_true")
    p.add_argument("--decay", action="store_true")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--degraded-sleep", type=float, default=0.0, help="sleep per step while replicas are missing")
    p.add_argument("--slow-replica", type=int, default=-1, help="this replica's --step-sleep is ...")
    p.add_argument("--slow-factor", type=float, default=1.0, help="... this many times longer (a straggler)")
    p.add_argument("--ddp", type=int, default=0)
    p.add_argument("--lr-mode", default=None)
    p.add_argument("--fail-commit-at", type=int, default=-1, help="vote 'failed' once after this step's exchange")
    p.add_argument("--fail-replicas", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--stop-at", type=int, default=-1, help="set trainer.should_stop at this step ...")
    p.add_argument("--stop-replica", type=int, default=0, help="... in this replica only")
    p.add_argument("--unseeded", action="store_true", help="no torch.manual_seed: every replica inits differently")
    p.add_argument("--clip", type=float, default=None, help="Trainer(gradient_clip_val=...)")
    p.add_argument("--amp16", type=float, default=0.0, help="fp16 autocast + GradScaler(init_scale=...) on CPU")
    p.add_argument("--growth-interval", type=int, default=3)
    p.add_argument("--overflow-at", type=lambda s: [int(x) for x in s.split(",") if x], default=[])
    p.add_argument("--overflow-replica", type=int, default=1)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--ckpt-dir", default="")
    p.add_argument("--ckpt-path", default=None)
    p.add_argument("--exit-before-training", type=int, default=-99,
                   help="this replica exits with code 1 before its first step (a crash loop)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    callbacks = []
    if a.ddp:
        # a GAN's discriminator step leaves the generator's parameters without gradients
        strategy: object = "ddp_find_unused_parameters_true" if a.gan else "ddp"
        devices = a.ddp
    else:
        from lightning_ft.callbacks import FailureInjector, LRIntervention

        strategy, devices = "ft_hsdp", "auto"
        callbacks.append(FailureInjector())
        if a.lr_mode:
            callbacks.append(LRIntervention(a.lr_mode))
    plugins = []
    if a.save_every:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=a.ckpt_dir, every_n_train_steps=a.save_every, save_top_k=-1,
                                         filename="{step}"))
    if a.amp16:
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler(
            "cpu", init_scale=a.amp16, growth_interval=a.growth_interval)))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=a.steps, plugins=plugins,
                        accumulate_grad_batches=1 if a.manual or a.gan else a.accumulate, callbacks=callbacks,
                        gradient_clip_val=None if a.gan else a.clip,
                        logger=False, enable_checkpointing=bool(a.save_every), enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=os.environ.get("LFT_RUN_DIR", "."),
                        use_distributed_sampler=not a.ddp)
    trainer.fit(GAN(a) if a.gan else MLP(a), ckpt_path=a.ckpt_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
