"""Warm spares (docs/ARCHITECTURE.md, "Warm standby"; coord/standby.py): keeping `standby` of them
started and registered, reaping the ones that die while they wait (and giving up when spares
keep dying before they register), stopping them, and taking one to promote in a failed
replica's place.

Threads: owned by the supervision loop (its records, the spares' processes)."""
from __future__ import annotations

import logging
import os
import time
from typing import Iterator, Optional

from lightning_ft.coord.store import StoreError
from lightning_ft.launch.event_log import EventLog
from lightning_ft.launch.processes import Processes, peek
from lightning_ft.launch.records import ReplicaRecord, SpareRecord, ports_in_use
from lightning_ft.launch.run_view import RunView
from lightning_ft.launch.zygote import Proc

log = logging.getLogger(__name__)

SPARE_FAILURES = 3
"""Spares that exit before they register, in a row, after which no more are started."""


class Spares:
    """The warm spares of one supervisor, beside the replicas of `replicas` (its records)."""

    def __init__(self, count: int, replicas: dict[int, ReplicaRecord], procs: Processes, view: RunView,
                 events: EventLog, *, run_dir: str, wrap: str) -> None:
        self.count = count
        """Warm spares to keep (`top_up`)."""
        self._replicas, self._procs, self._view, self._events = replicas, procs, view, events
        self._run_dir, self._wrap = run_dir, wrap
        self._spares: dict[str, SpareRecord] = {}
        self._seq = 0
        self._failures = 0
        self._read_at = 0.0
        self._done = False
        """A spare left because the job finished: none is started again."""

    def __bool__(self) -> bool:
        return bool(self._spares)

    def __iter__(self) -> Iterator[SpareRecord]:
        return iter(list(self._spares.values()))

    def top_up(self, stopped: bool = False) -> None:
        """Start spares until `count` are alive (none once the job is over, `stopped` (shut down
        or halted), or spares keep dying)."""
        if not self.count or stopped or self._done or self._failures >= SPARE_FAILURES:
            return
        if all(rep.state in ("done", "failed", "stopped") for rep in self._replicas.values()):
            return
        while len(self._spares) < self.count:
            self._seq += 1
            token = f"{self._view.run_id or 'run'}-{os.getpid()}-s{self._seq}"
            ids = sorted(self._replicas)
            template = self._replicas[ids[self._seq % len(ids)]]  # placed beside replicas in turn
            host = self._wrap.format(rid=template.rid) if self._wrap else ""
            port = self._procs.free_port(ports_in_use(self._replicas.values(), self._spares.values()))
            procs: list[Proc] = []
            try:
                for rank in range(template.spec.nproc):
                    path = os.path.join(self._run_dir, "logs", f"spare-{token}.rank{rank}.log")
                    procs.append(self._procs.start_process(self._procs.env(template, rank, port, spare=token), path,
                                                           host))
            except OSError as e:
                self._procs.kill(procs)
                log.warning("cannot start a warm spare (%s); restarts will be cold", e)
                self._failures = SPARE_FAILURES
                return
            self._spares[token] = SpareRecord(token, procs, port, host)
            self._events.line({"event": "spare_start", "token": token, "pids": [p.pid for p in procs],
                               **({"host": host} if host else {})})

    def reap(self, stopped: bool = False) -> None:
        """Spares that exited while waiting: cleaned up and replaced (a finished job's leave)."""
        if any(not sp.registered for sp in self._spares.values()) and time.monotonic() - self._read_at > 1.0:
            from lightning_ft.coord import standby

            self._read_at = time.monotonic()
            try:
                live = {sp.token for sp in standby.spares(self._view.store, self._view.root)}
            except StoreError:
                live = set()
            for sp in self._spares.values():
                sp.registered = sp.registered or sp.token in live
        for token, sp in list(self._spares.items()):
            codes = [peek(p) for p in sp.procs]
            if all(c is None for c in codes):
                continue
            self._procs.kill(sp.procs)
            del self._spares[token]
            self._events.line({"event": "spare_exit", "token": token, "codes": codes, "registered": sp.registered})
            if all(c == 0 for c in codes):  # a spare leaves cleanly only when the job finished
                self._done = True
            elif any(c not in (None, 0) for c in codes):
                self._failures = 0 if sp.registered else self._failures + 1
                if self._failures >= SPARE_FAILURES:
                    log.warning("%d warm spares in a row exited before they registered (see %s); no more spares: "
                                "restarts will be cold", SPARE_FAILURES,
                                os.path.join(self._run_dir, "logs", f"spare-{token}.rank0.log"))
        self.top_up(stopped)

    def stop(self, why: str) -> None:
        """Kill every spare (the job ended)."""
        for token, sp in list(self._spares.items()):
            self._procs.kill(sp.procs)
            self._events.line({"event": "spare_stop", "token": token, "reason": why})
        self._spares.clear()

    def forget(self) -> list[Proc]:
        """Drop every spare without a word; their live processes (shutdown stops them)."""
        live = [p for sp in self._spares.values() for p in sp.procs if p.returncode is None]
        self._spares.clear()
        return live

    def take(self, rep: ReplicaRecord) -> Optional[SpareRecord]:
        """A registered spare promoted (standby.assign/promote) to replica `rep`'s next
        incarnation, its logs linked under the replica's names; None when none could be."""
        from lightning_ft.coord import standby

        if not self._spares:
            return None
        try:
            live = {sp.token: sp for sp in standby.spares(self._view.store, self._view.root)}
        except StoreError as e:
            log.warning("cannot read the warm spares (%s); restarting replica %d cold", e, rep.rid)
            return None
        # where a spare runs is where we started it (its wrap), beside the replica it may replace
        ours = [standby.Spare(t, sp.host, live[t].world, live[t].since) for t, sp in self._spares.items()
                if t in live and all(peek(p) is None for p in sp.procs)]
        for sp in self._spares.values():
            sp.registered = sp.registered or sp.token in live
        vacancy = standby.Vacancy(rep.rid, rep.incarnation + 1, rep.host)
        pick = standby.assign([vacancy], ours, rep.spec.nproc).get(rep.rid)
        if pick is None:
            return None
        try:
            if not standby.promote(self._view.store, self._view.root, pick, rep.rid, rep.incarnation + 1):
                return None
        except StoreError as e:
            log.warning("cannot promote spare %s (%s); restarting replica %d cold", pick, e, rep.rid)
            return None
        sp = self._spares.pop(pick)
        for rank in range(len(sp.procs)):  # the replica's log under its usual name (report, crash loops)
            link = os.path.join(self._run_dir, "logs", f"r{rep.rid}.i{rep.incarnation + 1}.rank{rank}.log")
            try:
                os.symlink(f"spare-{pick}.rank{rank}.log", link)
            except OSError as e:
                log.warning("cannot link %s to spare %s's log: %s", link, pick, e)
        return sp
