"""One replica rank (docs/ARCHITECTURE.md, "The replica layer"), framework-free: who it is, where
its state stands in the job's history, and the parts it is made of.

    replica = Replica(model, optimizer, Identity(...), Settings.from_config(cfg), group=...)
    replica.start()                          # FTAR, catch-up transport; the leader registers
    for ask in replica.prepare(): ...        # sync / catch-up / rewind until this replica is current
    while replica.step < max_steps:
        step = replica.begin(batch=k)        # one optimizer step: see replica/step.py
        for ask in step: ...                 # compute, check, keep books: what it asks of its caller
        res = step.result

The step's decisions are the pure core's (core.py) and step.py drives it; the caller calls no
protocol code back and is called back by none. The parts, each with its own state (opened by
`start`, joining.py): `RoundClient` (rounds.py: report, quorum, ring, the round's plan),
`Exchange` (exchange.py: gradient buffers, FTAR), `StateTransfer` (catchup/transfer.py: publish,
fetch, load), `LedgerWriter` (ledger.py: the leader's commit records), `Digests` (guard.py) and
the leader's `Coordinator` (coord/).

Threads (docs/ARCHITECTURE.md, "Threads"): the training thread owns `state` and every field
here; a round started early (`begin_step`) runs on the quorum thread from a snapshot
(`RoundView`) and hands its result back through a future; the coordinator's watch thread only
aborts the ring."""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Optional, TypeVar

import torch

from lightning_ft.coord import keys
from lightning_ft.coord.coordinator import Coordinator
from lightning_ft.coord.store import Store
from lightning_ft.ftar.engine import FTAR
from lightning_ft.replica.catchup.http import HTTPTransport
from lightning_ft.replica.catchup.transfer import StateExtras, StateTransfer
from lightning_ft.replica.catchup.transport import TransportFactory
from lightning_ft.replica.core import StepSpec, own_optimizer
from lightning_ft.replica.events import append_event
from lightning_ft.replica.exchange import Exchange
from lightning_ft.replica.group import ReplicaGroup
from lightning_ft.replica.guard import Digests, keep_verified_checkpoints
from lightning_ft.replica.joining import Parts
from lightning_ft.replica.optimizers import Optimizers
from lightning_ft.replica.pace import Pace
from lightning_ft.replica.plan import StepPlan, StepStats
from lightning_ft.replica.replica_state import ReplicaState
from lightning_ft.replica.rounds import Round, RoundClient, RoundView
from lightning_ft.replica.settings import Identity, Settings, job_spec
from lightning_ft.replica.state import combine, fast_digest, hyperparameters
from lightning_ft.replica.step import Step
from lightning_ft.threads import name_current

log = logging.getLogger(__name__)
_T = TypeVar("_T")


def _opened(part: Optional[_T], what: str) -> _T:
    """A part `start` opens, or a clear error where it is read before then (or on a rank that
    has none)."""
    if part is None:
        raise RuntimeError(f"Replica.{what} is not open: start() opens it (the store and the coordinator "
                           f"on the replica's leader rank only)")
    return part


class Replica:
    """One rank of one replica: its identity, its state, its parts, and the step's driver."""

    def __init__(self, model: torch.nn.Module, optimizer: Any, who: Identity, settings: Optional[Settings] = None, *,
                 group: Optional[ReplicaGroup] = None, scheduler: Any = None, store: Optional[Store] = None,
                 run_dir: str = "", catchup_transport: TransportFactory = HTTPTransport) -> None:
        """`who`: the replica; `settings`: the protocol's knobs (replica/settings.py); `group`: this
        replica's ranks (default: one rank); `store`: an open etcd client for the leader (default:
        `start` opens one at `who.etcd`); `catchup_transport`: builds this rank's catch-up transport
        in `start` (replica/catchup/transport.py; tests: `InMemoryTransport`)."""
        st = self.settings = settings or Settings()
        self.group = group or ReplicaGroup(0, 1, None)
        if isinstance(optimizer, (list, tuple)):  # manual optimization with several: replica/optimizers.py
            optimizer = optimizer[0] if len(optimizer) == 1 else Optimizers(optimizer)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.multi = isinstance(optimizer, Optimizers)
        """Several optimizers: each `optimizer.step()` is a round (quorum rule 15)."""
        self.phase: tuple[int, bool] = (-1 if self.multi else 0, False)
        """(optimizer, continues a batch) of this replica's next round (reported; rule 15)."""
        # Captured now, while FSDP2's parameters are the sharded DTensors (see state.py).
        self._named_params = list(model.named_parameters())
        self.who = who
        """Who this replica is; a promoted warm spare's is replaced in `start`."""
        self.root = keys.root(st.prefix, who.job, who.run_id)
        """This run's keyspace; set by `start` once the run is known."""
        self.spec = job_spec(st, who, self.group.world, self._named_params)
        self.straggler_window = self.spec.straggler_window
        self.run_dir = run_dir
        self.state = ReplicaState()
        """Where this replica's state stands in the job's history (replica_state.py), replaced
        whole at each transition, by the training thread only."""
        self.digests = Digests(st.digest_every, st.checkpoint_every, self.group)
        self._store = store
        self._catchup_transport = catchup_transport
        self._parts: Optional[Parts] = None
        self.stats = StepStats()
        self.last_plan: Optional[StepPlan] = None
        self.micro_batches = 0
        """Micro-batches of this replica's slot batch, when its caller can train any subset of them
        and micro-batches of other slots (`begin(extras=True)`); 0: it cannot, and is never shrunk
        (stragglers policy "shrink": it is excluded instead)."""
        self.request_stop = False
        """Ask the job to stop (reported with every round until a round carries it)."""
        self.extras = StateExtras()
        """What travels with the tensors besides the optimizer's: the loss scale, the callbacks."""
        self.restart_breakdown: Optional[dict] = None
        """A restarted incarnation's start-up in parts (replica/startup.py), set at its first commit."""
        self.pace = Pace(who.rid, self.straggler_window)
        """The straggler measure: compute per step, the probe while benched (replica/pace.py)."""
        self.committed_round = -1
        self.cursor_stale = False
        self.bad_checkpoints: set[int] = set()
        self.t_free: Optional[float] = None
        """When the previous step (or `prepare`) returned: where the next step's compute starts."""
        self.t_ready: Optional[float] = None
        self.stash: Optional[StepPlan] = None
        """A train round `prepare` obtained before any batch: the first step trains it."""
        self._pending: Optional[Future[Round]] = None
        self._pool: Optional[ThreadPoolExecutor] = None

    # -- identity and the state's standing ----------------------------------------------------------
    @property
    def job(self) -> str:
        return self.who.job

    @property
    def rid(self) -> int:
        return self.who.rid

    @property
    def incarnation(self) -> int:
        return self.who.incarnation

    @property
    def R(self) -> int:
        return self.who.num_replicas

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world(self) -> int:
        return self.group.world

    @property
    def is_leader(self) -> bool:
        return self.group.is_leader

    @property
    def step(self) -> int:
        """Committed steps of this replica (its state is at the end of step `step - 1`)."""
        return self.state.step

    @property
    def gen(self) -> int:
        return self.state.gen

    @property
    def synced(self) -> bool:
        return self.state.synced

    @property
    def cursor(self) -> int:
        """The next batch of this replica's slot to train."""
        return self.state.cursor

    @property
    def batches(self) -> int:
        """Batches the job's history committed (one per batch-start round): `step` counts optimizer
        steps; with one optimizer both are equal."""
        return self.state.batches

    # -- the parts ----------------------------------------------------------------------------------
    @property
    def parts(self) -> Parts:
        return _opened(self._parts, "parts")

    @property
    def started(self) -> bool:
        return self._parts is not None

    @property
    def store(self) -> Store:
        return _opened(self._store, "store (the leader's etcd client)")

    @property
    def coord(self) -> Coordinator:
        return _opened(self.parts.rounds.coord, "coord (the leader's coordinator)")

    @property
    def ftar(self) -> FTAR:
        return self.parts.ftar

    @property
    def exchange(self) -> Exchange:
        return self.parts.exchange

    @property
    def transfer(self) -> StateTransfer:
        return self.parts.transfer

    @property
    def rounds(self) -> RoundClient:
        return self.parts.rounds

    @property
    def scaler(self) -> Any:
        """fp16 loss scaling (`set_scaler`): its skip decision is taken in the commit on the
        averaged gradients, the same on every replica; its state travels with the tensors."""
        return self.extras.scaler

    @property
    def callbacks(self) -> Any:
        """The caller's other state a catch-up carries (strategy/callback_state.py)."""
        return self.extras.callbacks

    @callbacks.setter
    def callbacks(self, callbacks: Any) -> None:
        self.extras.callbacks = callbacks

    def set_scaler(self, scaler: Any) -> None:
        """Scale the loss with this `torch.amp.GradScaler` (the caller's backward multiplies the
        loss by its scale); the replica unscales the averaged gradients, skips overflowed steps
        on every replica alike, updates the scale, and carries it in catch-up and checkpoints."""
        from lightning_ft.replica.scaler import ReplicaScaler

        self.extras.scaler = ReplicaScaler(scaler) if scaler is not None else None

    def stepped_optimizer(self, plan: Optional[StepPlan] = None) -> Any:
        """The torch optimizer a round steps (the only one, with one optimizer)."""
        if not self.multi:
            return self.optimizer
        plan = plan or self.last_plan
        return self.optimizer.optimizers[max(plan.opt if plan is not None else 0, 0)]

    # -- start ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Open FTAR and the catch-up transport; the leader registers with etcd (a warm spare
        first waits to be promoted). Do slow initialization before."""
        from lightning_ft.replica.joining import open_parts

        self._parts = open_parts(self)

    def enable_overlap(self, bucket_bytes: int = 4 << 20) -> None:
        """Exchange gradient buckets from backward hooks (buckets.py); the same `bucket_bytes` on
        every replica of a job."""
        self.exchange.enable_overlap(bucket_bytes)

    def disarm(self) -> None:
        self.exchange.disarm()

    # -- the step ---------------------------------------------------------------------------------
    def prepare(self) -> Step:
        """Before the first batch: take part in sync, catch-up and rewind rounds until this
        replica holds the job's current state, as a step that trains nothing (iterate it: its
        catch-ups ask CLIP and COMMITTED). A training round it gets meanwhile is kept for the
        first step."""
        if self.multi:
            self.phase = (-1, False)  # rule 15: at a batch boundary, its first optimizer not known yet
        return Step(self, StepSpec(prepare=True, multi=self.multi, planned=self.stash is not None, rid=self.rid))

    def begin_step(self) -> None:
        """Start the next round now, in the background, and arm the gradient hooks for the coming
        (final) backward: buckets are all-reduced as soon as the round's plan is known and their
        gradients are in. The next `begin` takes the round."""
        self.exchange.arm(True)
        if self.stash is not None:  # prepare() obtained a training round before any batch
            self.exchange.plan_known(self.stash)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"lft-quorum-r{self.rid}", initializer=name_current,
                                            initargs=(f"lft-quorum-r{self.rid}",))
        self._pending = self._pool.submit(self._round_in_background, self._view())

    @property
    def round_started(self) -> bool:
        """A round was started before the step (`begin_step`, or the one `prepare` kept)."""
        return self._pending is not None or self.stash is not None

    def begin(self, batch: Optional[int] = None, computed: bool = False, recompute: bool = True,
              extras: bool = False, phase: Optional[tuple[int, bool]] = None) -> Step:
        """One optimizer step (see the module docstring). `batch`: the slot batch the caller's
        loader delivered (None: whatever the plan assigns, `plan.batch_index`); `computed`: the
        caller computed its gradients already; `recompute`: it can compute them again (manual
        optimization cannot); `extras`: it trains micro-batches of any slot (`Do.EXTRA`);
        `phase`: (optimizer, continues a batch) with several optimizers."""
        if phase is not None:
            self.phase = (int(phase[0]), bool(phase[1]))
        spec = StepSpec(batch=batch, computed=computed, recompute=recompute, extras=extras,
                        shrinkable=bool(self.micro_batches) and extras, multi=self.multi, cont=self.phase[1],
                        planned=self.round_started, rid=self.rid)
        self.t_ready = time.monotonic() if computed else None
        return Step(self, spec)

    def planned_skip(self) -> tuple[int, ...]:
        """The micro-batches of its slot batch this replica gives away in its next train round, as
        the last quorum it adopted announced (`Quorum.shrink_next`; stragglers policy "shrink"). A
        caller computing before that round's plan arrives skips these; `StepPlan.skip` is what the
        round decided, and `Do.EXTRA` makes up any difference."""
        plan = self.last_plan
        for rid, g, n in plan.quorum.shrink_next if plan is not None else ():
            if rid == self.rid and n == self.micro_batches:
                return tuple(range(n - g, n))
        return ()

    # -- rounds ----------------------------------------------------------------------------------
    def _view(self) -> RoundView:
        """What this replica says of itself in its next round (the training thread's snapshot)."""
        return RoundView(self.state, self.committed_round, stop=self.request_stop,
                         bad_checkpoints=tuple(sorted(self.bad_checkpoints)), phase=self.phase,
                         micro=self.micro_batches, compute=self.pace.compute(), probe=self.pace.probed(),
                         cursor_stale=self.cursor_stale, multi=self.multi)

    def _round_in_background(self, view: RoundView) -> Round:
        rnd = self.rounds.next(view)
        self.exchange.plan_known(rnd.plan)
        return rnd

    def next_round(self, own: bool) -> StepPlan:
        """The next round's plan: the one started early (`begin_step`), the one `prepare` kept, or
        a round now. The round's effects on this replica are applied here, on the training thread.
        `own`: a step's round (several optimizers: a contributor steps its own optimizer)."""
        if self.stash is not None:
            plan, self.stash = self.stash, None
        else:
            if self._pending is not None:
                fut, self._pending = self._pending, None
                rnd = fut.result()
            else:
                rnd = self.rounds.next(self._view())
            plan = rnd.plan
            if rnd.refused is not None:
                self._disown(rnd.refused)
            self.state = replace(self.state, cursor=rnd.cursor)
            if rnd.cursor_read:
                self.cursor_stale = False
            self.stats = StepStats(quorum_s=rnd.quorum_s, reconfigure_s=rnd.reconfigure_s, retries=self.stats.retries)
        self.pace.planned(plan)
        if own and self.multi and plan.contribute:
            plan = own_optimizer(plan, self.phase[0], self.rid)
        if self.multi:
            self.exchange.select(plan.opt)
        self.last_plan = plan
        return plan

    def _disown(self, refused: tuple[int, int]) -> None:
        """The ledger refused our records of these steps: the state is not the job's history."""
        self.state = self.state.disown()
        log.warning("replica %d: the ledger refused our records of steps %d..%d (evicted or our lease lapsed): "
                    "the others may have redone them without us, so this replica adopts a member's state "
                    "before it trains again", self.rid, *refused)
        self.event("disowned", steps=list(refused))

    # -- state transfer ----------------------------------------------------------------------------
    def fetch_from(self, addr: str, step: int, src: int, deadline_s: float, gen: int) -> int:
        """Fetch version `step` of generation `gen` of replica `src`'s state (this rank's shard,
        from `addr`): OK, FAILED (nothing written) or LOST (partly overwritten)."""
        vote, meta = self.transfer.fetch(addr, step, src, deadline_s, gen)
        if meta is not None:
            self.state = replace(self.state, batches=int(meta.get("batches", step)))
            s = self.transfer.stats
            self.stats.catchup_s, self.stats.catchup_gbps, self.stats.catchup_mb = s["seconds"], s["gbps"], s["mb"]
        return vote

    def take_digest(self) -> None:
        """After a commit or an adoption: this rank's digest, if the step is one replicas digest at."""
        if not self.digests.due(self.step):
            self.digests.take(self.step, {})
            return
        named = {**self.transfer.tensors(), **hyperparameters(self.optimizer),  # the learning rate too
                 **(self.scaler.digest_tensors() if self.scaler is not None else {})}  # and the loss scale
        self.stats.digest_s = self.digests.take(self.step, named)

    def final_digest(self) -> str:
        """Every rank: the replica's digest of its whole state now (the end of the job compares them)."""
        named = {**self.transfer.tensors(), **hyperparameters(self.optimizer),
                 **(self.scaler.digest_tensors() if self.scaler is not None else {})}
        return combine(self.group.gather(fast_digest(sorted(named.items()))))

    def load_checkpoint(self, path: str) -> dict:
        """Load a persistent checkpoint into this rank's model, optimizer and scheduler; returns
        its meta. Used by `--resume` (before `start`) and by rewinds."""
        from lightning_ft.replica.catchup.transfer import load_checkpoint

        meta = load_checkpoint(path, self.model, self.optimizer, self.scheduler, self.scaler,
                               None if self.world == 1 else self.group.pg)
        self.state = replace(self.state, step=int(meta["step"]), batches=int(meta.get("batches", meta["step"])))
        return meta

    def continue_at(self, step: int, batches: int, cursor: int) -> None:
        """Before the first round: this replica holds the job's state at `step` (`batches`
        committed), and its slot goes on at `cursor` (a Lightning checkpoint's resume point)."""
        self.state = replace(self.state, step=step, batches=batches, cursor=cursor)

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
        """How long a finisher serves its final state to a member behind it (catchup/ending.py)."""
        return max(10.0, 3 * self.ftar.timeout_s)

    def mark_finished(self) -> None:
        """This replica trained to the end (every rank): record that the job trained to
        completion, so that a replica restarted afterwards finds nothing left to do instead of
        training alone, and serve the final state to a member behind it (catchup/ending.py)."""
        from lightning_ft.replica.catchup import ending

        ending.finish(self, self.linger_s)

    def finished_step(self) -> Optional[int]:
        """The step at which the job finished, or None while it runs. Same answer on every rank."""
        from lightning_ft.replica.catchup.ending import read_finished

        step = None
        if self.is_leader:
            rec = read_finished(self.store, self.root)
            step = rec["step"] if rec else None
        return self.group.broadcast(step)

    def flush_ledger(self) -> bool:
        """Leader: record the commits not in the ledger yet (before a checkpoint, at the end).
        Returns whether the ledger knows every step this replica committed (False once a write
        was refused, until a catch-up or sync replaces the state)."""
        writer = self.parts.writer
        refused = writer.flush() if writer is not None else None
        if refused is not None:
            self._disown(refused)
        return not self.state.disowned

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.transfer.tensors()

    def gather(self, obj: Any) -> list:
        """`obj` from every rank of this replica (all ranks call it), in rank order."""
        return self.group.gather(obj)

    def broadcast(self, obj: Any) -> Any:
        """The leader's `obj` on every rank of this replica (all ranks call it)."""
        return self.group.broadcast(obj)

    # -- events, the halt, closing -------------------------------------------------------------
    def event(self, name: str, **fields: Any) -> None:
        """Append an event to {run_dir}/events.jsonl (one write, O_APPEND: safe beside the launcher)."""
        if self.run_dir:
            append_event(self.run_dir, name, self.rid, self.incarnation, fields)

    def on_halt(self) -> None:
        """The job halted (diverged states): keep only checkpoints whose digests agreed."""
        if self.is_leader and self.settings.checkpoint_root and self.last_plan is not None:
            keep_verified_checkpoints(self.settings.checkpoint_root, self.last_plan.quorum.verified_step, self.rid)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        parts = self._parts
        if parts is not None:
            parts.rounds.close()
            if parts.writer is not None:
                try:
                    self.flush_ledger()
                except Exception as e:  # etcd gone: the other committers of that step recorded it too
                    log.warning("replica %d: could not record the last commit: %s", self.rid, e)
            if parts.rounds.coord is not None:
                parts.rounds.coord.close(revoke=True)
            parts.ftar.close()
            parts.transfer.close()
        if self._store is not None and self.who.etcd:
            self._store.close()
