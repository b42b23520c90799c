"""The soak at small size (`make soak` runs 100+ faults): mixed, overlapping faults at random
moments, including a whole-job kill with `--resume` and an etcd leader kill; nothing lost,
nothing trained twice, identical replicas, no stall."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from lightning_ft.bench import netns


@pytest.mark.timeout(900)
def test_ten_mixed_faults_lose_nothing_and_end_identical():
    # The job stops 60 steps after the last fault (--tail-steps; --steps is only a ceiling): at a
    # fixed 1200 steps, an idle machine trained them before 6 of the 10 faults had landed.
    cmd = [sys.executable, "-m", "lightning_ft.bench.soak", "--faults", "10", "--every-s", "1.0", "--overlap", "0.3",
           "--seed", "4", "--steps", "20000", "--tail-steps", "60", "--ckpt-every", "20", "--timeout", "800"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=880)
    lines = [json.loads(l) for l in p.stdout.splitlines() if l.startswith('{"bench": "soak"')]
    assert lines, p.stdout[-3000:] + p.stderr[-6000:]
    r = lines[-1]
    assert r["faults"] >= 10 and r["overlapping"] >= 1, (r, p.stderr[-4000:])
    assert r["lost_batches"] == 0 and r["duplicate_batches"] == 0 and r["conflicts"] == 0, (r, p.stderr[-4000:])
    assert r["identical"] and r["hangs"] == 0 and r["launcher_rc"] == 0 and not r["timed_out"], (r, p.stderr[-4000:])
    assert set(r["heals"]) == {"disowned", "stale", "diverged"}, r
    assert r["at_end"] >= 2, r  # a majority trained to the end (a late restart may find the job done)
    assert r["steps"] == r["final_step"] < 20000, r  # the ledger holds every step of the final history, and
    # the job stopped after its tail
    if netns.skip_reason() is None:
        assert r["by_kind"].get("link", 0) >= 1, r  # a replica's network link was cut
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.mark.timeout(180)
def test_a_job_that_outlives_the_timeout_is_reported_killed_and_cleaned_up():
    """The soak's own deadline: it says where each replica stood, kills the job by PID, and still
    prints its line (timed_out, exit 1) instead of a traceback with the job left running."""
    cmd = [sys.executable, "-m", "lightning_ft.bench.soak", "--faults", "1", "--kinds", "kill", "--steps", "100000",
           "--tail-steps", "0", "--timeout", "9", "--seed", "0"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    lines = [json.loads(l) for l in p.stdout.splitlines() if l.startswith('{"bench": "soak"')]
    assert lines and lines[-1]["timed_out"] is True, p.stdout[-2000:] + p.stderr[-3000:]
    assert p.returncode == 1
    assert "did not finish within --timeout 9 s; last rows:" in p.stderr, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    kept = re.search(r"its run directory is kept at (\S+) ", p.stderr)
    assert kept and os.path.isdir(kept.group(1)), p.stderr[-3000:]  # a failed soak keeps what went wrong
    shutil.rmtree(os.path.dirname(kept.group(1)), ignore_errors=True)
    ps = subprocess.run(["pgrep", "-f", "examples/train_lm.py --steps 100000"], capture_output=True, text=True)
    assert ps.stdout.strip() == "", f"replica processes left running: {ps.stdout}"


def test_the_soak_counts_each_guard_that_fired_from_the_events(tmp_path):
    from lightning_ft.bench.soak_parts import heals

    rows = [{"event": "disowned", "replica": 1}, {"event": "stale", "replica": 2}, {"event": "stale", "replica": 1},
            {"event": "restart", "replica": 0}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"event": "trunc')
    assert heals(str(tmp_path)) == {"disowned": 1, "stale": 2, "diverged": 0}
    assert heals(str(tmp_path / "none")) == {"disowned": 0, "stale": 0, "diverged": 0}


@pytest.mark.timeout(300)
def test_a_job_that_halts_ends_the_soak_with_its_reason():
    """Two replicas whose states disagree (one corrupted, no majority) halt the job: the launcher
    exits 86, and the soak stops injecting, prints its line with the halt and fails, instead of
    throwing faults at a dead job until its deadline."""
    cmd = [sys.executable, "-m", "lightning_ft.bench.soak", "--faults", "50", "--kinds", "kill", "--replicas", "2",
           "--every-s", "2", "--steps", "100000", "--timeout", "250", "--seed", "0",
           "--set", "failure.events=[{replica: 1, step: 30, kind: corrupt}]"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=290)
    lines = [json.loads(l) for l in p.stdout.splitlines() if l.startswith('{"bench": "soak"')]
    assert lines, p.stdout[-2000:] + p.stderr[-3000:]
    r = lines[-1]
    assert r["halted"] is True and "no majority agrees" in r["halt_reason"], (r, p.stderr[-3000:])
    assert r["launcher_rc"] == 86 and not r["timed_out"] and r["wall_s"] < 200, (r, p.stderr[-3000:])
    assert p.returncode == 1
    kept = re.search(r"its run directory is kept at (\S+) ", p.stderr)
    assert kept, p.stderr[-3000:]
    shutil.rmtree(os.path.dirname(kept.group(1)), ignore_errors=True)


def test_the_soak_reads_a_halt_from_the_events(tmp_path):
    from lightning_ft.bench.soak_parts import halt_reason

    assert halt_reason(str(tmp_path)) == ""
    rows = [{"event": "restart", "replica": 0}, {"event": "halt", "reason": "replica states diverged at step 40"}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"event": "trunc')
    assert halt_reason(str(tmp_path)) == "replica states diverged at step 40"
