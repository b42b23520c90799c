"""Goodput of ft_hsdp against restart-the-world, same job and failure schedule, one run.

    python -m lightning_ft.bench.goodput [--replicas 2] [--steps 360] [--every 60]
                                         [--ckpt-every 50] [--restart-delay 2]
    python -m lightning_ft.bench.goodput --end-to-end ...   # time to N steps beside DDP (goodput_e2e.py)

Both runs train examples/train_lm.py with replica 1 SIGKILLed every `--every` steps and
checkpoints every `--ckpt-every` steps:
- ft: `lightning-ft run` (only the failed replica restarts, then catches up from a peer);
- restart: `lightning-ft run --restart world` (like torchrun elastic: any failure stops every
  replica, and all restart from the newest checkpoint, redoing the steps since).

ETT (effective training time) counts work, not steps: sum over committed steps of
contributors/R x fault-free step time / training wall time (from the run report; the
fault-free step time is the median step while every replica contributes, in that run).
Each run's line also has `predicted_ett`: the goodput model (`lightning-ft plan`,
sim/goodput.py) fed with the detection, restart, catch-up, stall, failure interval,
checkpoint cost and the survivors' step time measured in that run, and
`predicted_ett_same_speed`: the same with the survivors stepping at the fault-free rate.
Prints one line per run and then

    {"bench": "goodput", "failures": ..., "ft_ett": ..., "ft_predicted_ett": ...,
     "restart_ett": ..., "restart_predicted_ett": ..., ...}
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace

from lightning_ft.report import load, summarize
from lightning_ft.sim.goodput import goodput
from lightning_ft.sim.plan import checkpoint_costs, predict_run

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples",
                       "train_lm.py")


def run(mode: str, a: argparse.Namespace, run_dir: str) -> dict:
    kills = ", ".join(f"{{replica: 1, step: {s}, kind: kill}}" for s in range(a.every, a.steps, a.every))
    cmd = [sys.executable, "-m", "lightning_ft.launch.cli", "run", "--replicas", str(a.replicas), "--run-dir",
           run_dir, "--no-status", "--max-restarts", "50", "--timeout", str(a.timeout),
           "--restart", "world" if mode == "restart" else "replica", a.script, "--steps", str(a.steps),
           *a.model_args.split(),
           "--val-every", str(10 ** 6), f"failure.events=[{kills}]", f"failure.restart_delay_s={a.restart_delay}",
           f"checkpoint.every_n_steps={a.ckpt_every}", "checkpoint.keep=2", f"job=goodput-{mode}"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout + 120)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{mode} run failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    data = load(run_dir)
    s = summarize(data)
    events = [json.loads(l) for l in open(os.path.join(run_dir, "events.jsonl"))]
    failures = sum(1 for e in events if e["event"] == "exit" and e.get("code") not in (0, None))
    # the step-time cost of a checkpoint step (the step waits while the state is staged in memory)
    ck = checkpoint_costs(data.steps.get(0, []))
    _, inp, predicted = predict_run(run_dir)
    # the same, but with the survivors stepping as fast as before the failure (as on a cluster)
    same_speed = goodput(replace(inp, degraded_step_s=None)).ft_ett if mode == "ft" else predicted
    rnd = (lambda x, n: None if x is None else round(x, n))  # noqa: E731
    row = {"bench": "goodput_run", "mode": mode, "steps": s["steps"], "work_steps": s["work_steps"],
           "failures": failures, "restarts": s["restarts"], "fault_free_step_s": round(s["fault_free_step_s"] or 0, 4),
           "train_wall_s": s["train_wall_s"], "ett": s["ett"], "predicted_ett": round(predicted, 4),
           "predicted_ett_same_speed": round(same_speed, 4),
           "launcher_wall_s": round(wall, 1), "identical": s["identical"],
           "ckpt_steps": ck["ckpt_steps"], "ckpt_step_call_s": rnd(ck["ckpt_step_call_s"], 4),
           "ckpt_stage_ms": rnd(ck["ckpt_stage_ms"], 2), "step_call_s": rnd(ck["step_call_s"], 4),
           "model_inputs": {k: rnd(v, 3) if isinstance(v, float) else v for k, v in asdict(inp).items()}}
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--end-to-end" in argv:
        from lightning_ft.bench import goodput_e2e

        return goodput_e2e.main(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--steps", type=int, default=360)
    p.add_argument("--every", type=int, default=60, help="kill replica 1 every this many steps")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--restart-delay", type=float, default=2.0, help="seconds before a failed replica restarts")
    p.add_argument("--script", default=EXAMPLE)
    p.add_argument("--model-args", default="--d 128 --layers 4",
                   help="script arguments: a step long enough that a restart (~12 s here) fits between kills")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    a = p.parse_args(argv)
    base = tempfile.mkdtemp(prefix="lft-goodput-")
    try:
        rows = {mode: run(mode, a, os.path.join(base, mode)) for mode in ("ft", "restart")}
    finally:
        if a.keep:
            print(f"run directories kept under {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)
    ft, rs = rows["ft"], rows["restart"]
    print(json.dumps({"bench": "goodput", "replicas": a.replicas, "steps": a.steps, "kill_every": a.every,
                      "fault_free_step_s": ft["fault_free_step_s"], "ckpt_step_call_s": ft["ckpt_step_call_s"],
                      "step_call_s": ft["step_call_s"], "ckpt_stage_ms": ft["ckpt_stage_ms"],
                      "ckpt_every": a.ckpt_every, "restart_delay_s": a.restart_delay,
                      "failures": ft["failures"], "restart_failures": rs["failures"],
                      "ft_ett": ft["ett"], "ft_predicted_ett": ft["predicted_ett"],
                      "restart_ett": rs["ett"], "restart_predicted_ett": rs["predicted_ett"],
                      "ft_wall_s": ft["train_wall_s"], "restart_wall_s": rs["train_wall_s"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
