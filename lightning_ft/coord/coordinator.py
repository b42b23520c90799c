"""A replica leader's view of the job in etcd: registration, leases, reports, the per-round
quorum, evictions and failure watches (docs/ARCHITECTURE.md, "The quorum"). `Coordinator`
is the rounds; it holds a `Membership` (coord/membership.py: registration, the lease, the
watches, addresses, evictions), and what the watches deliver is coord/watched.py.

Only replica leaders (local rank 0) talk to etcd; they fan the quorum out to their ranks.

Agreement. Every leader evaluates the pure `compute_quorum` on what it reads, and the first
to find the round ready *creates* `quorum/{round}` with a create-if-absent transaction.
Everyone, the writer included, then adopts the stored decision. etcd linearizes the create,
so one round has exactly one quorum: two leaders that raced with different views still
train with the same members (no split brain). A leader left out of a round it reported
for (a late joiner) moves to the next round; the healthy replicas never wait for it. Nobody
decides a round a member reports past (`round_log.passed`): it reports for that round.

Messages. A report (`members/{rid}`) and a quorum carry O(1) bytes per member: the per-rank
listener addresses are published once per lease under `addrs/` (coord/addresses.py) and read
by the leaders that need them when a ring changes (`addresses`).

Work per round is O(R). Only the round's decider watches `members/` (every report); it keeps
the reports its watch delivers and reads etcd for the decision once they could decide it
(`quorum.waiting_for`), not at every report. The other leaders watch `alive/{rid}` (one
small key per lease: failures and joiners), `evict/` and `quorum/` (one decision a round).

Liveness. `members/{rid}` and `alive/{rid}` are bound to a lease kept alive by a thread. The thread stops
refreshing once the training loop has made no progress (`heartbeat`) for `hang_timeout_s`,
so a hung replica drops out within TTL. A supervisor that sees a process die writes
`evict/{rid}/{inc}`, which removes it at once instead of after the TTL.
"""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Any, Callable, Generator, Optional, Sequence, TypeVar

from . import keys, round_log, straggler_rule, stragglers
from .addresses import Addresses
from .benched import IN, LEFT, Outside
from .membership import (CoordinatorClosed, Evicted, JobHalted, Membership,
                         MembershipSettings, QuorumTimeout, Runtime)
from .quorum import compute_quorum, waiting_for
from .round_records import Decision, Halt, History, JobSpec, Quorum, Report, decode_round
from .store import Store, StoreError

log = logging.getLogger(__name__)
_T = TypeVar("_T")


def wait_out(steps: Generator[float, None, _T], wake: Any) -> _T:
    """Run a generator that yields how long to wait for `wake` (a threading.Event) and returns a
    result: the blocking form of the coordinator's generators."""
    try:
        timeout = next(steps)
        while True:
            wake.wait(timeout)
            timeout = steps.send(None)
    except StopIteration as done:
        return done.value

class Coordinator:
    """The rounds as one leader takes part in them: full rounds decided through etcd, steady
    rounds adopted and recorded, the history a decision reads. It holds the leader's
    `membership` (coord/membership.py: registration, lease, watches, addresses, evictions).

    Threads (docs/ARCHITECTURE.md, "Threads"): the round thread (whichever thread runs the
    replica's round: its training thread, or its quorum worker `lft-quorum-r{rid}` while the
    round overlaps the backward pass; one at a time) calls everything here but `record_steady`
    (the replica's background recorder `lft-bg-r{rid}`; it reads only immutable fields) and
    `fence`, `report_stall` (an immutable snapshot of the lease). The rounds' state
    (`_current`, `_next_round`, `_before_steady`, `evaluations`, ...) is the round thread's
    alone; the watches learn the current round through `membership.watched.follow`.

    Args: as `Membership`'s, and
        on_event: called by the deciding leader as on_event(name, **fields) for rewind,
            diverged, halt and exclusion decisions (the manager appends them to events.jsonl).
        clock: the monotonic clock the hang timeout and round waits read (tests pass their own).
    """

    def __init__(self, store: Store, job: str, rid: int, incarnation: int, spec: JobSpec,
                 settings: Optional[MembershipSettings] = None, *, run: str = "",
                 on_failure: Optional[Callable[[int, str], None]] = None,
                 on_event: Optional[Callable[..., None]] = None, runtime: Optional[Runtime] = None) -> None:
        self.membership = m = Membership(store, job, rid, incarnation, spec, settings, run=run,
                                         on_failure=on_failure, runtime=runtime)
        clock = (runtime or Runtime()).clock
        self.store, self.rid, self.incarnation, self.spec, self.root = store, rid, incarnation, spec, m.root
        self.on_event = on_event
        self._clock = clock
        self._poll_s = m.settings.poll_interval_s
        self._slow_poll_s = max(m.settings.poll_interval_s * 5, 0.25)
        self._fallback_s = 2.0 * m.settings.lease_ttl_s
        self._current: Optional[Quorum] = None
        self._before_steady: Optional[Quorum] = None
        self._retracted: Optional[int] = None
        """The steady round we last retracted (its exchange failed for us), until we meet it again."""
        """The round a steady round followed (retract_steady goes back to it)."""
        self._next_round = 0
        self._last_reason = ""
        self.evaluations = 0
        """Decisions evaluated from etcd (one a round when the watched reports allow it)."""
        self._stragglers: set[int] = set()
        """Stragglers of the last round this leader decided (a `straggler` event per new one)."""
        self.outside: Optional[Outside] = None
        """Set while rule 14 benches us: we wait outside the rounds (coord/benched.py)."""

    # -- the membership, for callers -------------------------------------------------------------
    def register(self, step: int, addrs: Sequence[str] = (), state_addrs: Sequence[str] = (), **state: Any) -> None:
        """Join the job (`Membership.register`); the first round we report for follows the newest recorded."""
        self.membership.register(step, addrs, state_addrs, **state)
        self._next_round = self.membership.report.round

    def heartbeat(self) -> None:
        """The training loop made progress. Call at least every hang_timeout_s."""
        self.membership.heartbeat()

    def fence(self) -> dict[str, int]:
        """The ledger fence (`Membership.fence`)."""
        return self.membership.fence()

    def addresses(self, rid: int, incarnation: int) -> Optional[Addresses]:
        """(FTAR, state-server) addresses of every rank of (rid, incarnation) (`Membership.addresses`)."""
        return self.membership.addresses(rid, incarnation)

    def report_stall(self, stall: dict[str, Any]) -> None:
        """Publish where our exchange waits (`Membership.report_stall`)."""
        self.membership.report_stall(stall)

    def evict(self, rid: int, incarnation: int, reason: str) -> None:
        """Declare (rid, incarnation) dead, effective for everyone at once."""
        self.membership.evict(rid, incarnation, reason)

    def close(self, revoke: bool = True) -> None:
        """Stop the threads; with `revoke`, leave the job at once (`Membership.close`)."""
        self.membership.close(revoke)

    @property
    def changed(self) -> bool:
        """A watch saw a change since our last full-round report: the next round must be a full round."""
        return self.membership.changed

    @property
    def watching_reports(self) -> bool:
        """Whether we hold the members/ watch (we decide the rounds)."""
        return self.membership.watching_reports

    @property
    def current(self) -> Optional[Quorum]:
        """The round we are in (None before the first)."""
        return self._current

    # -- full rounds -----------------------------------------------------------------------------
    def quorum(self, step: int, timeout_s: Optional[float] = None, cursor: Optional[int] = None,
               ring_ok: bool = True, **state: Any) -> Quorum:
        """Report `step` for our next round and return the round's quorum, which includes us.
        `state`: Report fields describing our state (gen, synced, digest, digest_step, blame,
        bad_checkpoints); fields not given keep their last value, except that a digest is
        reported once.

        Blocks until the round is decided, moving to later rounds while we are left out (benched
        by rule 14: not; `outside`). Raises QuorumTimeout after `timeout_s`, Evicted if this
        incarnation was evicted, JobHalted if the job was stopped."""
        return wait_out(self.quorum_steps(step, timeout_s, cursor, ring_ok, **state), self.membership.wake)

    def quorum_steps(self, step: int, timeout_s: Optional[float] = None, cursor: Optional[int] = None,
                     ring_ok: bool = True, **state: Any) -> Generator[float, None, Quorum]:
        """`quorum` as a generator: it yields how long to wait for `membership.wake` (a watch event,
        a lapsed lease, close) before it looks again, and returns the quorum. `quorum` waits on a
        thread; the simulator (lightning_ft/sim) waits on its virtual clock."""
        m = self.membership
        probing = bool(state.pop("probing", False))
        if self.outside is not None:  # benched (rule 14): coord/benched.py
            how, q = yield from self.outside.steps(m, self._clock, step, {**state, "ring_ok": ring_ok, "cursor": (
                m.report.cursor if cursor is None else cursor)}, probing)
            if how == IN:
                self.outside = None
                self._adopt(q)
            if how != LEFT:
                return q
            self.outside = None  # no longer benched, not taken back: report for the next round
            self._current, self._next_round = q, q.round + 1
        deadline = None if timeout_s is None else self._clock() + timeout_s
        # Changes seen from here on count for the round after this one: whatever happened before
        # our report, the decider reads from etcd when it evaluates this round.
        m.new_report()
        state.setdefault("digest", "")
        state.setdefault("digest_step", -1)
        state.setdefault("blame", ())
        m.report = replace(m.report, ring_ok=ring_ok, cursor=m.report.cursor if cursor is None else cursor, **state)
        self._publish(step, self._next_round)
        started = last_get = self._clock()
        last_eval = started
        first = True
        while True:
            if m.closed:  # closed (the process exits): Python's exit would join this thread
                raise CoordinatorClosed(f"replica {self.rid}: the coordinator was closed while round "
                                        f"{m.report.round} waited")
            if first or self._clock() - last_get >= self._slow_poll_s:
                m.check_finished()
                m.check_halt()
            m.heartbeat()
            m.wake.clear()
            if m.lease_lost.is_set():
                m.recover_lease()
            round = m.report.round
            now = self._clock()
            raw = m.watched.decision(round)
            if raw is None and (first or now - last_get >= self._slow_poll_s):
                kv = self.store.get(self._round_key(round))
                raw, last_get = (kv.value if kv else None), now
            newer = self._newer_decision(round) if raw is None else None
            if newer is not None:
                # A round the others passed without recording it (we join, or our commit failed):
                # take the first later decision that has us, else report for the next round after
                # the fallback; never decide the stale round alone (seed 2858: two generations 1).
                n, nraw = newer
                qn, taken = self._take(nraw)
                if taken:
                    return qn
                if now - started >= self._fallback_s:
                    self._publish(step, n + 1)
                    started = self._clock()
                    continue
            decider = raw is None and newer is None and self._is_decider(now - started)
            if decider:
                m.watch_reports(True)
            # Evaluate from etcd once the watched reports could decide the round (and at least
            # every slow poll, whatever they say).
            if decider and (first or now - last_eval >= self._slow_poll_s or self._could_decide(round, now - started)):
                last_eval = now
                decision = self._evaluate(round, now - started)
                self._log_reason(decision.reason)
                if decision.passed > round:  # never decide a round the others passed: report for theirs
                    self._publish(step, decision.passed)
                    started = self._clock()
                    continue
                if decision.quorum is not None or decision.halt:
                    raw = decision.quorum.to_json() if decision.quorum is not None else \
                        Halt(decision.halt, round).to_json()
                    if self.store.create(self._round_key(round), raw):
                        self._decided(round, decision)
                    else:  # someone else decided first: theirs stands
                        kv = self.store.get(self._round_key(round))
                        assert kv is not None  # the create failed: the round's key exists
                        raw = kv.value
            first = False
            if raw is not None:
                q, taken = self._take(raw)
                if taken and q.steady and q.round == self._retracted:
                    # The steady round whose exchange failed for us was committed by a member that
                    # has now recorded it (steady rounds are recorded when their committers leave
                    # the steady rounds): it is over, and the next round is a full one for everyone.
                    self._retracted = None
                    self._publish(step, q.round + 1)
                    started = self._clock()
                    continue
                if taken:
                    return q
                # Left out: evicted (exit), benched (rule 14), or we reported too late (try the next round).
                if self.store.get(keys.evict(self.root, self.rid, self.incarnation)) is not None:
                    raise Evicted(f"replica {self.rid} incarnation {self.incarnation} was evicted; exiting so "
                                  "the supervisor restarts it")
                bench = stragglers.bench_entry(q.slow, self.rid)
                if bench is not None:
                    self.outside = Outside(*bench, self._clock(), q)
                    m.watched.forget_decisions(q.round)
                    return q
                if m.report.joining:
                    # our report counts for every round (rule 1): a later one may already have us
                    later = self._recorded_with_us(round)
                    if later is not None:
                        q, taken = self._take(later[1])
                        if taken:
                            return q
                self._publish(step, max(round, m.latest_round()) + 1)
                started = self._clock()
                continue
            if deadline is not None and self._clock() > deadline:
                raise QuorumTimeout(f"replica {self.rid}: no quorum for round {round} after {timeout_s:.1f}s; "
                                    f"last reason: {self._last_reason or 'waiting for the decider'}")
            yield self._poll_s

    def _round_key(self, round: int) -> str:
        return keys.quorum(self.root, round)

    def _publish(self, step: int, round: int) -> None:
        self.membership.publish(replace(self.membership.report, step=step, round=round))

    def _could_decide(self, round: int, waited_s: float) -> bool:
        """Whether the reports our watch delivered could decide `round` (quorum.waiting_for)."""
        reports, evicted = self.membership.watched.reports()
        previous = self._current if self._current is not None and self._current.round == round - 1 else None
        if previous is None and self._current is not None:
            return True  # we missed rounds: only etcd knows the previous quorum
        return not waiting_for(round, reports, evicted, previous, self.spec, waited_s)

    def _is_decider(self, waited_s: float) -> bool:
        """Whether to evaluate the round ourselves. The decider is the lowest-id member of the
        previous quorum not known dead; the others only wait for its decision. Anyone steps
        in after `fallback_s` (or at once at round 0), which is safe: creation is a CAS."""
        q = self._current
        if q is None:
            return self.membership.report.round == 0 or waited_s >= self._fallback_s
        alive = self.membership.watched.alive(q)
        return not alive or alive[0] == self.rid or waited_s >= self._fallback_s

    def _take(self, raw: bytes) -> tuple[Quorum, bool]:
        """A stored decision: raise JobHalted for a halt; else (its quorum, whether we are in it
        and adopted it)."""
        q = decode_round(raw)
        if isinstance(q, Halt):
            raise JobHalted(q.reason)
        if (self.rid, self.incarnation) in q.member_set():
            self._adopt(q)
            return q, True
        return q, False

    def _adopt(self, q: Quorum) -> None:
        m = self.membership
        self._before_steady = None
        if m.report.joining:
            m.report = replace(m.report, joining=False)
        self._current = q
        m.watched.follow(q, prune=True)
        self._next_round = q.round + 1
        m.watched.forget_decisions(q.round)
        m.watch_reports(self._is_decider(0.0))
        self._log_reason(q.reason)

    def _first_with_us(self, decisions: list[tuple[int, bytes]], after: int) -> Optional[tuple[int, bytes]]:
        """Of (round, stored decision) pairs in round order: the first after round `after` that
        has us, or is a halt; None when none does."""
        for r, raw in decisions:
            if r <= after:
                continue
            d = decode_round(raw)
            if isinstance(d, Halt) or (self.rid, self.incarnation) in d.member_set():
                return r, raw
        return None

    def _recorded_with_us(self, round: int) -> Optional[tuple[int, bytes]]:
        """The first round after `round` recorded in etcd that has us (or a halt), or None."""
        kvs, _ = self.store.get_prefix(keys.quorum(self.root))
        return self._first_with_us([(keys.round_of(kv.key), kv.value) for kv in kvs], round)

    def _newer_decision(self, round: int) -> Optional[tuple[int, bytes]]:
        """Of the decisions the quorum/ watch delivered for rounds after `round`: the first that
        has us (or a halt), else the newest; None when there are none. The first, so that we
        adopt every round we are a member of, in order, as the others do."""
        newer = self.membership.watched.decisions_after(round)
        return self._first_with_us(newer, round) or (newer[-1] if newer else None)

    def latest_quorum(self) -> Optional[Quorum]:
        """The newest decided quorum in the store (any leader's), or None before the first."""
        return round_log.latest(self.store, self.root)

    # -- steady rounds ---------------------------------------------------------------------------
    def adopt_steady(self, q: Quorum) -> None:
        """Adopt a steady round derived locally (quorum.steady_next); the lowest-id member also
        records it in etcd, off the critical path (`record_steady`), for joiners and the
        supervisor."""
        if self._current is not None and self._current.round == q.round - 1:
            self._before_steady = self._current
        self._current = q
        self._retracted = None
        self.membership.watched.follow(q)
        self._next_round = q.round + 1
        self.membership.report = replace(self.membership.report, round=q.round, step=q.max_step)

    def retract_steady(self) -> None:
        """Our steady round failed (a member went to a full round and aborted the ring, or a
        member died): it never happened for us. Report for that round number again, after the
        round before it, so that we join the full round the aborting member is deciding for the
        same number; reporting for the next one would make our report count for both rounds,
        and the decider would build a ring we never connect to. When the steady round is already
        recorded in etcd (by its lowest-id member) it stands: that round is over, and the next
        one is a full round for everyone."""
        q = self._current
        if q is None or not q.steady or self._before_steady is None or self._before_steady.round != q.round - 1:
            return
        try:
            kv = self.store.get(self._round_key(q.round))
        except StoreError:
            return
        recorded = decode_round(kv.value) if kv is not None else None
        if isinstance(recorded, Quorum) and recorded.steady:
            return  # the round is recorded as the steady round that failed: it is over, go on to the next
        self._current = self._before_steady
        self.membership.watched.follow(self._current)
        self._next_round = q.round
        self._retracted = q.round
        self.membership.report = replace(self.membership.report, round=q.round - 1,
                                         step=self._before_steady.max_step)

    def record_steady(self, q: Quorum) -> None:
        """Store a steady round's quorum (create-if-absent, so a full decision of the same round
        that won would stand) and prune old rounds. Called from a background thread, for some
        steady rounds only (replica/rounds.py: a steady round writes nothing to etcd; one in
        `RECORD_EVERY` rounds, or every `RECORD_EVERY_S`, is recorded for the supervisor and joiners),
        and at the end of a run of steady rounds (`record_committed`)."""
        try:
            round_log.record(self.store, self.root, q)
        except StoreError as e:
            log.warning("replica %d: could not record steady round %d: %s", self.rid, q.round, e)

    def record_committed(self, committed_round: int) -> None:
        """Before a full round's report: if our current quorum is a steady round we committed,
        record it (create-if-absent: every committer may). A member whose exchange of that round
        failed meets the record instead of waiting for a decision nobody makes, and a decider
        whose own view is older reads it as the previous round."""
        q = self._current
        if q is not None and q.steady and q.round == committed_round:
            self.record_steady(q)

    # -- deciding --------------------------------------------------------------------------------
    def _evaluate(self, round: int, waited_s: float) -> Decision:
        self.evaluations += 1
        members, rev = self.store.get_prefix(keys.members(self.root))
        evicts, _ = self.store.get_prefix(keys.evict(self.root), revision=rev)
        reports = {}
        for kv in members:
            rep = Report.from_json(kv.value)
            reports[rep.rid] = rep
        evicted = set()
        for kv in evicts:
            _, rid, inc = kv.key[len(self.root):].split("/")
            evicted.add((int(rid), int(inc)))
        ahead = round_log.passed(round, reports, frozenset(evicted), self.rid)
        if ahead > round:
            return Decision(None, f"round {round}: passed (a member reports for round {ahead})", passed=ahead)
        previous = round_log.recorded_before(self.store, self.root, round, ours=self._current)
        return compute_quorum(round, reports, frozenset(evicted), previous, self.spec, waited_s,
                              self._history(reports, previous))

    def _history(self, reports: dict[int, Report], previous: Optional[Quorum]) -> History:
        """The job's newest committed step, read only when nobody reports past the previous
        round's step (otherwise nothing can have been lost), and the published checkpoints;
        the slot cursors under batch_policy "constant"."""
        from lightning_ft.replica.ledger import read_cursors, recorded

        cursors: dict[int, int] = {}
        if self.spec.batch_policy == "constant":
            cursors = read_cursors(self.store, self.root, range(self.spec.replicas),
                                   previous.gen if previous is not None else None)
        if previous is None:
            from lightning_ft.replica.ledger import latest_gen

            return History(0, gen=latest_gen(self.store, self.root), cursors=cursors)
        # The checkpoints are read in every full round: a reported step can be past the previous
        # round's while no usable state holds it (a disowned replica's report), and the rewind that
        # follows must see them (sim seed 7573 rewound to step 0 past the checkpoint of step 150).
        kvs, _ = self.store.get_prefix(keys.ckpts(self.root))
        recs = [json.loads(kv.value) for kv in kvs]
        ckpts = tuple((int(d["step"]), str(d["path"])) for d in recs)
        top = max((r.step for r in reports.values() if r.gen == previous.gen), default=-1)
        if top > previous.max_step:
            return History(top, ckpts, cursors=cursors)
        h = previous.max_step + (1 if recorded(self.store, self.root, previous.gen, previous.max_step) else 0)
        # `previous` can be far behind (steady rounds are recorded sparsely): a checkpoint of step
        # N of this generation is published once the commit of step N - 1 is recorded (not N's).
        h = max([h] + [int(d["step"]) for d in recs if d.get("gen") == previous.gen and int(d["step"]) > h
                       and recorded(self.store, self.root, previous.gen, int(d["step"]) - 1)])
        return History(h, ckpts, cursors=cursors)

    def _decided(self, round: int, decision: Decision) -> None:
        """We wrote the round's decision: prune old rounds and announce what it did."""
        round_log.prune(self.store, self.root, round)
        q = decision.quorum
        if decision.halt:
            self.store.put(keys.halt(self.root), json.dumps({"reason": decision.halt, "round": round}).encode())
            self._emit("halt", round=round, reason=decision.halt)
            return
        assert q is not None  # the round was decided (quorum): the caller wrote no halt
        for rid, (mine, majority) in decision.diverged.items():
            self._emit("diverged", replica=rid, step=q.max_step, digest=mine, majority=majority, round=round)
        for name, fields in straggler_rule.events(decision, q, self.spec, said=self._stragglers):
            self._emit(name, **fields)
        self._stragglers = set(decision.stragglers)
        for rid, (made, newest) in decision.stale.items():
            self._emit("stale", replica=rid, step=q.max_step, made=list(made), newest=list(newest), round=round)
        if q.rewind is not None:
            self._emit("rewind", round=round, gen=q.gen, source=q.source, **{k: v for k, v in q.rewind.items()})
        prev_q = {r for r, _, _ in (self._current.quarantine if self._current else ())}
        for rid, until, k in q.quarantine:
            if rid not in prev_q or (self._current and rid in self._current.members and rid not in q.members):
                self._emit("excluded", replica=rid, until_round=until, exclusions=k, round=round,
                           reason="partition: repeated ring failures")

    def _emit(self, name: str, **fields: Any) -> None:
        log.warning("replica %d decided: %s %s", self.rid, name, fields)
        if self.on_event is not None:
            try:
                self.on_event(name, **fields)
            except Exception as e:  # an event log must never stop training
                log.warning("could not record event %s: %s", name, e)

    def _log_reason(self, reason: str) -> None:
        if reason != self._last_reason:
            self._last_reason = reason
            log.info("replica %d: %s", self.rid, reason)
