"""summary.md and the figures from a study's results (lightning_ft/study/summary.py, plots.py), on
synthetic results whose table is known: no training here."""
from __future__ import annotations

import os
import re
import struct
import time

import pytest

from lightning_ft.study.config import StudyConfig, RealConfig
from lightning_ft.study.runner import Study
from lightning_ft.study.settings import batch_schedule
from lightning_ft.study.summary import evaluate, render

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_moe.py")
STEPS = 40
NONE, SQRT = "d1x_fp32_for5_2reps_lr_none", "d1x_fp32_for5_2reps_lr_sqrt"


def _cfg(out: str) -> StudyConfig:
    return StudyConfig(out=out, script=SCRIPT, script_args=["--val-every", "20"], replicas=4, steps=STEPS,
                       start_step=10, window_steps=40, seeds=3, smooth_steps=1, jobs=1, settings=[NONE, SQRT],
                       real=RealConfig(settings=[SQRT]))


def _result(name, source, seed, loss, evals, study, wall=None):
    s = study.settings[name]
    contributors = [list(c) for c in study.cfg.schedule.contributors(s)]
    r = {"name": name, "source": source, "seed": seed, "train_loss": loss, "eval": evals,
         "contributors": contributors,
         "batches": batch_schedule([tuple(c) for c in contributors], 4, s.batch_policy), "seconds": 1.0}
    if wall is not None:
        r["wall"] = wall
    return r


def _study(out: str) -> Study:
    st = Study(_cfg(out))
    res = {}
    for seed, off in enumerate((0.0, 0.02, -0.02)):   # band: mean +- 2 sd = 1.96..2.04, evals 2.96..3.04
        res[f"baseline_fp32.sim.s{seed}"] = _result("baseline_fp32", "sim", seed, [2.0 + off] * STEPS,
                                                    {20: 3.5 + off, 40: 3.0 + off}, st)
    none = [2.0] * STEPS
    none[12] = 2.25                    # +0.25 in the window 10..14, back in band at once
    sqrt = [2.0] * STEPS
    sqrt[12] = 2.1                     # +0.10
    res[f"{NONE}.sim.s0"] = _result(NONE, "sim", 0, none, {20: 3.6, 40: 3.1}, st)          # held-out out of band
    res[f"{SQRT}.sim.s0"] = _result(SQRT, "sim", 0, sqrt, {20: 3.5, 40: 3.0}, st)
    wall = [0.1 * n for n in range(STEPS)]
    real = [x + 0.001 for x in sqrt]
    res[f"{SQRT}.real.s0"] = _result(SQRT, "real", 0, real, {20: 3.5, 40: 3.004}, st, wall)
    res[f"{SQRT}.replay.s0"] = _result(SQRT, "replay", 0, sqrt, {20: 3.5, 40: 3.0}, st)
    st.results = res
    return st


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """One study rendered once (matplotlib and the script's parser are slow to import here)."""
    st = _study(str(tmp_path_factory.mktemp("study") / "out"))
    return st, render(st, _meta())


def _meta():
    return {"config": "configs/x.yaml", "started": time.time(), "seconds": 60.0, "load_start": "1 1 1",
            "load_end": "2 2 2"}


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", head[16:24])


def test_summary_table_has_one_row_per_setting_and_the_computed_values(rendered):
    study, outcome = rendered
    text = open(os.path.join(study.cfg.out, "summary.md")).read()
    rows = {m[0] + "|" + m[1]: m for m in re.findall(r"^\| `([^`]+)` \| (\w+) \|(.*)$", text, re.M)}
    assert set(rows) == {"baseline_fp32|sim", f"{NONE}|sim", f"{SQRT}|sim", f"{SQRT}|real"}
    cells = lambda key: [c.strip() for c in rows[key][2].split("|")]  # noqa: E731
    none = cells(f"{NONE}|sim")
    # steps down per failure, final train, final held-out, max deviation, recover, train in band, held-out in band
    assert none[:7] == ["5", "2.000", "3.100", "+0.250", "0", "yes", "no"]
    assert cells(f"{SQRT}|sim")[3] == "+0.100"
    assert cells("baseline_fp32|sim")[1] == "2.000 (band 1.960–2.040)"
    assert cells("baseline_fp32|sim")[2] == "3.000 (band 2.960–3.040)"
    real = cells(f"{SQRT}|real")
    assert real[3] == "+0.101" and real[7] == "4"          # wall seconds: 39 steps x 0.1 s
    assert real[8] == "0.100 / 0.100"
    assert "sqrt vs none: max deviation 0.100 vs 0.250 nats." in text
    assert f"train loss 3 of 3, held-out 2 of 3; outside: {NONE} (sim)." in text
    # the simulator check against the real run: 1e-3 nats and 4e-3 bpb, within 0.01
    assert f"| `{SQRT}` | 1.00e-03 | 4.00e-03 | yes |" in text
    assert [c.ok for c in outcome.checks] == [True]
    assert outcome.conclusions[0].startswith("Simulator vs real runs (replaying each real run's ledger): 1 of 1 within")


def test_a_simulator_check_beyond_tolerance_is_reported_as_failed(tmp_path):
    study = _study(str(tmp_path / "out"))
    real = study.results[f"{SQRT}.real.s0"]
    real["train_loss"] = [x + 0.05 for x in real["train_loss"]]
    outcome, _ = evaluate(study)
    assert [c.ok for c in outcome.checks] == [False]
    assert outcome.checks[0].train_diff == pytest.approx(0.051)
    assert "0 of 1 within tolerance; largest train-loss difference 5.10e-02 nats" in outcome.conclusions[0]


def test_every_figure_is_written_as_a_png(rendered):
    study, outcome = rendered
    names = sorted(os.path.basename(p) for p in outcome.figures)
    assert names == ["eval.png", "loss.png", "summary.md", "wallclock.png", "zoom.png"]
    for p in outcome.figures:
        if p.endswith(".png"):
            w, h = _png_size(p)
            assert w > 300 and h > 200 and os.path.getsize(p) > 10_000, p
