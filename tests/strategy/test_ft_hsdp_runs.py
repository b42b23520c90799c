"""`Trainer(strategy="ft_hsdp")` end to end: real replica processes under `lightning-ft run`,
SIGKILLed and restarted, against a real etcd. Invariants checked (docs/ARCHITECTURE.md, "A step"): replicas end
bitwise identical, the exactly-once ledger is complete, Lightning's counters and LR
schedules are counted once per committed step."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.strategy.runs import SCRIPT, lft_run, ok

KILL_1_AT_5 = "failure.events=[{replica: 1, step: 5, kind: kill}]"


def sched_lr(step: int) -> float:
    """StepLR(step_size=3, gamma=0.5) from lr 0.01 after `step` scheduler steps."""
    return 0.01 * 0.5 ** (step // 3)


def test_kill_and_rejoin_w1_identical_ledger_and_sqrt_lr(tmp_path, etcd_endpoint):
    steps = 70
    run = lft_run(tmp_path, etcd_endpoint, "--steps", str(steps), "--degraded-sleep", "0.5", "--steplr",
                  "--lr-mode", "sqrt", overrides=(KILL_1_AT_5,))
    assert run.proc.returncode == 0, ok(run)
    assert [(e["event"], e["replica"]) for e in run.events if e["event"] in ("evict", "restart")] == [
        ("evict", 1), ("restart", 1)], ok(run)
    # bitwise-identical replicas, every step committed once
    assert set(run.finals) == {0, 1}
    assert run.finals[0]["digest"] == run.finals[1]["digest"], ok(run)
    assert run.finals[0]["step"] == run.finals[1]["step"] == steps
    # exactly once: each slot's batches 0..cursor-1 trained once, no conflicts
    assert run.ledger.ok, (run.ledger.duplicates, run.ledger.gaps, run.ledger.conflicts)
    assert run.ledger.steps == steps
    assert len(run.ledger.trained[0]) == steps and 5 <= len(run.ledger.trained[1]) < steps
    # Lightning's global_step advances by one per committed step on the healthy replica
    r0 = run.replica_rows(0)
    assert [r["step"] for r in r0] == list(range(1, steps + 1))
    # the scheduler is stepped once per step (no compounding with the LR factor) ...
    for r in r0:
        assert r["lr"] == pytest.approx(sched_lr(r["step"]), rel=1e-9), r
        # ... and the optimizer stepped with lr * sqrt(healthy / total)
        f = math.sqrt(len(r["contributors"]) / 2)
        assert r["lr_factor"] == pytest.approx(f)
        assert r["applied_lr"] == pytest.approx(sched_lr(r["step"] - 1) * f, rel=1e-9), r
    outage = [r for r in r0 if r["contributors"] == [0]]
    assert outage and r0[0]["contributors"] == [0, 1] and r0[-1]["contributors"] == [0, 1]
    # the restarted replica resumed mid-run with the healthy replica's schedule
    back = run.rows[(1, 1)]
    assert back[0]["step"] > 6 and back[-1]["step"] == steps
    assert all(r["lr"] == pytest.approx(sched_lr(r["step"]), rel=1e-9) for r in back)
    # it trained its slot from where the killed incarnation stopped
    assert run.rows[(1, 0)][-1]["batch"] + 1 == back[0]["batch"]
    # its start-up in parts, through Lightning (issue 25 §2): forked from the zygote, which had
    # imported torch and Lightning, so the parts start at the script
    (bd,) = [e for e in run.events if e["event"] == "restart_breakdown"]
    assert (bd["replica"], bd["incarnation"], bd.get("zygote")) == (1, 1, True), bd
    assert list(bd["parts"]) == ["script", "setup", "registered", "caught_up", "first_step"], bd
    assert all(v >= 0 for v in bd["parts"].values()) and bd["total_s"] > 0


def test_a_rejoining_replica_clips_its_catch_up_step_like_the_contributors(tmp_path, etcd_endpoint):
    """Lightning's gradient clipping on the averaged gradients (`_after_closure`) applies to a
    catch-up's optimizer step too (`_clip_catchup`, no user hooks): before, the rejoined replica
    applied them unclipped and ended with other weights. 1e-4 always binds."""
    steps = 40
    run = lft_run(tmp_path, etcd_endpoint, "--steps", str(steps), "--degraded-sleep", "0.5", "--clip", "1e-4",
                  overrides=(KILL_1_AT_5,))
    assert run.proc.returncode == 0, ok(run)
    assert ("restart", 1) in [(e["event"], e["replica"]) for e in run.events], ok(run)
    assert run.rows.get((1, 1)), ok(run)  # the restarted incarnation trained after its catch-up
    assert run.finals[0]["step"] == run.finals[1]["step"] == steps
    assert run.finals[0]["digest"] == run.finals[1]["digest"], ok(run)
    assert run.ledger.ok and run.ledger.steps == steps


def test_fsdp2_w2_accumulation_kill_and_rejoin(tmp_path, etcd_endpoint):
    steps = 40
    run = lft_run(tmp_path, etcd_endpoint, "--steps", str(steps), "--degraded-sleep", "0.8", "--accumulate", "2",
                  nproc=2, overrides=(KILL_1_AT_5, "checkpoint.every_n_steps=10"))
    assert run.proc.returncode == 0, ok(run)
    # sharded checkpoints by the lowest-id contributor: one file per rank, manifests verify
    from lightning_ft.replica import checkpoint as ck

    root = os.path.join(run.run_dir, "checkpoints")
    assert ck.list_steps(root) == [20, 30, 40]  # keep=3
    for step in (20, 30, 40):
        files = ck.verify(ck.step_dir(root, step))["files"]
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.json", "extra.pt"} <= set(files)
    assert run.finals[0]["digest"] == run.finals[1]["digest"], ok(run)
    assert len(run.finals[0]["digest"]) == 2 and run.finals[0]["digest"][0] != run.finals[0]["digest"][1], \
        "each rank holds a different FSDP2 shard"
    assert run.ledger.ok and run.ledger.steps == steps, run.ledger
    assert ("restart", 1) in [(e["event"], e["replica"]) for e in run.events]


def test_accumulation_retry_gives_the_same_result_as_no_failure(tmp_path, etcd_endpoint):
    args = ("--steps", "14", "--accumulate", "2")
    clean = lft_run(tmp_path, etcd_endpoint, *args)
    retried = lft_run(tmp_path, etcd_endpoint, *args, "--fail-commit-at", "6")
    for run in (clean, retried):
        assert run.proc.returncode == 0, ok(run)
        assert run.finals[0]["digest"] == run.finals[1]["digest"], ok(run)
        assert run.ledger.ok and run.ledger.steps == 14
    # both replicas voted "failed" at step 6: the step was retried from the saved local
    # gradient shards, and the result is bitwise the one without the failure
    assert retried.finals[0]["digest"] == clean.finals[0]["digest"]
    # only replica 0 fails its commit: replica 1 commits with replica 0's gradient, replica 0
    # catches up and does not train that batch again
    alone = lft_run(tmp_path, etcd_endpoint, *args, "--fail-commit-at", "6", "--fail-replicas", "0")
    assert alone.proc.returncode == 0, ok(alone)
    assert alone.finals[0]["digest"] == alone.finals[1]["digest"], ok(alone)
    assert alone.ledger.ok and alone.ledger.steps == 14, alone.ledger
    # replica 0's call for batch 6 ended with the catch-up step 7: Lightning's step jumps 6 -> 8
    # (rows are per micro-batch: global_step after each of them)
    assert sorted({r["step"] for r in alone.replica_rows(0)}) == [*range(0, 7), *range(8, 15)]
    assert sorted({r["step"] for r in alone.replica_rows(1)}) == list(range(0, 15))


def test_manual_optimization_kill_and_rejoin(tmp_path, etcd_endpoint):
    steps = 50
    run = lft_run(tmp_path, etcd_endpoint, "--steps", str(steps), "--degraded-sleep", "0.5", "--manual", "--steplr",
                  overrides=(KILL_1_AT_5,))
    assert run.proc.returncode == 0, ok(run)
    assert run.finals[0]["digest"] == run.finals[1]["digest"], ok(run)
    assert run.ledger.ok and run.ledger.steps == steps
    assert [r["step"] for r in run.replica_rows(0)] == list(range(1, steps + 1))
    assert all(r["lr"] == pytest.approx(sched_lr(r["step"]), rel=1e-9) for r in run.replica_rows(1))


def test_matches_lightning_ddp_without_failures(tmp_path, etcd_endpoint):
    steps = 12
    ft = lft_run(tmp_path, etcd_endpoint, "--steps", str(steps))
    assert ft.proc.returncode == 0, ok(ft)
    ddp = subprocess.run([sys.executable, SCRIPT, "--steps", str(steps), "--ddp", "2"], capture_output=True,
                         text=True, timeout=180, cwd=str(tmp_path))
    assert ddp.returncode == 0, ddp.stdout[-2000:] + ddp.stderr[-2000:]
    ddp_loss = [json.loads(l)["loss"] for l in ddp.stdout.splitlines() if l.startswith('{"event": "batch"')]
    ft_loss = [r["loss"] for r in ft.replica_rows(0)]
    assert len(ddp_loss) == len(ft_loss) == steps
    assert ft_loss == pytest.approx(ddp_loss, rel=1e-4, abs=1e-6)


def test_injected_exception_then_hang_through_lightning(tmp_path, etcd_endpoint):
    """FailureInjector's other kinds: an exception (exit 1) in incarnation 0, then a SIGSTOP hang
    in incarnation 1, which the launcher detects by the lapsed lease and restarts."""
    steps = 60
    run = lft_run(tmp_path, etcd_endpoint, "--steps", str(steps), "--degraded-sleep", "0.5", overrides=(
        "failure.events=[{replica: 1, step: 4, kind: exception}, {replica: 1, step: 8, kind: hang}]",))
    assert run.proc.returncode == 0, ok(run)
    ev = [(e["event"], e["replica"], e["incarnation"]) for e in run.events]
    assert ("exit", 1, 0) in ev and ("hang", 1, 1) in ev and ("restart", 1, 2) in ev, ev
    assert "InjectedFailure: injected exception in replica 1" in run.log(1, 0)
    assert run.finals[0]["digest"] == run.finals[1]["digest"], ok(run)
    assert run.finals[1]["incarnation"] == 2
    assert run.ledger.ok and run.ledger.steps == steps


def test_a_warm_spare_takes_over_a_killed_lightning_replica(tmp_path, etcd_endpoint):
    """`supervisor.standby=1` with a Lightning program: the spare runs the script up to the
    strategy's setup and waits; when replica 1 is killed it becomes replica 1 incarnation 1
    (loggers, step log and final.json under replica_1), catches up and trains to the end,
    identical, exactly once."""
    steps = 60
    run = lft_run(tmp_path, etcd_endpoint, "--steps", str(steps), "--step-sleep", "0.25",
                  overrides=("failure.events=[{replica: 1, step: 40, kind: kill}]", "supervisor.standby=1"))
    assert run.proc.returncode == 0, ok(run)
    spare = [e["token"] for e in run.events if e["event"] == "spare_start"][0]
    (restart,) = [e for e in run.events if e["event"] == "restart"]
    assert (restart["replica"], restart["incarnation"], restart.get("standby")) == (1, 1, spare), ok(run)
    back = run.rows[(1, 1)]
    assert back[0]["step"] > 40 and back[-1]["step"] == steps, back[:2]
    assert run.rows[(1, 0)][-1]["batch"] + 1 == back[0]["batch"]
    (bd,) = [e for e in run.events if e["event"] == "restart_breakdown"]
    assert bd["standby"] is True and list(bd["parts"]) == ["registered", "caught_up", "first_step"], bd
    assert run.finals[0]["digest"] == run.finals[1]["digest"] and run.finals[1]["step"] == steps, ok(run)
    assert run.ledger.ok and run.ledger.steps == steps
