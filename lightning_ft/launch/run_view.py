"""The supervisor's view of its run in etcd (launch/supervisor.py): opening the run (join,
start, resume), the members' reports (kept from a watch), stall reports, `left/`, the halt,
`finished`, the job's step, and evictions.

Threads: the supervision loop calls everything here. The members/ watch callback (the
store's watch thread) writes `_members`, under `_members_lock`, and wakes the loop
(`on_change`); the loop reads a copy. Hang-diagnosis threads (launch/diagnosis.py) call the
read-only queries (`stall_reports`, `left_cleanly`, `member_back`), which read etcd only."""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Callable, Optional

from lightning_ft.coord import keys
from lightning_ft.coord.runs import RunHold, is_live, open_run
from lightning_ft.coord.store import Store, StoreError
from lightning_ft.launch.supervisor_settings import Placement, SupervisorSettings

log = logging.getLogger(__name__)

Reports = dict[int, dict[str, Any]]
"""Member reports (members/{rid}, parsed) by replica id."""


class RunView:
    """The run's keys as one launcher reads and writes them."""

    def __init__(self, store: Store, place: Placement, settings: SupervisorSettings, *, own_store: bool,
                 on_change: Callable[[], None]) -> None:
        """`store`: the job's etcd (closed by `close` when `own_store`); `on_change`: called from
        the watch thread when a member report changed."""
        self.store = store
        self._own_store = own_store
        self._place, self._settings = place, settings
        self._on_change = on_change
        self.run_id = ""
        """The run this launcher belongs to (set by `open`)."""
        self.root = keys.root(place.prefix, place.job)
        """The keyspace of the run (the job's root until `open`)."""
        self.reason = ""
        """What `open` decided about the run, in words."""
        self._hold: Optional[RunHold] = None
        self._members: Optional[Reports] = None
        """members/ of the run as the watch last left it (None: no watch; read etcd instead).
        Written by the watch callback and by `watch_members`, read by the loop: under _members_lock."""
        self._members_lock = threading.Lock()
        self._cancel_members: Optional[Callable[[], None]] = None

    # -- the run ---------------------------------------------------------------------------------
    def open(self) -> None:
        """Join or start the job's run. `--resume` (`seed_from`) continues the run this run
        directory last ran (RUN_DIR/run_id) when etcd still knows it, so the ledger spans the
        restart: a new history generation at the checkpoint (replica/checkpoint.py restart_job).
        Only a launcher that finds the run not running seeds it (several launchers of one job
        may resume it)."""
        from lightning_ft.secret import tag

        place, seed_from = self._place, self._settings.seed_from
        self._hold = RunHold(self.store, ttl_s=5.0)
        try:
            want = self._previous_run_id() if seed_from else ""
            if want:
                # After a whole-job kill the dead job's keys (its launcher's hold, its members'
                # leases) stay until their leases lapse: wait that long, so that the resume
                # seeds the run instead of joining a run nobody runs (the soak found it: the
                # new incarnations met the dead job's evictions).
                root = keys.root(place.prefix, place.job, want)
                deadline = time.monotonic() + self._settings.resume_wait_s
                while is_live(self.store, root) and time.monotonic() < deadline:
                    time.sleep(0.2)
            run = open_run(self.store, place.prefix, place.job, tag(place.secret, place.job), self._hold, want=want)
            self.run_id, self.root = run.run_id, keys.root(place.prefix, place.job, run.run_id)
            if seed_from and (run.action == "start" or not is_live(self.store, self.root)):
                from lightning_ft.replica.checkpoint import restart_job

                rec = restart_job(self.store, self.root, seed_from)
                print(f"lightning-ft: history generation {rec['gen']} starts at step {rec['to']}"
                      + (f" (the job had reached step {rec['from']})" if "from" in rec else ""), flush=True)
        except BaseException:
            self._hold.close()
            self._hold = None
            raise
        self._hold.hold(self.root)
        self.reason = run.reason
        if place.run_dir:
            os.makedirs(place.run_dir, exist_ok=True)
            with open(os.path.join(place.run_dir, "run_id"), "w") as f:
                f.write(self.run_id + "\n")

    def _previous_run_id(self) -> str:
        try:
            with open(os.path.join(self._place.run_dir, "run_id")) as f:
                return f.read().strip()
        except OSError:
            return ""

    # -- the members' reports --------------------------------------------------------------------
    def watch_members(self) -> None:
        """Keep members/ of the run in memory from a watch, so that hang checks read no etcd: a
        change (a report, a lease that expired) wakes the loop at once. Without the watch (etcd
        refused it) the checks read etcd, as often as the loop polls."""
        try:
            kvs, rev = self.store.get_prefix(keys.members(self.root))
            with self._members_lock:
                self._members = {}
                for kv in kvs:
                    _put_report(self._members, kv.key, kv.value)
            self._cancel_members = self.store.watch_prefix(keys.members(self.root), self._on_member_event,
                                                           start_revision=rev + 1)
        except StoreError as e:
            log.warning("cannot watch the member reports (%s); reading them at every poll instead", e)
            with self._members_lock:
                self._members = None

    @property
    def watching(self) -> bool:
        """Whether member reports come from the watch (else each read goes to etcd)."""
        with self._members_lock:
            return self._members is not None

    def _on_member_event(self, ev: Any) -> None:
        """The watch thread: apply one members/ change, then wake the loop."""
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
        self._on_change()

    def member_reports(self) -> Optional[Reports]:
        """Live member reports by replica id (the watched view; etcd without one), or None when
        etcd could not be read."""
        with self._members_lock:
            if self._members is not None:
                return dict(self._members)
        try:
            kvs, _ = self.store.get_prefix(keys.members(self.root))
        except StoreError as e:
            log.warning("cannot read member reports: %s", e)
            return None
        reports: Reports = {}
        for kv in kvs:
            _put_report(reports, kv.key, kv.value)
        return reports

    def member_back(self, rid: int, incarnation: int) -> bool:
        """Whether members/{rid} exists again for `incarnation` (etcd's own view, from any thread)."""
        try:
            kv = self.store.get(keys.members(self.root, rid))
            return kv is not None and json.loads(kv.value).get("incarnation") == incarnation
        except Exception:
            return False

    def job_step(self, reports: Optional[Reports] = None) -> int:
        """The job's step: max of the newest quorum's max_step and the members' reported steps."""
        if reports is None:
            reports = self.member_reports() or {}
        steps = [int(r.get("step", 0)) for r in reports.values()]
        try:
            kvs, _ = self.store.get_prefix(keys.quorum(self.root))
            if kvs:
                steps.append(int(json.loads(kvs[-1].value).get("max_step", 0)))
        except (StoreError, ValueError) as e:
            log.warning("cannot read the newest quorum: %s", e)
        return max(steps, default=0)

    # -- other keys ------------------------------------------------------------------------------
    def stall_reports(self) -> Reports:
        """stall/{rid} of the run: each with `age_s` (seconds since its leader wrote it)."""
        out: Reports = {}
        now = time.time()
        try:
            kvs, _ = self.store.get_prefix(keys.stall(self.root))
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

    def left_cleanly(self, rid: int, incarnation: int) -> bool:
        """Whether the replica's leader wrote `left/{rid}/{inc}` (Coordinator.close) before
        revoking its lease: a process tearing down is not a hang."""
        try:
            return self.store.get(keys.left(self.root, rid, incarnation)) is not None
        except Exception:
            return False

    def halt_reason(self) -> str:
        """Why the job halted (the `halt` key), or "" (none, or etcd unreadable)."""
        try:
            kv = self.store.get(keys.halt(self.root))
        except StoreError:
            return ""
        return json.loads(kv.value).get("reason", "halted") if kv is not None else ""

    def job_finished(self) -> bool:
        try:
            return self.store.get(keys.finished(self.root)) is not None
        except StoreError:
            return False

    def evict(self, rid: int, incarnation: int, reason: str) -> bool:
        """Write evict/{rid}/{inc}; False (and a warning) when etcd refused or was unreachable."""
        key = keys.evict(self.root, rid, incarnation)
        try:
            self.store.put(key, reason.encode())
            return True
        except StoreError as e:
            log.warning("could not write %s (%s); the others will drop replica %d when its lease expires",
                        key, e, rid)
            return False

    # -- the end ---------------------------------------------------------------------------------
    def stop_watch(self) -> None:
        if self._cancel_members is not None:
            self._cancel_members()
            self._cancel_members = None

    def close(self) -> None:
        """Release the run (its hold) and, when it is ours, the store."""
        self.stop_watch()
        if self._hold is not None:
            self._hold.close()
        if self._own_store:
            self.store.close()


def _put_report(reports: Reports, key: str, value: bytes) -> None:
    """reports[replica id of members/ `key`] = its parsed report; a malformed one is skipped."""
    try:
        reports[int(key.rsplit("/", 1)[1])] = json.loads(value)
    except ValueError:
        log.warning("ignoring malformed member report %s", key)
