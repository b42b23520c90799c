"""Warm spares (docs/ARCHITECTURE.md, "Warm standby"; coord/standby.py): keeping `standby` of them
started and registered, reaping the ones that die while they wait (and giving up when spares
keep dying before they register), stopping them, and promoting one in a failed replica's place."""
from __future__ import annotations

import logging
import os
import signal
import time

from lightning_ft.coord.store import StoreError
from lightning_ft.launch.zygote import Proc

from lightning_ft.launch.processes import Processes
from lightning_ft.launch.records import _Replica, _Spare
from lightning_ft.launch.supervisor_base import SPARE_FAILURES, _peek, _signal, _wait

log = logging.getLogger(__name__)


class Spares(Processes):
    """Warm spares (over the processes)."""

    def _top_up_spares(self) -> None:
        """Start spares until `standby` are alive (none once the job is over or spares keep dying)."""
        if (not self.standby or self._shut_down or self.halted or self._spares_done
                or self._spare_failures >= SPARE_FAILURES):
            return
        if all(rep.state in ("done", "failed", "stopped") for rep in self._replicas.values()):
            return
        while len(self._spares) < self.standby:
            self._spare_seq += 1
            token = f"{self.run_id or 'run'}-{os.getpid()}-s{self._spare_seq}"
            ids = sorted(self._replicas)
            template = self._replicas[ids[self._spare_seq % len(ids)]]  # placed beside replicas in turn
            host = self._wrap.format(rid=template.rid) if self._wrap else ""
            port = self._free_port()
            procs: list[Proc] = []
            try:
                for rank in range(template.spec.nproc):
                    path = os.path.join(self.run_dir, "logs", f"spare-{token}.rank{rank}.log")
                    procs.append(self._start_process(self._env(template, rank, port, spare=token), path, host))
            except OSError as e:
                for p in procs:
                    _signal(p, signal.SIGKILL)
                    _wait(p)
                log.warning("cannot start a warm spare (%s); restarts will be cold", e)
                self._spare_failures = SPARE_FAILURES
                return
            self._spares[token] = _Spare(token, procs, port, host)
            self._event_line({"event": "spare_start", "token": token, "pids": [p.pid for p in procs],
                              **({"host": host} if host else {})})

    def _reap_spares(self) -> None:
        """Spares that exited while waiting: cleaned up and replaced (a finished job's leave)."""
        if any(not sp.registered for sp in self._spares.values()) and time.monotonic() - self._spares_read > 1.0:
            from lightning_ft.coord import standby

            self._spares_read = time.monotonic()
            try:
                live = {sp.token for sp in standby.spares(self._store, self._root)}
            except StoreError:
                live = set()
            for sp in self._spares.values():
                sp.registered = sp.registered or sp.token in live
        for token, sp in list(self._spares.items()):
            codes = [_peek(p) for p in sp.procs]
            if all(c is None for c in codes):
                continue
            for p in sp.procs:
                _signal(p, signal.SIGKILL)
                _wait(p)
            del self._spares[token]
            self._event_line({"event": "spare_exit", "token": token, "codes": codes, "registered": sp.registered})
            if all(c == 0 for c in codes):  # a spare leaves cleanly only when the job finished
                self._spares_done = True
            elif any(c not in (None, 0) for c in codes):
                self._spare_failures = 0 if sp.registered else self._spare_failures + 1
                if self._spare_failures >= SPARE_FAILURES:
                    log.warning("%d warm spares in a row exited before they registered (see %s); no more spares: "
                                "restarts will be cold", SPARE_FAILURES,
                                os.path.join(self.run_dir, "logs", f"spare-{token}.rank0.log"))
        self._top_up_spares()

    def _stop_spares(self, why: str) -> None:
        for token, sp in list(self._spares.items()):
            for p in sp.procs:
                _signal(p, signal.SIGKILL)
                _wait(p)
            self._event_line({"event": "spare_stop", "token": token, "reason": why})
        self._spares.clear()

    def _promote_spare(self, rep: _Replica) -> bool:
        """Replica `rep`'s next incarnation from a registered spare (standby.assign/promote)."""
        from lightning_ft.coord import standby

        if not self._spares:
            return False
        try:
            live = {sp.token: sp for sp in standby.spares(self._store, self._root)}
        except StoreError as e:
            log.warning("cannot read the warm spares (%s); restarting replica %d cold", e, rep.rid)
            return False
        # where a spare runs is where we started it (its wrap), beside the replica it may replace
        ours = [standby.Spare(t, sp.host, live[t].world, live[t].since) for t, sp in self._spares.items()
                if t in live and all(_peek(p) is None for p in sp.procs)]
        for sp in self._spares.values():
            sp.registered = sp.registered or sp.token in live
        vacancy = standby.Vacancy(rep.rid, rep.incarnation + 1, rep.host)
        pick = standby.assign([vacancy], ours, rep.spec.nproc).get(rep.rid)
        if pick is None:
            return False
        try:
            if not standby.promote(self._store, self._root, pick, rep.rid, rep.incarnation + 1):
                return False
        except StoreError as e:
            log.warning("cannot promote spare %s (%s); restarting replica %d cold", pick, e, rep.rid)
            return False
        sp = self._spares.pop(pick)
        for p in rep.procs:  # the previous incarnation's: reaped
            fd = self._pidfds.pop(p.pid, None)
            if fd is not None:
                os.close(fd)
        rep.incarnation += 1
        rep.restarts += 1
        rep.procs, rep.host = sp.procs, sp.host
        for rank in range(len(sp.procs)):  # the replica's log under its usual name (report, crash loops)
            link = os.path.join(self.run_dir, "logs", f"r{rep.rid}.i{rep.incarnation}.rank{rank}.log")
            try:
                os.symlink(f"spare-{pick}.rank{rank}.log", link)
            except OSError as e:
                log.warning("cannot link %s to spare %s's log: %s", link, pick, e)
        self._running(rep, sp.port, standby=pick, logs=f"spare-{pick}.rank*.log", **({"host": sp.host} if sp.host
                                                                                      else {}))
        self._top_up_spares()
        return True
