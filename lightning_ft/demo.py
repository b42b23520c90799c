"""`make demo`: a small GPT trained with ft_hsdp by 3 replicas on CPU; one is SIGKILLed
mid-run, restarts, catches up from a healthy peer and rejoins while the others keep going.

Prints the launcher's status, then a summary from the run report: steps, downtime of the
failure, whether the replicas ended bitwise identical, and the loss. The run directory
keeps events.jsonl, per-replica logs, summary.md and timeline.png.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_lm.py")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", default="runs/demo")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--kill-at", type=int, default=30, help="SIGKILL replica 1 as it reaches this step")
    a = p.parse_args(argv)
    if os.path.isdir(a.run_dir):
        shutil.rmtree(a.run_dir)
    cmd = [sys.executable, "-m", "lightning_ft.launch.cli", "run", "--replicas", str(a.replicas),
           "--nproc-per-replica", "1", "--run-dir", a.run_dir, "--timeout", "600", EXAMPLE, "--steps", str(a.steps),
           f"failure.events=[{{replica: 1, step: {a.kill_at}, kind: kill}}]", "failure.restart_delay_s=0.5"]
    print("$ lightning-ft run " + " ".join(cmd[4:]), flush=True)
    t0 = time.monotonic()
    rc = subprocess.call(cmd)
    wall = time.monotonic() - t0
    if rc != 0:
        print(f"demo: the run failed (exit {rc}); see {a.run_dir}/logs", file=sys.stderr)
        return rc
    from lightning_ft.report import report

    s = report(a.run_dir)
    print()
    print(f"demo summary ({wall:.0f} s wall, {a.run_dir}/summary.md, {a.run_dir}/timeline.png)")
    print(f"  committed steps      {s['steps']} (every replica: {sorted(set(s['final_step'].values()))})")
    for f in s["failures"]:
        print(f"  failure              replica {f['replica']} ({f['reason']}): down {f['down_s']} s until it "
              f"rejoined at step {f['back_at_step']}; healthy replicas stalled {f['healthy_stall_s']} s")
    print(f"  restarts             {s['restarts']}")
    print(f"  final weights        {'identical on all replicas' if s['identical'] else 'DIFFER'}")
    print(f"  train loss           {s['loss_first']} -> {s['loss_last']} nats/byte"
          + (f"; held-out {s['val_bpb']:.3f} bits/byte" if s["val_bpb"] is not None else ""))
    print(f"  effective training   {s['ett']} of the fault-free step rate ({s['fault_free_step_s']:.3f} s/step)")
    print(json.dumps({"demo": "train_lm", **{k: s[k] for k in ("steps", "restarts", "identical", "ett")}}))
    return 0 if s["identical"] and s["failures"] and s["failures"][0]["down_s"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
