"""The protocol's scenarios, each a simulated job (lightning_ft/sim/job.py) with the faults it
needs at chosen moments: what the real-process tests of the same claims check (their names are
given), in a fraction of a second each and on every run. The real-process tests keep what only
real processes show: signals, sockets, etcd itself, Lightning, the acceptance programs.

Each asserts the job's verdict (exactly once, identical replicas, an agreed end, liveness) and
what the job decided."""
from __future__ import annotations

from dataclasses import replace

from lightning_ft.sim.faults import Fault
from lightning_ft.sim.job import SimConfig, SimJob
from lightning_ft.sim.net import ModelState

CFG = SimConfig(steps=120)
STEP = CFG.step_s + 0.002  # a step's compute and its exchange


def run(*faults: Fault, cfg: SimConfig = CFG, seed: int = 1) -> SimJob:
    job = SimJob(seed, cfg, tuple(faults))
    v = job.run()
    job.verdict = v  # type: ignore[attr-defined]
    return job


def decided(job: SimJob, name: str) -> list[dict]:
    return [f for _, n, f in job.decisions if n == name]


def test_a_failed_commit_on_one_replica_is_not_trained_twice():
    """tests/replica/test_replica.py::test_partial_completion_is_not_trained_twice"""
    job = run(Fault(30 * STEP, "veto", 1))
    assert job.verdict.ok, job.verdict.violations  # type: ignore[attr-defined]
    assert job.verdict.restarts == 0  # type: ignore[attr-defined]


def test_a_stopped_replica_is_excluded_then_catches_up():
    """tests/replica/test_replica.py::test_sigstopped_replica_is_excluded_then_catches_up_after_sigcont"""
    job = run(Fault(1.0, "hang", 2, seconds=0.8))  # back before the supervisor's grace: no restart
    assert job.verdict.ok and job.verdict.restarts == 0, job.verdict.violations  # type: ignore[attr-defined]
    job = run(Fault(1.0, "hang", 2, seconds=6.0))  # past its grace: killed and restarted
    assert job.verdict.ok and job.verdict.restarts == 1, job.verdict.violations  # type: ignore[attr-defined]


def test_every_replica_down_at_once_rewinds_to_the_newest_checkpoint():
    """tests/strategy/test_rewind.py::test_every_replica_down_at_once_rewinds_to_the_newest_checkpoint"""
    t = 70 * STEP  # after the checkpoint of step 50, before the next
    job = run(Fault(t, "kill", 0, several=(1, 2)))
    assert job.verdict.ok, job.verdict.violations  # type: ignore[attr-defined]
    rewinds = decided(job, "rewind")
    assert [(r["to"], r["checkpoint_step"]) for r in rewinds] == [(50, 50)], rewinds
    assert rewinds[0]["from"] > 50


def test_without_a_checkpoint_a_total_loss_rewinds_to_step_0():
    """tests/strategy/test_rewind.py::test_without_checkpoints_a_total_loss_rewinds_to_step_0_and_says_so"""
    job = run(Fault(35 * STEP, "kill", 0, several=(1, 2)))  # after the full round of step 25 recorded commits
    assert job.verdict.ok, job.verdict.violations  # type: ignore[attr-defined]
    assert [(r["to"], r["checkpoint"]) for r in decided(job, "rewind")] == [(0, "")]
    # before any commit was recorded there is nothing to rewind: the batches of the lost steps were
    # never recorded, so the fresh replicas train them again in the same generation, once
    job = run(Fault(10 * STEP, "kill", 0, several=(1, 2)))
    assert job.verdict.ok and not decided(job, "rewind"), job.verdict.violations  # type: ignore[attr-defined]


def test_a_corrupted_replica_is_detected_healed_and_ends_identical():
    """tests/strategy/test_consistency.py::test_corrupted_replica_is_detected_healed_and_ends_identical"""
    job = run(Fault(30 * STEP, "corrupt", 2))
    assert job.verdict.ok, job.verdict.violations  # type: ignore[attr-defined]
    assert [d["replica"] for d in decided(job, "diverged")] == [2]
    assert not any(m.tainted for m in job.finals.values())


def test_two_replicas_that_disagree_halt_the_job():
    """tests/strategy/test_consistency.py::test_two_replicas_that_disagree_stop_the_job_and_keep_the_verified_checkpoint"""
    job = run(Fault(30 * STEP, "corrupt", 1), cfg=replace(CFG, replicas=2))
    assert job.verdict.ok, job.verdict.violations  # type: ignore[attr-defined]
    halts = decided(job, "halt")
    assert len(halts) == 1 and "no majority" in halts[0]["reason"] and job.finals == {}


def test_members_that_fail_the_last_step_end_with_the_finishers_state():
    """tests/replica/catchup/test_ending.py::test_members_that_fail_to_commit_the_last_step_end_at_it_..."""
    job = run(Fault((CFG.steps - 1) * STEP + 0.02, "veto", 1), Fault((CFG.steps - 1) * STEP + 0.02, "veto", 2))
    assert job.verdict.ok, job.verdict.violations  # type: ignore[attr-defined]
    assert len(job.finals) == 3 and len({(m.step, m.digest) for m in job.finals.values()}) == 1


def test_a_killed_leader_is_excluded_and_its_restart_catches_up():
    """tests/coord/test_coordinator.py::test_sigkilled_leader_is_excluded_within_lease_ttl,
    tests/replica/test_replica.py::test_sigkill_mid_exchange_survivors_continue_and_restarted_replica_catches_up"""
    job = run(Fault(1.03, "kill", 0))
    assert job.verdict.ok and job.verdict.restarts == 1, job.verdict.violations  # type: ignore[attr-defined]


def test_a_late_joiner_is_taken_in_as_lagging_and_nobody_waits():
    """tests/coord/test_coordinator.py::test_late_joiner_is_added_as_lagging_and_nobody_waits"""
    job = run(Fault(0.0, "late", 2, seconds=3.0))
    assert job.verdict.ok, job.verdict.violations  # type: ignore[attr-defined]
    # the job's first round waits init_timeout_s for all R; after that the two trained at full pace
    alone = run()
    assert job.verdict.end_t < alone.verdict.end_t + CFG.init_timeout_s + 0.5  # type: ignore[attr-defined]


def test_a_joiner_with_another_secret_is_refused_and_the_job_goes_on():
    """tests/replica/test_bad_joiners.py,
    tests/coord/test_coordinator.py::test_joiner_with_different_config_is_refused_by_name"""
    job = run(Fault(1.0, "intruder", 1))
    assert job.verdict.ok and job.verdict.restarts == 0, job.verdict.violations  # type: ignore[attr-defined]
    assert job.refused == ["ConfigMismatch"]


def test_a_slow_replica_is_benched_as_a_straggler_and_rejoins_identical():
    """tests/replica/test_stragglers_runs.py::test_a_benched_straggler_stays_out_while_slow_and_is_back_..."""
    job = run(Fault(0.5, "slow", 1, seconds=12.0, factor=5.0))
    assert job.verdict.ok, job.verdict.violations  # type: ignore[attr-defined]
    assert decided(job, "straggler") and decided(job, "straggler")[0]["replica"] == 1
    # a longer job: benched once, out while slow (its probe), back within 5 s of being fast again
    job = run(Fault(0.5, "slow", 1, seconds=12.0, factor=5.0), cfg=replace(CFG, steps=400))
    assert job.verdict.ok, job.verdict.violations  # type: ignore[attr-defined]
    benched = [t for t, n, f in job.decisions if n == "straggler" and f.get("benched") and f["replica"] == 1]
    back = [t for t, n, f in job.decisions if n == "readmitted" and f["replica"] == 1]
    assert len(benched) == 1 and benched[0] < 12.5 and len(back) == 1, job.decisions
    assert 12.5 < back[0] <= 12.5 + 5.0, (benched, back)


def test_a_warm_spare_takes_over_faster_than_a_cold_start():
    """tests/replica/test_standby_runs.py::test_a_promoted_spare_heals_a_killed_replica_and_the_job_ends_identical"""
    job = run(Fault(0.9, "spare", 0), Fault(1.0, "kill", 1))
    assert job.verdict.ok and job.verdict.restarts == 1, job.verdict.violations  # type: ignore[attr-defined]


def test_a_resumed_job_continues_from_its_newest_checkpoint():
    """tests/strategy/test_checkpoint.py (--resume), bench.soak's whole-job kill"""
    job = run(Fault(85 * STEP, "resume", 0))  # the full round of step 75 recorded commits past 50
    assert job.verdict.ok, job.verdict.violations  # type: ignore[attr-defined]
    assert [r["to"] for r in decided(job, "rewind")] == [50]


def test_an_etcd_outage_shorter_than_the_connect_timeout_is_ridden_out():
    """docs/GUIDE.md 'etcd': training pauses and resumes, no replica exits or is dropped"""
    job = run(Fault(1.0, "outage", 0, seconds=5.0))
    assert job.verdict.ok and job.verdict.restarts == 0, job.verdict.violations  # type: ignore[attr-defined]
    assert not decided(job, "rewind")


def test_the_models_start_where_a_resume_puts_them():
    assert ModelState().step == 0 and ModelState(5, 1, 5).applied(5, (), 1.0).step == 6
