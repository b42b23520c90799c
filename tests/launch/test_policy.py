"""launch/policy.py: the supervisor's decisions as tables (no processes, no etcd, no clock)."""
from __future__ import annotations

from dataclasses import replace

import itertools

import pytest

from lightning_ft.launch.policy import (Done, ExitFailed, Facts, Halted, History, Hung, Launch, Leaving, Limits,
                                        LogExit, Missing, Need, NotRestarted, Pending, Promote, Seen, View, Wait,
                                        after_failure, next_action, restart_action)

LIM = Limits(start_timeout_s=60.0, hang_grace_s=2.0, exit_timeout_s=30.0, crash_loop=3, max_restarts=5)
NOW = 1000.0


def view(codes=(None, None), **kw) -> View:
    base = dict(rid=1, incarnation=2, codes=tuple(codes), pids=(101, 102))
    return View(**{**base, **kw})


def kinds(actions) -> list[str]:
    return [type(a).__name__ for a in actions]


# -- exits ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("codes,halted,want", [
    # codes per rank        halt key  -> actions
    ((None, None), None, []),
    ((0, None), None, ["LogExit", "Leaving"]),
    ((None, 0), None, ["LogExit", "Leaving"]),
    ((0, 0), None, ["LogExit", "LogExit", "Done"]),
    ((1, None), None, ["Need"]),
    ((1, None), False, ["ExitFailed"]),
    ((1, None), True, ["Halted"]),
    ((0, -9), False, ["ExitFailed"]),  # a failure beats a clean exit beside it
    ((86, 86), True, ["Halted"]),
    ((86, None), False, ["ExitFailed"]),  # the key decides, not the code (a program may exit 86 itself)
])
def test_exits(codes, halted, want):
    assert kinds(next_action(view(codes), NOW, LIM, Facts(halted=halted))) == want


def test_the_first_failed_rank_is_named_with_the_launchers_kill_reason():
    (a,) = next_action(view((None, -9, 3), pids=(1, 2, 3), kill_reason="injected: kill"), NOW, LIM,
                       Facts(halted=False))
    assert a == ExitFailed(1, -9, "rank 1 exited with -9 (injected: kill)")
    (h,) = next_action(view((None, 86)), NOW, LIM, Facts(halted=True))
    assert h == Halted(1, 86)


def test_a_logged_clean_exit_is_not_logged_again_and_the_exit_timeout_runs_from_the_first_sight():
    v = view((0, None), logged_exits=frozenset({0}), leaving_since=NOW - 29.0)
    assert next_action(v, NOW, LIM) == (Leaving(),)
    (h,) = next_action(v, NOW + 1.0, LIM)
    assert isinstance(h, Hung) and h.reason.startswith("hung on exit for 30s (supervisor.exit_timeout_s=30)")
    assert "rank 0 exited 0 but ranks [1] still run" in h.reason and not h.diagnosed
    # exit_timeout_s = 0: never hung on exit
    assert next_action(v, NOW + 1e6, Limits(exit_timeout_s=0.0)) == (Leaving(),)


def test_a_rank_stopped_on_its_way_out_is_hung_after_the_grace_not_the_exit_timeout():
    """The soak's hang fault can SIGSTOP a leader that is already leaving (it left the job after
    an exception): stopped, it never exits, so waiting exit_timeout_s (20-30 s) for it only delays
    its restart. Stopped past hang_grace_s, it is hung at once; running, it keeps its exit timeout."""
    v = view((0, None), logged_exits=frozenset({0}), leaving_since=NOW - 1.0, stopped=(1,))
    assert next_action(v, NOW, LIM) == (Leaving(),)  # within hang_grace_s (2 s)
    (h,) = next_action(v, NOW + 1.0, LIM)
    assert isinstance(h, Hung) and h.reason.startswith("hung on exit: rank 1 is stopped (SIGSTOP) 2s after")
    assert "rank 0 exited 0 but ranks [1] still run" in h.reason and not h.dump  # no stack from a stopped rank
    assert next_action(replace(v, stopped=()), NOW + 1.0, LIM) == (Leaving(),)
    # a leader that left the job cleanly, then was stopped
    left = view((None,), watched=True, member_seen=True, missing_since=NOW - 10.0, leaving_since=NOW - 5.0,
                stopped=(0,))
    (h,) = next_action(left, NOW, LIM, Facts(left_cleanly=True))
    assert isinstance(h, Hung) and "rank 0 is stopped (SIGSTOP) 5s after" in h.reason and "left the job" in h.reason
    # exit_timeout_s = 0 (never hung on exit) covers a stopped rank too
    assert next_action(v, NOW + 1e6, Limits(exit_timeout_s=0.0)) == (Leaving(),)


# -- hangs ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("member_seen,missing_since,started_at,now,want", [
    (False, None, NOW - 10, NOW, []),                     # still starting
    (False, None, NOW - 60, NOW, ["Hung"]),               # not registered within start_timeout_s
    (False, None, 0.0, NOW, []),                          # start unknown: no initialization timeout
    (True, None, NOW - 100, NOW, ["Missing"]),            # its member key first seen gone
    (True, NOW - 1.0, NOW - 100, NOW, []),                # within the grace
    (True, NOW - 2.0, NOW - 100, NOW, ["Need"]),          # past it: did it leave cleanly?
])
def test_hangs_without_a_report(member_seen, missing_since, started_at, now, want):
    v = view(watched=True, member_seen=member_seen, missing_since=missing_since, started_at=started_at)
    assert kinds(next_action(v, now, LIM)) == want


def test_a_vanished_member_is_hung_unless_its_leader_left_cleanly():
    v = view(watched=True, member_seen=True, missing_since=NOW - 2.5)
    (h,) = next_action(v, NOW, LIM, Facts(left_cleanly=False))
    assert h == Hung("hung: members/1 of incarnation 2 vanished (lease expired) 2.5s ago while rank 0 (pid 101) "
                     "still runs", diagnosed=True)
    assert next_action(v, NOW, LIM, Facts(left_cleanly=True)) == (Leaving(),)
    (h,) = next_action(view(watched=True, member_seen=True, missing_since=NOW - 40, leaving_since=NOW - 30), NOW,
                       LIM, Facts(left_cleanly=True))
    assert isinstance(h, Hung) and "left the job (left/1/2) but rank 0 (pid 101) still runs" in h.reason


def test_a_report_of_this_incarnation_is_seen_and_unwatched_replicas_get_no_hang_rules():
    v = view(watched=True, report={"step": 7, "compute_ms": 12.5, "incarnation": 2}, member_seen=False,
             started_at=NOW - 1e6)
    assert next_action(v, NOW, LIM) == (Seen(7, 12.5),)
    assert next_action(view(watched=True, report={"incarnation": 2}), NOW, LIM) == (Seen(None, -1.0),)
    assert next_action(view(watched=False, member_seen=True, missing_since=NOW - 1e6), NOW, LIM) == ()


def test_a_clean_exit_and_the_hang_rules_apply_in_one_pass():
    v = view((None, 0), watched=True, member_seen=True, missing_since=None)
    assert next_action(v, NOW, LIM) == (LogExit(1), Leaving(), Missing())


def test_every_view_gets_a_decision_and_needs_at_most_one_fact_at_a_time():
    """Exhaustive over small views: a decision never raises, a Need comes alone, and once
    every fact is given no Need is left."""
    code_sets = list(itertools.product((None, 0, 1), repeat=2))
    for codes, watched, seen, missing, report, leaving in itertools.product(
            code_sets, (False, True), (False, True), (None, NOW - 0.5, NOW - 5), (None, {"step": 3}),
            (None, NOW - 40)):
        v = view(codes, watched=watched, member_seen=seen, missing_since=missing, report=report,
                 leaving_since=leaving, started_at=NOW - 100)
        for facts in (Facts(), Facts(halted=False, left_cleanly=False), Facts(halted=True, left_cleanly=True)):
            out = next_action(v, NOW, LIM, facts)
            needs = [a for a in out if isinstance(a, Need)]
            assert not needs or len(out) == 1, (v, out)
            if facts.halted is not None:
                assert not needs, (v, facts, out)
            ends = [a for a in out if isinstance(a, (Halted, ExitFailed, Hung, Done))]
            assert len(ends) <= 1 and (not ends or out[-1] is ends[0]), (v, out)


# -- after a failure ----------------------------------------------------------------------------------

@pytest.mark.parametrize("h,state,why,streak", [
    (History(code=1, progressed=False, crash_code=None, crash_streak=0, restarts=0), "restarting", "", 1),
    (History(code=1, progressed=False, crash_code=1, crash_streak=1, restarts=1), "restarting", "", 2),
    (History(code=1, progressed=False, crash_code=1, crash_streak=2, restarts=2), "failed", "crash_loop", 3),
    (History(code=2, progressed=False, crash_code=1, crash_streak=2, restarts=2), "restarting", "", 1),  # other code
    (History(code=1, progressed=True, crash_code=1, crash_streak=2, restarts=2), "restarting", "", 0),  # committed
    (History(code=-9, progressed=False, crash_code=1, crash_streak=2, restarts=2), "restarting", "", 0),  # a signal
    (History(code=None, progressed=False, crash_code=1, crash_streak=2, restarts=2), "restarting", "", 0),  # a hang
    (History(code=None, progressed=True, crash_code=None, crash_streak=0, restarts=5), "failed", "max_restarts", 0),
    (History(code=1, progressed=False, crash_code=1, crash_streak=2, restarts=0, halted=True), "failed", "halted", 2),
])
def test_after_failure(h, state, why, streak):
    out = after_failure(h, LIM)
    assert (out.state, out.why, out.crash_streak) == (state, why, streak)


def test_a_downtime_is_kept_only_for_a_restart():
    h = History(code=None, progressed=True, crash_code=None, crash_streak=0, restarts=0, downtime_steps=20)
    assert after_failure(h, LIM).downtime_steps == 20
    assert after_failure(History(**{**h.__dict__, "restarts": 9}), LIM).downtime_steps == 0


# -- waiting for a restart ------------------------------------------------------------------------------

@pytest.mark.parametrize("pending,now,facts,want", [
    (Pending(NOW + 1, by_step=False, spares=False), NOW, Facts(), Wait()),  # its delay
    (Pending(NOW - 1, by_step=False, spares=False), NOW, Facts(), Need("finished")),
    (Pending(NOW - 1, by_step=False, spares=False), NOW, Facts(finished=False), Launch()),
    (Pending(NOW - 1, by_step=False, spares=False), NOW, Facts(finished=True), NotRestarted()),
    (Pending(NOW + 1, by_step=False, spares=True), NOW, Facts(finished=False), Promote()),  # no pacing for a spare
    (Pending(NOW + 1, by_step=False, spares=True), NOW, Facts(finished=False, promoted=True), Wait()),
    (Pending(NOW + 1, by_step=False, spares=True), NOW, Facts(finished=False, promoted=False), Wait()),  # cold: delay
    (Pending(NOW - 1, by_step=False, spares=True), NOW, Facts(finished=False, promoted=False), Launch()),
    (Pending(NOW + 1, by_step=True, spares=False), NOW, Facts(), Need("downtime_over")),
    (Pending(NOW + 1, by_step=True, spares=False), NOW, Facts(downtime_over=False), Wait()),
    (Pending(NOW + 1, by_step=True, spares=False), NOW, Facts(downtime_over=True, finished=False), Launch()),
    (Pending(NOW + 1, by_step=True, spares=True), NOW, Facts(downtime_over=True, finished=False), Promote()),
])
def test_restart_action(pending, now, facts, want):
    assert restart_action(pending, now, facts) == want
