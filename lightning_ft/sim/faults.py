"""Seeded fault schedules for the simulator, and their shrinking (docs/ARCHITECTURE.md, "The
simulator"). Pure: a schedule is a tuple of `Fault`s, a function of the seed.

Kinds (what each does to the simulated job: sim/job.py):

    kill       SIGKILL one replica (`rid`), or `several` of them at once, or all (`all`)
    hang       SIGSTOP a replica for `seconds` (its lease lapses after the TTL; the supervisor
               kills a replica it sees hung past its grace)
    slow       a replica computes `factor` times slower for `seconds`
    cut        a replica's FTAR links are cut for `seconds` (etcd still reaches it)
    isolate    a replica's host is cut off for `seconds`: FTAR and etcd (its lease lapses)
    etcd_loss  the loss of an etcd member: requests fail over (a short outage)
    outage     etcd unreachable for `seconds` (ridden out up to etcd.connect_timeout_s)
    resume     the whole job is killed and started again from its newest checkpoint
    corrupt    one replica's state is silently corrupted (the divergence guard heals it)
    veto       one replica's commit fails after the exchange (a partial completion)
    intruder   a process with another secret tries to join (it is refused)
    late       a replica starts late (it joins as lagging)
    spare      a warm spare takes over the next failed replica (a faster restart)
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

KINDS = ("kill", "hang", "slow", "cut", "isolate", "etcd_loss", "outage", "resume", "corrupt", "veto", "intruder",
         "late", "spare")
WEIGHTS = (8, 3, 2, 2, 2, 1, 1, 1, 1, 2, 1, 1, 1)


@dataclass(frozen=True)
class Fault:
    t: float
    kind: str
    rid: int = 0
    seconds: float = 0.0
    several: tuple[int, ...] = ()
    """kill: more replicas killed at the same moment (with `rid`)."""
    factor: float = 1.0

    def __str__(self) -> str:
        extra = (f" +{list(self.several)}" if self.several else "") \
            + (f" {self.seconds:.2f}s" if self.seconds else "") + (f" x{self.factor:.1f}" if self.factor != 1.0 else "")
        return f"{self.kind}(r{self.rid}{extra}) at {self.t:.2f}s"


def schedule(seed: int, replicas: int, span_s: float, n: int, kinds: Sequence[str] = KINDS) -> tuple[Fault, ...]:
    """`n` faults at random moments of the first `span_s` seconds of a job of `replicas`."""
    rng = random.Random(seed * 7919 + 1)
    weights = [w for k, w in zip(KINDS, WEIGHTS, strict=True) if k in kinds]
    names = [k for k in KINDS if k in kinds]
    out = []
    for _ in range(n):
        kind = rng.choices(names, weights)[0]
        t = round(rng.uniform(0.2, span_s), 4)
        rid = rng.randrange(replicas)
        if kind == "kill":
            r = rng.random()
            several = tuple(sorted(set(range(replicas)) - {rid})) if r < 0.08 else \
                tuple(sorted(rng.sample(sorted(set(range(replicas)) - {rid}), 1))) if r < 0.25 and replicas > 1 else ()
            out.append(Fault(t, kind, rid, several=several))
        elif kind in ("hang", "cut", "isolate"):
            out.append(Fault(t, kind, rid, seconds=round(rng.uniform(0.2, 6.0), 3)))
        elif kind == "slow":
            out.append(Fault(t, kind, rid, seconds=round(rng.uniform(1.0, 8.0), 3), factor=round(rng.uniform(2, 6), 2)))
        elif kind == "etcd_loss":
            out.append(Fault(t, kind, seconds=0.05))
        elif kind == "outage":
            out.append(Fault(t, kind, seconds=round(rng.uniform(0.5, 14.0), 3)))
        elif kind == "late":
            out.append(Fault(0.0, kind, rid, seconds=round(rng.uniform(0.5, 5.0), 3)))
        else:
            out.append(Fault(t, kind, rid))
    return tuple(sorted(out, key=lambda f: (f.t, f.kind, f.rid)))


def shrink(faults: tuple[Fault, ...], fails: Callable[[tuple[Fault, ...]], bool]) -> tuple[Fault, ...]:
    """A smallest sub-schedule that still fails (delta debugging, ddmin): drop chunks of faults
    while the run still fails, halving the chunk size down to single faults."""
    current = faults
    n = 2
    while len(current) >= 2:
        size = max(1, len(current) // n)
        chunks = [current[i:i + size] for i in range(0, len(current), size)]
        for i in range(len(chunks)):
            rest = tuple(f for j, c in enumerate(chunks) if j != i for f in c)
            if rest and fails(rest):
                current, n = rest, max(n - 1, 2)
                break
        else:
            if n >= len(current):
                break
            n = min(len(current), n * 2)
    return current
