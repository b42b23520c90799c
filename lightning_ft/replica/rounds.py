"""The round client of one rank (docs/ARCHITECTURE.md, "Rounds"): the leader's report and the
quorum's decision (a full round through etcd, a steady round without it), handed to every rank
of the replica with its ring neighbours and the state source it fetches from; the ring rebuilt
on a new epoch; this replica's plan of the round (core.plan_of), and our state served to the
lagging members of a round we train in.

A round runs on one thread at a time: the quorum thread while it overlaps forward/backward
(`Replica.begin_step`), else the training thread, which hands the client over through the
round's future and reads nothing of it before the future resolves. The client reads the
replica's state only from the `RoundView` snapshot the training thread took, and returns what
the round changed (`Round`) instead of writing it."""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable, Generator, Optional

from lightning_ft.constants import Role
from lightning_ft.coord import stragglers
from lightning_ft.coord.coordinator import Coordinator, wait_out
from lightning_ft.coord.quorum import LocalView, adopt_role, must_abort, steady_next
from lightning_ft.coord.round_records import Quorum
from lightning_ft.coord.store import StoreError
from lightning_ft.ftar.engine import FTAR
from lightning_ft.ftar.ring import neighbours
from lightning_ft.ftar.transport.base import FatalError, FTARError, RecoverableError
from lightning_ft.replica import ledger
from lightning_ft.replica.catchup.transfer import StateTransfer
from lightning_ft.replica.core import plan_of
from lightning_ft.replica.group import ReplicaGroup
from lightning_ft.replica.guard import Digests
from lightning_ft.replica.plan import StepPlan
from lightning_ft.replica.replica_state import ReplicaState
from lightning_ft.replica.settings import Settings
from lightning_ft.threads import name_current

log = logging.getLogger(__name__)

RECORD_EVERY = 32
"""Steady rounds between two that the lowest-id member records in etcd (for the supervisor and
joiners); the others write nothing to etcd (docs/ARCHITECTURE.md, "Steady rounds"). Sparse records
need three rules the simulator checks (lightning_ft/sim): a member whose lease lapsed comes back as
a joiner (its report stands for every round: the newest recorded round may be one the others
passed long ago), a decider whose own view is older takes the newest recorded round before its
round as the previous one, and a member that missed a halted round learns of the halt from its
key. Before them the netns link-cut test failed 6 of 8 runs at 32 (a member cut off from etcd was
left out to the end of the job)."""
RECORD_EVERY_S = 2.0
"""... or this many seconds, whichever comes first (slow steps)."""


@dataclass(frozen=True)
class RoundView:
    """What this replica says of itself in a round, as the training thread saw it."""

    state: ReplicaState
    committed_round: int
    """The round of our last commit (a steady round follows only a committed one)."""
    stop: bool = False
    bad_checkpoints: tuple[int, ...] = ()
    phase: tuple[int, bool] = (0, False)
    micro: int = 0
    compute: Optional[tuple[float, int, int]] = None
    """(mean compute ms of its newest steps, the round of the newest, how many), once measured
    (coord/stragglers.py, `pace_over`)."""
    probe: Optional[tuple[float, float]] = None
    """Benched (rule 14): (its probe's mean compute ms or -1, the seconds it covers; -1: it cannot
    probe)."""
    cursor_stale: bool = False
    """A commit failed since the cursor was read: others may have committed our batch."""
    multi: bool = False
    """Several optimizers (quorum rule 15)."""


@dataclass(frozen=True)
class Round:
    """What one round decided for this rank."""

    quorum: Quorum
    cursor: int
    """Our slot's cursor for the round (re-read from the ledger where the round needs it)."""
    cursor_read: bool
    """The cursor was re-read from the ledger (the view's `cursor_stale` is answered)."""
    refused: Optional[tuple[int, int]]
    """Steps the ledger refused to record for us (evicted or lapsed): the state is disowned."""
    quorum_s: float
    reconfigure_s: float
    plan: StepPlan
    """This replica's plan of the round."""


class RoundClient:
    """The rounds of one rank; the leader also owns the coordinator's side of them."""

    def __init__(self, rid: int, group: ReplicaGroup, ftar: FTAR, digests: Digests, transfer: StateTransfer,
                 rank_addrs: list[str], settings: Settings, replicas: int,
                 clock: Callable[[], float] = time.monotonic,
                 background: Optional[Callable[[Callable[[], None]], None]] = None) -> None:
        """`clock` and `background` (runs a call off the round's path; default: a thread of its
        own) are the simulator's to replace (lightning_ft/sim)."""
        self.rid, self.group, self.ftar, self.digests, self.transfer = rid, group, ftar, digests, transfer
        self.settings, self.replicas = settings, replicas
        self._clock = clock
        self.rank_addrs = rank_addrs
        """Every rank's FTAR address in this replica (the leader forwards aborts to them)."""
        self.coord: Optional[Coordinator] = None
        """The leader's coordinator (None on other ranks)."""
        self.writer: Optional[ledger.LedgerWriter] = None
        """The leader's ledger writer: flushed before each full round's report."""
        self.epoch = -1
        """The ring epoch FTAR is connected for."""
        self.ring_ok = True
        """False after a failed exchange or commit: report it, and the next round rebuilds the ring."""
        self.blame: tuple[int, ...] = ()
        self._peers_epoch = -1
        self._ring_peers: tuple[int, Optional[str], Optional[str]] = (-1, None, None)
        """(epoch, left, right): this rank's ring neighbours' FTAR addresses, from the leader."""
        self._src_state: tuple[int, Optional[str]] = (-1, None)
        """(round, address): the state server this rank fetches from in that round."""
        self._bg: Optional[ThreadPoolExecutor] = None
        self._background = background or self._in_thread
        self._recorded: tuple[int, float] = (-1, clock())
        """(round, when) of the last steady round this leader recorded."""
        self._reported = -1
        """The round of the newest step of the compute measure we last reported (stragglers.self_check)."""

    @property
    def is_leader(self) -> bool:
        return self.group.is_leader

    def source(self, round: int) -> Optional[str]:
        """The state-server address this rank fetches from in `round` (None: none was handed out)."""
        got, addr = self._src_state
        return addr if got == round else None

    def next(self, view: RoundView) -> Round:
        """Report and obtain the next round (every rank; the leader talks to etcd), and connect
        the ring if its epoch changed."""
        return wait_out(self.next_steps(view), self.coord.membership.wake if self.coord is not None else None)

    def next_steps(self, view: RoundView) -> Generator[float, None, Round]:
        """`next` as a generator: it yields how long to wait for the coordinator's wake (while a
        full round is decided) and returns the round (the simulator, lightning_ft/sim, runs it on
        its virtual clock)."""
        t0 = time.perf_counter()
        digest = self.digests.for_report(view.state.step)
        msg: Any = None
        refused = None
        if self.is_leader:
            try:
                assert self.coord is not None  # the leader registered in start()
                self.coord.heartbeat()
                msg = self._steady_round(view) if self.coord.outside is None else None
            except Exception as e:
                msg = e
        if self.is_leader and msg is None:
            try:
                msg, refused = yield from self._full_round(view, digest)
            except Exception as e:  # Evicted, QuorumTimeout, JobHalted, StoreError: every rank must exit
                msg = e
        table = self._peer_table(msg[0]) if self.is_leader and isinstance(msg, tuple) else None
        if isinstance(msg, tuple):
            msg = (*msg, table is not None, refused)
        msg = self.group.broadcast(msg)
        if isinstance(msg, Exception):
            raise msg
        q, cursor, read, scatter, refused = msg
        if scatter:  # the ring changed, or we fetch a state: each rank gets its own addresses
            mine = self.group.scatter(table)
            if "left" in mine:
                self._ring_peers = (q.epoch, mine["left"], mine["right"])
            if "src" in mine:
                self._src_state = (q.round, mine["src"])
        quorum_s = time.perf_counter() - t0
        role = adopt_role(q, self.rid)
        st = self.settings
        if role == Role.BENCH:  # rule 14 benched us: no ring, nothing to train; the caller probes
            plan = plan_of(q, self.rid, role, cursor, st.batch_policy, st.lr_intervention, self.replicas)
            return Round(q, cursor, read, refused, quorum_s, 0.0, plan)
        reconfigure_s = self._connect(q) if q.epoch != self.epoch else 0.0
        if q.lagging and role == "train":
            self.transfer.publish_for(q, self.rid, self.group.rank, view.state.step, view.state.batches)
        plan = plan_of(q, self.rid, role, cursor, st.batch_policy, st.lr_intervention, self.replicas)
        if view.multi and plan.opt < 0 and role == "train" and view.phase[0] >= 0:
            # A round nobody named an optimizer for is trained with the contributors' own first one;
            # a lagging replica cannot know it, and sits it out (step.py's exchange).
            plan = replace(plan, opt=view.phase[0])
        return Round(q, cursor, read, refused, quorum_s, reconfigure_s, plan)

    def _full_round(self, view: RoundView, digest: Optional[tuple[int, str]]
                    ) -> Generator[float, None, tuple[tuple, Optional[tuple[int, int]]]]:
        """Leader: record our commits, report, and wait for the round's decision."""
        assert self.coord is not None and self.writer is not None  # the leader's, from start()
        state = view.state
        if self.coord.outside is None:  # (benched: that was done when it left the steady rounds)
            self.coord.record_committed(view.committed_round)  # the steady rounds end: the last one is recorded
        refused = self.writer.flush()  # the previous steps' records precede our report for this one
        if refused is not None:
            state = state.disown()
        cursor, root, read = state.cursor, self.coord.root, False
        if view.cursor_stale:  # a failed commit: others may have committed our batch
            cursor, read = max(cursor, ledger.read_cursor(self.writer.store, root, self.rid, state.gen)), True
        report = self._report(view, state, digest)
        q = yield from self.coord.quorum_steps(state.step, timeout_s=self.settings.quorum_timeout_s, cursor=cursor,
                                               ring_ok=self.ring_ok and not self.ftar.broken, **report)
        if adopt_role(q, self.rid) == "catchup":
            # Read after the decision: the contributors recorded the previous step (possibly
            # with our batch, if we failed to commit it) before reporting.
            cursor = ledger.read_cursor(self.writer.store, root, self.rid, q.gen)
        return (q, cursor, read), refused

    def _report(self, view: RoundView, state: ReplicaState, digest: Optional[tuple[int, str]]) -> dict[str, Any]:
        """Leader: what our full-round report says about us (Coordinator.quorum's fields). A
        disowned state claims no generation, so the quorum never counts it as the job's."""
        out: dict[str, Any] = state.report()
        out.update(blame=self.blame, stop=view.stop, bad_checkpoints=view.bad_checkpoints, opt=view.phase[0],
                   cont=view.phase[1], micro=view.micro, bench=-1, bench_s=0.0, probe_s=0.0)
        if view.probe is not None:  # benched: our pace outside the rounds (the coordinator adds `bench`)
            out.update(compute_ms=round(view.probe[0], 3), compute_round=-1, compute_n=0,
                       probe_s=round(view.probe[1], 3), probing=view.probe[1] >= 0)
        elif view.compute is not None:
            out.update(compute_ms=round(view.compute[0], 3), compute_round=view.compute[1], compute_n=view.compute[2])
            self._reported = view.compute[1]
        else:  # not measured since we (re)joined: say so, or the report would keep an old value
            out.update(compute_ms=-1.0, compute_round=-1, compute_n=0)
        if digest is not None:
            out.update(digest=digest[1], digest_step=digest[0])
        return out

    def _steady_round(self, view: RoundView) -> Optional[tuple]:
        """Leader: the next round without etcd when nothing changed (quorum.steady_next); else
        None, after stopping the others from going steady when they may (`must_abort`)."""
        coord = self.coord
        assert coord is not None
        q = coord.current
        if q is None:
            return None
        disagreed, verified = self.digests.after(q)
        spec = coord.spec
        rules = stragglers.Rules(spec.straggler_threshold, spec.straggler_policy, spec.min_replicas, spec.replicas,
                                 spec.straggler_window)
        slow = stragglers.self_check(view.compute, self.rid, q.pace_ms, q.suspects, self._reported, rules,
                                     shrunk=any(e[0] == self.rid for e in q.shrink_next))
        # Under shrink and adaptive the split follows each window's measure, which only a full
        # round reads: their jobs keep a full round at every digest step (digests then compared in
        # etcd), every member alike; the other policies compare digests on the ring.
        periodic = (spec.straggler_policy in (stragglers.SHRINK, stragglers.ADAPTIVE)
                    and self.digests.scheduled(q.max_step + 1))
        lv = LocalView(committed=view.committed_round == q.round, changed=coord.changed,
                       digest_due=disagreed or periodic,
                       stop=view.stop, opt=view.phase[0], cont=view.phase[1], verified=verified, slow=slow)
        nxt = steady_next(q, lv)
        if nxt is None:
            if must_abort(q, lv):
                self.abort_ring(f"replica {self.rid} needs a full round after round {q.round}")
            if q.steady and not lv.committed:  # our steady round failed: report for its number
                coord.retract_steady()
            return None
        coord.adopt_steady(nxt)
        now = self._clock()
        if self.rid == nxt.members[0] and (nxt.round - self._recorded[0] >= RECORD_EVERY
                                           or now - self._recorded[1] >= RECORD_EVERY_S):
            # One leader records some of the steady rounds, off the critical path: a steady round
            # writes nothing to etcd; the supervisor's view of the job's step and a joiner's round
            # number lag by at most these. Their end is recorded before a full round's report.
            self._recorded = (nxt.round, now)
            self._background(lambda: coord.record_steady(nxt))
        return (nxt, view.state.cursor, False)

    def _in_thread(self, fn: Callable[[], None]) -> None:
        if self._bg is None:
            self._bg = ThreadPoolExecutor(1, thread_name_prefix=f"lft-bg-r{self.rid}", initializer=name_current,
                                          initargs=(f"lft-bg-r{self.rid}",))
        self._bg.submit(fn)

    def _connect(self, q: Quorum) -> float:
        """Connect FTAR for the ring of `q`'s epoch (a failed exchange always bumps it); the
        seconds it took. A neighbour that died while connecting fails this round; the next
        rebuilds the ring."""
        try:
            epoch, left, right = self._ring_peers
            if epoch != q.epoch or left is None or right is None:
                raise RecoverableError(None, f"no addresses for the ring of epoch {q.epoch} (a neighbour is gone)")
            seconds = self.ftar.join(q.epoch, len(q.members), q.index(self.rid), left, right)
            self.epoch = q.epoch
            self.ring_ok, self.blame = True, ()
            return seconds
        except FatalError:
            raise
        except FTARError as e:
            log.warning("replica %d rank %d: connecting the ring of epoch %d failed: %s", self.rid,
                        self.group.rank, q.epoch, e)
            self.ring_ok, self.blame = False, self.blamed(q, e)
            return 0.0

    def exchange_failed(self, q: Quorum, e: FTARError) -> None:
        """An exchange of round `q` failed: rebuild the ring next round. An exchange on a ring
        that failed to connect fails at once without a peer: keep the blame of the connect,
        which named the neighbour that did not answer."""
        self.ring_ok, self.blame = False, self.blamed(q, e) or self.blame

    def _peer_table(self, q: Quorum) -> Optional[list[dict]]:
        """Leader: what each of our ranks needs of other replicas' addresses for round `q`
        (None: nothing new). A new ring epoch: the rank's two ring neighbours (its own local
        rank in their replicas). A round in which we catch up or adopt: the state server each
        rank fetches from. Read through the coordinator's address book (coord/addresses.py):
        two replicas' blocks per ring change, not every member's."""
        coord = self.coord
        assert coord is not None
        role = adopt_role(q, self.rid)
        if role == Role.BENCH:
            return None
        ring = q.epoch != self._peers_epoch
        fetch = role in ("catchup", "adopt")
        if not ring and not fetch:
            return None
        incs = dict(zip(q.members, q.incarnations, strict=True))

        def of(rid: int) -> Optional[tuple]:
            if rid == self.rid:
                return tuple(self.rank_addrs), ()
            try:
                return coord.addresses(rid, incs[rid])
            except StoreError as e:  # no addresses: those ranks fail to connect, the round is retried
                log.warning("replica %d: could not read replica %d's addresses: %s", self.rid, rid, e)
                return None

        table: list[dict] = [{} for _ in range(self.group.world)]
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

    def blamed(self, q: Quorum, e: FTARError) -> tuple[int, ...]:
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

    # -- aborts (the leader's watch thread, or a round going to a full round) ------------------------
    def abort_ring(self, why: str) -> None:
        """Fail this rank's exchange now and, through their FTAR listeners, our other ranks'. A
        member dies or is evicted (the coordinator's watch thread), or we go to a full round
        while the others may go steady: each ring's other members fail at once on the closed
        links and close theirs in turn, so the failure goes round every ring without us
        dialling any other replica's ranks."""
        epoch = self.epoch
        self.ftar.abort(why)
        for addr in self.rank_addrs[1:]:
            threading.Thread(target=self._abort_rank, args=(addr, why, epoch), daemon=True).start()

    def _abort_rank(self, addr: str, why: str, epoch: int) -> None:
        try:
            self.ftar.abort_peer(addr, why, epoch)
        except Exception as e:  # the rank may be gone already; its own errors will surface
            log.warning("replica %d: could not forward abort to %s: %s", self.rid, addr, e)

    def close(self) -> None:
        if self._bg is not None:
            self._bg.shutdown(wait=True)
