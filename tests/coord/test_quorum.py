"""The pure quorum decision: table-driven cases and a randomized property test."""
from __future__ import annotations

import dataclasses
import random

import pytest

from lightning_ft.coord.quorum import JobSpec, Quorum, Report, compute_quorum, fingerprint_diff

FP = {"job": "j", "replicas": 3, "nproc_per_replica": 1}
JOB = JobSpec(replicas=3, min_replicas=1, init_timeout_s=10.0, fingerprint=FP)


def rep(rid, step=0, round=0, inc=0, fp=None):
    return Report(rid=rid, incarnation=inc, step=step, round=round, fingerprint=fp or FP,
                  addrs=(f"h:{1000 + rid}",))


def decide(round, reports, evicted=(), previous=None, job=JOB, waited_s=0.0):
    return compute_quorum(round, {r.rid: r for r in reports}, frozenset(evicted), previous, job, waited_s)


def prev_of(*reports, round=0, epoch=0):
    d = decide(round, [dataclasses.replace(r, round=round) for r in reports], job=JobSpec(3, 1, 0.0, FP), waited_s=99)
    q = d.quorum
    return Quorum(**{**q.__dict__, "epoch": epoch})


def test_first_round_waits_for_all_replicas_then_forms():
    d = decide(0, [rep(0), rep(1)])
    assert d.quorum is None
    assert d.reason == "round 0: starting, waiting for 2 of 3 replicas: r2 not reported (0.0s of 10.0s)"
    d = decide(0, [rep(0), rep(1), rep(2)])
    assert d.quorum.members == (0, 1, 2) and d.quorum.epoch == 0
    assert d.quorum.contributors == (0, 1, 2) and d.quorum.lagging == ()
    assert d.reason == "round 0 epoch 0: 3/3 replicas [r0 r1 r2] (first quorum); max_step 0"


def test_first_round_starts_without_absent_replica_after_init_timeout():
    d = decide(0, [rep(0), rep(2)], waited_s=10.0)
    assert d.quorum.members == (0, 2)
    assert d.quorum.addrs == (("h:1000",), ("h:1002",))


def test_below_min_replicas_waits_and_says_why():
    job = JobSpec(3, min_replicas=2, init_timeout_s=1.0, fingerprint=FP)
    d = decide(0, [rep(1)], job=job, waited_s=5.0)
    assert d.quorum is None
    assert d.reason == ("round 0: below min_replicas: 1 of 2 needed (r1 alive); "
                        "training waits for replicas to join")


def test_waits_for_previous_member_that_has_not_reported_this_round():
    prev = prev_of(rep(0), rep(1), rep(2))
    d = decide(1, [rep(0, round=1), rep(1, round=0), rep(2, round=1)], previous=prev)
    assert d.quorum is None
    assert d.reason == "round 1: waiting for r1 to report (previous members; 2 reported)"


def test_expired_member_is_dropped_and_epoch_advances():
    prev = prev_of(rep(0), rep(1), rep(2))
    d = decide(1, [rep(0, 1, round=1), rep(2, 1, round=1)], previous=prev)  # r1's key expired
    q = d.quorum
    assert q.members == (0, 2) and q.epoch == 1
    assert d.reason == "round 1 epoch 1: 2/3 replicas [r0 r2] (left r1); max_step 1"


def test_evicted_member_is_dropped_even_if_its_key_remains():
    prev = prev_of(rep(0), rep(1), rep(2))
    d = decide(1, [rep(0, round=1), rep(1, round=0), rep(2, round=1)], evicted={(1, 0)}, previous=prev)
    assert d.quorum.members == (0, 2)


def test_eviction_of_an_old_incarnation_does_not_exclude_the_new_one():
    prev = prev_of(rep(0), rep(2))
    d = decide(1, [rep(0, 5, round=1), rep(1, 0, round=1, inc=1), rep(2, 5, round=1)],
               evicted={(1, 0)}, previous=prev)
    assert d.quorum.members == (0, 1, 2) and d.quorum.incarnations == (0, 1, 0)


def test_new_incarnation_replaces_old_and_counts_as_change():
    prev = prev_of(rep(0), rep(1), rep(2))
    d = decide(1, [rep(0, 1, round=1), rep(1, 0, round=1, inc=1), rep(2, 1, round=1)], previous=prev)
    q = d.quorum
    assert q.members == (0, 1, 2) and q.epoch == 1
    assert q.contributors == (0, 2) and q.lagging == (1,)
    assert d.reason == ("round 1 epoch 1: 3/3 replicas [r0 r1 r2] (joined r1, left r1); max_step 1; "
                        "lagging r1 (r1 at 0)")


def test_late_joiner_is_added_as_lagging_without_anyone_waiting():
    prev = prev_of(rep(0, 7), rep(2, 7), round=6, epoch=3)
    d = decide(7, [rep(0, 8, round=7), rep(1, 2, round=7, inc=2), rep(2, 8, round=7)], previous=prev)
    q = d.quorum
    assert q.epoch == 4 and q.members == (0, 1, 2)
    assert q.max_step == 8 and q.contributors == (0, 2) and q.lagging == (1,)


def test_joiner_that_reported_an_older_round_is_not_waited_for():
    prev = prev_of(rep(0), rep(2))
    d = decide(4, [rep(0, round=4), rep(1, round=3), rep(2, round=4)], previous=prev)
    assert d.quorum.members == (0, 2) and d.quorum.epoch == prev.epoch


def test_unchanged_membership_keeps_epoch():
    prev = prev_of(rep(0), rep(1), rep(2), epoch=5)
    d = decide(1, [rep(0, 1, round=1), rep(1, 1, round=1), rep(2, 1, round=1)], previous=prev)
    assert d.quorum.epoch == 5
    assert "(unchanged)" in d.reason


def test_failed_exchange_bumps_epoch_with_unchanged_members():
    prev = prev_of(rep(0), rep(1), rep(2), epoch=5)
    broken = dataclasses.replace(rep(1, 1, round=1), ring_ok=False)
    d = decide(1, [rep(0, 1, round=1), broken, rep(2, 1, round=1)], previous=prev)
    assert d.quorum.epoch == 6 and d.quorum.members == (0, 1, 2)
    assert "(ring reset requested by r1)" in d.reason


def test_config_mismatch_is_refused_with_the_differing_field():
    bad = {**FP, "nproc_per_replica": 2}
    d = decide(0, [rep(0), rep(1), rep(2, fp=bad)], waited_s=11)
    assert d.quorum.members == (0, 1)
    assert d.refused[2] == "replica 2 (incarnation 0) refused: job config differs in nproc_per_replica (2 != 1)"
    assert d.reason.endswith("; refused r2")


def test_all_previous_members_gone_falls_back_to_start_rule():
    prev = prev_of(rep(0), rep(1), rep(2))
    d = decide(9, [rep(0, round=9, inc=1)], evicted={(0, 0), (1, 0), (2, 0)}, previous=prev, waited_s=0.5)
    assert d.quorum is None and "starting, waiting for 1 of 3" in d.reason


def test_round_ahead_counts_as_reported():
    prev = prev_of(rep(0), rep(1), rep(2))
    d = decide(1, [rep(0, round=2), rep(1, round=1), rep(2, round=1)], previous=prev)
    assert d.quorum.members == (0, 1, 2)


def test_fingerprint_diff():
    assert fingerprint_diff({"a": 1}, {"a": 1}) == ""
    assert fingerprint_diff({"a": 1, "b": 2}, {"a": 3}) == "a (3 != 1), b (None != 2)"


def test_json_roundtrip():
    q = decide(0, [rep(0), rep(1), rep(2)]).quorum
    assert Quorum.from_json(q.to_json()) == q
    r = rep(1, 3, 4)
    assert Report.from_json(r.to_json()) == r


@pytest.mark.parametrize("seed", range(300))
def test_random_decisions_obey_invariants(seed):
    rng = random.Random(seed)
    R = rng.randint(1, 8)
    job = JobSpec(R, rng.randint(1, R), rng.choice([0.0, 5.0]), FP)
    rnd = rng.randint(1, 50)
    prev = None
    if rng.random() < 0.8:
        pm = sorted(rng.sample(range(R), rng.randint(1, R)))
        prev = Quorum(round=rnd - 1, epoch=rng.randint(0, 9), members=tuple(pm),
                      incarnations=tuple(rng.randint(0, 2) for _ in pm), max_step=0, contributors=tuple(pm), lagging=())
    reports = {}
    for r in range(R):
        if rng.random() < 0.8:
            reports[r] = Report(r, rng.randint(0, 2), rng.randint(0, 5), rnd + rng.randint(-1, 1),
                                FP if rng.random() < 0.9 else {**FP, "replicas": 99})
    evicted = {(r, rng.randint(0, 2)) for r in range(R) if rng.random() < 0.2}
    waited = rng.choice([0.0, 100.0])
    d = compute_quorum(rnd, reports, frozenset(evicted), prev, job, waited)
    # Deterministic, and independent of the order reports arrive in.
    shuffled = dict(rng.sample(sorted(reports.items()), len(reports)))
    assert compute_quorum(rnd, shuffled, frozenset(evicted), prev, job, waited) == d
    valid = {r for r, p in reports.items()
             if (r, p.incarnation) not in evicted and p.fingerprint == FP and p.round >= rnd}
    assert set(d.refused) == {r for r, p in reports.items() if p.fingerprint != FP and (r, p.incarnation) not in evicted}
    survivors = set()
    if prev:
        survivors = {r for r, i in zip(prev.members, prev.incarnations)
                     if r in reports and reports[r].incarnation == i and (r, i) not in evicted and r not in d.refused}
    q = d.quorum
    if q is None:
        assert d.reason.startswith(f"round {rnd}: ")
        assert (survivors - valid) or len(valid) < job.min_replicas or (
            not survivors and len(valid) < R and waited < job.init_timeout_s)
        return
    assert set(q.members) == valid and list(q.members) == sorted(q.members)
    assert survivors <= set(q.members)
    assert len(q.members) >= job.min_replicas
    assert set(q.contributors) | set(q.lagging) == set(q.members)
    assert not set(q.contributors) & set(q.lagging) and q.contributors
    assert q.max_step == max(reports[r].step for r in q.members)
    assert all(reports[r].step == q.max_step for r in q.contributors)
    assert q.incarnations == tuple(reports[r].incarnation for r in q.members)
    if prev is not None:
        same = q.member_set() == prev.member_set() and all(reports[r].ring_ok for r in q.members)
        assert q.epoch == (prev.epoch if same else prev.epoch + 1)
