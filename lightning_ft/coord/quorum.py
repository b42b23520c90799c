"""The per-round quorum decision, as a pure function (DESIGN §3, §5 step 1).

`compute_quorum` looks at what the replica leaders reported for a round and decides who
trains in it. It does no I/O and reads no clock: the coordinator passes it the member
reports, the evictions, the previous quorum and how long it has waited. It returns a
`Decision` whose `reason` says why, in words a person can act on.

Rules, in order:
1. A report counts for round r if it was made for round >= r, its (replica, incarnation)
   is not evicted, and its job fingerprint equals the job's. Mismatched fingerprints are
   refused with the differing fields named.
2. If some member of the previous quorum survives, the round waits until every surviving
   previous member has reported. A member is gone when its key is gone (lease expired),
   it is evicted, or a newer incarnation replaced it. Joiners who reported in time are
   taken in; the healthy replicas never wait for a joiner.
3. Otherwise (job start, or every previous member died) the round waits until all R
   replicas report, or `init_timeout_s` passes with at least `min_replicas`.
4. Fewer than `min_replicas` valid reports: no quorum, training waits, and says why.
5. Members are sorted by replica id (the ring order). `max_step` is the highest reported
   step; members at it are `contributors`, the others `lagging`.
6. The epoch stays when the (replica, incarnation) set is unchanged and no member asks for
   a ring reset (`ring_ok=False` after a failed exchange); otherwise it goes up by one.
   FTAR reconfigures when it changes.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Mapping, Optional


@dataclass(frozen=True)
class Report:
    """What a replica leader publishes in `members/{rid}` (bound to its lease)."""

    rid: int
    incarnation: int
    step: int
    """Committed steps so far: the step this replica would train next."""
    round: int
    """The round this leader is ready to take part in."""
    fingerprint: Mapping[str, object] = field(default_factory=dict)
    """Job settings every replica must agree on (config.fingerprint)."""
    addrs: tuple[str, ...] = ()
    """Per-rank FTAR addresses, host:port, indexed by local rank."""
    state_addrs: tuple[str, ...] = ()
    """Per-rank catch-up state-server addresses."""
    cursor: int = 0
    """Next batch index of this replica's data slot (DESIGN §7)."""
    ring_ok: bool = True
    """False after a failed exchange: the ring must be rebuilt even if membership is unchanged."""

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Report":
        d = json.loads(raw)
        d["addrs"] = tuple(d.get("addrs", ()))
        d["state_addrs"] = tuple(d.get("state_addrs", ()))
        return cls(**d)


@dataclass(frozen=True)
class Quorum:
    """Who trains in one round. Every leader adopts the same one (see coordinator)."""

    round: int
    epoch: int
    members: tuple[int, ...]
    """Replica ids in ring order (sorted)."""
    incarnations: tuple[int, ...]
    """Incarnation of each member, aligned with `members`."""
    max_step: int
    contributors: tuple[int, ...]
    """Members at max_step: they train and their gradients count."""
    lagging: tuple[int, ...]
    """Members behind max_step: they catch up and contribute zeros."""
    addrs: tuple[tuple[str, ...], ...] = ()
    """FTAR addresses of each member, aligned with `members`."""
    state_addrs: tuple[tuple[str, ...], ...] = ()
    cursors: tuple[int, ...] = ()
    """Reported data cursor of each member, aligned with `members`."""
    reason: str = ""

    def index(self, rid: int) -> int:
        return self.members.index(rid)

    def member_set(self) -> frozenset[tuple[int, int]]:
        return frozenset(zip(self.members, self.incarnations))

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Quorum":
        d = json.loads(raw)
        for k in ("members", "incarnations", "contributors", "lagging"):
            d[k] = tuple(d[k])
        d["addrs"] = tuple(tuple(a) for a in d.get("addrs", ()))
        d["state_addrs"] = tuple(tuple(a) for a in d.get("state_addrs", ()))
        d["cursors"] = tuple(d.get("cursors", ()))
        return cls(**d)

    def cursor_of(self, rid: int) -> int:
        return self.cursors[self.members.index(rid)]


@dataclass(frozen=True)
class JobSpec:
    """The parts of the job config the decision needs."""

    replicas: int
    min_replicas: int = 1
    init_timeout_s: float = 10.0
    fingerprint: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    quorum: Optional[Quorum]
    """None while the round must wait."""
    reason: str
    refused: Mapping[int, str] = field(default_factory=dict)
    """Replica id -> why its report was refused (config mismatch)."""


def fingerprint_diff(job: Mapping[str, object], mine: Mapping[str, object]) -> str:
    """'' if equal, else a readable list of differences like 'replicas (4 != 3)'."""
    keys = sorted(set(job) | set(mine))
    diffs = [f"{k} ({mine.get(k)!r} != {job.get(k)!r})" for k in keys if job.get(k) != mine.get(k)]
    return ", ".join(diffs)


def _names(rids) -> str:
    return " ".join(f"r{r}" for r in rids) or "none"


def compute_quorum(
    round: int,
    reports: Mapping[int, Report],
    evicted: frozenset[tuple[int, int]] | set[tuple[int, int]],
    previous: Optional[Quorum],
    job: JobSpec,
    waited_s: float = 0.0,
) -> Decision:
    """Decide the quorum of `round`; see the module docstring for the rules."""
    refused: dict[int, str] = {}
    valid: dict[int, Report] = {}
    for rid, rep in sorted(reports.items()):
        if (rid, rep.incarnation) in evicted:
            continue
        diff = fingerprint_diff(job.fingerprint, rep.fingerprint)
        if diff:
            refused[rid] = f"replica {rid} (incarnation {rep.incarnation}) refused: job config differs in {diff}"
            continue
        if rep.round >= round:
            valid[rid] = rep

    # Rule 2: wait for every surviving member of the previous quorum.
    survivors: list[int] = []
    if previous is not None:
        for rid, inc in zip(previous.members, previous.incarnations):
            rep = reports.get(rid)
            if rep is None or rep.incarnation != inc or (rid, inc) in evicted or rid in refused:
                continue  # gone: expired, evicted, or replaced by a new incarnation
            survivors.append(rid)
        missing = [r for r in survivors if r not in valid]
        if missing:
            return Decision(None, f"round {round}: waiting for {_names(missing)} to report "
                                  f"(previous members; {len(valid)} reported)", refused)

    # Rule 3: a fresh start waits for everyone, or for the init timeout.
    if not survivors:
        if len(valid) < job.replicas and waited_s < job.init_timeout_s:
            absent = [r for r in range(job.replicas) if r not in valid]
            return Decision(None, f"round {round}: starting, waiting for {len(valid)} of {job.replicas} replicas: "
                                  f"{_names(absent)} not reported ({waited_s:.1f}s of {job.init_timeout_s:.1f}s)",
                            refused)

    # Rule 4: min_replicas.
    if len(valid) < job.min_replicas:
        return Decision(None, f"round {round}: below min_replicas: {len(valid)} of {job.min_replicas} needed "
                              f"({_names(valid)} alive); training waits for replicas to join", refused)

    members = tuple(sorted(valid))
    incs = tuple(valid[r].incarnation for r in members)
    max_step = max(valid[r].step for r in members)
    contributors = tuple(r for r in members if valid[r].step == max_step)
    lagging = tuple(r for r in members if valid[r].step < max_step)
    member_set = frozenset(zip(members, incs))

    if previous is None:
        epoch, change = 0, "first quorum"
    elif member_set == previous.member_set():
        broken = [r for r in members if not valid[r].ring_ok]
        if broken:
            epoch, change = previous.epoch + 1, f"ring reset requested by {_names(broken)}"
        else:
            epoch, change = previous.epoch, "unchanged"
    else:
        epoch = previous.epoch + 1
        before = previous.member_set()
        joined = sorted(r for r, i in member_set - before)
        left = sorted(r for r, i in before - member_set)
        parts = []
        if joined:
            parts.append(f"joined {_names(joined)}")
        if left:
            parts.append(f"left {_names(left)}")
        change = ", ".join(parts)
    reason = (f"round {round} epoch {epoch}: {len(members)}/{job.replicas} replicas [{_names(members)}] ({change}); "
              f"max_step {max_step}")
    if lagging:
        reason += f"; lagging {_names(lagging)} (" + ", ".join(f"r{r} at {valid[r].step}" for r in lagging) + ")"
    if refused:
        reason += f"; refused {_names(refused)}"
    q = Quorum(round=round, epoch=epoch, members=members, incarnations=incs, max_step=max_step,
               contributors=contributors, lagging=lagging,
               addrs=tuple(valid[r].addrs for r in members),
               state_addrs=tuple(valid[r].state_addrs for r in members),
               cursors=tuple(valid[r].cursor for r in members), reason=reason)
    return Decision(q, reason, refused)
