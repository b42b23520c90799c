"""Setting names in the paper's form and the failure schedules they imply (lightning_ft/study/settings.py)."""
from __future__ import annotations

import pytest

from lightning_ft.study.settings import Schedule, Setting, batch_schedule, failure_windows, parse


@pytest.mark.parametrize("name, want", [
    ("d2x_bf16_for200_1reps_lr_sqrt", Setting("bf16", 2, 200, 1, "sqrt")),
    ("d1x_fp32_for40_2reps_lr_none", Setting("fp32", 1, 40, 2, "none")),
    ("d3x_fp32_for5_3reps_lr_linear", Setting("fp32", 3, 5, 3, "linear")),
    ("d1x_fp32_for40_2reps_lr_none_batch_constant", Setting("fp32", 1, 40, 2, "none", "constant")),
    ("baseline_bf16", Setting("bf16")),
])
def test_paper_form_names_parse_and_format_back_exactly(name, want):
    got = parse(name)
    assert got == want
    assert got.name == name


def test_fields_of_a_parsed_name():
    s = parse("d2x_bf16_for200_3reps_lr_linear")
    assert (s.freq, s.fp, s.length, s.con, s.lr, s.batch_policy) == (2, "bf16", 200, 3, "linear", "shrink")
    assert s.precision == "bf16-emulated" and not s.baseline
    assert parse("baseline_fp32").baseline and parse("baseline_fp32").precision == "32-true"


@pytest.mark.parametrize("bad", [
    "d2x_fp8_for4k_1reps_lr_none",       # fp8 and `4k` are the paper's, not ours
    "d2x_bf16_for200_1reps_lr_cubic",    # unknown intervention
    "d2x_bf16_for200_1reps",             # no lr part
    "2x_bf16_for200_1reps_lr_sqrt",      # no d
    "d2x_bf16_for200_1rep_lr_sqrt",      # reps, not rep
    "d2x_bf16_for200_1reps_lr_sqrt_batch_shrink",
    "d0x_fp32_for10_1reps_lr_none",      # zero failures is the baseline, by name
    "d1x_fp32_for0_1reps_lr_none",
    "d1x_fp32_for10_0reps_lr_none",
    "baseline",
])
def test_names_not_of_the_form_are_refused_with_the_form(bad):
    with pytest.raises(ValueError, match=r"freq|form"):
        parse(bad)


def test_events_are_freq_per_window_from_the_start_step_while_they_fit():
    sch = Schedule(replicas=4, steps=300, start_step=100, window_steps=100)
    assert sch.event_steps(parse("d2x_fp32_for20_1reps_lr_none")) == [100, 150, 200, 250]
    assert sch.event_steps(parse("d1x_fp32_for20_1reps_lr_none")) == [100, 200]
    # an event whose replicas would not be back before the end is left out
    assert sch.event_steps(parse("d1x_fp32_for120_1reps_lr_none")) == [100]
    assert sch.event_steps(parse("baseline_fp32")) == []


def test_victims_are_the_highest_ids_and_real_events_kill_each_kept_down_len_steps():
    sch = Schedule(4, 300, 100, 100)
    s = parse("d1x_fp32_for30_2reps_lr_sqrt")
    assert sch.victims(s) == (2, 3)
    assert sch.failure_events(s) == [
        {"replica": 2, "step": 100, "kind": "kill", "downtime_steps": 30},
        {"replica": 3, "step": 100, "kind": "kill", "downtime_steps": 30},
        {"replica": 2, "step": 200, "kind": "kill", "downtime_steps": 30},
        {"replica": 3, "step": 200, "kind": "kill", "downtime_steps": 30},
    ]
    with pytest.raises(ValueError, match="leaves nobody"):
        sch.victims(parse("d1x_fp32_for30_4reps_lr_none"))


def test_nominal_contributors_miss_exactly_len_steps_per_event():
    sch = Schedule(3, 40, 10, 20)
    c = sch.contributors(parse("d1x_fp32_for5_1reps_lr_none"))
    assert len(c) == 40
    down = [n for n, who in enumerate(c) if who != (0, 1, 2)]
    assert down == [10, 11, 12, 13, 14, 30, 31, 32, 33, 34]
    assert all(c[n] == (0, 1) for n in down)
    assert failure_windows(c, 3) == [(10, 15), (30, 35)]


def test_failure_windows_close_at_the_end_of_the_run():
    assert failure_windows([(0, 1), (0,), (0,)], 2) == [(1, 3)]
    assert failure_windows([(0, 1)] * 3, 2) == []


def test_batch_schedule_shrink_leaves_absent_slots_waiting_constant_trains_them():
    who = [(0, 1, 2), (0, 1), (0, 1), (0, 1, 2)]
    shrink = batch_schedule(who, 3, "shrink")
    assert shrink == [{0: 0, 1: 0, 2: 0}, {0: 1, 1: 1}, {0: 2, 1: 2}, {0: 3, 1: 3, 2: 1}]
    constant = batch_schedule(who, 3, "constant")
    assert constant == [{0: 0, 1: 0, 2: 0}, {0: 1, 1: 1, 2: 1}, {0: 2, 1: 2, 2: 2}, {0: 3, 1: 3, 2: 3}]
    # exactly once: each slot's batches are 0..cursor-1, each once
    for sched in (shrink, constant):
        for slot in range(3):
            ks = [b[slot] for b in sched if slot in b]
            assert ks == list(range(len(ks)))
