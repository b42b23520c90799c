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
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

from lightning_ft.constants import ExitCode
from lightning_ft.coord import keys
from lightning_ft.coord.etcd_server import free_port
from lightning_ft.coord.runs import RunHold, open_run
from lightning_ft.coord.hang import culprit_rank, diagnose
from lightning_ft.coord.store import EtcdStore, Store, StoreError
from lightning_ft.launch import policy
from lightning_ft.launch.stacks import DUMP_TIMEOUT_S, dump_stack, process_state
from lightning_ft.launch.zygote import Proc, Zygote, ZygoteProc, default_preload, python_target

log = logging.getLogger(__name__)

TERM_GRACE_S = 3.0
"""shutdown() waits this long after SIGTERM before it SIGKILLs what is left."""
REAP_TIMEOUT_S = 5.0
"""Bound on waiting for a SIGKILLed process to be reaped."""

SPARE_FAILURES = 3
"""Spares that exit before they register, in a row, after which no more are started."""
RESUME_LIVE_WAIT_S = 10.0
"""How long `--resume` waits for a dead job's leases to lapse (a launcher's hold: 5 s)."""
IDLE_WAKE_S = 1.0
"""run() wakes at least this often with nothing due (its `until`, e.g. etcd's health)."""
HALT_GRACE_S = 10.0
"""After a halt, replicas still running this long (they learn it at their next round) are stopped."""
STALL_MAX_AGE_S = 15.0
"""A hang diagnosis uses the other replicas' stall reports (stall/{rid}) younger than this."""


@dataclass
class ReplicaSpec:
    """A replica this supervisor owns: its id and its number of processes (W)."""

    rid: int
    nproc: int


@dataclass
class _Replica:
    """Supervision state of one replica."""

    spec: ReplicaSpec
    incarnation: int = 0
    state: str = "restarting"
    """"running" | "restarting" | "done" | "failed" | "stopped" (after shutdown)."""
    procs: list[Proc] = field(default_factory=list)
    """Indexed by local rank; kept after exit so the return codes stay readable."""
    logged_exits: set[int] = field(default_factory=set)
    """Ranks whose clean exit is already in the event log."""
    port: int = 0
    """MASTER_PORT of the current incarnation."""
    restarts: int = 0
    last_event: str = ""
    step: Optional[int] = None
    """The last step its leader reported in `members/{rid}` (hang_check only)."""
    compute_ms: float = -1.0
    """Its last reported compute time per step (coord/stragglers.py; the status table)."""
    kill_reason: str = ""
    """Why kill_replica() signalled it; added to the eviction reason."""
    member_seen: bool = False
    """Its leader's member key existed for the current incarnation."""
    started_at: float = 0.0
    """Monotonic time of the current incarnation's start."""
    missing_since: Optional[float] = None
    """When the member key was first seen gone after member_seen."""
    restart_at: float = 0.0
    """Monotonic time of the next start (time-based restart)."""
    restart_step: Optional[int] = None
    """Restart once the job's step reaches this (downtime-based restart)."""
    failed_at: float = 0.0
    first_step: Optional[int] = None
    """The step its leader first reported in this incarnation."""
    progressed: bool = False
    """This incarnation committed something (its reported step grew)."""
    crash_code: Optional[int] = None
    """Exit code of the last failure that came before any commit (crash-loop detection)."""
    crash_streak: int = 0
    diagnosis: Optional[threading.Thread] = None
    """The hang diagnosis running since its member key vanished (`_diagnose_hang`)."""
    host: str = ""
    """Where its processes run: the command prefix they were started with (`wrap`), "" without one;
    a promoted spare's replica runs where the spare ran."""
    leaving_since: Optional[float] = None
    """When it was first seen on its way out (left/{rid}/{inc} written, or a rank exited 0 while
    others still run): past exit_timeout_s from then it is hung on exit."""

    @property
    def rid(self) -> int:
        return self.spec.rid


@dataclass
class _Spare:
    """A warm spare this supervisor started (coord/standby.py)."""

    token: str
    procs: list[Proc]
    port: int
    host: str = ""
    """Where it runs: the command prefix it was started with (`wrap`), "" without one."""
    registered: bool = False
    """Its standby/ key was seen in etcd."""


class Supervisor:
    """Starts, watches and restarts the replicas `replica_ids` (default: all `replicas`) of one job."""

    def __init__(self, cmd: list[str], *, replicas: int, nproc_per_replica: int, job: str, etcd: str, secret: str,
                 run_dir: str, replica_ids: Sequence[int] | None = None, restart_delay_s: float = 0.2,
                 max_restarts: int = 10, env: dict[str, str] | None = None, store: Store | None = None,
                 prefix: str = "/lft", hang_check: bool = True, downtime_steps: dict[int, int] | None = None,
                 hang_grace_s: float = 2.0, restart: str = "replica", checkpoint_root: str = "",
                 crash_loop: int = 3, min_replicas: int = 1, seed_from: str = "", wrap: str = "",
                 start_timeout_s: float = 600.0, resume_wait_s: float = RESUME_LIVE_WAIT_S,
                 exit_timeout_s: float = 120.0, standby: int = 0, zygote: bool = False) -> None:
        """`hang_grace_s`: a vanished member key counts as a hang only if it stays gone this long
        while the leader still runs (a leader that revokes its lease on a clean exit is not hung).

        `restart`: "replica" (FT-HSDP: only the failed replica restarts and catches up) or "world"
        (the baseline, like torchrun elastic: any failure stops every replica, and all restart
        from the newest valid checkpoint under `checkpoint_root`, or from scratch).

        `crash_loop`: a replica that exits with the same non-zero code this many times in a row
        without committing a step is not restarted (its log tail is printed); if fewer than
        `min_replicas` are left, the job stops.

        The job's run (coord/runs.py) is opened by `start`: a launcher joins the run another
        launcher of the job (same job id and secret) is running, or starts a new one. A new
        run started with `seed_from` (a checkpoint directory: `--resume`) gets its cursors.

        `zygote`: restarts fork from a process that imported torch (and Lightning) once
        (launch/zygote.py) instead of starting Python afresh; only for `[python, script, ...]`
        (or `-m module`) commands without a `wrap`. Anything it cannot do starts as before."""
        self._zygote_wanted = zygote and not wrap and python_target(cmd) is not None
        self._zygote: Optional[Zygote] = None
        self._wrap = wrap
        if standby < 0:
            raise ValueError(f"standby={standby} must be >= 0")
        if standby and restart != "replica":
            raise ValueError("standby spares replace failed replicas; restart='world' restarts every replica")
        self.standby = standby
        """Warm spares to keep (`_top_up_spares`)."""
        self._spares: dict[str, _Spare] = {}
        self._spare_seq = 0
        self._spare_failures = 0
        self._spares_read = 0.0
        self._spares_done = False
        """A spare left because the job finished: none is started again."""
        self.start_timeout_s = start_timeout_s
        self.exit_timeout_s = exit_timeout_s
        """A replica on its way out (it left the job, or some ranks exited 0) that still runs this
        long after is hung on exit (stopped or deadlocked in teardown): killed and restarted (0: never)."""
        self._resume_wait_s = resume_wait_s
        """A leader not registered this long after its start is hung in initialization (0: never)."""
        """A command prefix per replica, `{rid}` replaced (e.g. `ip netns exec ns{rid}`: fault harnesses
        put each replica in its own network namespace; `LFT_REPLICA_WRAP` for `lightning-ft run`)."""
        if restart not in ("replica", "world"):
            raise ValueError(f"restart={restart!r} must be 'replica' or 'world'")
        self.restart_mode = restart
        self.checkpoint_root = checkpoint_root
        ids = list(range(replicas)) if replica_ids is None else list(replica_ids)
        bad = [r for r in ids if not 0 <= r < replicas]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"replica_ids {ids} must be distinct and between 0 and replicas - 1 ({replicas - 1})")
        if nproc_per_replica < 1:
            raise ValueError(f"nproc_per_replica={nproc_per_replica} must be >= 1")
        self.cmd = list(cmd)
        self.replicas = replicas
        self.job = job
        self.etcd = etcd
        self.run_dir = run_dir
        self.restart_delay_s = restart_delay_s
        self.max_restarts = max_restarts
        self.hang_check = hang_check
        self.hang_grace_s = hang_grace_s
        self.crash_loop = crash_loop
        self.min_replicas = min_replicas
        self.halted = ""
        """Why the job halted (from etcd), or ""."""
        self.stopped = ""
        """Why the supervisor stopped the job itself (too few replicas left), or ""."""
        self._halted_at = 0.0
        self._secret = secret
        self._extra_env = dict(env or {})
        self._prefix = prefix
        self._seed_from = seed_from
        self.run_id = ""
        """The run this launcher belongs to (set by `start`)."""
        self._root = keys.root(prefix, job)
        self._hold: Optional[RunHold] = None
        self.run_reason = ""
        """What `start` decided about the run, in words."""
        self._downtime = dict(downtime_steps or {})
        self._schedule = _failure_schedule(self._extra_env.get("LFT_CONFIG"), replicas)
        """The job's failure schedule: per-event downtimes (None without a job config)."""
        self._replicas = {rid: _Replica(ReplicaSpec(rid, nproc_per_replica)) for rid in ids}
        self._own_store = store is None
        self._store = store if store is not None else EtcdStore(etcd)
        self._lock = threading.RLock()
        self._stragglers: list[Proc] = []
        """SIGKILLed processes that were not reaped within REAP_TIMEOUT_S; shutdown() retries them."""
        self._started = False
        self._shut_down = False
        self._signalled: Optional[int] = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        """run() sleeps until a child exits (pidfds), a member report changes (the watch), a signal
        arrives, or its next deadline: nothing wakes it per training step."""
        self._pidfds: dict[int, int] = {}
        """pid -> pidfd of our children (readable once the process exited)."""
        self._members: Optional[dict[int, dict[str, Any]]] = None
        """members/ of the run as the watch last left it (None: no watch; read etcd instead)."""
        self._members_lock = threading.Lock()
        self._cancel_members: Optional[Callable[[], None]] = None
        os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
        self._events = open(os.path.join(run_dir, "events.jsonl"), "a", encoding="utf-8")
        self._events_lock = threading.Lock()

    # -- public API -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start every replica in incarnation 0."""
        with self._lock:
            if self._started or self._shut_down:
                raise RuntimeError("this Supervisor was already started; create a new one to start the job again")
            self._open_run()
            self._watch_members()
            atexit.register(self.shutdown)
            self._started = True
            for rep in self._replicas.values():
                self._launch(rep)
            self._top_up_spares()
            if self._zygote_wanted:  # after the replicas: it imports while they start
                try:
                    self._zygote = Zygote(default_preload(python_target(self.cmd)),
                                          env={**os.environ, **self._extra_env},
                                          log_path=os.path.join(self.run_dir, "logs", "zygote.log"))
                except OSError as e:
                    log.warning("cannot start the zygote (restarts start Python afresh): %s", e)

    @property
    def _limits(self) -> policy.Limits:
        """The settings launch/policy.py's rules read (attributes: tests and callers may change them)."""
        return policy.Limits(start_timeout_s=self.start_timeout_s, hang_grace_s=self.hang_grace_s,
                             exit_timeout_s=self.exit_timeout_s, crash_loop=self.crash_loop,
                             max_restarts=self.max_restarts)

    @property
    def root(self) -> str:
        """The keyspace of this launcher's run."""
        return self._root

    def _open_run(self) -> None:
        """Join or start the job's run. `--resume` (`seed_from`) continues the run this run
        directory last ran (RUN_DIR/run_id) when etcd still knows it, so the ledger spans the
        restart: a new history generation at the checkpoint (replica/checkpoint.py restart_job).
        Only a launcher that finds the run not running seeds it (several launchers of one job
        may resume it)."""
        from lightning_ft.coord.runs import is_live
        from lightning_ft.secret import tag

        self._hold = RunHold(self._store, ttl_s=5.0)
        try:
            want = self._previous_run_id() if self._seed_from else ""
            if want:
                # After a whole-job kill the dead job's keys (its launcher's hold, its members'
                # leases) stay until their leases lapse: wait that long, so that the resume
                # seeds the run instead of joining a run nobody runs (the soak found it: the
                # new incarnations met the dead job's evictions).
                root = keys.root(self._prefix, self.job, want)
                deadline = time.monotonic() + self._resume_wait_s
                while is_live(self._store, root) and time.monotonic() < deadline:
                    time.sleep(0.2)
            run = open_run(self._store, self._prefix, self.job, tag(self._secret, self.job), self._hold, want=want)
            self.run_id, self._root = run.run_id, keys.root(self._prefix, self.job, run.run_id)
            if self._seed_from and (run.action == "start" or not is_live(self._store, self._root)):
                from lightning_ft.replica.checkpoint import restart_job

                rec = restart_job(self._store, self._root, self._seed_from)
                print(f"lightning-ft: history generation {rec['gen']} starts at step {rec['to']}"
                      + (f" (the job had reached step {rec['from']})" if "from" in rec else ""), flush=True)
        except BaseException:
            self._hold.close()
            self._hold = None
            raise
        self._hold.hold(self._root)
        self.run_reason = run.reason
        if self.run_dir:
            os.makedirs(self.run_dir, exist_ok=True)
            with open(os.path.join(self.run_dir, "run_id"), "w") as f:
                f.write(self.run_id + "\n")

    def _previous_run_id(self) -> str:
        try:
            with open(os.path.join(self.run_dir, "run_id")) as f:
                return f.read().strip()
        except OSError:
            return ""

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

    def _notify(self) -> None:
        """Wake run() now (any thread, or a signal handler)."""
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    # -- the members/ watch -------------------------------------------------------------------------
    def _watch_members(self) -> None:
        """Keep members/ of the run in memory from a watch, so that hang checks read no etcd: a
        change (a report, a lease that expired) wakes run() at once. Without the watch (etcd
        refused it) the checks read etcd, as often as run() polls."""
        try:
            kvs, rev = self._store.get_prefix(keys.members(self._root))
            with self._members_lock:
                self._members = {}
                for kv in kvs:
                    _put_report(self._members, kv.key, kv.value)
            self._cancel_members = self._store.watch_prefix(keys.members(self._root), self._on_member_event,
                                                            start_revision=rev + 1)
        except StoreError as e:
            log.warning("cannot watch the member reports (%s); reading them at every poll instead", e)
            self._members = None

    def _on_member_event(self, ev: Any) -> None:
        with self._members_lock:
            if self._members is None:
                return
            if ev.kind == "delete":
                try:
                    self._members.pop(int(ev.key.rsplit("/", 1)[1]), None)
                except ValueError:
                    pass
            else:
                _put_report(self._members, ev.key, ev.value)
        self._notify()

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

    # -- launching --------------------------------------------------------------------------------
    def _launch(self, rep: _Replica) -> None:
        port = self._free_port()
        for p in rep.procs:  # the previous incarnation's: reaped
            fd = self._pidfds.pop(p.pid, None)
            if fd is not None:
                os.close(fd)
        rep.procs = []
        rep.host = self._wrap.format(rid=rep.rid) if self._wrap else ""
        zygote = self._zygote if rep.incarnation > 0 and not rep.host else None
        for rank in range(rep.spec.nproc):
            path = os.path.join(self.run_dir, "logs", f"r{rep.rid}.i{rep.incarnation}.rank{rank}.log")
            try:
                with open(path, "ab") as out:
                    env = self._env(rep, rank, port)
                    forked = zygote.spawn(self.cmd, env, os.getcwd(), out.fileno(), out.fileno()) if zygote else None
                    cmd = shlex.split(rep.host) + self.cmd if rep.host else self.cmd
                    rep.procs.append(forked or subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                                stdin=subprocess.DEVNULL, start_new_session=True))
            except OSError as e:
                for p in rep.procs:
                    _signal(p, signal.SIGKILL)
                    _wait(p)
                raise RuntimeError(f"cannot start replica {rep.rid} rank {rank} ({self.cmd[0]!r}): {e}. "
                                   "Check the command and that the run directory is writable.") from e
        self._running(rep, port)

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

    # -- warm spares (coord/standby.py) -------------------------------------------------------------
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
            cmd = shlex.split(host) + self.cmd if host else self.cmd
            port = self._free_port()
            procs: list[Proc] = []
            try:
                for rank in range(template.spec.nproc):
                    path = os.path.join(self.run_dir, "logs", f"spare-{token}.rank{rank}.log")
                    with open(path, "ab") as out:
                        procs.append(subprocess.Popen(cmd, env=self._env(template, rank, port, spare=token),
                                                      stdout=out, stderr=subprocess.STDOUT,
                                                      stdin=subprocess.DEVNULL, start_new_session=True))
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

    def _event_line(self, row: dict[str, Any]) -> None:
        """An event of no replica (the spares')."""
        with self._events_lock:
            if not self._events.closed:
                self._events.write(json.dumps({"t": time.time(), **row}) + "\n")
                self._events.flush()

    def _free_port(self) -> int:
        """A free loopback port not already handed to one of our running replicas."""
        used = {rep.port for rep in self._replicas.values() if rep.state == "running"}
        used |= {sp.port for sp in self._spares.values()}
        while True:
            port = free_port()
            if port not in used:
                return port

    # -- failures ---------------------------------------------------------------------------------
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
                leaving_since=rep.leaving_since)
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
            self._event(rep, "hang", reason=a.reason)
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
            if d.state not in ("T", "t", "D"):
                time.sleep(max(0.0, missing_since + self.hang_grace_s - time.monotonic()))
                if (self._left_cleanly(rep) or process_state(live.get(0, -1)) in ("Z", "X", "?")
                        or self._member_back(rep.rid, incarnation)):
                    return  # the leader exited, or its key is back: no hang (the supervisor's own rule)
            log.warning("hang: %s", d.reason)
            self._event(rep, "hang", incarnation=incarnation, diagnosis=True, **d.event())
        except Exception as e:  # a diagnosis must never stop the supervision
            log.warning("replica %d: hang diagnosis failed: %s: %s", rep.rid, type(e).__name__, e)

    def _member_back(self, rid: int, incarnation: int) -> bool:
        """Whether members/{rid} exists again for `incarnation` (etcd's own view, from any thread)."""
        try:
            kv = self._store.get(keys.members(self._root, rid))
            return kv is not None and json.loads(kv.value).get("incarnation") == incarnation
        except Exception:
            return False

    def _stall_reports(self) -> dict[int, dict[str, Any]]:
        """stall/{rid} of the run: each with `age_s` (seconds since its leader wrote it)."""
        out: dict[int, dict[str, Any]] = {}
        now = time.time()
        try:
            kvs, _ = self._store.get_prefix(keys.stall(self._root))
        except Exception as e:
            log.warning("could not read the stall reports: %s", e)
            return out
        for kv in kvs:
            try:
                st = json.loads(kv.value)
                out[int(kv.key.rsplit("/", 1)[1])] = {**st, "age_s": now - float(st.get("t", 0.0))}
            except (ValueError, TypeError):
                continue
        return out

    def _left_cleanly(self, rep: _Replica) -> bool:
        """Whether the replica's leader wrote `left/{rid}/{inc}` (Coordinator.close) before
        revoking its lease: a process tearing down is not a hang."""
        try:
            return self._store.get(keys.left(self._root, rep.rid, rep.incarnation)) is not None
        except Exception:
            return False

    # -- halts, crash loops, the end of the job -----------------------------------------------------
    def _read_halt(self) -> str:
        try:
            kv = self._store.get(keys.halt(self._root))
        except StoreError:
            return ""
        return json.loads(kv.value).get("reason", "halted") if kv is not None else ""

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

    def _job_finished(self) -> bool:
        try:
            return self._store.get(keys.finished(self._root)) is not None
        except StoreError:
            return False

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

    def _evict(self, rep: _Replica, reason: str) -> bool:
        """Write evict/{rid}/{inc}; False (and a warning) when etcd refused or was unreachable."""
        key = keys.evict(self._root, rep.rid, rep.incarnation)
        try:
            self._store.put(key, reason.encode())
            return True
        except StoreError as e:
            log.warning("could not write %s (%s); the others will drop replica %d when its lease expires",
                        key, e, rep.rid)
            return False

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

    def _committed_step(self, rep: _Replica) -> Optional[int]:
        """The steps a replica that exited cleanly committed: its `final.json` (strategy/runlog.py)
        when this incarnation wrote it, else the last step it reported. Member reports are written
        in full rounds only (steady rounds touch no etcd), so they lag by up to
        `consistency.every_n_steps`: a job of 400 steps ended with "step 390" on every replica."""
        path = os.path.join(self.run_dir, f"replica_{rep.rid}", "final.json")
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

    # -- etcd reads -------------------------------------------------------------------------------
    def _member_reports(self) -> Optional[dict[int, dict[str, Any]]]:
        """Live member reports by replica id (the watched view; etcd without one), or None when
        etcd could not be read."""
        with self._members_lock:
            if self._members is not None:
                return dict(self._members)
        try:
            kvs, _ = self._store.get_prefix(keys.members(self._root))
        except StoreError as e:
            log.warning("cannot read member reports: %s", e)
            return None
        reports: dict[int, dict[str, Any]] = {}
        for kv in kvs:
            _put_report(reports, kv.key, kv.value)
        return reports

    def _job_step(self, reports: Optional[dict[int, dict[str, Any]]] = None) -> int:
        """The job's step: max of the newest quorum's max_step and the members' reported steps."""
        if reports is None:
            reports = self._member_reports() or {}
        steps = [int(r.get("step", 0)) for r in reports.values()]
        try:
            kvs, _ = self._store.get_prefix(keys.quorum(self._root))
            if kvs:
                steps.append(int(json.loads(kvs[-1].value).get("max_step", 0)))
        except (StoreError, ValueError) as e:
            log.warning("cannot read the newest quorum: %s", e)
        return max(steps, default=0)

    # -- helpers ----------------------------------------------------------------------------------
    def _replica(self, rid: int) -> _Replica:
        if rid not in self._replicas:
            raise KeyError(f"replica {rid} is not supervised here (this supervisor owns {sorted(self._replicas)})")
        return self._replicas[rid]

    def _event(self, rep: _Replica, event: str, **details: Any) -> None:
        rec = {"t": time.time(), "event": event, "replica": rep.rid, "incarnation": rep.incarnation, **details}
        rep.last_event = event + (f": {details['reason']}" if "reason" in details else "")
        with self._events_lock:  # the hang diagnosis writes from its own thread
            self._events.write(json.dumps(rec) + "\n")
            self._events.flush()
        log.info("replica %d incarnation %d: %s %s", rep.rid, rep.incarnation, event, details)

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


def _signal(p: Proc, sig: int) -> None:
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


def _put_report(reports: dict[int, dict[str, Any]], key: str, value: bytes) -> None:
    """reports[replica id of members/ `key`] = its parsed report; a malformed one is skipped."""
    try:
        reports[int(key.rsplit("/", 1)[1])] = json.loads(value)
    except ValueError:
        log.warning("ignoring malformed member report %s", key)


def _peek(p: Proc) -> Optional[int]:
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


def _wait(p: Proc) -> bool:
    """Reap `p` within REAP_TIMEOUT_S; False if it is still there."""
    try:
        p.wait(REAP_TIMEOUT_S)
        return True
    except subprocess.TimeoutExpired:
        log.warning("pid %d did not exit within %.0fs of SIGKILL", p.pid, REAP_TIMEOUT_S)
        return False
