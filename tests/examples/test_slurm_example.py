"""examples/slurm/train.sbatch on one machine, with stand-ins for `srun` (runs the step's
command here) and `scontrol show hostnames` (one node, localhost): its etcd step, `lightning-ft
env` per replica and torchrun per replica train the plain loop to the end, with the secret in a
file and never on a command line."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys

import pytest

from lightning_ft.bench.localjob import LOOP
from lightning_ft.coord.etcd_server import free_port

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SBATCH = os.path.join(ROOT, "examples", "slurm", "train.sbatch")
SRUN = """#!/bin/bash
# stand-in for srun: drop its options, run the step's command on this machine
while [[ $# -gt 0 && $1 == --* ]]; do shift; done
echo "srun: $*" >> "$LOG"
exec "$@"
"""
SCONTROL = """#!/bin/bash
echo localhost
"""


@pytest.mark.timeout(300)
def test_sbatch_script_trains_every_replica_under_torchrun(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    venv = os.path.dirname(os.path.dirname(sys.executable))
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LFT_", "SLURM_", "TORCHELASTIC", "MASTER_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", LOG=str(tmp_path / "srun.log"), VENV=venv, RUN_DIR=str(run_dir),
               REPLICAS="2", NPROC="1", ETCD_PORT=str(free_port()), SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="1",
               SLURM_JOB_NODELIST="localhost", PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.Popen(["bash", SBATCH, LOOP, "--steps", "20", "--dim", "16", "--hidden", "32", "--batch", "8",
                          "--init-timeout", "60"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # the session this test started: the script and its steps
            p.wait(10)
    logs = {r: (run_dir / f"replica_{r}.out").read_text() for r in (0, 1)}
    assert p.returncode == 0, out[-2000:] + "".join(l[-2000:] for l in logs.values())
    finals = {r: [json.loads(l) for l in logs[r].splitlines() if l.startswith('{"')] for r in (0, 1)}
    finals = {r: [x for x in rows if x.get("event") == "final"] for r, rows in finals.items()}
    assert finals[0] and finals[1] and finals[0][0]["step"] == finals[1][0]["step"] == 20
    assert finals[0][0]["digest"] == finals[1][0]["digest"]
    steps = (tmp_path / "srun.log").read_text()
    assert steps.count("torchrun --standalone --nproc-per-node 1 --max-restarts 10") == 2
    secret = (run_dir / "secret").read_text().strip()
    assert len(secret) == 32 and oct((run_dir / "secret").stat().st_mode & 0o777) == "0o600"
    assert secret not in steps and secret not in out
