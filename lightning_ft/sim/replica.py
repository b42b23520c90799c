"""One replica incarnation of a simulated job (docs/ARCHITECTURE.md, "The simulator").

What runs here is the project's own protocol code: the coordinator and its membership
(coord/coordinator.py, coord/membership.py: registration, leases, watches, full and steady rounds,
the decision of coord/quorum.py), the round client (replica/rounds.py), the ledger writer
(replica/ledger.py) and the step's core (replica/core.py). What is modelled: the network (sim/net.py:
FTAR rings, catch-up), the model (`ModelState`: a hash chain of what it trained), etcd
(sim/etcd.py) and the clock (sim/world.py). The driver below is replica/step.py's, with the
simulator's I/O: one action of the core, one event back.

A replica is one rank (W = 1): a replica's ranks share its fate in the simulation.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Generator, Optional

from lightning_ft.coord import keys
from lightning_ft.coord.coordinator import Coordinator
from lightning_ft.coord.membership import JobFinished, MembershipSettings, Runtime
from lightning_ft.coord.quorum import adopt_role
from lightning_ft.coord.round_records import Quorum
from lightning_ft.coord.store import StoreError
from lightning_ft.ftar.transport.base import RecoverableError
from lightning_ft.replica import ledger
from lightning_ft.replica.core import (Action, Applied, Checked, Do, Done, Ended, Event, Exchanged, FinalAdopted,
                                       Planned, Probed, Restored, StepCore, StepSpec, Synced, Voted, own_optimizer)
from lightning_ft.replica.group import ReplicaGroup
from lightning_ft.replica.catchup.transfer import wire_version
from lightning_ft.replica.guard import Digests
from lightning_ft.replica.pace import Pace
from lightning_ft.replica.plan import FAILED, LOST, OK, ReplicaStateLost, StepPlan, StepResult
from lightning_ft.replica.replica_state import ReplicaState
from lightning_ft.replica.rounds import Round, RoundClient, RoundView
from lightning_ft.sim import ending as sim_ending
from lightning_ft.sim.net import Exchange, ModelState, SimFTAR
from lightning_ft.sim.world import Livelock

if TYPE_CHECKING:
    from lightning_ft.sim.job import SimJob

JOB = "sim"


SPIN_ROUNDS = 10_000
"""Rounds one replica may ask for at one virtual instant before the run is a livelock."""

class SimDigests(Digests):
    """The divergence guard's digests of the simulated model (its hash chain)."""

    def take(self, step: int, named: Any) -> float:
        self._mine = (step, int(named)) if self.due(step) else None
        return 0.0


class SimLedgerWriter(ledger.LedgerWriter):
    """The real ledger writer; the job learns which commits the ledger accepted (their states
    must agree)."""

    def __init__(self, replica: "SimReplica", *args: Any) -> None:
        super().__init__(*args)
        self.replica = replica

    def flush(self) -> Optional[tuple[int, int]]:
        recs = list(self._pending)
        refused = super().flush()
        if refused is None:
            self.replica.job.accepted(self.replica, [(r[3], r[0]) for r in recs])
        return refused


class SimReplica:
    """A replica incarnation: its process body, its keepalive, its state."""

    def __init__(self, job: "SimJob", rid: int, inc: int, model: ModelState, fingerprint: Optional[dict] = None,
                 slow: float = 1.0) -> None:
        self.job, self.rid, self.inc = job, rid, inc
        self.world, self.store, self.net, self.cfg = job.world, job.store, job.net, job.cfg
        self.model = model
        self.state = ReplicaState(step=model.step, batches=model.batches)
        self.fingerprint = fingerprint if fingerprint is not None else job.spec.fingerprint
        self.ftar = SimFTAR(self.net, rid)
        self.ftar.timeout_s = self.cfg.ftar_timeout_s
        group = ReplicaGroup(0, 1, None)
        self.digests = SimDigests(self.cfg.digest_every, self.cfg.ckpt_every, group)
        self.coord: Optional[Coordinator] = None
        self.rounds: Optional[RoundClient] = None
        self.writer: Optional[SimLedgerWriter] = None
        self.last_plan: Optional[StepPlan] = None
        self.stash: Optional[StepPlan] = None
        self.committed_round = -1
        self.cursor_stale = False
        self.compute_times: list[float] = []
        self.compute_round = -1
        self.pace = Pace(self.rid, self.job.spec.straggler_window)
        """Benched (rule 14): the probe of its pace (replica/pace.py), in simulated time."""
        self._spin = (0.0, 0)
        """(virtual time, rounds asked at it)."""
        self._t_round = 0.0
        self.grads: tuple = ()
        self.saved: Optional[tuple] = None
        self.result: Optional[tuple] = None
        self.exchange: Optional[Exchange] = None
        self.own: dict[tuple[int, int], int] = {}
        """(gen, step) -> the state digest after we committed it (untainted states only)."""
        self.done = False
        self.replaced = False
        """A fetch replaced our state in this round (replica/step.py)."""

    @property
    def addr(self) -> str:
        return f"f{self.rid}:{self.inc}"

    # -- etcd as a client sees it: an outage shorter than connect_timeout_s is ridden out --------------
    def _unreachable(self) -> float:
        """Until when etcd is out of this replica's reach (an outage, or its host cut off)."""
        return max(self.store.down_until, self.job.isolated.get(self.rid, -1.0))

    def _etcd(self) -> Generator[Any, Any, None]:
        down = self._unreachable() - self.world.now
        if down > 0:
            if down > self.cfg.etcd_connect_s:
                yield self.cfg.etcd_connect_s
                raise StoreError("etcd unreachable for longer than etcd.connect_timeout_s")
            yield down

    def _wait(self, gen: Generator[float, None, Any]) -> Generator[Any, Any, Any]:
        """Drive a coordinator generator (it yields how long to wait for its wake event)."""
        assert self.coord is not None
        wake = self.coord.membership.wake
        yield from self._etcd()
        try:
            timeout = next(gen)
            while True:
                yield wake, timeout
                yield from self._etcd()
                timeout = gen.send(None)
        except StopIteration as done:
            return done.value

    # -- the process --------------------------------------------------------------------------------
    def keepalive(self) -> Generator[Any, Any, None]:
        """The keepalive thread: every lease_ttl_s / 3 (it stops with its process)."""
        while True:
            yield self.cfg.ttl_s / 3.0
            if self.coord is not None and self._unreachable() <= self.world.now:
                self.coord.membership.keepalive_once()

    def body(self) -> Generator[Any, Any, None]:
        """The replica's main thread: join, prepare, train to the end, finish."""
        cfg, world = self.cfg, self.world
        yield from self._etcd()
        ms = MembershipSettings(lease_ttl_s=cfg.ttl_s, hang_timeout_s=cfg.hang_timeout_s,
                                poll_interval_s=cfg.poll_s)
        spec = replace(self.job.spec, fingerprint=self.fingerprint)
        self.coord = coord = Coordinator(self.store, JOB, self.rid, self.inc, spec, ms,
                                         on_failure=self._failure, on_event=self.job.decided,
                                         runtime=Runtime(world.clock, world.event, keepalive=False))
        root = coord.root
        gen = ledger.latest_gen(self.store, root)
        self.state = replace(self.state, gen=gen, cursor=ledger.read_cursor(self.store, root, self.rid, gen))
        if self.job.finished_record() is not None:
            return  # a replica started after the end has nothing to train
        coord.register(self.state.step, addrs=[self.addr], state_addrs=[self.addr], gen=gen, synced=self.state.synced,
                       cursor=self.state.cursor)
        self.writer = SimLedgerWriter(self, self.store, root, self.rid, coord.fence)
        self.rounds = RoundClient(self.rid, ReplicaGroup(0, 1, None), self.ftar, self.digests, self,  # type: ignore[arg-type]
                                  [self.addr], self.job.settings, cfg.replicas, clock=world.clock,
                                  background=self._background)
        self.rounds.coord, self.rounds.writer = coord, self.writer
        self.job.note(self, "registered")
        try:
            yield from self._drive(StepSpec(prepare=True, rid=self.rid))
        except JobFinished:
            return
        while self.state.step < cfg.steps:
            res = yield from self._drive(StepSpec(batch=None, extras=True, shrinkable=cfg.micro > 1,
                                                  planned=self.stash is not None, rid=self.rid))
            if res.stop or (res.caught_up and self.job.finished_record() is not None):
                break
        yield from self._finish()

    def _background(self, fn: Any) -> None:
        def run() -> None:
            if self.net.alive.get((self.rid, self.inc)) and self._unreachable() <= self.world.now:
                fn()
        self.world.after(0.001, run)

    def _failure(self, rid: int, reason: str) -> None:
        if self.rounds is not None:
            self.rounds.abort_ring(f"replica {rid} {reason}")

    # -- the step ---------------------------------------------------------------------------------------
    def _drive(self, spec: StepSpec) -> Generator[Any, Any, StepResult]:
        core = StepCore(spec, self.state.cursor, self.state.synced)
        # as replica/step.py: a step that cannot compute its batch (the first, preparing one) does
        # not probe, and its rounds wait instead (else a benched replica asks again at once, forever)
        self.pace.can_probe = not spec.prepare and core.can_recompute
        t_begin = self.world.now
        act = core.start()
        while act.do is not Do.DONE:
            ev = yield from self._perform(act, core)
            act = core.on(ev)
        if core.stash is not None:
            self.stash = core.stash
        res = core.result
        if res.caught_up or res.synced:
            self.compute_times.clear()
        elif res.trained and core.clean and not spec.prepare:
            self.compute_times = (self.compute_times + [self._t_ready - t_begin])[-self.job.spec.straggler_window:]
            self.compute_round = self.committed_round
        plan = self.last_plan
        res.step = self.state.step
        res.stop = bool(plan is not None and plan.quorum.stop and res.committed)
        return res

    def _perform(self, act: Action, core: StepCore) -> Generator[Any, Any, Event]:
        plan, do = act.plan, act.do
        if do is Do.ROUND:
            self._t_round = self.world.now
            try:
                return Planned((yield from self._next_round(own=not core.spec.prepare)))
            except JobFinished as e:
                return Ended(e)
        if do is Do.PROBE:
            yield from self._etcd()
            assert self.coord is not None
            q = self.coord.latest_quorum()
            return Probed(q is not None and (q.max_step > self.state.step or q.gen != self.state.gen))
        if do is Do.ADOPT_FINAL:
            return FinalAdopted((yield from self._adopt_final()))
        assert plan is not None
        if do in (Do.COMPUTE, Do.RECOMPUTE):
            yield self.cfg.step_s * self.job.slowness(self.rid)
            self._t_ready = self.world.now
            if plan.role == "bench":  # a benched straggler's probe (rule 14)
                self.pace.probe(self._t_round, self._t_ready, self._t_ready - self._t_round)
            self.grads = self._own(plan.batch_index, plan.skip)
            return Done()
        if do is Do.EXTRA:
            extra = tuple((s, k, j) for s, k in plan.extra for j in range(self.cfg.micro))
            self.grads = self._own(plan.batch_index, plan.skip) + extra + tuple(plan.micro)
            return Done()
        if do is Do.SYNC:
            return (yield from self._sync(plan))
        if do is Do.EXCHANGE:
            return Exchanged((yield from self._exchange(plan, act.save_grads)))
        if do is Do.CHECK:
            return Checked(not self.job.vetoes(self, plan))
        if do is Do.VOTE:
            return Voted(act.vote)
        if do is Do.RETRY:
            assert self.rounds is not None
            self.grads, self.cursor_stale = (), True
            self.rounds.ring_ok = False
            if self.replaced:  # replica/step.py `_fetched_in_vain`
                self.state, self.replaced = self.state.disown(), False
            return Done()
        if do is Do.RESTORE:
            ok = self.saved is not None
            self.grads, self.saved = (self.saved or ()), None
            return Restored(ok)
        if do is Do.APPLY:
            self._apply(plan)
            return Applied(self.state.cursor)
        if do is Do.COMMITTED:
            yield from self._checkpoint(plan)
        return Done()  # CLIP, RETRIED: nothing to do here

    def _own(self, k: int, skip: tuple[int, ...]) -> tuple:
        return tuple((self.rid, k, j) for j in range(self.cfg.micro) if j not in skip)

    def _view(self) -> RoundView:
        w = self.job.spec.straggler_window
        compute = None
        if len(self.compute_times) >= w:
            compute = (statistics.fmean(self.compute_times) * 1e3, self.compute_round, len(self.compute_times))
        return RoundView(self.state, self.committed_round, stop=False,
                         micro=self.cfg.micro if self.cfg.micro > 1 else 0, compute=compute,
                         probe=self.pace.probed(), cursor_stale=self.cursor_stale)

    def _next_round(self, own: bool) -> Generator[Any, Any, StepPlan]:
        """replica.Replica.next_round, in simulated time."""
        now = self.world.now
        self._spin = (now, self._spin[1] + 1) if self._spin[0] == now else (now, 0)
        if self._spin[1] > SPIN_ROUNDS:  # asks that never let time pass: the real replica would spin
            raise Livelock(f"t={now:.3f}: replica {self.rid} asked for {SPIN_ROUNDS} rounds without time passing")
        if self.stash is not None:
            plan, self.stash = self.stash, None
        else:
            assert self.rounds is not None
            rnd: Round = yield from self._wait(self.rounds.next_steps(self._view()))
            plan = rnd.plan
            if rnd.refused is not None:
                self.state = self.state.disown()
                self.job.note(self, f"disowned {rnd.refused}")
            if rnd.cursor != self.state.cursor:
                self.state = replace(self.state, cursor=rnd.cursor)
            if rnd.cursor_read:
                self.cursor_stale = False
        self.pace.planned(plan)
        if own and plan.contribute:
            plan = own_optimizer(plan, 0, self.rid)
        self.last_plan = plan
        return plan

    def _exchange(self, plan: StepPlan, save_grads: bool) -> Generator[Any, Any, int]:
        assert self.rounds is not None
        q = plan.quorum
        members = tuple(zip(q.members, q.incarnations, strict=True))
        trained = self.grads if plan.contribute else ()
        self.saved = self.grads if save_grads and plan.contribute else None
        ring = self.digests.ring_vector(q) if self.digests.ring_due(q) else None
        ex = self.net.submit(self.rid, q.epoch, plan.step, members, trained, self.ftar, ring)
        vote = OK
        if plan.lagging:  # fetch the healthy state while our zeros are on the wire
            vote = yield from self._fetch(plan, self.cfg.ftar_timeout_s)
        got, result, (why, culprit) = yield from self.net.wait(self.rid, ex, self.ftar, self.cfg.hang_timeout_s)
        if got != OK:
            peer = f"f{culprit}:{q.incarnations[q.index(culprit)]}" if culprit in q.members else None
            self.rounds.exchange_failed(q, RecoverableError(peer, why))
            vote = min(vote, FAILED)
        else:
            self.result = result
            if ring is not None:
                assert ex is not None and ex.sums is not None and len(ex.vectors) == len(members), "half-compared"
                if not self.digests.ring_verdict(q, ex.sums):
                    self.job.note(self, f"digests of {q.max_step} disagree on the ring")
        return vote

    def _fetch(self, plan: StepPlan, deadline_s: float) -> Generator[Any, Any, int]:
        q = plan.quorum
        src = q.contributors[self.rid % len(q.contributors)]
        vote, got = yield from self.net.fetch((src, q.incarnations[q.index(src)]), wire_version(q.gen, plan.step),
                                              deadline_s)
        if vote == OK:
            assert got is not None
            self.model = got
            self.state = replace(self.state, batches=got.batches)
            self.replaced = True
        elif vote == LOST:
            self.model = ModelState(-1, -1, -1)  # partly overwritten
        return vote

    def _apply(self, plan: StepPlan) -> None:
        q = plan.quorum
        trained = self.result or ()
        self.replaced = False
        self.job.check_step(self, plan, trained)
        self.model = self.model.applied(plan.step, trained, plan.lr_factor)
        self.state = self.state.committed(plan.step, q.gen, (q.round, q.epoch), trained=plan.role == "train",
                                          new_batch=not plan.cont, mine=(plan.batches or {}).get(self.rid))
        self.committed_round = q.round
        if not self.model.tainted:
            self.own[(q.gen, plan.step)] = self.model.digest
        self.world.note(f"r{self.rid}.{self.inc} commit {q.gen}:{plan.step} {plan.role} {self.model.digest:x}")
        assert self.writer is not None
        self.writer.add(plan.step, q.epoch, q.round, q.gen, plan.batches or {})
        self.digests.take(self.state.step, self.model.digest)
        self.grads, self.saved, self.result = (), None, None

    # -- sync rounds, checkpoints, the end ------------------------------------------------------------
    def _sync(self, plan: StepPlan) -> Generator[Any, Any, Event]:
        """replica/step.py's sync round, with catchup/sync.py's steps on the simulator's I/O."""
        assert self.coord is not None
        q, root = plan.quorum, self.coord.root
        yield from self._etcd()
        vote = OK
        if plan.role == "source":
            rw = q.rewind or {}
            cursors: Optional[dict[int, int]] = None
            if rw.get("checkpoint"):
                got = self.job.checkpoints.get(int(str(rw["checkpoint_step"])))
                if got is None:
                    vote = FAILED
                else:
                    self.model, cursors = got
            if vote == OK and rw:
                T = q.max_step
                if cursors is None:
                    cursors = ledger.cursors_at(self.store, root, T, range(self.cfg.replicas))
                ledger.seed_generation(self.store, root, q.gen, T, cursors, **{
                    "from": rw["from"], "checkpoint": rw["checkpoint"], "source": self.rid, "round": q.round})
                for kv in self.store.get_prefix(keys.ckpts(root))[0]:  # the discarded future's checkpoints
                    if int(json.loads(kv.value)["step"]) > T:
                        self.store.delete(kv.key)
                self.job.rewound(self, q, T)
            if vote == OK:
                self.job.check_source(self, q)
                self.model = replace(self.model, step=q.max_step)
                self.net.publish(self.rid, self.inc, wire_version(q.gen, q.max_step), self.model)
        else:
            vote = yield from self._fetch(plan, self.cfg.sync_timeout_s)
        if vote == LOST:
            raise ReplicaStateLost(f"replica {self.rid}: adopting replica {q.source}'s state failed midway")
        if vote != OK:
            return Synced(False, self.state.cursor)
        self.state = self.state.adopted(q.max_step, q.gen, (q.round, q.epoch))
        self.replaced = False
        yield from self._etcd()  # our cursor in the round's generation (replica/step.py)
        self.state = replace(self.state, cursor=ledger.read_cursor(self.store, root, self.rid, q.gen))
        self.digests.take(self.state.step, self.model.digest)
        return Synced(True, self.state.cursor)

    def publish_for(self, q: Quorum, rid: int, rank: int, step: int, batches: int) -> None:
        """The round client's `StateTransfer.publish_for`: serve our state to the lagging."""
        if adopt_role(q, rid) == "train" and self.model.step == step:
            self.net.publish(self.rid, self.inc, wire_version(q.gen, step), self.model)

    def _checkpoint(self, plan: StepPlan) -> Generator[Any, Any, None]:
        """The writer (the lowest-id contributor) saves every ckpt_every steps, after recording
        its commits in the ledger (strategy/checkpoints.py); the record goes to etcd once saved."""
        q, step = plan.quorum, self.state.step
        every = self.cfg.ckpt_every
        if not every or step % every or plan.role != "train" or self.rid != min(q.contributors):
            return
        yield from self._etcd()
        assert self.writer is not None and self.coord is not None
        if self.writer.flush() is not None:
            self.state = self.state.disown()
            return
        root = self.coord.root
        cursors = {s: (q.cursor_of(s) + 1 if s in q.contributors else ledger.read_cursor(self.store, root, s, q.gen))
                   for s in range(self.cfg.replicas)}
        self.job.save_checkpoint(step, q.gen, self.model, cursors)

    def _finish(self) -> Generator[Any, Any, None]:
        return (yield from sim_ending.finish(self))

    def _adopt_final(self) -> Generator[Any, Any, bool]:
        return (yield from sim_ending.adopt_final(self))
