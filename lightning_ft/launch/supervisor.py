"""Spawns R replicas of W processes each, restarts failed ones and evicts them at once
(docs/ARCHITECTURE.md, "Launch and supervision"; its decisions are launch/policy.py's).

One `Supervisor` owns the processes of some replicas of a job (all of them on one machine;
a disjoint `replica_ids` subset per node when several supervisors share one etcd). Each
process is started in its own session, so a Ctrl-C aimed at the supervisor does not reach
it implicitly, and is cleaned up by PID (its process group, which holds its own children).

A replica fails when one of its processes exits non-zero or by a signal, or when it hangs:
its leader's `members/{rid}` key ("Keyspace") existed for the current incarnation and then
vanished (lease expired) while the leader process still runs. From the moment the key vanished it
says where the replica hangs (launch/diagnosis.py: a `hang` event with the rank, the FTAR link and
the stack; docs/ARCHITECTURE.md, "Hang diagnosis"). Then the supervisor

1. SIGKILLs the rest of the replica,
2. writes `{prefix}/{job}/evict/{rid}/{inc}` at once, so the other replicas drop it without
   waiting for its lease to expire,
3. restarts it with incarnation + 1 after `restart_delay_s`, or, when a downtime is set for
   the replica (`set_downtime`, or the `downtime_steps` of the job config's failure event
   that fired in the failed incarnation: `env["LFT_CONFIG"]`), once the job has advanced
   that many steps; it gives up after `max_restarts`.

With `standby` = N it also keeps N warm spares (coord/standby.py; docs/ARCHITECTURE.md,
"Warm standby"): W processes each, started with `LFT_STANDBY=<token>`, waiting registered in
etcd. A restart takes a registered spare when there is one (at once: the spare is past its
start-up, so there is no crash loop to pace) and starts a new spare in its place; a cold
start is the fallback. A spare that exits while waiting is replaced, unless spares keep dying
before they register (`spares.SPARE_FAILURES` in a row: the program cannot be a spare).

Every event is one JSON line in `{run_dir}/events.jsonl`; each process logs to
`{run_dir}/logs/r{rid}.i{inc}.rank{rank}.log` (a spare to `spare-{token}.rank{rank}.log`; once
promoted, `r{rid}.i{inc}.rank{rank}.log` links to it, and the `restart` event names it).

The supervisor is composed of parts, one concept each (none inherits from another); this
module is the loop that obeys launch/policy.py's decisions for running replicas:
records.py (what it knows of each replica and spare), run_view.py (the run in etcd: members,
reports, halts, the job's step, evictions), event_log.py (events.jsonl), processes.py
(start, signal, reap), spares.py (warm spares), restarts.py (failures, restarts, world
restarts, halts), diagnosis.py (the hang diagnosis thread), waker.py (how the loop sleeps).
Which thread owns what: docs/ARCHITECTURE.md, "Threads".
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Optional

from lightning_ft.constants import ExitCode
from lightning_ft.coord.etcd_store import EtcdStore
from lightning_ft.coord.store import Store
from lightning_ft.launch import diagnosis, policy
from lightning_ft.launch.event_log import EventLog
from lightning_ft.launch.processes import TERM_GRACE_S, Processes, peek, reap, signal_group
from lightning_ft.launch.records import ReplicaRecord, ReplicaSpec
from lightning_ft.launch.restarts import HALT_GRACE_S, Restarts
from lightning_ft.launch.run_view import RunView
from lightning_ft.launch.spares import Spares
from lightning_ft.launch.stacks import DUMP_TIMEOUT_S, STOPPED, dump_stack, process_state
from lightning_ft.launch.supervisor_settings import Placement, SupervisorSettings
from lightning_ft.launch.waker import Waker

log = logging.getLogger(__name__)

IDLE_WAKE_S = 1.0
"""run() wakes at least this often with nothing due (its `until`, e.g. etcd's health)."""
EXIT_DUMP_TIMEOUT_S = 2.0
"""A replica hung on exit: each live rank's stack is read (py-spy) for this long at most before the kill."""


class Supervisor:
    """Starts, watches and restarts the replicas `replica_ids` (default: all `replicas`) of one job.

    Threads: the supervision loop is the thread that calls `start`, `poll`/`run` and
    `shutdown`; it owns the records and every part. It holds `_lock` for each of them;
    `status`, `kill_replica` and `set_downtime`, which other threads may call (a status
    table, a test), take it too. Other threads reach the loop only through the waker
    (`_signalled` is written by the signal handler, on the main thread)."""

    def __init__(self, cmd: list[str], place: Placement, settings: Optional[SupervisorSettings] = None, *,
                 store: Store | None = None) -> None:
        """Run `cmd` as the replicas of `place`, supervised by `settings` (launch/supervisor_settings.py);
        `store`: an open etcd client (default: one to `place.etcd`).

        The job's run (coord/runs.py) is opened by `start`: a launcher joins the run another
        launcher of the job (same job id and secret) is running, or starts a new one."""
        st = settings or SupervisorSettings()
        self.place, self.settings = place, st
        ids = list(range(place.replicas)) if place.replica_ids is None else list(place.replica_ids)
        bad = [r for r in ids if not 0 <= r < place.replicas]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"replica_ids {ids} must be distinct and between 0 and replicas - 1 "
                             f"({place.replicas - 1})")
        if place.nproc_per_replica < 1:
            raise ValueError(f"nproc_per_replica={place.nproc_per_replica} must be >= 1")
        self._lock = threading.RLock()
        """Held by the loop for each pass, by start() and shutdown(); other threads' calls take it."""
        self._replicas = {rid: ReplicaRecord(ReplicaSpec(rid, place.nproc_per_replica)) for rid in ids}
        self._limits = policy.Limits(start_timeout_s=st.start_timeout_s, hang_grace_s=st.hang_grace_s,
                                     exit_timeout_s=st.exit_timeout_s, crash_loop=st.crash_loop,
                                     max_restarts=st.max_restarts)
        self._waker = Waker()
        self._view = RunView(store if store is not None else EtcdStore(place.etcd), place, st,
                             own_store=store is None, on_change=self._waker.notify)
        os.makedirs(os.path.join(place.run_dir, "logs"), exist_ok=True)
        self._events = EventLog(os.path.join(place.run_dir, "events.jsonl"))
        self._procs = Processes(cmd, place, st, self._events)
        self._spares = Spares(st.standby, self._replicas, self._procs, self._view, self._events,
                              run_dir=place.run_dir, wrap=place.wrap)
        self._restarts = Restarts(self._replicas, place, st, self._limits,
                                  (self._procs, self._spares, self._view, self._events))
        self._started = False
        self._shut_down = False
        self._signalled: Optional[int] = None

    # -- what callers read -----------------------------------------------------------------------
    @property
    def root(self) -> str:
        """The keyspace of this launcher's run (known once started)."""
        return self._view.root

    @property
    def run_id(self) -> str:
        """The run this launcher belongs to (set by `start`)."""
        return self._view.run_id

    @property
    def run_reason(self) -> str:
        """What `start` decided about the run, in words."""
        return self._view.reason

    @property
    def etcd(self) -> str:
        return self.place.etcd

    @property
    def run_dir(self) -> str:
        return self.place.run_dir

    @property
    def halted(self) -> str:
        """Why the job halted (from etcd), or ""."""
        return self._restarts.halted

    @property
    def stopped(self) -> str:
        """Why the supervisor stopped the job itself (too few replicas left), or ""."""
        return self._restarts.stopped

    # -- public API ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start every replica in incarnation 0."""
        with self._lock:
            if self._started or self._shut_down:
                raise RuntimeError("this Supervisor was already started; create a new one to start the job again")
            self._view.open()
            self._procs.run_id = self._view.run_id
            self._view.watch_members()
            atexit.register(self.shutdown)
            self._started = True
            if self._procs.zygote_wanted:  # first: every replica and spare is forked from it once it imported
                self._procs.start_zygote()
            for rep in self._replicas.values():
                self._restarts.start(rep)
            self._spares.top_up()

    def set_downtime(self, rid: int, steps: int) -> None:
        """From now on, after a failure keep replica `rid` down until the job advances `steps`
        steps (instead of restarting after restart_delay_s); 0 restores the delay."""
        with self._lock:
            self._replica(rid)
            self._restarts.downtime[rid] = steps

    def poll(self) -> None:
        """One supervision pass: reap exits, detect hangs, restart due replicas. Does not wait
        for processes; its etcd reads and writes have deadlines."""
        with self._lock:
            if self._shut_down:
                return
            self._watch()
            self._spares.reap(stopped=bool(self.halted))
            self._restarts.due()

    def run(self, until: Callable[[], bool] | None = None, timeout_s: float | None = None,
            poll_s: float = 0.05) -> int:
        """Poll until every replica has stopped (0 if all finished, ExitCode.GAVE_UP if any was given
        up on), `until()` is true (0), `timeout_s` passed (ExitCode.TIMEOUT), or SIGINT/SIGTERM
        arrived (shutdown, then 128 + signal). Starts the replicas first if start() was not called."""
        if not self._started:
            self.start()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        restore = self._install_signal_handlers()
        try:
            while True:
                self.poll()
                if self._signalled is not None:
                    self.shutdown()
                    return 128 + self._signalled
                states = {rep.state for rep in self._replicas.values()}
                if states <= {"done", "failed", "stopped"}:
                    self._spares.stop("the job ended")
                    if self.halted:
                        return ExitCode.HALTED
                    return 0 if states == {"done"} else ExitCode.GAVE_UP
                if until is not None and until():
                    return 0
                if deadline is not None and time.monotonic() >= deadline:
                    return ExitCode.TIMEOUT
                self._sleep(self._next_wake_s(deadline, poll_s))
        finally:
            restore()

    def kill_replica(self, rid: int, sig: int = signal.SIGKILL, reason: str = "") -> None:
        """Send `sig` to every live process of replica `rid`. The next poll() handles the exits
        as a failure (evict, restart); `reason` is added to the eviction reason."""
        with self._lock:
            rep = self._replica(rid)
            rep.kill_reason = reason
            for p in rep.procs:
                signal_group(p, sig)

    def status(self) -> list[dict[str, Any]]:
        """Per replica: rid, incarnation, state ("running", "restarting", "done", "failed" or, after
        shutdown, "stopped"), pids (of live processes), restarts, step (last reported), last_event,
        compute_ms (its reported compute per step) and compute_ratio (over the median of the other
        running replicas'; a straggler's is >= stragglers.threshold)."""
        from lightning_ft.coord.stragglers import ratios

        with self._lock:
            slow = ratios({rep.rid: rep.compute_ms for rep in self._replicas.values() if rep.state == "running"})
            return [{"rid": rep.rid, "incarnation": rep.incarnation, "state": rep.state,
                     "pids": [p.pid for p in rep.procs if peek(p) is None], "restarts": rep.restarts,
                     "step": rep.step, "last_event": self._events.last(rep.rid),
                     "compute_ms": rep.compute_ms if rep.compute_ms > 0 else None, "compute_ratio": slow.get(rep.rid)}
                    for rep in self._replicas.values()]

    def shutdown(self) -> None:
        """SIGTERM every child, SIGKILL what is left after TERM_GRACE_S, evict the replicas that
        were running. Idempotent; runs at interpreter exit too."""
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
            atexit.unregister(self.shutdown)
            running = [rep for rep in self._replicas.values() if rep.state == "running"]
            live = [p for rep in running for p in rep.procs if p.returncode is None] + self._procs.stragglers
            live += self._spares.forget()
            for p in live:
                signal_group(p, signal.SIGTERM)
            deadline = time.monotonic() + TERM_GRACE_S
            while time.monotonic() < deadline and any(peek(p) is None for p in live):
                time.sleep(0.02)
            for p in live:
                signal_group(p, signal.SIGKILL)  # the exited ones too: this reaches what is left of their groups
                reap(p)
            reachable = True
            for rep in running:
                reachable = reachable and self._view.evict(rep.rid, rep.incarnation, "supervisor shut down")
                self._events.replica(rep.rid, rep.incarnation, "shutdown", pids=[p.pid for p in rep.procs])
                rep.state = "stopped"
            for rep in self._replicas.values():
                if rep.state == "restarting":
                    rep.state = "stopped"
            self._events.close()
            self._view.stop_watch()
            self._procs.close()
            self._view.close()

    # -- sleeping --------------------------------------------------------------------------------
    def _install_signal_handlers(self) -> Callable[[], None]:
        """SIGINT/SIGTERM make run() shut down; returns a function restoring the old handlers."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_signal(signum: int, frame: Any) -> None:
            self._signalled = signum
            self._waker.notify()

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

        def restore() -> None:
            for s, handler in old.items():
                signal.signal(s, handler)

        return restore

    def _next_wake_s(self, deadline: Optional[float], poll_s: float) -> float:
        """Seconds until something may be due without an event announcing it: a restart, a hang
        grace, a start or exit timeout, the halt grace, the run's deadline; at most IDLE_WAKE_S
        (run()'s `until`, etcd's health), at least poll_s. Without pidfds (no way to sleep on a
        child's exit) or the member watch, poll_s."""
        st = self.settings
        with self._lock:
            if not self._view.watching or not self._procs.all_watched(
                    p for rep in self._replicas.values() if rep.state == "running" for p in rep.procs):
                return poll_s
            due = [IDLE_WAKE_S + time.monotonic()]
            if deadline is not None:
                due.append(deadline)
            if self.halted:
                due.append(self._restarts.halted_at + HALT_GRACE_S)
            for rep in self._replicas.values():
                if rep.state == "restarting" and rep.restart_step is None:
                    due.append(rep.restart_at)
                elif rep.state == "restarting":
                    due.append(time.monotonic() + 1.0)  # downtime: the job's step is read from etcd
                elif rep.state == "running":
                    if not rep.member_seen and st.start_timeout_s > 0:
                        due.append(rep.started_at + st.start_timeout_s)
                    if rep.missing_since is not None:
                        due.append(rep.missing_since + st.hang_grace_s)
                    if rep.leaving_since is not None and st.exit_timeout_s > 0:
                        due.append(rep.leaving_since + st.exit_timeout_s)
        return max(poll_s, min(due) - time.monotonic())

    def _sleep(self, timeout_s: float) -> None:
        """Sleep up to `timeout_s`, waking at once when a child exits, the member watch saw a
        change, or a signal arrived."""
        with self._lock:
            fds = self._procs.exit_fds(p for rep in self._replicas.values() for p in rep.procs)
        self._waker.sleep(timeout_s, fds)

    # -- the loop --------------------------------------------------------------------------------
    def _replica(self, rid: int) -> ReplicaRecord:
        if rid not in self._replicas:
            raise KeyError(f"replica {rid} is not supervised here (this supervisor owns {sorted(self._replicas)})")
        return self._replicas[rid]

    def _watch(self) -> None:
        """This pass's decision for every running replica (launch/policy.py `next_action`),
        carried out: exits read without reaping (so the process groups of a failed replica can
        still be killed safely by PID), then, with hang checks on, its member report."""
        running = [rep for rep in self._replicas.values() if rep.state == "running"]
        if not running:
            return
        codes = {rep.rid: tuple(peek(p) for p in rep.procs) for rep in running}
        # one read of the members' reports per pass, when some replica's rank 0 still runs
        reports = (self._view.member_reports()
                   if self.settings.hang_check and any(c and c[0] is None for c in codes.values()) else None)
        now = time.monotonic()
        for rep in running:
            if rep.state != "running":  # a world restart or a halt already stopped it in this pass
                continue
            mine = reports.get(rep.rid) if reports is not None else None
            view = policy.View(
                rid=rep.rid, incarnation=rep.incarnation, codes=codes[rep.rid],
                pids=tuple(p.pid for p in rep.procs), logged_exits=frozenset(rep.logged_exits),
                kill_reason=rep.kill_reason, watched=reports is not None and codes[rep.rid][:1] == (None,),
                report=mine if mine is not None and mine.get("incarnation") == rep.incarnation else None,
                member_seen=rep.member_seen, started_at=rep.started_at, missing_since=rep.missing_since,
                leaving_since=rep.leaving_since,
                stopped=tuple(r for r, (p, code) in enumerate(zip(rep.procs, codes[rep.rid], strict=True))
                              if rep.leaving_since is not None and code is None and process_state(p.pid) in STOPPED))
            facts = policy.Facts()
            while True:
                actions = policy.next_action(view, now, self._limits, facts)
                if not (len(actions) == 1 and isinstance(actions[0], policy.Need)):
                    break
                if actions[0].fact == "halted":
                    facts = replace(facts, halted=bool(self._view.halt_reason()))  # the key decides
                else:
                    facts = replace(facts, left_cleanly=self._view.left_cleanly(rep.rid, rep.incarnation))
            for a in actions:
                self._obey(rep, a, now)

    def _obey(self, rep: ReplicaRecord, a: policy.Action, now: float) -> None:
        event = self._events.replica
        if isinstance(a, policy.LogExit):
            rep.procs[a.rank].wait()
            rep.logged_exits.add(a.rank)
            event(rep.rid, rep.incarnation, "exit", rank=a.rank, code=0, pid=rep.procs[a.rank].pid)
        elif isinstance(a, policy.Halted):
            event(rep.rid, rep.incarnation, "exit", rank=a.rank, code=a.code, pid=rep.procs[a.rank].pid)
            self._restarts.halt(rep)
        elif isinstance(a, policy.ExitFailed):
            event(rep.rid, rep.incarnation, "exit", rank=a.rank, code=a.code, pid=rep.procs[a.rank].pid)
            self._restarts.fail(rep, a.reason, code=a.code, rank=a.rank)
        elif isinstance(a, policy.Done):
            rep.state = "done"
            rep.step = _committed_step(rep, self.place.run_dir)
        elif isinstance(a, policy.Leaving):
            if rep.leaving_since is None:
                rep.leaving_since = now
        elif isinstance(a, policy.Hung):
            if a.diagnosed and rep.diagnosis is not None:  # its stacks are read before the kill (bounded)
                rep.diagnosis.join(DUMP_TIMEOUT_S + 1.0)
            stacks = {r: dump_stack(p.pid, EXIT_DUMP_TIMEOUT_S, native=True) for r, p in enumerate(rep.procs)
                      if a.dump and p.returncode is None}  # where it hangs on its way out
            event(rep.rid, rep.incarnation, "hang", reason=a.reason, **({"stacks": stacks} if stacks else {}))
            self._restarts.fail(rep, a.reason)
        elif isinstance(a, policy.Seen):
            rep.member_seen, rep.missing_since = True, None
            rep.step = a.step if a.step is not None else rep.step
            rep.compute_ms = a.compute_ms
            if rep.first_step is None:
                rep.first_step = rep.step
            elif rep.step is not None and rep.step > rep.first_step:
                rep.progressed = True
        elif isinstance(a, policy.Missing):
            rep.missing_since = now
            if rep.diagnosis is None or not rep.diagnosis.is_alive():  # read its stacks while it still hangs
                live = {r: p.pid for r, p in enumerate(rep.procs) if p.returncode is None}
                rep.diagnosis = diagnosis.start(self._view, self._events, diagnosis.Suspect(
                    rep.rid, rep.incarnation, live, now, self.settings.hang_grace_s))
        else:
            raise AssertionError(f"supervisor: no way to carry out {a!r}")


def _committed_step(rep: ReplicaRecord, run_dir: str) -> Optional[int]:
    """The steps a replica that exited cleanly committed: its `final.json` (strategy/runlog.py)
    when this incarnation wrote it, else the last step it reported. Member reports are written
    in full rounds only (steady rounds touch no etcd), so they lag by up to
    `consistency.every_n_steps`: a job of 400 steps ended with "step 390" on every replica."""
    path = os.path.join(run_dir, f"replica_{rep.rid}", "final.json")
    started = time.time() - (time.monotonic() - rep.started_at)
    try:
        if os.stat(path).st_mtime < started - 1.0:
            return rep.step  # an earlier run's, in a reused run directory
        with open(path) as f:
            final = json.load(f)
    except (OSError, ValueError):
        return rep.step
    if not isinstance(final, dict) or final.get("incarnation") != rep.incarnation:
        return rep.step
    step = final.get("step")
    if not isinstance(step, int):
        return rep.step
    return step
