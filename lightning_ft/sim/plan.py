"""`lightning-ft plan`: the goodput planner (docs/GUIDE.md, "Planning a job: `lightning-ft plan`";
the model is sim/goodput.py).

    lightning-ft plan [--preset paper] [--from-run RUN_DIR] [--gpus N] [--replicas R]
                      [--mtbf 18m | --mtbf-gpu 3y] [--detect S] [--restart S] [--catchup S]
                      [--step S] [--ckpt-every N] [--ckpt-cost S] [--stall S] [...]
                      [--overhead X | --baseline-step S] [--json] [--png PATH | --no-png]

Each input comes from, in order: a flag, the run directory (`--from-run`: measured by
`measure_run` from what `lightning-ft run` left there), the preset, the defaults. The
output names the source of every input, the ETT of ft_hsdp and of restart-the-world, what
one failure costs in each, a replica count, and the job size below which restart-the-world
wins (goodput.crossover: ft_hsdp's steady-state overhead X, `--overhead`, against its cheaper
failures; `--from-run` measures X as the run's fault-free step over a baseline step, the same
job's under DDP: `--baseline-step`, or the run directory's baseline.json, which
bench.goodput --end-to-end writes); plan.png plots ETT against job size for
both modes (per-GPU failure rate held) and ft_hsdp's ETT against the replica count. The
picture goes to `--png`, else into the run directory (`--from-run RUN_DIR/plan.png`), else to
`runs/plan/plan.png` (`runs/` is ignored by git): never into the working directory itself.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from dataclasses import asdict, fields
from itertools import pairwise
from typing import Any, Optional

from lightning_ft.sim.goodput import (PAPER, Inputs, Memory, at_scale, candidate_counts, crossover, goodput,
                                      recommend, with_replicas)

# Inputs nobody gave: a failure rate per GPU from the paper, the launcher's own detection
# (lease TTL), the paper's restart, and guesses for the rest; every one is labelled so.
DEFAULTS: dict[str, tuple[Any, str]] = {
    "mtbf_gpu_s": (PAPER.mtbf_job_s * PAPER.gpus, "paper: a failure every 18 min at 98304 GPUs"),
    "detect_s": (3.0, "default: etcd.lease_ttl_s (a crash is evicted at once)"),
    "restart_s": (PAPER.restart_s, "paper: 9 min to restart and initialize"),
    "catchup_s": (30.0, "default (guess)"),
    "step_s": (10.0, "default (guess)"),
    "ckpt_every": (100, "default: checkpoint.every_n_steps"),
    "ckpt_cost_s": (0.0, "default: asynchronous checkpoints"),
    "overhead": (0.0, "default: none (give --overhead X, or --baseline-step S with --from-run)"),
}

BASELINE_FILE = "baseline.json"
"""In a run directory: {"step_s": S, "what": ...}, the same job's fault-free step without
ft_hsdp (bench.goodput --end-to-end writes the clean DDP run's), for `--from-run`'s overhead."""

_UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "y": 365 * 86400}


def duration(text: str) -> float:
    """'90', '90s', '18m', '1.5h', '2d', '3y' -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in ("", *_UNITS):
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: use seconds or a unit s, m, h, d, y "
                                         "(e.g. 18m, 3y)")
    return float(m.group(1)) * _UNITS.get(m.group(2) or "s", 1)


def human(seconds: float) -> str:
    """1080 -> '18 min', 1.06e8 -> '3.37 y'."""
    for unit, n in (("y", 365 * 86400), ("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * n:
            return f"{seconds / n:.3g} {unit}"
    return f"{seconds:.3g} s"


def count(text: str) -> float:
    """'70e9', '70B', '405b', '8M' -> a number."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([kmbt]?)\s*", str(text).lower())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 70e9 or 70B)")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2)]


# -- measured inputs from a run directory ---------------------------------------------------------

def _primary_failures(events: list[dict]) -> list[dict]:
    """One record per failed (replica, incarnation): when it failed and when it was evicted.
    A world restart's evictions of the healthy replicas are consequences, not failures."""
    out: dict[tuple[Optional[int], Optional[int]], dict] = {}
    for e in events:
        key = (e.get("replica"), e.get("incarnation"))
        if e["event"] in ("exit", "hang") and (e["event"] == "hang" or e.get("code") not in (0, None)):
            out.setdefault(key, {"replica": key[0], "incarnation": key[1], "t": e["t"], "evict_t": None})
        elif e["event"] == "evict" and not str(e.get("reason", "")).startswith("world restart after"):
            f = out.setdefault(key, {"replica": key[0], "incarnation": key[1], "t": e["t"], "evict_t": None})
            f["evict_t"] = e["t"] if f["evict_t"] is None else f["evict_t"]
    return sorted(out.values(), key=lambda f: f["t"])


def checkpoint_costs(rows: list[dict]) -> dict[str, Optional[float]]:
    """From the checkpoint writer's steps.jsonl rows: median step with and without a checkpoint,
    and the median in-memory staging (what a checkpoint step waits for)."""
    ck = [r["call_s"] for r in rows if "ckpt_stage_ms" in r]
    plain = [r["call_s"] for r in rows if "ckpt_stage_ms" not in r and not r["caught_up"]]
    stage = [r["ckpt_stage_ms"] for r in rows if "ckpt_stage_ms" in r]
    med = (lambda xs: statistics.median(xs) if xs else None)  # noqa: E731
    return {"ckpt_steps": len(ck), "ckpt_step_call_s": med(ck), "step_call_s": med(plain), "ckpt_stage_ms": med(stage)}


def overhead_of(ft_step_s: Optional[float], baseline_step_s: Optional[float]) -> Optional[float]:
    """ft_hsdp's steady-state overhead X: its fault-free step over the baseline (the same job's
    step without ft_hsdp), minus 1; None when either is unknown."""
    if not ft_step_s or not baseline_step_s or baseline_step_s <= 0:
        return None
    return ft_step_s / baseline_step_s - 1.0


def read_baseline(run_dir: str) -> Optional[float]:
    """The baseline step time recorded in RUN_DIR/baseline.json, if any."""
    path = os.path.join(run_dir, BASELINE_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        step = json.load(f).get("step_s")
    return float(step) if step else None


def measure_run(run_dir: str, baseline_step_s: Optional[float] = None) -> dict[str, Any]:
    """The planner's inputs measured in a run directory of `lightning-ft run` (ft_hsdp, or
    `--restart world`): every failure's detection, restart and catch-up, the healthy
    replicas' stall, the failure interval, step time and checkpoint cost, and (given a
    baseline step, or the run's baseline.json) the steady-state overhead of an ft_hsdp run's
    fault-free steps. Keys are Inputs fields (plus `mode`, `failures`, `baseline_step_s`);
    what the run cannot tell is left out."""
    from lightning_ft import report

    data = report.load(run_dir)
    s = report.summarize(data)
    R, step = s["replicas"], s["fault_free_step_s"]
    out: dict[str, Any] = {"replicas": R, "gpus": R}
    cfg_path = os.path.join(run_dir, "config.yaml")
    if os.path.exists(cfg_path):
        from lightning_ft.config import load_config

        cfg = load_config(cfg_path)
        out["gpus"] = R * int(cfg.nproc_per_replica)
        out["ckpt_every"] = int(cfg.checkpoint.every_n_steps)
    if step:
        out["step_s"] = step
    world = any(e["event"] == "world_restart" for e in data.events)
    out["mode"] = "restart" if world else "ft"
    base = baseline_step_s or read_baseline(run_dir)
    x = None if world else overhead_of(step, base)
    if x is not None:
        out["overhead"], out["baseline_step_s"] = x, base
    fails = _primary_failures(data.events)
    out["failures"] = len(fails)
    if fails and s["train_wall_s"]:
        out["mtbf_job_s"] = s["train_wall_s"] / len(fails)
    detect = [f["evict_t"] - f["t"] for f in fails if f["evict_t"] is not None]
    if detect:
        out["detect_s"] = statistics.fmean(detect)
    d = out.get("detect_s", 0.0)
    rows = sorted((r for rr in data.steps.values() for r in rr), key=lambda r: r["t"])
    started = {(e["replica"], e["incarnation"]): e["t"] for e in data.events if e["event"] in ("start", "restart")}
    restart, catchup, rollback = [], [], []
    for f in fails:
        if world:  # the job is back when a fresh incarnation commits; it redid the steps since the checkpoint
            before = [r["step"] for r in rows if r["t"] <= f["t"]]
            after = [r for r in rows if r["t"] > f["t"] and started.get((r["rid"], r["inc"]), 0) > f["t"]]
            if before and after and step:
                restart.append(after[0]["t"] - f["t"] - d - step)
                rollback.append(max(before) - (after[0]["step"] - 1))
        else:
            back = [r for r in data.steps.get(f["replica"], []) if r["inc"] > f["incarnation"] and r["t"] > f["t"]]
            if back:
                c = back[0]["call_s"] if back[0]["caught_up"] else 0.0
                catchup.append(c)
                restart.append(back[0]["t"] - f["t"] - d - c)
    if restart:
        out["world_restart_s" if world else "restart_s"] = max(0.0, statistics.fmean(restart))
    if catchup:
        out["catchup_s"] = statistics.fmean(catchup)
    if rollback:
        out["rollback_steps"] = statistics.fmean(rollback)
    stalls = [f["healthy_stall_s"] for f in s["failures"]
              if (f["replica"], f["incarnation"]) in {(x["replica"], x["incarnation"]) for x in fails}]
    if stalls and not world:
        out["stall_s"] = statistics.fmean(stalls)
    if not world:  # the survivors' step time while someone is away (both steps of a gap degraded)
        ctb = {}
        for r in rows:
            ctb[r["step"]] = len(r.get("contributors") or range(R))
        commits = report.commit_times(data)
        gaps = [b[0] - a[0] for a, b in pairwise(commits)
                if b[1] == a[1] + 1 and ctb.get(a[1], R) < R and ctb.get(b[1], R) < R]
        if gaps:
            out["degraded_step_s"] = statistics.fmean(gaps)
    writer = data.steps.get(min(data.steps), [])
    ck = checkpoint_costs(writer)
    if ck["ckpt_step_call_s"] is not None and ck["step_call_s"] is not None:
        out["ckpt_cost_s"] = max(0.0, ck["ckpt_step_call_s"] - ck["step_call_s"])
    return out


# -- inputs, in order of precedence ----------------------------------------------------------------

_FLAGS = {  # argparse dest -> Inputs field
    "gpus": "gpus", "replicas": "replicas", "mtbf": "mtbf_job_s", "detect": "detect_s", "restart": "restart_s",
    "world_restart": "world_restart_s", "catchup": "catchup_s", "step": "step_s", "ckpt_every": "ckpt_every",
    "ckpt_cost": "ckpt_cost_s", "stall": "stall_s", "rollback_steps": "rollback_steps",
    "degraded_step": "degraded_step_s", "overhead": "overhead",
}


def build_inputs(a: argparse.Namespace) -> tuple[Inputs, dict[str, str]]:
    """Flags over the run directory over the preset over the defaults. A failure rate that
    comes with a job size (preset, run) is kept per GPU, so `--gpus` rescales it; `--mtbf`
    is the job's own. Raises ValueError when nothing gives the GPUs or the replicas."""
    names = {f.name for f in fields(Inputs)} | {"mtbf_gpu_s"}
    vals: dict[str, Any] = {}
    src: dict[str, str] = {}

    def take(d: dict, label: str) -> None:
        if d.get("mtbf_job_s") is not None and d.get("gpus"):
            d = {**d, "mtbf_gpu_s": d["mtbf_job_s"] * d["gpus"]}
        for k, v in d.items():
            if v is not None and k in names and k != "mtbf_job_s":
                vals[k], src[k] = v, label

    for k, (v, label) in DEFAULTS.items():
        take({k: v}, label)
    if a.preset == "paper":
        take(asdict(PAPER), "preset paper")
    if a.from_run:
        m = measure_run(a.from_run, a.baseline_step)
        take(m, f"run {a.from_run}")
        if "overhead" in m:
            src["overhead"] = (f"run {a.from_run}: fault-free step {m['step_s']:.4g} s / baseline "
                               f"{m['baseline_step_s']:.4g} s - 1")
    elif a.baseline_step is not None:
        raise ValueError("--baseline-step needs --from-run RUN_DIR (the run whose fault-free steps it measures)")
    if a.mtbf is not None and a.mtbf_gpu is not None:
        raise ValueError("give --mtbf (the job's) or --mtbf-gpu (one GPU's), not both")
    take({"mtbf_gpu_s": a.mtbf_gpu, **{field: getattr(a, dest) for dest, field in _FLAGS.items()
                                       if field != "mtbf_job_s"}}, "flag")
    missing = [k for k in ("gpus", "replicas") if k not in vals]
    if missing:
        raise ValueError(f"no {' or '.join('--' + k for k in missing)}: give them, or --preset paper, "
                         "or --from-run RUN_DIR")
    per_gpu, gpu_src = vals.pop("mtbf_gpu_s"), src.pop("mtbf_gpu_s")
    if a.mtbf is not None:
        vals["mtbf_job_s"], src["mtbf_job_s"] = a.mtbf, "flag"
    else:
        vals["mtbf_job_s"] = per_gpu / vals["gpus"]
        src["mtbf_job_s"] = f"{gpu_src} (one GPU fails every {human(per_gpu)}; / {vals['gpus']} GPUs)"
    inp = Inputs(**vals)
    return inp, {f.name: src.get(f.name, _DERIVED.get(f.name, "model default")) for f in fields(Inputs)}


_DERIVED = {"stall_s": "model: detect_s + step_s", "rollback_steps": "model: ckpt_every / 2",
            "world_restart_s": "model: restart_s", "degraded_step_s": "model: step_s"}


def predict_run(run_dir: str) -> tuple[str, Inputs, float]:
    """The model's ETT for a run from that run's own measured inputs: (mode, inputs, ETT).
    This is the planner's validation against a measured run (bench.goodput prints it)."""
    m = measure_run(run_dir)
    if not m.get("failures"):
        raise ValueError(f"{run_dir} has no failures: nothing to model")
    names = {f.name for f in fields(Inputs)} - {"overhead"}  # ETT against the run's own fault-free rate
    inp = Inputs(**{"detect_s": 0.0, "restart_s": 0.0, "catchup_s": 0.0, "step_s": 0.0,
                    **{k: v for k, v in m.items() if k in names}})
    g = goodput(inp)
    return m["mode"], inp, g.restart_ett if m["mode"] == "restart" else g.ft_ett


# -- output ------------------------------------------------------------------------------------------

def plot(inp: Inputs, rec_replicas: Optional[int], memory: Optional[Memory], path: str,
         max_replicas: int = 64) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    lo, hi = max(inp.replicas, inp.gpus // 256, 2), inp.gpus * 16
    xs = sorted({int(x) for x in np.geomspace(lo, hi, 80)})
    at = [goodput(at_scale(inp, x)) for x in xs]
    ax1.plot(xs, [g.ft_ett for g in at], color="#2ca02c", label=f"ft_hsdp, {inp.replicas} replicas")
    if rec_replicas and rec_replicas != inp.replicas:
        ax1.plot(xs, [goodput(at_scale(with_replicas(inp, rec_replicas), x)).ft_ett for x in xs], color="#2ca02c",
                 ls="--", label=f"ft_hsdp, {rec_replicas} replicas (recommended)")
    ax1.plot(xs, [g.restart_ett for g in at], color="#d62728", label="restart-the-world")
    here = goodput(inp)
    ax1.plot([inp.gpus] * 2, [here.ft_ett, here.restart_ett], "ko", ms=4)
    ax1.axvline(inp.gpus, color="#888", lw=0.8, ls=":")
    cross = crossover(inp).gpus
    if cross and lo < cross < hi:
        ax1.axvline(cross, color="#d62728", lw=0.8, ls="--", label=f"restart-the-world wins below {cross} GPUs")
    ax1.set_xscale("log")
    ax1.set_ylim(0, 1.02)
    ax1.set_xlabel("GPUs (per-GPU MTBF held: the job's MTBF scales as 1/GPUs)")
    ax1.set_ylabel("effective training time")
    ax1.set_title(f"ETT against scale (MTBF {human(inp.mtbf_job_s)} at {inp.gpus} GPUs)")
    ax1.legend(fontsize=8, loc="lower left")
    rs = candidate_counts(inp.gpus, max_replicas=256) or [inp.replicas]
    ax2.plot(rs, [goodput(with_replicas(inp, r)).ft_ett for r in rs], "o-", color="#2ca02c", ms=3, label="ft_hsdp")
    ax2.axhline(here.restart_ett, color="#d62728", label="restart-the-world")
    if memory:
        bad = [r for r in rs if not memory.fits(inp.gpus, r)]
        if bad:
            ax2.axvspan(min(bad), max(rs), color="#ddd", label="state does not fit in GPU memory")
    if max(rs) > max_replicas:
        ax2.axvspan(max_replicas, max(rs), color="#eee", zorder=0, label=f"beyond --max-replicas {max_replicas}")
    if rec_replicas:
        ax2.axvline(rec_replicas, color="k", lw=0.8, ls="--", label=f"recommended: {rec_replicas}")
    ax2.set_xscale("log", base=2)
    ax2.set_ylim(0, 1.02)
    ax2.set_xlabel(f"replicas (of {inp.gpus} GPUs)")
    ax2.set_title("ETT against the replica count")
    ax2.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def text(inp: Inputs, src: dict[str, str], result: dict) -> str:
    g = goodput(inp)
    world_restart_s = inp.restart_s if inp.world_restart_s is None else inp.world_restart_s
    lines = [f"lightning-ft plan: {inp.gpus} GPUs as {inp.replicas} replicas x {inp.ranks_per_replica:g}, "
             f"a failure every {human(inp.mtbf_job_s)}", "", f"  {'input':<18} {'value':>12}  source"]
    for f in fields(Inputs):
        v = getattr(inp, f.name)
        lines.append(f"  {f.name:<18} {'-' if v is None else _fmt(v):>12}  {src[f.name]}")
    lines += ["", "effective training time (work done / fault-free work rate):",
              f"  restart-the-world  {g.restart_ett:.3f}  a failure costs {g.restart_lost_s:.4g} s: detection "
              f"{inp.detect_s:.4g} + restart {world_restart_s:.4g}"
              f" + {inp.rollback:.4g} steps redone x {inp.step_s:.4g} s",
              f"  ft_hsdp            {g.ft_ett:.3f}  a failure costs {g.ft_lost_s:.4g} s: a {g.ft_stall_s:.4g} s full "
              f"stall, then {g.ft_degraded_s:.4g} s at {inp.replicas - 1}/{inp.replicas} replicas"
              + (f" stepping in {inp.degraded_step_s:.4g} s" if inp.degraded_step_s else "")]
    if g.ckpt_factor < 1:
        lines.append(f"  (both x {g.ckpt_factor:.4f} for checkpoint cost)")
    if inp.overhead:
        lines.append(f"  (ft_hsdp x {g.overhead_factor:.4f} for its steady-state overhead {inp.overhead:.4g})")
    lines += ["", f"crossover: {result['crossover']}", f"recommended: {result['recommendation']}"]
    return "\n".join(lines)


DEFAULT_PNG = os.path.join("runs", "plan", "plan.png")
"""The plot's path without `--png` or `--from-run`: under `runs/`, which git ignores."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=["paper"], help="the FT-HSDP paper's inputs (98304 GPUs, 12 replicas, ...)")
    p.add_argument("--from-run", metavar="RUN_DIR", help="measured inputs from a `lightning-ft run` directory")
    p.add_argument("--gpus", type=int)
    p.add_argument("--replicas", type=int)
    p.add_argument("--mtbf", type=duration, help="mean time between failures of the job (e.g. 18m)")
    p.add_argument("--mtbf-gpu", type=duration, help="... or of one GPU (e.g. 3y); the job's is this / GPUs")
    p.add_argument("--detect", type=duration, help="failure to detection")
    p.add_argument("--restart", type=duration, help="detection to a restarted replica being ready")
    p.add_argument("--world-restart", type=duration, help="restart of the whole job (default: --restart)")
    p.add_argument("--catchup", type=duration, help="a restarted replica's catch-up from a peer")
    p.add_argument("--stall", type=duration, help="ft_hsdp full stall per failure (default: detection + a step)")
    p.add_argument("--step", type=duration, help="fault-free step time")
    p.add_argument("--ckpt-every", type=int, help="steps between checkpoints (0: leave checkpoints out)")
    p.add_argument("--ckpt-cost", type=duration, help="training time one checkpoint costs")
    p.add_argument("--degraded-step", type=duration, help="ft_hsdp step time while a replica is away "
                                                           "(default: --step)")
    p.add_argument("--overhead", type=float, help="ft_hsdp's steady-state overhead X: its fault-free step is "
                                                  "(1 + X) x the same job's DDP step (e.g. 0.066)")
    p.add_argument("--baseline-step", type=duration, help="with --from-run: the same job's step without ft_hsdp "
                                                          "(DDP); the overhead is the run's fault-free step over it")
    p.add_argument("--rollback-steps", type=float, help="restart-the-world: steps redone per failure "
                                                        "(default: half the checkpoint interval)")
    p.add_argument("--model-params", type=count, help="parameters (e.g. 70B): limits replicas by memory")
    p.add_argument("--bytes-per-param", type=float, default=16.0,
                   help="model + optimizer state bytes per parameter (default 16: bf16 + fp32 master + Adam)")
    p.add_argument("--gpu-mem-gb", type=float, default=80.0)
    p.add_argument("--mem-budget", type=float, default=0.5, help="share of GPU memory for the sharded state")
    p.add_argument("--max-replicas", type=int, default=64, help="largest replica count to consider")
    p.add_argument("--tolerance", type=float, default=0.01, help="ETT the recommendation may give up for "
                                                                 "fewer replicas")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--png", default=None, help="where to write the plot (default: RUN_DIR/plan.png with "
                                                 f"--from-run, else {DEFAULT_PNG})")
    p.add_argument("--no-png", action="store_true")


def png_path(a: argparse.Namespace) -> str:
    """Where the plot goes: `--png`, else the run directory of `--from-run`, else DEFAULT_PNG."""
    if a.png:
        return str(a.png)
    if a.from_run:
        return os.path.join(a.from_run, "plan.png")
    return DEFAULT_PNG


def run(a: argparse.Namespace) -> int:
    try:
        inp, src = build_inputs(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"lightning-ft plan: {e}", file=sys.stderr)
        return 2
    memory = Memory(a.model_params * a.bytes_per_param, a.gpu_mem_gb * 1e9, a.mem_budget) if a.model_params else None
    counts = candidate_counts(inp.gpus, a.max_replicas)
    rec = recommend(inp, counts, memory, a.tolerance) if counts else None
    g = goodput(inp)
    cross = crossover(inp)
    result = {"restart_ett": round(g.restart_ett, 4), "ft_ett": round(g.ft_ett, 4), "gpus": inp.gpus,
              "overhead": inp.overhead, "restart_wins_below_gpus": cross.gpus, "crossover": cross.reason,
              "replicas": inp.replicas, "mtbf_job_s": inp.mtbf_job_s,
              "restart_lost_s": g.restart_lost_s, "ft_lost_s": g.ft_lost_s, "ft_stall_s": g.ft_stall_s,
              "ft_degraded_s": g.ft_degraded_s, "ckpt_factor": g.ckpt_factor,
              "recommended_replicas": rec.replicas if rec else None,
              "recommendation": rec.reason if rec else f"{inp.gpus} GPUs cannot be split into 2 or more replicas",
              "candidates": [asdict(c) for c in rec.candidates] if rec else [],
              "inputs": asdict(inp), "sources": src}
    png = png_path(a)
    if not a.no_png:
        os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
        plot(inp, rec.replicas if rec else None, memory, png, a.max_replicas)
        result["png"] = png
    print(json.dumps(result) if a.json else text(inp, src, result))
    if not a.no_png and not a.json:
        print(f"wrote {png}: ETT against GPUs for both modes, and against the replica count")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="lightning-ft plan", description="effective training time of ft_hsdp and "
                                                                      "restart-the-world for a job")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
