"""`EtcdStore`: the Store contract over an etcd v3 cluster, with failover, TLS and auth
(docs/GUIDE.md, "etcd"; docs/ARCHITECTURE.md, "Security").

It speaks etcd's gRPC API through the stubs of etcd-sdk-python (`pyetcd.etcdrpc`), one channel
per member. What happens when a request fails is decided by the pure etcd_failover.py:

- **Failover.** Requests go to one member; when it is down, has no leader or times out, the
  next member is tried at once, then all of them again after a short backoff. Every RPC rides
  out an outage of up to `connect_timeout_s` (`etcd.connect_timeout_s`) and then raises a
  StoreError that names the endpoints, the last error and what to do. A write whose answer was
  lost may be applied twice: put is idempotent, and callers of cas/create re-read on False.
- **Watches** each run on their own stream and thread; a broken stream (member killed, etcd
  restarted, member without a leader) is re-created on a live member from the revision after
  the last event delivered, so no event is lost or repeated.
- **Leases** survive a leader change and a restart: etcd grants every lease a fresh TTL when a
  new leader takes over, so a keepalive that gets through within the TTL after the outage keeps
  the lease. Keepalive attempts are cut at TTL/2, leaving time to try another member.
- **TLS** for https:// endpoints or when a CA / client certificate is configured (never a
  silent downgrade), **auth** by user and password; the token is renewed when etcd forgets it
  (simple tokens do not survive a restart).

`store_from_config(cfg.etcd)` (etcd_config.py) builds one from a job's `etcd` config section.
"""
from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from typing import Any, Callable, Optional, Sequence

import grpc
from pyetcd import etcdrpc
from pyetcd.etcdrpc import kv_pb2

from .etcd_failover import (Action, attempt_timeout, backoff, classify, format_endpoints, hint, parse_endpoints,
                            use_tls)
from .store import KV, Event, LeaseExpired, Store, StoreError, WatchCallback
from lightning_ft.threads import Thread

log = logging.getLogger(__name__)

FAIL_FAST_S = 1.0
"""After one request waited connect_timeout_s for etcd in vain, the next ones wait this long."""

_CHANNEL_OPTIONS = [
    # Reconnect to a restarted member within a quarter second (gRPC's default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 250),
    # Notice a silently dead connection (etcd refuses pings more often than every 5 s).
    ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
    # Prefix reads of a long job's ledger exceed gRPC's 4 MiB default.
    ("grpc.max_receive_message_length", 256 << 20),
]


class _RpcError(grpc.RpcError):
    """An outcome we turn into a gRPC error, so that `classify` treats it like one of etcd's."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _prefix_end(prefix: bytes) -> bytes:
    """The range end that selects every key starting with `prefix`."""
    s = bytearray(prefix)
    for i in reversed(range(len(s))):
        if s[i] < 0xFF:
            s[i] += 1
            return bytes(s[: i + 1])
    return b"\0"


def _read(path: Optional[str], what: str) -> Optional[bytes]:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise StoreError(f"cannot read {what} {path!r}: {e.strerror}") from e


class EtcdStore(Store):
    """The Store contract over the members `endpoints` ("host:port", "https://a:2379,https://b:2379"
    or a list) of one etcd cluster."""

    def __init__(self, endpoints: str | Sequence[str], connect_timeout_s: float = 10.0, rpc_timeout_s: float = 2.0,
                 *, ca_cert: Optional[str] = None, cert: Optional[str] = None, key: Optional[str] = None,
                 user: Optional[str] = None, password: Optional[str] = None) -> None:
        try:
            self._eps = parse_endpoints(endpoints)
            if bool(cert) != bool(key):
                raise ValueError("etcd.cert and etcd.key go together: set both (a client certificate and its key) "
                                 "or neither")
            self.tls = use_tls(self._eps, bool(ca_cert or cert or key))
        except ValueError as e:
            raise StoreError(str(e)) from None
        if user and not password:
            raise StoreError(f"etcd.user is {user!r} but no password is set: set LFT_ETCD_PASSWORD (or etcd.password)")
        self.endpoint = format_endpoints(self._eps)
        self.connect_timeout_s = connect_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self.user = user or ""
        self._password = password or ""
        creds = None
        if self.tls:
            creds = grpc.ssl_channel_credentials(_read(ca_cert, "etcd.ca_cert"), _read(key, "etcd.key"),
                                                 _read(cert, "etcd.cert"))
        self._channels = [grpc.secure_channel(e.target, creds, _CHANNEL_OPTIONS) if creds is not None
                          else grpc.insecure_channel(e.target, _CHANNEL_OPTIONS) for e in self._eps]
        self._kv = [etcdrpc.KVStub(c) for c in self._channels]
        self._lease = [etcdrpc.LeaseStub(c) for c in self._channels]
        self._lock = threading.Lock()
        # Many clients of one cluster should not all pile onto its first member.
        self._current = random.randrange(len(self._eps))
        self._token: Optional[str] = None if self.user else ""
        """"": no token needed; None: authenticate before the next request."""
        self._lease_ttl: dict[int, float] = {}
        self._unreachable = False
        """The last request found no member for the whole outage deadline."""
        self._closed = False
        self._watch_lock = threading.Lock()
        self._watches: dict[int, _Watch] = {}
        self._watch_ids = itertools.count(1)
        try:
            self._call("status", lambda i, t, md: etcdrpc.MaintenanceStub(self._channels[i]).Status(
                etcdrpc.StatusRequest(), timeout=t, metadata=md))
        except StoreError as e:
            self._close_channels()
            if e.unreachable:
                raise StoreError(f"etcd at {self.endpoint} is unreachable after {connect_timeout_s:.1f}s "
                                 f"({e.last_error}). Start one with `lightning-ft etcd` or pass a reachable "
                                 "--etcd host:port" + (f"; {e.hint}" if e.hint else "."), unreachable=True) from e
            raise

    # -- one RPC, with failover ------------------------------------------------------------------
    def _call(self, what: str, rpc: Callable[[int, float, Any], Any], lease_ttl_s: Optional[float] = None) -> Any:
        """Run `rpc(member, timeout, metadata)` until it succeeds, failing over between members
        and riding out an outage of up to `connect_timeout_s`. Once a request has waited that
        long in vain, later ones wait only `FAIL_FAST_S` until one gets through again (a
        replica on its way out, a launcher evicting, should not wait a full timeout per request)."""
        wait_s = min(FAIL_FAST_S, self.connect_timeout_s) if self._unreachable else self.connect_timeout_s
        deadline = time.monotonic() + wait_s
        waits = backoff()
        failed = reauths = 0
        while True:
            i = self._current
            token = self._token
            timeout = attempt_timeout(self.rpc_timeout_s, deadline - time.monotonic(), lease_ttl_s=lease_ttl_s)
            try:
                if token is None:
                    token = self._authenticate(i, timeout)
                result = rpc(i, timeout, (("token", token),) if token else None)
                self._unreachable = False
                return result
            except grpc.RpcError as e:
                code, details = e.code().name, e.details() or ""
                action = classify(code, details)
                if self._closed:
                    raise StoreError(f"etcd {what}: the store was closed") from e
                if action is Action.LEASE:
                    raise LeaseExpired(f"etcd {what}: lease expired or was revoked") from e
                reauths = reauths + 1 if action is Action.REAUTH else 0
                if action is Action.FATAL or (action is Action.REAUTH and (not self.user or reauths > 3)):
                    raise self._refusal(what, i, code, details) from e
                if action is Action.REAUTH:
                    self._forget_token(token)
                else:
                    self._rotate(i)
                    failed += 1
                now = time.monotonic()
                if now >= deadline:
                    extra = hint(code, details, self.tls, self.user)
                    last = f"{self._eps[i]}: {code}: {details}"
                    self._unreachable = True
                    raise StoreError(
                        f"etcd {what}: no etcd member answered for {wait_s:.1f}s (etcd.connect_timeout_s="
                        f"{self.connect_timeout_s:g}) at {self.endpoint}; last error {last}"
                        + (f"; {extra}" if extra else ""), unreachable=True, last_error=last, hint=extra) from e
                if failed and failed % len(self._eps) == 0:
                    time.sleep(min(next(waits), deadline - now))

    def _refusal(self, what: str, i: int, code: str, details: str) -> StoreError:
        """The error for a request that member `i` refused and retrying cannot help, with a hint."""
        extra = hint(code, details, self.tls, self.user)
        return StoreError(f"etcd {what} failed at {self._eps[i]}: {code}: {details}" + (f"; {extra}" if extra else ""),
                          hint=extra)

    def _rotate(self, failed: int) -> None:
        with self._lock:
            if self._current == failed:
                self._current = (failed + 1) % len(self._eps)

    def _forget_token(self, token: Optional[str]) -> None:
        """etcd refused `token`: authenticate before the next request (unless another thread did)."""
        with self._lock:
            if self._token == token:
                self._token = None

    def _authenticate(self, i: int, timeout: float) -> str:
        """A fresh token from member `i` (raises grpc.RpcError like any RPC)."""
        try:
            resp = etcdrpc.AuthStub(self._channels[i]).Authenticate(
                etcdrpc.AuthenticateRequest(name=self.user, password=self._password), timeout=timeout)
            token = resp.token
        except grpc.RpcError as e:
            if "authentication is not enabled" not in (e.details() or ""):
                raise
            log.warning("etcd at %s has authentication disabled; etcd.user %r is not used", self._eps[i], self.user)
            token = ""
        with self._lock:
            self._token = token
        return token

    # -- Store ------------------------------------------------------------------------------------
    @staticmethod
    def _kv_of(raw: Any) -> KV:
        return KV(raw.key.decode(), bytes(raw.value), raw.create_revision, raw.mod_revision, raw.lease)

    def get(self, key: str) -> Optional[KV]:
        req = etcdrpc.RangeRequest(key=key.encode())
        resp = self._call("get", lambda i, t, md: self._kv[i].Range(req, timeout=t, metadata=md))
        return self._kv_of(resp.kvs[0]) if resp.kvs else None

    def get_prefix(self, prefix: str, revision: int = 0) -> tuple[list[KV], int]:
        p = prefix.encode()
        req = etcdrpc.RangeRequest(key=p, range_end=_prefix_end(p), revision=revision,
                                   sort_order=etcdrpc.RangeRequest.ASCEND, sort_target=etcdrpc.RangeRequest.KEY)
        resp = self._call("get_prefix", lambda i, t, md: self._kv[i].Range(req, timeout=t, metadata=md))
        return [self._kv_of(kv) for kv in resp.kvs], (revision or resp.header.revision)

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        req = etcdrpc.PutRequest(key=key.encode(), value=bytes(value), lease=lease)
        return self._call(f"put {key}", lambda i, t, md: self._kv[i].Put(req, timeout=t, metadata=md)).header.revision

    def delete(self, key: str) -> bool:
        req = etcdrpc.DeleteRangeRequest(key=key.encode())
        return self._call(f"delete {key}", lambda i, t, md: self._kv[i].DeleteRange(req, timeout=t,
                                                                                    metadata=md)).deleted > 0

    def delete_prefix(self, prefix: str) -> int:
        p = prefix.encode()
        req = etcdrpc.DeleteRangeRequest(key=p, range_end=_prefix_end(p))
        return self._call(f"delete_prefix {prefix}",
                          lambda i, t, md: self._kv[i].DeleteRange(req, timeout=t, metadata=md)).deleted

    def cas(self, key: str, expected_mod_revision: int, value: bytes, lease: int = 0) -> bool:
        k = key.encode()
        req = etcdrpc.TxnRequest(
            compare=[etcdrpc.Compare(result=etcdrpc.Compare.EQUAL, target=etcdrpc.Compare.MOD, key=k,
                                     mod_revision=expected_mod_revision)],
            success=[etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=k, value=bytes(value), lease=lease))])
        return bool(self._call(f"cas {key}", lambda i, t, md: self._kv[i].Txn(req, timeout=t, metadata=md)).succeeded)

    def put_if(self, key: str, value: bytes, created: dict[str, int]) -> bool:
        return self.put_many_if([(key, value)], created)

    def put_many_if(self, items: list[tuple[str, bytes]], created: dict[str, int]) -> bool:
        req = etcdrpc.TxnRequest(
            compare=[etcdrpc.Compare(result=etcdrpc.Compare.EQUAL, target=etcdrpc.Compare.CREATE, key=k.encode(),
                                     create_revision=rev) for k, rev in created.items()],
            success=[etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=k.encode(), value=bytes(v)))
                     for k, v in items])
        return bool(self._call(f"put_if {items[0][0]} (+{len(items) - 1})",
                               lambda i, t, md: self._kv[i].Txn(req, timeout=t, metadata=md)).succeeded)

    def lease_grant(self, ttl_s: float) -> int:
        # etcd leases have whole-second TTLs and a server-side minimum; round up.
        ttl = max(1, int(-(-ttl_s // 1)))
        req = etcdrpc.LeaseGrantRequest(TTL=ttl)
        lid = self._call("lease_grant", lambda i, t, md: self._lease[i].LeaseGrant(req, timeout=t, metadata=md)).ID
        self._lease_ttl[lid] = float(ttl)
        return lid

    def lease_keepalive(self, lease_id: int) -> None:
        req = etcdrpc.LeaseKeepAliveRequest(ID=lease_id)

        def rpc(i: int, t: float, md: Any) -> Any:
            call = self._lease[i].LeaseKeepAlive(iter([req]), timeout=t, metadata=md)
            try:
                for resp in call:
                    # During a leader change a member may answer TTL 0 with an empty header; a
                    # lease that is really gone comes with the answering member's id.
                    if resp.TTL <= 0 and not resp.header.member_id:
                        raise _RpcError(grpc.StatusCode.UNAVAILABLE, "keepalive answered by no member")
                    return resp
                raise _RpcError(grpc.StatusCode.UNAVAILABLE, "keepalive stream ended without an answer")
            finally:
                call.cancel()

        resp = self._call("lease_keepalive", rpc, lease_ttl_s=self._lease_ttl.get(lease_id))
        if resp.TTL <= 0:
            self._lease_ttl.pop(lease_id, None)
            raise LeaseExpired(f"lease {lease_id:x} expired or was revoked")

    def lease_revoke(self, lease_id: int) -> None:
        req = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        self._lease_ttl.pop(lease_id, None)
        try:
            self._call("lease_revoke", lambda i, t, md: self._lease[i].LeaseRevoke(req, timeout=t, metadata=md))
        except LeaseExpired:
            pass

    def watch_prefix(self, prefix: str, callback: WatchCallback, start_revision: int = 0) -> Callable[[], None]:
        if not start_revision:
            p = prefix.encode()
            req = etcdrpc.RangeRequest(key=p, range_end=_prefix_end(p), count_only=True)
            start_revision = self._call(f"watch {prefix}", lambda i, t, md: self._kv[i].Range(
                req, timeout=t, metadata=md)).header.revision + 1
        w = _Watch(self, prefix, callback, start_revision)
        with self._watch_lock:
            wid = next(self._watch_ids)
            self._watches[wid] = w
        try:
            w.start()
        except StoreError:
            with self._watch_lock:
                self._watches.pop(wid, None)
            raise

        def cancel() -> None:
            with self._watch_lock:
                self._watches.pop(wid, None)
            w.cancel()

        return cancel

    def revision(self) -> int:
        # An empty transaction: linearizable, and needs no permission on any key.
        return self._call("revision", lambda i, t, md: self._kv[i].Txn(etcdrpc.TxnRequest(), timeout=t,
                                                                        metadata=md)).header.revision

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._watch_lock:
            watches, self._watches = list(self._watches.values()), {}
        for w in watches:
            w.cancel()
        self._close_channels()

    def _close_channels(self) -> None:
        for c in self._channels:
            try:
                c.close()
            except Exception:
                pass


class _Watch:
    """One prefix watch on its own stream and thread. A broken stream is re-created on a live
    member from the revision after the last event delivered."""

    def __init__(self, store: EtcdStore, prefix: str, callback: WatchCallback, start_revision: int) -> None:
        self._store = store
        self._prefix = prefix
        self._callback = callback
        self._next_rev = start_revision
        self._cancelled = threading.Event()
        self._created = threading.Event()
        self._error: Optional[StoreError] = None
        self._lock = threading.Lock()
        self._call: Any = None
        self._thread = Thread(target=self._run, name=f"lft-watch {prefix}", daemon=True)

    def start(self) -> None:
        """Start the stream; returns once etcd confirmed it. Raises StoreError when it cannot be
        created within connect_timeout_s or is refused (e.g. permission denied)."""
        self._thread.start()
        timeout = self._store.connect_timeout_s + self._store.rpc_timeout_s
        if not self._created.wait(timeout) or self._error is not None:
            self.cancel()
            raise self._error or StoreError(
                f"etcd watch on {self._prefix}: not created within {timeout:.1f}s at {self._store.endpoint}",
                unreachable=True)

    def _run(self) -> None:
        store = self._store
        waits = backoff()
        down_since: Optional[float] = None
        while not self._cancelled.is_set():
            i = store._current
            done = threading.Event()
            p = self._prefix.encode()
            create = etcdrpc.WatchRequest(create_request=etcdrpc.WatchCreateRequest(
                key=p, range_end=_prefix_end(p), start_revision=self._next_rev))

            def requests(create: Any = create, done: threading.Event = done):
                yield create
                done.wait()  # keep the stream open until it ends or is cancelled

            token = store._token
            try:
                if token is None:
                    token = store._authenticate(i, store.rpc_timeout_s)
                # hasleader: a member cut off from its leader ends the stream, so we move on.
                md = (("hasleader", "true"),) + ((("token", token),) if token else ())
                call = etcdrpc.WatchStub(store._channels[i]).Watch(requests(), metadata=md)
                with self._lock:
                    self._call = call
                if self._cancelled.is_set():
                    call.cancel()
                for resp in call:
                    if resp.canceled and "permission denied" in resp.cancel_reason:
                        raise _RpcError(grpc.StatusCode.PERMISSION_DENIED, resp.cancel_reason)
                    if resp.created and not resp.canceled:
                        self._created.set()
                        down_since, waits = None, backoff()
                    if resp.compact_revision:
                        log.error("etcd watch on %s: revisions up to %d were compacted; events in between are "
                                  "lost", self._prefix, resp.compact_revision)
                        self._next_rev = resp.compact_revision
                    self._deliver(resp)
                    if resp.canceled:
                        store._rotate(i)
                        break
            except grpc.RpcError as e:
                if self._cancelled.is_set() or store._closed:
                    return
                code, details = e.code().name, e.details() or ""
                action = classify(code, details)
                if action is Action.REAUTH and store.user:
                    store._forget_token(token)
                elif action is Action.RETRY:
                    store._rotate(i)
                else:
                    err = store._refusal(f"watch on {self._prefix}", i, code, details)
                    if not self._created.is_set():
                        self._error = err
                        self._created.set()
                        return
                    log.error("%s; retrying", err)
                down_since = down_since or time.monotonic()
                if time.monotonic() - down_since > store.connect_timeout_s:
                    log.warning("etcd watch on %s: no member has served it for %.0fs; still retrying",
                                self._prefix, time.monotonic() - down_since)
                    down_since = time.monotonic()
            finally:
                done.set()
                with self._lock:
                    self._call = None
            if self._cancelled.wait(next(waits)):
                return

    def _deliver(self, resp: Any) -> None:
        for ev in resp.events:
            rev = ev.kv.mod_revision or resp.header.revision
            self._next_rev = max(self._next_rev, rev + 1)  # a reconnect resumes after it
            kind = "delete" if ev.type == kv_pb2.Event.DELETE else "put"
            try:
                self._callback(Event(kind, ev.kv.key.decode(), bytes(ev.kv.value) if kind == "put" else b"", rev))
            except Exception:
                log.exception("watch callback failed")

    def cancel(self) -> None:
        self._cancelled.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
