"""A tiny study end to end (`python -m lightning_ft.study`): simulated grid, band, summary and figures,
results reused on a second run; and (slow) a real `lightning-ft run` checked against the simulator."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from lightning_ft.study.config import StudyConfigError, load
from lightning_ft.study.runner import Job, Study, plan

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TINY = ["--d", "16", "--layers", "1", "--experts", "4", "--context", "16", "--batch", "4", "--val-every", "7",
        "--val-windows", "32"]
NONE, SQRT = "d1x_fp32_for3_1reps_lr_none", "d1x_bf16_for3_2reps_lr_sqrt"


def _config(tmp_path, **extra) -> str:
    cfg = {"out": str(tmp_path / "out"), "work_dir": str(tmp_path / "runs"),
           "script": os.path.join(ROOT, "examples", "train_moe.py"), "script_args": TINY, "replicas": 3,
           "steps": 14, "start_step": 5, "window_steps": 10, "seeds": 2, "smooth_steps": 3, "jobs": 1,
           "settings": [NONE, SQRT], **extra}
    path = tmp_path / "study.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return str(path)


def test_plan_runs_real_first_then_every_baseline_seed_of_each_precision_then_replays(tmp_path):
    cfg = load(_config(tmp_path, real={"settings": [NONE]}))
    assert [j.key for j in plan(cfg)] == [
        f"{NONE}.real.s0", "baseline_fp32.sim.s0", "baseline_fp32.sim.s1", "baseline_bf16.sim.s0",
        "baseline_bf16.sim.s1", f"{NONE}.sim.s0", f"{SQRT}.sim.s0", f"{NONE}.replay.s0"]


@pytest.mark.parametrize("override, message", [
    ("seeds=1", "at least 2 baseline seeds"),
    ("start_step=20", "start_step=20 must be between"),
    ("settings=[d1x_fp32_for3_3reps_lr_none]", "leaves nobody to train"),
    ("settings=[d1x_fp32_for30_1reps_lr_none]", "no failure fits"),
    ("settings=[d1x_fp8_for3_1reps_lr_none]", "is not of the form"),
])
def test_bad_study_configs_are_refused_with_the_reason(tmp_path, override, message):
    with pytest.raises(StudyConfigError, match=message):
        load(_config(tmp_path), [override])


def test_tiny_grid_end_to_end_writes_the_table_and_figures_and_reuses_results(tmp_path):
    path = _config(tmp_path)
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "lightning_ft.study", path], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert time.monotonic() - t0 < 150
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["eval.png", "loss.png", "results", "summary.md", "zoom.png"]
    text = (out / "summary.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \| (\w+) \| ([^|]+) \| ([0-9.]+)", text, re.M)
    assert sorted((n, s) for n, s, _, _ in rows) == sorted([("baseline_bf16", "sim"), ("baseline_fp32", "sim"),
                                                           (NONE, "sim"), (SQRT, "sim")])
    down = {n: d.strip() for n, _, d, _ in rows}
    assert down[NONE] == "3" and down[SQRT] == "3"        # the nominal schedule: exactly len steps down
    results = {p.name: json.loads(p.read_text()) for p in (out / "results").iterdir()}
    assert sorted(results) == sorted(f"{k}.json" for k in (
        "baseline_fp32.sim.s0", "baseline_fp32.sim.s1", "baseline_bf16.sim.s0", "baseline_bf16.sim.s1",
        f"{NONE}.sim.s0", f"{SQRT}.sim.s0"))
    base0, base1 = results["baseline_fp32.sim.s0.json"], results["baseline_fp32.sim.s1.json"]
    assert len(base0["train_loss"]) == 14 and base0["train_loss"] != base1["train_loss"]   # seeds differ
    assert base0["train_loss"][-1] < base0["train_loss"][0] - 0.2                          # it learns
    # identical to its baseline until the first failure (step 5: fewer slot batches in the mean)
    none = results[f"{NONE}.sim.s0.json"]
    assert none["train_loss"][:5] == base0["train_loss"][:5] and none["train_loss"][5] != base0["train_loss"][5]
    assert [len(b) for b in none["batches"][4:9]] == [3, 2, 2, 2, 3]
    # the summary's final train loss is the run's smoothed last value
    final = {n: float(v) for n, _, _, v in rows}
    assert final[NONE] == pytest.approx(sum(none["train_loss"][-3:]) / 3, abs=5e-4)
    # a second study reuses every result (same spec and script), so it trains nothing
    logs: list[str] = []
    again = Study(load(path), log=logs.append)
    t1 = time.monotonic()
    again.run()
    assert time.monotonic() - t1 < 5
    assert sum("cached" in m for m in logs) == 6
    assert again.results[Job(NONE, "sim").key]["train_loss"] == none["train_loss"]


@pytest.mark.slow
def test_real_run_with_sigkills_matches_its_simulator_replay(tmp_path):
    """A real `lightning-ft run` (3 replicas, one SIGKILLed and kept down) against the simulator's
    replay of its ledger: the same curves within the study's tolerance."""
    path = _config(tmp_path, steps=30, start_step=8, settings=[NONE], real={"settings": [NONE], "timeout_s": 400})
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "lightning_ft.study", path], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    text = (tmp_path / "out" / "summary.md").read_text()
    m = re.search(rf"^\| `{NONE}` \| ([0-9.e+-]+) \| ([0-9.e+-]+) \| yes \|$", text, re.M)
    assert m, text
    assert float(m[1]) <= 0.01 and float(m[2]) <= 0.01
    real = json.loads((tmp_path / "out" / "results" / f"{NONE}.real.s0.json").read_text())
    assert any(len(c) == 2 for c in real["contributors"])         # a replica really was down
    assert (tmp_path / "out" / "wallclock.png").stat().st_size > 10_000
