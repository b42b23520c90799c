"""examples/hydra (lightning-hydra-template layout) under `lightning-ft run --replicas 2`, with app
overrides and FT overrides on one command line and a SIGKILL of one replica at a random moment
of a step (not at a step boundary): the app's overrides took effect in every replica process,
the FT overrides too, every process wrote its Hydra output under the run dir, and the replicas
end bitwise identical with a complete exactly-once ledger."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid

import yaml

from lightning_ft.coord.etcd_store import EtcdStore
from lightning_ft.replica.ledger import read_cursors, verify_ledger
from tests.strategy.runs import Run, ok, run_root

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
APP = os.path.abspath(os.path.join(ROOT, "examples", "hydra", "src", "train.py"))
STEPS = 80
APP_OVERRIDES = [f"trainer.max_steps={STEPS}", "trainer.val_check_interval=40", "model.d=32", "model.context=32",
                 "model.lr=0.002", "model.warmup=5", "model.max_bytes=400000", "seed=777"]
# min_replicas=2: the survivor waits for the restarted replica (so it rejoins before the end
# however slow the restart), then the restarted one catches up; bucket_bytes is checked at join.
FT_OVERRIDES = ["ft.min_replicas=2", "ft.ftar.bucket_bytes=65536", "ft.lr_intervention=linear",
                "ft.etcd.lease_ttl_s=1", "ft.etcd.hang_timeout_s=120", "ft.failure.restart_delay_s=0.2",
                "ft.quorum.init_timeout_s=60", "ft.checkpoint.every_n_steps=0"]


def steps_of(run_dir: str, rid: int) -> list[dict]:
    path = os.path.join(run_dir, f"replica_{rid}", "steps.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def events_of(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def test_hydra_example_two_replicas_sigkill_mid_step(tmp_path, etcd_endpoint, procs):
    job = "hyd" + uuid.uuid4().hex[:8]
    run_dir = str(tmp_path / job)
    cmd = [sys.executable, "-m", "lightning_ft.launch.cli", "run", "--replicas", "2", "--etcd", etcd_endpoint,
           "--job", job, "--run-dir", run_dir, "--no-status", "--timeout", "200", "--max-restarts", "3",
           APP, *APP_OVERRIDES, *FT_OVERRIDES]
    out, err = tmp_path / "launcher.out", tmp_path / "launcher.err"
    with open(out, "w") as o, open(err, "w") as e:
        p = subprocess.Popen(cmd, stdout=o, stderr=e, cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": ROOT})
    procs.append(p)
    # SIGKILL replica 1 a random time into a step, once it trains steadily
    kill_after = 5
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and p.poll() is None and len(steps_of(run_dir, 1)) < kill_after:
        time.sleep(0.02)
    assert len(steps_of(run_dir, 1)) >= kill_after, out.read_text() + err.read_text()
    (start,) = [ev for ev in events_of(run_dir) if ev["event"] == "start" and ev["replica"] == 1]
    time.sleep(random.uniform(0.0, 0.1))
    os.kill(start["pids"][0], signal.SIGKILL)
    killed_at = steps_of(run_dir, 1)[-1]["step"]
    try:
        p.wait(200)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    run = Run(run_dir, subprocess.CompletedProcess(cmd, p.returncode, out.read_text(), err.read_text()))
    run.rows = {(1, 0): [], (1, 1): [], (0, 0): []}  # for ok(): the logs of every incarnation
    run.events = events_of(run_dir)
    assert p.returncode == 0, ok(run)
    assert killed_at < STEPS, "the kill must land mid-run"
    assert [(ev["event"], ev["replica"]) for ev in run.events if ev["event"] in ("evict", "restart")] == [
        ("evict", 1), ("restart", 1)], ok(run)

    # the replicas end bitwise identical, every batch trained exactly once
    finals = [json.load(open(os.path.join(run_dir, f"replica_{rid}", "final.json"))) for rid in (0, 1)]
    assert finals[0]["digest"] == finals[1]["digest"], ok(run)
    assert finals[0]["step"] == finals[1]["step"] == STEPS and finals[1]["incarnation"] == 1
    store = EtcdStore(etcd_endpoint)
    try:
        root = run_root(store, job)
        ledger = verify_ledger(store, root, read_cursors(store, root, range(2)))
        fingerprint = json.loads(store.get(root + "config").value)
    finally:
        store.close()
    assert ledger.ok and ledger.steps == STEPS, (ledger.duplicates, ledger.gaps, ledger.conflicts)

    # FT overrides: beat the app's ft node (lr_intervention: sqrt), reached every replica (a joiner
    # with another bucket size or min_replicas is refused at join) and acted
    cfg = yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))
    assert (cfg["lr_intervention"], cfg["min_replicas"], cfg["ftar"]["bucket_bytes"]) == ("linear", 2, 65536)
    assert cfg["replicas"] == 2 and cfg["checkpoint"]["every_n_steps"] == 0
    assert fingerprint["min_replicas"] == 2 and fingerprint["bucket_bytes"] == 65536, fingerprint
    rows0, rows1 = steps_of(run_dir, 0), steps_of(run_dir, 1)
    caught_up = [row["step"] for row in rows1 if row["caught_up"]]
    alone = [row["step"] for row in rows0 if row["contributors"] == [0]]
    assert caught_up, "the restarted replica caught up from the survivor"
    # min_replicas=2: the survivor waited instead of training alone; its only single-contributor
    # steps are the rounds in which the restarted replica was a lagging member catching up
    assert alone == caught_up, (alone, caught_up)
    # linear: the LR factor is contributors / R (sqrt would give 0.707)
    for row in rows0 + rows1:
        assert row["lr_factor"] == (0.5 if row["contributors"] == [0] else 1.0), row

    # app overrides: in each process's Hydra output, under the run dir per replica and incarnation,
    # and in the model each one built (Lightning's hparams)
    for rid, inc in ((0, 0), (1, 0), (1, 1)):
        out_dir = os.path.join(run_dir, f"replica_{rid}", "hydra", f"i{inc}.rank0")
        saved = yaml.safe_load(open(os.path.join(out_dir, ".hydra", "config.yaml")))
        assert saved["seed"] == 777 and saved["trainer"]["max_steps"] == STEPS
        assert (saved["model"]["d"], saved["model"]["lr"]) == (32, 0.002)
        hp = yaml.safe_load(open(os.path.join(out_dir, "lightning_logs", f"replica_{rid}", "hparams.yaml")))
        assert (hp["d"], hp["context"], hp["lr"], hp["steps"]) == (32, 32, 0.002, STEPS)
        assert os.path.exists(os.path.join(out_dir, "train.log"))
    assert not (tmp_path / "outputs").exists(), "no process wrote Hydra's default outputs/DATE dir"
