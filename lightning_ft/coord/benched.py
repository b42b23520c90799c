"""A benched straggler's wait outside the rounds (docs/ARCHITECTURE.md, "Stragglers"; quorum rule 14).

A replica leader that a decision left out because it benched it (`Quorum.slow` names it) does not
wait for a round in `Coordinator.quorum` as a joiner would: its caller keeps computing its batch
to measure its pace (the probe), and asks again between probes. Each ask (`Outside.poll`) takes the
first decision the quorum/ watch delivered that has us back (`IN`), or says we are still out
(`OUT`, with the newest decision), or that the bench is over without us (`LEFT`: our entry is gone,
or every member died; the caller then reports for the next round as usual). Our report carries
the probe (`bench`, `bench_s`, `compute_ms`, `probe_s`) and is put in etcd only now and then: at
once when it becomes ready (stragglers.ready against the newest round's pace), every `READY_S`
while it stays ready (the decider's watch asks for a full round on a ready report, and the
members' fresh measures decide), else every `QUIET_S` (status tables). Reports that are not
ready ask nothing of the others: their steady rounds go on.

Owned by the round thread (the Coordinator's), like the rounds' state.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Generator

from . import stragglers
from .membership import CoordinatorClosed, JobHalted, Membership
from .round_records import Halt, Quorum, decode_round

IN, OUT, LEFT = "in", "out", "left"
READY_S = 1.0
"""A ready report is put again this often while no decision takes it back."""
QUIET_S = 5.0
"""A report that is not ready is put this often (its probe, for status tables)."""
WAIT_S = 0.2
"""A caller that does not probe (it cannot recompute, or has no batch yet) waits this long per ask
(`Coordinator.quorum_steps` yields it: a watch event ends the wait early)."""
FINISHED_S = 1.0
"""How often the wait reads whether the job finished."""


@dataclass
class Outside:
    """The bench of one leader: since when, which exclusion, the newest decision seen."""

    since: int
    """The round that benched us."""
    k: int
    """Our exclusions so far (this one included)."""
    seen_t: float
    """When we learned it (our clock)."""
    newest: Quorum
    """The newest decision seen (not a member of it)."""
    published_t: float = -math.inf
    ready: bool = False
    checked_t: float = -math.inf

    def steps(self, m: Membership, clock: Callable[[], float], step: int, state: dict[str, Any],
              probing: bool) -> Generator[float, None, tuple[str, Quorum]]:
        """One ask of `Coordinator.quorum_steps`: `poll`, and when it is still OUT and the caller
        does not probe (`probing` False), a wait of `WAIT_S` (yielded) and a second poll."""
        if m.closed:
            raise CoordinatorClosed(f"replica {m.rid}: the coordinator was closed while it was benched")
        m.wake.clear()
        how, q = self.poll(m, clock, step, state)
        if how == OUT and not probing:
            yield WAIT_S
            how, q = self.poll(m, clock, step, state)
        return how, q

    def poll(self, m: Membership, clock: Callable[[], float], step: int, state: dict[str, Any]) -> tuple[str, Quorum]:
        """One ask, without waiting: (IN, a decision that has us), (OUT, the newest decision) or
        (LEFT, the newest). `state`: our report's fields (the probe among them)."""
        now = clock()
        m.heartbeat()
        if m.lease_lost.is_set():
            m.recover_lease()
        if now - self.checked_t >= FINISHED_S:
            m.check_finished()
            self.checked_t = now
        for _, raw in m.watched.decisions_after(self.newest.round):
            d = decode_round(raw)
            if isinstance(d, Halt):
                raise JobHalted(d.reason)
            if (m.rid, m.incarnation) in d.member_set():
                return IN, d
            self.newest = d
        m.watched.forget_decisions(self.newest.round)
        m.watched.follow(self.newest)
        entry = stragglers.bench_entry(self.newest.slow, m.rid)
        if entry is None or not m.watched.alive(self.newest):
            return LEFT, self.newest
        if entry[0] != self.since:  # benched again (a later exclusion): measured afresh
            self.since, self.k, self.seen_t, self.ready = entry[0], entry[1], now, False
        report = replace(m.report, step=step, **{**state, "bench": self.since, "bench_s": round(now - self.seen_t, 3)})
        probe = stragglers.Probe(report.compute_ms, report.probe_s, report.bench, report.bench_s)
        ready = stragglers.ready(probe, self.since, self.k, self.newest.pace_ms, m.spec.straggler_threshold)
        due = READY_S if ready else QUIET_S
        if ready != self.ready or now - self.published_t >= due:
            m.publish(report)
            self.published_t, self.ready = now, ready
        return OUT, self.newest
