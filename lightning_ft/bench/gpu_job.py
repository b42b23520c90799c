"""bench.gpu_check's job check: 2 replicas of ft_hsdp (examples/train_lm.py) on one device, one
SIGKILLed and rejoining, identical at the end (docs/ARCHITECTURE.md, "The GPU path").

The job runs until replica 1's restart has trained a number of steps with the survivor, then
train_lm's --stop-file ends it at a step both agree on (a fixed step count could end before the
restart is back: a small model's steps take milliseconds). On a GPU both replicas train on
cuda:0, and every training process (the survivor, the killed one and its restart) must exchange
its gradients through FTAR's device path with pinned staging: each process reports the data
paths it used (LFT_FTAR_PATHS). On the CPU (gpu_check --dry-run) the same job runs with
--accelerator cpu: the processes report the CPU path, and the device-path condition is reported
as not applicable.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_LM = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "train_lm.py")


def emit(**kw) -> None:
    print(json.dumps({"bench": "gpu_check", **kw}), flush=True)


def _rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _rejoined_steps(run_dir: str) -> int:
    """Steps replica 1 has committed as a contributor since its restart (incarnation >= 1)."""
    return sum(1 for r in _rows(os.path.join(run_dir, "replica_1", "steps.jsonl"))
               if r.get("inc", 0) >= 1 and 1 in (r.get("contributors") or []))


def replicas_job(accelerator: str, kill_step: int, after_steps: int, keep_dir: str = "",
                 timeout_s: float = 200) -> bool:
    """The job under `lightning-ft run`, replica 1 SIGKILLed at step `kill_step`; once its restart has
    trained `after_steps` steps with the other, train_lm's --stop-file ends the job at a step both
    agree on. True when it exits 0 with identical final digests (and, on CUDA, every process on the
    device path with pinned staging)."""
    d = keep_dir or tempfile.mkdtemp(prefix="lft-gpucheck-")
    if keep_dir:
        shutil.rmtree(keep_dir, ignore_errors=True)
        os.makedirs(keep_dir)
    try:
        paths_file, stop_file = os.path.join(d, "ftar_paths.jsonl"), os.path.join(d, "STOP")
        cmd = [sys.executable, "-m", "lightning_ft.launch.cli", "run", "--replicas", "2", "--run-dir", d,
               "--no-status", "--timeout", str(int(timeout_s)), TRAIN_LM, "--steps", "1000000",
               "--stop-file", stop_file, "--accelerator", accelerator,
               f"failure.events=[{{replica: 1, step: {kill_step}, kind: kill}}]", "failure.restart_delay_s=0.5"]
        t0 = time.perf_counter()
        with tempfile.TemporaryFile("w+") as log:
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                 env={**os.environ, "LFT_FTAR_PATHS": paths_file})
            while p.poll() is None and time.perf_counter() - t0 < timeout_s:
                if not os.path.exists(stop_file) and _rejoined_steps(d) >= after_steps:
                    open(stop_file, "w").close()
                time.sleep(0.2)
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            rc = p.wait()
            log.seek(0)
            out = log.read()
        finals = []
        for rid in (0, 1):
            path = os.path.join(d, f"replica_{rid}", "final.json")
            if os.path.exists(path):
                with open(path) as f:
                    finals.append(json.load(f))
        identical = len(finals) == 2 and finals[0]["digest"] == finals[1]["digest"]
        rows = _rows(paths_file)
        pids = {r["pid"] for r in rows}
        # the survivor, the killed process and its restart: 3 processes at least, each reported its path
        restarted = len(pids) >= 3 and _rejoined_steps(d) >= after_steps
        if accelerator == "cuda":
            on_gpu = {r["pid"] for r in rows if r["path"] == "device" and r["device"].startswith("cuda")
                      and r["pinned"]}
            device_path: bool | str = restarted and on_gpu == pids
        else:
            device_path = "not applicable: the CPU job takes the CPU path"
        ok = rc == 0 and identical and restarted and device_path is not False
        emit(check="replicas_kill_rejoin", ok=ok, accelerator=accelerator, rc=rc, identical=identical,
             wall_s=round(time.perf_counter() - t0, 1), steps=[f["step"] for f in finals], kill_step=kill_step,
             rejoined_steps=_rejoined_steps(d), processes=len(pids), device_path=device_path,
             ftar_paths=sorted({(r["replica"], r["path"], r["device"], r["kernels"]) for r in rows}),
             run_dir=d if keep_dir else "", tail="" if ok else out[-1500:])
        return ok
    finally:
        if not keep_dir:
            shutil.rmtree(d, ignore_errors=True)
