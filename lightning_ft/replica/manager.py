"""The per-step protocol of one replica rank, framework-free (docs/ARCHITECTURE.md, "A step").

    mgr = ReplicaManager(model, optimizer, Identity(...), Settings.from_config(cfg), group=...)
    mgr.start()                         # FTAR + catch-up transport; the leader registers
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

The class is built in layers, one concept per module, each calling only down:
replica/base.py (identity, parts, setup, queries) -> history.py (ledger, digests) -> sync.py
(catch-up fetch, sync rounds, rewinds, checkpoint loads) -> rounds.py (a round's quorum and
ring) -> this module (the step: run_step, exchange, the two-phase commit). The round's types and
votes are in plan.py; its knobs in settings.py.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, Callable, Optional


from lightning_ft.coord.coordinator import JobFinished
from lightning_ft.ftar.ring import neighbours
from lightning_ft.ftar.transport.base import FTARError, FatalError
from lightning_ft.replica import startup

from lightning_ft.replica.base import ReplicaBase
from lightning_ft.replica.plan import (FAILED, LOST, OK, ReplicaStateLost, StaleManualStep, StepPlan, StepResult,
                                       StepStats, lr_factor)
from lightning_ft.replica.rounds import Rounds

__all__ = ["FAILED", "LOST", "OK", "ReplicaBase", "ReplicaManager", "ReplicaStateLost", "StaleManualStep", "StepPlan",
           "StepResult", "StepStats", "lr_factor"]

log = logging.getLogger(__name__)


class ReplicaManager(Rounds):
    """One per rank: the step (over rounds, sync, history and the base)."""

    def set_scaler(self, scaler: Any) -> None:
        """Scale the loss with this `torch.amp.GradScaler` (the caller's backward multiplies the
        loss by its scale); the manager unscales the averaged gradients, skips overflowed steps
        on every replica alike, updates the scale, and carries it in catch-up and checkpoints."""
        from lightning_ft.replica.scaler import ReplicaScaler

        self.scaler = ReplicaScaler(scaler) if scaler is not None else None

    # -- the step --------------------------------------------------------------------------------
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
        return self._outcome(res)

    def _outcome(self, res: StepResult) -> StepResult:
        """The step's result as the caller reads it: the committed count, the last round's role,
        the job's stop decision and who writes (one object; the glue reads nothing else)."""
        plan = self.last_plan
        res.step = self.step
        res.role = plan.role if plan is not None else ""
        res.stop = bool(plan is not None and plan.quorum.stop and res.committed)
        res.writer = self.rid == (min(plan.quorum.contributors) if plan is not None else 0)
        return res

    def run_step(self, compute: Callable[[StepPlan], Any], batch: Optional[int] = None,
                 recompute: Optional[Callable[[StepPlan], Any]] = None, pending: Optional[Future] = None,
                 computed: bool = False, after_exchange: Optional[Callable[[], Optional[bool]]] = None,
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
            done, of = self.share if self.share is not None and self.share[0] > 0 else (1, 1)
            self._compute.append((self._t_ready - t_begin) * of / done)  # per whole slot batch
            self._compute_round = self._committed_round
        self.share = None
        return self._outcome(res)

    def planned_skip(self) -> tuple[int, ...]:
        """The micro-batches of its slot batch this replica gives away in its next train round, as
        the last quorum it adopted announced (`Quorum.shrink_next`; stragglers policy "shrink"). A
        caller computing before that round's plan arrives skips these; `StepPlan.skip` is what the
        round decided, and `run_step(extra=...)` makes up any difference."""
        plan = self.last_plan
        for rid, g, n in plan.quorum.shrink_next if plan is not None else ():
            if rid == self.rid and n == self.micro_batches:
                return tuple(range(n - g, n))
        return ()

    def _run_step(self, compute: Callable[[StepPlan], Any], batch: Optional[int], recompute: Optional[Callable],
                  pending: Optional[Future], computed: bool, after_exchange: Optional[Callable[[], Optional[bool]]],
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
        on the averaged gradients before the optimizer step (clipping); returning False makes
        this rank vote "failed", so the replica retries the step in a new round. `extra(plan)` adds the
        gradients of `plan.extra`, the absent slots' batches this replica trains under
        batch_policy "constant", and of `plan.micro`, the micro-batches of shrunk stragglers, to
        those of its own batch (forward and backward each); for a shrunk replica it also makes the
        gradients of its own batch those of every micro-batch but `plan.skip` (the caller knows
        which it computed)."""
        res = StepResult(loss=loss)
        # A caller that can be shrunk holds its own slot batch as it decided before the plan
        # (`planned_skip`): None says "not checked against this plan yet", and `extra` is called.
        fresh: Optional[tuple] = None if self.micro_batches and extra is not None else ()
        in_grads = fresh
        """What the local gradients hold besides our own slot batch (`StepPlan.extras`)."""
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
            if computed and in_grads and in_grads != plan.extras:
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
                replaced, in_grads = False, fresh
            elif not computed:
                res.loss = compute(plan)
                computed, replaced, in_grads = True, False, fresh
                self._t_ready = time.monotonic()
            if in_grads != plan.extras and (plan.extras or in_grads is None):
                if extra is None:
                    raise RuntimeError(f"replica {self.rid}: the round assigns it absent slots' batches "
                                       f"{list(plan.extra)} (batch_policy 'constant') or a shrunk straggler's "
                                       f"micro-batches {list(plan.micro)} (skipping {list(plan.skip)} of its own), "
                                       "but its caller passes no run_step(extra=...) to train them")
                extra(plan)
                in_grads = plan.extras
            # A retry recomputes when it can; only a caller that cannot (manual optimization)
            # pays for a saved copy of its local gradients.
            vote = self.exchange(plan, save_grads=recompute is None)
            if vote == OK and self.scaler is not None:
                # before clipping and the user's hooks, as Lightning does
                self.scaler.unscale(self.stepped_optimizer(plan))
            if vote == OK and after_exchange is not None and after_exchange() is False:
                vote = FAILED  # the caller's check of the averaged gradients failed: retry the step
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

    # -- exchange --------------------------------------------------------------------------------
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

    # -- two-phase commit and the LR factor ------------------------------------------------------
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
        self.stats.freeze_s = self.catchup.freeze()
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
        # `mine`: we trained it, or (constant policy, catching up) someone did for us
        self.state = self.state.committed(plan.step, q.gen, (q.round, q.epoch), trained=plan.role == "train",
                                          new_batch=not plan.cont, mine=(plan.batches or {}).get(self.rid))
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

    # -- shutdown --------------------------------------------------------------------------------
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
        if self._catchup is not None:
            self._catchup.close()
        if self._store is not None and self._etcd:
            self._store.close()
