"""The failure-injection schedule: explicit events, the k-th-injection-in-k-th-incarnation rule,
seeded MTBF draws, kind validation and building it from the config."""
from __future__ import annotations

import pytest

from lightning_ft.config import load_config
from lightning_ft.launch.failure import FailureSchedule, Injection


def test_explicit_events_fire_at_their_step_for_their_replica():
    s = FailureSchedule([Injection(1, 5, "kill"), Injection(0, 3, "hang", downtime_steps=4)], replicas=2)
    assert s.events() == [Injection(0, 3, "hang", 4), Injection(1, 5, "kill")]
    assert [s.due(0, step) for step in range(3)] == [None, None, None]
    assert s.due(1, 3) is None
    assert s.due(0, 3) == Injection(0, 3, "hang", 4)
    assert s.due(0, 4) is None
    assert s.due(1, 5) == Injection(1, 5, "kill")


def test_an_injection_fires_once_per_schedule():
    s = FailureSchedule([Injection(0, 2, "kill")])
    assert s.due(0, 2) == Injection(0, 2, "kill")
    assert s.due(0, 2) is None


def test_kth_injection_fires_only_in_kth_incarnation():
    events = [Injection(1, 10, "kill"), Injection(1, 20, "exception"), Injection(1, 30, "hang")]
    # Each process has its own schedule object: the rule alone must keep a restarted
    # replica from re-firing the injection that killed its previous incarnation.
    assert FailureSchedule(events).due(1, 10, incarnation=0) == events[0]
    assert FailureSchedule(events).due(1, 10, incarnation=1) is None  # restarted at step 10: no re-fire
    assert FailureSchedule(events).due(1, 20, incarnation=0) is None  # incarnation 0 died at step 10
    assert FailureSchedule(events).due(1, 20, incarnation=1) == events[1]
    assert FailureSchedule(events).due(1, 30, incarnation=2) == events[2]
    assert FailureSchedule(events).due(1, 30, incarnation=3) is None
    assert FailureSchedule(events).due(0, 10, incarnation=0) is None


def test_two_injections_for_one_replica_at_one_step_are_refused():
    with pytest.raises(ValueError, match="replica 1 has two injections at step 7"):
        FailureSchedule([Injection(1, 7, "kill"), Injection(1, 7, "hang")])


def test_unknown_kind_is_refused_naming_the_allowed_kinds():
    with pytest.raises(ValueError, match="unknown failure kind 'explode'; allowed kinds are kill, hang, exception"):
        FailureSchedule([Injection(0, 1, "explode")])
    with pytest.raises(ValueError, match="allowed kinds are kill, hang, exception"):
        FailureSchedule(mtbf_steps=10, kinds=["kill", "oom"])


def test_negative_step_is_refused():
    with pytest.raises(ValueError, match="must be >= 0"):
        FailureSchedule([Injection(0, -1, "kill")])


def test_mtbf_schedule_is_determined_by_the_seed():
    a = FailureSchedule(mtbf_steps=20, kinds=("kill", "hang"), replicas=4, seed=7, horizon_steps=2000)
    b = FailureSchedule(mtbf_steps=20, kinds=("kill", "hang"), replicas=4, seed=7, horizon_steps=2000)
    c = FailureSchedule(mtbf_steps=20, kinds=("kill", "hang"), replicas=4, seed=8, horizon_steps=2000)
    assert a.events() == b.events()
    assert a.events() != c.events()
    assert a.describe() == b.describe()


def test_mtbf_mean_interarrival_is_close_to_mtbf_and_draws_are_uniform():
    s = FailureSchedule(mtbf_steps=50, kinds=("kill", "hang", "exception"), replicas=4, seed=1,
                        horizon_steps=500_000)
    events = s.events()
    steps = [e.step for e in events]
    assert steps == sorted(steps) and all(0 < st < 500_000 for st in steps)
    mean = steps[-1] / len(steps)
    assert 48 < mean < 52, mean  # ~10,000 draws: the standard error is 0.5 steps
    for replica in range(4):
        assert 0.22 < sum(e.replica == replica for e in events) / len(events) < 0.28
    for kind in ("kill", "hang", "exception"):
        assert 0.30 < sum(e.kind == kind for e in events) / len(events) < 0.37
    assert all(e.downtime_steps == 0 for e in events)


def test_random_and_explicit_injections_merge_sorted_by_step():
    explicit = Injection(0, 1, "exception")
    s = FailureSchedule([explicit], mtbf_steps=5, replicas=2, seed=3, horizon_steps=40)
    assert s.events()[0] == explicit
    assert len(s.events()) > 2
    assert [e.step for e in s.events()] == sorted(e.step for e in s.events())


def test_describe_lists_one_line_per_injection_with_its_incarnation():
    s = FailureSchedule([Injection(1, 5, "kill"), Injection(1, 9, "hang", downtime_steps=3)])
    assert s.describe() == ("step 5: kill replica 1 (its incarnation 0)\n"
                            "step 9: hang replica 1 (its incarnation 1), down for 3 steps")
    assert FailureSchedule().describe() == "no failure injections"


def test_from_config_with_mtbf_override():
    cfg = load_config(overrides=["replicas=4", "failure.mtbf_steps=50", "failure.kinds=[kill,hang]",
                                 "failure.seed=5"])
    s = FailureSchedule.from_config(cfg.failure, replicas=cfg.replicas)
    assert s.events() == FailureSchedule(mtbf_steps=50, kinds=("kill", "hang"), replicas=4, seed=5).events()
    assert {e.kind for e in s.events()} == {"kill", "hang"}
    assert {e.replica for e in s.events()} == {0, 1, 2, 3}


def test_from_config_with_explicit_events():
    cfg = load_config(overrides=["replicas=2",
                                 "failure.events=[{replica: 1, step: 50, kind: hang, downtime_steps: 10}]"])
    s = FailureSchedule.from_config(cfg.failure, replicas=cfg.replicas)
    assert s.events() == [Injection(1, 50, "hang", 10)]
    assert FailureSchedule.from_config(load_config().failure, replicas=3).events() == []


def test_downtime_is_that_of_the_injection_that_fired_in_the_incarnation():
    s = FailureSchedule([Injection(1, 5, "kill", downtime_steps=7), Injection(1, 40, "kill"),
                         Injection(2, 9, "kill", downtime_steps=3)], replicas=3)
    assert [s.downtime(1, inc) for inc in range(3)] == [7, 0, 0]
    assert [s.downtime(2, inc) for inc in range(2)] == [3, 0]
    assert s.downtime(0, 0) == 0
