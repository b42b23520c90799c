"""The coordination store: one small key-value contract, two implementations (docs/ARCHITECTURE.md, "Keyspace").

`EtcdStore` (etcd_store.py; import it from there: gRPC is loaded only by who uses it) talks
to a real etcd v3 cluster through etcd-sdk-python's gRPC stubs, failing over between members;
`store_from_config(cfg.etcd)` (etcd_config.py) builds one from a job's config. `MemoryStore` is
an in-process stand-in for unit tests. Both pass the same contract tests
(tests/coord/test_store.py), so code written against `Store` behaves the same on either.

Keys and values are `str` and `bytes`. Every mutation returns the store revision after it,
and every read can be made at an older revision, which is what lets several leaders agree on
one view of the member reports.
"""
from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional

log = logging.getLogger(__name__)


class StoreError(RuntimeError):
    """The store could not be reached or refused a request.

    `unreachable`: no etcd member answered within the outage deadline (etcd.connect_timeout_s);
    `last_error`: the last member's error then; `hint`: what the user can do about it."""

    def __init__(self, message: str, *, unreachable: bool = False, last_error: str = "", hint: str = "") -> None:
        super().__init__(message)
        self.unreachable = unreachable
        self.last_error = last_error
        self.hint = hint


class LeaseExpired(StoreError):
    """A lease is gone: it expired or was revoked. Keys bound to it are deleted."""


@dataclass(frozen=True)
class KV:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True)
class Event:
    """One change seen by a watch. `value` is empty for deletes (including lease expiry)."""

    kind: str  # "put" | "delete"
    key: str
    value: bytes
    revision: int


WatchCallback = Callable[[Event], None]


class Store(ABC):
    """What coordination needs from etcd, and nothing more."""

    @abstractmethod
    def get(self, key: str) -> Optional[KV]:
        """The current value of `key`, or None."""

    @abstractmethod
    def get_prefix(self, prefix: str, revision: int = 0) -> tuple[list[KV], int]:
        """All keys under `prefix`, sorted by key, read at `revision` (0: now).

        Returns the KVs and the revision the read was made at."""

    @abstractmethod
    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Write `key`; returns the new revision."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Delete `key`; True if it existed."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under `prefix`; returns how many."""

    @abstractmethod
    def cas(self, key: str, expected_mod_revision: int, value: bytes, lease: int = 0) -> bool:
        """Write `key` only if its mod revision is `expected_mod_revision` (0: key absent)."""

    def create(self, key: str, value: bytes, lease: int = 0) -> bool:
        """Create-if-absent; True if this call created the key."""
        return self.cas(key, 0, value, lease)

    @abstractmethod
    def put_if(self, key: str, value: bytes, created: dict[str, int]) -> bool:
        """Write `key` only if every key in `created` has that create revision (0: absent).
        A fence: e.g. "my member key is the one I created, and I am not evicted"."""

    @abstractmethod
    def put_many_if(self, items: list[tuple[str, bytes]], created: dict[str, int]) -> bool:
        """`put_if` for several keys in one transaction: all are written, or none."""

    @abstractmethod
    def lease_grant(self, ttl_s: float) -> int:
        """A new lease id that expires `ttl_s` seconds after its last keepalive."""

    @abstractmethod
    def lease_keepalive(self, lease_id: int) -> None:
        """Refresh the lease; raises LeaseExpired if it is already gone."""

    @abstractmethod
    def lease_revoke(self, lease_id: int) -> None:
        """End the lease now and delete its keys (no error if already gone)."""

    @abstractmethod
    def watch_prefix(self, prefix: str, callback: WatchCallback, start_revision: int = 0) -> Callable[[], None]:
        """Call `callback(event)` for every change under `prefix` after `start_revision`
        (0: from now). Returns a function that cancels the watch."""

    @abstractmethod
    def revision(self) -> int:
        """The current store revision."""

    def close(self) -> None:  # noqa: B027 - optional: a store without connections or threads keeps this no-op
        """Release connections and threads."""


# ---------------------------------------------------------------------------------------------
# MemoryStore
# ---------------------------------------------------------------------------------------------


class MemoryStore(Store):
    """A thread-safe in-memory store with etcd's semantics (revisions, leases, watches).

    For unit tests only: it lives in one process. It keeps full history so reads at an old
    revision work, and a reaper thread expires leases and emits delete events."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._rev = 1
        self._history: dict[str, list[tuple[int, Optional[KV]]]] = {}  # key -> [(rev, kv|None)]
        self._leases: dict[int, tuple[float, float]] = {}  # id -> (ttl, deadline)
        self._lease_ids = itertools.count(0x1000)
        self._watches: dict[int, tuple[str, WatchCallback]] = {}
        self._watch_ids = itertools.count(1)
        self._pending: list[tuple[WatchCallback, Event]] = []
        self._closed = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="memstore-reaper", daemon=True)
        self._reaper.start()

    # -- internals ----------------------------------------------------------------------------
    def _current(self, key: str, rev: int = 0) -> Optional[KV]:
        hist = self._history.get(key)
        if not hist:
            return None
        if rev <= 0:
            return hist[-1][1]
        i = bisect.bisect_right([r for r, _ in hist], rev) - 1
        return hist[i][1] if i >= 0 else None

    def _write(self, key: str, value: Optional[bytes], lease: int = 0) -> int:
        """Apply one mutation under the lock; queue watch events; return the new revision."""
        self._rev += 1
        if value is None:
            kv = None
            event = Event("delete", key, b"", self._rev)
        else:
            prev = self._current(key)
            create = prev.create_revision if prev is not None else self._rev
            kv = KV(key, bytes(value), create, self._rev, lease)
            event = Event("put", key, kv.value, self._rev)
        self._history.setdefault(key, []).append((self._rev, kv))
        for prefix, cb in list(self._watches.values()):
            if key.startswith(prefix):
                self._pending.append((cb, event))
        return self._rev

    def _flush(self) -> None:
        """Deliver queued watch events outside the lock, in order."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                batch, self._pending = self._pending, []
            for cb, ev in batch:
                try:
                    cb(ev)
                except Exception:  # a watcher's bug must not break the store
                    log.exception("watch callback failed")

    def _expire_lease(self, lease_id: int) -> None:
        self._leases.pop(lease_id, None)
        for key, hist in self._history.items():
            kv = hist[-1][1]
            if kv is not None and kv.lease == lease_id:
                self._write(key, None)

    def _reap(self) -> None:
        while not self._closed.wait(0.02):
            now = time.monotonic()
            with self._lock:
                for lid, (_, deadline) in list(self._leases.items()):
                    if deadline <= now:
                        self._expire_lease(lid)
            self._flush()

    def _check_lease(self, lease: int) -> None:
        if lease and lease not in self._leases:
            raise LeaseExpired(f"lease {lease:x} does not exist (expired or revoked)")

    # -- Store --------------------------------------------------------------------------------
    def get(self, key: str) -> Optional[KV]:
        with self._lock:
            return self._current(key)

    def get_prefix(self, prefix: str, revision: int = 0) -> tuple[list[KV], int]:
        with self._lock:
            rev = revision or self._rev
            out = [kv for k in sorted(self._history) if k.startswith(prefix)
                   for kv in [self._current(k, rev)] if kv is not None]
            return out, rev

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        with self._lock:
            self._check_lease(lease)
            rev = self._write(key, value, lease)
        self._flush()
        return rev

    def delete(self, key: str) -> bool:
        with self._lock:
            existed = self._current(key) is not None
            if existed:
                self._write(key, None)
        self._flush()
        return existed

    def delete_prefix(self, prefix: str) -> int:
        with self._lock:
            keys = [k for k, h in self._history.items() if k.startswith(prefix) and h[-1][1] is not None]
            for k in keys:
                self._write(k, None)
        self._flush()
        return len(keys)

    def cas(self, key: str, expected_mod_revision: int, value: bytes, lease: int = 0) -> bool:
        with self._lock:
            self._check_lease(lease)
            cur = self._current(key)
            if (cur.mod_revision if cur is not None else 0) != expected_mod_revision:
                return False
            self._write(key, value, lease)
        self._flush()
        return True

    def put_if(self, key: str, value: bytes, created: dict[str, int]) -> bool:
        return self.put_many_if([(key, value)], created)

    def put_many_if(self, items: list[tuple[str, bytes]], created: dict[str, int]) -> bool:
        with self._lock:
            for k, rev in created.items():
                cur = self._current(k)
                if (cur.create_revision if cur is not None else 0) != rev:
                    return False
            for key, value in items:
                self._write(key, value)
        self._flush()
        return True

    def lease_grant(self, ttl_s: float) -> int:
        with self._lock:
            lid = next(self._lease_ids)
            self._leases[lid] = (ttl_s, time.monotonic() + ttl_s)
            return lid

    def lease_keepalive(self, lease_id: int) -> None:
        with self._lock:
            if lease_id not in self._leases:
                raise LeaseExpired(f"lease {lease_id:x} expired or was revoked")
            ttl, _ = self._leases[lease_id]
            self._leases[lease_id] = (ttl, time.monotonic() + ttl)

    def lease_revoke(self, lease_id: int) -> None:
        with self._lock:
            if lease_id in self._leases:
                self._expire_lease(lease_id)
        self._flush()

    def watch_prefix(self, prefix: str, callback: WatchCallback, start_revision: int = 0) -> Callable[[], None]:
        with self._lock:
            wid = next(self._watch_ids)
            self._watches[wid] = (prefix, callback)
            if start_revision:
                replay = []
                for k, hist in self._history.items():
                    if not k.startswith(prefix):
                        continue
                    for rev, kv in hist:
                        if rev >= start_revision:
                            replay.append((rev, Event("put", k, kv.value, rev) if kv else Event("delete", k, b"", rev)))
                self._pending.extend((callback, ev) for _, ev in sorted(replay, key=lambda t: t[0]))
        self._flush()

        def cancel() -> None:
            with self._lock:
                self._watches.pop(wid, None)

        return cancel

    def revision(self) -> int:
        with self._lock:
            return self._rev

    def close(self) -> None:
        self._closed.set()
