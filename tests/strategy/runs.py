"""Run tests/strategy/lit_script.py under `lightning-ft run` against the test etcd and read
back what happened: per-batch rows of every replica incarnation, final digests, events and
the exactly-once ledger."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass, field

from lightning_ft.coord.etcd_store import EtcdStore
from lightning_ft.replica.ledger import read_cursors, verify_ledger

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lit_script.py")


@dataclass
class Run:
    run_dir: str
    proc: subprocess.CompletedProcess
    rows: dict = field(default_factory=dict)
    """(rid, incarnation) -> list of batch rows, in order."""
    finals: dict = field(default_factory=dict)
    events: list = field(default_factory=list)
    ledger: object = None

    def log(self, rid: int, inc: int = 0) -> str:
        path = os.path.join(self.run_dir, "logs", f"r{rid}.i{inc}.rank0.log")
        return open(path, errors="replace").read() if os.path.exists(path) else ""

    def replica_rows(self, rid: int) -> list[dict]:
        return [r for (i, _), rows in sorted(self.rows.items()) if i == rid for r in rows]


def lft_cmd(run_dir: str, job: str, etcd_endpoint: str, *script_args: str, replicas: int = 2, nproc: int = 1,
            overrides: tuple[str, ...] = (), timeout: float = 240, script: str = SCRIPT,
            python: str = sys.executable) -> list[str]:
    """`python` runs the launcher and so the replicas (tests/fabric: the LitGPT venv's)."""
    return [python, "-m", "lightning_ft.launch.cli", "run", "--replicas", str(replicas),
            "--nproc-per-replica", str(nproc), "--etcd", etcd_endpoint, "--job", job, "--run-dir", run_dir,
            "--no-status", "--timeout", str(timeout - 20), "--max-restarts", "3", script, *script_args,
            "etcd.lease_ttl_s=1", "failure.restart_delay_s=0.2", "quorum.init_timeout_s=60", *overrides]


def lft_run(tmp_path, etcd_endpoint: str, *script_args: str, replicas: int = 2, nproc: int = 1,
            overrides: tuple[str, ...] = (), timeout: float = 240, script: str = SCRIPT,
            python: str = sys.executable) -> Run:
    job = "lit" + uuid.uuid4().hex[:8]
    run_dir = str(tmp_path / job)
    cmd = lft_cmd(run_dir, job, etcd_endpoint, *script_args, replicas=replicas, nproc=nproc, overrides=overrides,
                  timeout=timeout, script=script, python=python)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return collect(run_dir, job, etcd_endpoint, replicas, proc)


def collect(run_dir: str, job: str, etcd_endpoint: str, replicas: int, proc) -> Run:
    """Read back a finished run: batch rows, final digests, events and the ledger."""
    run = Run(run_dir, proc)
    logs = os.path.join(run_dir, "logs")
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        if not name.endswith(".rank0.log"):
            continue
        if name.startswith("spare-"):  # a warm spare's; a promoted one's is linked as r{rid}.i{inc}
            continue
        rows = [json.loads(l) for l in open(os.path.join(logs, name)) if l.startswith('{"event": "batch"')]
        rid, inc = int(name[1:name.index(".")]), int(name.split(".")[1][1:])
        run.rows[(rid, inc)] = rows
    for rid in range(replicas):
        path = os.path.join(run_dir, f"replica_{rid}", "final.json")
        if os.path.exists(path):
            run.finals[rid] = json.load(open(path))
    ev = os.path.join(run_dir, "events.jsonl")
    if os.path.exists(ev):
        run.events = [json.loads(l) for l in open(ev)]
    store = EtcdStore(etcd_endpoint)
    try:
        root = run_root(store, job)
        run.ledger = verify_ledger(store, root, read_cursors(store, root, range(replicas)))
    finally:
        store.close()
    return run


def run_root(store, job: str, prefix: str = "/lft") -> str:
    """The keyspace of the job's current run (coord/runs.py)."""
    from lightning_ft.coord import keys
    from lightning_ft.coord.runs import recorded_run

    record = recorded_run(store, prefix, job)
    assert record is not None, f"job {job!r} recorded no run"
    return keys.root(prefix, job, record.id)


def ok(run: Run) -> str:
    """Diagnostics for a failed assertion: the launcher's output and each replica's log tail."""
    out = [(run.proc.stdout or "")[-1500:], (run.proc.stderr or "")[-1500:]]
    for (rid, inc) in sorted(run.rows):
        out.append(f"--- r{rid}.i{inc}\n" + "\n".join(l for l in run.log(rid, inc).splitlines()
                                                      if not l.startswith('{"event": "batch"'))[-2500:])
    return "\n".join(out)
