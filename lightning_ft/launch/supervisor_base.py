"""The supervisor's base layer (launch/supervisor.py has the whole story): the records of the
replicas and spares it owns, the job's run (open, join, resume), what etcd says about the run
(members and their reports, stall reports, halts, left and finished records, the job's step),
the event log, and the small process helpers every layer uses."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from typing import Any, Callable, Optional

from lightning_ft.coord import keys
from lightning_ft.coord.runs import RunHold, open_run
from lightning_ft.coord.store import EtcdStore, Store, StoreError
from lightning_ft.launch import policy
from lightning_ft.launch.zygote import Proc, Zygote, python_target

from lightning_ft.launch.records import ReplicaSpec, _Replica, _Spare
from lightning_ft.launch.supervisor_settings import Placement, SupervisorSettings

log = logging.getLogger(__name__)

TERM_GRACE_S = 3.0
"""shutdown() waits this long after SIGTERM before it SIGKILLs what is left."""
REAP_TIMEOUT_S = 5.0
"""Bound on waiting for a SIGKILLed process to be reaped."""

SPARE_FAILURES = 3
"""Spares that exit before they register, in a row, after which no more are started."""
IDLE_WAKE_S = 1.0
"""run() wakes at least this often with nothing due (its `until`, e.g. etcd's health)."""
HALT_GRACE_S = 10.0
"""After a halt, replicas still running this long (they learn it at their next round) are stopped."""
STALL_MAX_AGE_S = 15.0
"""A hang diagnosis uses the other replicas' stall reports (stall/{rid}) younger than this."""


class SupervisorBase:
    """Records, the run and what etcd says about it (see launch/supervisor.py)."""

    def __init__(self, cmd: list[str], place: Placement, settings: Optional[SupervisorSettings] = None, *,
                 store: Store | None = None) -> None:
        """Run `cmd` as the replicas of `place`, supervised by `settings` (launch/supervisor_settings.py);
        `store`: an open etcd client (default: one to `place.etcd`).

        The job's run (coord/runs.py) is opened by `start`: a launcher joins the run another
        launcher of the job (same job id and secret) is running, or starts a new one."""
        st = settings or SupervisorSettings()
        self.place, self.settings = place, st
        replicas, nproc_per_replica, job, etcd = place.replicas, place.nproc_per_replica, place.job, place.etcd
        run_dir, replica_ids, wrap, prefix = place.run_dir, place.replica_ids, place.wrap, place.prefix
        restart, standby, zygote = st.restart, st.standby, st.zygote
        self._zygote_wanted = zygote and not wrap and python_target(cmd) is not None
        self._zygote: Optional[Zygote] = None
        self._wrap = wrap
        """A command prefix per replica, `{rid}` replaced (e.g. `ip netns exec ns{rid}`: fault harnesses
        put each replica in its own network namespace; `LFT_REPLICA_WRAP` for `lightning-ft run`)."""
        self.standby = standby
        """Warm spares to keep (`_top_up_spares`)."""
        self._spares: dict[str, _Spare] = {}
        self._spare_seq = 0
        self._spare_failures = 0
        self._spares_read = 0.0
        self._spares_done = False
        """A spare left because the job finished: none is started again."""
        self.start_timeout_s = st.start_timeout_s
        """A leader not registered this long after its start is hung in initialization (0: never)."""
        self.exit_timeout_s = st.exit_timeout_s
        """A replica on its way out (it left the job, or some ranks exited 0) that still runs this
        long after is hung on exit (stopped or deadlocked in teardown): killed and restarted (0: never)."""
        self._resume_wait_s = st.resume_wait_s
        """How long `--resume` waits for a dead job's leases to lapse."""
        self.restart_mode = restart
        self.checkpoint_root = st.checkpoint_root
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
        self.restart_delay_s = st.restart_delay_s
        self.max_restarts = st.max_restarts
        self.hang_check = st.hang_check
        self.hang_grace_s = st.hang_grace_s
        self.crash_loop = st.crash_loop
        self.min_replicas = st.min_replicas
        self.halted = ""
        """Why the job halted (from etcd), or ""."""
        self.stopped = ""
        """Why the supervisor stopped the job itself (too few replicas left), or ""."""
        self._halted_at = 0.0
        self._secret = place.secret
        self._extra_env = dict(place.env)
        self._prefix = prefix
        self._seed_from = st.seed_from
        self.run_id = ""
        """The run this launcher belongs to (set by `start`)."""
        self._root = keys.root(prefix, job)
        self._hold: Optional[RunHold] = None
        self.run_reason = ""
        """What `start` decided about the run, in words."""
        self._downtime = dict(st.downtime_steps)
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

    # -- the run ---------------------------------------------------------------------------------
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

    # -- what etcd says --------------------------------------------------------------------------
    def _notify(self) -> None:
        """Wake run() now (any thread, or a signal handler)."""
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

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

    def _read_halt(self) -> str:
        try:
            kv = self._store.get(keys.halt(self._root))
        except StoreError:
            return ""
        return json.loads(kv.value).get("reason", "halted") if kv is not None else ""

    def _job_finished(self) -> bool:
        try:
            return self._store.get(keys.finished(self._root)) is not None
        except StoreError:
            return False

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

    # -- events ----------------------------------------------------------------------------------
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

    def _event_line(self, row: dict[str, Any]) -> None:
        """An event of no replica (the spares')."""
        with self._events_lock:
            if not self._events.closed:
                self._events.write(json.dumps({"t": time.time(), **row}) + "\n")
                self._events.flush()

    @property
    def _limits(self) -> policy.Limits:
        """The settings launch/policy.py's rules read (attributes: tests and callers may change them)."""
        return policy.Limits(start_timeout_s=self.start_timeout_s, hang_grace_s=self.hang_grace_s,
                             exit_timeout_s=self.exit_timeout_s, crash_loop=self.crash_loop,
                             max_restarts=self.max_restarts)

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
