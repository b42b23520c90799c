"""Steady-state step time and CPU of ft_hsdp against Lightning's own DDP (targets: ratio and
cpu_ratio <= 1.03).

    python -m lightning_ft.bench.overhead [--procs 2] [--steps 240] [--rounds 6] [--width 1024] [--single]

Same LightningModule, same data, same number of processes, one torch thread each
(OMP_NUM_THREADS=1 for both, since Lightning's launcher would otherwise change the thread
count): ft_hsdp runs P replicas x 1 process under `lightning-ft run` (embedded etcd,
quorum, FTAR, two-phase commit), DDP runs P processes through Lightning's launcher (gloo).
Rounds alternate which one runs first, so a noisy machine hits both; the figure is the
median of the per-round paired ratios (one noisy round cannot decide). Step time = median
gap between consecutive `on_train_batch_end` of rank 0 after `--warmup` steps.
`--single` also compares 1 replica of ft_hsdp with single-process Lightning.

The CPU account (bench/cpu_account.py): every thread of every process of each job (the
launcher, etcd and the workers for ft_hsdp; Lightning's launcher process and its ranks for
DDP) is sampled from /proc while it runs, and snapshotted when the job's rank 0 reaches the
end of step `--warmup` and of its last step (each writes a mark file the bench watches for):
the difference is the CPU of the steady-state steps between, per step, by process role and by
thread; start-up and teardown stay outside. CPU time
barely moves with the machine's load, so `cpu_ratio` (the whole job's CPU per step, ft_hsdp
/ DDP) is the figure noise cannot hide. Prints, per round and then the medians:

    {"bench": "overhead", "ft_step_s": ..., "ddp_step_s": ..., "ratio": ..., "ratios": [...],
     "cpu_ratio": ..., "cpu_ratios": [...], "cpu_ms": {"ft": {account}, "ddp": {account}}, ...}
    {"bench": "overhead_single", "ft_step_s": ..., "lightning_step_s": ..., "ratio": ..., ...}

`--accelerator cuda` runs both jobs on the GPU(s) (bench/gpu_run.py: 2 processes sharing one GPU).
DDP then all-reduces over NCCL when each process has a GPU of its own; when processes share a GPU
NCCL refuses ("Duplicate GPU detected"), so DDP uses gloo on its CUDA gradients, and its ranks are
started as one-device nodes (`--ddp-launch external`: LOCAL_RANK=0, NODE_RANK=rank; Lightning's
launcher would ask for one GPU per process). The line's "ddp" field says which, and why.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from itertools import pairwise
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy

HERE = os.path.abspath(__file__)
MARKS_ENV = "OVERHEAD_MARKS"
"""The directory where a worker's rank 0 marks the start and the end of the measured steps."""


def _mark(path: str) -> None:
    """Create `path` once (every replica's rank 0 marks; the first one wins)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        pass


def worker(a: argparse.Namespace) -> int:
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_ft  # noqa: F401
    import lightning.pytorch as L

    torch.set_num_threads(1)
    marks = os.environ.get(MARKS_ENV)

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
            if marks and self.global_rank == 0 and len(self.times) in (a.warmup, a.steps):
                _mark(os.path.join(marks, "end" if len(self.times) == a.steps else "start"))

        def on_train_end(self):
            if self.global_rank == 0:
                gaps = [b - t for t, b in pairwise(self.times)][a.warmup:]
                print(json.dumps({"step_s": statistics.median(gaps), "steps": len(self.times)}), flush=True)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(1)
    n = a.batch * a.procs * (a.steps + 4)
    data = TensorDataset(torch.randn(n, a.width, generator=g), torch.randn(n, 1, generator=g))
    strategy: str | Strategy = "ft_hsdp"
    devices: int | str = "auto"
    nodes = 1
    if a.no_overlap and not a.ddp:
        from lightning_ft.strategy.ft_hsdp import FTHSDPStrategy

        strategy = FTHSDPStrategy(overlap=False)
    if a.ddp:
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(process_group_backend=a.ddp_backend) if a.procs > 1 else "auto"
        # external: this process is one of `procs` one-device nodes (ddp_external started it)
        devices, nodes = (1, a.procs) if a.ddp_launch == "external" else (a.procs, 1)
    trainer = L.Trainer(strategy=strategy, accelerator=a.accelerator, devices=devices, num_nodes=nodes,
                        max_steps=a.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Model(), DataLoader(data, batch_size=a.batch, shuffle=True))
    return 0


def ddp_external(a: argparse.Namespace, argv: list[str]) -> int:
    """Start `procs` DDP ranks as one-device nodes of one process each (Lightning sees LOCAL_RANK and
    creates no process: NODE_RANK is the rank), and wait for them; a rank that fails ends the others."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = []
    for r in range(a.procs):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(r),
               "LOCAL_RANK": "0", "WORLD_SIZE": str(a.procs)}
        ranks.append(subprocess.Popen([sys.executable, HERE, *argv, "--ddp-rank", str(r)], env=env))
    rc = 0
    while any(p.poll() is None for p in ranks):
        failed = [p.returncode for p in ranks if p.returncode not in (None, 0)]
        if failed:
            rc = failed[0]
            for p in ranks:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    return rc or max(abs(p.returncode) for p in ranks)


def ddp_mode(a: argparse.Namespace) -> tuple[str, str, str]:
    """DDP's backend and launch for `--accelerator` and the GPUs here (the "auto" choices), and why."""
    backend, launch, why = a.ddp_backend, a.ddp_launch, ""
    if a.accelerator == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        shared = gpus < a.procs
        if shared:
            why = (f"{a.procs} processes share {gpus} GPU(s): NCCL refuses two ranks on one GPU "
                   "('Duplicate GPU detected'), so DDP all-reduces its CUDA gradients over gloo, its ranks "
                   "started as one-device nodes")
        backend = backend if backend != "auto" else ("gloo" if shared else "nccl")
        launch = launch if launch != "auto" else ("external" if shared else "lightning")
    else:
        backend = backend if backend != "auto" else "gloo"
        launch = launch if launch != "auto" else "lightning"
    return backend, launch, why


def _step_s(out: str) -> float:
    for line in reversed(out.splitlines()):
        if line.startswith('{"step_s"'):
            return json.loads(line)["step_s"]
    raise RuntimeError("worker printed no step time:\n" + out[-3000:])


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LFT_")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: list[str], timeout: float, what: str, steps: int) -> tuple[str, dict]:
    """Run a job, accounting the CPU of every thread of its process tree between its start and
    end marks; (stdout, CPU ms per measured step)."""
    from lightning_ft.bench.cpu_account import Account, per_step

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryDirectory(prefix="lft-marks-") as marks:
        env = _env()
        env[MARKS_ENV] = marks
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        acc = Account(proc.pid).start()
        snaps: dict[str, dict] = {}

        def watch() -> None:  # snapshot as soon as a mark appears
            for name in ("start", "end"):
                while not os.path.exists(os.path.join(marks, name)):
                    if proc.poll() is not None:
                        return
                    time.sleep(0.005)
                snaps[name] = acc.snapshot()

        watcher = threading.Thread(target=watch, name="overhead-marks", daemon=True)
        watcher.start()
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:  # the whole job: its launcher and what it started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = -9
        except KeyboardInterrupt:  # its own session: a ^C here does not reach it
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        watcher.join(5)
        acc.stop()
        out.seek(0)
        text = out.read()
    if rc != 0:
        raise RuntimeError(f"{what} run failed ({rc}):\n{text[-4000:]}")
    if set(snaps) != {"start", "end"}:
        raise RuntimeError(f"{what} run: its rank 0 marked {sorted(snaps)} of start and end:\n{text[-2000:]}")
    return text, per_step(snaps["start"], snaps["end"], steps)


def run_ft(a: argparse.Namespace, args: list[str], procs: int) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory(prefix="lft-overhead-") as d:
        cmd = [sys.executable, "-m", "lightning_ft.launch.cli", "run", "--replicas", str(procs),
               "--nproc-per-replica", "1", "--run-dir", d, "--no-status", "--timeout", str(a.timeout), HERE, *args,
               *a.set]
        _, acc = _run(cmd, a.timeout + 60, "ft_hsdp", a.steps - a.warmup)
        return _step_s(open(os.path.join(d, "logs", "r0.i0.rank0.log")).read()), acc


def run_ddp(a: argparse.Namespace, args: list[str]) -> tuple[float, dict]:
    out, acc = _run([sys.executable, HERE, *args, "--ddp"], a.timeout + 60, "DDP", a.steps - a.warmup)
    return _step_s(out), acc


def _spread(xs: list[float]) -> list[float]:
    return [round(min(xs), 4), round(max(xs), 4)]


def _median_account(accounts: list[dict]) -> dict:
    """The per-key median of several per-step accounts."""
    def med(dicts: list[dict]) -> dict:
        keys = sorted(set().union(*dicts))
        return {k: round(statistics.median(d.get(k, 0.0) for d in dicts), 2) for k in keys}

    return {"total": round(statistics.median(x["total"] for x in accounts), 2),
            "by_role": med([x["by_role"] for x in accounts]), "by_thread": med([x["by_thread"] for x in accounts])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--steps", type=int, default=240, help="steps of each run")
    p.add_argument("--warmup", type=int, default=10, help="steps before the measured ones (wall time and CPU)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--single", action="store_true", help="also 1 replica vs single-process Lightning")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=256, help="per process")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--no-overlap", action="store_true", help="ft_hsdp without quorum/backward overlap")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an ft_hsdp config override (repeatable), e.g. --set consistency.every_n_steps=0")
    p.add_argument("--only-ft", action="store_true", help="run ft_hsdp alone (its CPU account; no ratio)")
    p.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu", help="where both jobs train")
    p.add_argument("--ddp-backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="DDP's backend (auto: gloo on CPU and where processes share a GPU, else nccl)")
    p.add_argument("--ddp-launch", choices=("auto", "lightning", "external"), default="auto",
                   help="DDP's ranks: Lightning's launcher, or one-device nodes started here (auto: external "
                        "where processes share a GPU)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ddp", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ddp-rank", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        if a.ddp and a.ddp_launch == "external" and a.ddp_rank is None:
            return ddp_external(a, list(sys.argv[1:] if argv is None else argv))
        return worker(a)
    if a.steps < a.warmup + 2:
        p.error(f"--steps must be at least --warmup + 2 ({a.warmup + 2})")

    backend, launch, why = ddp_mode(a)

    def args_for(procs: int, steps: int) -> list[str]:
        return ["--worker", "--procs", str(procs), "--steps", str(steps), "--warmup", str(a.warmup), "--width",
                str(a.width), "--depth", str(a.depth), "--batch", str(a.batch), "--accelerator", a.accelerator,
                "--ddp-backend", backend, "--ddp-launch", launch] + (["--no-overlap"] if a.no_overlap else [])

    params = a.depth * (a.width * a.width + a.width) + a.width + 1
    cases = [(a.procs, "ddp", "overhead")] + ([(1, "lightning", "overhead_single")] if a.single else [])
    for procs, peer, bench in cases:
        step_s: dict[str, list[float]] = {"ft": [], peer: []}
        accounts: dict[str, list[dict]] = {"ft": [], peer: []}
        ratios, cpu_ratios = [], []
        for r in range(a.rounds):
            got = {}
            for name in ("ft",) if a.only_ft else (("ft", peer) if r % 2 == 0 else (peer, "ft")):
                if name == "ft":
                    wall, acc = run_ft(a, args_for(procs, a.steps), procs)
                else:
                    wall, acc = run_ddp(a, args_for(procs, a.steps))
                got[name] = (wall, acc)
                step_s[name].append(wall)
                accounts[name].append(acc)
                print(json.dumps({"bench": f"{bench}_round", "round": r, "strategy": name, "step_s": round(wall, 5),
                                  "cpu_ms": acc}), flush=True)
            if a.only_ft:
                continue
            ratios.append(got["ft"][0] / got[peer][0])
            if got[peer][1]["total"] > 0:  # a short run can account no CPU tick (10 ms) to the peer
                cpu_ratios.append(got["ft"][1]["total"] / got[peer][1]["total"])
        if a.only_ft:
            print(json.dumps({"bench": f"{bench}_ft", "procs": procs, "steps": a.steps, "warmup": a.warmup,
                              "set": a.set, "ft_step_s": round(statistics.median(step_s["ft"]), 5),
                              "cpu_ms": _median_account(accounts["ft"]), "loadavg": os.getloadavg()[0]}), flush=True)
            continue
        ft_s, ref_s = statistics.median(step_s["ft"]), statistics.median(step_s[peer])
        ddp = {"backend": backend, "launch": launch, "why": why} if peer == "ddp" else {}
        print(json.dumps({"bench": bench, "procs": procs, "accelerator": a.accelerator, "ddp": ddp,
                          "params": params, "batch_per_proc": a.batch,
                          "steps": a.steps, "warmup": a.warmup, "rounds": a.rounds,
                          "ft_step_s": round(ft_s, 5), f"{peer}_step_s": round(ref_s, 5),
                          "ratio": round(statistics.median(ratios), 4), "ratios": [round(x, 4) for x in ratios],
                          "ratio_spread": _spread(ratios), "overhead_ms": round((ft_s - ref_s) * 1e3, 2),
                          "cpu_ratio": round(statistics.median(cpu_ratios), 4) if cpu_ratios else None,
                          "cpu_ratios": [round(x, 4) for x in cpu_ratios],
                          "cpu_ratio_spread": _spread(cpu_ratios) if cpu_ratios else None,
                          "cpu_ms": {"ft": _median_account(accounts["ft"]), peer: _median_account(accounts[peer])},
                          "loadavg": os.getloadavg()[0]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
