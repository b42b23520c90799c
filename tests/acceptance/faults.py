"""Run a program under `lightning-ft run` and hit it with faults at random moments (not at
step boundaries): SIGKILL of one process, SIGSTOP of another replica's leader. The moments
come from a seeded RNG, printed on failure so a run can be replayed."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid

from tests.strategy.runs import Run, collect, lft_cmd


def _pids(run_dir: str) -> dict[int, list[int]]:
    """Live pids of each replica's current incarnation, from events.jsonl."""
    out: dict[int, list[int]] = {}
    path = os.path.join(run_dir, "events.jsonl")
    if os.path.exists(path):
        for line in open(path):
            ev = json.loads(line)
            if ev["event"] in ("start", "restart"):
                out[ev["replica"]] = ev["pids"]
    return out


def _steps(run_dir: str, rid: int) -> int:
    path = os.path.join(run_dir, f"replica_{rid}", "steps.jsonl")
    if not os.path.exists(path):
        return 0
    lines = open(path).read().splitlines()
    return json.loads(lines[-1])["step"] if lines else 0


def run_with_faults(tmp_path, etcd_endpoint: str, script: str, *script_args: str, replicas: int = 3,
                    steps: int = 60, seed: int = 0, kill: bool = True, stop_s: float = 0.0,
                    overrides: tuple[str, ...] = (), timeout: float = 300, nproc: int = 1,
                    python: str = sys.executable) -> tuple[Run, str]:
    """Returns the run and a description of the faults (for assertion messages)."""
    rng = random.Random(seed)
    job = "acc" + uuid.uuid4().hex[:8]
    run_dir = str(tmp_path / job)
    cmd = lft_cmd(run_dir, job, etcd_endpoint, *script_args, replicas=replicas, nproc=nproc, overrides=overrides,
                  timeout=timeout, script=script, python=python)
    log = open(os.path.join(str(tmp_path), f"{job}.out"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    done: list[str] = []
    try:
        deadline = time.monotonic() + timeout - 30
        # Faults only once every replica trains, somewhere in the first half of the run.
        while (time.monotonic() < deadline and proc.poll() is None
               and min(_steps(run_dir, r) for r in range(replicas)) < 3):
            time.sleep(0.05)
        plan = []
        if kill:
            plan.append(("kill", rng.uniform(0.2, 2.0), rng.randrange(replicas)))
        if stop_s:
            plan.append(("stop", rng.uniform(0.5, 2.5), rng.randrange(replicas)))
        for kind, delay, rid in plan:
            # After `delay`, or sooner once a replica passed the middle of the run: on fast steps a
            # fixed delay put a kill so late that the survivor finished before the restart could
            # rejoin (CI: killed near step 34 of 40, and the restarted replica had nothing to train).
            until = time.monotonic() + delay
            while (time.monotonic() < until and proc.poll() is None
                   and max(_steps(run_dir, r) for r in range(replicas)) < steps // 2):
                time.sleep(0.02)
            pids = _pids(run_dir).get(rid, [])
            if not pids or proc.poll() is not None:
                continue
            pid = rng.choice(pids)
            at = _steps(run_dir, rid)
            try:
                if kind == "kill":
                    os.kill(pid, signal.SIGKILL)
                else:
                    os.kill(pids[0], signal.SIGSTOP)
                    time.sleep(stop_s)
                    os.kill(pids[0], signal.SIGCONT)
            except ProcessLookupError:
                continue
            done.append(f"{kind} replica {rid} pid {pid} near step {at} (delay {delay:.2f}s)")
        proc.wait(max(1.0, deadline + 25 - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
    out = open(log.name).read()
    proc.stdout, proc.stderr = out, ""
    return collect(run_dir, job, etcd_endpoint, replicas, proc), f"seed {seed}: " + "; ".join(done)
