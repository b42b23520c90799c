"""Real study runs: one `lightning-ft run` per setting and seed, with real SIGKILLs, read
back into curves (docs/study/, "Real runs").

The study starts one etcd for all its real runs (each run is its own job), so that after a
run the exactly-once ledger can be verified and read: its commit records give the slot
batches of every step, which the simulator replays to validate itself. From the run
directory come the per-step train loss (each replica's `steps.jsonl` rows, weighted by
the slot batches each trained), the held-out evaluations (`eval.jsonl`), the contributors
of each step and the wall-clock time of each step's first commit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

from lightning_ft.coord import keys
from lightning_ft.coord.etcd_store import EtcdStore
from lightning_ft.coord.store import Store
from lightning_ft.replica.ledger import read_cursors, verify_ledger
from lightning_ft.report import _jsonl  # torn last lines of killed writers are skipped


@dataclass
class RealSpec:
    script: str
    script_args: list[str]
    seed: int
    precision: str
    lr: str
    batch_policy: str
    replicas: int
    steps: int
    events: list[dict] = field(default_factory=list)
    """failure.events of the job."""
    timeout_s: float = 1800.0


class RealRunFailed(RuntimeError):
    """A real run did not finish, or broke an invariant; the message says where to look."""


def command(spec: RealSpec, run_dir: str, job: str, etcd: str) -> list[str]:
    """The `lightning-ft run` command line of a real run."""
    events = "[" + ", ".join("{" + ", ".join(f"{k}: {v}" for k, v in e.items()) + "}" for e in spec.events) + "]"
    return [sys.executable, "-m", "lightning_ft.launch.cli", "run", "--replicas", str(spec.replicas),
            "--nproc-per-replica", "1", "--etcd", etcd, "--job", job, "--run-dir", run_dir, "--no-status",
            "--timeout", str(int(spec.timeout_s)), "--max-restarts", "100", spec.script, *spec.script_args,
            "--steps", str(spec.steps), "--seed", str(spec.seed), "--precision", spec.precision,
            f"seed={spec.seed}", f"lr_intervention={spec.lr}", f"batch_policy={spec.batch_policy}",
            "checkpoint.every_n_steps=0", "quorum.init_timeout_s=120", f"failure.events={events}"]


def run_real(spec: RealSpec, run_dir: str, job: str, etcd: str) -> dict:
    """Run it (output in run_dir/launcher.log) and read it back; RealRunFailed if it failed."""
    os.makedirs(run_dir, exist_ok=True)
    t0 = time.time()
    with open(os.path.join(run_dir, "launcher.log"), "w") as log:
        try:
            proc = subprocess.run(command(spec, run_dir, job, etcd), stdout=log, stderr=subprocess.STDOUT,
                                  timeout=spec.timeout_s + 60, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise RealRunFailed(
                f"real run {job} did not finish in {spec.timeout_s + 60:.0f}s; see {run_dir}/logs") from None
    if proc.returncode != 0:
        raise RealRunFailed(f"real run {job} exited with {proc.returncode}; see {run_dir}/launcher.log and "
                            f"{run_dir}/logs")
    out = read_run(run_dir, spec.replicas, spec.steps)
    store = EtcdStore(etcd)
    try:
        out.update(ledger(store, keys.root("/lft", job, run_id(run_dir)), spec.replicas, spec.steps))
    finally:
        store.close()
    out["seconds"] = time.time() - t0
    return out


def run_id(run_dir: str) -> str:
    """The run id the launcher wrote to RUN_DIR/run_id (the job's keyspace is per run)."""
    try:
        with open(os.path.join(run_dir, "run_id")) as f:
            return f.read().strip()
    except OSError:
        raise RealRunFailed(f"{run_dir}/run_id is missing: did `lightning-ft run` start?") from None


def ledger(store: Store, root: str, replicas: int, steps: int) -> dict:
    """A job's ledger (keyspace `root`): verified exactly once, and the slot batches of every step."""
    rep = verify_ledger(store, root, read_cursors(store, root, range(replicas)))
    kvs, _ = store.get_prefix(keys.commits(root))
    job = root
    if not rep.ok or rep.rewinds:
        raise RealRunFailed(f"job {job}: the ledger is not an exact single-generation history: duplicates "
                            f"{rep.duplicates[:5]}, gaps {rep.gaps[:5]}, conflicts {rep.conflicts[:2]}, "
                            f"rewinds {rep.rewinds}")
    batches: dict[int, dict[int, int]] = {}
    for kv in kvs:
        _, step, _ = keys.parse_commit(root, kv.key)
        batches.setdefault(step, {int(s): int(k) for s, k in json.loads(kv.value)["batches"].items()})
    if sorted(batches) != list(range(steps)):
        raise RealRunFailed(f"job {job}: the ledger has steps "
                            f"{min(batches, default=None)}..{max(batches, default=None)}"
                            f" ({len(batches)}), expected 0..{steps - 1}")
    return {"batches": [batches[n] for n in range(steps)], "ledger_steps": rep.steps}


def read_run(run_dir: str, replicas: int, steps: int) -> dict:
    """Curves of a finished run directory: train loss, held-out, contributors, wall time."""
    rows: list[dict] = []
    evals: dict[int, float] = {}
    for rid in range(replicas):
        d = os.path.join(run_dir, f"replica_{rid}")
        rows += _jsonl(os.path.join(d, "steps.jsonl"))
        for e in _jsonl(os.path.join(d, "eval.jsonl")):
            evals.setdefault(int(e["step"]), float(e["val_bpb"]))
    loss_sum = [0.0] * steps
    weight = [0] * steps
    contributors: list[Optional[list[int]]] = [None] * steps
    first_t: list[Optional[float]] = [None] * steps
    for r in rows:
        n = int(r["step"]) - 1  # the row of the call that committed step n (state version n + 1)
        if not 0 <= n < steps:
            continue
        if first_t[n] is None or r["t"] < first_t[n]:
            first_t[n] = r["t"]
        if r.get("role") in ("train", "catchup"):
            contributors[n] = sorted(r["contributors"])
        if r.get("role") == "train" and r.get("loss") is not None:
            w = int(r.get("slots", 1))
            loss_sum[n] += float(r["loss"]) * w
            weight[n] += w
    missing = [n for n in range(steps) if weight[n] == 0 or contributors[n] is None or first_t[n] is None]
    if missing:
        raise RealRunFailed(f"{run_dir}: no train rows for steps {missing[:10]} (of {len(missing)}); see its logs")
    times = [t for t in first_t if t is not None]  # all of them: no step is missing
    t0 = times[0]
    return {"train_loss": [s / w for s, w in zip(loss_sum, weight, strict=True)], "eval": evals,
            "contributors": contributors, "wall": [t - t0 for t in times]}

