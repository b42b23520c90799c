"""What follows a replica's failure, and when it runs again (launch/supervisor.py; the
decisions are launch/policy.py's `after_failure` and `restart_action`): the kill and the
eviction, then a restart (a warm spare, a fresh start, or the whole world from the newest
checkpoint) or giving up (a crash loop, `max_restarts`, a halted job); halts, and stopping the
job when fewer than `min_replicas` are left.

Threads: owned by the supervision loop, with the records it acts on."""
from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import replace
from typing import Any, Optional

from lightning_ft.constants import ExitCode
from lightning_ft.coord.store import StoreError
from lightning_ft.launch import policy
from lightning_ft.launch.event_log import EventLog
from lightning_ft.launch.processes import Processes, peek, signal_group
from lightning_ft.launch.records import ReplicaRecord, ports_in_use
from lightning_ft.launch.run_view import RunView
from lightning_ft.launch.spares import Spares
from lightning_ft.launch.supervisor_settings import Placement, SupervisorSettings

log = logging.getLogger(__name__)

HALT_GRACE_S = 10.0
"""After a halt, replicas still running this long (they learn it at their next round) are stopped."""


class Restarts:
    """Failures and restarts of the replicas `replicas` (the supervisor's records)."""

    def __init__(self, replicas: dict[int, ReplicaRecord], place: Placement, settings: SupervisorSettings,
                 limits: policy.Limits, parts: tuple[Processes, Spares, RunView, EventLog]) -> None:
        self._replicas, self._place, self._settings, self._limits = replicas, place, settings, limits
        self._procs, self._spares, self._view, self._events = parts
        self.halted = ""
        """Why the job halted (from etcd), or ""."""
        self.halted_at = 0.0
        self.stopped = ""
        """Why the supervisor stopped the job itself (too few replicas left), or ""."""
        self.downtime = dict(settings.downtime_steps)
        """Replica -> job steps to keep it down after a failure (`Supervisor.set_downtime`)."""
        self._schedule = _failure_schedule(place.env.get("LFT_CONFIG"), place.replicas)
        """The job's failure schedule: per-event downtimes (None without a job config)."""

    # -- starting --------------------------------------------------------------------------------
    def start(self, rep: ReplicaRecord) -> None:
        """Start `rep`'s current incarnation as new processes, on a port none of ours uses."""
        self._procs.launch(rep, self._procs.free_port(ports_in_use(self._replicas.values(), self._spares)))

    def _promote(self, rep: ReplicaRecord) -> bool:
        """Replica `rep`'s next incarnation from a registered spare (Spares.take)."""
        sp = self._spares.take(rep)
        if sp is None:
            return False
        self._procs.untrack(rep.procs)  # the previous incarnation's: reaped
        rep.incarnation += 1
        rep.restarts += 1
        rep.procs, rep.host = sp.procs, sp.host
        more: dict[str, Any] = {"host": sp.host} if sp.host else {}
        self._procs.running(rep, sp.port, standby=sp.token, logs=f"spare-{sp.token}.rank*.log", **more)
        self._spares.top_up(bool(self.halted))
        return True

    # -- failures --------------------------------------------------------------------------------
    def fail(self, rep: ReplicaRecord, reason: str, code: Optional[int] = None, rank: int = 0) -> None:
        """Kill the rest of the replica, evict it at once, then schedule its restart or give up."""
        killed = [rank for rank, p in enumerate(rep.procs) if peek(p) is None]
        for p in rep.procs:
            signal_group(p, signal.SIGKILL)  # the exited ranks too: this reaches what is left of their groups
        self._view.evict(rep.rid, rep.incarnation, reason)
        self._procs.reap(rep.procs)
        rep.failed_at = time.monotonic()
        self._events.replica(rep.rid, rep.incarnation, "evict", reason=reason, killed_ranks=killed)
        downtime = self.downtime.get(rep.rid, 0)
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
            self._events.replica(rep.rid, rep.incarnation, "give_up",
                                 reason=f"replica {rep.rid} failed {rep.restarts + 1} times "
                                        f"(max_restarts={self._settings.max_restarts}); not restarting it")
            return
        if out.state != "restarting":  # a halted job restarts nobody: an eviction racing the halt ends it
            return
        rep.restart_at = rep.failed_at + self._settings.restart_delay_s
        if self._settings.restart == "world":
            self._stop_world(rep)
            return
        if out.downtime_steps > 0:
            rep.restart_step = self._view.job_step() + out.downtime_steps

    def halt(self, rep: ReplicaRecord) -> None:
        """The job halted: this replica is done for good, and nobody is restarted."""
        if not self.halted:
            self.halted = (self._view.halt_reason()
                           or f"replica {rep.rid} exited with {int(ExitCode.HALTED)} (job halted)")
            self.halted_at = time.monotonic()
            log.error("lightning-ft: the job halted: %s", self.halted)
            self._events.replica(rep.rid, rep.incarnation, "job_halted", reason=self.halted)
        self._procs.kill(rep.procs)
        rep.state = "failed"
        for other in self._replicas.values():
            if other.state == "restarting":
                other.state = "failed"

    def _report_crash_loop(self, rep: ReplicaRecord, code: Optional[int], rank: int) -> None:
        """A crash loop ended the replica (policy.after_failure): say so, with its log's last lines."""
        path = os.path.join(self._place.run_dir, "logs", f"r{rep.rid}.i{rep.incarnation}.rank{rank}.log")
        try:
            tail = open(path, errors="replace").read().splitlines()[-20:]
        except OSError:
            tail = []
        msg = (f"replica {rep.rid} failed {rep.crash_streak} times in a row with exit code {code} before committing "
               f"any step; not restarting it. Last lines of {path}:\n" + "\n".join("    " + t for t in tail))
        print(f"lightning-ft: {msg}", flush=True)
        self._events.replica(rep.rid, rep.incarnation, "crash_loop", code=code, streak=rep.crash_streak, log=path,
                             tail=tail)

    def _check_min_replicas(self) -> None:
        """Replicas given up on: stop the job when fewer than min_replicas can still train."""
        left = [r for r in self._replicas.values() if r.state != "failed"]
        if len(self._replicas) < self._place.replicas:
            return  # one launcher of several: the others' replicas count too, and we cannot see them
        if len(left) < self._settings.min_replicas:
            self.stopped = (f"only {len(left)} replica(s) left after crash loops, fewer than min_replicas="
                            f"{self._settings.min_replicas}; stopping the job")
            print(f"lightning-ft: {self.stopped}", flush=True)
            for r in left:
                self._procs.kill(r.procs)
                self._view.evict(r.rid, r.incarnation, "job stopped: too few replicas")
                r.state = "failed"

    # -- world restarts --------------------------------------------------------------------------
    def _stop_world(self, failed: ReplicaRecord) -> None:
        """Restart-the-world baseline: stop every other running replica as well."""
        for rep in self._replicas.values():
            if rep is failed or rep.state != "running":
                continue
            self._procs.kill(rep.procs)
            self._view.evict(rep.rid, rep.incarnation, f"world restart after replica {failed.rid} failed")
            self._events.replica(rep.rid, rep.incarnation, "world_stop", reason=f"replica {failed.rid} failed")
            rep.failed_at = failed.failed_at
            rep.state = "restarting"
            rep.restart_at = failed.restart_at

    def _resume_world(self) -> None:
        """Before a world restart: the newest valid checkpoint, and a new history generation at it."""
        from lightning_ft.replica.checkpoint import newest_valid, restart_job

        root = self._settings.checkpoint_root
        found = newest_valid(root) if root else None
        try:
            restart_job(self._view.store, self._view.root, found[1] if found else None)
        except StoreError as e:
            log.warning("could not reset the job keyspace for a world restart: %s", e)
        if found is None:
            self._procs.extra_env.pop("LFT_RESUME", None)
        else:
            self._procs.extra_env["LFT_RESUME"] = os.path.abspath(found[1])
        for rep in self._replicas.values():
            if rep.state == "restarting":
                self._events.replica(rep.rid, rep.incarnation, "world_restart",
                                     checkpoint=found[1] if found else None, step=found[0] if found else 0)

    # -- restarts due ----------------------------------------------------------------------------
    def due(self) -> None:
        """Start the replicas whose restart is due (policy.restart_action); after a halt, none."""
        now = time.monotonic()
        if self.halted:
            for rep in self._replicas.values():
                if rep.state == "restarting":  # nothing restarts after a halt: run() can end
                    rep.state = "failed"
            if now - self.halted_at > HALT_GRACE_S:  # replicas that never learned of it
                for rep in self._replicas.values():
                    if rep.state == "running":
                        self.halt(rep)
            return
        if self._settings.restart == "world":
            waiting = [rep for rep in self._replicas.values() if rep.state == "restarting"]
            if not waiting or any(rep.state == "running" for rep in self._replicas.values()) or \
                    now < max(rep.restart_at for rep in waiting):
                return
            self._resume_world()
            for rep in waiting:
                rep.incarnation += 1
                rep.restarts += 1
                self.start(rep)
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
                    facts = replace(facts, finished=self._view.job_finished())
                elif isinstance(a, policy.Promote):
                    facts = replace(facts, promoted=self._promote(rep))
                else:
                    break
            if isinstance(a, policy.NotRestarted):  # nothing left to train: a late replica would only idle
                rep.state = "done"
                self._events.replica(rep.rid, rep.incarnation, "not_restarted", reason="the job already finished")
            elif isinstance(a, policy.Launch):
                rep.incarnation += 1
                rep.restarts += 1
                self.start(rep)

    def _downtime_over(self, rep: ReplicaRecord) -> bool:
        """The job reached restart_step, or nobody else is training (so it never would)."""
        reports = self._view.member_reports()
        if reports is None:
            return False
        others = {rid: r for rid, r in reports.items() if rid != rep.rid}
        return not others or (rep.restart_step is not None and self._view.job_step(reports) >= rep.restart_step)


def _failure_schedule(config_path: Optional[str], replicas: int) -> Any:
    """The FailureSchedule of the job config at `config_path`, or None (no config, no events)."""
    if not config_path or not os.path.exists(config_path):
        return None
    from lightning_ft.config import load_config
    from lightning_ft.launch.failure import FailureSchedule

    cfg = load_config(config_path)
    if not cfg.failure.events:
        return None
    return FailureSchedule.from_config(cfg.failure, replicas)
