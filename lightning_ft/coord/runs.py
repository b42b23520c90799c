"""Which run of a job a process belongs to (docs/ARCHITECTURE.md, "Keyspace").

A job id (`--job`, default "lft") is a name people reuse. Each *run* of it gets its own
keyspace (`keys.root(prefix, job, run)`), and `{prefix}/{job}/run` records the current one:
its id, a tag of the job secret (`secret.tag`), when and by whom it started. So:

- two different jobs (different secrets) that pick the same id on one etcd do not merge:
  the second is refused while the first runs, and takes the id over once it is gone;
- a job id used again starts a new run and never inherits the old run's `finished`,
  cursors, ledger or evictions;
- launchers and replicas of one job on different hosts need nothing but the same
  `--job`, etcd and secret: the first to arrive starts the run, the others join it.

`decide_run` is the pure rule; `open_run` does the I/O (a CAS on the record, retried when
another process changed it meanwhile). A run is *live* while some replica leader holds a
`members/` key or some launcher a `launchers/` key under it (both bound to leases).
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Optional

from . import keys
from .store import LeaseExpired, Store, StoreError
from lightning_ft.threads import Thread


class RunConflict(RuntimeError):
    """Another job holds this job id on this etcd, or this process belongs to a replaced run."""


@dataclass(frozen=True)
class RunRecord:
    id: str
    tag: str
    """secret.tag(secret, job): equal for every process of one job."""
    started: float = 0.0
    by: str = ""

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "RunRecord":
        d = json.loads(raw)
        return cls(str(d["id"]), str(d["tag"]), float(d.get("started", 0.0)), str(d.get("by", "")))


@dataclass(frozen=True)
class RunChoice:
    action: str
    """"join" the recorded run, "start" run `run_id` (a fresh keyspace), or "refuse"."""
    run_id: str
    reason: str


def decide_run(job: str, record: Optional[RunRecord], *, tag: str, want: str, live: bool, first: bool,
               new_id: str, now: float = 0.0) -> RunChoice:
    """The run a process of `job` with secret tag `tag` belongs to.

    `want`: the run id it was given ("" = none: a process under torchrun, or a launcher);
    `live`: the recorded run has a live member or launcher; `first`: the process starts the
    job from its point of view (a launcher, or a replica's incarnation 0), as opposed to a
    restart, which only ever joins."""
    if record is None:
        rid = want or new_id
        return RunChoice("start", rid, f"job {job!r}: no run recorded; starting run {rid}")
    age = f"{max(0.0, now - record.started):.0f} s ago" if record.started and now else "earlier"
    held = f"run {record.id}, started {age}{' by ' + record.by if record.by else ''}"
    if record.tag != tag:
        if live:
            return RunChoice("refuse", "", (
                f"job id {job!r} is in use on this etcd by another job ({held}, with another secret); the "
                f"replicas of one job share one secret. If this process belongs to that job, give it the job's "
                f"secret ($LFT_SECRET_FILE); else pick another job id (--job / job=...), or stop that job"))
        rid = want or new_id
        return RunChoice("start", rid, f"job {job!r}: the previous run ({held}) belonged to another job and "
                                       f"nothing of it runs any more; starting run {rid}")
    if want:
        if record.id == want:
            return RunChoice("join", want, f"job {job!r}: joining run {want}")
        if live:
            return RunChoice("refuse", "", (
                f"job {job!r} is running as {held}, but this process belongs to run {want}; a job runs once "
                f"at a time. Stop that run, or use another job id"))
        return RunChoice("start", want, f"job {job!r}: run {record.id} has ended; starting run {want}")
    if live:
        return RunChoice("join", record.id, f"job {job!r}: joining the running {held}")
    if first:
        return RunChoice("start", new_id, f"job {job!r}: run {record.id} has ended; starting run {new_id} "
                                          f"(nothing of the old run is inherited)")
    return RunChoice("join", record.id, f"job {job!r}: rejoining run {record.id} (a restarted replica)")


def is_live(store: Store, root: str) -> bool:
    return bool(store.get_prefix(keys.members(root))[0] or store.get_prefix(keys.launchers(root))[0])


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def open_run(store: Store, prefix: str, job: str, tag: str, hold: "RunHold", *, want: str = "",
             first: bool = True, attempts: int = 20) -> RunChoice:
    """Decide and record the run of this process (see `decide_run`); raises RunConflict.

    A new run is made live (`hold` puts its key under the run) *before* it is recorded, so
    that a process arriving a moment later joins it instead of starting another."""
    key = keys.run_record(prefix, job)
    for _ in range(attempts):
        kv = store.get(key)
        record = RunRecord.from_json(kv.value) if kv is not None else None
        live = record is not None and is_live(store, keys.root(prefix, job, record.id))
        choice = decide_run(job, record, tag=tag, want=want, live=live, first=first, new_id=new_run_id(),
                            now=time.time())
        if choice.action == "refuse":
            raise RunConflict(choice.reason)
        if choice.action == "join":
            return choice
        hold.hold(keys.root(prefix, job, choice.run_id))
        raw = RunRecord(choice.run_id, tag, time.time(), hold.by).to_json()
        done = store.create(key, raw) if kv is None else store.cas(key, kv.mod_revision, raw)
        if done:
            return choice
        # someone else changed the record meanwhile: decide again on what they wrote
    raise StoreError(f"job {job!r}: the run record {key} kept changing under us ({attempts} attempts)")


def recorded_run(store: Store, prefix: str, job: str) -> Optional[RunRecord]:
    """The job id's current run record, whoever it belongs to (tools and tests read runs with it)."""
    kv = store.get(keys.run_record(prefix, job))
    return RunRecord.from_json(kv.value) if kv is not None else None


def recorded_root(store: Store, prefix: str, job: str) -> str:
    """The keyspace of the job id's recorded run, for tools that read a finished job (the
    soak's ledger check, the study's real runs). Raises LookupError when none is recorded."""
    record = recorded_run(store, prefix, job)
    if record is None:
        raise LookupError(f"job {job!r} recorded no run under {prefix}")
    return keys.root(prefix, job, record.id)


def current_run(store: Store, prefix: str, job: str, tag: str, want: str = "") -> Optional[str]:
    """The run id to read a job's state from without joining it: `want`, or the recorded
    run if it is this job's (same secret tag). None when there is none."""
    if want:
        return want
    record = recorded_run(store, prefix, job)
    return record.id if record is not None and record.tag == tag else None


class RunHold:
    """A lease-bound `launchers/{name}` key that keeps a run live. A launcher holds one for
    as long as it runs (`keepalive=True`), so the run counts as live before its replicas
    register (their slow initialization comes first). A replica leader that starts a run
    holds one only until its `members/` key exists (`keepalive=False`: it lapses by itself).

    Threads: the owner's (`hold`, `close`) and the keepalive thread (`lft-run-hold`) both
    write the lease and the key (a lapsed lease is granted anew): under `_lock`."""

    def __init__(self, store: Store, ttl_s: float = 5.0, keepalive: bool = True) -> None:
        self.store, self.ttl_s = store, ttl_s
        self.by = f"{socket.gethostname()} pid {os.getpid()}"
        self._name = f"{socket.gethostname()}-{os.getpid()}"
        self._value = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "t": time.time()}).encode()
        self._lock = threading.Lock()
        """Guards `_lease` and `key` (and their etcd writes) between the owner and the keepalive thread."""
        self._lease = store.lease_grant(ttl_s) if keepalive else 0
        self.key = ""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if keepalive:
            self._thread = Thread(target=self._loop, name="lft-run-hold", daemon=True)
            self._thread.start()

    def hold(self, root: str) -> None:
        """Keep the run at `root` live (moves the key there from a run held before)."""
        key = keys.launchers(root, self._name)
        with self._lock:
            if not self._lease:
                self._lease = self.store.lease_grant(self.ttl_s)
            if self.key and self.key != key:
                self.store.delete(self.key)
            self.key = key
            self.store.put(key, self._value, lease=self._lease)

    def _loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                with self._lock:
                    try:
                        self.store.lease_keepalive(self._lease)
                    except LeaseExpired:
                        self._lease = self.store.lease_grant(self.ttl_s)
                    if self.key and self.store.get(self.key) is None:  # lapsed, or a restart cleared the keyspace
                        self.store.put(self.key, self._value, lease=self._lease)
            except StoreError:
                pass  # etcd unreachable for now: the run may look ended meanwhile; retry

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        if self._lease:
            try:
                self.store.lease_revoke(self._lease)
            except StoreError:
                pass
