"""A replica's pace, as the straggler rules measure it (docs/ARCHITECTURE.md, "Stragglers";
coord/stragglers.py): its compute per cleanly trained step while it is a member, and its probe
while rule 14 benches it. Owned by the training thread; the round's `RoundView` carries a copy."""
from __future__ import annotations

import collections
import logging
from typing import Optional

from lightning_ft.constants import Role
from lightning_ft.coord import stragglers
from lightning_ft.replica.plan import StepPlan

log = logging.getLogger(__name__)


class Pace:
    """The compute measure of one replica rank and, while benched, its probe."""

    def __init__(self, rid: int, window: int) -> None:
        self.rid, self.window = rid, max(1, window)
        self.steps: collections.deque[tuple[float, float, float]] = collections.deque()
        """(start, ready, seconds per whole slot batch): from the end of the previous step to
        ready-to-exchange of the newest cleanly trained steps since this replica (re)joined."""
        self.round = -1
        """The round of the newest step in `steps`."""
        self.bench: Optional[tuple[int, int]] = None
        """(round that benched us, exclusions) while rule 14 benches this replica."""
        self.probes: collections.deque[tuple[float, float, float]] = collections.deque()
        """Benched: (start, end, seconds) of each probe, our batch computed to measure our pace."""
        self.can_probe = False
        """The step in progress can probe (it can compute its batch again): set by each Step."""

    def step(self, start: float, ready: float, seconds: float, round: int) -> None:
        """A cleanly trained step of `round` took `seconds` (per whole slot batch) from `start`."""
        self._add(self.steps, start, ready, seconds)
        self.round = round

    def probe(self, start: float, end: float, seconds: float) -> None:
        """A probe (benched: our batch computed again, nothing committed)."""
        self._add(self.probes, start, end, seconds)

    def forget(self) -> None:
        """A catch-up or sync replaced the state: measured afresh."""
        self.steps.clear()

    def _add(self, times: collections.deque, start: float, end: float, seconds: float) -> None:
        times.append((start, end, seconds))
        while len(times) > self.window and times[0][0] < end - 2 * stragglers.MAX_PROBE_S:
            times.popleft()

    def compute(self) -> Optional[tuple[float, int, int]]:
        """(mean ms, round of the newest, steps) over `MEASURE_S` and `window` steps, once measured."""
        ms, _, n = stragglers.pace_over(self.steps, stragglers.MEASURE_S, self.window)
        return (ms, self.round, n) if ms > 0 else None

    def probed(self) -> Optional[tuple[float, float]]:
        """Benched: (the probe's mean ms or -1, the seconds it covers; -1: this caller cannot
        probe), over `probe_span(k)` and `window` probes; None when not benched."""
        if self.bench is None:
            return None
        if not self.can_probe:
            return -1.0, -1.0
        ms, span, _ = stragglers.pace_over(self.probes, stragglers.probe_span(self.bench[1]), self.window)
        return ms, span

    def planned(self, plan: StepPlan) -> None:
        """A round's plan: one that benched us starts (or goes on with) our probe; the first that
        has us back ends it, and we are measured afresh."""
        bench = stragglers.bench_entry(plan.quorum.slow, self.rid) if plan.role == Role.BENCH else None
        if bench == self.bench:
            return
        if bench is not None:
            log.warning("replica %d: benched as a straggler (exclusion %d, round %d): it measures its pace outside "
                        "the rounds until it is within the others'", self.rid, bench[1], bench[0])
        else:
            log.warning("replica %d: back from the bench in round %d", self.rid, plan.quorum.round)
        self.bench = bench
        self.probes.clear()
        self.steps.clear()
