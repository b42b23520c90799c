"""A replica leader's view of the job in etcd: registration, leases, reports, the per-round
quorum, evictions and failure watches (docs/ARCHITECTURE.md, "The quorum").

Only replica leaders (local rank 0) talk to etcd; they fan the quorum out to their ranks.

Agreement. Every leader evaluates the pure `compute_quorum` on what it reads, and the first
to find the round ready *creates* `quorum/{round}` with a create-if-absent transaction.
Everyone, the writer included, then adopts the stored decision. etcd linearizes the create,
so one round has exactly one quorum: two leaders that raced with different views still
train with the same members (no split brain). A leader left out of a round it reported
for (a late joiner) moves to the next round; the healthy replicas never wait for it.

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
from typing import Any, Optional

from . import keys
from .quorum import (Decision, Halt, History, Quorum, Report, compute_quorum, decode_round, waiting_for)
from .store import LeaseExpired, StoreError
from lightning_ft.coord.membership import (ConfigMismatch, CoordinatorClosed, Evicted, JobFinished, JobHalted,
                                           Membership, MembershipSettings, QuorumTimeout)

log = logging.getLogger(__name__)

KEEP_ROUNDS = 32
"""Decided rounds kept in etcd; older `quorum/` keys are pruned by the round's writer."""


__all__ = ["ConfigMismatch", "Coordinator", "CoordinatorClosed", "Evicted", "JobFinished", "JobHalted",
           "MembershipSettings", "QuorumTimeout"]


class Coordinator(Membership):
    """The rounds as one leader takes part in them: full rounds decided through etcd, steady
    rounds adopted and recorded, the history a decision reads (over its membership)."""

    def _could_decide(self, round: int, waited_s: float) -> bool:
        """Whether the reports our watch delivered could decide `round` (quorum.waiting_for)."""
        with self._dead_lock:
            reports, evicted = dict(self._reports), set(self._evicted)
        previous = self._current if self._current is not None and self._current.round == round - 1 else None
        if previous is None and self._current is not None:
            return True  # we missed rounds: only etcd knows the previous quorum
        return not waiting_for(round, reports, evicted, previous, self.spec, waited_s)

    def quorum(self, step: int, timeout_s: Optional[float] = None, cursor: Optional[int] = None,
               ring_ok: bool = True, **state: Any) -> Quorum:
        """Report `step` for our next round and return the round's quorum, which includes us.
        `state`: Report fields describing our state (gen, synced, digest, digest_step, blame,
        bad_checkpoints); fields not given keep their last value, except that a digest is
        reported once.

        Blocks until the round is decided, moving to later rounds while we are left out.
        Raises QuorumTimeout after `timeout_s`, Evicted if this incarnation was evicted,
        JobHalted if the job was stopped."""
        deadline = None if timeout_s is None else self._clock() + timeout_s
        # Changes seen from here on count for the round after this one: whatever happened before
        # our report, the decider reads from etcd when it evaluates this round.
        self.changed = self._lease_lost.is_set()
        state.setdefault("digest", "")
        state.setdefault("digest_step", -1)
        state.setdefault("blame", ())
        self._report = replace(self._own_report, ring_ok=ring_ok,
                               cursor=self._own_report.cursor if cursor is None else cursor, **state)
        self._publish(step, self._next_round)
        started = last_get = self._clock()
        last_eval = started
        first = True
        while True:
            if self._stop.is_set():  # closed (the process exits): Python's exit would join this thread
                raise CoordinatorClosed(f"replica {self.rid}: the coordinator was closed while round "
                                        f"{self._own_report.round} waited")
            if first or self._clock() - last_get >= self._slow_poll_s:
                self._check_finished()
            self.heartbeat()
            self._wake.clear()
            if self._lease_lost.is_set():
                self._recover_lease()
            round = self._own_report.round
            now = self._clock()
            raw = self._decisions.get(round)
            if raw is None and (first or now - last_get >= self._slow_poll_s):
                kv = self.store.get(self._round_key(round))
                raw, last_get = (kv.value if kv else None), now
            newer = self._newer_decision(round) if raw is None and self._own_report.joining else None
            if newer is not None:
                # A joiner whose round the others passed without recording it (steady rounds are
                # recorded in the background): take the first later decision that has us, else
                # report for the next round after the fallback; never decide the stale round alone.
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
                self._watch_reports(True)
            # Evaluate from etcd once the watched reports could decide the round (and at least
            # every slow poll, whatever they say).
            if decider and (first or now - last_eval >= self._slow_poll_s or self._could_decide(round, now - started)):
                last_eval = now
                decision = self._evaluate(round, now - started)
                self._log_reason(decision.reason)
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
                if taken:
                    return q
                # Left out: evicted (exit), or we reported too late (try the next round).
                if self.store.get(keys.evict(self._root, self.rid, self.incarnation)) is not None:
                    raise Evicted(f"replica {self.rid} incarnation {self.incarnation} was evicted; exiting so "
                                  "the supervisor restarts it")
                if self._own_report.joining:
                    # our report counts for every round (rule 1): a later one may already have us
                    later = self._recorded_with_us(round)
                    if later is not None:
                        q, taken = self._take(later[1])
                        if taken:
                            return q
                self._publish(step, max(round, self._latest_round()) + 1)
                started = self._clock()
                continue
            if deadline is not None and self._clock() > deadline:
                raise QuorumTimeout(f"replica {self.rid}: no quorum for round {round} after {timeout_s:.1f}s; "
                                    f"last reason: {self._last_reason or 'waiting for the decider'}")
            self._wake.wait(self.poll_interval_s)

    def adopt_steady(self, q: Quorum) -> None:
        """Adopt a steady round derived locally (quorum.steady_next); the lowest-id member also
        records it in etcd, off the critical path (`record_steady`), for joiners and the
        supervisor."""
        if self._current is not None and self._current.round == q.round - 1:
            self._before_steady = self._current
        self._current = q
        self._next_round = q.round + 1
        self._report = replace(self._own_report, round=q.round, step=q.max_step)

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
        self._next_round = q.round
        self._report = replace(self._own_report, round=q.round - 1, step=self._before_steady.max_step)

    def record_steady(self, q: Quorum) -> None:
        """Store a steady round's quorum (create-if-absent, so a full decision of the same round
        that won would stand) and prune old rounds. Called from a background thread."""
        try:
            if self.store.create(self._round_key(q.round), q.to_json()):
                old = q.round - KEEP_ROUNDS
                if old >= 0:
                    self.store.delete(self._round_key(old))
        except StoreError as e:
            log.warning("replica %d: could not record steady round %d: %s", self.rid, q.round, e)

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
        kvs, _ = self.store.get_prefix(keys.quorum(self._root))
        return self._first_with_us([(keys.round_of(kv.key), kv.value) for kv in kvs], round)

    def _newer_decision(self, round: int) -> Optional[tuple[int, bytes]]:
        """Of the decisions the quorum/ watch delivered for rounds after `round`: the first that
        has us (or a halt), else the newest; None when there are none. The first, so that we
        adopt every round we are a member of, in order, as the others do."""
        newer = sorted((r, self._decisions[r]) for r in list(self._decisions) if r > round)
        return self._first_with_us(newer, round) or (newer[-1] if newer else None)

    def _adopt(self, q: Quorum) -> None:
        self._before_steady = None
        if self._own_report.joining:
            self._report = replace(self._own_report, joining=False)
        with self._dead_lock:
            self._current = q
            self._dead = {m for m in self._dead if m in q.member_set()}
        self._next_round = q.round + 1
        for r in list(self._decisions):  # list(): the watch thread inserts concurrently
            if r <= q.round:
                self._decisions.pop(r, None)
        self._watch_reports(self._is_decider(0.0))
        self._log_reason(q.reason)

    def _is_decider(self, waited_s: float) -> bool:
        """Whether to evaluate the round ourselves. The decider is the lowest-id member of the
        previous quorum not known dead; the others only wait for its decision. Anyone steps
        in after `fallback_s` (or at once at round 0), which is safe: creation is a CAS."""
        q = self._current
        if q is None:
            return self._own_report.round == 0 or waited_s >= self._fallback_s
        with self._dead_lock:
            alive = [r for r, i in zip(q.members, q.incarnations, strict=True) if (r, i) not in self._dead]
        return not alive or alive[0] == self.rid or waited_s >= self._fallback_s

    def _publish(self, step: int, round: int) -> None:
        self._report = replace(self._own_report, step=step, round=round)
        try:
            self.store.put(keys.members(self._root, self.rid), self._own_report.to_json(), lease=self._lease)
        except LeaseExpired:
            self._recover_lease()

    def latest_quorum(self) -> Optional[Quorum]:
        """The newest decided quorum in the store (any leader's), or None before the first."""
        kvs, _ = self.store.get_prefix(keys.quorum(self._root))
        quorums = [q for q in map(decode_round, (kv.value for kv in kvs)) if isinstance(q, Quorum)]
        return quorums[-1] if quorums else None

    def _evaluate(self, round: int, waited_s: float) -> Decision:
        self.evaluations += 1
        members, rev = self.store.get_prefix(keys.members(self._root))
        evicts, _ = self.store.get_prefix(keys.evict(self._root), revision=rev)
        reports = {}
        for kv in members:
            rep = Report.from_json(kv.value)
            reports[rep.rid] = rep
        evicted = set()
        for kv in evicts:
            _, rid, inc = kv.key[len(self._root):].split("/")
            evicted.add((int(rid), int(inc)))
        previous: Optional[Quorum]
        if self._current is not None and self._current.round == round - 1:
            previous = self._current  # ours, possibly a steady round not yet recorded in etcd
        else:
            prev_kv = self.store.get(self._round_key(round - 1)) if round > 0 else None
            recorded = decode_round(prev_kv.value) if prev_kv else None
            previous = recorded if isinstance(recorded, Quorum) else None
        return compute_quorum(round, reports, frozenset(evicted), previous, self.spec, waited_s,
                              self._history(reports, previous))

    def _history(self, reports: dict[int, Report], previous: Optional[Quorum]) -> History:
        """The job's newest committed step, read only when nobody reports past the previous
        round's step (otherwise nothing can have been lost), and the published checkpoints;
        the slot cursors under batch_policy "constant"."""
        from lightning_ft.replica.ledger import read_cursors, recorded

        cursors: dict[int, int] = {}
        if self.spec.batch_policy == "constant":
            cursors = read_cursors(self.store, self._root, range(self.spec.replicas),
                                   previous.gen if previous is not None else None)
        if previous is None:
            from lightning_ft.replica.ledger import latest_gen

            return History(0, gen=latest_gen(self.store, self._root), cursors=cursors)
        top = max((r.step for r in reports.values() if r.gen == previous.gen), default=-1)
        if top > previous.max_step:
            return History(top, cursors=cursors)
        h = previous.max_step + (1 if recorded(self.store, self._root, previous.gen, previous.max_step) else 0)
        kvs, _ = self.store.get_prefix(keys.ckpts(self._root))
        ckpts = tuple((int(d["step"]), str(d["path"])) for d in (json.loads(kv.value) for kv in kvs))
        return History(h, ckpts, cursors=cursors)

    def _decided(self, round: int, decision: Decision) -> None:
        """We wrote the round's decision: prune old rounds and announce what it did."""
        old = round - KEEP_ROUNDS
        if old >= 0:
            self.store.delete(self._round_key(old))
        q = decision.quorum
        if decision.halt:
            self.store.put(keys.halt(self._root), json.dumps({"reason": decision.halt, "round": round}).encode())
            self._emit("halt", round=round, reason=decision.halt)
            return
        assert q is not None  # the round was decided (quorum): the caller wrote no halt
        for rid, (mine, majority) in decision.diverged.items():
            self._emit("diverged", replica=rid, step=q.max_step, digest=mine, majority=majority, round=round)
        for rid, ratio in sorted(decision.stragglers.items()):
            excluded = decision.excluded_straggler if decision.excluded_straggler and \
                decision.excluded_straggler[0] == rid else None
            split = next(((g, n) for r, g, n in q.shrink_next if r == rid), None)  # policy "shrink"
            if excluded is None and rid in self._stragglers:
                continue  # still slow, already said (policy "wait"; "shrink": its split follows in the reasons)
            self._emit("straggler", replica=rid, ratio=float(f"{ratio:.3f}"), window=self.spec.straggler_window,
                       threshold=self.spec.straggler_threshold, policy=self.spec.straggler_policy,
                       step=q.max_step, round=round,
                       **({"until_round": excluded[1], "exclusions": excluded[2]} if excluded else {}),
                       **({"gives": split[0], "of": split[1]} if split else {}))
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
