"""The stall definition of bench.recovery (issue 25: it printed negative kill stalls)."""
from __future__ import annotations

import pytest

from lightning_ft.bench.recovery import _gap_around, _stall


def _rows(*ts: float) -> list[dict]:
    return [{"t": t} for t in ts]


def test_a_kill_landing_in_a_fast_step_is_no_stall_not_a_negative_one():
    # median step 0.25 s (binary-exact times); the kill at 1.05 falls in a 0.125 s step, the
    # next ones are normal: the old definition (gap around the kill minus the median) gave -0.125
    rows = _rows(0.5, 0.75, 1.0, 1.125, 1.375, 1.625)
    assert _gap_around(rows, 1.05, 1.05) - 0.25 == -0.125
    assert _stall(rows, 1.05, 1.375, 0.25) == 0.0


def test_the_stall_is_the_longest_gap_in_the_window_beyond_a_median_step():
    # kill at 1.05 inside a normal step; the next step (ring broken, eviction) ends at 2.0
    rows = _rows(0.8, 1.0, 1.2, 2.0, 2.2)
    assert _stall(rows, 1.05, 2.0, 0.2) == pytest.approx(0.6)
    assert _stall(rows, 1.05, 1.05, 0.2) == 0.0  # the kill's own gap alone misses it


def test_a_kill_between_rows_or_without_rows_is_never_negative():
    assert _stall(_rows(1.0, 1.1), 5.0, 6.0, 0.2) == 0.0  # no gap overlaps the window
    assert _stall([], 1.0, 2.0, 0.2) == 0.0
    assert _stall(_rows(1.0), 0.5, 1.5, 0.2) == 0.0
