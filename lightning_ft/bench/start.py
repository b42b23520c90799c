"""What starting a job costs: `lightning-ft run` with its replicas forked from the zygote
(`supervisor.zygote=true`, the default) against every process starting Python afresh
(`supervisor.zygote=false`), in the same run, alternating the order each round.

    python -m lightning_ft.bench.start [--replicas 3] [--nproc 1] [--steps 10] [--rounds 2]

Each run is a whole job of examples/plain_loop.py (or `--script`) through `lightning-ft run`
with an embedded etcd, to the end. CPU is the job's: user + system time of this process's
children, grandchildren included, from `getrusage(RUSAGE_CHILDREN)` around the run (the
zygote's forks are reaped by the zygote, which the launcher reaps), so it barely moves with
the machine's load; wall time does. One JSON line per run, then one summary:

    {"bench": "start_run", "round": r, "zygote": bool, "cpu_s": ..., "wall_s": ..., "rc": 0}
    {"bench": "start", "replicas": R, "nproc": W, "cpu_zygote_s": ..., "cpu_cold_s": ...,
     "cpu_ratio": zygote/cold, "wall_zygote_s": ..., "wall_cold_s": ..., "wall_ratio": ...}

(medians over rounds; the ratio is the median of the rounds' paired ratios).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from lightning_ft.bench.localjob import LOOP


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_job(script: str, replicas: int, nproc: int, steps: int, zygote: bool, run_dir: str,
            timeout_s: float) -> tuple[float, float, int]:
    """(cpu_s, wall_s, exit code) of one whole job."""
    cmd = [sys.executable, "-m", "lightning_ft.launch.cli", "run", "--replicas", str(replicas),
           "--nproc-per-replica", str(nproc), "--run-dir", run_dir, "--no-status", "--timeout", str(int(timeout_s)),
           script, "--steps", str(steps), f"supervisor.zygote={'true' if zygote else 'false'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LFT_SECRET": "bench-start-secret-0123456789"}
    c0, t0 = _cpu(), time.perf_counter()
    with open(os.path.join(os.path.dirname(run_dir), os.path.basename(run_dir) + ".log"), "w") as out:
        p = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s + 60)
    return _cpu() - c0, time.perf_counter() - t0, p.returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=1, help="processes per replica")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--script", default=LOOP, help="the training script (default: examples/plain_loop.py)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    a = ap.parse_args(argv)
    got: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    cpu_ratios, wall_ratios = [], []
    with tempfile.TemporaryDirectory(prefix="lft-bench-start-") as tmp:
        for r in range(a.rounds):
            this: dict[bool, tuple[float, float]] = {}
            for zygote in ((True, False) if r % 2 == 0 else (False, True)):
                cpu, wall, rc = run_job(a.script, a.replicas, a.nproc, a.steps, zygote,
                                        os.path.join(tmp, f"r{r}-{'zygote' if zygote else 'cold'}"), a.timeout)
                print(json.dumps({"bench": "start_run", "round": r, "zygote": zygote, "cpu_s": round(cpu, 3),
                                  "wall_s": round(wall, 3), "rc": rc}), flush=True)
                if rc != 0:
                    print(f"bench.start: the job exited with {rc}; its log is in {tmp} (kept while it runs)",
                          file=sys.stderr)
                    return 1
                this[zygote] = (cpu, wall)
                got[zygote].append((cpu, wall))
            cpu_ratios.append(this[True][0] / this[False][0])
            wall_ratios.append(this[True][1] / this[False][1])

    def med(zygote: bool, i: int) -> float:
        return round(statistics.median(x[i] for x in got[zygote]), 3)

    print(json.dumps({"bench": "start", "replicas": a.replicas, "nproc": a.nproc, "steps": a.steps,
                      "rounds": a.rounds, "cpu_zygote_s": med(True, 0), "cpu_cold_s": med(False, 0),
                      "cpu_ratio": round(statistics.median(cpu_ratios), 3), "wall_zygote_s": med(True, 1),
                      "wall_cold_s": med(False, 1), "wall_ratio": round(statistics.median(wall_ratios), 3),
                      "loadavg": os.getloadavg()[0]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
