"""One optimizer step of one replica rank, as its caller drives it (docs/ARCHITECTURE.md, "A step").

    step = replica.begin(batch=k)            # replica/replica.py
    for ask in step:                         # what the replica asks of its caller, in order
        if ask.do is Do.COMPUTE: ...         # forward/backward of the slot batch (but ask.plan.skip)
        elif ask.do is Do.CHECK: ...         # clip the averaged gradients; step.veto = True to retry
        elif ask.do is Do.COMMITTED: ...     # schedulers, loaders, logs
    step.result                              # trained, caught up, stale, stop, ...

`Step` is the driver of the step's pure core (core.py): it performs what the core asks of the
replica (the round, a sync round, the exchange, the vote, the optimizer step) and yields what the
core asks of the caller (`core.CALLER`). A reader follows the whole step in the caller, this
module and core.py; the parts it calls (rounds.py, exchange.py, catchup/) are leaves.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterator, Optional

from lightning_ft.constants import Role
from lightning_ft.coord.membership import JobFinished
from lightning_ft.replica import ledger, startup
from lightning_ft.replica.core import (CALLER, Action, Applied, Checked, Do, Done, Ended, Event, Exchanged,
                                       FinalAdopted, Planned, Probed, Restored, StepCore, StepSpec, Synced, Voted)
from lightning_ft.replica.plan import FAILED, OK, StepPlan, StepResult

if TYPE_CHECKING:
    from lightning_ft.replica.replica import Replica

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ask:
    """What the replica asks of its caller in a step: `do` (one of core.CALLER) for `plan`."""

    do: Do
    plan: StepPlan


class Step:
    """One optimizer step: iterate over its `Ask`s, answer each, then read `result`."""

    def __init__(self, replica: Replica, spec: StepSpec) -> None:
        self.core = StepCore(spec, replica.cursor, replica.synced)
        self.r = replica
        self.veto = False
        """The caller's answer to CHECK: the averaged gradients failed its check; retry the step."""
        self.replaced = False
        """A fetch replaced this rank's state in this round (a catch-up or an adoption)."""
        self.share: Optional[tuple[int, int]] = None
        """The caller's answer to COMPUTE when it can be shrunk: (micro-batches of its slot batch
        it computed, of how many), so the straggler measure counts a whole slot batch."""
        replica.pace.can_probe = not spec.prepare and self.core.can_recompute  # benched: it measures its pace
        self.round_s = 0.0
        """Seconds this step waited for its rounds (not compute: the straggler measure leaves them out)."""

    @property
    def result(self) -> StepResult:
        return self.core.result

    def __iter__(self) -> Iterator[Ask]:
        """The step's conversation with its core: perform what it asks of the replica, yield
        what it asks of the caller."""
        r, core = self.r, self.core
        t_begin = None if core.spec.prepare else r.t_free
        every = r.digests.checkpoint_every
        if every and r.step % every == 0:
            t_begin = None  # the checkpoint writer staged its state since: not compute
        t_round = time.monotonic()
        try:
            act = core.start()
            while act.do is not Do.DONE:
                if act.disarm:
                    r.exchange.disarm()
                if act.do in CALLER:
                    assert act.plan is not None  # the caller's work is always for a round
                    if act.do is Do.CLIP and r.scaler is not None:
                        r.scaler.unscale(r.stepped_optimizer(act.plan))  # as the contributors' were
                    self.veto = False
                    yield Ask(act.do, act.plan)
                    if act.do in (Do.COMPUTE, Do.RECOMPUTE):
                        r.t_ready = time.monotonic()
                        if act.plan.role == Role.BENCH:  # a probe: our pace while benched (rule 14),
                            # from the ask for its round (a stop anywhere in the loop counts) to its end
                            r.pace.probe(t_round, r.t_ready, r.t_ready - t_round)
                    act = core.on(Checked(not self.veto) if act.do is Do.CHECK else Done())
                elif act.do is Do.ROUND:
                    t_round = time.monotonic()
                    act = core.on(self._perform(act))
                    self.round_s += time.monotonic() - t_round
                else:
                    act = core.on(self._perform(act))
            if act.disarm:
                r.exchange.disarm()
        finally:
            r.t_free = time.monotonic()
        if core.stash is not None:
            r.stash = core.stash
        self._measure(t_begin)
        self._outcome()

    def _perform(self, act: Action) -> Event:
        """The replica's own part of the step: one action, its event."""
        r, plan = self.r, act.plan
        if act.do is Do.ROUND:
            try:
                return Planned(r.next_round(own=not self.core.spec.prepare))
            except JobFinished as e:
                return Ended(e)
        if act.do is Do.PROBE:
            return Probed(r.behind())
        if act.do is Do.ADOPT_FINAL:
            from lightning_ft.replica.catchup import ending

            return FinalAdopted(ending.adopt_final(r, r.linger_s))
        assert plan is not None
        if act.do is Do.SYNC:
            return Synced(self._sync(plan), r.cursor)
        if act.do is Do.EXCHANGE:
            return Exchanged(self._exchange(plan, act.save_grads))
        if act.do is Do.VOTE:
            return Voted(r.group.vote(act.vote))
        if act.do is Do.RETRY:
            self._retry(plan)
            return Done()
        if act.do is Do.RESTORE:
            return Restored(r.exchange.restore())
        assert act.do is Do.APPLY, act
        self._apply(plan)
        return Applied(r.cursor)

    # -- the exchange and the two-phase commit ------------------------------------------------------
    def _exchange(self, plan: StepPlan, save_grads: bool) -> int:
        """Average gradients over the contributors through FTAR (lagging: zeros, and fetch the
        healthy state meanwhile); this rank's vote."""
        r = self.r
        works = r.exchange.send(plan, save_grads)
        ring = None
        if r.digests.ring_due(plan.quorum):  # a steady round compares digests on the ring, after the gradients
            ring = r.exchange.send_digest(r.digests.ring_vector(plan.quorum))
            works = [*works, ring[1]]
        vote = OK
        if plan.lagging and plan.opt < 0:  # which optimizer the contributors step is not known: retry
            vote = FAILED
        elif plan.lagging:  # fetch the healthy state while our zeros are on the wire
            vote = self._fetch(plan, deadline_s=r.ftar.timeout_s)
        err = r.exchange.wait(plan, works)
        if err is not None:
            r.rounds.exchange_failed(plan.quorum, err)
            vote = min(vote, FAILED)
        if ring is not None and err is None and not r.digests.ring_verdict(plan.quorum, ring[0].tolist()):
            log.warning("replica %d rank %d: the replicas' digests of step %d disagree on the ring; the next round "
                        "compares them in etcd", r.rid, r.rank, plan.quorum.max_step)
        if vote == OK:
            r.exchange.write_grads()
            if plan.contribute and r.scaler is not None:
                # before clipping and the user's hooks, as Lightning does
                r.scaler.unscale(r.stepped_optimizer(plan))
        r.stats.exchange_s = r.exchange.seconds
        return vote

    def _fetch(self, plan: StepPlan, deadline_s: float) -> int:
        """Fetch the state of version plan.step (a catch-up or an adoption) from our source: OK,
        FAILED (nothing written: retry next round) or LOST (partly overwritten)."""
        r, q = self.r, plan.quorum
        src = q.contributors[(r.rid + r.rank) % len(q.contributors)]
        addr = r.rounds.source(q.round)
        if not addr:
            log.warning("replica %d rank %d: no state-server address of replica %d for round %d (it is gone)",
                        r.rid, r.rank, src, q.round)
            return FAILED
        vote = r.fetch_from(addr, plan.step, src, deadline_s, q.gen)
        self.replaced = self.replaced or vote == OK
        if vote == OK:
            st = r.stats
            log.info("replica %d rank %d %s step %d from replica %d: %.1f MB in %.3fs (%.2f GB/s)", r.rid,
                     r.rank, "adopted" if plan.sync else "caught up to", plan.step, src, st.catchup_mb,
                     st.catchup_s, st.catchup_gbps)
        return vote

    def _retry(self, plan: StepPlan) -> None:
        """A round's vote failed: the step is retried in a new round."""
        r = self.r
        self._fetched_in_vain()
        if r.scaler is not None:
            r.scaler.reset()
        r.stepped_optimizer(plan).zero_grad(set_to_none=True)
        r.cursor_stale = True
        r.stats.retries += 1
        r.rounds.ring_ok = False  # peers may be mid-collective: rebuild the ring next round

    def _fetched_in_vain(self) -> None:
        """The round failed after a fetch replaced our state (on some rank): we hold the source's
        version, or a mix of versions over the ranks, not the step we claim, so the state is
        disowned until we adopt or catch up again (never a source: the simulator, seed 1496: a
        catch-up that fetched step 31 and lost its round was then the source of a rewind to step
        0, as if it held the initial state)."""
        r = self.r
        if r.group.any(self.replaced):
            r.state = r.state.disown()
        self.replaced = False

    def _apply(self, plan: StepPlan) -> None:
        """Every rank voted OK: apply the optimizer step with the plan's LR factor (or skip it on
        every replica alike, fp16 overflow), and advance the replica's state."""
        r = self.r
        self.replaced = False  # the fetched state is ours now: the round commits it
        opt = r.stepped_optimizer(plan)
        r.stats.freeze_s = r.transfer.freeze()
        skip = r.scaler.overflowed(r.group.any) if r.scaler is not None else False
        if not skip:
            saved = [g["lr"] for g in opt.param_groups]
            for g in opt.param_groups:
                g["lr"] = g["lr"] * plan.lr_factor
            try:
                opt.step()
            finally:
                for g, lr in zip(opt.param_groups, saved, strict=True):
                    g["lr"] = lr
        if r.scaler is not None:
            r.scaler.update(skip)
        opt.zero_grad(set_to_none=True)
        q = plan.quorum
        # `mine`: we trained it, or (constant policy, catching up) someone did for us
        r.state = r.state.committed(plan.step, q.gen, (q.round, q.epoch), trained=plan.role == "train",
                                    new_batch=not plan.cont, mine=(plan.batches or {}).get(r.rid))
        r.committed_round = q.round
        writer = r.parts.writer
        if writer is not None:  # recorded before our next full round's report: off the step's path
            writer.add(plan.step, q.epoch, q.round, q.gen, plan.batches or {})
        r.take_digest()
        if r.incarnation > 0 and r.restart_breakdown is None:
            startup.mark("first_step")
            r.restart_breakdown = startup.restart_breakdown()
            if r.is_leader:
                r.event("restart_breakdown", **r.restart_breakdown)

    # -- sync rounds: the job's start, resumes and rewinds ---------------------------------------
    def _sync(self, plan: StepPlan) -> bool:
        """A sync round: the source (loading the rewind's checkpoint first, if any) publishes its
        state, every other member adopts it. Returns whether the round succeeded here."""
        from lightning_ft.replica.catchup import sync

        r = self.r
        t0 = time.perf_counter()
        q = plan.quorum
        vote, cursors = OK, None
        if plan.role == "source":
            rw = q.rewind or {}
            if rw.get("checkpoint"):
                at = int(str(rw["checkpoint_step"]))
                vote, cursors = sync.load_rewind_checkpoint(r, str(rw["checkpoint"]))
                if vote != OK:
                    r.bad_checkpoints.add(at)
            if vote == OK and rw and r.is_leader:
                r.state = replace(r.state, cursor=sync.start_generation(r, q, cursors))
            if vote == OK:
                r.state = replace(r.state, step=q.max_step)
                sync.publish_source(r, q)
        else:
            vote = self._fetch(plan, deadline_s=r.settings.sync_timeout_s)
        if not sync.agreed(r, q, vote):
            self._fetched_in_vain()
            return False
        self.replaced = False
        r.state = r.state.adopted(q.max_step, q.gen, (q.round, q.epoch))
        # Our slot's cursor in the round's generation, whatever generation our cursor was read in: a
        # replica whose adoption in a rewind failed, and that is the source of a later sync round of
        # the new generation, held the old generation's cursor and trained the slot on from there
        # (the simulator, seed 55: batches 0-24 of a slot never trained in generation 1).
        cur = ledger.read_cursor(r.store, r.root, r.rid, q.gen) if r.is_leader else 0
        r.state = replace(r.state, cursor=r.group.broadcast(cur))
        r.take_digest()
        if plan.role == "adopt" and r.is_leader:
            sync.announce(r, q, time.perf_counter() - t0)
        return True

    # -- what the step did ------------------------------------------------------------------------
    def _measure(self, t_begin: Optional[float]) -> None:
        """A step trained cleanly (its first round, no retry, catch-up or recomputation) adds its
        compute time, from the previous step's return to ready-to-exchange, less its wait for the
        round (a full round's etcd round trip is no compute; an overlapped round is waited for
        after ready-to-exchange), to the straggler measure (coord/stragglers.py); a catch-up or
        sync starts the measure afresh."""
        r, res = self.r, self.core.result
        if res.caught_up or res.synced:
            r.pace.forget()
        elif res.trained and self.core.clean and t_begin is not None and r.t_ready is not None:
            done, of = self.share if self.share is not None and self.share[0] > 0 else (1, 1)
            waited = 0.0 if self.core.spec.computed else self.round_s
            secs = max(0.0, r.t_ready - t_begin - waited) * of / done  # per whole slot batch
            r.pace.step(t_begin, r.t_ready, secs, r.committed_round)

    def _outcome(self) -> None:
        """The step's result as the caller reads it: the committed count, the last round's role,
        the job's stop decision and who writes."""
        r, res, plan = self.r, self.core.result, self.r.last_plan
        res.step = r.step
        res.role = plan.role if plan is not None else ""
        res.stop = bool(plan is not None and plan.quorum.stop and res.committed)
        res.writer = r.rid == (min(plan.quorum.contributors) if plan is not None else 0)
