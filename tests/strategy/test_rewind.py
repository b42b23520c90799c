"""No fault pattern loses training (docs/ARCHITECTURE.md, "Rewinds"): when every replica is
down at once the job rewinds to its newest checkpoint by itself, the superseded commits
are marked, and the final history is exactly once; a crash loop ends with its cause."""
from __future__ import annotations


from tests.strategy.runs import lft_run, ok

ALL_DIE_AT_25 = "failure.events=[{replica: 0, step: 25, kind: kill}, {replica: 1, step: 25, kind: kill}]"


def test_every_replica_down_at_once_rewinds_to_the_newest_checkpoint(tmp_path, etcd_endpoint):
    steps = 40
    run = lft_run(tmp_path, etcd_endpoint, "--steps", str(steps), "--steplr", "--unseeded", replicas=2,
                  overrides=(ALL_DIE_AT_25, "checkpoint.every_n_steps=10"))
    assert run.proc.returncode == 0, ok(run)
    rewinds = [e for e in run.events if e["event"] == "rewind"]
    assert len(rewinds) == 1, run.events
    rw = rewinds[0]
    # The checkpoint of step 20 is written in the background: when both die at 25 before it is
    # on disk (a loaded machine), the newest one that verifies is step 10's.
    # "from" is the newest step the ledger recorded: commits of steady rounds are buffered and
    # written before the next full round, so the last ones before the kill may be unrecorded
    # (CI: from 23 with a kill at 25).
    assert rw["to"] in (10, 20) and rw["to"] <= rw["from"] <= 25, rw
    assert rw["checkpoint"].endswith(f"step_{rw['to']:08d}"), rw
    # every replica ends at max_steps, identical, and the final history trains each batch once
    assert {f["step"] for f in run.finals.values()} == {steps}, run.finals
    assert len({tuple(f["digest"]) for f in run.finals.values()}) == 1, run.finals
    led = run.ledger
    # Commits after the checkpoint are superseded, or were never recorded (steady rounds record
    # in batches; both replicas died with theirs): either way the final history is exact.
    assert led.ok and led.steps == steps, led
    assert [r["to"] for r in led.rewinds] == [rw["to"]]
    # the restarted replicas trained from the checkpoint's next step with its schedule (StepLR)
    back = run.rows[(0, 1)]
    first = rw["to"] + 1
    assert back[0]["step"] == first, back[:3]
    assert back[0]["lr"] == 0.01 * 0.5 ** (first // 3)


def test_without_checkpoints_a_total_loss_rewinds_to_step_0_and_says_so(tmp_path, etcd_endpoint):
    # Killed at step 40: past the first recorded steady round (one in RECORD_EVERY = 32), so the
    # ledger holds commits that the total loss takes away. (Killed before any record, the job
    # restarts from step 0 in the same generation: nothing recorded was lost, no rewind.)
    run = lft_run(tmp_path, etcd_endpoint, "--steps", "50", replicas=2,
                  overrides=(ALL_DIE_AT_25.replace("25", "40"), "checkpoint.every_n_steps=0"))
    assert run.proc.returncode == 0, ok(run)
    rw = [e for e in run.events if e["event"] == "rewind"]
    assert len(rw) == 1 and rw[0]["to"] == 0 and rw[0]["checkpoint"] == "", rw
    assert run.ledger.ok and run.ledger.steps == 50 and {f["step"] for f in run.finals.values()} == {50}


def test_crash_loop_is_not_restarted_and_names_the_cause(tmp_path, etcd_endpoint):
    # Replica 1's three failures take about 0.6 s here (every start forks from the zygote); replica
    # 0 trains its 30 steps in 9 s or more.
    run = lft_run(tmp_path, etcd_endpoint, "--steps", "30", "--step-sleep", "0.3", "--exit-before-training", "1",
                  replicas=2, overrides=("quorum.init_timeout_s=3",))
    out = run.proc.stdout
    assert "replica 1 failed 3 times in a row with exit code 1 before committing any step" in out, ok(run)
    assert "a typo in user code" in out  # the log tail
    restarts = [e for e in run.events if e["event"] == "restart" and e["replica"] == 1]
    assert len(restarts) == 2, run.events
    assert run.finals[0]["step"] == 30  # replica 0 trained on alone (min_replicas=1)
    assert run.proc.returncode == 1  # a replica was given up on


def test_crash_loop_below_min_replicas_stops_the_job(tmp_path, etcd_endpoint):
    run = lft_run(tmp_path, etcd_endpoint, "--steps", "200", "--step-sleep", "0.05", "--exit-before-training", "1",
                  replicas=2, overrides=("quorum.init_timeout_s=2", "min_replicas=2"))
    out = run.proc.stdout
    assert "fewer than min_replicas=2; stopping the job" in out, ok(run)
    assert run.proc.returncode != 0
    assert 0 not in run.finals
