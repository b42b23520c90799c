"""Warm standby replicas (issue 25 §1; docs/ARCHITECTURE.md, "Warm standby").

A spare is a replica's W processes started with `LFT_STANDBY=<token>` and no replica id. The
user's script runs as for any replica up to the replica manager's `start()`: imports, model,
optimizer and its state, the replica's process group. There the spare's leader checks that
it belongs to the job (the run's secret tag and the job's config fingerprint: a mismatched
spare is refused like any joiner), registers `standby/{token}` bound to its lease, and waits.
It trains, writes and logs nothing as a replica meanwhile.

Whoever restarts replicas (the supervisor; a test) promotes it: `promote()` writes
`promote/{token}` = {rid, incarnation}, create-if-absent, once the spare's `standby/` key
is seen live. The spare then takes that replica id as that incarnation: it opens FTAR and its
state server, registers like any restarted replica, catches up from a live peer and trains.
Nothing after the wait differs from a cold restart, so exactly-once, identical replicas and
the divergence guard hold as for any rejoin; what the spare saves is everything before it.

`assign` (pure) says which spare takes which vacated replica.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from . import keys
from .membership import ConfigMismatch, JobFinished
from .quorum import fingerprint_diff
from .runs import RunConflict, recorded_run
from .store import Store

log = logging.getLogger(__name__)

STANDBY_ENV = "LFT_STANDBY"
"""A spare's token (unique in the job); set instead of LFT_REPLICA_ID."""


class LauncherGone(RuntimeError):
    """A waiting spare's parent process (its launcher) exited."""


@dataclass(frozen=True)
class Spare:
    token: str
    host: str = ""
    world: int = 1
    since: float = 0.0
    """When it registered: the longest-waiting spare is taken first (it is surely warm)."""


@dataclass(frozen=True)
class Vacancy:
    """A replica that needs a new incarnation: its id, that incarnation, and the host its last
    incarnation ran on ("" when unknown)."""
    rid: int
    incarnation: int
    host: str = ""


@dataclass(frozen=True)
class Promotion:
    rid: int
    incarnation: int
    run_id: str


def assign(vacancies: Sequence[Vacancy], spares: Sequence[Spare], world: int) -> dict[int, str]:
    """Which spare takes which vacated replica: {rid: token}. Vacancies in replica id order each
    take a spare of the job's `world` size: one on the replica's own host first (its data and
    network are where the replica was), else the longest-waiting one anywhere (ties: the token).
    A spare is used once; a vacancy with no spare left is absent (it restarts cold)."""
    free = sorted((s for s in spares if s.world == world), key=lambda s: (s.since, s.token))
    out: dict[int, str] = {}
    for v in sorted(vacancies, key=lambda v: v.rid):
        if not free:
            break
        pick = next((s for s in free if v.host and s.host == v.host), free[0])
        free.remove(pick)
        out[v.rid] = pick.token
    return out


def decode_spare(token: str, raw: bytes) -> Spare:
    d = json.loads(raw)
    return Spare(token, str(d.get("host", "")), int(d.get("world", 1)), float(d.get("since", 0.0)))


def spares(store: Store, root: str) -> list[Spare]:
    """The live spares of the run (their `standby/` keys, bound to their leases)."""
    prefix = keys.standby(root)
    kvs, _ = store.get_prefix(prefix)
    return [decode_spare(kv.key[len(prefix):], kv.value) for kv in kvs]


def promote(store: Store, root: str, token: str, rid: int, incarnation: int) -> bool:
    """Tell spare `token` to become replica `rid` as `incarnation`. False when the spare is gone
    (its lease lapsed: it died waiting) or was already promoted."""
    if store.get(keys.standby(root, token)) is None:
        return False
    return store.create(keys.promote(root, token), json.dumps({"rid": rid, "incarnation": incarnation}).encode())


@dataclass(frozen=True)
class WaiterSettings:
    """Where a spare looks for its job and its timing (a replica's `etcd.prefix` and `etcd.lease_ttl_s`)."""

    prefix: str = "/lft"
    """The etcd prefix of every job (coord/keys.py)."""
    ttl_s: float = 3.0
    """The TTL of the lease its `standby/` key is bound to (renewed every third of it while it waits)."""
    poll_s: float = 0.05
    """The wait between looks for the job's run before it is recorded."""

    def __post_init__(self) -> None:
        for name in ("ttl_s", "poll_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"standby setting {name}={getattr(self, name)} must be > 0")


class Waiter:
    """A spare leader's registration and wait (I/O). `wait` returns the Promotion; it raises
    RunConflict (another job's secret), ConfigMismatch (another config) or JobFinished.

    Args:
        store: the job's etcd.
        job: the job's name.
        tag: the job secret's tag (secret.py): a run recorded with another is refused.
        fingerprint: this spare's config fingerprint, checked against the job's.
        token: the spare's token (`LFT_STANDBY`), unique in the job.
        settings: the key prefix, lease TTL and poll interval (`WaiterSettings`; None: the defaults).
        host: the host it runs on (`assign` prefers a spare on a vacated replica's host).
        world: its ranks (only a spare of the job's replica size is assigned).
        run_id: the run to wait in; "": the one the job records.
    """

    def __init__(self, store: Store, job: str, tag: str, fingerprint: Mapping, token: str,
                 settings: Optional[WaiterSettings] = None, *, host: str = "", world: int = 1,
                 run_id: str = "") -> None:
        self.settings = st = settings or WaiterSettings()
        self.store, self.prefix, self.job, self.tag = store, st.prefix, job, tag
        self.fingerprint, self.token, self.host, self.world = dict(fingerprint), token, host, world
        self.run_id, self.ttl_s, self.poll_s = run_id, st.ttl_s, st.poll_s
        self._parent = os.getppid()
        """Its launcher: a spare whose launcher died is nobody's (it would wait until the job ends)."""
        self._promoted = threading.Event()
        self._root: Optional[str] = None
        self._lease: Optional[int] = None
        self._cancel: Optional[Callable[[], None]] = None
        self._renewed = 0.0

    def _run_root(self, deadline: Optional[float]) -> tuple[str, str]:
        """(run id, root) of the job's run, once it is recorded with our secret's tag."""
        while True:
            record = recorded_run(self.store, self.prefix, self.job)
            if record is not None and record.tag != self.tag:
                raise RunConflict(f"standby {self.token} refused: job {self.job!r} runs with another secret")
            if record is not None and (not self.run_id or record.id == self.run_id):
                return record.id, keys.root(self.prefix, self.job, record.id)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"standby {self.token}: job {self.job!r} recorded no run to wait in")
            time.sleep(self.poll_s)

    def _check(self, root: str) -> None:
        if os.getppid() != self._parent:
            raise LauncherGone(f"standby {self.token}: its launcher (pid {self._parent}) is gone; nobody would "
                               "promote it")
        if self.store.get(keys.finished(root)) is not None:
            raise JobFinished(f"the job already finished; standby {self.token} is not needed")
        kv = self.store.get(keys.config(root))
        diff = fingerprint_diff(json.loads(kv.value), self.fingerprint) if kv is not None else None
        if diff:
            raise ConfigMismatch(f"standby {self.token} refused: job config differs in {diff}")

    def register(self) -> str:
        """Check the job, then register `standby/{token}` bound to a new lease (once). The root."""
        if self._root is None:
            run_id, root = self._run_root(None)
            self._check(root)
            self._lease = self.store.lease_grant(self.ttl_s)
            record = json.dumps({"host": self.host, "world": self.world, "since": time.time()}).encode()
            self.store.put(keys.standby(root, self.token), record, self._lease)
            self._cancel = self.store.watch_prefix(keys.promote(root, self.token), lambda ev: self._promoted.set())
            self._renewed = time.monotonic()
            self.run_id, self._root = run_id, root
            log.info("standby %s: waiting in run %s (host %s, %d ranks)", self.token, run_id, self.host, self.world)
        return self._root

    def wait(self, timeout_s: Optional[float] = None) -> Optional[Promotion]:
        """Block until promoted (the Promotion; the registration is withdrawn) or for at most
        `timeout_s` (None; still registered: call again, or `close`). The lease is renewed,
        and the job re-checked, meanwhile."""
        root = self.register()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            kv = self.store.get(keys.promote(root, self.token))
            if kv is not None:
                d = json.loads(kv.value)
                self.close()
                return Promotion(int(d["rid"]), int(d["incarnation"]), self.run_id)
            if deadline is not None and time.monotonic() > deadline:
                return None
            if time.monotonic() - self._renewed > self.ttl_s / 3 and self._lease is not None:
                self.store.lease_keepalive(self._lease)
                self._renewed = time.monotonic()
                self._check(root)
            self._promoted.wait(min(self.ttl_s / 3, 1.0, *(() if deadline is None else
                                                         (max(0.0, deadline - time.monotonic()),))))

    def close(self) -> None:
        """Withdraw the registration (idempotent)."""
        if self._root is None or self._lease is None:
            return
        if self._cancel is not None:
            self._cancel()
            self._cancel = None
        try:
            self.store.delete(keys.standby(self._root, self.token))
            self.store.lease_revoke(self._lease)
        except Exception as e:  # the lease lapses by itself
            log.warning("standby %s: could not withdraw its registration: %s", self.token, e)
        self._lease = None
