"""Stragglers: the pure detection (coord/stragglers.py) and quorum rule 14, table-driven."""
from __future__ import annotations

import json

import pytest

from lightning_ft.coord import stragglers
from lightning_ft.coord.quorum import compute_quorum, steady_eligible
from lightning_ft.coord.round_records import History, JobSpec, Quorum, Report
from lightning_ft.coord.stragglers import EXCLUDE, WAIT

FP = {"job": "j"}


@pytest.mark.parametrize("compute,want", [
    ({0: 10, 1: 10, 2: 30}, {0: 0.5, 1: 0.5, 2: 3.0}),      # median of the others
    ({0: 10, 1: 20}, {0: 0.5, 1: 2.0}),                      # two: each against the other
    ({0: 10, 1: -1, 2: 30}, {0: 1 / 3, 2: 3.0}),             # unmeasured replicas are left out
    ({0: 10, 1: -1, 2: -1}, {}),                             # one measured: nothing to compare with
    ({}, {}),
    ({0: 10, 1: 11, 2: 12, 3: 40}, {0: 10 / 12, 1: 11 / 12, 2: 12 / 11, 3: 40 / 11}),
])
def test_ratio_is_own_compute_over_the_median_of_the_others(compute, want):
    got = stragglers.ratios(compute)
    assert set(got) == set(want)
    for r, x in want.items():
        assert got[r] == pytest.approx(x)


@pytest.mark.parametrize("compute,threshold,want", [
    ({0: 100, 1: 100, 2: 130}, 1.3, [2]),     # exactly at the threshold counts
    ({0: 100, 1: 100, 2: 129}, 1.3, []),
    ({0: 100, 1: 100, 2: 300}, 0, []),        # 0 = detection off
    ({0: 100, 1: 300, 2: 300}, 1.3, []),      # a fast one is no straggler: most are slow
    ({0: 100, 1: 140, 2: 300}, 1.3, [2]),
    ({0: 2.0, 1: 2.0, 2: 6.9}, 1.3, []),      # 3.45x, but 4.9 ms: noise of a tiny step
    ({0: 2.0, 1: 2.0, 2: 7.0}, 1.3, [2]),
])
def test_flag_by_threshold(compute, threshold, want):
    assert sorted(stragglers.flag(compute, threshold)) == want


R = 3
"""The job's replicas in the tables below (members (0, 1, 2))."""


W = 10
"""stragglers.window in the tables below."""
SEEN = tuple((r, 0, 0) for r in range(8))
"""Every replica a suspect since round 0: a flag by a measure of round >= W confirms it (the
tables that are about what happens to a straggler, not how it is confirmed)."""


def M(**ms):
    """Measures at round 100: {rid: (ms, 100)}."""
    return {int(k[1:]): (float(v), 100) for k, v in ms.items()}


RULES = stragglers.Rules(1.3, EXCLUDE, 1, R, W)


def D(round, measures, members, slow, policy, min_replicas, replicas, suspects=SEEN):
    """stragglers.decide with window W; its (stragglers, excluded, slow)."""
    v = stragglers.decide(round, measures, members, stragglers.Rules(1.3, policy, min_replicas, replicas, W),
                          stragglers.Standing(slow, (), suspects))
    return v.stragglers, v.excluded, v.standing.slow


def test_exclude_benches_the_slowest():
    flagged, victim, slow = D(101, M(r0=10, r1=10, r2=40), (0, 1, 2), (), EXCLUDE, 1, R)
    assert stragglers.MIN_EXCESS_MS <= 30
    assert sorted(flagged) == [2] and victim == (2, 101, 1) and slow == (victim,)


def test_wait_only_reports_and_min_replicas_keeps_the_straggler_in():
    flagged, victim, slow = D(5, M(r0=10, r1=10, r2=40), (0, 1, 2), (), WAIT, 1, R)
    assert sorted(flagged) == [2] and victim is None and slow == ()
    flagged, victim, slow = D(5, M(r0=10, r1=10, r2=40), (0, 1, 2), (), EXCLUDE, 3, R)
    assert sorted(flagged) == [2] and victim is None and slow == ()


def test_ties_exclude_the_highest_id_and_only_one_per_round():
    flagged, victim, slow = D(5, M(r0=10, r1=10, r2=40, r3=40), (0, 1, 2, 3), (), EXCLUDE, 1, 4)
    assert sorted(flagged) == [2, 3] and victim[0] == 3 and [e[0] for e in slow] == [3]


@pytest.mark.parametrize("replicas, cap", [(1, 1), (2, 1), (3, 1), (4, 1), (5, 2), (6, 2), (7, 3), (12, 5)])
def test_a_minority_of_the_job_sits_out_at_most(replicas, cap):
    assert stragglers.max_excluded(replicas) == cap


def test_no_second_exclusion_while_the_cap_is_reached():
    """The soak under `exclude` on a loaded host: r2 is benched; r0 and r1, slowed in turn by
    the same load, must not follow it (the job would train on one replica of three)."""
    probe = {2: stragglers.Probe(40.0, 1.0, 150, 1.0)}
    v = stragglers.decide(160, M(r0=10, r1=40, r3=10), (0, 1, 3), stragglers.Rules(1.3, EXCLUDE, 1, 4, W),
                          stragglers.Standing(((2, 150, 1),), (), SEEN), probe)
    assert sorted(v.stragglers) == [1] and v.excluded is None and v.standing.slow == ((2, 150, 1),)
    # five replicas: two may sit out at once, not three
    one_out = ((4, 150, 1),)
    v = stragglers.decide(160, M(r0=10, r1=10, r2=10, r3=40), (0, 1, 2, 3), stragglers.Rules(1.3, EXCLUDE, 1, 5, W),
                          stragglers.Standing(one_out, (), SEEN), {4: stragglers.Probe(40.0, 1.0, 150, 1.0)})
    assert v.excluded == (3, 160, 1) and v.standing.slow == ((3, 160, 1), (4, 150, 1))
    two_out = ((3, 150, 1), (4, 150, 1))
    v = stragglers.decide(160, M(r0=10, r1=10, r2=40), (0, 1, 2), stragglers.Rules(1.3, EXCLUDE, 1, 5, W),
                          stragglers.Standing(two_out, (), SEEN),
                          {r: stragglers.Probe(30.0, 1.0, 150, 1.0) for r in (3, 4)})
    assert sorted(v.stragglers) == [2] and v.excluded is None and v.standing.slow == two_out


@pytest.mark.parametrize("compute,replicas,want", [
    ({0: 10, 1: 10, 2: 40}, 3, [2]),
    ({0: 10, 2: 40}, 3, []),              # two of three measured: no majority to compare with
    ({0: 10, 1: -1, 2: 40}, 3, []),
    ({0: 10, 2: 40}, 2, [2]),             # a job of two has no third
    ({0: 10, 1: 10, 2: 40}, 8, [2]),      # three measured are enough in a larger job
])
def test_a_replica_is_flagged_only_against_a_majority_of_measured_others(compute, replicas, want):
    assert sorted(stragglers.flag(compute, 1.3, stragglers.least_measured(replicas))) == want


# -- rule 14 in compute_quorum ------------------------------------------------------------------

JOB_X = JobSpec(3, 1, 10.0, FP, straggler_threshold=1.3, straggler_policy=EXCLUDE)
JOB_W = JobSpec(3, 1, 10.0, FP, straggler_threshold=1.3, straggler_policy=WAIT)


def rep(rid, step, round, ms=-1.0, at=-1):
    return Report(rid=rid, incarnation=0, step=step, round=round, fingerprint=FP, made=(round - 1, 0),
                  compute_ms=ms, compute_round=at)


def prev(members, step, round, **kw):
    return Quorum(round=round, epoch=0, members=tuple(members), incarnations=(0,) * len(members), max_step=step,
                  contributors=tuple(members), lagging=(), cursors=(step,) * len(members), **kw)


def decide(round, reports, previous, job):
    return compute_quorum(round, {r.rid: r for r in reports}, frozenset(), previous, job, 0.0, History(50))


def brep(rid, step, round, ms, since, probe_s=1.0, out_s=1.0, inc=0):
    """A benched replica's report: its probe (compute_ms) over probe_s seconds, benched in `since`."""
    return Report(rid=rid, incarnation=inc, step=step, round=round, fingerprint=FP, made=(since - 1, 0),
                  compute_ms=ms, bench=since, probe_s=probe_s, bench_s=out_s)


def test_exclude_policy_benches_the_straggler_and_readmits_it_once_its_pace_is_back():
    p = prev((0, 1, 2), 50, 9)
    # flagged once: a suspect, still a member, nothing reported
    d = decide(10, [rep(0, 50, 10, 10, 9), rep(1, 50, 10, 11, 9), rep(2, 50, 10, 35, 9)], p, JOB_X)
    assert d.quorum.members == (0, 1, 2) and d.quorum.suspects == ((2, 9, 9),) and d.stragglers == {}
    assert d.excluded_straggler is None and "straggler" not in d.reason and d.quorum.pace_ms == 11
    # the suspects travel through the record (and a steady round copies the record)
    p = Quorum.from_json(d.quorum.to_json())
    assert p.suspects == ((2, 9, 9),) and p.pace_ms == 11
    # flagged again by a window that overlaps the first: still a suspect
    p = Quorum(**{**p.__dict__, "round": 14, "max_step": 54})
    d = decide(15, [rep(0, 54, 15, 10, 14), rep(1, 54, 15, 11, 14), rep(2, 54, 15, 35, 14)], p, JOB_X)
    assert d.quorum.members == (0, 1, 2) and d.quorum.suspects == ((2, 9, 14),) and d.stragglers == {}
    # ... and by one that does not (measured `window` rounds after the first): benched
    p = Quorum(**{**d.quorum.__dict__, "round": 19, "max_step": 59})
    d = decide(20, [rep(0, 59, 20, 10, 19), rep(1, 59, 20, 11, 19), rep(2, 59, 20, 35, 19)], p, JOB_X)
    q = d.quorum
    assert q.members == (0, 1) and q.contributors == (0, 1) and q.slow == ((2, 20, 1),) and q.suspects == ()
    assert d.excluded_straggler == (2, 20, 1) and d.stragglers[2] == pytest.approx(35 / 10.5)
    assert "straggler r2 (3.33x the others' compute); r2 benched (exclusion 1)" in d.reason
    assert Quorum.from_json(q.to_json()).slow == q.slow
    # benched: not waited for (no report for this round), not a member, and no steady round ends it
    d = decide(21, [rep(0, 60, 21, 10, 20), rep(1, 60, 21, 10, 20), rep(2, 59, 20, 35, 19)], q, JOB_X)
    assert d.quorum is not None and d.quorum.members == (0, 1) and d.quorum.slow == q.slow
    assert steady_eligible(d.quorum)
    # a benched replica whose report is gone (it died) leaves the bench; its count goes on
    gone = decide(21, [rep(0, 60, 21, 10, 20), rep(1, 60, 21, 10, 20)], q, JOB_X).quorum
    assert gone.slow == () and gone.parole == ((2, 21, 1),) and gone.members == (0, 1)
    # much later: its report (the round it reported for is long past) still counts; its probe is slow
    late = Quorum(**{**d.quorum.__dict__, "round": 400, "max_step": 439})
    reps = [rep(0, 440, 401, 10, 400), rep(1, 440, 401, 10, 400)]
    d = decide(401, reps + [brep(2, 60, 21, 33, 20)], late, JOB_X)
    assert d.quorum.members == (0, 1) and d.quorum.slow == ((2, 20, 1),) and d.readmitted == {}
    assert "benched r2" in d.reason
    # its pace is back: readmitted, as a member that lags (it catches up), on parole
    d = decide(401, reps + [brep(2, 60, 21, 11, 20)], late, JOB_X)
    assert d.quorum.members == (0, 1, 2) and d.quorum.lagging == (2,) and d.quorum.slow == ()
    assert d.quorum.parole == ((2, 401, 1),) and d.readmitted == {2: (1, 1.1)}
    assert "readmitted r2 (1.10x the pace)" in d.reason
    assert Quorum.from_json(d.quorum.to_json()).parole == d.quorum.parole


def test_a_benched_replica_is_set_aside_before_the_partition_rule():
    """Rule 5 compares the members with the previous round's: a benched replica's report (which
    counts for every round) must not make them look changed and reset the strikes."""
    q = prev((0, 1), 60, 20, slow=((2, 20, 1),), strikes=1, pace_ms=10.0)
    reps = {0: Report(rid=0, incarnation=0, step=60, round=21, fingerprint=FP, ring_ok=False, blame=(1,)),
            1: Report(rid=1, incarnation=0, step=60, round=21, fingerprint=FP, ring_ok=False, blame=(0,)),
            2: brep(2, 50, 3, 40, 20)}
    d = compute_quorum(21, reps, frozenset(), q, JOB_X, 0.0, History(60))
    assert d.quorum.strikes == 2 and d.quorum.members == (0, 1)


def test_wait_policy_reports_the_straggler_and_keeps_it_training():
    p = prev((0, 1, 2), 50, 9, suspects=((2, -1, -1),))
    d = decide(10, [rep(0, 50, 10, 10, 9), rep(1, 50, 10, 10, 9), rep(2, 50, 10, 35, 9)], p, JOB_W)
    assert d.quorum.suspects == ((2, -1, 9),)  # under "wait" it stays one (and stays reported)
    assert d.quorum.contributors == (0, 1, 2) and d.quorum.slow == () and d.excluded_straggler is None
    assert list(d.stragglers) == [2] and "straggler r2 (3.50x" in d.reason


def test_off_by_default_and_old_records_decode():
    p = prev((0, 1, 2), 50, 9)
    d = decide(10, [rep(0, 50, 10, 10, 9), rep(1, 50, 10, 10, 9), rep(2, 50, 10, 35, 9)], p,
               JobSpec(3, 1, 10.0, FP))
    assert d.stragglers == {} and d.quorum.members == (0, 1, 2)
    q = Quorum.from_json(json.dumps({k: v for k, v in json.loads(p.to_json()).items() if k != "slow"}).encode())
    assert q.slow == ()
    r = Report.from_json(json.dumps({"rid": 1, "incarnation": 0, "step": 3, "round": 4}).encode())
    assert r.compute_ms == -1.0 and r.compute_round == -1
    q2 = Quorum.from_json(prev((0, 1), 5, 3, slow=((2, 9, 1),)).to_json())
    assert q2.slow == ((2, 9, 1),)


# -- confirmation: two windows that do not overlap ---------------------------------------------

class V(tuple):
    """stragglers.decide's verdict, with the standing's fields at hand."""

    def __new__(cls, round, measures, members=(0, 1, 2), suspects=(), slow=(), policy=EXCLUDE, parole=(), probes=None):
        v = stragglers.decide(round, measures, members, stragglers.Rules(1.3, policy, 1, R, W),
                              stragglers.Standing(slow, parole, suspects), probes)
        out = super().__new__(cls, v)
        out.v = v
        return out

    stragglers = property(lambda self: self.v.stragglers)
    excluded = property(lambda self: self.v.excluded)
    slow = property(lambda self: self.v.standing.slow)
    parole = property(lambda self: self.v.standing.parole)
    suspects = property(lambda self: self.v.standing.suspects)


def at(round, **ms):
    return {int(k[1:]): (float(v), round) for k, v in ms.items()}


def test_one_slow_window_makes_a_suspect_and_a_second_one_that_does_not_overlap_a_straggler():
    v = V(100, at(100, r0=10, r1=10, r2=40))
    assert v.stragglers == {} and v.excluded is None and v.slow == () and v.suspects == ((2, 100, 100),)
    s = v.suspects
    for newer in range(101, 100 + W):  # measures whose windows overlap the first: only the newest flag moves
        s = V(newer, at(newer, r0=10, r1=10, r2=40), suspects=s).suspects
        assert s == ((2, 100, newer),), newer
    v = V(100 + W, at(100 + W, r0=10, r1=10, r2=40), suspects=s)
    assert list(v.stragglers) == [2] and v.excluded == (2, 100 + W, 1)
    assert v.suspects == ()  # excluded: measured afresh when it is back


@pytest.mark.parametrize("then, excluded, suspects", [
    (at(110, r0=10, r1=10, r2=40), True, ()),                  # slow again: a straggler
    (at(110, r0=10, r1=10, r2=11), False, ()),                 # a whole window within the threshold: cleared
    (at(110, r0=10, r1=10, r2=-1), False, ((2, 100, 100),)),   # not measured (it lagged): still a suspect
    (at(110, r0=10, r1=10), False, ((2, 100, 100),)),          # no report of it (rule 5 took it out): still one
])
def test_the_next_window_that_does_not_overlap_decides_and_windows_between_do_not(then, excluded, suspects):
    v = V(100, at(100, r0=10, r1=10, r2=40))
    v = V(105, at(105, r0=10, r1=10, r2=11), suspects=v.suspects)  # a clean window that overlaps: nothing
    assert v.suspects == ((2, 100, 100),) and v.excluded is None
    v = V(110, then, suspects=v.suspects)
    assert (v.excluded is not None) == excluded and v.suspects == suspects


def test_a_clean_window_among_slow_ones_does_not_clear_a_suspect():
    """CI: the throttled replica (stopped 0.2 s in every 0.3 s) came back from its second
    probation and trained 82 rounds before its third exclusion: its stops landed in its compute
    or in the exchange by chance, so some windows were clean, and when the one measure `window`
    rounds after the first flag was clean the suspect was cleared and started over. Now a clean
    measure clears it only a whole window after its newest flag."""
    v = V(100, at(100, r0=10, r1=10, r2=40))
    v = V(107, at(107, r0=10, r1=10, r2=40), suspects=v.suspects)  # slow again, overlapping
    assert v.suspects == ((2, 100, 107),)
    v = V(110, at(110, r0=10, r1=10, r2=11), suspects=v.suspects)  # clean, but 3 rounds after a flag
    assert v.excluded is None and v.suspects == ((2, 100, 107),)
    v = V(112, at(112, r0=10, r1=10, r2=40), suspects=v.suspects)  # slow, 12 rounds after the first
    assert list(v.stragglers) == [2] and v.excluded == (2, 112, 1)
    # a healthy replica's load blip: flagged for a window's worth of sliding measures, then clean
    s = V(100, at(100, r0=10, r1=10, r2=40)).suspects
    for r in range(101, 110):
        s = V(r, at(r, r0=10, r1=10, r2=40), suspects=s).suspects
    for r in range(110, 119):  # clean, within a window of its newest flag (109): still a suspect
        s = V(r, at(r, r0=10, r1=10, r2=11), suspects=s).suspects
        assert s == ((2, 100, 109),), r
    assert V(119, at(119, r0=10, r1=10, r2=11), suspects=s).suspects == ()


def test_old_records_suspects_of_two_fields_still_decide():
    v = V(110, at(110, r0=10, r1=10, r2=40), suspects=((2, 100),))
    assert v.excluded == (2, 110, 1)
    assert V(110, at(110, r0=10, r1=10, r2=11), suspects=((2, 100),)).suspects == ()


def test_a_suspect_on_parole_is_not_forgiven_and_its_next_exclusion_counts_on():
    """CI: the throttled replica, back from its first exclusion, had clean windows among its slow
    ones; one of them forgave it (its count started again) while it was a suspect. A suspect on
    parole is not forgiven; benched again, its exclusion is the second (a longer probe span)."""
    back = ((2, 100, 1),)
    v = V(500, at(500, r0=10, r1=10, r2=40), parole=back)
    assert v.suspects == ((2, 500, 500),)
    v = V(505, at(505, r0=10, r1=10, r2=11), parole=back, suspects=v.suspects)
    assert v.parole == back  # a suspect: not forgiven, FORGIVE_ROUNDS or not
    v = V(510, at(510, r0=10, r1=10, r2=40), parole=back, suspects=v.suspects)
    assert v.excluded == (2, 510, 2) and v.parole == () and v.slow == ((2, 510, 2),)
    assert stragglers.probe_span(2) == 2 * stragglers.probe_span(1)


def test_a_suspect_that_left_the_members_is_forgotten():
    v = V(100, at(100, r0=10, r1=10, r2=40))
    v = V(101, at(101, r0=10, r1=10), members=(0, 1), suspects=v.suspects)
    assert v.suspects == ()


def test_the_ci_false_flag_a_load_blip_of_a_healthy_replica_while_the_straggler_is_back_unmeasured():
    """CI (issue 27, and again in the note of issue 42): r1 (throttled) came back from its
    probation, unmeasured for `window` rounds; r0 and r2 were then compared one to one, and
    load on r0 excluded it, again and again, which kept r1 in (at most one replica of three
    sits out). Two measured replicas of three are no majority: nobody is flagged; r1, slow in
    two windows once measured, is benched."""
    back = ((1, 164, 1),)
    v = V(165, {0: (16.0, 165), 1: (-1.0, -1), 2: (11.0, 165)}, parole=back)
    assert v.excluded is None and v.suspects == () and v.stragglers == {}
    v = V(175, {0: (16.0, 175), 1: (40.0, 175), 2: (11.0, 175)}, parole=back, suspects=v.suspects)
    assert v.excluded is None and v.suspects == ((1, 175, 175),)
    v = V(185, {0: (16.0, 185), 1: (40.0, 185), 2: (11.0, 185)}, parole=back, suspects=v.suspects)
    assert v.excluded == (1, 185, 2) and v.suspects == ()
    # benched, its probe counts among the others': r0 (1.45x r2) is not flagged against r2 alone
    v = V(195, {0: (16.0, 195), 2: (11.0, 195)}, members=(0, 2), slow=((1, 185, 2),),
          probes={1: stragglers.Probe(40.0, 2.0, 185, 2.0)})
    assert v.stragglers == {} and v.suspects == () and v.slow == ((1, 185, 2),)


def test_wait_reports_a_straggler_only_once_confirmed():
    v = V(100, at(100, r0=10, r1=10, r2=40), policy=WAIT)
    assert v.stragglers == {} and v.suspects == ((2, 100, 100),)
    v = V(110, at(110, r0=10, r1=10, r2=40), policy=WAIT, suspects=v.suspects)
    assert list(v.stragglers) == [2] and v.excluded is None and v.suspects == ((2, 100, 110),)
