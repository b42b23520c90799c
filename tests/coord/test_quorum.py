"""The pure quorum decision: table-driven cases and a randomized property test."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest

from lightning_ft.coord.quorum import compute_quorum, fingerprint_diff
from lightning_ft.coord.round_records import Halt, JobSpec, Quorum, Report, decode_round

FP = {"job": "j", "replicas": 3, "nproc_per_replica": 1}
JOB = JobSpec(replicas=3, min_replicas=1, init_timeout_s=10.0, fingerprint=FP)


def rep(rid, step=0, round=0, inc=0, fp=None):
    return Report(rid=rid, incarnation=inc, step=step, round=round, fingerprint=fp or FP)


def decide(round, reports, evicted=(), previous=None, job=JOB, waited_s=0.0, history=None):
    from lightning_ft.coord.round_records import History

    return compute_quorum(round, {r.rid: r for r in reports}, frozenset(evicted), previous, job, waited_s,
                          history or History())


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


@pytest.mark.parametrize("joining, inc, taken", [
    (True, 0, True),    # a new process: its report stands for every round until it is taken in
    (False, 0, False),  # a replica that left the quorum (a finisher, one left out): its old round is stale
    (True, 4, True),    # a new incarnation of a member of the previous quorum is a joiner too
])
def test_a_joiners_report_for_a_round_the_others_passed_still_counts(joining, inc, taken):
    """Steady rounds are recorded in the background, so a joiner reports for the round after
    the newest recorded one, which the others may have passed long ago (rule 1)."""
    prev = prev_of(rep(0, 7), rep(1, 7), rep(2, 7), round=90, epoch=3)
    prev = dataclasses.replace(prev, members=(0, 2), incarnations=(0, 0), contributors=(0, 2))
    if inc:
        prev = dataclasses.replace(prev, members=(0, 1, 2), incarnations=(0, 3, 0), contributors=(0, 1, 2))
    late = dataclasses.replace(rep(1, 0, round=12, inc=inc), joining=joining)
    reports = [rep(0, 8, round=91), late, rep(2, 8, round=91)]
    d = decide(91, reports, previous=prev, evicted=[(1, 3)] if inc else ())
    assert (1 in d.quorum.members) == taken, d.reason
    if taken:
        assert d.quorum.lagging == (1,) and d.quorum.contributors == (0, 2)


def test_a_member_whose_report_still_says_joining_is_held_to_its_round():
    """Its joining report is still in etcd after it adopted a round: as a member of the previous
    quorum it counts only for the round it names (the round waits for its next report)."""
    prev = prev_of(rep(0, 7), rep(1, 7), rep(2, 7), round=91, epoch=4)
    stale = dataclasses.replace(rep(1, 7, round=12), joining=True)
    d = decide(92, [rep(0, 8, round=92), stale, rep(2, 8, round=92)], previous=prev)
    assert d.quorum is None and "r1" in d.reason


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
    assert fingerprint_diff({"params": "n=2 sha=1", "secret_tag": "x"}, {"params": "n=3 sha=2", "secret_tag": "y"}) \
        == "params (the model's parameter names, shapes and dtypes: 'n=3 sha=2' != 'n=2 sha=1'), " \
           "secret (not the job's secret)", "the tags are not shown"


def test_json_roundtrip():
    q = decide(0, [rep(0), rep(1), rep(2)]).quorum
    assert Quorum.from_json(q.to_json()) == q
    r = rep(1, 3, 4)
    assert Report.from_json(r.to_json()) == r


def test_a_round_record_decodes_to_its_quorum_or_its_halt():
    q = decide(0, [rep(0), rep(1), rep(2)]).quorum
    assert decode_round(q.to_json()) == q
    h = Halt("no majority of replica states agreed at step 7", 12)
    assert h.to_json().startswith(b'{"halt"')  # the record's shape stays what older launchers read
    assert decode_round(h.to_json()) == h
    assert decode_round(b'{"halt": "x"}') == Halt("x", -1)


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
    assert set(d.refused) == {r for r, p in reports.items()
                              if p.fingerprint != FP and (r, p.incarnation) not in evicted}
    survivors = set()
    if prev:
        survivors = {r for r, i in zip(prev.members, prev.incarnations, strict=True)
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


# -- rules 5-9: partitions, usable states, rewinds, sync rounds, the divergence guard -------------

from lightning_ft.coord.quorum import QUARANTINE_ROUNDS, STRIKES, adopt_role  # noqa: E402
from lightning_ft.coord.round_records import SYNC, TRAIN, History  # noqa: E402


def srep(rid, step=0, round=1, inc=0, gen=0, synced=True, digest="", digest_step=-1, ring_ok=True, blame=(),
         bad=(), made=(-1, -1)):
    return Report(rid=rid, incarnation=inc, step=step, round=round, fingerprint=FP,
                  gen=gen, synced=synced, digest=digest, digest_step=digest_step, ring_ok=ring_ok, blame=blame,
                  bad_checkpoints=bad, made=made)


def quorum_of(members, step, round=0, gen=0, epoch=0, incs=None, **kw):
    incs = incs or (0,) * len(members)
    return Quorum(round=round, epoch=epoch, members=tuple(members), incarnations=tuple(incs), max_step=step,
                  contributors=tuple(members), lagging=(), gen=gen, **kw)


def test_job_start_with_fresh_replicas_is_a_sync_round_from_the_lowest_id():
    d = decide(0, [srep(r, round=0, synced=False) for r in range(3)])
    q = d.quorum
    assert q.kind == SYNC and q.source == 0 and q.contributors == (0,) and q.lagging == (1, 2)
    assert q.max_step == 0 and q.gen == 0 and q.rewind is None
    assert d.reason == ("round 0 epoch 0: 3/3 replicas [r0 r1 r2] (first quorum); max_step 0; adopting r1 r2 "
                        "(r1 at 0, r2 at 0); sync: every replica adopts r0's state")
    assert [adopt_role(q, r) for r in range(3)] == ["source", "adopt", "adopt"]


def test_after_the_sync_the_synced_replicas_train():
    prev = dataclasses.replace(quorum_of((0, 1, 2), 0), kind=SYNC, contributors=(0,), lagging=(1, 2))
    d = decide(1, [srep(r, 0, round=1) for r in range(3)], previous=prev)
    assert d.quorum.kind == TRAIN and d.quorum.contributors == (0, 1, 2)
    assert [adopt_role(d.quorum, r) for r in range(3)] == ["train"] * 3


def test_fresh_replica_at_the_job_step_catches_up_instead_of_contributing():
    prev = quorum_of((0, 1), 0)
    d = decide(1, [srep(0, 0), srep(1, 0), srep(2, 0, inc=1, synced=False)], previous=prev)
    q = d.quorum
    assert q.kind == TRAIN and q.contributors == (0, 1) and q.lagging == (2,)
    assert adopt_role(q, 2) == "catchup"


def test_resumed_replicas_at_the_checkpoint_step_sync_from_the_lowest_id():
    d = decide(0, [srep(r, 40, round=0, synced=False) for r in (2, 1, 0)], history=History(committed_step=40))
    q = d.quorum
    assert q.kind == SYNC and q.source == 0 and q.max_step == 40 and q.rewind is None


def test_total_loss_rewinds_to_the_newest_checkpoint():
    prev = quorum_of((0, 1, 2), 60, round=70)
    reports = [srep(r, 0, round=71, inc=1, synced=False) for r in range(3)]
    hist = History(committed_step=61, checkpoints=((40, "/c/40"), (60, "/c/60"), (20, "/c/20")))
    d = decide(71, reports, evicted={(0, 0), (1, 0), (2, 0)}, previous=prev, history=hist, waited_s=99)
    q = d.quorum
    assert q.kind == SYNC and q.gen == 1 and q.max_step == 60 and q.source == 0
    assert q.rewind == {"from": 61, "to": 60, "checkpoint": "/c/60", "checkpoint_step": 60}
    assert "rewind from step 61 to 60 (checkpoint step 60, loaded by r0), generation 1" in d.reason


def test_rewind_skips_checkpoints_a_replica_could_not_load():
    prev = quorum_of((0, 1), 60, round=70)
    reports = [srep(0, 0, round=71, inc=1, synced=False, bad=(60,)), srep(1, 0, round=71, inc=1, synced=False)]
    hist = History(committed_step=61, checkpoints=((40, "/c/40"), (60, "/c/60")))
    q = decide(71, reports, evicted={(0, 0), (1, 0)}, previous=prev, history=hist, waited_s=99).quorum
    assert q.rewind["checkpoint"] == "/c/40" and q.max_step == 40


def test_total_loss_without_checkpoint_rewinds_to_step_0_from_a_fresh_replica():
    prev = quorum_of((0, 1), 30, round=30)
    reports = [srep(1, 0, round=31, inc=1, synced=False), srep(0, 0, round=31, inc=1, synced=False)]
    d = decide(31, reports, evicted={(0, 0), (1, 0)}, previous=prev, history=History(committed_step=31),
               job=JobSpec(2, 1, 10.0, FP))
    q = d.quorum
    assert q.kind == SYNC and q.max_step == 0 and q.source == 0 and q.gen == 1
    assert q.rewind == {"from": 31, "to": 0, "checkpoint": "", "checkpoint_step": -1}
    assert "rewind from step 31 to 0 (step 0 (no checkpoint; initial state of r0))" in d.reason


@pytest.mark.parametrize("repeat", [True, False])
def test_a_rewind_whose_source_failed_is_repeated_by_the_next_source(repeat):
    """The rewind to step 0 of round 31 chose r0, which hung before it wrote generation 1's record
    (`rewinds/1`, with the cursors). The next round syncs the others' fresh step-0 states into
    generation 1: it carries the rewind, so its source writes the record (sim seed 5255: without
    it generation 1 was trained with no record, and a later resume made a second generation 1)."""
    first = decide(31, [srep(1, 0, round=31, inc=1, synced=False), srep(0, 0, round=31, inc=1, synced=False)],
                   evicted={(0, 0), (1, 0)}, previous=quorum_of((0, 1), 30, round=30),
                   history=History(committed_step=31), job=JobSpec(2, 1, 10.0, FP)).quorum
    assert first.rewind is not None and first.source == 0 and first.gen == 1
    prev = first if repeat else dataclasses.replace(first, rewind=None)
    q = decide(32, [srep(1, 0, round=32, inc=1, synced=False)], evicted={(0, 1)}, previous=prev,
               history=History(committed_step=0), job=JobSpec(2, 1, 10.0, FP), waited_s=99).quorum
    assert q.kind == SYNC and q.gen == 1 and q.max_step == 0 and q.source == 1
    assert q.rewind == (first.rewind if repeat else None)


def test_a_surviving_state_newer_than_the_checkpoint_wins_the_rewind():
    # r2 was stopped at step 55 while the others trained to 60 and died; checkpoint at 40.
    prev = quorum_of((0, 1), 60, round=80)
    reports = [srep(0, 0, round=81, inc=1, synced=False), srep(2, 55, round=81)]
    hist = History(committed_step=61, checkpoints=((40, "/c/40"),))
    q = decide(81, reports, evicted={(0, 0), (1, 0)}, previous=prev, history=hist, waited_s=99).quorum
    assert q.kind == SYNC and q.source == 2 and q.max_step == 55 and q.lagging == (0,)
    assert q.rewind == {"from": 61, "to": 55, "checkpoint": "", "checkpoint_step": -1}


def test_partial_commit_by_dead_replicas_is_a_one_step_rewind():
    prev = quorum_of((0, 1), 9, round=9)
    # r0 committed step 9 (recorded) and died; r1 failed its vote and is still at 9.
    d = decide(10, [srep(1, 9, round=10)], evicted={(0, 0)}, previous=prev, history=History(committed_step=10))
    q = d.quorum
    assert q.kind == SYNC and q.gen == 1 and q.source == 1 and q.max_step == 9
    assert q.rewind["from"] == 10 and q.rewind["to"] == 9


def test_no_rewind_while_someone_holds_the_newest_step():
    prev = quorum_of((0, 1, 2), 9, round=9)
    d = decide(10, [srep(0, 10, round=10), srep(2, 3, round=10, inc=1, synced=False)], evicted={(1, 0)}, previous=prev,
               history=History(committed_step=10))
    q = d.quorum
    assert q.kind == TRAIN and q.gen == 0 and q.contributors == (0,) and q.lagging == (2,)


def test_stale_generation_state_is_not_usable_and_adopts():
    prev = quorum_of((0, 1), 40, round=50, gen=1)
    # r2 slept through a rewind: its step-58 state belongs to generation 0.
    d = decide(51, [srep(0, 41, round=51, gen=1), srep(1, 41, round=51, gen=1), srep(2, 58, round=51, gen=0)],
               previous=prev, history=History(committed_step=41))
    q = d.quorum
    assert q.kind == TRAIN and q.max_step == 41 and q.contributors == (0, 1) and q.lagging == (2,)


def test_no_usable_state_and_no_checkpoint_waits_for_a_fresh_replica():
    prev = quorum_of((0, 1), 40, round=50, gen=1)
    d = decide(51, [srep(2, 58, round=51, gen=0)], evicted={(0, 0), (1, 0)}, previous=prev,
               history=History(committed_step=41), waited_s=99)
    assert d.quorum is None and "no checkpoint; waiting for a fresh replica" in d.reason


def test_diverged_minority_heals_as_lagging():
    prev = quorum_of((0, 1, 2), 9, round=9)
    reports = [srep(0, 10, 10, digest="aa", digest_step=10), srep(1, 10, 10, digest="bb", digest_step=10),
               srep(2, 10, 10, digest="aa", digest_step=10)]
    d = decide(10, reports, previous=prev)
    q = d.quorum
    assert q.contributors == (0, 2) and q.lagging == (1,) and q.diverged == (1,) and q.verified_step == 10
    assert d.diverged == {1: ("bb", "aa")}
    assert "diverged r1 at step 10 (majority aa); healing by catch-up" in d.reason


def test_two_replicas_that_disagree_halt_the_job_naming_them():
    prev = quorum_of((0, 1), 9, round=9, verified_step=5)
    reports = [srep(0, 10, 10, digest="aa", digest_step=10), srep(1, 10, 10, digest="bb", digest_step=10)]
    d = decide(10, reports, previous=prev, job=JobSpec(2, 1, 10.0, FP))
    assert d.quorum is None
    assert d.halt.startswith("replica states diverged at step 10 and no majority agrees: r0=aa, r1=bb.")
    assert "(step <= 5)" in d.halt


def test_digests_of_other_steps_are_not_compared():
    prev = quorum_of((0, 1, 2), 9, round=9, verified_step=5)
    reports = [srep(0, 10, 10, digest="aa", digest_step=10), srep(1, 10, 10, digest="bb", digest_step=5),
               srep(2, 10, 10)]
    q = decide(10, reports, previous=prev).quorum
    assert q.contributors == (0, 1, 2) and q.diverged == () and q.verified_step == 10


def test_agreeing_digests_advance_the_verified_step():
    prev = quorum_of((0, 1), 9, round=9, verified_step=5)
    reports = [srep(r, 10, 10, digest="aa", digest_step=10) for r in (0, 1)]
    assert decide(10, reports, previous=prev, job=JobSpec(2, 1, 10.0, FP)).quorum.verified_step == 10
    reports = [srep(r, 10, 10) for r in (0, 1)]
    assert decide(10, reports, previous=prev, job=JobSpec(2, 1, 10.0, FP)).quorum.verified_step == 5


def _broken_rounds(members, blame, start_round=10, strikes_before=0, quarantine=()):
    prev = quorum_of(members, 5, round=start_round - 1, strikes=strikes_before, quarantine=quarantine)
    reports = [srep(r, 5, round=start_round, ring_ok=False, blame=blame.get(r, ())) for r in members]
    return decide(start_round, reports, previous=prev)


def test_ftar_only_partition_excludes_the_most_blamed_after_strikes():
    # r1-r2 link cut: each blames the other; r0's exchange failed towards r2 too.
    blame = {0: (2,), 1: (2,), 2: (1,)}
    for s in range(STRIKES - 1):
        d = _broken_rounds((0, 1, 2), blame, strikes_before=s)
        assert d.quorum.members == (0, 1, 2) and d.quorum.strikes == s + 1
    d = _broken_rounds((0, 1, 2), blame, strikes_before=STRIKES - 1)
    q = d.quorum
    assert q.members == (0, 1) and q.strikes == 0
    assert q.quarantine == ((2, 10 + QUARANTINE_ROUNDS, 1),)
    assert f"excluded r2 after {STRIKES} failed ring rounds (partition)" in d.reason


def test_symmetric_blame_excludes_the_higher_id():
    d = _broken_rounds((0, 1), {0: (1,), 1: (0,)}, strikes_before=STRIKES - 1)
    assert d.quorum.members == (0,) and d.quorum.quarantine[0][0] == 1


def test_quarantined_member_sits_out_then_returns_and_repeat_doubles():
    prev = quorum_of((0, 1), 5, round=11, quarantine=((2, 14, 1),))
    reports = [srep(0, 6, round=12), srep(1, 6, round=12), srep(2, 5, round=12)]
    assert decide(12, reports, previous=prev).quorum.members == (0, 1)
    reports = [dataclasses.replace(r, round=14) for r in reports]
    q = decide(14, reports, previous=dataclasses.replace(prev, round=13)).quorum
    assert q.members == (0, 1, 2) and q.lagging == (2,)
    assert q.quarantine == ((2, 14, 1),)  # not forgiven until a healthy round with it
    # it breaks the ring again: the next exclusion lasts twice as long
    d = _broken_rounds((0, 1, 2), {0: (2,), 1: (2,), 2: (0,)}, start_round=20, strikes_before=STRIKES - 1,
                       quarantine=((2, 14, 1),))
    assert d.quorum.quarantine == ((2, 20 + 2 * QUARANTINE_ROUNDS, 2),)


def test_healthy_round_forgives_a_returned_member():
    prev = quorum_of((0, 1, 2), 5, round=19, quarantine=((2, 14, 1),))
    q = decide(20, [srep(r, 6, round=20) for r in range(3)], previous=prev).quorum
    assert q.quarantine == ()


def test_membership_change_resets_strikes():
    prev = quorum_of((0, 1, 2), 5, round=9, strikes=2)
    q = decide(10, [srep(0, 5, 10, ring_ok=False, blame=(1,)), srep(1, 5, 10, ring_ok=False)], evicted={(2, 0)},
               previous=dataclasses.replace(prev, round=9)).quorum
    assert q.strikes == 0 and q.members == (0, 1)


def test_report_and_quorum_json_roundtrip_with_the_new_fields():
    r = srep(1, 3, digest="ab", digest_step=3, blame=(2,), bad=(40,), synced=False, gen=2)
    assert Report.from_json(r.to_json()) == r
    prev = quorum_of((0, 1), 60, round=70)
    q = decide(71, [srep(r, 0, round=71, inc=1, synced=False) for r in (0, 1)], evicted={(0, 0), (1, 0)},
               previous=prev, history=History(61, ((40, "/c"),)), waited_s=99).quorum
    assert Quorum.from_json(q.to_json()) == q


@pytest.mark.parametrize("seed", range(300))
def test_random_histories_never_lose_the_newest_state(seed):
    """Whatever survives, a round either trains from a member holding the newest committed
    state of its generation, or rewinds to the best state that exists (and says so)."""
    rng = random.Random(seed)
    R = rng.randint(1, 6)
    gen = rng.randint(0, 2)
    H = rng.randint(0, 30)
    prev = quorum_of(tuple(range(R)), max(0, H - 1), round=20, gen=gen, incs=(0,) * R)
    reports = {}
    for r in range(R):
        if rng.random() < 0.7:
            inc = rng.choice([0, 1])
            step = rng.choice([0, max(0, H - rng.randint(0, 3)), H]) if inc == 0 else rng.choice([0, 0, H])
            reports[r] = srep(r, step, round=21, inc=inc, gen=rng.choice([gen, gen, gen - 1]) if step else gen,
                              synced=rng.random() < 0.7)
    evicted = {(r, 0) for r in range(R) if r in reports and reports[r].incarnation == 1}
    ckpts = tuple((s, f"/c/{s}") for s in sorted(rng.sample(range(0, 31, 5), rng.randint(0, 3))) if s <= H)
    d = compute_quorum(21, reports, frozenset(evicted), prev, JobSpec(R, 1, 0.0, FP), 99.0, History(H, ckpts))
    q = d.quorum
    if q is None:
        return
    usable = {r: reports[r].step for r in q.members if reports[r].gen == gen or reports[r].step == 0}
    best = max(usable.values(), default=-1)
    if best >= H:
        assert q.rewind is None and q.gen == gen and q.max_step == best
        if q.kind == TRAIN:
            assert all(reports[r].step == best and reports[r].synced and reports[r].gen == gen
                       for r in q.contributors)
    else:
        ck = max((s for s, _ in ckpts), default=-1)
        assert q.rewind is not None and q.gen == gen + 1 and q.kind == SYNC
        assert q.max_step == max(best, ck) and q.rewind["to"] == q.max_step and q.rewind["from"] == H
        assert (q.rewind["checkpoint"] != "") == (ck > best)
    assert set(q.contributors) | set(q.lagging) == set(q.members) and len(q.contributors) >= 1
    if q.kind == SYNC:
        assert len(q.contributors) == 1


# -- steady rounds -------------------------------------------------------------------------------

from lightning_ft.coord.quorum import LocalView, must_abort, steady_eligible, steady_next  # noqa: E402


def _settled(**kw):
    q = decide(10, [srep(r, 10, round=10) for r in range(3)], previous=quorum_of((0, 1, 2), 9, round=9)).quorum
    return dataclasses.replace(q, cursors=(10, 10, 7), **kw)


CALM = LocalView(committed=True, changed=False, digest_due=False)


def test_a_settled_round_continues_steady_with_everything_advanced():
    q = _settled()
    n = steady_next(q, CALM)
    assert n.steady and n.round == q.round + 1 and n.max_step == q.max_step + 1 and n.epoch == q.epoch
    assert n.members == q.members and n.contributors == q.contributors and n.cursors == (11, 11, 8)
    assert n.reason == "round 11 epoch 0: steady (3 replicas, unchanged since round 10); max_step 11"
    assert steady_next(n, CALM).round == 12  # steady rounds chain


@pytest.mark.parametrize("view", [
    LocalView(committed=False, changed=False, digest_due=False),
    LocalView(committed=True, changed=True, digest_due=False),
    LocalView(committed=True, changed=False, digest_due=True),
    LocalView(committed=True, changed=False, digest_due=False, stop=True),
])
def test_any_local_reason_makes_the_next_round_full(view):
    assert steady_next(_settled(), view) is None


@pytest.mark.parametrize("change", [
    dict(kind=SYNC), dict(lagging=(2,), contributors=(0, 1)), dict(diverged=(1,)),
    dict(rewind={"from": 9, "to": 5, "checkpoint": "", "checkpoint_step": -1}), dict(stop=True),
    dict(quarantine=((4, 11, 1),)),
])
def test_rounds_that_are_not_settled_are_followed_by_full_rounds(change):
    q = _settled(**change)
    assert not steady_eligible(q) and steady_next(q, CALM) is None
    assert not must_abort(q, LocalView(committed=False, changed=True, digest_due=False))


def test_digests_that_agreed_on_the_ring_verify_the_round_s_step_in_the_next_steady_round():
    q = _settled(verified_step=0)
    n = steady_next(q, LocalView(committed=True, changed=False, digest_due=False, verified=q.max_step))
    assert n.verified_step == q.max_step
    assert steady_next(n, CALM).verified_step == q.max_step  # carried on
    # a digest step alone no longer makes a full round: the steady round compares on the ring
    assert steady_next(_settled(max_step=20), CALM) is not None


def test_a_quarantine_that_ends_later_does_not_stop_steady_rounds():
    assert steady_next(_settled(quarantine=((4, 30, 1),)), CALM) is not None


def test_who_must_abort_the_ring():
    q = _settled()
    assert must_abort(q, LocalView(committed=False, changed=False, digest_due=False))  # our commit failed
    assert must_abort(q, LocalView(committed=True, changed=True, digest_due=False))    # we saw a joiner
    assert must_abort(q, LocalView(committed=True, changed=False, digest_due=False, stop=True))
    assert not must_abort(q, CALM)                                                     # we go steady too
    # everyone goes full after digests disagreed on the ring (all read the same sums): no need to break it
    assert not must_abort(q, LocalView(committed=True, changed=False, digest_due=True))
    assert not must_abort(q, LocalView(committed=True, changed=True, digest_due=True))


@pytest.mark.parametrize("seed", range(200))
def test_steady_views_agree_or_someone_aborts(seed):
    """Whatever each leader sees locally, either every leader derives the same steady round,
    or at least one that goes full aborts the ring (so no one trains a steady round alone)."""
    rng = random.Random(seed)
    q = _settled()
    views = [LocalView(committed=rng.random() < 0.9, changed=rng.random() < 0.2, digest_due=False,
                       stop=rng.random() < 0.1) for _ in q.members]
    nexts = [steady_next(q, v) for v in views]
    if all(n is not None for n in nexts):
        assert len(set(nexts)) == 1
    elif any(n is not None for n in nexts):
        assert any(n is None and must_abort(q, v) for n, v in zip(nexts, views, strict=True))


def test_first_round_after_a_resume_in_the_same_keyspace_takes_the_ledgers_generation():
    d = decide(0, [srep(r, 40, round=0, synced=False, gen=3) for r in range(3)], history=History(0, gen=3))
    q = d.quorum
    assert q.gen == 3 and q.kind == SYNC and q.max_step == 40 and q.rewind is None


def test_a_ring_reset_without_blame_is_not_a_strike():
    """A member that aborts the others' steady rounds to go to a full round (or whose abort
    reached them) asks for a ring reset naming nobody: no evidence of a partition. Measured
    in a path cut (tests/launch/test_partitions.py): a quarantined member's report churn made
    the survivors go full and abort each other every round, and the unblamed resets added up
    to strikes that excluded a healthy survivor."""
    prev = quorum_of((0, 2), 5, round=16, strikes=STRIKES - 1)
    unblamed = [srep(0, 5, round=17, ring_ok=False), srep(2, 5, round=17, ring_ok=False)]
    q = decide(17, unblamed, previous=prev).quorum
    assert q.members == (0, 2) and q.strikes == 0 and q.epoch == prev.epoch + 1  # rebuilt, nobody excluded
    blamed = [srep(0, 5, round=17, ring_ok=False, blame=(2,)), srep(2, 5, round=17, ring_ok=False)]
    q = decide(17, blamed, previous=prev).quorum
    assert q.members == (0,) and q.strikes == 0  # a named failure is a strike: the third excludes


def test_steady_retraction_reports_for_the_failed_rounds_number():
    """A steady round that failed never happened for the member: it reports for that round's
    number again (Coordinator.retract_steady), so its report cannot count for the round after
    it while the aborting member decides the same number without it (a ring it never joins)."""
    prev = quorum_of((0, 2), 5, round=15)
    # r2 reports for 16 (retracted), r0 for 16: both are members of round 16
    q = decide(16, [srep(0, 6, round=16), srep(2, 6, round=16)], previous=prev).quorum
    assert q.members == (0, 2)
    # had r2 reported for 17 (not retracted), round 16 would take it in while it waits for 17
    q = decide(16, [srep(0, 6, round=16), srep(2, 6, round=17)], previous=prev).quorum
    assert 2 in q.members


def test_a_disowned_state_at_the_top_step_is_lagging_not_a_second_opinion():
    """The halted 100-fault soak: r1's lease lapsed while its ring completed (the others' failed),
    so it kept a step 10 that r0 redid without it. Its records were refused, so it reports no
    generation (ReplicaManager._report_state): r0 alone trains, r1 catches up; nothing halts."""
    prev = quorum_of((0,), 9, round=9, verified_step=5)
    reports = [srep(0, 10, 10, digest="aa", digest_step=10),
               srep(1, 10, 10, gen=-1, synced=False, digest="bb", digest_step=10)]
    d = decide(10, reports, previous=prev, job=JobSpec(2, 1, 10.0, FP), history=History(committed_step=10))
    q = d.quorum
    assert d.halt == "" and q is not None and q.kind == TRAIN, d.reason
    assert q.contributors == (0,) and q.lagging == (1,) and q.diverged == ()
    assert adopt_role(q, 1) == "catchup"


def test_only_disowned_states_left_rewind_to_the_checkpoint_instead_of_adopting_one():
    prev = quorum_of((0, 1), 9, round=9)
    reports = [srep(1, 10, 10, gen=-1, synced=False)]
    d = decide(10, reports, previous=prev, job=JobSpec(2, 1, 10.0, FP),
               history=History(committed_step=10, checkpoints=((8, "/c/step_8"),)))
    q = d.quorum
    assert q is not None and q.kind == SYNC and q.rewind["to"] == 8 and q.rewind["checkpoint"] == "/c/step_8", d.reason


# -- rule 8, provenance: the same step made by two rounds ------------------------------------------

def test_a_state_made_by_an_older_round_at_the_top_step_is_stale_and_catches_up():
    """r2 committed step 9 in round 7 (epoch 3) just as its lease lapsed; r0 and r1 redid step 9
    without it in round 9 (epoch 4). Its ledger records went in anyway (say it was excluded, not
    fenced), so it reports its generation: only provenance tells the two step-10 states apart."""
    prev = quorum_of((0, 1), 10, round=9, epoch=4)
    reports = [srep(0, 10, 10, made=(9, 4), digest="aa", digest_step=10),
               srep(1, 10, 10, made=(9, 4), digest="aa", digest_step=10),
               srep(2, 10, 10, made=(7, 3), digest="bb", digest_step=10)]
    d = decide(10, reports, previous=prev, job=JobSpec(3, 1, 10.0, FP), history=History(committed_step=10))
    q = d.quorum
    assert d.halt == "" and q.kind == TRAIN and q.contributors == (0, 1) and q.lagging == (2,), d.reason
    assert q.diverged == () and adopt_role(q, 2) == "catchup"
    assert "stale r2 at step 10: made by round 7 (r2), which round 9 redid without them" in d.reason


def test_provenance_prevents_a_halt_when_two_disagreeing_states_are_left():
    """The halted soak's shape: one member down, the two left at the same step with different
    digests. Without provenance this is 'no majority' (a halt); with it the older one heals."""
    prev = quorum_of((0,), 10, round=12, epoch=6)
    reports = [srep(0, 10, 13, made=(12, 6), digest="aa", digest_step=10),
               srep(1, 10, 13, made=(8, 5), digest="bb", digest_step=10)]
    d = decide(13, reports, previous=prev, job=JobSpec(3, 1, 10.0, FP), history=History(committed_step=10))
    q = d.quorum
    assert d.halt == "" and q.contributors == (0,) and q.lagging == (1,), d.reason
    # The same reports without provenance: no majority, the job halts.
    bare = [dataclasses.replace(r, made=(-1, -1)) for r in reports]
    assert decide(13, bare, previous=prev, job=JobSpec(3, 1, 10.0, FP),
                  history=History(committed_step=10)).halt != ""


def test_a_full_round_that_redoes_a_failed_steady_round_wins_by_its_epoch():
    """A steady round and the full round that replaces it can share a round number (retract_steady):
    the full one has the higher epoch (ring reset or membership change), so it is the newer."""
    prev = quorum_of((0, 1), 5, round=6, epoch=3)
    reports = [srep(0, 6, 7, made=(6, 3)), srep(1, 6, 7, made=(6, 2))]
    q = decide(7, reports, previous=prev, job=JobSpec(2, 1, 10.0, FP), history=History(committed_step=6)).quorum
    assert q.contributors == (0,) and q.lagging == (1,)


def test_states_made_by_the_same_round_all_contribute():
    prev = quorum_of((0, 1, 2), 10, round=9, epoch=4)
    reports = [srep(r, 10, 10, made=(9, 4)) for r in range(3)]
    d = decide(10, reports, previous=prev, job=JobSpec(3, 1, 10.0, FP), history=History(committed_step=10))
    assert d.quorum.contributors == (0, 1, 2) and d.quorum.lagging == () and "stale" not in d.reason


def test_a_lagging_member_made_by_an_old_round_is_only_lagging():
    """Provenance compares states at the top step only: a member behind is lagging anyway."""
    prev = quorum_of((0, 1), 10, round=9, epoch=4)
    reports = [srep(0, 10, 10, made=(9, 4)), srep(1, 8, 10, made=(20, 9))]
    q = decide(10, reports, previous=prev, job=JobSpec(2, 1, 10.0, FP), history=History(committed_step=10)).quorum
    assert q.contributors == (0,) and q.lagging == (1,) and q.max_step == 10


def test_a_rewind_and_a_sync_take_the_newest_made_state_as_source():
    # Rewind: the job reached 12, only states at 10 survive; r2's is the newer of the two.
    prev = quorum_of((0, 1, 2), 12, round=20, epoch=8)
    reports = [srep(1, 10, 21, made=(14, 6)), srep(2, 10, 21, made=(17, 7))]
    q = decide(21, reports, previous=prev, job=JobSpec(3, 1, 10.0, FP), history=History(committed_step=12)).quorum
    assert q.kind == SYNC and q.rewind is not None and q.source == 2 and q.max_step == 10
    # Sync (nobody synced): the newest-made state at the top is everyone's.
    reports = [srep(0, 10, 0, synced=False, made=(3, 1)), srep(1, 10, 0, synced=False, made=(5, 2))]
    q = decide(0, reports, job=JobSpec(2, 1, 0.0, FP)).quorum
    assert q.kind == SYNC and q.source == 1


def test_the_made_field_round_trips_through_json_and_defaults_for_old_reports():
    r = srep(0, 3, 4, made=(4, 2))
    assert Report.from_json(r.to_json()) == r
    old = json.loads(r.to_json())
    del old["made"]
    assert Report.from_json(json.dumps(old).encode()).made == (-1, -1)


# -- waiting_for: the decider's cheap check on the reports its watch delivered -----------------

def _waiting_cases():
    full = prev_of(rep(0), rep(1), rep(2), round=4)
    two = prev_of(rep(0), rep(1), round=4)
    return [
        ("fresh start, one missing", 0, [rep(0), rep(1)], (), None, 0.0),
        ("fresh start, all in", 0, [rep(0), rep(1), rep(2)], (), None, 0.0),
        ("fresh start, init timeout passed", 0, [rep(0)], (), None, 10.0),
        ("previous member not yet reported", 5, [rep(0, round=5), rep(1, round=5), rep(2, round=4)], (), full, 0.0),
        ("every previous member reported", 5, [rep(0, round=5), rep(1, round=5), rep(2, round=5)], (), full, 0.0),
        ("a dead member's key is gone", 5, [rep(0, round=5), rep(1, round=5)], (), full, 0.0),
        ("an evicted member is not waited for", 5, [rep(0, round=5), rep(1, round=5), rep(2, round=4)],
         {(2, 0)}, full, 0.0),
        ("a new incarnation replaced a member", 5, [rep(0, round=5), rep(1, inc=1, round=4), rep(2, round=5)],
         (), full, 0.0),
        ("a joiner is never waited for", 5, [rep(0, round=5), rep(1, round=5)], (), two, 0.0),
        ("a report for an older round does not count", 5, [rep(0, round=5), rep(1, round=3)], (), two, 0.0),
    ]


@pytest.mark.parametrize("case", _waiting_cases(), ids=lambda c: c[0])
def test_waiting_for_says_exactly_when_compute_quorum_would_wait(case):
    from lightning_ft.coord.quorum import waiting_for

    _, rnd, reports, evicted, previous, waited = case
    d = decide(rnd, reports, evicted, previous, waited_s=waited)
    why = waiting_for(rnd, {r.rid: r for r in reports}, frozenset(evicted), previous, JOB, waited)
    if d.quorum is not None:
        assert why == ""
    else:
        assert why == d.reason and why
