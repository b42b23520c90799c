"""bench.goodput --end-to-end: the kill schedule and the time-to-N measure as tables, and a tiny
run of the three jobs (ft_hsdp, restart-the-world, clean DDP) under a real SIGKILL."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lightning_ft.bench.goodput_e2e import ddp_commits, ddp_step_s, kill_steps, lost_steps, time_to_n


@pytest.mark.parametrize("steps,every,offset,want", [
    (1500, 300, 50, [250, 550, 850, 1150, 1450]),  # the default: mid-way between checkpoints
    (1500, 300, 0, [300, 600, 900, 1200]),          # at a step: a checkpoint at the same step loses nothing
    (40, 30, 5, [25]),
    (100, 0, 0, []),
    (10, 30, 5, []),                                # the first kill lies beyond the job
])
def test_kill_steps(steps, every, offset, want):
    assert kill_steps(steps, every, offset) == want


def test_time_to_n_counts_work_as_ett_does():
    # steps 1-4 by 3 of 3 replicas every second, then 5-8 by 2 of 3 (one down): 4 + 4 x 2/3
    commits = [(10.0 + s, s, 1.0) for s in range(1, 5)] + [(14.0 + (s - 4), s, 2 / 3) for s in range(5, 9)]
    t = time_to_n(commits, 6)
    assert t.step_s == 1.0 and t.work == pytest.approx(4 + 8 / 3)
    # the job starts a step before its first commit (10 + 1 - 1 = 10); work 6 is reached at step 7
    assert t.time_to_n_s == pytest.approx((14.0 + 3) - 10.0)
    assert time_to_n(commits, 100).time_to_n_s is None
    assert time_to_n([], 1) == time_to_n([], 1) and time_to_n([], 1).work == 0


def test_a_restart_redoes_the_steps_since_its_checkpoint():
    # launch 0 trains 1..25 and dies; launch 1 resumes at the step-20 checkpoint 8 s later
    rows = [{"t": float(s), "step": s, "launch": 0} for s in range(1, 26)]
    rows += [{"t": 33.0 + (s - 21), "step": s, "launch": 1} for s in range(21, 41)]
    assert lost_steps(rows) == 5 and ddp_step_s(rows) == 1.0
    commits = ddp_commits(rows)
    assert len(commits) == 40 and (33.0, 21, 1.0) in commits  # the redone step counts at its last time
    t = time_to_n(commits, 40)
    assert t.time_to_n_s == pytest.approx((33.0 + 19) - 0.0)  # first commit at 1 s, a step before: 0


def test_end_to_end_bench_trains_n_steps_of_work_in_all_three_jobs(tmp_path):
    """Three tiny jobs, one kill at step 25 of 40 with checkpoints every 10 steps."""
    out = subprocess.run([sys.executable, "-m", "lightning_ft.bench.goodput", "--end-to-end", "--steps", "40",
                          "--kill-every", "30", "--ckpt-every", "10", "--width", "32", "--depth", "1", "--batch", "4",
                          "--timeout", "120"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    jobs = {r["job"]: r for r in rows if r["bench"] == "goodput_e2e_job"}
    (line,) = [r for r in rows if r["bench"] == "goodput_e2e"]
    assert set(jobs) == {"ft", "restart", "clean"} and line["kill_steps"] == [25]
    for job in jobs.values():
        assert job["work"] >= 40 and job["time_to_n_s"] > 0
    ft, rs, clean = jobs["ft"], jobs["restart"], jobs["clean"]
    assert ft["failures"] == 1 and ft["identical"] is True and ft["lost_steps"] == 0
    assert rs["failures"] == 1 and rs["lost_steps"] == 5 and rs["steps"] == 40  # 21..25 trained again
    assert clean["failures"] == 0 and clean["lost_steps"] == 0
    assert line["ft_time_to_n_s"] == pytest.approx(ft["time_to_n_s"], abs=0.01)
    assert line["ft_over_clean"] == pytest.approx(ft["time_to_n_s"] / clean["time_to_n_s"], rel=0.01)
    assert line["restart_over_clean"] == pytest.approx(rs["time_to_n_s"] / clean["time_to_n_s"], rel=0.01)
    # a world restart starts every process again; ft_hsdp's survivors never stopped
    assert line["ft_time_to_n_s"] < line["restart_time_to_n_s"]
