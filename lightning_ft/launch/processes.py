"""The supervisor's process layer (launch/supervisor.py): starting a replica's W processes (each
in its own session, cleaned up by PID; through the zygote when it can), their environment,
signalling and reaping them, the status rows, and shutdown."""
from __future__ import annotations

import atexit
import logging
import os
import shlex
import signal
import subprocess
import threading
import time
from typing import Any, Callable

from lightning_ft.coord.etcd_server import free_port
from lightning_ft.launch.zygote import Proc, ZygoteProc

from lightning_ft.launch.records import _Replica
from lightning_ft.launch.supervisor_base import TERM_GRACE_S, SupervisorBase, _peek, _signal, _wait

log = logging.getLogger(__name__)


class Processes(SupervisorBase):
    """A replica's processes (over the base)."""

    def _launch(self, rep: _Replica) -> None:
        port = self._free_port()
        for p in rep.procs:  # the previous incarnation's: reaped
            fd = self._pidfds.pop(p.pid, None)
            if fd is not None:
                os.close(fd)
        rep.procs = []
        rep.host = self._wrap.format(rid=rep.rid) if self._wrap else ""
        for rank in range(rep.spec.nproc):
            path = os.path.join(self.run_dir, "logs", f"r{rep.rid}.i{rep.incarnation}.rank{rank}.log")
            try:
                rep.procs.append(self._start_process(self._env(rep, rank, port), path, rep.host))
            except OSError as e:
                for p in rep.procs:
                    _signal(p, signal.SIGKILL)
                    _wait(p)
                raise RuntimeError(f"cannot start replica {rep.rid} rank {rank} ({self.cmd[0]!r}): {e}. "
                                   "Check the command and that the run directory is writable.") from e
        self._running(rep, port)

    def _start_process(self, env: dict[str, str], log_path: str, host: str) -> Proc:
        """One process of the command with `env`, its output appended to `log_path`: forked by the
        zygote when there is one and it is ready (never under a per-replica `host` wrap), else a
        new process in its own session (through `host`'s wrap, if any)."""
        with open(log_path, "ab") as out:
            forked = (self._zygote.spawn(self.cmd, env, os.getcwd(), out.fileno(), out.fileno())
                      if self._zygote is not None and not host else None)
            cmd = shlex.split(host) + self.cmd if host else self.cmd
            return forked or subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True)

    def _running(self, rep: _Replica, port: int, **more: Any) -> None:
        """Bookkeeping of a replica whose processes (`rep.procs`) were just started or promoted."""
        for p in rep.procs:
            if isinstance(p, ZygoteProc):  # not our child: readable once the zygote reported its exit
                self._pidfds[p.pid] = p.exit_fd()
                continue
            try:
                self._pidfds[p.pid] = os.pidfd_open(p.pid)
            except (AttributeError, OSError):  # no pidfds here: run() polls
                pass
        details: dict[str, Any] = {"pids": [p.pid for p in rep.procs], "master_port": port, **more}
        forked_by = {p.zygote_pid for p in rep.procs if isinstance(p, ZygoteProc)}
        if forked_by:  # the processes' parent, rather than this launcher
            details["zygote_pid"] = min(forked_by)
        if rep.restart_step is not None:
            details["wait_step"] = rep.restart_step
        rep.state = "running"
        rep.port = port
        rep.logged_exits = set()
        rep.kill_reason = ""
        rep.member_seen = False
        rep.started_at = time.monotonic()
        rep.missing_since = None
        rep.leaving_since = None
        rep.restart_step = None
        rep.first_step, rep.progressed = None, False
        if rep.incarnation == 0:
            self._event(rep, "start", **details)
        else:
            self._event(rep, "restart", restarts=rep.restarts,
                        down_s=round(time.monotonic() - rep.failed_at, 3), **details)

    def _env(self, rep: _Replica, rank: int, port: int, spare: str = "") -> dict[str, str]:
        """A replica's process environment, or (`spare`) a warm spare's: its token instead of the
        replica id and incarnation, which it learns when promoted."""
        nproc = str(rep.spec.nproc)
        extra = dict(self._extra_env)
        if spare:  # a spare is always a later process: it catches up, it never resumes
            env = self._env(rep, rank, port)
            for name in ("LFT_REPLICA_ID", "LFT_INCARNATION", "LFT_RESUME"):
                env.pop(name, None)
            return {**env, "LFT_STANDBY": spare}
        if self.restart_mode == "replica" and rep.restarts > 0:
            # The resume checkpoint is for the job's first processes: a replica restarted later
            # catches up from the live ones (or a rewind loads a published checkpoint), and the
            # resume checkpoint may have been pruned meanwhile (the soak found it).
            extra.pop("LFT_RESUME", None)
        return {**os.environ, **extra,
                "LFT_JOB": self.job, "LFT_REPLICA_ID": str(rep.rid), "LFT_NUM_REPLICAS": str(self.replicas),
                "LFT_ETCD": self.etcd, "LFT_SECRET": self._secret, "LFT_INCARNATION": str(rep.incarnation),
                "LFT_RUN_ID": self.run_id,
                "LFT_RUN_DIR": self.run_dir, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc,
                "LFT_SPAWN_T": repr(time.time())}  # the restart breakdown's zero (replica/startup.py)

    def _free_port(self) -> int:
        """A free loopback port not already handed to one of our running replicas."""
        used = {rep.port for rep in self._replicas.values() if rep.state == "running"}
        used |= {sp.port for sp in self._spares.values()}
        while True:
            port = free_port()
            if port not in used:
                return port

    def kill_replica(self, rid: int, sig: int = signal.SIGKILL, reason: str = "") -> None:
        """Send `sig` to every live process of replica `rid`. The next poll() handles the exits
        as a failure (evict, restart); `reason` is added to the eviction reason."""
        with self._lock:
            rep = self._replica(rid)
            rep.kill_reason = reason
            for p in rep.procs:
                _signal(p, sig)

    def status(self) -> list[dict[str, Any]]:
        """Per replica: rid, incarnation, state ("running", "restarting", "done", "failed" or, after
        shutdown, "stopped"), pids (of live processes), restarts, step (last reported), last_event,
        compute_ms (its reported compute per step) and compute_ratio (over the median of the other
        running replicas'; a straggler's is >= stragglers.threshold)."""
        from lightning_ft.coord.stragglers import ratios

        with self._lock:
            slow = ratios({rep.rid: rep.compute_ms for rep in self._replicas.values() if rep.state == "running"})
            return [{"rid": rep.rid, "incarnation": rep.incarnation, "state": rep.state,
                     "pids": [p.pid for p in rep.procs if _peek(p) is None], "restarts": rep.restarts,
                     "step": rep.step, "last_event": rep.last_event,
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
            live = [p for rep in running for p in rep.procs if p.returncode is None] + self._stragglers
            live += [p for sp in self._spares.values() for p in sp.procs if p.returncode is None]
            self._spares.clear()
            for p in live:
                _signal(p, signal.SIGTERM)
            deadline = time.monotonic() + TERM_GRACE_S
            while time.monotonic() < deadline and any(_peek(p) is None for p in live):
                time.sleep(0.02)
            for p in live:
                _signal(p, signal.SIGKILL)  # the exited ones too: this reaches what is left of their groups
                _wait(p)
            reachable = True
            for rep in running:
                reachable = reachable and self._evict(rep, "supervisor shut down")  # one timeout at most
                self._event(rep, "shutdown", pids=[p.pid for p in rep.procs])
                rep.state = "stopped"
            for rep in self._replicas.values():
                if rep.state == "restarting":
                    rep.state = "stopped"
            self._events.close()
            if self._cancel_members is not None:
                self._cancel_members()
                self._cancel_members = None
            for fd in self._pidfds.values():
                os.close(fd)
            self._pidfds.clear()
            if self._zygote is not None:
                self._zygote.close()
            # the wake pipe stays open: a late signal or watch callback may still write to it,
            # and a closed descriptor's number may by then belong to some other file
            if self._hold is not None:
                self._hold.close()
            if self._own_store:
                self._store.close()

    def _install_signal_handlers(self) -> Callable[[], None]:
        """SIGINT/SIGTERM make run() shut down; returns a function restoring the old handlers."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_signal(signum: int, frame: Any) -> None:
            self._signalled = signum
            self._notify()

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

        def restore() -> None:
            for s, handler in old.items():
                signal.signal(s, handler)

        return restore
