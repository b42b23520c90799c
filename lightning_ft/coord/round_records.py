"""What a round is made of, as etcd holds it (docs/ARCHITECTURE.md, "The quorum"; "Keyspace"): a leader's
`Report`, the decided `Quorum` (or a `Halt`), the `JobSpec` every replica agrees on, what the
job's `History` says, and the `Decision` of `compute_quorum` (coord/quorum.py). Records from
another version may carry more fields; the decoders keep the known ones."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Mapping, Optional

TRAIN, SYNC = "train", "sync"
"""Round kinds (`Quorum.kind`)."""


def _shallow(record: object) -> dict:
    """A record's fields as a dict for json (tuples and mappings as they are: json writes them as
    lists and objects, what dataclasses.asdict's deep copy would give, at a fraction of its cost)."""
    return {f.name: getattr(record, f.name) for f in fields(record)}  # type: ignore[arg-type]


def _known(cls: type, d: dict) -> dict:
    """The fields of `cls` in a decoded record (a record from another version may carry more)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names}


@dataclass(frozen=True)
class Report:
    """What a replica leader publishes in `members/{rid}` (bound to its lease)."""

    rid: int
    incarnation: int
    step: int
    """Committed steps so far: the step this replica would train next (its state version)."""
    round: int
    """The round this leader is ready to take part in."""
    fingerprint: Mapping[str, object] = field(default_factory=dict)
    """Job settings every replica must agree on (config.fingerprint)."""
    cursor: int = 0
    """Next batch index of this replica's data slot (docs/ARCHITECTURE.md, "Exactly once")."""
    ring_ok: bool = True
    """False after a failed exchange: the ring must be rebuilt even if membership is unchanged."""
    gen: int = 0
    """History generation of this replica's state (bumped by every rewind)."""
    synced: bool = True
    """Its state comes from the job's history (it committed or adopted in `gen`). A new
    process reports False until it adopted or caught up (the manager always says)."""
    digest: str = ""
    """State digest of version `digest_step` ("" = none this round)."""
    digest_step: int = -1
    blame: tuple[int, ...] = ()
    """Replicas whose FTAR connection failed in this replica's last failed exchange."""
    bad_checkpoints: tuple[int, ...] = ()
    """Checkpoint steps this replica could not load (missing or corrupted files)."""
    stop: bool = False
    """The training loop asked to stop (Lightning's `trainer.should_stop`): the job stops
    when the round that carries it commits, on every replica at the same step."""
    made: tuple[int, int] = (-1, -1)
    """(round, epoch) of the round that made this state: its last commit, or the sync round
    in which it adopted (or was the source). (-1, -1): not known (a fresh process). Rule 8."""
    compute_ms: float = -1.0
    """Mean time from the end of the previous step to ready-to-exchange of its newest cleanly
    trained steps covering `stragglers.MEASURE_S` and at least `stragglers.window` of them; -1
    while it has fewer since it (re)joined. Rule 14."""
    compute_round: int = -1
    """The round of the newest step in `compute_ms`."""
    compute_n: int = 0
    """How many steps `compute_ms` covers (0: `stragglers.window`, as older reports meant)."""
    bench: int = -1
    """A benched straggler (rule 14): the round that benched it (-1: not benched). Its report
    counts for every round, and its `compute_ms` is its probe: its pace outside the rounds."""
    bench_s: float = 0.0
    """A benched straggler: seconds since it learned it is benched."""
    probe_s: float = 0.0
    """A benched straggler: the seconds its probe (`compute_ms`) covers; -1: it cannot probe."""
    opt: int = 0
    """The optimizer its next round steps (-1: not known yet, before its first batch). Rule 15."""
    cont: bool = False
    """Its next round continues a batch whose first optimizer step it committed. Rule 15."""
    micro: int = 0
    """Micro-batches its slot batch splits into, when it can train any subset of them and other
    slots' (gradient accumulation over map-style data); 0 = it cannot. Rule 14, policy "shrink"."""
    joining: bool = False
    """A new process (or incarnation) that has not adopted any quorum yet: its report stands for
    every round until it is taken in (rule 1)."""

    def to_json(self) -> bytes:
        return json.dumps(_shallow(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Report":
        d = _known(cls, json.loads(raw))
        for k in ("blame", "bad_checkpoints"):
            d[k] = tuple(d.get(k, ()))
        d["made"] = tuple(d.get("made", (-1, -1)))
        return cls(**d)


@dataclass(frozen=True)
class Quorum:
    """Who trains in one round, and how. Every leader adopts the same one (see coordinator)."""

    round: int
    epoch: int
    members: tuple[int, ...]
    """Replica ids in ring order (sorted)."""
    incarnations: tuple[int, ...]
    """Incarnation of each member, aligned with `members`."""
    max_step: int
    contributors: tuple[int, ...]
    """Train rounds: members at max_step whose gradients count. Sync rounds: the source."""
    lagging: tuple[int, ...]
    """Members that catch up (train: zeros + catch-up; sync: adopt the source's state)."""
    cursors: tuple[int, ...] = ()
    """Reported data cursor of each member, aligned with `members`."""
    reason: str = ""
    gen: int = 0
    """History generation of this round."""
    kind: str = TRAIN
    """"train": contributors train and exchange; "sync": nobody trains, everyone adopts the
    state of `contributors[0]` (at the job's start, after a resume, and in a rewind)."""
    rewind: Optional[Mapping[str, object]] = None
    """The first round of a new generation: {"from": H, "to": T, "checkpoint": path or "",
    "checkpoint_step": step or -1}. The source loads the checkpoint when one is named."""
    diverged: tuple[int, ...] = ()
    """Contributors whose state digest disagreed with the majority; lagging this round."""
    verified_step: int = -1
    """Newest state version whose digests were compared and agreed."""
    strikes: int = 0
    """Consecutive ring-reset rounds with these members (rule 5)."""
    quarantine: tuple[tuple[int, int, int], ...] = ()
    """(rid, until_round, exclusions) of members excluded by rule 5."""
    slow: tuple[tuple[int, int, int], ...] = ()
    """(rid, round that benched it, exclusions) of stragglers benched by rule 14: not members,
    they measure their pace outside the rounds until it is within the threshold
    (coord/stragglers.py)."""
    parole: tuple[tuple[int, int, int], ...] = ()
    """(rid, round it returned, exclusions) of readmitted stragglers not forgiven yet: benched
    again, their count goes on."""
    pace_ms: float = -1.0
    """The median of the members' compute measures at the last full round (-1: none): what a
    benched straggler's probe, and a member's own measure between full rounds, compare with."""
    suspects: tuple[tuple[int, int, int], ...] = ()
    """(rid, round of its first flag, round of its newest flag) of members flagged by rule 14,
    not yet confirmed as stragglers by a non-overlapping window nor cleared by a whole window
    within the threshold (coord/stragglers.py)."""
    shrunk: tuple[tuple[int, int, int], ...] = ()
    """(rid, g, n) of stragglers shrunk in this round (rule 14, policy "shrink"): rid trains the
    first n-g of its slot batch's n micro-batches, the contributors not shrunk train the rest
    (replica/batch_policy.py). The previous round's `shrink_next`, for its contributors."""
    shrink_next: tuple[tuple[int, int, int], ...] = ()
    """The split announced for the rounds after this one (coord/stragglers.py, `shrink`): a
    straggler computes before its round's quorum arrives, so it learns its share a round ahead."""
    stop: bool = False
    """Some member asked to stop: every replica stops after committing this round."""
    steady: bool = False
    """Derived by every leader from the previous round without etcd (`steady_next`)."""
    slot_cursors: tuple[int, ...] = ()
    """Train rounds under batch_policy "constant": the cursor of every slot 0..R-1 (members'
    as reported, the others' from the ledger), so contributors can train absent slots
    (replica/batch_policy.py). Empty otherwise."""
    opt: int = 0
    """The optimizer this round steps (rule 15; -1: the contributors step the first one their
    batch steps, which no report named yet)."""
    cont: bool = False
    """The round continues a batch (its second or later optimizer step): it records no batch in
    the ledger and advances no cursor; replicas at a batch boundary sit it out (rule 15)."""
    first: int = -1
    """The optimizer the job's batches start with, once a round named it (rule 15): a batch
    start whose contributors do not know theirs yet (replicas before their first batch) steps
    it, so that a lagging replica knows which step to apply."""

    def index(self, rid: int) -> int:
        return self.members.index(rid)

    def member_set(self) -> frozenset[tuple[int, int]]:
        return frozenset(zip(self.members, self.incarnations, strict=True))

    @property
    def source(self) -> int:
        """The replica everyone adopts from in a sync round."""
        return self.contributors[0] if self.kind == SYNC else -1

    def to_json(self) -> bytes:
        return json.dumps(_shallow(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Quorum":
        d = _known(cls, json.loads(raw))
        for k in ("members", "incarnations", "contributors", "lagging", "diverged"):
            d[k] = tuple(d.get(k, ()))
        d["cursors"] = tuple(d.get("cursors", ()))
        d["slot_cursors"] = tuple(d.get("slot_cursors", ()))
        d["quarantine"] = tuple(tuple(q) for q in d.get("quarantine", ()))
        d["slow"] = tuple(tuple(q) for q in d.get("slow", ()))
        d["parole"] = tuple(tuple(q) for q in d.get("parole", ()))
        d["suspects"] = tuple(tuple(q) for q in d.get("suspects", ()))
        d["shrunk"] = tuple(tuple(q) for q in d.get("shrunk", ()))
        d["shrink_next"] = tuple(tuple(q) for q in d.get("shrink_next", ()))
        return cls(**d)

    def cursor_of(self, rid: int) -> int:
        return self.cursors[self.members.index(rid)]


@dataclass(frozen=True)
class Halt:
    """The decision that ends the job instead of a quorum (no majority of replica states agreed):
    stored under `quorum/{round}` like one."""

    reason: str
    round: int

    def to_json(self) -> bytes:
        return json.dumps({"halt": self.reason, "round": self.round}).encode()


def decode_round(raw: bytes) -> "Quorum | Halt":
    """A `quorum/{round}` record, the one decoder of it: the decided quorum, or the halt."""
    if raw.startswith(b'{"halt"'):
        d = json.loads(raw)
        return Halt(str(d["halt"]), int(d.get("round", -1)))
    return Quorum.from_json(raw)


@dataclass(frozen=True)
class JobSpec:
    """The parts of the job config the decision needs."""

    replicas: int
    min_replicas: int = 1
    init_timeout_s: float = 10.0
    fingerprint: Mapping[str, object] = field(default_factory=dict)
    batch_policy: str = "shrink"
    """"constant": train rounds carry every slot's cursor (`Quorum.slot_cursors`)."""
    straggler_threshold: float = 0.0
    """Rule 14: compute time over the median of the others' that makes a straggler; 0 = off."""
    straggler_policy: str = "wait"
    """Rule 14: "wait" (report only), "exclude", "shrink" or "adaptive"."""
    straggler_window: int = 10
    """Rule 14: the steps each report's compute time is a median of (for the event)."""


@dataclass(frozen=True)
class History:
    """What the job's records say, read by the coordinator for the decision."""

    committed_step: int = 0
    """H: the newest state version the job has recorded in the current generation (1 + the
    newest recorded commit, or the generation's base). The coordinator may pass any value
    <= the highest reported step of the current generation when that step is above the
    previous round's max_step (nothing can be lost then)."""
    checkpoints: tuple[tuple[int, str], ...] = ()
    """Published checkpoints of the current history: (step, path), any order."""
    gen: int = 0
    """The ledger's newest history generation: the generation of a job's first round (after
    a `--resume` in the same keyspace it is the resume's new generation)."""
    cursors: Mapping[int, int] = field(default_factory=dict)
    """Slot cursors of the current generation in the ledger (read only under batch_policy
    "constant"; every previous member recorded its commits before it reported)."""


@dataclass(frozen=True)
class Decision:
    quorum: Optional[Quorum]
    """None while the round must wait, or when the job halts."""
    reason: str
    refused: Mapping[int, str] = field(default_factory=dict)
    """Replica id -> why its report was refused (config mismatch)."""
    halt: str = ""
    """Non-empty: the job must stop (states diverged with no majority); the reason."""
    passed: int = -1
    """A later round a member reports for (round_log.passed): this round was passed without
    being recorded, and nobody decides it; the decider reports for that round instead."""
    diverged: Mapping[int, tuple[str, str]] = field(default_factory=dict)
    """Replica id -> (its digest, the majority's digest), for the `diverged` event."""
    stale: Mapping[int, tuple[tuple[int, int], tuple[int, int]]] = field(default_factory=dict)
    """Replica id -> (the (round, epoch) that made its state, the newest), for the `stale` event."""
    stragglers: Mapping[int, float] = field(default_factory=dict)
    """Rule 14: replica id -> its compute time over the median of the others', for the
    `straggler` event (every straggler, whatever the policy)."""
    excluded_straggler: Optional[tuple[int, int, int]] = None
    """Rule 14: (rid, round, exclusions) of the straggler benched now."""
    readmitted: Mapping[int, tuple[int, float]] = field(default_factory=dict)
    """Rule 14: benched stragglers that return in this round -> (exclusions, their probe's
    ratio to the members' pace; -1: not measured), for the `readmitted` event."""
