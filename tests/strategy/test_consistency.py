"""Consistent replicas for any Lightning program (docs/ARCHITECTURE.md, "Sync rounds" and
"The divergence guard"): one starting state whatever the user seeds, a state digest compared
every few steps that heals a corrupted minority, and a clear stop when no majority agrees."""
from __future__ import annotations

import math
import os

import pytest

from lightning_ft.replica import checkpoint as ck
from tests.strategy.runs import lft_run, ok


def test_unseeded_replicas_adopt_replica_0_and_end_identical(tmp_path, etcd_endpoint):
    run = lft_run(tmp_path, etcd_endpoint, "--steps", "12", "--unseeded", replicas=3,
                  overrides=("consistency.every_n_steps=1",))
    assert run.proc.returncode == 0, ok(run)
    assert len({tuple(f["digest"]) for f in run.finals.values()}) == 1, run.finals
    syncs = [e for e in run.events if e["event"] == "sync"]
    assert sorted(e["replica"] for e in syncs) == [1, 2] and {e["source"] for e in syncs} == {0}
    assert all(e["step"] == 0 and e["mb"] > 0 for e in syncs), syncs
    assert "adopted replica 0's state at step 0" in run.log(1)
    # the digests were compared every step and never disagreed
    assert not [e for e in run.events if e["event"] in ("diverged", "halt")]
    # the first step trained all three slots (the sync round trained nothing)
    first = run.replica_rows(0)[0]
    assert first["step"] == 1 and first["contributors"] == [0, 1, 2]


def test_corrupted_replica_is_detected_healed_and_ends_identical(tmp_path, etcd_endpoint):
    run = lft_run(tmp_path, etcd_endpoint, "--steps", "30", "--step-sleep", "0.02", replicas=3,
                  overrides=("consistency.every_n_steps=5", "failure.events=[{replica: 1, step: 12, kind: corrupt}]"))
    assert run.proc.returncode == 0, ok(run)
    # the digests of step 15 disagree on a steady round's ring; every replica digests step 16 and
    # its full round names the diverged replica (replica/guard.py)
    div = [e for e in run.events if e["event"] == "diverged"]
    assert len(div) == 1 and div[0]["replica"] == 1 and div[0]["step"] == 16, run.events
    assert div[0]["digest"] != div[0]["majority"]
    assert len({tuple(f["digest"]) for f in run.finals.values()}) == 1, run.finals
    assert run.ledger.ok and run.ledger.steps == 30, run.ledger
    # replica 1 healed by a catch-up in the round of step 16, then trained its batch
    import json

    rows = [json.loads(l) for l in open(os.path.join(run.run_dir, "replica_1", "steps.jsonl"))]
    assert [r["step"] for r in rows if r["caught_up"] and r["role"] == "train"] == [18], rows


def test_a_replica_corrupted_after_the_last_digest_is_healed_at_the_end(tmp_path, etcd_endpoint):
    """Corrupted at step 27 of 30, after the last compared digest (25): the end compares the final
    states (replica/catchup/ending.py, `end_verdict`) and the minority takes the majority's."""
    run = lft_run(tmp_path, etcd_endpoint, "--steps", "30", "--step-sleep", "0.02", replicas=3,
                  overrides=("consistency.every_n_steps=5", "failure.events=[{replica: 1, step: 27, kind: corrupt}]"))
    assert run.proc.returncode == 0, ok(run)
    div = [e for e in run.events if e["event"] == "diverged"]
    assert len(div) == 1 and div[0]["replica"] == 1 and div[0].get("at") == "end" and div[0]["step"] == 30, div
    assert len({tuple(f["digest"]) for f in run.finals.values()}) == 1, run.finals
    assert run.ledger.ok and run.ledger.steps == 30, run.ledger
    assert "differed from the majority's" in run.log(1)


def test_a_healed_replica_stays_identical_under_a_schedule_that_changes_every_step(tmp_path, etcd_endpoint):
    # The 100-fault soak (issue: "halts on main"): a replica healed by a catch-up inside a step
    # then trained that step's batch with the learning rate of the step it caught up to (the
    # scheduler's step owed for the catch-up was paid only after both), so it diverged again
    # at every digest check, and halted the job once only two replicas were left.
    run = lft_run(tmp_path, etcd_endpoint, "--steps", "40", "--step-sleep", "0.02", "--decay", replicas=3,
                  overrides=("consistency.every_n_steps=5", "failure.events=[{replica: 1, step: 12, kind: corrupt}]"))
    assert run.proc.returncode == 0, ok(run)
    div = [(e["replica"], e["step"]) for e in run.events if e["event"] == "diverged"]
    assert div == [(1, 16)], run.events
    assert len({tuple(f["digest"]) for f in run.finals.values()}) == 1, run.finals
    assert run.ledger.ok and run.ledger.steps == 40, run.ledger
    # every replica stepped with the same learning rate at every step, the healed one included
    lrs = {}
    for rid in range(3):
        for row in run.replica_rows(rid):
            lrs.setdefault(row["step"], set()).add(row["applied_lr"])
    assert all(len(v) == 1 for v in lrs.values()), {s: v for s, v in lrs.items() if len(v) > 1}


def test_two_replicas_that_disagree_stop_the_job_and_keep_the_verified_checkpoint(tmp_path, etcd_endpoint):
    run = lft_run(tmp_path, etcd_endpoint, "--steps", "40", "--step-sleep", "0.02", replicas=2,
                  overrides=("consistency.every_n_steps=5", "checkpoint.every_n_steps=5",
                             "failure.events=[{replica: 1, step: 12, kind: corrupt}]"))
    assert run.proc.returncode == 86, ok(run)
    assert "the job halted: replica states diverged at step 16 and no majority agrees: r0=" in run.proc.stdout, ok(run)
    assert "r1=" in run.proc.stdout
    halts = [e for e in run.events if e["event"] in ("halt", "job_halted")]
    assert halts, run.events
    # no replica was restarted after the halt
    assert not [e for e in run.events if e["event"] == "restart"], run.events
    root = os.path.join(run.run_dir, "checkpoints")
    found = ck.newest_valid(root, warn=lambda m: None)
    assert found is not None and found[0] == 10, (found, ck.list_steps(root))
    with pytest.raises(ck.CheckpointInvalid, match="diverged"):
        ck.verify(ck.step_dir(root, 15))


@pytest.mark.parametrize("mode", ["none", "linear"])
def test_lr_intervention_callback_takes_effect_during_an_outage(tmp_path, etcd_endpoint, mode):
    run = lft_run(tmp_path, etcd_endpoint, "--steps", "30", "--degraded-sleep", "0.4", "--lr-mode", mode,
                  overrides=("failure.events=[{replica: 1, step: 5, kind: kill}]", "lr_intervention=sqrt"))
    assert run.proc.returncode == 0, ok(run)
    outage = [r for r in run.replica_rows(0) if r["contributors"] == [0]]
    assert outage, ok(run)
    want = {"none": 1.0, "linear": 0.5}[mode]
    assert all(math.isclose(r["lr_factor"], want) for r in outage), outage
    assert all(math.isclose(r["applied_lr"], r["lr"] * want, rel_tol=1e-9) for r in outage[1:]), outage


def test_a_replica_restarted_after_the_job_finished_runs_no_user_hook(tmp_path, etcd_endpoint):
    import subprocess
    import sys

    from tests.strategy.runs import SCRIPT

    secret = "late-replica-secret-0123456789"  # the job's: a process of the job proves it (runs are tagged)
    run = lft_run(tmp_path, etcd_endpoint, "--steps", "6", replicas=2, overrides=(f"secret={secret}",))
    assert run.proc.returncode == 0, ok(run)
    job = os.path.basename(run.run_dir)
    env = {**os.environ, "LFT_JOB": job, "LFT_REPLICA_ID": "1", "LFT_NUM_REPLICAS": "2", "LFT_ETCD": etcd_endpoint,
           "LFT_SECRET": secret, "LFT_INCARNATION": "5", "LFT_RUN_DIR": str(tmp_path / "late"),
           "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29655", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    late = subprocess.run([sys.executable, SCRIPT, "--steps", "6"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert late.returncode == 0, late.stderr
    assert "the job already finished" in late.stderr
    assert '{"event": "batch"' not in late.stdout
    assert not os.path.exists(tmp_path / "late" / "replica_1" / "final.json")


def test_should_stop_in_one_replica_stops_every_replica_at_the_same_step(tmp_path, etcd_endpoint):
    run = lft_run(tmp_path, etcd_endpoint, "--steps", "60", "--stop-at", "12", "--stop-replica", "1", replicas=2)
    assert run.proc.returncode == 0, ok(run)
    steps = {f["step"] for f in run.finals.values()}
    assert len(steps) == 1 and 12 < steps.pop() <= 14, run.finals
    assert len({tuple(f["digest"]) for f in run.finals.values()}) == 1
    assert run.ledger.ok
