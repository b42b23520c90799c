"""The per-step protocol of one replica rank, framework-free (docs/ARCHITECTURE.md, "A step").

    mgr = ReplicaManager.from_config(model, optimizer, cfg, ...)   # after the slow init
    mgr.start()                         # FTAR + state server; the leader registers
    mgr.prepare()                       # sync / catch-up / rewind until this replica is current
    while mgr.step < max_steps:
        res = mgr.run_step(compute)     # rounds until one commits a step this replica trained

`run_step` owns the whole step: the quorum round (optionally started early with
`begin_step`, overlapped with forward/backward), the round's role, the exchange, the
two-phase commit inside the replica, retries, and the rounds that are not training:

- train:   contributors train their slot batch and average gradients through FTAR;
- catchup: lagging (or diverged) replicas send zeros, fetch the healthy state
           (version = committed steps) from `contributors[(rid + rank) % len]` while their
           zeros are on the wire, and apply the same optimizer step;
- source / adopt: a sync round (the job's first round, after a resume, or a rewind): the
           source (after loading a checkpoint, in a rewind) publishes its state and every
           other member adopts it; nobody trains.

Two-phase commit: each rank votes; an all-reduce MIN over the replica's own process group
decides. All apply the step, or none does and the step is retried. A rank whose state a
failed fetch partly overwrote votes "lost", and the whole replica exits (ReplicaStateLost)
so that the launcher restarts it fresh. Only the leader (local rank 0) talks to etcd; it
broadcasts each round's quorum to its ranks.
"""
from __future__ import annotations

import collections
import json
import logging
import math
import os
import statistics
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, TypeVar, cast

import torch

from lightning_ft.constants import LR_MODES
from lightning_ft.coord import keys
from lightning_ft.coord.coordinator import Coordinator, JobFinished
from lightning_ft.coord.quorum import JobSpec, LocalView, Quorum, adopt_role, must_abort, steady_next
from lightning_ft.coord.runs import RunHold, open_run
from lightning_ft.coord.store import Store, StoreError, store_from_config
from lightning_ft.ftar.engine import FTAR
from lightning_ft.ftar.ring import neighbours
from lightning_ft.ftar.transport.base import FTARError, FatalError, RecoverableError
from lightning_ft.replica import data as ledger
from lightning_ft.replica.batch_policy import round_batches
from lightning_ft.replica.buckets import GradBuckets
from lightning_ft.replica.group import ReplicaGroup
from lightning_ft.replica.settings import Identity, Settings
from lightning_ft.replica import startup
from lightning_ft.replica.catchup import CatchupError, StateServer, fetch_state
from lightning_ft.replica.optimizers import Optimizers, unwrap
from lightning_ft.replica.state import (combine, fast_digest, hyperparameters, materialize_optimizer_state,
                                        opt_params, param_layout, state_tensors)
from lightning_ft.secret import tag as secret_tag
from lightning_ft.threads import name_current

log = logging.getLogger(__name__)

OK, FAILED, LOST = 1, 0, -1
"""Votes: MIN over the replica's ranks decides."""


def lr_factor(mode: str, healthy: int, total: int) -> float:
    """f(healthy/total) for the LR intervention: 1, x or sqrt(x)."""
    x = healthy / total
    if mode == "none":
        return 1.0
    if mode == "linear":
        return x
    if mode == "sqrt":
        return math.sqrt(x)
    raise ValueError(f"lr_intervention {mode!r} is not one of {LR_MODES}")


class ReplicaStateLost(RuntimeError):
    """A failed catch-up left this replica's state partly overwritten; it must restart fresh."""


class StaleManualStep(RuntimeError):
    """Manual optimization computed gradients on weights a catch-up then replaced."""


@dataclass(frozen=True)
class StepPlan:
    step: int
    """The step this round trains (committed steps of the healthy replicas)."""
    quorum: Quorum
    role: str
    """"train", "catchup", "source" or "adopt" (see the module docstring)."""
    divisor: int
    lr_factor: float
    batch_index: int
    """The batch of this replica's slot to train (train role only)."""
    batches: Any = None
    """Slot -> batch index trained in this round by all contributors (train rounds; the
    commit's ledger record). None in sync rounds."""
    extra: tuple[tuple[int, int], ...] = ()
    """(slot, k) batches of absent slots this replica trains besides its own (batch_policy
    "constant"; `run_step(extra=...)` computes them)."""
    opt: int = 0
    """The optimizer this round steps (quorum rule 15; -1: not known yet)."""
    cont: bool = False
    """The round continues a batch: no batch in its ledger record, no cursor advances."""

    @property
    def contribute(self) -> bool:
        return self.role == "train"

    @property
    def lagging(self) -> bool:
        return self.role != "train"

    @property
    def sync(self) -> bool:
        return self.role in ("source", "adopt")


@dataclass
class StepStats:
    quorum_s: float = 0.0
    reconfigure_s: float = 0.0
    exchange_s: float = 0.0
    catchup_s: float = 0.0
    catchup_gbps: float = 0.0
    catchup_mb: float = 0.0
    freeze_s: float = 0.0
    digest_s: float = 0.0
    retries: int = 0


@dataclass
class StepResult:
    """What one `run_step` call did."""

    committed: int = 0
    """Steps committed (catch-ups included)."""
    trained: bool = False
    """A step that trained the requested batch committed."""
    caught_up: bool = False
    synced: bool = False
    stale: bool = False
    """The slot's cursor went back (a rewind): the delivered batch is not the next to train;
    the caller must re-position its data source at `ReplicaManager.cursor`."""
    loss: Any = None


_T = TypeVar("_T")


def _opened(part: Optional[_T], what: str) -> _T:
    """A part `ReplicaManager.start` opens, or a clear error where it is read before then (or on
    a rank that has none)."""
    if part is None:
        raise RuntimeError(f"ReplicaManager.{what} is not open: start() opens it (the store and "
                           f"the coordinator on the replica's leader rank only)")
    return part


class ReplicaManager:
    """One per rank. The leader (rank 0 of the replica) also owns the Coordinator."""

    def __init__(self, model: torch.nn.Module, optimizer: Any, who: Identity, settings: Optional[Settings] = None, *,
                 group: Optional[ReplicaGroup] = None, scheduler: Any = None, store: Optional[Store] = None,
                 run_dir: str = "") -> None:
        """`who`: the replica; `settings`: the protocol's knobs (replica/settings.py); `group`: this
        replica's ranks (default: one rank); `store`: an open etcd client for the leader (default:
        `start` opens one at `who.etcd`)."""
        st = self.settings = settings or Settings()
        group = group or ReplicaGroup(0, 1, None)
        self.batch_policy = st.batch_policy
        if isinstance(optimizer, (list, tuple)):  # manual optimization with several: replica/optimizers.py
            optimizer = optimizer[0] if len(optimizer) == 1 else Optimizers(optimizer)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.multi = isinstance(optimizer, Optimizers)
        """Several optimizers: each `optimizer.step()` is a round (quorum rule 15)."""
        self.phase: tuple[int, bool] = (-1 if self.multi else 0, False)
        """(optimizer, continues a batch) of this replica's next round (reported; rule 15)."""
        self.batches = 0
        """Batches the job's history committed (one per batch-start round): `step` counts optimizer
        steps; with one optimizer both are equal."""
        self._all_buckets: list[GradBuckets] = []
        # Captured now, while FSDP2's parameters are the sharded DTensors (see state.py).
        self._named_params = list(model.named_parameters())
        self.job, self.rid, self.incarnation = who.job, who.rid, who.incarnation
        self.standby = who.standby
        """A warm spare's token (coord/standby.py): `start` waits to be promoted, and takes the
        replica id and incarnation it is given; "" for a replica."""
        self.R, self.rank, self.world, self.pg = who.num_replicas, group.rank, group.world, group.pg
        self.group = group
        """This replica's ranks: the collectives inside it (replica/group.py)."""
        self.secret = who.secret
        self._etcd, self._store = who.etcd, store
        self.prefix = st.prefix
        self.run_id = who.run_id
        """The job's run (coord/runs.py): "" = join or start the run recorded in etcd."""
        self.root = keys.root(st.prefix, who.job, who.run_id)
        """This run's keyspace; set by `start` once the run is known."""
        self.lr_mode = st.lr_intervention
        R, world = who.num_replicas, group.world
        fp = dict(st.fingerprint or {"job": who.job, "replicas": R, "nproc_per_replica": world})
        # What this process really uses, whatever the config said, and what no config holds.
        fp.update(job=who.job, replicas=R, nproc_per_replica=world, chunk_bytes=st.chunk_bytes,
                  num_chunks=st.num_chunks, lr_intervention=st.lr_intervention,
                  secret_tag=secret_tag(who.secret, who.job), params=param_layout(self._named_params))
        # Rule 14 (coord/stragglers.py): the job config's section, or detection off.
        sg = st.stragglers
        self.straggler_window = int(sg.window) if sg is not None else 10
        self.spec = JobSpec(R, st.min_replicas, st.init_timeout_s, fp, batch_policy=st.batch_policy,
                            straggler_threshold=float(sg.threshold) if sg is not None else 0.0,
                            straggler_policy=str(sg.policy) if sg is not None else "wait",
                            straggler_window=self.straggler_window)
        self._compute: collections.deque[float] = collections.deque(maxlen=max(1, self.straggler_window))
        """Seconds from the end of the previous step to ready-to-exchange of the last cleanly
        trained steps since this replica last (re)joined (`compute_ms` in the reports)."""
        self._compute_round = -1
        self._t_free: Optional[float] = None
        """When the previous `run_step` / `prepare` returned: where the next step's compute starts."""
        self._t_ready: Optional[float] = None
        self._clean = True
        self._ftar_kw: dict[str, Any] = dict(chunk_bytes=st.chunk_bytes, num_chunks=st.num_chunks,
                                             timeout_s=st.ftar_timeout_s, connect_timeout_s=st.ftar_connect_timeout_s,
                                             bind_host=st.bind_host, start_timeout_s=st.hang_timeout_s,
                                             transport=st.transport)
        self.digest_every, self.checkpoint_every = max(0, st.digest_every), max(0, st.checkpoint_every)
        self.checkpoint_root, self.run_dir = st.checkpoint_root, run_dir
        self.step = 0
        """Committed steps of this replica (its state is at the end of step `step - 1`)."""
        self.gen = 0
        """History generation of this replica's state (a rewind starts a new one)."""
        self.synced = False
        """The state comes from the job's history: it adopted or committed in `gen`."""
        self._disowned = False
        """The ledger refused our records of commits (our lease lapsed, or we were evicted): the
        others may have redone those steps without us, so our state is not the job's history
        even at the same step. Reported with no generation (not usable) until we adopt a state."""
        self._made: tuple[int, int] = (-1, -1)
        """(round, epoch) of the round that made our state: the last commit, or the sync round
        we adopted in or were the source of (reported; quorum rule 8, provenance)."""
        self.cursor = 0
        self._coord: Optional[Coordinator] = None
        self._ftar: Optional[FTAR] = None
        self._server: Optional[StateServer] = None
        self._buckets: Optional[GradBuckets] = None
        self._epoch = -1
        self._rank_addrs: list[str] = []
        self._peers_epoch = -1
        """Leader: the ring epoch whose neighbour addresses it last handed to its ranks."""
        self._ring_peers: tuple[int, Optional[str], Optional[str]] = (-1, None, None)
        """(epoch, left, right): this rank's ring neighbours' FTAR addresses, from the leader."""
        self._src_state: tuple[int, Optional[str]] = (-1, None)
        """(round, address): the state server this rank catches up or adopts from in that round."""
        self._ring_ok = True
        self._blame: tuple[int, ...] = ()
        self._bad_ckpts: set[int] = set()
        self._digest: Optional[tuple[int, int]] = None
        """(state version, this rank's 64-bit digest), reported with the next round."""
        self._cursor_stale = False
        self._unrecorded: list[tuple] = []
        """Commits not yet in the ledger: written before our next report (full round), before a
        checkpoint and at close; steady rounds only append."""
        self._ledger_lock = threading.Lock()
        self._committed_round = -1
        self._bg: Optional[ThreadPoolExecutor] = None
        self._stash: Optional[StepPlan] = None
        self._pool: Optional[ThreadPoolExecutor] = None
        self.stats = StepStats()
        self.last_plan: Optional[StepPlan] = None
        self.on_commit: Optional[Callable[[StepPlan], None]] = None
        self.restart_breakdown: Optional[dict] = None
        """A restarted incarnation's start-up in parts (replica/startup.py), set at its first commit."""
        self.on_state_replaced: Optional[Callable[[StepPlan], None]] = None
        """Called after a sync or catch-up replaced this rank's state (not after training)."""
        self.callbacks: Any = None
        """The caller's other state a catch-up carries (state_dict() -> str or None,
        load_state_dict(str)): Lightning callbacks' (strategy/callback_state.py)."""
        self.request_stop = False
        """Ask the job to stop (reported with every round until a round carries it)."""
        self.on_retry: Optional[Callable[[StepPlan], None]] = None
        """Called when a round's commit failed (the step is retried in a new round)."""
        self.scaler: Optional[Any] = None
        """fp16 loss scaling (`replica/scaler.py::ReplicaScaler`, set by `set_scaler`): its skip
        decision is taken in the commit on the averaged gradients, the same on every replica."""
        self.clip_catchup: Optional[Callable[[], None]] = None
        """Applied to the averaged gradients before a catch-up's optimizer step, on every rank
        after the vote: what a contributor's `after_exchange` does to them (gradient clipping),
        without its user hooks. Without it a catch-up applied unclipped gradients where the
        contributors clipped, and the caught-up replica diverged (the typical program)."""

    @classmethod
    def from_config(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: Any, *, job: str, rid: int,
                    incarnation: int, num_replicas: int, secret: str, etcd: str, rank: int = 0, world: int = 1,
                    pg: Any = None, scheduler: Any = None, run_dir: str = "", run_id: str = "", standby: str = "",
                    **overrides: Any) -> "ReplicaManager":
        """A manager from the job's FTConfig (lightning_ft.config): its sections, then `overrides`
        (Settings fields)."""
        who = Identity(job, rid, incarnation, num_replicas, secret, etcd, run_id=run_id, standby=standby)
        return cls(model, optimizer, who, Settings.from_config(cfg, **overrides), group=ReplicaGroup(rank, world, pg),
                   scheduler=scheduler, run_dir=run_dir)

    def set_scaler(self, scaler: Any) -> None:
        """Scale the loss with this `torch.amp.GradScaler` (the caller's backward multiplies the
        loss by its scale); the manager unscales the averaged gradients, skips overflowed steps
        on every replica alike, updates the scale, and carries it in catch-up and checkpoints."""
        from lightning_ft.replica.scaler import ReplicaScaler

        self.scaler = ReplicaScaler(scaler) if scaler is not None else None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # What `start` opens (the store: the leader's only). Read before it, they raise instead of
    # handing None on; `started` says whether they exist (close, and tests that build a part).
    @property
    def store(self) -> Store:
        return _opened(self._store, "store (the leader's etcd client)")

    @property
    def coord(self) -> Coordinator:
        return _opened(self._coord, "coord (the leader's coordinator)")

    @coord.setter
    def coord(self, coord: Coordinator) -> None:
        self._coord = coord

    @property
    def ftar(self) -> FTAR:
        return _opened(self._ftar, "ftar")

    @property
    def server(self) -> StateServer:
        return _opened(self._server, "server (the state server)")

    @server.setter
    def server(self, server: StateServer) -> None:
        self._server = server

    @property
    def buckets(self) -> GradBuckets:
        """The exchange buffer of the optimizer this round steps."""
        return _opened(self._buckets, "buckets")

    @buckets.setter
    def buckets(self, buckets: GradBuckets) -> None:
        self._buckets = buckets

    @property
    def started(self) -> bool:
        """`start` opened FTAR, the state server and the exchange buffers."""
        return self._ftar is not None and self._server is not None and self._buckets is not None

    # -- setup ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Open FTAR and the state server; the leader registers with etcd. Do slow init first."""
        from lightning_ft.network import advertised

        startup.mark("setup")
        if self.incarnation > 0 or self.step > 0 or self.standby:
            # A restarted replica (or a spare) will almost surely catch up: build its optimizer
            # state now, in the slow init, not on the catch-up's critical path.
            materialize_optimizer_state(self.optimizer)
        if self.is_leader and self._store is None:
            self._store = store_from_config(self.settings.etcd_config, self._etcd)
        st = self.settings
        host = self.group.leader_result(lambda: advertised(st.bind_host, st.advertise_host, self._etcd))
        if self.standby:
            self._await_promotion(host)
        from lightning_ft import ops

        ops.set_num_programs(self.settings.num_programs)  # the Triton kernels' grid on GPU (ftar.num_programs)
        self._ftar = FTAR(self.job, self.rid, self.rank, self.secret, **self._ftar_kw)
        self._server = StateServer(self.secret.encode(), bind_host=st.bind_host, name=f"r{self.rid}/rank{self.rank}")
        mine = (_with_host(self.ftar.address, host), _with_host(self.server.address, host))
        addrs = self.group.gather(mine)
        self._rank_addrs = [a for a, _ in addrs]
        # One flat buffer per optimizer: a round exchanges the one it steps.
        opts = self.optimizer.optimizers if self.multi else [self.optimizer]
        self._all_buckets = [GradBuckets(opt_params(o), self._send_bucket, f"replica {self.rid}") for o in opts]
        for o, b in zip(opts, self._all_buckets, strict=True):
            b.attach()
            o.zero_grad = b.zero  # keep .grad as views of the exchange buffer
        self.buckets = self._all_buckets[0]
        self.root, self.gen, self.cursor = self.group.leader_result(lambda: self._register(addrs))
        startup.mark("registered")

    def _await_promotion(self, host: str, slice_s: float = 5.0) -> None:
        """A spare: wait (warm) until promoted, then become that replica's incarnation. The leader
        waits in etcd; with W ranks it hands the outcome on every `slice_s` (None: still
        waiting), so the replica's process group never sits in one collective for hours."""
        from lightning_ft.coord.standby import Waiter

        waiter = None
        if self.is_leader:
            waiter = Waiter(self.store, self.prefix, self.job, secret_tag(self.secret, self.job),
                            self.spec.fingerprint, self.standby, host=host, world=self.world, run_id=self.run_id,
                            ttl_s=self.settings.lease_ttl_s)
        try:
            while True:
                got = self.group.leader_result(
                    lambda: waiter.wait(slice_s if self.world > 1 else None) if waiter else None)
                if got is not None:
                    break
        finally:
            if waiter is not None:
                waiter.close()
        log.info("standby %s: promoted to replica %d incarnation %d", self.standby, got.rid, got.incarnation)
        self.rid, self.incarnation, self.run_id = got.rid, got.incarnation, got.run_id
        self.root = keys.root(self.prefix, self.job, got.run_id)
        self.standby = ""
        startup.mark("promoted")

    def _register(self, addrs: list) -> tuple[str, int, int]:
        """Leader: join (or start) the job's run, then register with the coordinator."""
        hold = RunHold(self.store, ttl_s=30.0, keepalive=False)  # until our members/ key exists
        try:
            run = open_run(self.store, self.prefix, self.job, secret_tag(self.secret, self.job), hold,
                           want=self.run_id, first=self.incarnation == 0)
            log.info("replica %d: %s", self.rid, run.reason)
            self.run_id, self.root = run.run_id, keys.root(self.prefix, self.job, run.run_id)
            self.coord = Coordinator(self.store, self.job, self.rid, self.incarnation, self.spec, prefix=self.prefix,
                                     run=self.run_id, on_failure=self._on_failure, on_event=self.event,
                                     lease_ttl_s=self.settings.lease_ttl_s,
                                     hang_timeout_s=self.settings.hang_timeout_s,
                                     poll_interval_s=self.settings.poll_interval_s)
            # A new process holds an initial state or the resume's checkpoint: both belong to the
            # ledger's newest generation.
            self.gen = ledger.latest_gen(self.store, self.root)
            self.cursor = ledger.read_cursor(self.store, self.root, self.rid, self.gen)
            self.coord.register(self.step, addrs=[a for a, _ in addrs], state_addrs=[s for _, s in addrs],
                                gen=self.gen, synced=self.synced, cursor=self.cursor)
        finally:
            hold.close()
        return self.root, self.gen, self.cursor

    def enable_overlap(self, bucket_bytes: int = 4 << 20) -> None:
        """Exchange gradient buckets from backward hooks (buckets.py); same `bucket_bytes` on
        every replica of a job."""
        for b in self._all_buckets:
            b.enable_overlap(bucket_bytes)

    def event(self, name: str, **fields: Any) -> None:
        """Append an event to {run_dir}/events.jsonl (one write, O_APPEND: safe beside the launcher)."""
        if not self.run_dir:
            return
        fields.setdefault("replica", self.rid)
        fields.setdefault("incarnation", self.incarnation if fields["replica"] == self.rid else None)
        line = json.dumps({"t": time.time(), "event": name, "by": self.rid, **fields}) + "\n"
        fd = os.open(os.path.join(self.run_dir, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def _on_failure(self, rid: int, reason: str) -> None:
        """Eviction or lease expiry of a current member (leader's watch thread): interrupt the
        exchange at once on this rank and, through their FTAR listeners, on our other ranks."""
        why = f"replica {rid} {reason}"
        epoch = self._epoch
        if self._ftar is not None:
            self._ftar.abort(why)
        for addr in self._rank_addrs[1:]:
            threading.Thread(target=self._abort_rank, args=(addr, why, epoch), daemon=True).start()

    def _abort_rank(self, addr: str, why: str, epoch: int) -> None:
        try:
            self.ftar.abort_peer(addr, why, epoch)
        except Exception as e:  # the rank may be gone already; its own errors will surface
            log.warning("replica %d: could not forward abort to %s: %s", self.rid, addr, e)

    def gather(self, obj: Any) -> list:
        """`obj` from every rank of this replica (all ranks call it), in rank order."""
        return self.group.gather(obj)

    def broadcast(self, obj: Any) -> Any:
        """The leader's `obj` on every rank of this replica (all ranks call it)."""
        return self.group.broadcast(obj)

    # -- the quorum of a round ----------------------------------------------------------------------
    def start_step(self) -> StepPlan:
        """Report and obtain this round's quorum (every rank; the leader talks to etcd) and
        prepare the ring. Safe to run on a background thread (`begin_step`)."""
        t0 = time.perf_counter()
        digest = self._replica_digest()
        msg: Any = None
        if self.is_leader:
            try:
                self.coord.heartbeat()
                msg = self._steady_round()
            except Exception as e:
                msg = e
        if self.is_leader and msg is None:
            try:
                self.flush_ledger()  # the previous steps' records precede our report for this one
                if self._cursor_stale:  # a failed commit: others may have committed our batch
                    self.cursor = max(self.cursor, ledger.read_cursor(self.store, self.root, self.rid, self.gen))
                    self._cursor_stale = False
                state = self._report_state(digest)
                q = self.coord.quorum(self.step, timeout_s=self.settings.quorum_timeout_s, cursor=self.cursor,
                                      ring_ok=self._ring_ok and not self.ftar.broken, **state)
                if adopt_role(q, self.rid) == "catchup":
                    # Read after the decision: the contributors recorded the previous step
                    # (possibly with our batch, if we failed to commit it) before reporting.
                    self.cursor = ledger.read_cursor(self.store, self.root, self.rid, q.gen)
                msg = (q, self.cursor)
            except Exception as e:  # Evicted, QuorumTimeout, JobHalted, StoreError: every rank must exit
                msg = e
        table = self._peer_table(msg[0]) if self.is_leader and isinstance(msg, tuple) else None
        if isinstance(msg, tuple):
            msg = (*msg, table is not None)
        msg = self.group.broadcast(msg)
        if isinstance(msg, Exception):
            raise msg
        q, self.cursor, scatter = msg
        if scatter:  # the ring changed, or we fetch a state: each rank gets its own addresses
            mine = self.group.scatter(table)
            if "left" in mine:
                self._ring_peers = (q.epoch, mine["left"], mine["right"])
            if "src" in mine:
                self._src_state = (q.round, mine["src"])
        self.stats = StepStats(quorum_s=time.perf_counter() - t0, retries=self.stats.retries)
        role = adopt_role(q, self.rid)
        if q.epoch != self._epoch:  # a failed exchange (ring_ok=False) always bumps the epoch
            try:
                epoch, left, right = self._ring_peers
                if epoch != q.epoch or left is None or right is None:
                    raise RecoverableError(None, f"no addresses for the ring of epoch {q.epoch} (a neighbour is gone)")
                self.stats.reconfigure_s = self.ftar.join(q.epoch, len(q.members), q.index(self.rid), left, right)
                self._epoch = q.epoch
                self._ring_ok, self._blame = True, ()
            except FatalError:
                raise
            except FTARError as e:  # a neighbour died while connecting: this round fails, the next rebuilds
                log.warning("replica %d rank %d: connecting the ring of epoch %d failed: %s", self.rid,
                            self.rank, q.epoch, e)
                self._ring_ok, self._blame = False, self._blamed(q, e)
        if role == "train" and q.lagging:
            self._publish_snapshot(q)
        cont = q.kind == "train" and q.cont  # rule 15: the batch was counted at its first step
        rb = None if q.kind != "train" or cont else round_batches(
            self.batch_policy, q.contributors, {c: q.cursor_of(c) for c in q.contributors}, self.R, q.slot_cursors)
        trained = rb.divisor if rb is not None else len(q.contributors)
        plan = StepPlan(step=q.max_step, quorum=q, role=role, divisor=trained,
                        lr_factor=lr_factor(self.lr_mode, trained, self.R), batch_index=self.cursor,
                        batches=rb.batches if rb is not None else ({} if cont else None),
                        extra=rb.extra_of(self.rid) if rb is not None and role == "train" else (),
                        opt=q.opt, cont=cont)
        if self.multi:
            # A round nobody named an optimizer for (-1) is trained with the contributors' own
            # first one; a lagging replica cannot know it, and sits it out (`exchange`).
            if plan.opt < 0 and role == "train" and self.phase[0] >= 0:
                plan = replace(plan, opt=self.phase[0])
            self.buckets = self._all_buckets[max(plan.opt, 0)]
        self.last_plan = plan
        return plan

    def _peer_table(self, q: Quorum) -> Optional[list[dict]]:
        """Leader: what each of our ranks needs of other replicas' addresses for round `q`
        (None: nothing new). A new ring epoch: the rank's two ring neighbours (its own local
        rank in their replicas). A round in which we catch up or adopt: the state server each
        rank fetches from. Read through the coordinator's address book (coord/addresses.py):
        two replicas' blocks per ring change, not every member's."""
        role = adopt_role(q, self.rid)
        ring = q.epoch != self._peers_epoch
        fetch = role in ("catchup", "adopt")
        if not ring and not fetch:
            return None
        incs = dict(zip(q.members, q.incarnations, strict=True))

        def of(rid: int) -> Optional[tuple]:
            if rid == self.rid:
                return tuple(self._rank_addrs), ()
            try:
                return self.coord.addresses(rid, incs[rid])
            except StoreError as e:  # no addresses: those ranks fail to connect, the round is retried
                log.warning("replica %d: could not read replica %d's addresses: %s", self.rid, rid, e)
                return None

        table: list[dict] = [{} for _ in range(self.world)]
        if ring:
            i, n = q.index(self.rid), len(q.members)
            left, right = (of(q.members[j]) for j in neighbours(n, i))
            for r, entry in enumerate(table):
                entry["left"] = left[0][r] if left else None
                entry["right"] = right[0][r] if right else None
            self._peers_epoch = q.epoch
        if fetch:
            sources = {c: of(c) for c in q.contributors}
            for r, entry in enumerate(table):
                src = sources[q.contributors[(self.rid + r) % len(q.contributors)]]
                entry["src"] = src[1][r] if src else None
        return table

    def _report_state(self, digest: Optional[tuple[int, str]] = None) -> dict[str, Any]:
        """Leader: what our full-round report says about our state (Coordinator.quorum's fields).
        A disowned state claims no generation, so the quorum never counts it as the job's."""
        state: dict[str, Any] = dict(gen=-1 if self._disowned else self.gen,
                                     synced=self.synced and not self._disowned, blame=self._blame,
                                     stop=self.request_stop, bad_checkpoints=tuple(sorted(self._bad_ckpts)),
                                     made=self._made, opt=self.phase[0], cont=self.phase[1])
        if len(self._compute) >= self.straggler_window:
            state.update(compute_ms=round(statistics.fmean(self._compute) * 1e3, 3), compute_round=self._compute_round)
        else:  # not measured since we (re)joined: say so, or the report would keep an old value
            state.update(compute_ms=-1.0, compute_round=-1)
        if digest is not None:
            state.update(digest=digest[1], digest_step=digest[0])
        return state

    def _steady_round(self) -> Any:
        """Leader: the next round without etcd when nothing changed (quorum.steady_next); else
        None, after stopping the others from going steady when they may (`must_abort`)."""
        q = self.coord.current
        if q is None:
            return None
        view = LocalView(committed=self._committed_round == q.round, changed=self.coord.changed,
                         digest_due=self.digest_due(q.max_step + 1), stop=self.request_stop,
                         opt=self.phase[0], cont=self.phase[1])
        nxt = steady_next(q, view)
        if nxt is None:
            if must_abort(q, view):
                self._abort_ring(q)
            if q.steady and not view.committed:  # our steady round failed: report for its number
                self.coord.retract_steady()
            return None
        self.coord.adopt_steady(nxt)
        if self.rid == nxt.members[0]:  # one leader records it, off the critical path
            if self._bg is None:
                self._bg = ThreadPoolExecutor(1, thread_name_prefix=f"lft-bg-r{self.rid}", initializer=name_current,
                                              initargs=(f"lft-bg-r{self.rid}",))
            self._bg.submit(self.coord.record_steady, nxt)
        return (nxt, self.cursor)

    def _abort_ring(self, q: Quorum) -> None:
        """Leader: we go to a full round while the others may go steady from `q`. Fail every
        rank's exchange of every other member now (and ours: the full round rebuilds the ring),
        before we report, instead of letting them wait for our contribution."""
        why = f"replica {self.rid} needs a full round after round {q.round}"
        # Our ranks abort their links; each ring's other members fail at once on the closed
        # links and close theirs in turn (FTAR aborts a failed all-reduce's links), so the
        # failure goes round every ring without us dialling any other replica's ranks.
        self.ftar.abort(why)
        for addr in self._rank_addrs[1:]:
            threading.Thread(target=self._abort_rank, args=(addr, why, self._epoch), daemon=True).start()

    def _blamed(self, q: Quorum, e: FTARError) -> tuple[int, ...]:
        """The replica whose FTAR endpoint an error names (for the partition rule)."""
        peer = getattr(e, "peer", None)
        epoch, left, right = self._ring_peers
        if not peer or epoch != q.epoch or self.rid not in q.members:
            return ()
        lj, rj = neighbours(len(q.members), q.index(self.rid))
        for addr, rid in ((left, q.members[lj]), (right, q.members[rj])):
            if addr == peer and rid != self.rid:
                return (rid,)
        return ()

    def begin_step(self, save_grads: bool = True) -> "Future[StepPlan]":
        """Start this round's quorum in the background and arm the gradient hooks for the
        coming (final) backward: buckets are all-reduced as soon as the plan is known and
        their gradients are in. Then pass the future to `run_step(pending=...)`."""
        self.buckets.arm(save_grads)
        if self._stash is not None:  # prepare() obtained a training round before any batch
            plan, self._stash = self._stash, None
            fut: Future = Future()
            fut.set_result(plan)
            self.buckets.plan_known(plan)
            return fut
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"lft-quorum-r{self.rid}", initializer=name_current,
                                            initargs=(f"lft-quorum-r{self.rid}",))
        return self._pool.submit(self._start_and_release)

    def _start_and_release(self) -> StepPlan:
        plan = self.start_step()
        self.buckets.plan_known(plan)
        return plan

    def disarm(self) -> None:
        for b in self._all_buckets:
            b.disarm()

    # -- the step ----------------------------------------------------------------------------------
    def prepare(self) -> StepResult:
        """Before the first batch: take part in sync, catch-up and rewind rounds until this
        replica holds the job's current state. A training round it gets meanwhile is kept for
        the first `run_step` / `begin_step`."""
        res = StepResult()
        if self.multi:
            self.phase = (-1, False)  # rule 15: at a batch boundary, its first optimizer not known yet
        # Several optimizers: until a round starts a batch with us, since the job may be inside a
        # batch (rounds we sit out), and a batch computed meanwhile would be on replaced weights.
        while self._stash is None and (self.multi or not self.synced or self.behind()):
            plan = self.start_step()
            if plan.sync:
                res.synced |= self._sync(plan)
            elif plan.role == "catchup":
                if self.commit(self.exchange(plan)):
                    res.committed += 1
                    res.caught_up = True
            else:
                self._stash = plan
        self._t_free = time.monotonic()
        return res

    def run_step(self, compute: Callable[[StepPlan], Any], batch: Optional[int] = None,
                 recompute: Optional[Callable[[StepPlan], Any]] = None, pending: Optional[Future] = None,
                 computed: bool = False, after_exchange: Optional[Callable[[], None]] = None,
                 loss: Any = None, extra: Optional[Callable[[StepPlan], Any]] = None,
                 phase: Optional[tuple[int, bool]] = None) -> StepResult:
        """Run rounds until one commits a step in which this replica trained (see `_run_step`).
        `phase`: (optimizer, continues a batch) of this step, with several optimizers (quorum
        rule 15); a step that continues a batch passes `batch=None`.
        A step trained cleanly (its first round, no retry, catch-up or recomputation) adds its
        compute time, from the previous call's return to ready-to-exchange, to the straggler
        measure (coord/stragglers.py); a catch-up or sync starts the measure afresh."""
        t_begin, self._clean = self._t_free, True
        if phase is not None:
            self.phase = (int(phase[0]), bool(phase[1]))
        if self.checkpoint_every and self.step % self.checkpoint_every == 0:
            t_begin = None  # the checkpoint writer staged its state since: not compute
        self._t_ready = time.monotonic() if computed else None
        try:
            res = self._run_step(compute, batch, recompute, pending, computed, after_exchange, loss, extra)
        finally:
            self._t_free = time.monotonic()
        if res.caught_up or res.synced:
            self._compute.clear()
        elif res.trained and self._clean and t_begin is not None and self._t_ready is not None:
            self._compute.append(self._t_ready - t_begin)
            self._compute_round = self._committed_round
        return res

    def _run_step(self, compute: Callable[[StepPlan], Any], batch: Optional[int], recompute: Optional[Callable],
                  pending: Optional[Future], computed: bool, after_exchange: Optional[Callable[[], None]],
                  loss: Any, extra: Optional[Callable[[StepPlan], Any]]) -> StepResult:
        """Run rounds until one commits a step in which this replica trained.

        `batch`: the slot batch the caller's loader delivered (None: train whatever the plan
        assigns; `compute(plan)` then reads `plan.batch_index`). If the job already trained it
        (a catch-up moved the cursor past it), return without training; if a rewind moved the
        cursor before it, return `stale=True`. `compute(plan)` runs forward and backward;
        `computed=True` says the caller already did (overlap: before `pending` resolved).
        After a catch-up or sync replaced the weights, gradients computed before are stale:
        `recompute(plan)` redoes them (default: `compute` if the caller had not computed yet, else
        raise StaleManualStep). `after_exchange()` runs
        on the averaged gradients before the optimizer step (clipping). `extra(plan)` adds the
        gradients of `plan.extra`, the absent slots' batches this replica trains under
        batch_policy "constant", to those of its own batch (forward and backward each)."""
        res = StepResult(loss=loss)
        in_grads: tuple = ()
        """The extra batches whose gradients the local gradients hold besides our own."""
        if recompute is None and not computed:  # compute() has not run: it can simply run again
            recompute = compute
        try:
            first = pending.result() if pending is not None else None
        except JobFinished as e:
            return self._ended_behind(res, e)
        if first is None and self._stash is not None:
            first, self._stash = self._stash, None
        replaced = False
        behind = False  # a catch-up round failed: we are behind the job until one commits
        while True:
            if first is None and batch is not None and self.cursor > batch and not behind:
                return res
            try:
                plan, first = (first, None) if first is not None else (self.start_step(), None)
            except JobFinished as e:
                return self._ended_behind(res, e)
            if self.multi and plan.contribute:
                plan = self._own_optimizer(plan)
            if plan.sync:
                ok = self._sync(plan)
                res.synced |= ok
                replaced |= ok
                behind = not ok
                if ok and self.phase[1]:  # the rest of our batch is not ours to train any more
                    return res
                continue
            if plan.role == "catchup":
                behind = not self.commit(self.exchange(plan))
                if not behind:
                    res.committed += 1
                    res.caught_up = replaced = True
                    if self.phase[1]:  # rule 15: the job went on without the rest of our batch
                        return res
                continue
            if batch is not None and plan.batch_index != batch:
                if plan.batch_index < batch:
                    self.disarm()
                    res.stale = True
                    return res
                raise RuntimeError(f"replica {self.rid}: the quorum assigns slot batch {plan.batch_index} but "
                                   f"the loader delivered batch {batch}")
            if computed and in_grads and in_grads != plan.extra:
                replaced = True  # they hold another round's extra batches: start over
            if computed and replaced:
                self._clean = False
                self.disarm()
                if self.multi:
                    # Several optimizers (rule 15): the rest of a batch is the job's, trained without
                    # us; a batch's first step computed on replaced weights is delivered again
                    # (`stale`: the caller re-positions its loader at our cursor) instead of a restart.
                    res.stale = not self.phase[1]
                    return res
                if recompute is None:
                    raise StaleManualStep(f"replica {self.rid} fell behind with a half-trained manual-optimization "
                                          "step; exiting so that the launcher restarts it and it catches up first")
                res.loss = recompute(plan)
                replaced, in_grads = False, ()
            elif not computed:
                res.loss = compute(plan)
                computed, replaced, in_grads = True, False, ()
                self._t_ready = time.monotonic()
            if plan.extra and in_grads != plan.extra:
                if extra is None:
                    raise RuntimeError(f"replica {self.rid}: batch_policy 'constant' assigns it absent slots' "
                                       f"batches {list(plan.extra)}, but its caller passes no run_step(extra=...) "
                                       "to train them")
                extra(plan)
                in_grads = plan.extra
            # A retry recomputes when it can; only a caller that cannot (manual optimization)
            # pays for a saved copy of its local gradients.
            vote = self.exchange(plan, save_grads=recompute is None)
            if vote == OK and self.scaler is not None:
                # before clipping and the user's hooks, as Lightning does
                self.scaler.unscale(self.stepped_optimizer(plan))
            if vote == OK and after_exchange is not None:
                after_exchange()
            if self.commit(vote):
                res.committed += 1
                res.trained = True
                return res
            self._clean = False  # a retry: this step's time is not its compute time
            if not self.restore_grads():
                replaced = True  # the gradients are gone (zeroed): recompute them on the next round

    def _ended_behind(self, res: StepResult, finished: JobFinished) -> StepResult:
        """The job finished at a later step than ours (we failed to commit its last step):
        take the final state from a replica that finished, or leave (JobFinished again)."""
        from lightning_ft.replica import ending

        if not ending.adopt_final(self, self.linger_s):
            raise finished
        res.caught_up = True
        return res

    def _own_optimizer(self, plan: StepPlan) -> StepPlan:
        """A contributor's plan with the optimizer it steps (a round no report named one for)."""
        mine = self.phase[0]
        if plan.opt < 0 and mine >= 0:
            plan = replace(plan, opt=mine)
            self.last_plan, self.buckets = plan, self._all_buckets[mine]
        if plan.opt != mine:
            raise RuntimeError(f"replica {self.rid}: round {plan.quorum.round} steps optimizer {plan.opt} but this "
                               f"replica's training_step stepped optimizer {mine}: every replica must step its "
                               "optimizers in the same order")
        return plan

    def stepped_optimizer(self, plan: Optional[StepPlan] = None) -> Any:
        """The torch optimizer a round steps (the only one, with one optimizer)."""
        if not self.multi:
            return self.optimizer
        plan = plan or self.last_plan
        return self.optimizer.optimizers[max(plan.opt if plan is not None else 0, 0)]

    # -- exchange and catch-up ------------------------------------------------------------------------
    def _send_bucket(self, view: torch.Tensor, plan: StepPlan) -> Any:
        return self.ftar.allreduce([view], divisor=float(plan.divisor))

    def exchange(self, plan: StepPlan, save_grads: bool = False) -> int:
        """Average gradients over the contributors through FTAR (lagging: zeros, and catch up
        meanwhile). Returns this rank's vote. With `save_grads`, a contributor keeps a copy of
        its local gradients for `restore_grads` (a retry without recomputation). Buckets that
        the backward hooks already sent (`begin_step`) are not sent again."""
        t0 = time.perf_counter()
        works = self.buckets.send_all(plan, save_grads)
        vote = OK
        if plan.lagging and plan.opt < 0:  # which optimizer the contributors step is not known: retry
            vote = FAILED
        elif plan.lagging:  # fetch the healthy state while our zeros are on the wire
            vote = self._fetch(plan, deadline_s=self.ftar.timeout_s)
        nbytes = self.buckets.nbytes
        start = time.monotonic()
        deadline = start + self.settings.hang_timeout_s + self.ftar.timeout_s * 4 + nbytes / 1e7
        stall_at = start + self.settings.hang_report_after_s if self._coord is not None else None
        try:
            for work in works:  # bounded by the engine's own deadlines; this guards a stuck engine
                if stall_at is not None and not work.wait_done(max(0.0, stall_at - time.monotonic())):
                    self._report_stall(plan, time.monotonic() - start)
                    stall_at = None
                work.wait(max(0.1, deadline - time.monotonic()))
        except FatalError:
            raise
        except FTARError as e:
            log.warning("replica %d rank %d: exchange of step %d failed: %s", self.rid, self.rank, plan.step, e)
            # An exchange on a ring that failed to connect fails at once without a peer: keep
            # the blame of the connect, which named the neighbour that did not answer.
            self._ring_ok, self._blame = False, self._blamed(plan.quorum, e) or self._blame
            vote = min(vote, FAILED)
        if vote == OK:
            self.buckets.write_grads()
        self.stats.exchange_s = time.perf_counter() - t0
        return vote

    def _report_stall(self, plan: StepPlan, waited_s: float) -> None:
        """Leader: the exchange has waited hang.report_after_s; say where (coord/hang.py): our
        ring neighbours and the FTAR link counters, in etcd and the log."""
        q = plan.quorum
        if self.rid not in q.members:
            return
        lj, rj = neighbours(len(q.members), q.index(self.rid))
        links = self.ftar.links.snapshot()
        stall = {"round": q.round, "epoch": q.epoch, "step": plan.step, "rank": self.rank,
                 "waited_s": round(waited_s, 3), "left": q.members[lj], "right": q.members[rj], "links": links}
        log.warning("replica %d: exchange of step %d waiting %.1fs: from r%d %d bytes outstanding, to r%d %d",
                    self.rid, plan.step, waited_s, stall["left"], links["rx_outstanding"], stall["right"],
                    links["tx_outstanding"])
        self.coord.report_stall(stall)

    def restore_grads(self) -> bool:
        """After a failed commit: put back this rank's local gradients as they were before the
        exchange, so the step is retried without recomputing them."""
        return self.buckets.restore()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return state_tensors(self._named_params, self.model, self.optimizer)

    def _meta(self) -> dict:
        return {
            "step": self.step,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "batches": self.batches,
            "callbacks": self.callbacks.state_dict() if self.callbacks is not None else None,
        }

    def _publish_snapshot(self, q: Quorum) -> None:
        expected = set()
        for lag in q.lagging:
            if q.contributors[(lag + self.rank) % len(q.contributors)] == self.rid:
                expected.add(f"{lag}/{self.rank}")
        self.server.publish(self.step, self.state_tensors(), self._meta(), expected)

    def _fetch(self, plan: StepPlan, deadline_s: float) -> int:
        """Fetch the state of version plan.step from our source into our tensors: OK, FAILED
        (nothing written: retry next round) or LOST (partly overwritten)."""
        q = plan.quorum
        src = q.contributors[(self.rid + self.rank) % len(q.contributors)]
        got_round, addr = self._src_state
        if got_round != q.round or not addr:
            log.warning("replica %d rank %d: no state-server address of replica %d for round %d (it is gone)",
                        self.rid, self.rank, src, q.round)
            return FAILED
        vote = self.fetch_from(addr, plan.step, src, deadline_s)
        if vote == OK:
            st = self.stats
            log.info("replica %d rank %d %s step %d from replica %d: %.1f MB in %.3fs (%.2f GB/s)", self.rid,
                     self.rank, "adopted" if plan.sync else "caught up to", plan.step, src, st.catchup_mb,
                     st.catchup_s, st.catchup_gbps)
        return vote

    def fetch_from(self, addr: str, step: int, src: int, deadline_s: float) -> int:
        """Fetch version `step` of replica `src`'s state (this rank's shard, from `addr`) into our
        tensors and apply its meta: OK, FAILED (nothing written) or LOST (partly overwritten)."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + deadline_s
        materialize_optimizer_state(self.optimizer)
        into = self.state_tensors()
        while True:
            try:
                with torch.no_grad():
                    meta, stats = fetch_state(addr, step, into, self.secret.encode(), f"{self.rid}/{self.rank}",
                                              timeout_s=max(10.0, self.ftar.timeout_s * 2),
                                              param_groups=self.optimizer.param_groups)
                break
            except CatchupError as e:
                # The source publishes right after it gets the same quorum (or, in a rewind, after
                # it loaded the checkpoint); we may be early.
                if e.not_yet_published(step) and time.monotonic() < deadline:
                    time.sleep(0.002)
                    continue
                log.warning("replica %d rank %d: catch-up from replica %d failed: %s", self.rid, self.rank, src, e)
                return LOST if e.partial else FAILED
        # verified (catchup_wire.check_meta): as many groups as ours, known keys only
        for g, saved in zip(self.optimizer.param_groups, meta["param_groups"], strict=True):
            g.update(saved)
        if self.scheduler is not None and meta.get("scheduler") is not None:
            self.scheduler.load_state_dict(meta["scheduler"])
        if self.scaler is not None and meta.get("scaler") is not None:
            self.scaler.load_state_dict(meta["scaler"])
        self.batches = int(meta.get("batches", step))
        if self.callbacks is not None and meta.get("callbacks"):
            self.callbacks.load_state_dict(meta["callbacks"])
        self.stats.catchup_s = time.perf_counter() - t0
        startup.mark("caught_up")
        self.stats.catchup_gbps = stats.get("gbps", 0.0)
        self.stats.catchup_mb = stats.get("bytes", 0) / 1e6
        return OK

    # -- sync rounds: the job's start, resumes and rewinds ------------------------------------------------
    def _sync(self, plan: StepPlan) -> bool:
        """A sync round: the source (loading the rewind's checkpoint first, if any) publishes
        its state, every other member adopts it. Returns whether the round succeeded here."""
        q = plan.quorum
        t0 = time.perf_counter()
        self.disarm()
        vote, cursors = OK, None
        if plan.role == "source":
            rw = q.rewind or {}
            if rw.get("checkpoint"):
                at = int(cast(int, rw["checkpoint_step"]))
                vote, cursors = self._load_rewind_checkpoint(str(rw["checkpoint"]), at)
            if vote == OK and rw and self.is_leader:
                self._start_generation(q, cursors)
            if vote == OK:
                self.step = q.max_step
                materialize_optimizer_state(self.optimizer)  # a fresh source has no optimizer state yet
                self._publish_snapshot(q)
        else:
            vote = self._fetch(plan, deadline_s=self.settings.sync_timeout_s)
        vote = self.group.vote(vote)
        if vote == LOST:
            raise ReplicaStateLost(f"replica {self.rid}: adopting replica {q.source}'s state failed midway; the "
                                   "state is partly overwritten, so this replica exits to restart fresh")
        if vote != OK:
            return False
        self.step, self.gen, self.synced = q.max_step, q.gen, True
        self._disowned, self._made = False, (q.round, q.epoch)
        if q.rewind is not None:
            cur = ledger.read_cursor(self.store, self.root, self.rid, q.gen) if self.is_leader else 0
            self.cursor = self.group.broadcast(cur)
        self._take_digest()
        seconds = time.perf_counter() - t0
        if plan.role == "adopt" and self.is_leader:
            st = self.stats
            print(f"lightning-ft: replica {self.rid} adopted replica {q.source}'s state at step {q.max_step}"
                  f"{' (rewind)' if q.rewind else ''}: {st.catchup_mb:.1f} MB per rank in {seconds:.3f} s "
                  f"({st.catchup_gbps:.2f} GB/s)", flush=True)
            self.event("sync", replica=self.rid, source=q.source, step=q.max_step, gen=q.gen,
                       rewind=q.rewind is not None, seconds=round(seconds, 4), mb=round(st.catchup_mb, 3))
        if self.on_state_replaced is not None:
            self.on_state_replaced(plan)
        return True

    def _load_rewind_checkpoint(self, path: str, step: int) -> tuple[int, Optional[dict]]:
        """Load the rewind's checkpoint (every rank its shard); (vote, cursors of its meta)."""
        from lightning_ft.replica.checkpoint import CheckpointInvalid, verify

        why = ""
        if self.is_leader:
            try:
                verify(path)
            except CheckpointInvalid as e:
                why = str(e)
        why = self.group.broadcast(why)  # every rank loads, or none does (the load is a collective)
        if why:
            log.error("replica %d: the rewind's checkpoint does not verify: %s", self.rid, why)
            self._bad_ckpts.add(step)
            return FAILED, None
        try:
            self.load_checkpoint(path)
            meta = json.load(open(os.path.join(path, "meta.json")))
            return OK, {int(s): int(k) for s, k in meta.get("cursors", {}).items()}
        except (CheckpointInvalid, OSError, RuntimeError, ValueError, KeyError) as e:
            log.error("replica %d: cannot load the rewind's checkpoint %s: %s", self.rid, path, e)
            self._bad_ckpts.add(step)
            return FAILED, None

    def load_checkpoint(self, path: str) -> dict:
        """Load a persistent checkpoint into this rank's model, optimizer and scheduler;
        returns its meta. Used by `--resume` (before `start`) and by rewinds."""
        from lightning_ft.replica.checkpoint import load

        materialize_optimizer_state(self.optimizer)
        got = load(path, self.model, unwrap(self.optimizer), pg=None if self.world == 1 else self.pg)
        extra = got["extra"]
        for g, saved in zip(self.optimizer.param_groups, extra["param_groups"], strict=True):
            g.update(saved)
        if self.scheduler is not None and extra.get("schedulers") is not None:
            self.scheduler.load_state_dict(extra["schedulers"])
        if self.scaler is not None and extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])
        self.step = int(got["meta"]["step"])
        self.batches = int(got["meta"].get("batches", self.step))
        return got["meta"]

    def _start_generation(self, q: Quorum, cursors: Optional[dict[int, int]]) -> None:
        """Leader of a rewind's source: seed the new generation's cursors (the checkpoint's, or
        the ledger's at the step we hold) and retire the checkpoints of the discarded future."""
        from lightning_ft.replica.checkpoint import supersede

        T = q.max_step
        if cursors is None:
            cursors = ledger.cursors_at(self.store, self.root, T, range(self.R))
        rw = q.rewind
        assert rw is not None  # a rewind's round
        ledger.seed_generation(self.store, self.root, q.gen, T, cursors, **{
            "from": rw["from"], "checkpoint": rw["checkpoint"], "source": self.rid, "round": q.round})
        if self.checkpoint_root:
            supersede(self.store, self.root, self.checkpoint_root, T, q.gen)
        self.cursor = cursors.get(self.rid, 0)
        print(f"lightning-ft: replica {self.rid}: rewind from step {rw['from']} to {T} (generation {q.gen}"
              f"{', checkpoint ' + str(rw['checkpoint']) if rw['checkpoint'] else ''})", flush=True)

    # -- two-phase commit and the LR factor ------------------------------------------------------------
    def commit(self, vote: int | bool) -> bool:
        """All ranks of the replica apply the optimizer step, or none does."""
        plan = self.last_plan
        if plan is None:
            raise RuntimeError("ReplicaManager.commit: no round was planned (prepare or begin_step first)")
        result = self.group.vote(int(vote))
        if result == LOST:
            raise ReplicaStateLost(f"replica {self.rid}: a catch-up failed midway; the state is partly overwritten, "
                                   "so this replica exits to restart fresh")
        opt = self.stepped_optimizer(plan)
        if result != OK:
            if self.scaler is not None:
                self.scaler.reset()
            opt.zero_grad(set_to_none=True)
            self._cursor_stale = True
            self.stats.retries += 1
            self._ring_ok = False  # peers may be mid-collective: rebuild the ring next round
            if self.on_retry is not None:
                self.on_retry(plan)
            return False
        if plan.role == "catchup" and self.scaler is not None:
            self.scaler.unscale(opt)  # the contributors unscaled these averaged gradients too
        if plan.role == "catchup" and self.clip_catchup is not None:
            self.clip_catchup()  # the contributors clipped these averaged gradients too
        self.stats.freeze_s = self.server.freeze()
        # fp16: an inf/NaN in the averaged gradients skips the step on every rank of every replica
        skip = self.scaler.overflowed(self.group.any) if self.scaler is not None else False
        if not skip:
            saved = [g["lr"] for g in opt.param_groups]
            for g in opt.param_groups:
                g["lr"] = g["lr"] * plan.lr_factor
            try:
                opt.step()
            finally:
                for g, lr in zip(opt.param_groups, saved, strict=True):
                    g["lr"] = lr
        if self.scaler is not None:
            self.scaler.update(skip)
        opt.zero_grad(set_to_none=True)
        q = plan.quorum
        self.step, self.gen, self.synced = plan.step + 1, q.gen, True
        self.batches += 0 if plan.cont else 1
        self._made = (q.round, q.epoch)
        if plan.role != "train":  # a catch-up's state is the contributors' (a disowned one never trains)
            self._disowned = False
        mine = (plan.batches or {}).get(self.rid)
        if mine is not None:  # we trained it, or (constant policy, catching up) someone did for us
            self.cursor = max(self.cursor, mine + 1)
        self._committed_round = q.round
        if self.is_leader:
            # Written before this replica reports for a later (full) round, from the quorum
            # thread when overlapped: off the step's critical path.
            with self._ledger_lock:
                self._unrecorded.append((plan.step, q.epoch, q.round, q.gen, dict(plan.batches)))
        self._take_digest()
        if self.incarnation > 0 and self.restart_breakdown is None:
            startup.mark("first_step")
            self.restart_breakdown = startup.restart_breakdown()
            if self.is_leader:
                self.event("restart_breakdown", **self.restart_breakdown)
        if self.on_commit is not None:
            self.on_commit(plan)
        if plan.role == "catchup" and self.on_state_replaced is not None:
            self.on_state_replaced(plan)
        return True

    def flush_ledger(self) -> bool:
        """Record the unrecorded commits in the ledger and advance the cursors (leader;
        idempotent). The write is fenced: an evicted incarnation, or one whose lease lapsed,
        records nothing. Returns whether the ledger knows every step this replica committed
        (False once a write was refused, until a catch-up or sync replaces the state)."""
        with self._ledger_lock:
            recs, self._unrecorded = self._unrecorded, []
        if recs and self.is_leader:
            if not ledger.record_commits(self.store, self.root, self.rid, recs, fence=self.coord.fence()):
                # The 100-fault soak: a replica whose lease lapsed while its last ring completed (the
                # others' failed) kept its step S+1, re-registered and reported it next to theirs,
                # which they had redone without it: same step, other state. Majorities healed it;
                # with two replicas left the divergence guard halted the job.
                self._disowned = True
                log.warning("replica %d: the ledger refused our records of steps %d..%d (evicted or our lease "
                            "lapsed): the others may have redone them without us, so this replica adopts a "
                            "member's state before it trains again", self.rid, recs[0][0], recs[-1][0])
                self.event("disowned", steps=[recs[0][0], recs[-1][0]])
        return not self._disowned

    # -- the divergence guard ------------------------------------------------------------------------
    def digest_due(self, step: int) -> bool:
        """Every replica digests at the same steps: every `digest_every`, and at checkpoints."""
        return step > 0 and bool((self.digest_every and step % self.digest_every == 0)
                                 or (self.checkpoint_every and step % self.checkpoint_every == 0))

    def _take_digest(self) -> None:
        if not self.digest_due(self.step):
            self._digest = None
            return
        t0 = time.perf_counter()
        named = {**self.state_tensors(), **hyperparameters(self.optimizer),  # the learning rate too
                 **(self.scaler.digest_tensors() if self.scaler is not None else {})}  # and the loss scale
        self._digest = (self.step, fast_digest(sorted(named.items())))
        self.stats.digest_s = time.perf_counter() - t0

    def _replica_digest(self) -> Optional[tuple[int, str]]:
        """(version, replica digest) to report now (every rank takes part), or None."""
        mine, self._digest = self._digest, None
        if self.world > 1:
            if not self.digest_due(self.step):  # the same answer on every rank: no collective
                return None
            got = self.group.gather(mine)
            if any(g is None or g[0] != got[0][0] for g in got):
                return None
            return got[0][0], combine(d for _, d in got)
        return None if mine is None else (mine[0], combine([mine[1]]))

    # -- queries ------------------------------------------------------------------------------------
    def behind(self) -> bool:
        """Whether the job has already trained past this replica's step, so that its next round
        will be a catch-up round (a restarted or late replica). Same answer on every rank."""
        ahead = False
        if self.is_leader:
            q = self.coord.latest_quorum()
            ahead = q is not None and (q.max_step > self.step or q.gen != self.gen)
        return bool(self.group.broadcast(ahead))

    @property
    def linger_s(self) -> float:
        """How long a finisher serves its final state to a member behind it (replica/ending.py)."""
        return max(10.0, 3 * self.ftar.timeout_s)

    def mark_finished(self) -> None:
        """This replica trained to the end (every rank): record that the job trained to
        completion, so that a replica restarted afterwards finds nothing left to do instead of
        training alone, and serve the final state to a member behind it (replica/ending.py)."""
        from lightning_ft.replica import ending

        ending.finish(self, self.linger_s)

    def finished_step(self) -> Optional[int]:
        """The step at which the job finished, or None while it runs. Same answer on every rank."""
        from lightning_ft.replica.ending import read_finished

        step = None
        if self.is_leader:
            rec = read_finished(self.store, self.root)
            step = rec["step"] if rec else None
        return self.group.broadcast(step)

    def on_halt(self) -> None:
        """The job halted (diverged states): keep only checkpoints whose digests agreed."""
        from lightning_ft.replica.checkpoint import invalidate_after

        plan = self.last_plan
        if self.is_leader and self.checkpoint_root and plan is not None:
            gone = invalidate_after(self.checkpoint_root, plan.quorum.verified_step)
            if gone:
                print(f"lightning-ft: replica {self.rid}: checkpoints {gone} may hold diverged state; their "
                      f"manifests were renamed manifest.json.suspect", flush=True)

    # -- shutdown -----------------------------------------------------------------------------------
    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._bg is not None:
            self._bg.shutdown(wait=True)
        if self.is_leader and self._store is not None:
            try:
                self.flush_ledger()
            except Exception as e:  # etcd gone: the other committers of that step recorded it too
                log.warning("replica %d: could not record the last commit: %s", self.rid, e)
        if self._coord is not None:
            self._coord.close(revoke=True)
        if self._ftar is not None:
            self._ftar.close()
        if self._server is not None:
            self._server.close()
        if self._store is not None and self._etcd:
            self._store.close()


def _with_host(addr: str, host: Optional[str]) -> str:
    """`addr` (host:port of a listener) with the advertised host in place of its bind host."""
    if not host:
        return addr
    _, _, port = addr.rpartition(":")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
