"""Warm standby with real processes (coord/standby.py, issue 25 §1): a spare of the plain loop
waits registered, is promoted when a replica is SIGKILLed mid-exchange, catches up and
trains; the job ends identical with an exact ledger. A spare with another secret is refused,
and a spare never needed leaves when the job finishes."""
from __future__ import annotations

import time

import pytest

from lightning_ft.bench.localjob import TEST_SECRET
from lightning_ft.coord import keys
from tests.replica.test_replica import SMALL, assert_exactly_once, assert_identical_every_step


@pytest.mark.timeout(300)
def test_a_promoted_spare_heals_a_killed_replica_and_the_job_ends_identical(job_factory, tmp_path):
    stop = str(tmp_path / "STOP")  # once the promoted spare trains, the job stops at a step all agree on
    job = job_factory(args=SMALL + ("--steps", "400", "--step-sleep", "0.02", "--stop-file", stop),
                      extra={(1, 0): ["--kill-in-exchange-at", "60"]})
    job.start_all()
    spare = job.start_spare("s0")
    job.wait_spare("s0", 120)
    assert spare.wait_for(lambda x: x.get("event") == "standby", 5)["token"] == "s0"
    # it waits: it neither trains nor registers as a replica
    assert not [x for x in spare.rows if x.get("event") == "step"]
    job.wait_exit(1, timeout_s=120)
    t_kill = time.time()
    job.replicas[1].kill()
    job.evict(1, "rank 0 exited with -9")
    assert job.promote("s0", 1) is spare and (spare.rid, spare.inc) == (1, 1)
    first = spare.wait_for(lambda x: x.get("event") == "step", 60)
    heal_s = first["t"] - t_kill
    assert first["rid"] == 1 and first["inc"] == 1 and first["lag"], first
    # promoted, not started: the spare's start-up is not on the heal path
    bd = spare.wait_for(lambda x: x.get("event") == "restart_breakdown", 5)
    assert bd["standby"] is True and list(bd["parts"]) == ["registered", "caught_up", "first_step"], bd
    print({"heal_standby_s": round(heal_s, 3), "breakdown": bd["parts"]})
    assert heal_s < 10.0, heal_s  # the bench measures it (bench.recovery); here: it heals at all, warm
    assert job.store.get(keys.standby(job.root, "s0")) is None  # no longer a spare
    spare.wait_for(lambda x: x.get("event") == "step" and x["role"] == "train", 60)
    open(stop, "w").close()
    job.wait_done(240)
    assert_identical_every_step(job)
    assert_exactly_once(job)


@pytest.mark.timeout(180)
def test_a_spare_with_another_secret_is_refused_and_one_never_needed_leaves_at_the_end(job_factory, tmp_path):
    # 300 steps at most (9 s or more): the spares fork from the session zygote and register within a
    # second or two; once both are judged, the job stops at a step all agree on
    stop = str(tmp_path / "STOP")
    job = job_factory(args=SMALL + ("--steps", "300", "--step-sleep", "0.02", "--stop-file", stop))
    job.start_all()
    job.replicas[0].wait_for(lambda x: x.get("event") == "step", 120)
    wrong = job.start_spare("bad", env={"LFT_SECRET": TEST_SECRET[::-1]})
    good = job.start_spare("ok")
    job.wait_spare("ok", 120)
    deadline = time.monotonic() + 120
    while wrong.alive():
        assert time.monotonic() < deadline, "the wrong-secret spare kept waiting"
        time.sleep(0.05)
    assert wrong.procs[0].returncode != 0
    with open(f"{job.log_dir}/spare-bad.rank0.log") as f:
        assert "another secret" in f.read()
    assert job.store.get(keys.standby(job.root, "bad")) is None
    open(stop, "w").close()
    job.wait_done(180)
    assert good.procs[0].wait(60) == 0  # the job finished: the spare is not needed
    assert good.wait_for(lambda x: x.get("event") == "finished_already", 5)
    assert_identical_every_step(job)
    assert_exactly_once(job)
