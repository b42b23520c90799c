"""The supervisor's decisions, pure (docs/ARCHITECTURE.md, "Launch and supervision").

`launch/supervisor.py` observes (exit codes read without reaping, its replicas' `members/`
reports, a few etcd keys) and acts (signals, evictions, starts); what it does about what it saw
is decided here, with no I/O and no clock, so that every rule has a table test
(tests/launch/test_policy.py) and the shell only gathers and obeys.

Three decisions:
- `next_action(view, now, limits, facts)`: a running replica this pass: record clean exits, the
  job halted, failed (an exit, a hang in initialization, a vanished member key, a hung exit),
  done, on its way out, seen training, or first seen missing.
- `after_failure(history, limits)`: once a failed replica's processes are killed and it is
  evicted: restart it (after the delay, or after a downtime in steps), or give up on it (a
  crash loop, too many restarts, a halted job).
- `restart_action(pending, now, facts)`: a replica waiting for its restart: wait, start it,
  hand it to a warm spare, or not restart it (the job finished).

A decision that needs an etcd read only some of the time asks for it: it returns `Need(fact)`,
and the shell reads that fact and asks again with it (`Facts`), so the reads stay as lazy as
before (the halt key only after a failed exit, `left/` only for a member key gone past the grace).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Optional, Union

# -- what the shell knows -----------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """The supervisor's settings that rules read (config `supervisor.*`)."""

    start_timeout_s: float = 0.0
    """A replica that has not registered this long after its start is hung in initialization (0: never)."""
    hang_grace_s: float = 0.0
    """A member key gone this long while rank 0 runs is a hang."""
    exit_timeout_s: float = 0.0
    """A replica on its way out this long is hung on exit (0: never)."""
    crash_loop: int = 3
    """Failures in a row with one exit code before any commit that end a crash loop."""
    max_restarts: int = 1 << 30


@dataclass(frozen=True)
class View:
    """A running replica, as one supervision pass saw it."""

    rid: int
    incarnation: int
    codes: tuple[Optional[int], ...]
    """Each rank's exit code, None while it runs (read without reaping)."""
    pids: tuple[int, ...]
    logged_exits: frozenset[int] = frozenset()
    """Ranks whose clean exit is already in the event log."""
    kill_reason: str = ""
    """Why the launcher signalled it (kill_replica), added to the failure's reason."""
    watched: bool = False
    """Hang checks apply: they are on, rank 0 runs, and the members' reports could be read."""
    report: Optional[Mapping[str, object]] = None
    """Its leader's `members/{rid}` report, when it is of this incarnation."""
    member_seen: bool = False
    started_at: float = 0.0
    """Monotonic start of this incarnation (0: unknown)."""
    missing_since: Optional[float] = None
    leaving_since: Optional[float] = None
    stopped: tuple[int, ...] = ()
    """Ranks in the stopped state (SIGSTOP), read only while it is on its way out."""


@dataclass(frozen=True)
class Facts:
    """etcd reads a decision asked for (None: not read yet)."""

    halted: Optional[bool] = None
    """The job's halt key exists."""
    left_cleanly: Optional[bool] = None
    """This incarnation's leader wrote `left/{rid}/{inc}` (it revoked its lease on the way out)."""
    downtime_over: Optional[bool] = None
    """The job reached the replica's restart step, or nobody else trains."""
    finished: Optional[bool] = None
    """The job's `finished` key exists."""
    promoted: Optional[bool] = None
    """A warm spare took the replica over (the shell tried to promote one)."""


# -- what the shell does ------------------------------------------------------------------------


@dataclass(frozen=True)
class Need:
    """Read this fact (a `Facts` field) and decide again."""

    fact: str


@dataclass(frozen=True)
class LogExit:
    """Rank `rank` exited 0: reap it and log its exit."""

    rank: int


@dataclass(frozen=True)
class Halted:
    """Rank `rank` exited with `code` and the job halted: log the exit; this replica is done for
    good, and nobody restarts."""

    rank: int
    code: int


@dataclass(frozen=True)
class ExitFailed:
    """A rank exited with a non-zero code: log the exit, then fail the replica."""

    rank: int
    code: int
    reason: str


@dataclass(frozen=True)
class Hung:
    """Fail the replica as hung (a `hang` event first; `diagnosed`: wait for its stacks;
    `dump`: read its live ranks' stacks into the event before the kill)."""

    reason: str
    diagnosed: bool = False
    dump: bool = False


@dataclass(frozen=True)
class Done:
    """Every rank exited 0."""


@dataclass(frozen=True)
class Leaving:
    """On its way out and still within exit_timeout_s: note since when."""


@dataclass(frozen=True)
class Seen:
    """Its member key is there, for this incarnation: its step and compute time."""

    step: Optional[int]
    compute_ms: float


@dataclass(frozen=True)
class Missing:
    """Its member key is first seen gone: note since when, and read its stacks while it hangs."""


Action = Union[Need, LogExit, Halted, ExitFailed, Hung, Done, Leaving, Seen, Missing]


def next_action(v: View, now: float, lim: Limits, facts: Facts = Facts()) -> tuple[Action, ...]:
    """What to do about a running replica, in order; `(Need(f),)` alone asks for a fact first.

    Exits come first: the first non-zero exit fails the replica, unless the halt key says the job
    halted (an exit code alone may be the program's own). When every rank exited 0 it is done; a
    rank that exited 0 beside ranks that still run starts its exit timeout. Then, if watched, the
    hang rules: its report (seen), no registration within start_timeout_s (hung in
    initialization), its member key first gone (missing), gone past hang_grace_s (hung, unless
    its leader left cleanly: then it is on its way out)."""
    bad = [(rank, code) for rank, code in enumerate(v.codes) if code not in (None, 0)]
    if bad:
        rank, code = bad[0]
        assert code is not None
        if facts.halted is None:
            return (Need("halted"),)
        if facts.halted:
            return (Halted(rank, code),)
        reason = f"rank {rank} exited with {code}" + (f" ({v.kill_reason})" if v.kill_reason else "")
        return (ExitFailed(rank, code, reason),)
    out: list[Action] = [LogExit(r) for r, c in enumerate(v.codes) if c == 0 and r not in v.logged_exits]
    if v.codes and all(c == 0 for c in v.codes):
        return (*out, Done())
    if 0 in v.codes:
        running = [r for r, c in enumerate(v.codes) if c is None]
        exiting = _exit_check(v, now, lim, f"rank {v.codes.index(0)} exited 0 but ranks {running} still run")
        if isinstance(exiting, Hung):
            return (*out, exiting)
        out.append(exiting)
        v = replace(v, leaving_since=now if v.leaving_since is None else v.leaving_since)
    if not v.watched:
        return tuple(out)
    pid0 = v.pids[0] if v.pids else -1
    if v.report is not None:
        step = v.report.get("step")
        return (*out, Seen(step if isinstance(step, int) else None, float(str(v.report.get("compute_ms", -1.0)))))
    if not v.member_seen:
        if lim.start_timeout_s > 0 and v.started_at and now - v.started_at >= lim.start_timeout_s:
            return (*out, Hung(f"hung in initialization: incarnation {v.incarnation} did not register with etcd "
                               f"within {lim.start_timeout_s:.0f}s of its start (supervisor.start_timeout_s) while "
                               f"rank 0 (pid {pid0}) still runs"))
        return tuple(out)
    if v.missing_since is None:
        return (*out, Missing())
    if now - v.missing_since < lim.hang_grace_s:
        return tuple(out)
    if facts.left_cleanly is None:
        return (Need("left_cleanly"),)
    if facts.left_cleanly:
        exiting = _exit_check(v, now, lim, f"incarnation {v.incarnation} left the job (left/{v.rid}/"
                                           f"{v.incarnation}) but rank 0 (pid {pid0}) still runs")
        return (*out, exiting)
    return (*out, Hung(f"hung: members/{v.rid} of incarnation {v.incarnation} vanished (lease expired) "
                       f"{now - v.missing_since:.1f}s ago while rank 0 (pid {pid0}) still runs", diagnosed=True))


def _exit_check(v: View, now: float, lim: Limits, what: str) -> Union[Leaving, Hung]:
    """On its way out: fine within exit_timeout_s of when it was first seen so (a process
    deadlocked in teardown never exits by itself); hung on exit past it, or past hang_grace_s
    with a rank stopped (SIGSTOP)."""
    since = now if v.leaving_since is None else v.leaving_since
    if lim.exit_timeout_s <= 0:
        return Leaving()
    if v.stopped and now - since >= lim.hang_grace_s:  # stopped, it never exits by itself
        ranks = ", ".join(str(r) for r in v.stopped)
        return Hung(f"hung on exit: rank {ranks} {'is' if len(v.stopped) == 1 else 'are'} stopped (SIGSTOP) "
                    f"{now - since:.0f}s after it began to leave: {what}")
    if now - since < lim.exit_timeout_s:
        return Leaving()
    return Hung(f"hung on exit for {now - since:.0f}s (supervisor.exit_timeout_s={lim.exit_timeout_s:g}): {what}",
                dump=True)


# -- after a failure ------------------------------------------------------------------------------


@dataclass(frozen=True)
class History:
    """A replica that just failed (its processes killed, its incarnation evicted)."""

    code: Optional[int]
    """Its exit code (None: a hang or a signal, which are not the program's fault)."""
    progressed: bool
    """This incarnation committed something."""
    crash_code: Optional[int]
    """The code of the previous failure before any commit (None: none)."""
    crash_streak: int
    restarts: int
    halted: bool = False
    """The job halted."""
    downtime_steps: int = 0
    """Keep it down until the job advances this many steps (0: restart after the delay)."""


@dataclass(frozen=True)
class Outcome:
    """What becomes of a failed replica."""

    state: str
    """"restarting" or "failed"."""
    why: str = ""
    """"halted", "crash_loop" or "max_restarts" when failed."""
    crash_code: Optional[int] = None
    crash_streak: int = 0
    """The crash-loop count to keep."""
    downtime_steps: int = 0
    """Restarting: wait for this many more job steps instead of restart_delay_s."""


def after_failure(h: History, lim: Limits) -> Outcome:
    """Restart a failed replica, or give up on it. A halted job restarts nobody. Failures before
    any commit with one exit code are counted; `crash_loop` of them in a row end the replica
    (a signal, a hang or any commit resets the count). After `max_restarts` restarts it is
    given up on. Otherwise it restarts, after `downtime_steps` job steps when asked, else
    after `restart_delay_s`."""
    if h.halted:
        return Outcome("failed", "halted", h.crash_code, h.crash_streak)
    if h.progressed or h.code is None or h.code <= 0:
        code, streak = None, 0
    else:
        code, streak = h.code, (h.crash_streak + 1 if h.crash_code == h.code else 1)
        if streak >= lim.crash_loop:
            return Outcome("failed", "crash_loop", code, streak)
    if h.restarts >= lim.max_restarts:
        return Outcome("failed", "max_restarts", code, streak)
    return Outcome("restarting", "", code, streak, max(0, h.downtime_steps))


# -- waiting for a restart ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Pending:
    """A replica waiting for its restart."""

    restart_at: float
    """Monotonic time from which it may start (restart_delay_s after its failure)."""
    by_step: bool
    """It waits for the job to reach a step (downtime) instead of for `restart_at`."""
    spares: bool
    """Warm spares exist: one may take it over at once, past any pacing."""


@dataclass(frozen=True)
class Wait:
    """Not yet."""


@dataclass(frozen=True)
class NotRestarted:
    """The job finished: a late replica would only idle."""


@dataclass(frozen=True)
class Promote:
    """Try a warm spare; tell `restart_action` whether one took it (`Facts.promoted`)."""


@dataclass(frozen=True)
class Launch:
    """Start its next incarnation."""


Restart = Union[Need, Wait, NotRestarted, Promote, Launch]


def restart_action(p: Pending, now: float, facts: Facts = Facts()) -> Restart:
    """A downtime waits for the job's step; a delay waits for `restart_at`, unless a spare can
    take over at once. A finished job restarts nothing. A spare, when there is one, comes
    before a fresh start; a fresh start still waits out its delay."""
    if p.by_step:
        if facts.downtime_over is None:
            return Need("downtime_over")
        if not facts.downtime_over:
            return Wait()
    elif now < p.restart_at and not p.spares:
        return Wait()
    if facts.finished is None:
        return Need("finished")
    if facts.finished:
        return NotRestarted()
    if p.spares:
        if facts.promoted is None:
            return Promote()
        if facts.promoted:
            return Wait()
    if now < p.restart_at and not p.by_step:
        return Wait()
    return Launch()
