"""Time to train N steps of work under failures: ft_hsdp beside restart-the-world and a
failure-free DDP run, same model, same global batch, same machine, one run
(`python -m lightning_ft.bench.goodput --end-to-end`; the form of the outside torchft
benchmark: 930 min against 818 for checkpoint-restart to 3,000 steps).

    python -m lightning_ft.bench.goodput --end-to-end [--replicas 3] [--steps 1500]
        [--kill-every 300] [--ckpt-every 100] [--rounds 1] [--width 1024] [--batch 64] ...

Three jobs of R processes, one rank (replica) each, the same LightningModule (an MLP of
`--depth` x `--width`, AdamW, `--batch` samples per process and step, one torch thread):
- ft: `lightning-ft run --replicas R` with strategy ft_hsdp; replica 1 is SIGKILLed (the
  failure injector, `failure.events`) at every kill step and restarted by the launcher
  (forked from its zygote, or a warm spare with `--standby 1`); it catches up from a peer.
  Its own asynchronous checkpoints every `--ckpt-every` steps, as a real job keeps them.
- restart: Lightning DDP (gloo) over R processes that this bench starts as torchrun would
  (LOCAL_RANK, WORLD_SIZE, ...), with ModelCheckpoint every `--ckpt-every` steps (save_last);
  rank 1 SIGKILLs itself at each kill step, the bench sees the death (polled every 0.1 s, as
  torchrun's monitor), kills every rank and relaunches the job from last.ckpt: the steps since
  that checkpoint are trained again.
- clean: the same DDP job without failures.
Kill steps: `every x k - offset` for k = 1, 2, ... below N, the offset half a checkpoint
interval by default (a failure at a random time loses half an interval on average; a kill
right after a checkpoint would cost restart-the-world no steps). In a job's k-th launch
(restart) or a replica's k-th incarnation (ft) the k-th kill fires once its step count
reaches the kill step, at the start of the next step.

Work is counted as ETT counts it (report.py): a step committed with c of R contributors is
c/R of a full step (ft_hsdp's survivors train without the failed replica's batch while it is
away, `batch_policy` shrink); a DDP step is a full step, and a step trained again after a
restart counts once. `time_to_n_s` runs from the start of the job's first step (its first
step's end minus one fault-free step: start-up before it is the same for all and not
measured) to the moment the work reaches N steps. The ft job runs until then (a stop file the
bench writes; the job agrees on the stop). Rounds alternate the order of the jobs, so a noisy
machine hits all alike. Prints one `goodput_e2e_job` line per job and round, then

    {"bench": "goodput_e2e", "ft_time_to_n_s": ..., "restart_time_to_n_s": ...,
     "clean_ddp_time_to_n_s": ..., "ft_over_clean": ..., "restart_over_clean": ..., ...}

with medians over the rounds, each job's failures, restarts, steps lost and down times, the
steady-state overhead (ft's fault-free step over the clean job's) and, with that overhead,
the job size below which restart-the-world wins at the FT-HSDP paper's failure rate
(`lightning-ft plan --preset paper --overhead X`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Optional, Sequence

HERE = os.path.abspath(__file__)
JOBS = ("ft", "restart", "clean")


# -- pure: the schedule and the measure ------------------------------------------------------------

def kill_steps(steps: int, every: int, offset: int) -> list[int]:
    """The steps at which replica 1 is killed: every x k - offset for k = 1, 2, ..., below `steps`."""
    if every <= 0:
        return []
    return [s for s in range(every - offset, steps, every) if s > 0]


@dataclass(frozen=True)
class TimeToN:
    time_to_n_s: Optional[float]
    """From the start of the first step to the commit that brought the work to N (None: never)."""
    step_s: Optional[float]
    """The fault-free step (median gap between consecutive steps of one incarnation, all
    contributing)."""
    work: float
    """Full steps of work committed in the whole job."""


def time_to_n(commits: Sequence[tuple[float, int, float]], n: float) -> TimeToN:
    """`commits`: (time, step, work of the step: contributors / R) of every commit that stands,
    one per step, in any order; the gaps of consecutive full steps give the fault-free step.
    The job starts one fault-free step before its first commit."""
    rows = sorted(commits, key=lambda c: c[1])
    gaps = [b[0] - a[0] for a, b in pairwise(rows) if b[1] == a[1] + 1 and a[2] >= 1 and b[2] >= 1 and b[0] > a[0]]
    step = statistics.median(gaps) if gaps else None
    if not rows:
        return TimeToN(None, step, 0.0)
    start = min(r[0] for r in rows) - (step or 0.0)
    work, at = 0.0, None
    for t, _, w in rows:
        work += w
        if at is None and work >= n - 1e-9:
            at = t
    return TimeToN(None if at is None else at - start, step, work)


def ddp_commits(rows: Sequence[dict]) -> list[tuple[float, int, float]]:
    """A DDP job's step log (rank 0: {t, step, launch}, every launch) to the commits that stand:
    a step trained again after a restart counts at its last time."""
    last: dict[int, float] = {}
    for r in rows:
        if r["step"] not in last or r["t"] > last[r["step"]]:
            last[r["step"]] = r["t"]
    return [(t, s, 1.0) for s, t in last.items()]


def ddp_step_s(rows: Sequence[dict]) -> Optional[float]:
    """Median gap between consecutive steps within one launch."""
    gaps = [b["t"] - a["t"] for a, b in pairwise(rows) if b["launch"] == a["launch"] and b["step"] == a["step"] + 1]
    return statistics.median(gaps) if gaps else None


def lost_steps(rows: Sequence[dict]) -> int:
    """Steps trained more than once (a restart redid them from its checkpoint)."""
    seen: dict[int, int] = {}
    for r in rows:
        seen[r["step"]] = seen.get(r["step"], 0) + 1
    return sum(c - 1 for c in seen.values())


# -- the worker: one rank of any of the three jobs ---------------------------------------------------

def worker(a: argparse.Namespace) -> int:
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset

    if a.strategy == "ft_hsdp":
        import lightning_ft  # noqa: F401  (registers the strategy)
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.set_num_threads(1)

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            w = a.width
            self.body = nn.Sequential(*[m for _ in range(a.depth) for m in (nn.Linear(w, w), nn.GELU())])
            self.out = nn.Linear(w, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.out(self.body(x)), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Steps(L.Callback):
        """DDP: rank 0 logs each step; rank `kill_rank` SIGKILLs itself at this launch's kill step."""

        def __init__(self) -> None:
            self._out = open(a.step_log, "a", buffering=1) if a.step_log else None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if a.kill_at and trainer.global_rank == a.kill_rank and trainer.global_step >= a.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self._out is not None and trainer.global_rank == 0:
                self._out.write(json.dumps({"t": time.time(), "step": trainer.global_step, "launch": a.launch}) + "\n")

    class StopFile(L.Callback):
        """ft: stop once the bench says the work is done (ft_hsdp agrees the stop across replicas)."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if a.stop_file and os.path.exists(a.stop_file):
                trainer.should_stop = True

    g = torch.Generator().manual_seed(1)
    n = a.batch * a.procs * a.data_batches
    data = TensorDataset(torch.randn(n, a.width, generator=g), torch.randn(n, 1, generator=g))
    callbacks: list = [Steps()] if a.strategy == "ddp" else [StopFile()]
    ckpt_path = None
    if a.strategy == "ddp" and a.ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=a.ckpt_dir, every_n_train_steps=a.ckpt_every, save_last=True,
                                         save_top_k=0))
        last = os.path.join(a.ckpt_dir, "last.ckpt")
        ckpt_path = last if os.path.exists(last) else None
    trainer = L.Trainer(strategy=a.strategy, accelerator="cpu", devices=a.procs if a.strategy == "ddp" else "auto",
                        max_steps=a.steps, logger=False, enable_checkpointing=bool(a.ckpt_dir),
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                        num_sanity_val_steps=0)
    trainer.fit(Model(), DataLoader(data, batch_size=a.batch, shuffle=True), ckpt_path=ckpt_path)
    return 0


def _worker_args(a: argparse.Namespace, strategy: str, steps: int) -> list[str]:
    return [HERE, "--worker", "--strategy", strategy, "--procs", str(a.replicas), "--steps", str(steps),
            "--width", str(a.width), "--depth", str(a.depth), "--batch", str(a.batch),
            "--data-batches", str(a.data_batches), "--ckpt-every", str(a.ckpt_every)]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LFT_", "TORCHELASTIC_"))}
    env["OMP_NUM_THREADS"] = "1"
    return env


# -- the jobs ------------------------------------------------------------------------------------------

def _launch_ddp(a: argparse.Namespace, d: str, steps: int, launch: int, kill_at: int, ckpt: bool) -> list:
    from lightning_ft.coord.etcd_server import free_port

    port = free_port()
    args = _worker_args(a, "ddp", steps) + ["--step-log", os.path.join(d, "steps.jsonl"), "--launch", str(launch),
                                            "--kill-at", str(kill_at)]
    if ckpt:
        args += ["--ckpt-dir", os.path.join(d, "ckpt")]
    procs = []
    for rank in range(a.replicas):
        env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(a.replicas),
               "NODE_RANK": "0", "LOCAL_RANK": str(rank)}
        log = open(os.path.join(d, f"launch{launch}.rank{rank}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
        log.close()
    return procs


def _watch(procs: list, deadline: float, what: str) -> list[Optional[int]]:
    """Wait until a rank fails (then at once: torchrun's monitor polls every 0.1 s) or every
    rank has exited 0; the exit codes (None: still running)."""
    while True:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
            return codes
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: still running at its timeout")
        time.sleep(0.1)


def _kill(procs: list) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait(10)


def run_ddp(a: argparse.Namespace, d: str, failures: bool) -> dict:
    """The clean DDP job, or (`failures`) restart-the-world: relaunch from last.ckpt after each kill."""
    os.makedirs(d, exist_ok=True)
    kills = kill_steps(a.steps, a.kill_every, a.kill_offset) if failures else []
    deadline = time.monotonic() + a.timeout
    launch, deaths, relaunch = 0, [], []
    while True:
        kill_at = kills[launch] if launch < len(kills) else 0
        procs = _launch_ddp(a, d, a.steps, launch, kill_at, ckpt=failures)
        try:
            codes = _watch(procs, deadline, f"DDP job ({'restart' if failures else 'clean'}); logs in {d}")
            t_dead = time.time()
        finally:
            _kill(procs)
        if all(c == 0 for c in codes):
            break
        if not failures or launch >= len(kills):
            raise RuntimeError(f"DDP launch {launch} failed with exit codes {codes}; logs in {d}")
        deaths.append(t_dead)
        launch += 1
    rows = [json.loads(line) for line in open(os.path.join(d, "steps.jsonl"))]
    rows.sort(key=lambda r: r["t"])
    for k, t in enumerate(deaths):  # the death to the next launch's first step
        nxt = [r["t"] for r in rows if r["launch"] == k + 1]
        if nxt:
            relaunch.append(nxt[0] - t)
    tn = time_to_n(ddp_commits(rows), a.steps)
    return {"time_to_n_s": tn.time_to_n_s, "step_s": ddp_step_s(rows), "work": tn.work,
            "steps": max(r["step"] for r in rows), "failures": len(deaths), "restarts": len(deaths),
            "lost_steps": lost_steps(rows), "kill_steps": kills,
            "down_s": [round(x, 2) for x in relaunch]}


class _FtWork:
    """Tails the ft job's steps.jsonl files: the work committed so far (contributors / R per step)."""

    def __init__(self, run_dir: str, replicas: int) -> None:
        self.run_dir, self.R = run_dir, replicas
        self._pos: dict[int, int] = {}
        self.work_of: dict[int, float] = {}

    def work(self) -> float:
        for rid in range(self.R):
            path = os.path.join(self.run_dir, f"replica_{rid}", "steps.jsonl")
            if not os.path.exists(path):
                continue
            with open(path) as f:
                f.seek(self._pos.get(rid, 0))
                chunk = f.read()
                end = chunk.rfind("\n") + 1
                self._pos[rid] = self._pos.get(rid, 0) + len(chunk[:end].encode())
            for line in chunk[:end].splitlines():
                r = json.loads(line)
                if r.get("role", "train") == "train":
                    self.work_of[r["step"]] = len(r.get("contributors") or range(self.R)) / self.R
        return sum(self.work_of.values())


def run_ft(a: argparse.Namespace, d: str) -> dict:
    from lightning_ft import report

    kills = kill_steps(a.steps, a.kill_every, a.kill_offset)
    events = ", ".join(f"{{replica: 1, step: {s}, kind: kill}}" for s in kills)
    stop = os.path.join(d, "STOP")
    cap = int(a.steps * 1.5) + 50  # the stop file ends it at N steps of work
    cmd = [sys.executable, "-m", "lightning_ft.launch.cli", "run", "--replicas", str(a.replicas),
           "--nproc-per-replica", "1", "--run-dir", d, "--no-status", "--max-restarts", "50",
           "--timeout", str(a.timeout), *(["--standby", str(a.standby)] if a.standby else []),
           *_worker_args(a, "ft_hsdp", cap), "--stop-file", stop,
           f"failure.events=[{events}]", f"checkpoint.every_n_steps={a.ckpt_every}", "checkpoint.keep=2",
           "job=goodput-e2e", *a.set]
    os.makedirs(d, exist_ok=True)
    tail = _FtWork(d, a.replicas)
    with open(os.path.join(d, "launcher.log"), "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
        try:
            deadline = time.monotonic() + a.timeout + 60
            while p.poll() is None:
                if not os.path.exists(stop) and tail.work() >= a.steps:
                    open(stop, "w").close()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ft job still running after {a.timeout} s; logs in {d}")
                time.sleep(0.2)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)
    if p.returncode != 0:
        raise RuntimeError(f"ft job failed ({p.returncode}); see {d}/launcher.log and {d}/logs")
    data = report.load(d)
    s = report.summarize(data)
    last: dict[int, tuple[float, float]] = {}  # step -> (its first commit, work): the commit that stands
    for rows in data.steps.values():
        for r in rows:
            if r.get("role", "train") != "train":
                continue
            w = len(r.get("contributors") or range(a.replicas)) / a.replicas
            if r["step"] not in last or r["t"] < last[r["step"]][0]:
                last[r["step"]] = (r["t"], w)
    tn = time_to_n([(t, step, w) for step, (t, w) in last.items()], a.steps)
    return {"time_to_n_s": tn.time_to_n_s, "step_s": s["fault_free_step_s"], "work": tn.work, "steps": s["steps"],
            "failures": len(s["failures"]), "restarts": s["restarts"],
            "standby_restarts": s["standby_restarts"], "lost_steps": sum(r["lost_steps"] for r in s["rewinds"]),
            "kill_steps": kills, "identical": s["identical"], "ett": s["ett"],
            "straggler_events": len(s["stragglers"]),
            "steps_short": sum(1 for _, w in last.values() if w < 1),
            "down_s": [f["down_s"] for f in s["failures"]],
            "healthy_stall_s": [f["healthy_stall_s"] for f in s["failures"]]}


# -- main ----------------------------------------------------------------------------------------------

def _median(xs: list) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _rnd(x: Optional[float], n: int = 3) -> Optional[float]:
    return None if x is None else round(x, n)


def run_round(a: argparse.Namespace, base: str, r: int) -> dict[str, dict]:
    order = JOBS if r % 2 == 0 else tuple(reversed(JOBS))
    out = {}
    for job in order:
        d = os.path.join(base, f"round{r}", job)
        t0 = time.monotonic()
        res = run_ft(a, d) if job == "ft" else run_ddp(a, d, failures=job == "restart")
        res["bench_wall_s"] = round(time.monotonic() - t0, 1)
        out[job] = res
        print(json.dumps({"bench": "goodput_e2e_job", "round": r, "job": job,
                          **{k: _rnd(v, 4) if isinstance(v, float) else v for k, v in res.items()},
                          "loadavg": os.getloadavg()[0]}), flush=True)
    clean_step = out["clean"]["step_s"]
    if clean_step:  # `lightning-ft plan --from-run` measures the overhead against it
        with open(os.path.join(base, f"round{r}", "ft", "baseline.json"), "w") as f:
            json.dump({"step_s": clean_step, "what": "the clean DDP job's step (bench.goodput --end-to-end)"}, f)
    return out


def summary(a: argparse.Namespace, rounds: list[dict[str, dict]]) -> dict:
    from lightning_ft.sim.goodput import PAPER, crossover

    tn = {job: _median([r[job]["time_to_n_s"] for r in rounds]) for job in JOBS}
    step = {job: _median([r[job]["step_s"] for r in rounds]) for job in JOBS}
    ratio = (lambda x, y: None if x is None or not y else round(x / y, 4))  # noqa: E731
    overhead = ratio(step["ft"], step["clean"])
    x = None if overhead is None else overhead - 1
    cross = crossover(replace(PAPER, overhead=max(0.0, x))) if x is not None else None
    ft = [r["ft"] for r in rounds]
    rs = [r["restart"] for r in rounds]
    return {"bench": "goodput_e2e", "replicas": a.replicas, "steps": a.steps, "kill_every": a.kill_every,
            "kill_steps": kill_steps(a.steps, a.kill_every, a.kill_offset), "ckpt_every": a.ckpt_every,
            "standby": a.standby, "rounds": a.rounds,
            "ft_time_to_n_s": _rnd(tn["ft"], 2), "restart_time_to_n_s": _rnd(tn["restart"], 2),
            "clean_ddp_time_to_n_s": _rnd(tn["clean"], 2),
            "ft_over_clean": ratio(tn["ft"], tn["clean"]), "restart_over_clean": ratio(tn["restart"], tn["clean"]),
            "ft_over_restart": ratio(tn["ft"], tn["restart"]),
            "per_round": {job: [_rnd(r[job]["time_to_n_s"], 2) for r in rounds] for job in JOBS},
            "step_s": {job: _rnd(step[job], 4) for job in JOBS},
            "ft_step_over_clean": overhead,
            "ft_failures": [f["failures"] for f in ft], "ft_down_s": [f["down_s"] for f in ft],
            "ft_healthy_stall_s": [f["healthy_stall_s"] for f in ft], "ft_identical": [f["identical"] for f in ft],
            "restart_failures": [f["failures"] for f in rs], "restart_lost_steps": [f["lost_steps"] for f in rs],
            "restart_down_s": [f["down_s"] for f in rs],
            "paper_crossover_gpus": cross.gpus if cross else None,
            "loadavg": os.getloadavg()[0]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=3, help="replicas (ft) = DDP processes; one process each")
    p.add_argument("--steps", type=int, default=1500, help="N: the steps of work to train")
    p.add_argument("--kill-every", type=int, default=300, help="kill replica (rank) 1 every this many steps")
    p.add_argument("--kill-offset", type=int, default=None,
                   help="kills at every x k - offset (default: half a checkpoint interval)")
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--standby", type=int, default=0, help="ft: warm spare replicas (lightning-ft run --standby)")
    p.add_argument("--rounds", type=int, default=1, help="each job this many times, alternating the order")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=64, help="per process and step")
    p.add_argument("--data-batches", type=int, default=64, help="dataset size in batches per process (epochs wrap)")
    p.add_argument("--timeout", type=float, default=3600, help="per job")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an ft_hsdp config override")
    p.add_argument("--keep", action="store_true", help="keep the run directories (printed)")


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        w = argparse.ArgumentParser()
        for name, typ, default in (("--strategy", str, "ddp"), ("--procs", int, 1), ("--steps", int, 10),
                                   ("--width", int, 64), ("--depth", int, 2), ("--batch", int, 8),
                                   ("--data-batches", int, 64), ("--ckpt-every", int, 100), ("--ckpt-dir", str, ""),
                                   ("--step-log", str, ""), ("--launch", int, 0), ("--kill-at", int, 0),
                                   ("--kill-rank", int, 1), ("--stop-file", str, "")):
            w.add_argument(name, type=typ, default=default)
        w.add_argument("--worker", action="store_true")
        return worker(w.parse_args(argv))
    p = argparse.ArgumentParser(prog="python -m lightning_ft.bench.goodput --end-to-end",
                                description=__doc__.split("\n")[0])
    p.add_argument("--end-to-end", action="store_true")
    add_arguments(p)
    a = p.parse_args(argv)
    if a.kill_offset is None:
        a.kill_offset = a.ckpt_every // 2
    if a.replicas < 2:
        p.error("--replicas must be at least 2 (replica 1 is the one killed)")
    base = tempfile.mkdtemp(prefix="lft-goodput-e2e-")
    try:
        rounds = [run_round(a, base, r) for r in range(a.rounds)]
        print(json.dumps(summary(a, rounds)), flush=True)
    finally:
        if a.keep:
            print(f"run directories kept under {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
