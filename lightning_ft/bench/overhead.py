"""Steady-state step time of ft_hsdp against Lightning's own DDP (target: ratio <= 1.03).

    python -m lightning_ft.bench.overhead [--procs 2] [--steps 60] [--rounds 4] [--width 1024] [--single]

Same LightningModule, same data, same number of processes, one torch thread each
(OMP_NUM_THREADS=1 for both, since Lightning's launcher would otherwise change the thread
count): ft_hsdp runs P replicas x 1 process under `lightning-ft run` (embedded etcd,
quorum, FTAR, two-phase commit), DDP runs P processes through Lightning's launcher (gloo).
Rounds alternate which one runs first, so a noisy machine hits both; the figure is the
median of the per-round paired ratios (one noisy round cannot decide). Step time = median
gap between consecutive `on_train_batch_end` of rank 0 after `--warmup` steps.
`--single` also compares 1 replica of ft_hsdp with single-process Lightning. Prints:

    {"bench": "overhead", "ft_step_s": ..., "ddp_step_s": ..., "ratio": ..., "ratios": [...], ...}
    {"bench": "overhead_single", "ft_step_s": ..., "lightning_step_s": ..., "ratio": ..., ...}
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)


def worker(a: argparse.Namespace) -> int:
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_ft  # noqa: F401
    import lightning.pytorch as L

    torch.set_num_threads(1)

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            w = a.width
            self.body = nn.Sequential(*[m for _ in range(a.depth) for m in (nn.Linear(w, w), nn.GELU())])
            self.out = nn.Linear(w, 1)
            self.times: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.out(self.body(x)), y)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.times.append(time.perf_counter())

        def on_train_end(self):
            if self.global_rank == 0:
                gaps = [b - t for t, b in zip(self.times, self.times[1:])][a.warmup:]
                print(json.dumps({"step_s": statistics.median(gaps), "steps": len(self.times)}), flush=True)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(1)
    n = a.batch * a.procs * (a.steps + 4)
    data = TensorDataset(torch.randn(n, a.width, generator=g), torch.randn(n, 1, generator=g))
    strategy: object = "ddp" if a.ddp else "ft_hsdp"
    if a.no_overlap and not a.ddp:
        from lightning_ft.strategy.ft_hsdp import FTHSDPStrategy

        strategy = FTHSDPStrategy(overlap=False)
    if a.ddp and a.procs == 1:
        strategy = "auto"
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=a.procs if a.ddp else "auto",
                        max_steps=a.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Model(), DataLoader(data, batch_size=a.batch, shuffle=True))
    return 0


def _step_s(out: str) -> float:
    for line in reversed(out.splitlines()):
        if line.startswith('{"step_s"'):
            return json.loads(line)["step_s"]
    raise RuntimeError("worker printed no step time:\n" + out[-3000:])


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LFT_")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_ft(a: argparse.Namespace, args: list[str], procs: int) -> float:
    with tempfile.TemporaryDirectory(prefix="lft-overhead-") as d:
        cmd = [sys.executable, "-m", "lightning_ft.launch.cli", "run", "--replicas", str(procs),
               "--nproc-per-replica", "1", "--run-dir", d, "--no-status", "--timeout", str(a.timeout), HERE, *args]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout + 60, env=_env())
        if p.returncode != 0:
            raise RuntimeError(f"ft_hsdp run failed ({p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
        return _step_s(open(os.path.join(d, "logs", "r0.i0.rank0.log")).read())


def run_ddp(a: argparse.Namespace, args: list[str]) -> float:
    p = subprocess.run([sys.executable, HERE, *args, "--ddp"], capture_output=True, text=True,
                       timeout=a.timeout + 60, env=_env())
    if p.returncode != 0:
        raise RuntimeError(f"DDP run failed ({p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    return _step_s(p.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--single", action="store_true", help="also 1 replica vs single-process Lightning")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=256, help="per process")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--no-overlap", action="store_true", help="ft_hsdp without quorum/backward overlap")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ddp", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker(a)

    def args_for(procs: int) -> list[str]:
        return ["--worker", "--procs", str(procs), "--steps", str(a.steps), "--warmup", str(a.warmup), "--width",
                str(a.width), "--depth", str(a.depth), "--batch", str(a.batch)] + (
                    ["--no-overlap"] if a.no_overlap else [])

    params = a.depth * (a.width * a.width + a.width) + a.width + 1
    for procs, peer, bench in [(a.procs, "ddp", "overhead")] + ([(1, "lightning", "overhead_single")] if a.single else []):
        ft, ref, ratios = [], [], []
        for r in range(a.rounds):
            got = {}
            for name in (("ft", peer) if r % 2 == 0 else (peer, "ft")):
                got[name] = run_ft(a, args_for(procs), procs) if name == "ft" else run_ddp(a, args_for(procs))
                print(json.dumps({"bench": f"{bench}_round", "round": r, "strategy": name,
                                  "step_s": round(got[name], 5)}), flush=True)
            ft.append(got["ft"])
            ref.append(got[peer])
            ratios.append(got["ft"] / got[peer])
        ft_s, ref_s = statistics.median(ft), statistics.median(ref)
        print(json.dumps({"bench": bench, "procs": procs, "params": params, "batch_per_proc": a.batch,
                          "steps": a.steps, "rounds": a.rounds, "ft_step_s": round(ft_s, 5),
                          f"{peer}_step_s": round(ref_s, 5), "ratio": round(statistics.median(ratios), 4),
                          "ratios": [round(x, 4) for x in ratios], "overhead_ms": round((ft_s - ref_s) * 1e3, 2),
                          "loadavg": os.getloadavg()[0]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
