"""A replica leader's membership in the job (coord/coordinator.py has the whole story):
registration (the config fingerprint checked, a finished or halted job refused), the lease and
its keepalive (paused by a hang), the watch on the members' reports, the address book,
evictions, stall reports and the event hook."""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

from . import keys
from .addresses import AddressBook, Addresses, encode_blocks, publish as publish_addresses
from .quorum import JobSpec, Quorum, Report, fingerprint_diff
from .store import Event, LeaseExpired, Store, StoreError
from lightning_ft.threads import Thread

log = logging.getLogger(__name__)

class ConfigMismatch(RuntimeError):
    """This replica's job config differs from the one the job was started with."""


class Evicted(RuntimeError):
    """This (replica, incarnation) was declared dead; the process must exit."""


class QuorumTimeout(TimeoutError):
    """No quorum formed within the deadline; the message carries the last reason."""


class JobFinished(RuntimeError):
    """The job already trained to completion (`finished` key): a late replica has nothing to do."""


class CoordinatorClosed(RuntimeError):
    """The process closed its coordinator (it is exiting) while a quorum call still waited."""


class JobHalted(RuntimeError):
    """The job must stop: a decision every replica obeys (replica states diverged with no
    majority). The message says why and what to do."""


@dataclass(frozen=True)
class MembershipSettings:
    """Where a job's keys live and a member's timing (the job config's `etcd.prefix`,
    `etcd.lease_ttl_s`, `etcd.hang_timeout_s` and `quorum.poll_interval_s`)."""

    prefix: str = "/lft"
    """The etcd prefix of every job (coord/keys.py)."""
    lease_ttl_s: float = 3.0
    """The member lease's TTL: a replica silent this long is failed by the others."""
    hang_timeout_s: float = 30.0
    """The keepalive stops when the training loop made no progress (`heartbeat`) this long."""
    poll_interval_s: float = 0.05
    """The wait between looks at etcd while a round is being decided."""

    def __post_init__(self) -> None:
        for name in ("lease_ttl_s", "hang_timeout_s", "poll_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"membership setting {name}={getattr(self, name)} must be > 0")


class Membership:
    """One per replica leader. Thread-safe where it says so; otherwise call from one thread.

    Args:
        store: the job's etcd (or a MemoryStore).
        job: the job's name.
        rid: this replica's id.
        incarnation: this process's incarnation of the replica.
        spec: what the job is (replicas, min_replicas, the config fingerprint, policies).
        settings: the key prefix, lease TTL, hang timeout and poll interval (`MembershipSettings`;
            None: the defaults).
        run: the job's run id (coord/runs.py) whose keys it uses; "": the job's root.
        on_failure: called as on_failure(rid, reason) when the watches see a member fail.
        on_event: see `self.on_event`.
        clock: the monotonic clock the hang timeout and round waits read (tests pass their own).
    """

    def __init__(self, store: Store, job: str, rid: int, incarnation: int, spec: JobSpec,
                 settings: Optional[MembershipSettings] = None, *, run: str = "",
                 on_failure: Optional[Callable[[int, str], None]] = None,
                 on_event: Optional[Callable[..., None]] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = st = settings or MembershipSettings()
        self.store = store
        self.job = job
        self.rid = rid
        self.incarnation = incarnation
        self.spec = spec
        self.lease_ttl_s = st.lease_ttl_s
        self.hang_timeout_s = st.hang_timeout_s
        self.poll_interval_s = st.poll_interval_s
        self.on_failure = on_failure
        self.on_event = on_event
        """Called by the deciding leader as on_event(name, **fields) for rewind, diverged, halt
        and exclusion decisions (the manager appends them to events.jsonl)."""
        self._clock = clock
        self._root = keys.root(st.prefix, job, run)
        self._member_created = 0
        """Create revision of our members/ key: the fence of our ledger writes."""
        self._lease = 0
        self._lease_lost = threading.Event()
        self._report: Optional[Report] = None
        self._next_round = 0
        self._before_steady: Optional[Quorum] = None
        """The round a steady round followed (retract_steady goes back to it)."""
        self._current: Optional[Quorum] = None
        self._last_progress = clock()
        self._last_reason = ""
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._keepalive: Optional[threading.Thread] = None
        self._cancel_watches: list[Callable[[], None]] = []
        self._decisions: dict[int, bytes] = {}
        """Decisions seen by the quorum/ watch, by round (saves non-deciders a read per wake)."""
        self._dead: set[tuple[int, int]] = set()
        """Members of the current quorum seen evicted or expired by the watches."""
        self._dead_lock = threading.Lock()
        self.changed = False
        """A watch saw a change since our last full-round report (failure, eviction, joiner, new
        incarnation, our lease lapsed): the next round must be a full round."""
        self._slow_poll_s = max(st.poll_interval_s * 5, 0.25)
        self._fallback_s = 2.0 * st.lease_ttl_s
        self._addr_blocks: list[bytes] = []
        self._world = 1
        self.book: Optional[AddressBook] = None
        """Fetched per-rank addresses of other incarnations (`addresses`)."""
        self._cancel_reports: Optional[Callable[[], None]] = None
        """The members/ watch, held while we decide rounds."""
        self._reports: dict[int, Report] = {}
        """Reports that watch delivered, by replica id (guarded by _dead_lock)."""
        self._evicted: set[tuple[int, int]] = set()
        """Every eviction the evict/ watch delivered."""
        self.evaluations = 0
        self._stragglers: set[int] = set()
        """Stragglers of the last round this leader decided (a `straggler` event per new one)."""
        """Decisions evaluated from etcd (one a round when the watched reports allow it)."""

    @property
    def root(self) -> str:
        return self._root

    @property
    def _own_report(self) -> Report:
        """Our member report (set by `register`)."""
        if self._report is None:
            raise RuntimeError(f"replica {self.rid}: no member report before register()")
        return self._report

    def _round_key(self, round: int) -> str:
        return keys.quorum(self._root, round)

    def fence(self) -> dict[str, int]:
        """The ledger fence ({key: create revision}): our member key is the one we created,
        and this incarnation is not evicted."""
        return {keys.members(self._root, self.rid): self._member_created,
                keys.evict(self._root, self.rid, self.incarnation): 0}

    def register(self, step: int, addrs: Sequence[str] = (), state_addrs: Sequence[str] = (), **state: Any) -> None:
        """Check the job config, take a lease, publish our member report and start the
        keepalive thread and the failure watches. Do slow initialization *before* this.
        `state`: Report fields describing our state (gen, synced, cursor, ...)."""
        self._check_config()
        self._check_halt()
        if self.store.get(keys.evict(self._root, self.rid, self.incarnation)) is not None:
            raise Evicted(f"replica {self.rid} incarnation {self.incarnation} was already evicted; "
                          "restart it with a new incarnation")
        kv = self.store.get(keys.members(self._root, self.rid))
        if kv is not None and Report.from_json(kv.value).incarnation >= self.incarnation:
            held = Report.from_json(kv.value).incarnation
            raise ConfigMismatch(
                f"replica {self.rid} (incarnation {self.incarnation}) refused: replica {self.rid} incarnation {held} "
                f"is registered and alive. Is the same replica id started twice, or another job running with the "
                f"same job id and secret? Give each replica its own id, or the other job another --job")
        self._next_round = self._latest_round() + 1
        self._report = Report(self.rid, self.incarnation, step, self._next_round, dict(self.spec.fingerprint),
                              joining=True, **state)
        addrs = tuple(addrs)
        state_addrs = tuple(state_addrs) or ("",) * len(addrs)
        self._world = max(1, len(addrs))
        self._addr_blocks = encode_blocks(addrs, state_addrs) if addrs else []
        self.book = AddressBook(self.store, self._root, self._world)
        if addrs:
            self.book.put(self.rid, self.incarnation, (addrs, state_addrs))
        self._grant_and_publish()
        self._cancel_watches.append(self.store.watch_prefix(keys.evict(self._root), self._on_event))
        self._cancel_watches.append(self.store.watch_prefix(keys.alive(self._root), self._on_event))
        self._cancel_watches.append(self.store.watch_prefix(keys.quorum(self._root), self._on_event))
        self._keepalive = Thread(target=self._keepalive_loop, name=f"lft-lease-r{self.rid}", daemon=True)
        self._keepalive.start()

    def _check_config(self) -> None:
        mine = dict(self.spec.fingerprint)
        raw = json.dumps(mine, sort_keys=True).encode()
        if self.store.create(keys.config(self._root), raw):
            return
        kv = self.store.get(keys.config(self._root))
        job_fp = json.loads(kv.value) if kv else {}
        diff = fingerprint_diff(job_fp, mine)
        if diff:
            raise ConfigMismatch(
                f"replica {self.rid} (incarnation {self.incarnation}) refused: job config differs in {diff}. "
                f"Use the job's settings, or a new job id to start a different job.")

    def _check_finished(self) -> None:
        kv = self.store.get(keys.finished(self._root))
        if kv is not None:
            raise JobFinished(f"the job already finished ({kv.value.decode(errors='replace')}); replica {self.rid} "
                              "has nothing left to train")

    def _check_halt(self) -> None:
        kv = self.store.get(keys.halt(self._root))
        if kv is not None:
            raise JobHalted(json.loads(kv.value)["reason"])

    def _grant_and_publish(self) -> None:
        """A new lease, and on it our addresses, our alive key and our report (in that order:
        whoever sees the report can read the rest)."""
        self._lease = self.store.lease_grant(self.lease_ttl_s)
        self._lease_lost.clear()
        publish_addresses(self.store, self._root, self.rid, self.incarnation, self._addr_blocks, self._lease)
        self.store.put(keys.alive(self._root, self.rid), json.dumps({"incarnation": self.incarnation}).encode(),
                       lease=self._lease)
        key = keys.members(self._root, self.rid)
        self.store.put(key, self._own_report.to_json(), lease=self._lease)
        kv = self.store.get(key)
        self._member_created = kv.create_revision if kv is not None else 0

    def _keepalive_loop(self) -> None:
        period = max(self.lease_ttl_s / 3.0, 0.05)
        while not self._stop.wait(period):
            if self._clock() - self._last_progress > self.hang_timeout_s:
                if not self._lease_lost.is_set():
                    log.warning("replica %d: no training progress for %.1fs (hang_timeout); letting the lease lapse",
                                self.rid, self.hang_timeout_s)
                continue
            if self._lease_lost.is_set():
                continue
            try:
                self.store.lease_keepalive(self._lease)
            except LeaseExpired:
                self._lease_lost.set()
                self.changed = True
                self._wake.set()
            except StoreError as e:
                log.warning("replica %d: lease keepalive failed: %s", self.rid, e)

    def _recover_lease(self) -> None:
        """Our lease lapsed (we hung, or etcd lost it). Come back as a joiner unless evicted."""
        if self.store.get(keys.evict(self._root, self.rid, self.incarnation)) is not None:
            raise Evicted(f"replica {self.rid} incarnation {self.incarnation} was evicted while its lease lapsed; "
                          "exiting so the supervisor restarts it")
        log.warning("replica %d: lease lapsed; re-registering as a joiner", self.rid)
        self._report = replace(self._own_report, round=max(self._own_report.round, self._latest_round() + 1))
        self._grant_and_publish()

    def report_stall(self, stall: dict[str, Any]) -> None:
        """Our exchange has waited past hang.report_after_s: publish where (`stall/{rid}`, on our
        lease; coord/hang.py reads it). Never raises: a diagnosis must not fail a step."""
        try:
            self.store.put(keys.stall(self._root, self.rid),
                           json.dumps({"t": time.time(), "incarnation": self.incarnation, **stall}).encode(),
                           lease=self._lease)
        except Exception as e:
            log.warning("replica %d: could not publish its stall report: %s", self.rid, e)

    def heartbeat(self) -> None:
        """The training loop made progress. Call at least every hang_timeout_s."""
        self._last_progress = self._clock()

    def _watch_reports(self, want: bool) -> None:
        """Hold the members/ watch while we decide rounds, drop it when another leader does."""
        if want and self._cancel_reports is None:
            kvs, rev = self.store.get_prefix(keys.members(self._root))
            with self._dead_lock:
                self._reports = {r.rid: r for r in (Report.from_json(kv.value) for kv in kvs)}
            self._cancel_reports = self.store.watch_prefix(keys.members(self._root), self._on_event,
                                                           start_revision=rev + 1)
        elif not want and self._cancel_reports is not None:
            self._cancel_reports()
            self._cancel_reports = None
            with self._dead_lock:
                self._reports = {}

    @property
    def watching_reports(self) -> bool:
        return self._cancel_reports is not None

    def addresses(self, rid: int, incarnation: int) -> Optional[Addresses]:
        """(FTAR, state-server) addresses of every rank of (rid, incarnation), read once while
        it lives; None when it has none in etcd (it died or left)."""
        assert self.book is not None, "addresses() before register()"
        return self.book.get(rid, incarnation)

    def evict(self, rid: int, incarnation: int, reason: str) -> None:
        """Declare (rid, incarnation) dead, effective for everyone at once."""
        self.store.put(keys.evict(self._root, rid, incarnation), reason.encode())

    @property
    def current(self) -> Optional[Quorum]:
        return self._current

    def _emit(self, name: str, **fields: Any) -> None:
        log.warning("replica %d decided: %s %s", self.rid, name, fields)
        if self.on_event is not None:
            try:
                self.on_event(name, **fields)
            except Exception as e:  # an event log must never stop training
                log.warning("could not record event %s: %s", name, e)

    def _log_reason(self, reason: str) -> None:
        if reason != self._last_reason:
            self._last_reason = reason
            log.info("replica %d: %s", self.rid, reason)

    def _on_event(self, ev: Event) -> None:
        parts = ev.key[len(self._root):].split("/")
        q = self._current
        failed: Optional[tuple[int, str]] = None
        if parts[0] == "quorum" and ev.kind == "put":
            self._decisions[int(parts[1])] = ev.value
        elif parts[0] == "evict" and ev.kind == "put" and len(parts) == 3:
            rid, inc = int(parts[1]), int(parts[2])
            with self._dead_lock:
                self._evicted.add((rid, inc))
            if q is not None and (rid, inc) in q.member_set():
                with self._dead_lock:
                    self._dead.add((rid, inc))
                self.changed = True
                failed = (rid, f"evicted: {ev.value.decode(errors='replace')}")
        elif parts[0] == "alive" and len(parts) == 2 and q is not None:
            rid = int(parts[1])
            if rid in q.members:
                inc = q.incarnations[q.members.index(rid)]
                with self._dead_lock:
                    if ev.kind == "delete":
                        self._dead.add((rid, inc))
                        self.changed = True
                        failed = (rid, "lease expired")
                    elif json.loads(ev.value)["incarnation"] == inc:
                        self._dead.discard((rid, inc))  # back from a lapse (evictions are re-checked in quorum)
                    else:
                        self.changed = True  # a new incarnation replaces a member
            elif ev.kind == "put" and rid != self.rid:
                self.changed = True  # a joiner: take it in at the next round
        elif parts[0] == "members" and len(parts) == 2:  # the decider's watch only
            rid = int(parts[1])
            report = Report.from_json(ev.value) if ev.kind == "put" else None
            with self._dead_lock:
                if report is None:
                    self._reports.pop(rid, None)
                else:
                    self._reports[rid] = report
            if report is not None and rid != self.rid and q is not None and (
                    rid not in q.members or report.incarnation != q.incarnations[q.members.index(rid)]):
                # a joiner still reporting (left out of a round), or a new incarnation of a member
                # (a warm spare promoted before the old one's lease lapsed): take it in
                self.changed = True
        self._wake.set()
        if failed and failed[0] != self.rid and self.on_failure is not None:
            self.on_failure(*failed)

    def _latest_round(self) -> int:
        kvs, _ = self.store.get_prefix(keys.quorum(self._root))
        return keys.round_of(kvs[-1].key) if kvs else -1

    def close(self, revoke: bool = True) -> None:
        """Stop the threads; with `revoke`, leave the job at once (a clean exit). A quorum call
        that still waits ends (CoordinatorClosed)."""
        self._stop.set()
        self._wake.set()
        for cancel in self._cancel_watches:
            cancel()
        self._cancel_watches.clear()
        if self._cancel_reports is not None:
            self._cancel_reports()
            self._cancel_reports = None
        if self._keepalive is not None:
            self._keepalive.join(2.0)
        if revoke and self._lease:
            try:
                # Tell the supervisor this is a clean exit, not a hang, then leave at once.
                self.store.put(keys.left(self._root, self.rid, self.incarnation), b"clean exit")
                self.store.lease_revoke(self._lease)
            except StoreError:
                pass
