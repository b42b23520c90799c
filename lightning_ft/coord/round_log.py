"""The decided rounds in etcd (`quorum/<round>`): recording a round that was decided locally,
pruning old ones, and reading the round before a given one (docs/ARCHITECTURE.md, "Steady
rounds"). Pure reads and writes on a Store; the Coordinator decides when."""
from __future__ import annotations

from typing import Mapping, Optional

from . import keys
from .round_records import Quorum, Report, decode_round
from .store import Store

KEEP_ROUNDS = 32
"""Decided rounds kept in etcd; older `quorum/` keys are pruned by the round's writer."""


def prune(store: Store, root: str, round: int) -> None:
    """Delete the round that `round` pushes out of the KEEP_ROUNDS kept."""
    old = round - KEEP_ROUNDS
    if old >= 0:
        store.delete(keys.quorum(root, old))


def record(store: Store, root: str, q: Quorum) -> bool:
    """Store a locally decided round, create-if-absent (a full decision of the same round that
    won stands), and prune; whether ours was stored."""
    if not store.create(keys.quorum(root, q.round), q.to_json()):
        return False
    prune(store, root, q.round)
    return True


def latest(store: Store, root: str) -> Optional[Quorum]:
    """The newest decided quorum in the store (any leader's), or None before the first."""
    kvs, _ = store.get_prefix(keys.quorum(root))
    quorums = [q for q in map(decode_round, (kv.value for kv in kvs)) if isinstance(q, Quorum)]
    return quorums[-1] if quorums else None


def recorded_before(store: Store, root: str, round: int, ours: Optional[Quorum] = None) -> Optional[Quorum]:
    """The previous round of `round`: the one recorded in etcd as round - 1; else `ours` when it
    is round - 1 (a steady round nobody recorded); else the newest quorum recorded before `round`.
    Not all steady rounds are recorded (replica/rounds.py, RECORD_EVERY), and the ones after a
    recorded round have its members until the next full round (which is always recorded): that
    round stands for them. A record beats our own view: a replica cut off that trained on alone
    in steady rounds of its own, under numbers the others reached without it, must not take its
    own as the job's (the simulator, seed 1095: it decided a rewind alone and trained generation
    1's first batches with other contents). None before the job's first round."""
    if round <= 0:
        return None
    kv = store.get(keys.quorum(root, round - 1))
    if kv is None and ours is not None and ours.round == round - 1:
        return ours
    if kv is None:
        kvs, _ = store.get_prefix(keys.quorum(root))
        older = [k for k in kvs if keys.round_of(k.key) < round]
        kv = older[-1] if older else None
    recorded = decode_round(kv.value) if kv is not None else None
    return recorded if isinstance(recorded, Quorum) else None


def passed(round: int, reports: Mapping[int, Report], evicted: frozenset, rid: int) -> int:
    """The latest round past `round` that another live member reports for, else -1. Steady rounds
    are recorded sparsely, so a joiner (or a member left behind) can report for a round the
    others passed long ago: deciding it from their later reports made two histories of rounds
    with the same members (a joiner decided round 1120 while the others decided round 1137 with
    the same reports, then each side followed its own rounds and waited for the other forever).
    Joiners and benched stragglers report for every round: theirs prove nothing."""
    return max((rep.round for r, rep in reports.items() if r != rid and rep.round > round and not rep.joining
                and rep.bench < 0 and (r, rep.incarnation) not in evicted), default=-1)
