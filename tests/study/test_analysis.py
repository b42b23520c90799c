"""Bands, deviations in failure windows, recovery and computed conclusions (lightning_ft/study/analysis.py),
on synthetic curves whose answers are known."""
from __future__ import annotations

import pytest

from lightning_ft.study.analysis import analyze, band, conclusions, recovery_steps, smooth
from lightning_ft.study.settings import parse

R = 4
STEPS = 40


def test_smooth_is_a_trailing_mean_with_a_short_start():
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smooth([4.0, 2.0], 5) == [4.0, 3.0]


def test_band_is_mean_plus_minus_two_sample_sd_per_step_and_of_final_evals():
    b = band([[1.0, 2.0, 3.0], [1.5, 1.0, 2.5], [0.5, 1.5, 2.8]], [3.1, 3.0, 3.3])
    assert b.lo == pytest.approx([0.0, 0.5, 2.76667 - 2 * 0.251661], abs=1e-5)
    assert b.hi == pytest.approx([2.0, 2.5, 2.76667 + 2 * 0.251661], abs=1e-5)
    assert b.final_train == (b.lo[-1], b.hi[-1])
    assert b.final_eval == pytest.approx((3.13333 - 2 * 0.152753, 3.13333 + 2 * 0.152753), abs=1e-5)
    assert b.inside(1, 2.4) and not b.inside(1, 2.51)
    # identical seeds: a zero-width band that holds exactly their value
    same = band([[2.0, 2.0]] * 3, [3.0] * 3)
    assert same.lo == same.hi == [2.0, 2.0] and same.inside(0, 2.0) and not same.inside(0, 2.0001)
    with pytest.raises(ValueError, match="at least 2"):
        band([[1.0]], [1.0])


def _flat_band(width: float = 0.01):
    base = [2.0] * STEPS
    return base, band([[2.0 - width] * STEPS, [2.0 + width] * STEPS], [3.0, 3.2])


def _run(loss, down=range(10, 15), evals=None):
    contributors = [[0, 1] if n in down else [0, 1, 2, 3] for n in range(STEPS)]
    return {"train_loss": loss, "contributors": contributors, "eval": evals or {STEPS: 3.1}}


def test_max_deviation_is_the_largest_magnitude_inside_failure_windows_only():
    base, b = _flat_band()
    loss = [2.0] * STEPS
    loss[12] = 2.3        # inside the window: +0.3
    loss[13] = 1.6        # inside: -0.4, the largest magnitude (signed)
    loss[30] = 9.0        # outside every window: not counted
    row = analyze("d1x_fp32_for5_2reps_lr_none", "sim", _run(loss), base, b, 1, R, events=1, con=2)
    assert row.max_dev == pytest.approx(-0.4)
    assert row.down_steps == pytest.approx(5 * 2 / (1 * 2))


def test_steps_to_recover_counts_from_the_last_window_end_until_the_curve_stays_in_band():
    base, b = _flat_band()
    loss = [2.0] * STEPS
    for n in range(10, 22):   # the loss stays high 7 steps past the window's end (15)
        loss[n] = 2.2
    row = analyze("d1x_fp32_for5_2reps_lr_none", "sim", _run(loss), base, b, 1, R, events=1, con=2)
    assert row.recover_steps == 22 - 15
    # a dip back into the band shorter than `hold` does not count as recovered
    smoothed = [2.0] * 15 + [2.2, 2.0, 2.2, 2.2] + [2.0] * (STEPS - 19)
    assert recovery_steps(smoothed, b, 15, hold=3) == 19 - 15
    assert recovery_steps(smoothed, b, 15, hold=1) == 16 - 15
    assert recovery_steps([2.5] * STEPS, b, 15, hold=3) is None


def test_a_replica_down_at_the_end_has_no_recovery_to_count():
    base, b = _flat_band()
    row = analyze("n", "real", _run([2.0] * STEPS, down=range(30, STEPS)), base, b, 1, R, 1, 2)
    assert row.down_at_end and row.recover_steps is None
    back = analyze("n", "real", _run([2.0] * STEPS, down=range(30, STEPS - 1)), base, b, 1, R, 1, 2)
    assert not back.down_at_end and back.recover_steps == 0


def test_in_band_flags_use_the_final_smoothed_loss_and_the_last_evaluation():
    base, b = _flat_band()
    inside = analyze("n", "sim", _run([2.0] * STEPS, evals={20: 9.0, STEPS: 3.1}), base, b, 1, R, 1, 2)
    assert inside.train_in_band and inside.eval_in_band and inside.final_eval == 3.1
    high = analyze("n", "sim", _run([2.0] * (STEPS - 1) + [2.5], evals={STEPS: 3.4}), base, b, 1, R, 1, 2)
    assert not high.train_in_band and not high.eval_in_band
    assert high.final_train == pytest.approx(2.5)


def test_real_rows_report_per_step_time_inside_and_outside_failure_windows():
    base, b = _flat_band()
    run = _run([2.0] * STEPS)
    run["wall"] = [0.0]
    for n in range(1, STEPS):   # 0.1 s per healthy step, 0.3 s per step with replicas down
        run["wall"].append(run["wall"][-1] + (0.3 if 10 <= n < 15 else 0.1))
    row = analyze("n", "real", run, base, b, 1, R, 1, 2)
    assert row.healthy_step_s == pytest.approx(0.1) and row.degraded_step_s == pytest.approx(0.3)
    assert row.seconds == pytest.approx(34 * 0.1 + 5 * 0.3)


def _row(name, dev, train_in=True, eval_in=True):
    base, b = _flat_band()
    loss = [2.0] * STEPS
    loss[12] = 2.0 + dev
    loss[-1] = 2.0 if train_in else 2.5
    return analyze(name, "sim", _run(loss, evals={STEPS: 3.1 if eval_in else 3.5}), base, b, 1, R, 1, 2)


def test_conclusions_are_computed_from_the_rows():
    names = {"none": "d1x_fp32_for5_2reps_lr_none", "sqrt": "d1x_fp32_for5_2reps_lr_sqrt",
             "linear": "d1x_fp32_for5_2reps_lr_linear", "constant": "d1x_fp32_for5_2reps_lr_none_batch_constant",
             "one": "d1x_fp32_for5_1reps_lr_none", "long": "d1x_fp32_for9_2reps_lr_none"}
    rows = [_row(names["none"], 0.058), _row(names["sqrt"], 0.031), _row(names["linear"], 0.045),
            _row(names["constant"], 0.004), _row(names["one"], 0.02, train_in=False),
            _row(names["long"], 0.07, eval_in=False)]
    settings = {n: parse(n) for n in names.values()}
    text = "\n".join(conclusions(rows, settings))
    assert "d1x_fp32_for5_2reps (sim): sqrt vs none: max deviation 0.031 vs 0.058 nats." in text
    assert ("max deviation in failure windows, smallest first: batch constant 0.004, sqrt 0.031, linear 0.045, "
            "none 0.058 nats; closest to the baseline: batch constant.") in text
    assert "1 vs 2 concurrent failures: max deviation d1x_fp32_for5_1reps_lr_none 0.020 vs " \
           "d1x_fp32_for5_2reps_lr_none 0.058 nats." in text
    assert "for5 vs for9: max deviation" in text and "d1x_fp32_for9_2reps_lr_none 0.070" in text
    assert ("Final values inside the baseline noise band: train loss 5 of 6, held-out 5 of 6; outside: "
            "d1x_fp32_for5_1reps_lr_none (sim), d1x_fp32_for9_2reps_lr_none (sim).") in text
    # a different table gives different sentences: swap the two interventions' deviations
    swapped = [_row(names["none"], 0.031), _row(names["sqrt"], 0.058)]
    text2 = "\n".join(conclusions(swapped, settings))
    assert "sqrt vs none: max deviation 0.058 vs 0.031 nats." in text2
    assert "closest to the baseline: none." in text2
