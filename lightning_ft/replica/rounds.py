"""A round (docs/ARCHITECTURE.md, "Rounds"): the leader's report and the quorum's decision (full
rounds through etcd, steady rounds without it), handed to every rank with its ring neighbours and
state source; the ring rebuilt on a new epoch; the plan of the round; the early start that
overlaps the quorum with backward (`begin_step`)."""
from __future__ import annotations

import logging
import statistics
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Optional


from lightning_ft.coord.quorum import LocalView, Quorum, adopt_role, must_abort, steady_next
from lightning_ft.coord.store import StoreError
from lightning_ft.ftar.ring import neighbours
from lightning_ft.ftar.transport.base import FTARError, FatalError, RecoverableError
from lightning_ft.replica import ledger
from lightning_ft.replica.batch_policy import round_batches
from lightning_ft.threads import name_current

from lightning_ft.replica.plan import StepPlan, StepStats, lr_factor
from lightning_ft.replica.sync import Sync

log = logging.getLogger(__name__)


class Rounds(Sync):
    """The quorum of each round and its ring (over sync)."""

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
            self.batch_policy, q.contributors, {c: q.cursor_of(c) for c in q.contributors}, self.R, q.slot_cursors,
            q.shrunk)
        trained = rb.divisor if rb is not None else len(q.contributors)
        mine = rb if rb is not None and role == "train" else None  # what this replica trains besides its batch
        plan = StepPlan(step=q.max_step, quorum=q, role=role, divisor=trained,
                        lr_factor=lr_factor(self.lr_mode, trained, self.R), batch_index=self.cursor,
                        batches=rb.batches if rb is not None else ({} if cont else None),
                        extra=mine.extra_of(self.rid) if mine is not None else (),
                        micro=mine.micro_of(self.rid) if mine is not None else (),
                        skip=mine.skip_of(self.rid) if mine is not None else (),
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
        state: dict[str, Any] = self.state.report()
        state.update(blame=self._blame, stop=self.request_stop, bad_checkpoints=tuple(sorted(self._bad_ckpts)),
                     opt=self.phase[0], cont=self.phase[1], micro=self.micro_batches)
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
