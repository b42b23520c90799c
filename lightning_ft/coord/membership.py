"""A replica leader's membership in the job (coord/coordinator.py has the whole story):
registration (the config fingerprint checked, a finished or halted job refused), the lease and
its keepalive (paused by a hang), the watches (failures, joiners, decisions, and the members'
reports while it decides; coord/watched.py), the address book, evictions and stall reports.
The rounds (coord/coordinator.py) hold one."""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

from . import keys
from .addresses import AddressBook, Addresses, encode_blocks, publish as publish_addresses
from .quorum import fingerprint_diff
from .round_records import JobSpec, Report
from .store import Event, LeaseExpired, Store, StoreError
from .watched import Watched
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
class Runtime:
    """How a coordinator runs: on real time and threads, or on the simulator's clock and events
    (sim/replica.py), where no thread renews the lease (its own keepalive process does)."""

    clock: Callable[[], float] = time.monotonic
    event: Callable[[], Any] = threading.Event
    keepalive: bool = True
    """Renew the lease from a thread of our own."""


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


@dataclass(frozen=True)
class Grant:
    """This incarnation's lease and what is fenced on it, replaced whole when a lapsed lease is
    granted anew (the keepalive, the ledger's recorder and a stall report read it)."""

    lease: int = 0
    member_created: int = 0
    """Create revision of our members/ key: the fence of our ledger writes."""


class Membership:
    """One per replica leader: its membership in the job.

    Threads (docs/ARCHITECTURE.md, "Threads"): the round thread (see Coordinator) registers,
    publishes our report (`report`, `publish`), heartbeats and closes; the keepalive thread
    (`lft-lease-r{rid}`) keeps the lease alive; the watch callbacks write `watched`. Between
    them: `_grant` (an immutable Grant, replaced whole by the round thread; the keepalive, the
    ledger's fence and stall reports read it), `_last_progress` (a float the round thread
    replaces, the keepalive reads), and the events `lease_lost` (set by the keepalive, cleared
    by a new grant), `_changed` (set by the watches and the keepalive, cleared at the round
    thread's next report) and `wake` (set by the watches, the keepalive and close; the round
    thread waits on it).

    Args:
        store: the job's etcd (or a MemoryStore).
        job: the job's name.
        rid: this replica's id.
        incarnation: this process's incarnation of the replica.
        spec: what the job is (replicas, min_replicas, the config fingerprint, policies).
        settings: the key prefix, lease TTL, hang timeout and poll interval (`MembershipSettings`;
            None: the defaults).
        run: the job's run id (coord/runs.py) whose keys it uses; "": the job's root.
        on_failure: called as on_failure(rid, reason) when the watches see a member fail
            (from a watch thread).
        clock: the monotonic clock the hang timeout reads (tests pass their own).
        event: makes the events above (threading.Event; the simulator passes its own, lightning_ft/sim).
        keepalive: start the keepalive thread at `register` (False: the caller calls
            `keepalive_once` every lease_ttl_s / 3, as the simulator does).
    """

    def __init__(self, store: Store, job: str, rid: int, incarnation: int, spec: JobSpec,
                 settings: Optional[MembershipSettings] = None, *, run: str = "",
                 on_failure: Optional[Callable[[int, str], None]] = None, runtime: Optional[Runtime] = None) -> None:
        rt = runtime or Runtime()
        clock, event, keepalive = rt.clock, rt.event, rt.keepalive
        self.settings = settings or MembershipSettings()
        self.store, self.job, self.rid, self.incarnation, self.spec = store, job, rid, incarnation, spec
        self.on_failure = on_failure
        self._clock = clock
        self.root = keys.root(self.settings.prefix, job, run)
        self.watched = Watched(self.root, rid, spec.straggler_threshold)
        """What the watches delivered (thread-safe)."""
        self.wake = event()
        """Set when something the rounds wait for may have happened (a watch event, a lapsed lease, close)."""
        self.lease_lost = event()
        """Our lease lapsed (the keepalive saw it): the round thread re-registers (`recover_lease`)."""
        self._changed = event()
        self._stop = event()
        self._keepalive_thread = keepalive
        self._grant = Grant()
        self._report: Optional[Report] = None
        self._last_progress = clock()
        self._keepalive: Optional[threading.Thread] = None
        self._cancel_watches: list[Callable[[], None]] = []
        self._cancel_reports: Optional[Callable[[], None]] = None
        """The members/ watch, held while we decide rounds."""
        self._addr_blocks: list[bytes] = []
        self._world = 1
        self.book: Optional[AddressBook] = None
        """Fetched per-rank addresses of other incarnations (`addresses`)."""

    # -- what the rounds read --------------------------------------------------------------------
    @property
    def report(self) -> Report:
        """Our member report (set by `register`; the round thread's)."""
        if self._report is None:
            raise RuntimeError(f"replica {self.rid}: no member report before register()")
        return self._report

    @report.setter
    def report(self, report: Report) -> None:
        self._report = report

    @property
    def changed(self) -> bool:
        """A watch saw a change since our last full-round report (failure, eviction, joiner, new
        incarnation, our lease lapsed): the next round must be a full round."""
        return self._changed.is_set()

    def new_report(self) -> None:
        """We report for a round: changes seen from here on count for the round after it."""
        self._changed.clear()
        if self.lease_lost.is_set():
            self._changed.set()

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    @property
    def watching_reports(self) -> bool:
        return self._cancel_reports is not None

    def fence(self) -> dict[str, int]:
        """The ledger fence ({key: create revision}): our member key is the one we created,
        and this incarnation is not evicted."""
        return {keys.members(self.root, self.rid): self._grant.member_created,
                keys.evict(self.root, self.rid, self.incarnation): 0}

    # -- registration ----------------------------------------------------------------------------
    def register(self, step: int, addrs: Sequence[str] = (), state_addrs: Sequence[str] = (), **state: Any) -> None:
        """Check the job config, take a lease, publish our member report and start the
        keepalive thread and the failure watches. Do slow initialization *before* this.
        `state`: Report fields describing our state (gen, synced, cursor, ...)."""
        self._check_config()
        self.check_halt()
        if self.store.get(keys.evict(self.root, self.rid, self.incarnation)) is not None:
            raise Evicted(f"replica {self.rid} incarnation {self.incarnation} was already evicted; "
                          "restart it with a new incarnation")
        kv = self.store.get(keys.members(self.root, self.rid))
        if kv is not None and Report.from_json(kv.value).incarnation >= self.incarnation:
            held = Report.from_json(kv.value).incarnation
            raise ConfigMismatch(
                f"replica {self.rid} (incarnation {self.incarnation}) refused: replica {self.rid} incarnation {held} "
                f"is registered and alive. Is the same replica id started twice, or another job running with the "
                f"same job id and secret? Give each replica its own id, or the other job another --job")
        self._report = Report(self.rid, self.incarnation, step, self.latest_round() + 1, dict(self.spec.fingerprint),
                              joining=True, **state)
        addrs = tuple(addrs)
        state_addrs = tuple(state_addrs) or ("",) * len(addrs)
        self._world = max(1, len(addrs))
        self._addr_blocks = encode_blocks(addrs, state_addrs) if addrs else []
        self.book = AddressBook(self.store, self.root, self._world)
        if addrs:
            self.book.put(self.rid, self.incarnation, (addrs, state_addrs))
        self._grant_and_publish()
        for prefix in (keys.evict(self.root), keys.alive(self.root), keys.quorum(self.root)):
            self._cancel_watches.append(self.store.watch_prefix(prefix, self._on_event))
        if self._keepalive_thread:
            self._keepalive = Thread(target=self._keepalive_loop, name=f"lft-lease-r{self.rid}", daemon=True)
            self._keepalive.start()

    def _check_config(self) -> None:
        mine = dict(self.spec.fingerprint)
        raw = json.dumps(mine, sort_keys=True).encode()
        if self.store.create(keys.config(self.root), raw):
            return
        kv = self.store.get(keys.config(self.root))
        job_fp = json.loads(kv.value) if kv else {}
        diff = fingerprint_diff(job_fp, mine)
        if diff:
            raise ConfigMismatch(
                f"replica {self.rid} (incarnation {self.incarnation}) refused: job config differs in {diff}. "
                f"Use the job's settings, or a new job id to start a different job.")

    def check_finished(self) -> None:
        """Raise JobFinished when the job already trained to completion."""
        kv = self.store.get(keys.finished(self.root))
        if kv is not None:
            raise JobFinished(f"the job already finished ({kv.value.decode(errors='replace')}); replica {self.rid} "
                              "has nothing left to train")

    def check_halt(self) -> None:
        """Raise JobHalted once the job is halted (a decision every replica obeys, whatever round it
        reports for: one that missed the halted round, its lease lapsed meanwhile, must not decide
        rounds alone)."""
        kv = self.store.get(keys.halt(self.root))
        if kv is not None:
            raise JobHalted(json.loads(kv.value)["reason"])

    def latest_round(self) -> int:
        """The newest round recorded in etcd (-1: none)."""
        kvs, _ = self.store.get_prefix(keys.quorum(self.root))
        return keys.round_of(kvs[-1].key) if kvs else -1

    # -- the lease -------------------------------------------------------------------------------
    def _grant_and_publish(self) -> None:
        """A new lease, and on it our addresses, our alive key and our report (in that order:
        whoever sees the report can read the rest)."""
        lease = self.store.lease_grant(self.settings.lease_ttl_s)
        self._grant = Grant(lease, self._grant.member_created)
        self.lease_lost.clear()
        publish_addresses(self.store, self.root, self.rid, self.incarnation, self._addr_blocks, lease)
        self.store.put(keys.alive(self.root, self.rid), json.dumps({"incarnation": self.incarnation}).encode(),
                       lease=lease)
        key = keys.members(self.root, self.rid)
        self.store.put(key, self.report.to_json(), lease=lease)
        kv = self.store.get(key)
        self._grant = Grant(lease, kv.create_revision if kv is not None else 0)

    def _keepalive_loop(self) -> None:
        period = max(self.settings.lease_ttl_s / 3.0, 0.05)
        while not self._stop.wait(period):
            self.keepalive_once()

    def keepalive_once(self) -> None:
        """Refresh the lease, unless the training loop made no progress for hang_timeout_s (a hung
        replica lets its lease lapse, and the others fail it) or the lease is already lost."""
        st = self.settings
        if self._clock() - self._last_progress > st.hang_timeout_s:
            if not self.lease_lost.is_set():
                log.warning("replica %d: no training progress for %.1fs (hang_timeout); letting the lease lapse",
                            self.rid, st.hang_timeout_s)
            return
        if self.lease_lost.is_set():
            return
        try:
            self.store.lease_keepalive(self._grant.lease)
        except LeaseExpired:
            self.lease_lost.set()
            self._changed.set()
            self.wake.set()
        except StoreError as e:
            log.warning("replica %d: lease keepalive failed: %s", self.rid, e)

    def recover_lease(self) -> None:
        """Our lease lapsed (we hung, or etcd lost it). Come back as a joiner unless evicted."""
        if self.store.get(keys.evict(self.root, self.rid, self.incarnation)) is not None:
            raise Evicted(f"replica {self.rid} incarnation {self.incarnation} was evicted while its lease lapsed; "
                          "exiting so the supervisor restarts it")
        log.warning("replica %d: lease lapsed; re-registering as a joiner", self.rid)
        # A joiner's report stands for every round until it is taken in (quorum rule 1): the
        # newest round recorded in etcd may be one the others passed long ago in steady rounds.
        self._report = replace(self.report, round=max(self.report.round, self.latest_round() + 1), joining=True)
        self._grant_and_publish()

    def publish(self, report: Report) -> None:
        """Make `report` ours and put it in members/ (on a new lease if ours lapsed)."""
        self._report = report
        try:
            self.store.put(keys.members(self.root, self.rid), report.to_json(), lease=self._grant.lease)
        except LeaseExpired:
            self.recover_lease()

    def heartbeat(self) -> None:
        """The training loop made progress. Call at least every hang_timeout_s."""
        self._last_progress = self._clock()

    def report_stall(self, stall: dict[str, Any]) -> None:
        """Our exchange has waited past hang.report_after_s: publish where (`stall/{rid}`, on our
        lease; coord/hang.py reads it). Never raises: a diagnosis must not fail a step."""
        try:
            self.store.put(keys.stall(self.root, self.rid),
                           json.dumps({"t": time.time(), "incarnation": self.incarnation, **stall}).encode(),
                           lease=self._grant.lease)
        except Exception as e:
            log.warning("replica %d: could not publish its stall report: %s", self.rid, e)

    # -- the watches -----------------------------------------------------------------------------
    def watch_reports(self, want: bool) -> None:
        """Hold the members/ watch while we decide rounds, drop it when another leader does."""
        if want and self._cancel_reports is None:
            kvs, rev = self.store.get_prefix(keys.members(self.root))
            self.watched.set_reports({r.rid: r for r in (Report.from_json(kv.value) for kv in kvs)})
            self._cancel_reports = self.store.watch_prefix(keys.members(self.root), self._on_event,
                                                           start_revision=rev + 1)
        elif not want and self._cancel_reports is not None:
            self._cancel_reports()
            self._cancel_reports = None
            self.watched.set_reports({})

    def _on_event(self, ev: Event) -> None:
        """A watch thread: take the event in, wake the rounds, report a member's failure."""
        changed, failed = self.watched.apply(ev)
        if changed:
            self._changed.set()
        self.wake.set()
        if failed and failed[0] != self.rid and self.on_failure is not None:
            self.on_failure(*failed)

    # -- other replicas --------------------------------------------------------------------------
    def addresses(self, rid: int, incarnation: int) -> Optional[Addresses]:
        """(FTAR, state-server) addresses of every rank of (rid, incarnation), read once while
        it lives; None when it has none in etcd (it died or left)."""
        assert self.book is not None, "addresses() before register()"
        return self.book.get(rid, incarnation)

    def evict(self, rid: int, incarnation: int, reason: str) -> None:
        """Declare (rid, incarnation) dead, effective for everyone at once."""
        self.store.put(keys.evict(self.root, rid, incarnation), reason.encode())

    # -- the end ---------------------------------------------------------------------------------
    def close(self, revoke: bool = True) -> None:
        """Stop the threads; with `revoke`, leave the job at once (a clean exit). A quorum call
        that still waits ends (CoordinatorClosed)."""
        self._stop.set()
        self.wake.set()
        for cancel in self._cancel_watches:
            cancel()
        self._cancel_watches.clear()
        if self._cancel_reports is not None:
            self._cancel_reports()
            self._cancel_reports = None
        if self._keepalive is not None:
            self._keepalive.join(2.0)
        lease = self._grant.lease
        if revoke and lease:
            try:
                # Tell the supervisor this is a clean exit, not a hang, then leave at once.
                self.store.put(keys.left(self.root, self.rid, self.incarnation), b"clean exit")
                self.store.lease_revoke(lease)
            except StoreError:
                pass
