"""The replica layer's base (docs/ARCHITECTURE.md, "The replica layer"): who this rank is, its
parts (etcd store and coordinator on the leader, FTAR, the catch-up transport, the exchange buffers),
opening them (`start`: a spare waits for its promotion, the leader registers), the event log,
forwarding an eviction's abort to our ranks, and the queries every layer above asks.

The layers, each a class over the one below, each calling only down:
base (this) -> history.py (ledger, digests) -> sync.py (state transfer: catch-up fetch, sync,
rewind) -> rounds.py (a round's quorum and ring) -> manager.py (the step: exchange, commit)."""
from __future__ import annotations

import collections
from dataclasses import replace
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, TypeVar

import torch

from lightning_ft.coord import keys
from lightning_ft.coord.coordinator import Coordinator, MembershipSettings
from lightning_ft.coord.quorum import JobSpec
from lightning_ft.coord.runs import RunHold, open_run
from lightning_ft.coord.store import Store, store_from_config
from lightning_ft.ftar.engine import FTAR, FTARSettings
from lightning_ft.replica import ledger
from lightning_ft.replica.buckets import GradBuckets
from lightning_ft.replica.group import ReplicaGroup
from lightning_ft.replica.plan import StepPlan, StepStats
from lightning_ft.replica.replica_state import ReplicaState
from lightning_ft.replica.settings import Identity, Settings
from lightning_ft.replica import startup
from lightning_ft.replica.catchup.http import HTTPTransport
from lightning_ft.replica.catchup.transport import CatchupTransport, TransportFactory
from lightning_ft.replica.optimizers import Optimizers
from lightning_ft.replica.state import (materialize_optimizer_state,
                                        opt_params, param_layout, state_tensors)
from lightning_ft.secret import tag as secret_tag

log = logging.getLogger(__name__)
_T = TypeVar("_T")


def _opened(part: Optional[_T], what: str) -> _T:
    """A part `ReplicaManager.start` opens, or a clear error where it is read before then (or on
    a rank that has none)."""
    if part is None:
        raise RuntimeError(f"ReplicaManager.{what} is not open: start() opens it (the store and "
                           f"the coordinator on the replica's leader rank only)")
    return part


class ReplicaBase:
    """One per rank: identity, state and parts (the leader also owns the Coordinator)."""

    def __init__(self, model: torch.nn.Module, optimizer: Any, who: Identity, settings: Optional[Settings] = None, *,
                 group: Optional[ReplicaGroup] = None, scheduler: Any = None, store: Optional[Store] = None,
                 run_dir: str = "", catchup_transport: TransportFactory = HTTPTransport) -> None:
        """`who`: the replica; `settings`: the protocol's knobs (replica/settings.py); `group`: this
        replica's ranks (default: one rank); `store`: an open etcd client for the leader (default:
        `start` opens one at `who.etcd`); `catchup_transport`: builds this rank's catch-up transport
        in `start` (replica/catchup_transport.py; tests: `InMemoryTransport`)."""
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
        self.micro_batches = 0
        """Micro-batches of this replica's slot batch, when its caller can train any subset of them
        and micro-batches of other slots (`run_step(extra=...)`, `StepPlan.micro`/`skip`); 0: it
        cannot, and is never shrunk (stragglers policy "shrink": it is excluded instead)."""
        self.share: Optional[tuple[int, int]] = None
        """(micro-batches of its own slot batch computed before the exchange, of `micro_batches`):
        the caller sets it for the step in progress, and the straggler measure counts the step's
        compute time per whole slot batch (a shrunk straggler must not look healthy)."""
        self._t_free: Optional[float] = None
        """When the previous `run_step` / `prepare` returned: where the next step's compute starts."""
        self._t_ready: Optional[float] = None
        self._clean = True
        self._ftar_settings = FTARSettings(chunk_bytes=st.chunk_bytes, num_chunks=st.num_chunks,
                                           timeout_s=st.ftar_timeout_s, connect_timeout_s=st.ftar_connect_timeout_s,
                                           bind_host=st.bind_host, start_timeout_s=st.hang_timeout_s,
                                           transport=st.transport)
        self.digest_every, self.checkpoint_every = max(0, st.digest_every), max(0, st.checkpoint_every)
        self.checkpoint_root, self.run_dir = st.checkpoint_root, run_dir
        self.state = ReplicaState()
        """Where this replica's state stands in the job's history (replica/replica_state.py),
        replaced whole at each transition; `step`, `gen`, `synced`, `cursor` and `batches` read it."""
        self._coord: Optional[Coordinator] = None
        self._ftar: Optional[FTAR] = None
        self._catchup_transport = catchup_transport
        self._catchup: Optional[CatchupTransport] = None
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

    # -- the state's standing, read from `state` (one value; replica/replica_state.py) ------------
    @property
    def step(self) -> int:
        """Committed steps of this replica (its state is at the end of step `step - 1`)."""
        return self.state.step

    @step.setter
    def step(self, step: int) -> None:
        self.state = replace(self.state, step=step)

    @property
    def gen(self) -> int:
        return self.state.gen

    @gen.setter
    def gen(self, gen: int) -> None:
        self.state = replace(self.state, gen=gen)

    @property
    def synced(self) -> bool:
        return self.state.synced

    @property
    def cursor(self) -> int:
        return self.state.cursor

    @cursor.setter
    def cursor(self, cursor: int) -> None:
        self.state = replace(self.state, cursor=cursor)

    @property
    def batches(self) -> int:
        """Batches the job's history committed (one per batch-start round): `step` counts optimizer
        steps; with one optimizer both are equal."""
        return self.state.batches

    @batches.setter
    def batches(self, batches: int) -> None:
        self.state = replace(self.state, batches=batches)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

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
    def catchup(self) -> CatchupTransport:
        """This rank's catch-up transport: the server of its state and the client of the others'."""
        return _opened(self._catchup, "catchup (the catch-up transport)")

    @catchup.setter
    def catchup(self, transport: CatchupTransport) -> None:
        self._catchup = transport

    @property
    def buckets(self) -> GradBuckets:
        """The exchange buffer of the optimizer this round steps."""
        return _opened(self._buckets, "buckets")

    @buckets.setter
    def buckets(self, buckets: GradBuckets) -> None:
        self._buckets = buckets

    @property
    def started(self) -> bool:
        """`start` opened FTAR, the catch-up transport and the exchange buffers."""
        return self._ftar is not None and self._catchup is not None and self._buckets is not None

    # -- setup -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Open FTAR and the catch-up transport; the leader registers with etcd. Do slow init first."""
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
        self._ftar = FTAR(self.job, self.rid, self.rank, self.secret, self._ftar_settings)
        self._catchup = self._catchup_transport(self.secret.encode(), st.bind_host, f"r{self.rid}/rank{self.rank}")
        mine = (_with_host(self.ftar.address, host), _with_host(self.catchup.address, host))
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
        from lightning_ft.coord.standby import Waiter, WaiterSettings

        waiter = None
        if self.is_leader:
            waiter = Waiter(self.store, self.job, secret_tag(self.secret, self.job), self.spec.fingerprint,
                            self.standby, WaiterSettings(prefix=self.prefix, ttl_s=self.settings.lease_ttl_s),
                            host=host, world=self.world, run_id=self.run_id)
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
            self.coord = Coordinator(self.store, self.job, self.rid, self.incarnation, self.spec,
                                     MembershipSettings(prefix=self.prefix, lease_ttl_s=self.settings.lease_ttl_s,
                                                        hang_timeout_s=self.settings.hang_timeout_s,
                                                        poll_interval_s=self.settings.poll_interval_s),
                                     run=self.run_id, on_failure=self._on_failure, on_event=self.event)
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

    def disarm(self) -> None:
        """Drop the armed gradient hooks (the coming backward's gradients are not sent)."""
        for b in self._all_buckets:
            b.disarm()

    # -- events and aborts -----------------------------------------------------------------------
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

    def _send_bucket(self, view: torch.Tensor, plan: StepPlan) -> Any:
        return self.ftar.allreduce([view], divisor=float(plan.divisor))

    # -- the state -------------------------------------------------------------------------------
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

    def stepped_optimizer(self, plan: Optional[StepPlan] = None) -> Any:
        """The torch optimizer a round steps (the only one, with one optimizer)."""
        if not self.multi:
            return self.optimizer
        plan = plan or self.last_plan
        return self.optimizer.optimizers[max(plan.opt if plan is not None else 0, 0)]

    # -- queries ---------------------------------------------------------------------------------
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


def _with_host(addr: str, host: Optional[str]) -> str:
    """`addr` (host:port of a listener) with the advertised host in place of its bind host."""
    if not host:
        return addr
    _, _, port = addr.rpartition(":")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
