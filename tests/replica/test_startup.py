"""The restart breakdown's arithmetic (replica/startup.py): parts from the spawn, monotone, never negative."""
from __future__ import annotations

import pytest

from lightning_ft.replica.startup import PARTS, breakdown, spawn_time


@pytest.mark.parametrize("spawn, marks, parts, total", [
    # every mark present: each part runs from the previous one
    (100.0, {"python": 100.1, "torch": 101.0, "lightning": 102.5, "script": 102.6, "setup": 102.9,
             "registered": 103.0, "caught_up": 103.25, "first_step": 103.5},
     {"python": 0.1, "torch": 0.9, "lightning": 1.5, "script": 0.1, "setup": 0.3, "registered": 0.1,
      "caught_up": 0.25, "first_step": 0.25}, 3.5),
    # the plain loop: no Lightning, no fit; missing marks fold into the next one present
    (10.0, {"python": 10.5, "torch": 12.0, "registered": 13.0, "first_step": 13.5},
     {"python": 0.5, "torch": 1.5, "registered": 1.0, "first_step": 0.5}, 3.5),
    # torch imported before lightning_ft: no python mark, its time is in torch
    (10.0, {"torch": 12.0, "first_step": 13.0}, {"torch": 2.0, "first_step": 1.0}, 3.0),
    # a mark earlier than the previous one (clocks, out-of-order marks) is 0 s, never negative
    (10.0, {"python": 11.0, "torch": 10.5, "setup": 12.0}, {"python": 1.0, "torch": 0.0, "setup": 1.0}, 2.0),
    # a mark before the spawn time (the launcher's clock read late) counts 0
    (10.0, {"python": 9.9, "torch": 11.0}, {"python": 0.0, "torch": 1.0}, 1.0),
    # no spawn time: from the first mark
    (None, {"python": 5.0, "torch": 6.0}, {"python": 0.0, "torch": 1.0}, 1.0),
    (10.0, {}, {}, 0.0),
])
def test_parts_run_from_the_previous_mark_never_negative_and_sum_to_the_total(spawn, marks, parts, total):
    got = breakdown(spawn, marks)
    assert got["parts"] == pytest.approx(parts)
    assert list(got["parts"]) == [p for p in PARTS if p in parts]  # in start-up order
    assert got["total_s"] == pytest.approx(total)
    assert sum(got["parts"].values()) == pytest.approx(got["total_s"], abs=1e-3)


def test_the_spawn_time_is_the_launchers_else_the_kernels():
    assert spawn_time({"LFT_SPAWN_T": "1234.5"}) == 1234.5
    import time

    own = spawn_time({})  # /proc/self/stat: this test process started before now, today
    assert own is not None and time.time() - 86400 * 30 < own <= time.time()


def test_a_promoted_spare_counts_from_its_promotion(monkeypatch):
    from lightning_ft.replica import startup

    monkeypatch.setattr(startup, "_marks", {"python": 1.0, "torch": 2.0, "setup": 3.0, "promoted": 100.0,
                                            "registered": 100.5, "caught_up": 101.0, "first_step": 101.25})
    got = startup.restart_breakdown({"LFT_SPAWN_T": "0.5"})
    assert got == {"spawn_t": 100.0, "standby": True, "total_s": 1.25,
                   "parts": {"registered": 0.5, "caught_up": 0.5, "first_step": 0.25}}
