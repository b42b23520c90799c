"""Spawns R replicas of W processes each, restarts failed ones and evicts them at once
(docs/ARCHITECTURE.md, "Launch and supervision"; its decisions are launch/policy.py's).

One `Supervisor` owns the processes of some replicas of a job (all of them on one machine;
a disjoint `replica_ids` subset per node when several supervisors share one etcd). Each
process is started in its own session, so a Ctrl-C aimed at the supervisor does not reach
it implicitly, and is cleaned up by PID (its process group, which holds its own children).

A replica fails when one of its processes exits non-zero or by a signal, or when it hangs:
its leader's `members/{rid}` key ("Keyspace") existed for the current incarnation and then
vanished (lease expired) while the leader process still runs. From the moment the key vanished it
says where the replica hangs (`_diagnose_hang`: a `hang` event with the rank, the FTAR link and
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
before they register (`SPARE_FAILURES` in a row: the program cannot be a spare).

Every event is one JSON line in `{run_dir}/events.jsonl`; each process logs to
`{run_dir}/logs/r{rid}.i{inc}.rank{rank}.log` (a spare to `spare-{token}.rank{rank}.log`; once
promoted, `r{rid}.i{inc}.rank{rank}.log` links to it, and the `restart` event names it).

The supervisor is built in layers, each a class over the one below and calling only down (mypy
checks it): supervisor_base.py (the replicas' records, the run, what etcd says: members,
reports, halts, the job's step; the event log) -> processes.py (starting, signalling and
reaping a replica's processes, shutdown) -> spares.py (warm spares) -> this module (the loop:
watching, obeying launch/policy.py's decisions, failures, restarts, world restarts, halts).
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from dataclasses import replace
from typing import Callable, Optional

from lightning_ft.constants import ExitCode
from lightning_ft.coord.hang import culprit_rank, diagnose
from lightning_ft.coord.store import StoreError
from lightning_ft.launch import policy
from lightning_ft.launch.stacks import DUMP_TIMEOUT_S, STOPPED, dump_stack, process_state
from lightning_ft.launch.zygote import Proc, Zygote, default_preload, python_target

from lightning_ft.launch.spares import Spares
from lightning_ft.launch.records import ReplicaSpec, _Replica
from lightning_ft.launch.supervisor_base import (HALT_GRACE_S, IDLE_WAKE_S, REAP_TIMEOUT_S, SPARE_FAILURES,
                                                 STALL_MAX_AGE_S, TERM_GRACE_S, _peek, _signal, _wait)
from lightning_ft.launch.supervisor_settings import RESUME_LIVE_WAIT_S, Placement, SupervisorSettings

__all__ = ["HALT_GRACE_S", "IDLE_WAKE_S", "REAP_TIMEOUT_S", "RESUME_LIVE_WAIT_S", "SPARE_FAILURES", "STALL_MAX_AGE_S",
           "TERM_GRACE_S", "Placement", "ReplicaSpec", "Supervisor", "SupervisorSettings"]

log = logging.getLogger(__name__)

ZYGOTE_FIRST_WAIT_S = 90.0
"""How long the start waits for the zygote's imports before it starts the replicas as new
processes (a loaded 2-core host took 15-100 s to import torch and Lightning; unloaded, 5 s)."""
EXIT_DUMP_TIMEOUT_S = 2.0
"""A replica hung on exit: each live rank's stack is read (py-spy) for this long at most before the kill."""


class Supervisor(Spares):
    """Starts, watches and restarts the replicas `replica_ids` (default: all `replicas`) of one job."""

    # -- public API ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start every replica in incarnation 0."""
        with self._lock:
            if self._started or self._shut_down:
                raise RuntimeError("this Supervisor was already started; create a new one to start the job again")
            self._open_run()
            self._watch_members()
            atexit.register(self.shutdown)
            self._started = True
            if self._zygote_wanted:  # first: every replica and spare is forked from it once it imported
                self._start_zygote()
            for rep in self._replicas.values():
                self._launch(rep)
            self._top_up_spares()

    def _start_zygote(self) -> None:
        """Start the zygote and wait until it imported torch (and Lightning, when the script
        imports it), at most `ZYGOTE_FIRST_WAIT_S`: the replicas are then forked from it, so the
        job imports once instead of once per process (a 3-replica job here: 5 s of CPU instead
        of 16). A zygote that fails, or is not ready in time, leaves the replicas to start as
        plain processes; restarts use it once it is ready."""
        try:
            self._zygote = Zygote(default_preload(python_target(self.cmd)), env={**os.environ, **self._extra_env},
                                  log_path=os.path.join(self.run_dir, "logs", "zygote.log"))
        except OSError as e:
            log.warning("cannot start the zygote (replicas start Python afresh): %s", e)
            return
        deadline = time.monotonic() + ZYGOTE_FIRST_WAIT_S
        while not self._zygote.ready.wait(0.1) and not self._zygote.failed and self._zygote.proc.poll() is None:
            if time.monotonic() > deadline:
                log.warning("the zygote did not import within %.0f s: the replicas start as new processes",
                            ZYGOTE_FIRST_WAIT_S)
                return

    def set_downtime(self, rid: int, steps: int) -> None:
        """From now on, after a failure keep replica `rid` down until the job advances `steps`
        steps (instead of restarting after restart_delay_s); 0 restores the delay."""
        self._replica(rid)
        self._downtime[rid] = steps

    def poll(self) -> None:
        """One supervision pass: reap exits, detect hangs, restart due replicas. Does not wait
        for processes; its etcd reads and writes have deadlines."""
        with self._lock:
            if self._shut_down:
                return
            self._watch()
            self._reap_spares()
            self._restart_due()

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
                    self._stop_spares("the job ended")
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

    def _next_wake_s(self, deadline: Optional[float], poll_s: float) -> float:
        """Seconds until something may be due without an event announcing it: a restart, a hang
        grace, a start or exit timeout, the halt grace, the run's deadline; at most IDLE_WAKE_S
        (run()'s `until`, etcd's health), at least poll_s. Without pidfds (no way to sleep on a
        child's exit) or the member watch, poll_s."""
        with self._lock:
            if self._members is None or any(p.pid not in self._pidfds for rep in self._replicas.values()
                                            if rep.state == "running" for p in rep.procs if p.returncode is None):
                return poll_s
            due = [IDLE_WAKE_S + time.monotonic()]
            if deadline is not None:
                due.append(deadline)
            if self.halted:
                due.append(self._halted_at + HALT_GRACE_S)
            for rep in self._replicas.values():
                if rep.state == "restarting" and rep.restart_step is None:
                    due.append(rep.restart_at)
                elif rep.state == "restarting":
                    due.append(time.monotonic() + 1.0)  # downtime: the job's step is read from etcd
                elif rep.state == "running":
                    if not rep.member_seen and self.start_timeout_s > 0:
                        due.append(rep.started_at + self.start_timeout_s)
                    if rep.missing_since is not None:
                        due.append(rep.missing_since + self.hang_grace_s)
                    if rep.leaving_since is not None and self.exit_timeout_s > 0:
                        due.append(rep.leaving_since + self.exit_timeout_s)
        return max(poll_s, min(due) - time.monotonic())

    def _sleep(self, timeout_s: float) -> None:
        """Sleep up to `timeout_s`, waking at once when a child exits, the member watch saw a
        change, or a signal arrived (`_notify`)."""
        import select

        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        with self._lock:
            for rep in self._replicas.values():
                for p in rep.procs:
                    fd = self._pidfds.get(p.pid)
                    if fd is not None and _peek(p) is None:
                        poller.register(fd, select.POLLIN)
        try:
            poller.poll(max(0.0, timeout_s) * 1e3)
        except InterruptedError:
            pass
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    # -- the loop --------------------------------------------------------------------------------
    def _watch(self) -> None:
        """This pass's decision for every running replica (launch/policy.py `next_action`),
        carried out: exits read without reaping (so the process groups of a failed replica can
        still be killed safely by PID), then, with hang checks on, its member report."""
        running = [rep for rep in self._replicas.values() if rep.state == "running"]
        if not running:
            return
        codes = {rep.rid: tuple(_peek(p) for p in rep.procs) for rep in running}
        # one read of the members' reports per pass, when some replica's rank 0 still runs
        reports = (self._member_reports() if self.hang_check and any(c and c[0] is None for c in codes.values())
                   else None)
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
                    facts = replace(facts, halted=bool(self._read_halt()))  # the key decides
                else:
                    facts = replace(facts, left_cleanly=self._left_cleanly(rep))
            for a in actions:
                self._obey(rep, a, now)

    def _obey(self, rep: _Replica, a: policy.Action, now: float) -> None:
        if isinstance(a, policy.LogExit):
            rep.procs[a.rank].wait()
            rep.logged_exits.add(a.rank)
            self._event(rep, "exit", rank=a.rank, code=0, pid=rep.procs[a.rank].pid)
        elif isinstance(a, policy.Halted):
            self._event(rep, "exit", rank=a.rank, code=a.code, pid=rep.procs[a.rank].pid)
            self._on_halt(rep)
        elif isinstance(a, policy.ExitFailed):
            self._event(rep, "exit", rank=a.rank, code=a.code, pid=rep.procs[a.rank].pid)
            self._fail(rep, a.reason, code=a.code, rank=a.rank)
        elif isinstance(a, policy.Done):
            rep.state = "done"
            rep.step = self._committed_step(rep)
        elif isinstance(a, policy.Leaving):
            if rep.leaving_since is None:
                rep.leaving_since = now
        elif isinstance(a, policy.Hung):
            if a.diagnosed and rep.diagnosis is not None:  # its stacks are read before the kill (bounded)
                rep.diagnosis.join(DUMP_TIMEOUT_S + 1.0)
            stacks = {r: dump_stack(p.pid, EXIT_DUMP_TIMEOUT_S, native=True) for r, p in enumerate(rep.procs)
                      if a.dump and p.returncode is None}  # where it hangs on its way out
            self._event(rep, "hang", reason=a.reason, **({"stacks": stacks} if stacks else {}))
            self._fail(rep, a.reason)
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
                rep.diagnosis = threading.Thread(target=self._diagnose_hang, name=f"lft-hang-r{rep.rid}",
                                                 args=(rep, rep.incarnation, list(rep.procs), now), daemon=True)
                rep.diagnosis.start()
        else:
            raise AssertionError(f"supervisor: no way to carry out {a!r}")

    def _diagnose_hang(self, rep: _Replica, incarnation: int, procs: list[Proc],
                       missing_since: float) -> None:
        """A `hang` event that says where replica `rep` hangs (coord/hang.py): its ranks' process
        states and Python stacks, read from outside while it still hangs (launch/stacks.py), and
        the other replicas' stall reports (which FTAR link waits on it). Runs on its own thread
        from the moment its member key vanished; the kill waits for it (bounded). A stopped rank
        is a hang at once; otherwise the event waits for `hang_grace_s`, and is dropped if the
        replica exited meanwhile (a leader that revoked its lease on its way out)."""
        try:
            if self._left_cleanly(rep):
                return
            live = {r: p.pid for r, p in enumerate(procs) if p.returncode is None}
            if not live:
                return
            states = {r: process_state(pid) for r, pid in live.items()}
            culprit = culprit_rank(states)
            stacks = {r: dump_stack(pid) for r, pid in live.items() if r in (0, culprit)}
            d = diagnose(rep.rid, states, self._stall_reports(), stacks, pids=live, max_age_s=STALL_MAX_AGE_S,
                         why=f"members/{rep.rid} of incarnation {incarnation} vanished (lease expired) while "
                             f"its processes run")
            if d.state not in (*STOPPED, "D"):
                time.sleep(max(0.0, missing_since + self.hang_grace_s - time.monotonic()))
                if (self._left_cleanly(rep) or process_state(live.get(0, -1)) in ("Z", "X", "?")
                        or self._member_back(rep.rid, incarnation)):
                    return  # the leader exited, or its key is back: no hang (the supervisor's own rule)
            log.warning("hang: %s", d.reason)
            self._event(rep, "hang", incarnation=incarnation, diagnosis=True, **d.event())
        except Exception as e:  # a diagnosis must never stop the supervision
            log.warning("replica %d: hang diagnosis failed: %s: %s", rep.rid, type(e).__name__, e)

    def _on_halt(self, rep: _Replica) -> None:
        """The job halted: this replica is done for good, and nobody is restarted."""
        if not self.halted:
            self.halted = self._read_halt() or f"replica {rep.rid} exited with {int(ExitCode.HALTED)} (job halted)"
            self._halted_at = time.monotonic()
            log.error("lightning-ft: the job halted: %s", self.halted)
            self._event(rep, "job_halted", reason=self.halted)
        for p in rep.procs:
            _signal(p, signal.SIGKILL)
            _wait(p)
        rep.state = "failed"
        for other in self._replicas.values():
            if other.state == "restarting":
                other.state = "failed"

    def _report_crash_loop(self, rep: _Replica, code: Optional[int], rank: int) -> None:
        """A crash loop ended the replica (policy.after_failure): say so, with its log's last lines."""
        path = os.path.join(self.run_dir, "logs", f"r{rep.rid}.i{rep.incarnation}.rank{rank}.log")
        try:
            tail = open(path, errors="replace").read().splitlines()[-20:]
        except OSError:
            tail = []
        msg = (f"replica {rep.rid} failed {rep.crash_streak} times in a row with exit code {code} before committing "
               f"any step; not restarting it. Last lines of {path}:\n" + "\n".join("    " + t for t in tail))
        print(f"lightning-ft: {msg}", flush=True)
        self._event(rep, "crash_loop", code=code, streak=rep.crash_streak, log=path, tail=tail)

    # -- failures and restarts -------------------------------------------------------------------
    def _fail(self, rep: _Replica, reason: str, code: Optional[int] = None, rank: int = 0) -> None:
        """Kill the rest of the replica, evict it at once, then schedule its restart or give up."""
        killed = [rank for rank, p in enumerate(rep.procs) if _peek(p) is None]
        for p in rep.procs:
            _signal(p, signal.SIGKILL)  # the exited ranks too: this reaches what is left of their groups
        self._evict(rep, reason)
        for p in rep.procs:
            if not _wait(p):
                self._stragglers.append(p)
        rep.failed_at = time.monotonic()
        self._event(rep, "evict", reason=reason, killed_ranks=killed)
        downtime = self._downtime.get(rep.rid, 0)
        if downtime <= 0 and self._schedule is not None:
            downtime = self._schedule.downtime(rep.rid, rep.incarnation)
        out = policy.after_failure(policy.History(
            code=code, progressed=rep.progressed, crash_code=rep.crash_code, crash_streak=rep.crash_streak,
            restarts=rep.restarts, halted=bool(self.halted), downtime_steps=downtime), self._limits)
        rep.crash_code, rep.crash_streak = out.crash_code, out.crash_streak
        rep.state = out.state
        if out.why == "crash_loop":
            self._report_crash_loop(rep, code, rank)
            self._check_min_replicas()
            return
        if out.why == "max_restarts":
            self._event(rep, "give_up", reason=f"replica {rep.rid} failed {rep.restarts + 1} times "
                                               f"(max_restarts={self.max_restarts}); not restarting it")
            return
        if out.state != "restarting":  # a halted job restarts nobody: an eviction racing the halt ends it
            return
        rep.restart_at = rep.failed_at + self.restart_delay_s
        if self.restart_mode == "world":
            self._stop_world(rep)
            return
        if out.downtime_steps > 0:
            rep.restart_step = self._job_step() + out.downtime_steps

    def _check_min_replicas(self) -> None:
        """Replicas given up on: stop the job when fewer than min_replicas can still train."""
        left = [r for r in self._replicas.values() if r.state != "failed"]
        if len(self._replicas) < self.replicas:
            return  # one launcher of several: the others' replicas count too, and we cannot see them
        if len(left) < self.min_replicas:
            self.stopped = (f"only {len(left)} replica(s) left after crash loops, fewer than min_replicas="
                            f"{self.min_replicas}; stopping the job")
            print(f"lightning-ft: {self.stopped}", flush=True)
            for r in left:
                for p in r.procs:
                    _signal(p, signal.SIGKILL)
                    _wait(p)
                self._evict(r, "job stopped: too few replicas")
                r.state = "failed"

    def _stop_world(self, failed: _Replica) -> None:
        """Restart-the-world baseline: stop every other running replica as well."""
        for rep in self._replicas.values():
            if rep is failed or rep.state != "running":
                continue
            for p in rep.procs:
                _signal(p, signal.SIGKILL)
            for p in rep.procs:
                if not _wait(p):
                    self._stragglers.append(p)
            self._evict(rep, f"world restart after replica {failed.rid} failed")
            self._event(rep, "world_stop", reason=f"replica {failed.rid} failed")
            rep.failed_at = failed.failed_at
            rep.state = "restarting"
            rep.restart_at = failed.restart_at

    def _resume_world(self) -> None:
        """Before a world restart: the newest valid checkpoint, and a new history generation at it."""
        from lightning_ft.replica.checkpoint import newest_valid, restart_job

        found = newest_valid(self.checkpoint_root) if self.checkpoint_root else None
        try:
            restart_job(self._store, self._root, found[1] if found else None)
        except StoreError as e:
            log.warning("could not reset the job keyspace for a world restart: %s", e)
        if found is None:
            self._extra_env.pop("LFT_RESUME", None)
        else:
            self._extra_env["LFT_RESUME"] = os.path.abspath(found[1])
        for rep in self._replicas.values():
            if rep.state == "restarting":
                self._event(rep, "world_restart", checkpoint=found[1] if found else None,
                            step=found[0] if found else 0)

    def _restart_due(self) -> None:
        now = time.monotonic()
        if self.halted:
            for rep in self._replicas.values():
                if rep.state == "restarting":  # nothing restarts after a halt: run() can end
                    rep.state = "failed"
            if now - self._halted_at > HALT_GRACE_S:  # replicas that never learned of it
                for rep in self._replicas.values():
                    if rep.state == "running":
                        self._on_halt(rep)
            return
        if self.restart_mode == "world":
            waiting = [rep for rep in self._replicas.values() if rep.state == "restarting"]
            if not waiting or any(rep.state == "running" for rep in self._replicas.values()) or \
                    now < max(rep.restart_at for rep in waiting):
                return
            self._resume_world()
            for rep in waiting:
                rep.incarnation += 1
                rep.restarts += 1
                self._launch(rep)
            return
        for rep in self._replicas.values():
            if rep.state != "restarting":
                continue
            pending = policy.Pending(restart_at=rep.restart_at, by_step=rep.restart_step is not None,
                                     spares=bool(self._spares))
            facts = policy.Facts()
            while True:
                a = policy.restart_action(pending, now, facts)
                if isinstance(a, policy.Need) and a.fact == "downtime_over":
                    facts = replace(facts, downtime_over=self._downtime_over(rep))
                elif isinstance(a, policy.Need):
                    facts = replace(facts, finished=self._job_finished())
                elif isinstance(a, policy.Promote):
                    facts = replace(facts, promoted=self._promote_spare(rep))
                else:
                    break
            if isinstance(a, policy.NotRestarted):  # nothing left to train: a late replica would only idle
                rep.state = "done"
                self._event(rep, "not_restarted", reason="the job already finished")
            elif isinstance(a, policy.Launch):
                rep.incarnation += 1
                rep.restarts += 1
                self._launch(rep)

    def _downtime_over(self, rep: _Replica) -> bool:
        """The job reached restart_step, or nobody else is training (so it never would)."""
        reports = self._member_reports()
        if reports is None:
            return False
        others = {rid: r for rid, r in reports.items() if rid != rep.rid}
        return not others or (rep.restart_step is not None and self._job_step(reports) >= rep.restart_step)
