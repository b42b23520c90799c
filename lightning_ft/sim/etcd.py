"""etcd as the simulator sees it (docs/ARCHITECTURE.md, "The simulator"): the `Store` contract
with etcd's semantics as this project uses them, on the world's virtual clock and in its one
thread: revisions (reads at an old revision), leases that expire at their deadline, watches
(delivered in revision order, in the writing event), transactions (compare-and-swap,
create-if-absent, writes fenced on create revisions), and outages (every call fails with the
`StoreError` a real client raises once its retries are spent).
"""
from __future__ import annotations

import bisect
import itertools
from typing import Callable, Optional

from lightning_ft.coord.store import KV, Event, LeaseExpired, Store, StoreError, WatchCallback
from lightning_ft.sim.world import World


class SimStore(Store):
    """An in-memory etcd on a virtual clock."""

    def __init__(self, world: World) -> None:
        self.world = world
        self._rev = 1
        self._history: dict[str, list[tuple[int, Optional[KV]]]] = {}
        self._keys: list[str] = []
        """The keys ever written, sorted (prefix reads bisect into it)."""
        self._leases: dict[int, tuple[float, float]] = {}  # id -> (ttl, deadline)
        self._lease_ids = itertools.count(0x1000)
        self._watches: dict[int, tuple[str, WatchCallback]] = {}
        self._watch_ids = itertools.count(1)
        self.down_until = -1.0
        """An outage: every call fails until then (a member loss is a short one: the client fails over)."""
        self.renew_leases = True
        """At an outage's end every lease's TTL starts afresh (etcd renews leases when a leader takes
        over); False: the clients were cut from a running etcd, and leases lapsed meanwhile."""
        self.calls = 0
        self.writes = 0

    # -- outages ---------------------------------------------------------------------------------
    def _check(self) -> None:
        self.calls += 1
        if self.world.now < self.down_until:
            raise StoreError(f"etcd unreachable (simulated outage until t={self.down_until:.2f})", unreachable=True)

    def outage(self, seconds: float, renew_leases: bool = True) -> None:
        self.down_until = max(self.down_until, self.world.now + seconds)
        self.renew_leases = renew_leases

    # -- internals --------------------------------------------------------------------------------
    def _current(self, key: str, rev: int = 0) -> Optional[KV]:
        hist = self._history.get(key)
        if not hist:
            return None
        if rev <= 0 or hist[-1][0] <= rev:
            return hist[-1][1]
        i = bisect.bisect_right([r for r, _ in hist], rev) - 1
        return hist[i][1] if i >= 0 else None

    def _write(self, key: str, value: Optional[bytes], lease: int = 0) -> int:
        self._rev += 1
        self.writes += 1
        if value is None:
            kv = None
            event = Event("delete", key, b"", self._rev)
        else:
            prev = self._current(key)
            create = prev.create_revision if prev is not None else self._rev
            kv = KV(key, bytes(value), create, self._rev, lease)
            event = Event("put", key, kv.value, self._rev)
        if key not in self._history:
            bisect.insort(self._keys, key)
            self._history[key] = []
        self._history[key].append((self._rev, kv))
        for prefix, cb in list(self._watches.values()):
            if key.startswith(prefix):
                cb(event)
        return self._rev

    def _expire(self, lease_id: int, deadline: float) -> None:
        got = self._leases.get(lease_id)
        if got is None or got[1] != deadline:
            return  # refreshed (a later deadline has its own check) or revoked
        if self.world.now < self.down_until and self.renew_leases:
            ttl = got[0]
            renewed = self.down_until + ttl  # the server is down: its leases start afresh when it is back
            self._leases[lease_id] = (ttl, renewed)
            self.world.at(renewed, self._expire, lease_id, renewed)
            return
        self._drop_lease(lease_id)

    def _drop_lease(self, lease_id: int) -> None:
        self._leases.pop(lease_id, None)
        for key in [k for k, h in self._history.items() if h[-1][1] is not None and h[-1][1].lease == lease_id]:
            self._write(key, None)

    def _check_lease(self, lease: int) -> None:
        if lease and lease not in self._leases:
            raise LeaseExpired(f"lease {lease:x} does not exist (expired or revoked)")

    def _prefixed(self, prefix: str) -> list[str]:
        i = bisect.bisect_left(self._keys, prefix)
        out = []
        while i < len(self._keys) and self._keys[i].startswith(prefix):
            out.append(self._keys[i])
            i += 1
        return out

    # -- Store --------------------------------------------------------------------------------------
    def get(self, key: str) -> Optional[KV]:
        self._check()
        return self._current(key)

    def get_prefix(self, prefix: str, revision: int = 0) -> tuple[list[KV], int]:
        self._check()
        rev = revision or self._rev
        out = [kv for k in self._prefixed(prefix) for kv in [self._current(k, rev)] if kv is not None]
        return out, rev

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        self._check()
        self._check_lease(lease)
        return self._write(key, value, lease)

    def delete(self, key: str) -> bool:
        self._check()
        existed = self._current(key) is not None
        if existed:
            self._write(key, None)
        return existed

    def delete_prefix(self, prefix: str) -> int:
        self._check()
        keys = [k for k in self._prefixed(prefix) if self._history[k][-1][1] is not None]
        for k in keys:
            self._write(k, None)
        return len(keys)

    def cas(self, key: str, expected_mod_revision: int, value: bytes, lease: int = 0) -> bool:
        self._check()
        self._check_lease(lease)
        cur = self._current(key)
        if (cur.mod_revision if cur is not None else 0) != expected_mod_revision:
            return False
        self._write(key, value, lease)
        return True

    def put_if(self, key: str, value: bytes, created: dict[str, int]) -> bool:
        return self.put_many_if([(key, value)], created)

    def put_many_if(self, items: list[tuple[str, bytes]], created: dict[str, int]) -> bool:
        self._check()
        for k, rev in created.items():
            cur = self._current(k)
            if (cur.create_revision if cur is not None else 0) != rev:
                return False
        for key, value in items:
            self._write(key, value)
        return True

    def lease_grant(self, ttl_s: float) -> int:
        self._check()
        lid = next(self._lease_ids)
        deadline = self.world.now + ttl_s
        self._leases[lid] = (ttl_s, deadline)
        self.world.at(deadline, self._expire, lid, deadline)
        return lid

    def lease_keepalive(self, lease_id: int) -> None:
        self._check()
        if lease_id not in self._leases:
            raise LeaseExpired(f"lease {lease_id:x} expired or was revoked")
        ttl, _ = self._leases[lease_id]
        deadline = self.world.now + ttl
        self._leases[lease_id] = (ttl, deadline)
        self.world.at(deadline, self._expire, lease_id, deadline)

    def lease_revoke(self, lease_id: int) -> None:
        self._check()
        if lease_id in self._leases:
            self._drop_lease(lease_id)

    def watch_prefix(self, prefix: str, callback: WatchCallback, start_revision: int = 0) -> Callable[[], None]:
        self._check()
        wid = next(self._watch_ids)
        if start_revision:
            replay = []
            for k in self._prefixed(prefix):
                for rev, kv in self._history[k]:
                    if rev >= start_revision:
                        replay.append((rev, Event("put", k, kv.value, rev) if kv else Event("delete", k, b"", rev)))
            for _, ev in sorted(replay, key=lambda t: t[0]):
                callback(ev)
        self._watches[wid] = (prefix, callback)

        def cancel() -> None:
            self._watches.pop(wid, None)

        return cancel

    def revision(self) -> int:
        return self._rev
