"""The per-step protocol of one replica rank, framework-free (DESIGN §5, §6).

    mgr = ReplicaManager(model, optimizer, ...)      # after the slow init (model, data)
    mgr.start()                                      # FTAR + state server; the leader registers
    while mgr.step < max_steps:
        plan = mgr.start_step()                      # quorum, ring, snapshot or catch-up role
        if plan.contribute:
            loss = model(batch(plan.batch_index)).backward()
        if mgr.commit(mgr.exchange(plan)):           # FTAR exchange, then 2PC inside the replica
            ...                                      # committed: step advanced
        # else: retried next round with a new quorum

Roles per round. Contributors train and send their gradients; lagging replicas skip forward
and backward, send zeros, fetch the healthy state (version = committed steps) from
`contributors[(rid + rank) % len]` while their zeros are on the wire, and apply the same
optimizer step, so they end the step identical to everyone. The divisor is the number of
contributors. Healthy ranks publish live references to their state when someone lags and
freeze (copy) only what has not been fetched by the time their optimizer steps.

Two-phase commit: each rank votes (exchange ok, catch-up ok); an all-reduce MIN over the
replica's own process group decides. All apply the step, or none does and the step is
retried. Only the leader (local rank 0) talks to etcd; it broadcasts the quorum to its ranks.
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_ft.coord.coordinator import Coordinator
from lightning_ft.coord.quorum import JobSpec, Quorum
from lightning_ft.coord.store import EtcdStore, Store
from lightning_ft.ftar.engine import FTAR
from lightning_ft.ftar.transport.base import FTARError, FatalError
from lightning_ft.replica import data as ledger
from lightning_ft.replica.catchup import CatchupError, StateServer, fetch_state

log = logging.getLogger(__name__)

LR_MODES = ("none", "linear", "sqrt")


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


@dataclass(frozen=True)
class StepPlan:
    step: int
    """The step this round trains (committed steps of the healthy replicas)."""
    quorum: Quorum
    lagging: bool
    divisor: int
    lr_factor: float
    batch_index: int
    """The batch of this replica's slot to train (contributors only)."""

    @property
    def contribute(self) -> bool:
        return not self.lagging


@dataclass
class StepStats:
    quorum_s: float = 0.0
    reconfigure_s: float = 0.0
    exchange_s: float = 0.0
    catchup_s: float = 0.0
    catchup_gbps: float = 0.0
    catchup_mb: float = 0.0
    freeze_s: float = 0.0
    retries: int = 0


@dataclass
class _Round:
    """Bucket bookkeeping of one exchange (see `ReplicaManager.begin_step`)."""

    save: bool
    buckets: int
    plan: Optional[StepPlan] = None
    submitted: int = 0
    works: list = field(default_factory=list)
    filled: set = field(default_factory=set)
    count: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.count = [0] * self.buckets


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class ReplicaManager:
    """One per rank. The leader (rank 0 of the replica) also owns the Coordinator."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, job: str, rid: int,
                 incarnation: int, num_replicas: int, secret: str, etcd: str = "", store: Optional[Store] = None,
                 rank: int = 0, world: int = 1, pg: Any = None, min_replicas: int = 1, prefix: str = "/lft",
                 lease_ttl_s: float = 3.0, hang_timeout_s: float = 30.0, init_timeout_s: float = 10.0,
                 lr_intervention: str = "sqrt", chunk_bytes: int = 4 << 20, num_chunks: int = 4,
                 ftar_timeout_s: float = 5.0, quorum_timeout_s: Optional[float] = None,
                 bind_host: str = "127.0.0.1", transport: str = "tcp",
                 fingerprint: Optional[dict] = None, scheduler: Any = None) -> None:
        if lr_intervention not in LR_MODES:
            raise ValueError(f"lr_intervention {lr_intervention!r} is not one of {LR_MODES}")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        # Captured now, while FSDP2's parameters are the sharded DTensors: during forward and
        # backward it swaps unsharded tensors into the module, and the quorum (which publishes
        # snapshots for catch-up) runs concurrently with those (`begin_step`).
        self._named_params = list(model.named_parameters())
        self.job, self.rid, self.incarnation = job, rid, incarnation
        self.R, self.rank, self.world, self.pg = num_replicas, rank, world, pg
        self.secret = secret
        self._etcd, self._store = etcd, store
        self.prefix = prefix
        self.root = f"{prefix.rstrip('/')}/{job}/"
        self.lr_mode = lr_intervention
        self.quorum_timeout_s = quorum_timeout_s
        self.spec = JobSpec(num_replicas, min_replicas, init_timeout_s,
                            fingerprint or {"job": job, "replicas": num_replicas, "nproc_per_replica": world})
        self._coord_kw = dict(lease_ttl_s=lease_ttl_s, hang_timeout_s=hang_timeout_s)
        self.hang_timeout_s = hang_timeout_s
        self._ftar_kw = dict(chunk_bytes=chunk_bytes, num_chunks=num_chunks, timeout_s=ftar_timeout_s,
                             connect_timeout_s=max(2.0, ftar_timeout_s), bind_host=bind_host,
                             start_timeout_s=hang_timeout_s, transport=transport)
        self.step = 0
        """Committed steps of this replica (its state is at the end of step `step - 1`)."""
        self.cursor = 0
        self.coord: Optional[Coordinator] = None
        self.ftar: Optional[FTAR] = None
        self.server: Optional[StateServer] = None
        self._epoch = -1
        self._rank_addrs: list[str] = []
        self._ring_ok = True
        self._dirty = False
        """A catch-up wrote into our state and did not commit: never contribute from it."""
        self._flat: Optional[torch.Tensor] = None
        self._saved: Optional[torch.Tensor] = None
        self._saved_ok = False
        self._cursor_stale = False
        self._unrecorded: Optional[tuple] = None
        self._lock = threading.Lock()
        self._buckets: list[tuple[int, int]] = []
        self._bucket_need: list[int] = []
        self._offsets: list[tuple[int, int]] = []
        self._bucket_of: dict[int, int] = {}
        self._index: dict[int, int] = {}
        self._armed = False
        self._round: Optional[_Round] = None
        self._pool: Any = None
        self._exchange_ok = False
        self.stats = StepStats()
        self.last_plan: Optional[StepPlan] = None
        self.on_commit: Optional[Callable[[StepPlan], None]] = None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # -- setup ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Open FTAR and the state server; the leader registers with etcd. Do slow init first."""
        if self.incarnation > 0:
            # A restarted replica will almost surely catch up: build its optimizer state now,
            # in the slow init, not on the catch-up's critical path.
            self._materialize_optimizer_state()
        self.ftar = FTAR(self.job, self.rid, self.rank, self.secret, **self._ftar_kw)
        self.server = StateServer(self.secret.encode(), name=f"r{self.rid}/rank{self.rank}")
        addrs = self._gather((self.ftar.address, self.server.address))
        self._rank_addrs = [a for a, _ in addrs]
        if self.is_leader:
            if self._store is None:
                self._store = EtcdStore(self._etcd)
            self.coord = Coordinator(self._store, self.job, self.rid, self.incarnation, self.spec, prefix=self.prefix,
                                     on_failure=self._on_failure, **self._coord_kw)
            self.cursor = ledger.read_cursor(self._store, self.root, self.rid)
            self.coord.register(self.step, addrs=[a for a, _ in addrs], state_addrs=[s for _, s in addrs])
        self.cursor = self._broadcast(self.cursor)

    def _on_failure(self, rid: int, reason: str) -> None:
        """Eviction or lease expiry of a current member (leader's watch thread): interrupt the
        exchange at once on this rank and, through their FTAR listeners, on our other ranks."""
        why = f"replica {rid} {reason}"
        epoch = self._epoch
        if self.ftar is not None:
            self.ftar.abort(why)
        for addr in self._rank_addrs[1:]:
            threading.Thread(target=self._abort_rank, args=(addr, why, epoch), daemon=True).start()

    def _abort_rank(self, addr: str, why: str, epoch: int) -> None:
        try:
            self.ftar.abort_peer(addr, why, epoch)
        except Exception as e:  # the rank may be gone already; its own errors will surface
            log.warning("replica %d: could not forward abort to %s: %s", self.rid, addr, e)

    def _gather(self, obj: Any) -> list:
        if self.pg is None and self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def _broadcast(self, obj: Any) -> Any:
        if self.pg is None and self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    # -- step 1: quorum ----------------------------------------------------------------------------
    def start_step(self) -> StepPlan:
        t0 = time.perf_counter()
        msg: Any = None
        if self.is_leader:
            try:
                self.coord.heartbeat()
                self.flush_ledger()  # the previous step's record precedes our report for this one
                if self._cursor_stale:  # a failed commit: others may have committed our batch
                    self.cursor = max(self.cursor, ledger.read_cursor(self._store, self.root, self.rid))
                    self._cursor_stale = False
                ring_ok = self._ring_ok and not self.ftar.broken
                q = self.coord.quorum(self.step, timeout_s=self.quorum_timeout_s, cursor=self.cursor,
                                      ring_ok=ring_ok)
                if self.rid in q.lagging:
                    # Read after the decision: the contributors recorded the previous step
                    # (possibly with our batch, if we failed to commit it) before reporting.
                    self.cursor = ledger.read_cursor(self._store, self.root, self.rid)
                msg = (q, self.cursor)
            except Exception as e:  # Evicted, QuorumTimeout, StoreError: every rank must exit
                msg = e
        msg = self._broadcast(msg)
        if isinstance(msg, Exception):
            raise msg
        q, self.cursor = msg
        self.stats = StepStats(quorum_s=time.perf_counter() - t0, retries=self.stats.retries)
        lagging = self.rid in q.lagging
        if self._dirty and not lagging:
            raise RuntimeError(
                f"replica {self.rid}: a failed catch-up left this replica's state partly overwritten and no "
                "healthy replica is ahead of it to catch up from; restart the job from a checkpoint")
        if q.epoch != self._epoch:  # a failed exchange (ring_ok=False) always bumps the epoch
            ring = [q.addrs[i][self.rank] for i in range(len(q.members))]
            try:
                self.stats.reconfigure_s = self.ftar.reconfigure(q.epoch, ring, q.index(self.rid))
                self._epoch = q.epoch
                self._ring_ok = True
            except FatalError:
                raise
            except FTARError as e:  # a neighbour died while connecting: this round fails, the next rebuilds
                log.warning("replica %d rank %d: connecting the ring of epoch %d failed: %s", self.rid,
                            self.rank, q.epoch, e)
                self._ring_ok = False
        if not lagging and q.lagging:
            self._publish_snapshot(q)
        plan = StepPlan(step=q.max_step, quorum=q, lagging=lagging, divisor=len(q.contributors),
                        lr_factor=lr_factor(self.lr_mode, len(q.contributors), self.R),
                        batch_index=self.cursor)
        self.last_plan = plan
        return plan

    # -- step 2-3: exchange (and catch-up) ------------------------------------------------------------
    def _params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _flat_buffer(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise FatalError(f"replica {self.rid}: parameters of mixed dtypes {sorted(map(str, dtypes))}; "
                             "FTAR exchanges one flat bucket per step, so use one parameter dtype")
        numel = sum(_local(p).numel() for p in params)
        if self._flat is None or self._flat.numel() != numel:
            self._flat = torch.zeros(numel, dtype=params[0].dtype)
            self._offsets, off = [], 0
            for p in params:
                n = _local(p).numel()
                self._offsets.append((off, off + n))
                off += n
            if not self._buckets:  # no overlap: one bucket, sent by exchange()
                self._buckets, self._bucket_need = [(0, numel)], [len(params)]
        return self._flat

    def behind(self) -> bool:
        """Whether the job has already trained past this replica's step, so that its next round
        will be a catch-up round (a restarted or late replica). Same answer on every rank."""
        ahead = False
        if self.is_leader:
            q = self.coord.latest_quorum()
            ahead = q is not None and q.max_step > self.step
        return bool(self._broadcast(ahead))

    def mark_finished(self) -> None:
        """Record that the job trained to completion (at this replica's step); a replica that
        restarts afterwards finds nothing left to do instead of training alone."""
        if self.is_leader:
            self.flush_ledger()
            self._store.put(f"{self.root}finished", json.dumps({"step": self.step, "rid": self.rid}).encode())

    def finished_step(self) -> Optional[int]:
        """The step at which the job finished, or None while it runs. Same answer on every rank."""
        step = None
        if self.is_leader:
            kv = self._store.get(f"{self.root}finished")
            step = json.loads(kv.value)["step"] if kv else None
        return self._broadcast(step)

    def restore_grads(self) -> bool:
        """After a failed commit: put back this rank's local gradients as they were before the
        exchange (saved by `exchange(save_grads=True)`), so the step is retried without
        recomputing them. Returns False when nothing was saved."""
        if not self._saved_ok or self._saved is None:
            return False
        self._write_grads(self._params(), self._saved)
        return True

    def _write_grads(self, params: list[torch.nn.Parameter], src: torch.Tensor) -> None:
        """Copy a flat buffer (the layout of `_flat`) into the parameters' local gradients."""
        for p, (lo, hi) in zip(params, self._offsets):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            _local(p.grad).view(-1).copy_(src[lo:hi])

    # -- buckets and overlap with backward ---------------------------------------------------------
    def enable_overlap(self, bucket_bytes: int = 4 << 20) -> None:
        """Exchange gradients in buckets, started from post-accumulate-grad hooks while backward
        still runs (FSDP2 calls them after each reduce-scatter). Every replica of a job must use
        the same `bucket_bytes`: the buckets are all-reduced in one canonical order, reverse
        parameter order (the order backward produces them), whatever order the grads arrive in."""
        params = self._params()
        flat = self._flat_buffer(params)
        offs, off = self._offsets, flat.numel()
        buckets: list[tuple[int, int]] = []
        members: list[list[int]] = []
        hi = off
        cur: list[int] = []
        for i in reversed(range(len(params))):
            cur.append(i)
            lo = offs[i][0]
            if (hi - lo) * flat.element_size() >= bucket_bytes or i == 0:
                buckets.append((lo, hi))
                members.append(cur)
                hi, cur = lo, []
        self._buckets = buckets
        self._bucket_of = {i: b for b, ms in enumerate(members) for i in ms}
        self._bucket_need = [len(ms) for ms in members]
        self._index = {id(p): i for i, p in enumerate(params)}
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def begin_step(self, save_grads: bool = True) -> "Future[StepPlan]":
        """Start this round's quorum in the background and arm the gradient hooks for the
        coming (final) backward: buckets are all-reduced as soon as the plan is known and
        their gradients are in. Call before the backward; then `exchange(plan_future.result())`."""
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"lft-quorum-r{self.rid}")
        with self._lock:
            self._armed = True
            self._round = _Round(save_grads, len(self._buckets))
        fut: Future = self._pool.submit(self._start_and_release)
        return fut

    def _start_and_release(self) -> StepPlan:
        plan = self.start_step()
        with self._lock:
            if self._round is not None:
                self._round.plan = plan
                self._submit_ready(self._round)
        return plan

    def disarm(self) -> None:
        """Hooks stop exchanging (recomputation, retries): `exchange` sends everything."""
        with self._lock:
            self._armed = False
            self._round = None

    def _grad_ready(self, p: torch.Tensor) -> None:
        with self._lock:
            r = self._round
            if not self._armed or r is None:
                return
            i = self._index[id(p)]
            lo, hi = self._offsets[i]
            self._flat[lo:hi].copy_(_local(p.grad).reshape(-1))
            if i not in r.filled:
                r.filled.add(i)
                r.count[self._bucket_of[i]] += 1
            self._submit_ready(r)

    def _submit_ready(self, r: "_Round") -> None:
        """Submit, in canonical order, the buckets whose gradients are all in (lock held)."""
        plan = r.plan
        if plan is None or plan.lagging:
            return
        while r.submitted < len(self._buckets) and r.count[r.submitted] == self._bucket_need[r.submitted]:
            self._submit(r, r.submitted, plan)

    def _submit(self, r: "_Round", b: int, plan: StepPlan) -> None:
        lo, hi = self._buckets[b]
        if r.save:
            if self._saved is None or self._saved.numel() != self._flat.numel():
                self._saved = torch.empty_like(self._flat)
            self._saved[lo:hi].copy_(self._flat[lo:hi])
        r.works.append(self.ftar.allreduce([self._flat[lo:hi]], divisor=float(plan.divisor)))
        r.submitted += 1

    def exchange(self, plan: StepPlan, save_grads: bool = False) -> bool:
        """Average gradients over the contributors through FTAR (lagging: zeros, and catch up
        meanwhile). Returns this rank's vote. With `save_grads`, a contributor keeps a copy of
        its local gradients for `restore_grads` (a retry without recomputation). Buckets that
        the backward hooks already sent (`begin_step`) are not sent again."""
        t0 = time.perf_counter()
        params = self._params()
        flat = self._flat_buffer(params)
        with self._lock:
            r = self._round if (self._armed and self._round is not None and self._round.plan is plan) else None
            self._armed, self._round = False, None
            if r is None:
                r = _Round(save_grads, len(self._buckets))
                r.plan = plan
            r.save = save_grads and not plan.lagging
            self._saved_ok = r.save
            if plan.lagging:
                flat.zero_()
            else:
                for i, p in enumerate(params):
                    if i not in r.filled:
                        lo, hi = self._offsets[i]
                        if p.grad is None:
                            flat[lo:hi].zero_()
                        else:
                            flat[lo:hi].copy_(_local(p.grad).reshape(-1))
            for b in range(r.submitted, len(self._buckets)):
                self._submit(r, b, plan)
        ok = True
        if plan.lagging:  # fetch the healthy state while our zeros are on the wire
            self._dirty = True
            ok = self._catch_up(plan)
        deadline = time.monotonic() + self.hang_timeout_s + self.ftar.timeout_s * 4 + \
            flat.numel() * flat.element_size() / 1e7
        try:
            # Bounded by the engine's own deadlines; this only guards against a stuck engine.
            for work in r.works:
                work.wait(max(0.1, deadline - time.monotonic()))
        except FatalError:
            raise
        except FTARError as e:
            log.warning("replica %d rank %d: exchange of step %d failed: %s", self.rid, self.rank, plan.step, e)
            self._ring_ok = False
            ok = False
        if ok:
            self._write_grads(params, flat)
        self.stats.exchange_s = time.perf_counter() - t0
        return ok

    # -- catch-up --------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's state shard as named local tensors: parameters, buffers, optimizer state."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self._named_params:
            out[f"param.{name}"] = _local(p.data if not hasattr(p, "to_local") else p).detach()
        for name, b in self.model.named_buffers():
            out[f"buffer.{name}"] = _local(b).detach()
        for i, p in enumerate(self._params()):
            for key, v in sorted(self.optimizer.state.get(p, {}).items()):
                if torch.is_tensor(v):
                    out[f"optim.{i}.{key}"] = _local(v).detach()
        return out

    def _meta(self) -> dict:
        return {
            "step": self.step,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
        }

    def _publish_snapshot(self, q: Quorum) -> None:
        expected = set()
        for lag in q.lagging:
            if q.contributors[(lag + self.rank) % len(q.contributors)] == self.rid:
                expected.add(f"{lag}/{self.rank}")
        self.server.publish(self.step, self.state_tensors(), self._meta(), expected)

    def _materialize_optimizer_state(self) -> None:
        """A fresh replica has no optimizer state yet; take one step with zero grads and lr 0
        so that every state tensor exists, then zero every state tensor. Zeroed state is what
        lazy initialization creates (Adam/AdamW moments and step, SGD momentum), so a replica
        that ends up not catching up trains exactly as a fresh one would."""
        params = self._params()
        if all(self.optimizer.state.get(p) for p in params):
            return
        saved = [(g, g["lr"]) for g in self.optimizer.param_groups]
        grads = [p.grad for p in params]
        for p in params:
            p.grad = torch.zeros_like(p)
        for g, _ in saved:
            g["lr"] = 0.0
        self.optimizer.step()
        for g, lr in saved:
            g["lr"] = lr
        for p, gr in zip(params, grads):
            p.grad = gr
        with torch.no_grad():
            for p in params:
                for v in self.optimizer.state.get(p, {}).values():
                    if torch.is_tensor(v):
                        _local(v).zero_()

    def _catch_up(self, plan: StepPlan) -> bool:
        q = plan.quorum
        src = q.contributors[(self.rid + self.rank) % len(q.contributors)]
        addr = q.state_addrs[q.index(src)][self.rank]
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.ftar.timeout_s
        try:
            self._materialize_optimizer_state()
            into = self.state_tensors()
            while True:
                try:
                    with torch.no_grad():
                        meta, stats = fetch_state(addr, plan.step, into, self.secret.encode(),
                                                  f"{self.rid}/{self.rank}", timeout_s=max(10.0, self.ftar.timeout_s * 2))
                    break
                except CatchupError as e:
                    # The healthy ranks publish right after they get the same quorum; we may be early.
                    if not e.not_yet_published(plan.step) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.002)
        except CatchupError as e:
            log.warning("replica %d rank %d: catch-up from replica %d failed: %s", self.rid, self.rank, src, e)
            return False
        for g, saved in zip(self.optimizer.param_groups, meta["param_groups"]):
            g.update({k: tuple(v) if isinstance(g.get(k), tuple) else v for k, v in saved.items()})
        if self.scheduler is not None and meta.get("scheduler") is not None:
            self.scheduler.load_state_dict(meta["scheduler"])
        self.stats.catchup_s = time.perf_counter() - t0
        self.stats.catchup_gbps = stats.get("gbps", 0.0)
        self.stats.catchup_mb = stats.get("bytes", 0) / 1e6
        log.info("replica %d rank %d caught up to step %d from replica %d: %.1f MB in %.3fs (%.2f GB/s)", self.rid,
                 self.rank, plan.step, src, stats["bytes"] / 1e6, stats["seconds"], stats["gbps"])
        return True

    # -- step 4-5: two-phase commit and the LR factor ---------------------------------------------------
    def commit(self, vote: bool) -> bool:
        """All ranks of the replica apply the optimizer step, or none does."""
        plan = self.last_plan
        ok = self._vote(vote)
        if not ok:
            self.optimizer.zero_grad(set_to_none=True)
            self._cursor_stale = True
            self.stats.retries += 1
            self._ring_ok = False  # peers may be mid-collective: rebuild the ring next round
            return False
        self.stats.freeze_s = self.server.freeze()
        saved = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = g["lr"] * plan.lr_factor
        try:
            self.optimizer.step()
        finally:
            for g, lr in zip(self.optimizer.param_groups, saved):
                g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        self.step = plan.step + 1
        self._dirty = False
        self._saved_ok = False
        if plan.contribute:
            self.cursor = plan.batch_index + 1
        if self.is_leader:
            # Written by the next start_step, before this replica reports for the next round
            # (from the quorum thread when overlapped): off the step's critical path.
            q = plan.quorum
            self._unrecorded = (plan.step, q.epoch, q.round, {c: q.cursor_of(c) for c in q.contributors})
        if self.on_commit is not None:
            self.on_commit(plan)
        return True

    def flush_ledger(self) -> None:
        """Record the last commit in the ledger and advance the cursors (leader; idempotent)."""
        rec, self._unrecorded = self._unrecorded, None
        if rec is not None and self.is_leader:
            step, epoch, round_, batches = rec
            ledger.record_commit(self._store, self.root, step, self.rid, epoch, round_, batches)

    def _vote(self, vote: bool) -> bool:
        if self.pg is None and self.world == 1:
            return vote
        t = torch.tensor([1 if vote else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.pg)
        return bool(t.item())

    # -- shutdown -----------------------------------------------------------------------------------
    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self.is_leader and self._store is not None:
            try:
                self.flush_ledger()
            except Exception as e:  # etcd gone: the other committers of that step recorded it too
                log.warning("replica %d: could not record the last commit: %s", self.rid, e)
        if self.coord is not None:
            self.coord.close(revoke=True)
        if self.ftar is not None:
            self.ftar.close()
        if self.server is not None:
            self.server.close()
        if self._store is not None and self._etcd:
            self._store.close()
