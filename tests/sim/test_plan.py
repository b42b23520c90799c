"""`lightning-ft plan`: inputs and their sources, measured inputs from run directories whose
times are known exactly, the JSON and text output, and plan.png."""
from __future__ import annotations

import argparse
import json
import os

import pytest

from lightning_ft.launch.cli import main as cli
from lightning_ft.sim import plan
from lightning_ft.sim.goodput import goodput

T0 = 1_000_000.0
STEP = 0.5


def _write(d, events, rows_by_rid, config=None):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "events.jsonl"), "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    for rid, rows in rows_by_rid.items():
        os.makedirs(os.path.join(d, f"replica_{rid}"), exist_ok=True)
        with open(os.path.join(d, f"replica_{rid}", "steps.jsonl"), "w") as f:
            f.writelines(json.dumps({"rid": rid, "loss": 1.0, "caught_up": False, "call_s": STEP, **r}) + "\n"
                         for r in rows)
    if config:
        with open(os.path.join(d, "config.yaml"), "w") as f:
            f.write(config)


def ft_run(d):
    """3 replicas x 2 processes; replica 1 is SIGKILLed after step 20 (evicted 0.2 s later),
    the others stall 1 s, replica 1 restarts and its catch-up step (1.5 s) ends 8 s after the kill."""
    tk = T0 + 20 * STEP + 0.1
    t_back = tk + 8.0
    events = [{"t": T0 - 1, "event": "start", "replica": r, "incarnation": 0} for r in range(3)]
    events += [{"t": tk, "event": "exit", "replica": 1, "incarnation": 0, "code": -9},
               {"t": tk + 0.2, "event": "evict", "replica": 1, "incarnation": 0, "reason": "rank 0 exited with -9"},
               {"t": tk + 1.0, "event": "restart", "replica": 1, "incarnation": 1}]
    rows = {0: [], 1: [], 2: []}
    for s in range(1, 81):
        t = T0 + s * STEP + (1.0 if s > 20 else 0.0)  # the 1 s stall right after the kill
        down = tk < t < t_back
        contrib = [0, 2] if tk < t <= t_back else [0, 1, 2]
        extra = {"ckpt_stage_ms": 5.0, "call_s": STEP + 0.1} if s % 10 == 0 else {}
        for r in (0, 2):
            rows[r].append({"t": t, "inc": 0, "step": s, "contributors": contrib, **extra})
        if not down:
            inc = 1 if t >= t_back else 0
            first_back = inc == 1 and not any(x["inc"] == 1 for x in rows[1])
            if first_back:
                rows[1].append({"t": t_back, "inc": 1, "step": s, "contributors": [0, 2], "caught_up": True,
                                "call_s": 1.5})
            elif inc == 1 or t <= tk:
                rows[1].append({"t": t, "inc": inc, "step": s, "contributors": contrib, **extra})
    _write(d, events, rows, "replicas: 3\nnproc_per_replica: 2\ncheckpoint:\n  every_n_steps: 10\n")
    return tk, t_back


def world_run(d):
    """2 replicas restart the world: replica 1 dies after step 30 (evicted 0.1 s later), the
    checkpoint is at step 20; everyone is back at step 21 committed 6 s after the kill."""
    tk = T0 + 30 * STEP + 0.1
    events = [{"t": T0 - 1, "event": "start", "replica": r, "incarnation": 0} for r in range(2)]
    events += [{"t": tk, "event": "exit", "replica": 1, "incarnation": 0, "code": -9},
               {"t": tk + 0.1, "event": "evict", "replica": 1, "incarnation": 0, "reason": "rank 0 exited with -9"},
               {"t": tk + 0.12, "event": "evict", "replica": 0, "incarnation": 0,
                "reason": "world restart after replica 1 failed"},
               {"t": tk + 0.13, "event": "world_stop", "replica": 0, "incarnation": 0},
               {"t": tk + 2.0, "event": "world_restart", "replica": 0, "incarnation": 0, "step": 20},
               {"t": tk + 2.0, "event": "restart", "replica": 0, "incarnation": 1},
               {"t": tk + 2.0, "event": "restart", "replica": 1, "incarnation": 1}]
    rows = {r: [{"t": T0 + s * STEP, "inc": 0, "step": s, "contributors": [0, 1]} for s in range(1, 31)]
            for r in (0, 1)}
    for r in (0, 1):
        rows[r] += [{"t": tk + 6.0 + (s - 21) * STEP, "inc": 1, "step": s, "contributors": [0, 1]}
                    for s in range(21, 61)]
    _write(d, events, rows)
    return tk


def test_measure_run_reads_every_time_of_an_ft_run(tmp_path):
    tk, t_back = ft_run(str(tmp_path))
    m = plan.measure_run(str(tmp_path))
    assert m["mode"] == "ft" and m["failures"] == 1 and m["replicas"] == 3 and m["gpus"] == 6
    assert m["step_s"] == pytest.approx(STEP) and m["ckpt_every"] == 10
    assert m["detect_s"] == pytest.approx(0.2)
    assert m["catchup_s"] == pytest.approx(1.5)
    assert m["restart_s"] == pytest.approx(8.0 - 0.2 - 1.5)
    assert m["stall_s"] == pytest.approx(1.0, abs=1e-6)
    assert m["ckpt_cost_s"] == pytest.approx(0.1)
    assert m["degraded_step_s"] == pytest.approx(STEP)  # the survivors kept their pace
    wall = (T0 + 80 * STEP + 1.0) - (T0 + STEP) + STEP
    assert m["mtbf_job_s"] == pytest.approx(wall)


def test_measure_run_reads_a_world_restart(tmp_path):
    world_run(str(tmp_path))
    m = plan.measure_run(str(tmp_path))
    assert m["mode"] == "restart" and m["failures"] == 1  # the healthy replica's eviction is no failure
    assert m["detect_s"] == pytest.approx(0.1)
    assert m["rollback_steps"] == 10  # steps 21..30 trained twice
    assert m["world_restart_s"] == pytest.approx(6.0 - 0.1 - STEP)
    mode, inp, ett = plan.predict_run(str(tmp_path))
    assert mode == "restart" and ett == pytest.approx(goodput(inp).restart_ett)
    lost = 0.1 + (6.0 - 0.1 - STEP) + 10 * STEP  # = the time from the kill until step 30 is done again
    assert goodput(inp).restart_lost_s == pytest.approx(lost)
    assert lost == pytest.approx(6.0 + 9 * STEP)


def test_cli_paper_preset_json(capsys):
    assert cli(["plan", "--preset", "paper", "--json", "--no-png"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["restart_ett"] == pytest.approx(0.4444, abs=1e-4) and out["ft_ett"] == pytest.approx(0.8009, abs=1e-4)
    assert out["gpus"] == 98304 and out["replicas"] == 12 and out["recommended_replicas"] == 32
    assert out["sources"]["stall_s"] == "preset paper"


def test_flags_override_the_preset_and_gpus_rescale_its_failure_rate(capsys):
    assert cli(["plan", "--preset", "paper", "--gpus", "49152", "--replicas", "24", "--json", "--no-png"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mtbf_job_s"] == pytest.approx(2 * 1080)  # half the GPUs fail half as often
    assert out["sources"]["replicas"] == "flag" and out["sources"]["detect_s"] == "preset paper"
    assert out["ft_ett"] == pytest.approx(1 - (180 + 420 / 24) / 2160, abs=1e-4)
    assert cli(["plan", "--preset", "paper", "--mtbf", "36m", "--json", "--no-png"]) == 0
    assert json.loads(capsys.readouterr().out)["restart_ett"] == pytest.approx(1 - 600 / 2160, abs=1e-4)


def test_from_run_fills_the_measured_inputs(tmp_path, capsys):
    ft_run(str(tmp_path))
    assert cli(["plan", "--from-run", str(tmp_path), "--json", "--no-png"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpus"] == 6 and out["inputs"]["catchup_s"] == pytest.approx(1.5)
    assert out["sources"]["restart_s"] == f"run {tmp_path}"
    assert out["sources"]["rollback_steps"].startswith("model")
    mode, inp, ett = plan.predict_run(str(tmp_path))
    assert mode == "ft" and out["ft_ett"] == pytest.approx(ett, abs=1e-4)


def test_text_output_names_sources_and_costs(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert cli(["plan", "--preset", "paper", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "restart-the-world  0.444" in out and "ft_hsdp            0.801" in out
    assert "a 180 s full stall, then 420 s at 11/12 replicas" in out
    assert "recommended: 32 replicas of 3072 GPUs" in out and f"wrote {png}" in out


def test_plan_png_draws_both_modes(tmp_path, capsys):
    import matplotlib.image as mpimg
    import numpy as np

    png = tmp_path / "plan.png"
    assert cli(["plan", "--preset", "paper", "--png", str(png), "--json"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(str(png))[..., :3]
    left = img[:, : img.shape[1] // 2]

    def share(rgb):
        return np.all(np.abs(left - np.array(rgb)) < 0.06, axis=-1).mean()

    green, red = (0x2c / 255, 0xa0 / 255, 0x2c / 255), (0xd6 / 255, 0x27 / 255, 0x28 / 255)
    assert share(green) > 0.001 and share(red) > 0.001
    # the restart-the-world curve lies below ft_hsdp's: at the job's size its pixels are lower
    cols = np.nonzero(np.all(np.abs(left - np.array(red)) < 0.06, axis=-1).any(axis=0))[0]
    mid = cols[len(cols) // 2]
    ys_red = np.nonzero(np.all(np.abs(left[:, mid] - np.array(red)) < 0.06, axis=-1))[0]
    ys_green = np.nonzero(np.all(np.abs(left[:, mid] - np.array(green)) < 0.06, axis=-1))[0]
    assert ys_red.size and ys_green.size and ys_red.mean() >= ys_green.mean()


@pytest.mark.parametrize("argv,msg", [(["plan", "--replicas", "3"], "no --gpus"),
                                      (["plan", "--gpus", "8", "--replicas", "2", "--mtbf", "1h", "--mtbf-gpu", "1y"],
                                       "not both"),
                                      (["plan", "--gpus", "4", "--replicas", "8"], "at least as many GPUs"),
                                      (["plan", "--from-run", "/nonexistent/run"], "no run directory")])
def test_bad_input_says_what_to_do(argv, msg, capsys):
    assert cli(argv + ["--no-png"]) == 2
    assert msg in capsys.readouterr().err


def test_durations_and_counts():
    assert plan.duration("90") == 90 and plan.duration("18m") == 1080 and plan.duration("1.5h") == 5400
    assert plan.duration("3y") == 3 * 365 * 86400
    assert plan.human(1080) == "18 min" and plan.human(3 * 365 * 86400) == "3 y" and plan.human(42) == "42 s"
    assert plan.count("70B") == 70e9 and plan.count("4.2e6") == 4.2e6
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="not a duration"):
        plan.duration("soon")


def test_plan_png_goes_to_the_run_directory_or_runs_never_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli(["plan", "--preset", "paper", "--json"]) == 0
    assert (tmp_path / "runs" / "plan" / "plan.png").is_file() and not (tmp_path / "plan.png").exists()
    assert plan.png_path(argparse.Namespace(png=None, from_run="r/d")) == os.path.join("r/d", "plan.png")
    assert plan.png_path(argparse.Namespace(png="x.png", from_run="r/d")) == "x.png"


def test_from_run_measures_the_overhead_against_a_baseline_step(tmp_path, capsys):
    ft_run(str(tmp_path))
    assert "overhead" not in plan.measure_run(str(tmp_path))  # no baseline: not measured
    m = plan.measure_run(str(tmp_path), baseline_step_s=0.4)
    assert m["overhead"] == pytest.approx(STEP / 0.4 - 1) and m["baseline_step_s"] == 0.4
    (tmp_path / plan.BASELINE_FILE).write_text(json.dumps({"step_s": 0.45, "what": "clean DDP"}))
    assert plan.measure_run(str(tmp_path))["overhead"] == pytest.approx(STEP / 0.45 - 1)
    assert cli(["plan", "--from-run", str(tmp_path), "--json", "--no-png"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["overhead"] == pytest.approx(STEP / 0.45 - 1)
    assert out["sources"]["overhead"] == f"run {tmp_path}: fault-free step 0.5 s / baseline 0.45 s - 1"
    assert cli(["plan", "--from-run", str(tmp_path), "--baseline-step", "0.5", "--json", "--no-png"]) == 0
    assert json.loads(capsys.readouterr().out)["overhead"] == pytest.approx(0.0)  # the flag over the file
    mode, inp, ett = plan.predict_run(str(tmp_path))  # the run's ETT is against its own fault-free rate
    assert mode == "ft" and inp.overhead == 0.0


def test_world_restart_runs_have_no_overhead(tmp_path):
    world_run(str(tmp_path))
    assert "overhead" not in plan.measure_run(str(tmp_path), baseline_step_s=0.4)


def test_overhead_flag_prints_the_crossover(capsys):
    assert cli(["plan", "--preset", "paper", "--overhead", "0.1", "--json", "--no-png"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["overhead"] == 0.1 and out["sources"]["overhead"] == "flag"
    assert out["ft_ett"] == pytest.approx(0.8009 / 1.1, abs=1e-4)
    assert out["restart_wins_below_gpus"] == 23859
    assert out["crossover"].startswith("restart-the-world wins below 23859 GPUs")
    assert cli(["plan", "--preset", "paper", "--overhead", "0.1", "--no-png"]) == 0
    text = capsys.readouterr().out
    assert "crossover: restart-the-world wins below 23859 GPUs" in text
    assert "(ft_hsdp x 0.9091 for its steady-state overhead 0.1)" in text
    assert cli(["plan", "--preset", "paper", "--json", "--no-png"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["overhead"] == 0.0 and out["restart_wins_below_gpus"] == 12  # no tax: ft_hsdp wins at any size
    assert out["sources"]["overhead"] == "preset paper"  # the paper measured 0% steady-state overhead


def test_baseline_step_needs_a_run(capsys):
    assert cli(["plan", "--preset", "paper", "--baseline-step", "1", "--no-png"]) == 2
    assert "--baseline-step needs --from-run RUN_DIR" in capsys.readouterr().err
