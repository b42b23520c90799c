"""The failure-injection schedule: which replica fails at which step, and how
(docs/ARCHITECTURE.md, "Launch and supervision").

A pure schedule: no I/O, no clock. It holds explicit injections (`failure.events`) plus, when
`failure.mtbf_steps > 0`, random ones drawn deterministically from `failure.seed`, so every
process of a job derives the same schedule from the same config.

Firing rule. A replica's injections, sorted by step, are numbered k = 0, 1, 2, ... and

    the k-th injection of replica r fires iff r is about to run exactly its step
    AND r runs in incarnation k (every injected failure restarts r with incarnation + 1).

So a restarted replica that reaches the same step again does not re-fire the injection that
killed its previous incarnation, and no state has to be shared between processes. Each
schedule object also remembers what it has fired, so asking twice in one process fires once.
Consequences of the rule, by design: an injection fires only if its replica runs its step (a
replica that is down then, or skips the step while catching up, misses it), and once the
replica's incarnation no longer matches k, the remaining injections of that replica do not
fire either. Keep one replica's injections further apart than its restart takes.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from lightning_ft.config import FAILURE_KINDS


@dataclass(frozen=True)
class Injection:
    """One failure: replica `replica` fails as it is about to run `step`."""

    replica: int
    step: int
    kind: str
    """"kill" (SIGKILL), "hang" (stops making progress) or "exception" (raises in the step)."""
    downtime_steps: int = 0
    """Keep the replica down until the others advance this many steps; 0 = the usual restart delay."""


class FailureSchedule:
    """Explicit injections plus, with `mtbf_steps > 0`, random ones (see the module docstring)."""

    def __init__(self, events: Sequence[Injection] = (), mtbf_steps: float = 0.0, kinds: Sequence[str] = ("kill",),
                 replicas: int = 1, seed: int = 0, horizon_steps: int = 100000) -> None:
        """Random failures arrive job-wide with exponential inter-arrival times of mean `mtbf_steps`
        (in steps), up to `horizon_steps`; each picks a replica in [0, replicas) and a kind from
        `kinds` uniformly. Raises ValueError for an unknown kind or an invalid injection."""
        for inj in events:
            _check(inj)
        _check_kinds(kinds)
        if mtbf_steps < 0:
            raise ValueError(f"mtbf_steps={mtbf_steps} must be >= 0 (0 = no random failures)")
        if mtbf_steps > 0 and not kinds:
            raise ValueError(f"mtbf_steps={mtbf_steps} needs at least one kind; allowed: {', '.join(FAILURE_KINDS)}")
        if replicas < 1:
            raise ValueError(f"replicas={replicas} must be >= 1")
        taken = set()
        for inj in events:
            if (inj.replica, inj.step) in taken:
                raise ValueError(f"replica {inj.replica} has two injections at step {inj.step}; "
                                 "give each a different step")
            taken.add((inj.replica, inj.step))
        drawn = _draw(mtbf_steps, kinds, replicas, seed, horizon_steps, taken) if mtbf_steps > 0 else []
        self._events = sorted([*events, *drawn], key=lambda i: (i.step, i.replica))
        self._by_replica: dict[int, list[Injection]] = {}
        for inj in self._events:
            self._by_replica.setdefault(inj.replica, []).append(inj)
        self._fired: set[Injection] = set()

    @classmethod
    def from_config(cls, cfg: Any, replicas: int) -> "FailureSchedule":
        """The schedule of a `FailureConfig` (omegaconf DictConfig or the dataclass)."""
        events = [Injection(int(e.replica), int(e.step), str(e.kind), int(e.downtime_steps)) for e in cfg.events]
        return cls(events, mtbf_steps=float(cfg.mtbf_steps), kinds=[str(k) for k in cfg.kinds],
                   replicas=replicas, seed=int(cfg.seed))

    def due(self, replica: int, step: int, incarnation: int = 0) -> Optional[Injection]:
        """The injection that fires now for `replica` about to run `step` in `incarnation`, or None.

        The k-th injection of a replica fires in its k-th incarnation, at most once per schedule."""
        mine = self._by_replica.get(replica, [])
        if not 0 <= incarnation < len(mine):
            return None
        inj = mine[incarnation]
        if inj.step != step or inj in self._fired:
            return None
        self._fired.add(inj)
        return inj

    def downtime(self, replica: int, incarnation: int) -> int:
        """Steps to keep `replica` down after it failed in `incarnation`: the downtime_steps of
        its injection number `incarnation` (the one that fires in it, by the firing rule);
        0 when none is scheduled (restart after the usual delay)."""
        mine = self._by_replica.get(replica, [])
        return mine[incarnation].downtime_steps if 0 <= incarnation < len(mine) else 0

    def events(self) -> list[Injection]:
        """Every injection, sorted by step (then replica)."""
        return list(self._events)

    def describe(self) -> str:
        """One line per injection, for logs."""
        if not self._events:
            return "no failure injections"
        lines = []
        seen: dict[int, int] = {}
        for inj in self._events:
            k = seen[inj.replica] = seen.get(inj.replica, -1) + 1
            down = f", down for {inj.downtime_steps} steps" if inj.downtime_steps else ""
            lines.append(f"step {inj.step}: {inj.kind} replica {inj.replica} (its incarnation {k}){down}")
        return "\n".join(lines)


def _check_kinds(kinds: Sequence[str]) -> None:
    for kind in kinds:
        if kind not in FAILURE_KINDS:
            raise ValueError(f"unknown failure kind {kind!r}; allowed kinds are {', '.join(FAILURE_KINDS)}")


def _check(inj: Injection) -> None:
    _check_kinds([inj.kind])
    if inj.replica < 0 or inj.step < 0 or inj.downtime_steps < 0:
        raise ValueError(f"{inj}: replica, step and downtime_steps must be >= 0")


def _draw(mtbf_steps: float, kinds: Sequence[str], replicas: int, seed: int, horizon_steps: int,
          taken: set[tuple[int, int]]) -> list[Injection]:
    """Random injections up to `horizon_steps`; a draw that hits a (replica, step) already
    scheduled is dropped (a replica fails at most once per step)."""
    rng = random.Random(seed)
    out: list[Injection] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_steps)
        step = math.ceil(t)
        if step >= horizon_steps:
            return out
        replica, kind = rng.randrange(replicas), rng.choice(list(kinds))
        if (replica, step) not in taken:
            taken.add((replica, step))
            out.append(Injection(replica, step, kind))
