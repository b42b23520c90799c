"""The processes of the replicas and spares one supervisor owns (launch/supervisor.py):
starting a replica's W processes (each in its own session, cleaned up by PID; forked by the
zygote when it can), their environment, signalling and reaping them.

Threads: owned by the supervision loop. Only its thread starts, signals or reaps processes,
and holds the pidfds; a hang-diagnosis thread gets the pids it reads as a snapshot."""
from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import time
from typing import Any, Iterable, Optional

from lightning_ft.coord.etcd_server import free_port
from lightning_ft.launch.event_log import EventLog
from lightning_ft.launch.records import ReplicaRecord
from lightning_ft.launch.supervisor_settings import Placement, SupervisorSettings
from lightning_ft.launch.zygote import Proc, Zygote, ZygoteProc, default_preload, python_target

log = logging.getLogger(__name__)

TERM_GRACE_S = 3.0
"""shutdown() waits this long after SIGTERM before it SIGKILLs what is left."""
REAP_TIMEOUT_S = 5.0
"""Bound on waiting for a SIGKILLed process to be reaped."""
ZYGOTE_FIRST_WAIT_S = 90.0
"""How long the start waits for the zygote's imports before it starts the replicas as new
processes (a loaded 2-core host took 15-100 s to import torch and Lightning; unloaded, 5 s)."""


class Processes:
    """Starts, signals and reaps the processes of the replicas of `place` running `cmd`."""

    def __init__(self, cmd: list[str], place: Placement, settings: SupervisorSettings, events: EventLog) -> None:
        self.cmd = list(cmd)
        self._place, self._settings, self._events = place, settings, events
        self.run_id = ""
        """The run the processes belong to (LFT_RUN_ID; set once the run is open)."""
        self.extra_env = dict(place.env)
        """Added to every process's environment; a world restart changes LFT_RESUME."""
        self.zygote_wanted = settings.zygote and not place.wrap and python_target(cmd) is not None
        self.zygote: Optional[Zygote] = None
        self.stragglers: list[Proc] = []
        """SIGKILLed processes that were not reaped within REAP_TIMEOUT_S; shutdown() retries them."""
        self._pidfds: dict[int, int] = {}
        """pid -> pidfd of our children (readable once the process exited)."""

    # -- starting --------------------------------------------------------------------------------
    def start_zygote(self) -> None:
        """Start the zygote and wait until it imported torch (and Lightning, when the script
        imports it), at most `ZYGOTE_FIRST_WAIT_S`: the replicas are then forked from it, so the
        job imports once instead of once per process (a 3-replica job here: 5 s of CPU instead
        of 16). A zygote that fails, or is not ready in time, leaves the replicas to start as
        plain processes; restarts use it once it is ready."""
        try:
            self.zygote = Zygote(default_preload(python_target(self.cmd)), env={**os.environ, **self.extra_env},
                                 log_path=os.path.join(self._place.run_dir, "logs", "zygote.log"))
        except OSError as e:
            log.warning("cannot start the zygote (replicas start Python afresh): %s", e)
            return
        deadline = time.monotonic() + ZYGOTE_FIRST_WAIT_S
        while not self.zygote.ready.wait(0.1) and not self.zygote.failed and self.zygote.proc.poll() is None:
            if time.monotonic() > deadline:
                log.warning("the zygote did not import within %.0f s: the replicas start as new processes",
                            ZYGOTE_FIRST_WAIT_S)
                return

    def launch(self, rep: ReplicaRecord, port: int) -> None:
        """Start replica `rep`'s current incarnation on `port` (MASTER_PORT)."""
        self.untrack(rep.procs)  # the previous incarnation's: reaped
        rep.procs = []
        rep.host = self._place.wrap.format(rid=rep.rid) if self._place.wrap else ""
        for rank in range(rep.spec.nproc):
            path = os.path.join(self._place.run_dir, "logs", f"r{rep.rid}.i{rep.incarnation}.rank{rank}.log")
            try:
                rep.procs.append(self.start_process(self.env(rep, rank, port), path, rep.host))
            except OSError as e:
                self.kill(rep.procs)
                raise RuntimeError(f"cannot start replica {rep.rid} rank {rank} ({self.cmd[0]!r}): {e}. "
                                   "Check the command and that the run directory is writable.") from e
        self.running(rep, port)

    def start_process(self, env: dict[str, str], log_path: str, host: str) -> Proc:
        """One process of the command with `env`, its output appended to `log_path`: forked by the
        zygote when there is one and it is ready (never under a per-replica `host` wrap), else a
        new process in its own session (through `host`'s wrap, if any)."""
        with open(log_path, "ab") as out:
            forked = (self.zygote.spawn(self.cmd, env, os.getcwd(), out.fileno(), out.fileno())
                      if self.zygote is not None and not host else None)
            cmd = shlex.split(host) + self.cmd if host else self.cmd
            return forked or subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True)

    def running(self, rep: ReplicaRecord, port: int, **more: Any) -> None:
        """Bookkeeping of a replica whose processes (`rep.procs`) were just started or promoted."""
        for p in rep.procs:
            if isinstance(p, ZygoteProc):  # not our child: readable once the zygote reported its exit
                self._pidfds[p.pid] = p.exit_fd()
                continue
            try:
                self._pidfds[p.pid] = os.pidfd_open(p.pid)
            except (AttributeError, OSError):  # no pidfds here: the loop polls
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
            self._events.replica(rep.rid, rep.incarnation, "start", **details)
        else:
            self._events.replica(rep.rid, rep.incarnation, "restart", restarts=rep.restarts,
                                 down_s=round(time.monotonic() - rep.failed_at, 3), **details)

    def env(self, rep: ReplicaRecord, rank: int, port: int, spare: str = "") -> dict[str, str]:
        """A replica's process environment, or (`spare`) a warm spare's: its token instead of the
        replica id and incarnation, which it learns when promoted."""
        place = self._place
        nproc = str(rep.spec.nproc)
        extra = dict(self.extra_env)
        if spare:  # a spare is always a later process: it catches up, it never resumes
            env = self.env(rep, rank, port)
            for name in ("LFT_REPLICA_ID", "LFT_INCARNATION", "LFT_RESUME"):
                env.pop(name, None)
            return {**env, "LFT_STANDBY": spare}
        if self._settings.restart == "replica" and rep.restarts > 0:
            # The resume checkpoint is for the job's first processes: a replica restarted later
            # catches up from the live ones (or a rewind loads a published checkpoint), and the
            # resume checkpoint may have been pruned meanwhile (the soak found it).
            extra.pop("LFT_RESUME", None)
        return {**os.environ, **extra,
                "LFT_JOB": place.job, "LFT_REPLICA_ID": str(rep.rid), "LFT_NUM_REPLICAS": str(place.replicas),
                "LFT_ETCD": place.etcd, "LFT_SECRET": place.secret, "LFT_INCARNATION": str(rep.incarnation),
                "LFT_RUN_ID": self.run_id,
                "LFT_RUN_DIR": place.run_dir, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc,
                "LFT_SPAWN_T": repr(time.time())}  # the restart breakdown's zero (replica/startup.py)

    @staticmethod
    def free_port(used: set[int]) -> int:
        """A free loopback port not in `used` (the ports of our running replicas and spares)."""
        while True:
            port = free_port()
            if port not in used:
                return port

    # -- exits -----------------------------------------------------------------------------------
    def untrack(self, procs: Iterable[Proc]) -> None:
        """Forget the pidfds of `procs` (an incarnation that was replaced: reaped)."""
        for p in procs:
            fd = self._pidfds.pop(p.pid, None)
            if fd is not None:
                os.close(fd)

    def exit_fds(self, procs: Iterable[Proc]) -> list[int]:
        """The descriptors that turn readable when one of the live `procs` exits."""
        return [fd for p in procs if (fd := self._pidfds.get(p.pid)) is not None and peek(p) is None]

    def all_watched(self, procs: Iterable[Proc]) -> bool:
        """Whether every live process of `procs` has a pidfd (else the loop must poll)."""
        return all(p.pid in self._pidfds for p in procs if p.returncode is None)

    def kill(self, procs: list[Proc]) -> None:
        """SIGKILL `procs` (their process groups), and reap them; the ones not reaped within
        REAP_TIMEOUT_S are kept as stragglers (shutdown tries again)."""
        for p in procs:
            signal_group(p, signal.SIGKILL)  # the exited ones too: this reaches what is left of their groups
        self.reap(procs)

    def reap(self, procs: list[Proc]) -> None:
        """Reap `procs` (signalled already); the ones still there are kept as stragglers."""
        for p in procs:
            if not reap(p):
                self.stragglers.append(p)

    def close(self) -> None:
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()
        if self.zygote is not None:
            self.zygote.close()


def signal_group(p: Proc, sig: int) -> None:
    """Signal the process group of `p` (its own: it was started in a new session), or `p` alone
    if it left that group. Only while `p` is unreaped, so its PID cannot belong to someone else."""
    if p.returncode is not None:
        return
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        try:
            os.kill(p.pid, sig)
        except ProcessLookupError:
            pass


def peek(p: Proc) -> Optional[int]:
    """The exit code of `p` (-N for signal N), or None while it runs, without reaping it."""
    if p.returncode is not None:
        return p.returncode
    try:
        info = os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped elsewhere (Popen.wait), or the zygote's child: let p report it
        return p.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def reap(p: Proc) -> bool:
    """Reap `p` within REAP_TIMEOUT_S; False if it is still there."""
    try:
        p.wait(REAP_TIMEOUT_S)
        return True
    except subprocess.TimeoutExpired:
        log.warning("pid %d did not exit within %.0fs of SIGKILL", p.pid, REAP_TIMEOUT_S)
        return False
