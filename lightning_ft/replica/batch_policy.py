"""Which slot batches a train round trains, and who trains them (docs/ARCHITECTURE.md,
"Batch policies"; "A step", 4, and "Exactly once"). A pure rule: no I/O.

Every replica slot s owns a stream of batches; its cursor is the next batch index to train
(data.py). In a train round the contributors train, and the round's ledger record
`batches` {slot: k} lists what was trained. Two policies:

- `shrink` (the paper's FT-HSDP): each contributor trains its own slot's batch at its
  cursor; slots of absent replicas (dead, restarting or catching up) wait for them. The
  global batch shrinks to len(contributors) slot batches, the divisor of the gradient
  average is len(contributors), and the LR intervention sees x = contributors / R.
- `constant`: contributors also train the absent slots' batches, at those slots' cursors
  (`slot_cursors`, from the quorum), so every step trains all R slot batches: the global
  batch stays constant, the divisor is R and x = 1 (no LR intervention applies). Absent
  slots are dealt out in slot order to the contributors in ring order, round-robin, so
  no contributor trains more than one extra slot more than another. Exactly once holds
  as before: each absent slot's cursor advances with the commit that lists it, and its
  replica resumes past the batches others trained for it.

Under either policy a round may shrink stragglers (`Quorum.shrunk`, coord/stragglers.py: policy
"shrink"): a shrunk contributor (rid, g, n) trains the first n-g micro-batches of its slot
batch (`skip`: the rest), and those g micro-batches of slot rid's batch are dealt one by one
to the contributors not shrunk, in ring order, round-robin across every shrunk one (`micro`).
The slot batches and the divisor do not change: each micro-batch's loss is already scaled by
1/n, so the summed gradients are those of the whole slot batches, and the ledger record is the
same.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Mapping, Sequence

from lightning_ft.constants import BATCH_POLICIES as POLICIES


@dataclass(frozen=True)
class RoundBatches:
    """The batches of one train round."""

    batches: Mapping[int, int]
    """Slot -> batch index trained in this round (the ledger record of the commit)."""
    extra: Mapping[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    """Contributor -> ((slot, k), ...) it trains besides its own slot (constant policy)."""
    micro: Mapping[int, tuple[tuple[int, int, int], ...]] = field(default_factory=dict)
    """Contributor -> ((slot, k, j), ...): micro-batches of shrunk slots it trains besides."""
    skip: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    """Shrunk contributor -> the micro-batches of its own slot batch it does not train."""

    @property
    def divisor(self) -> int:
        """Slot batches whose gradients are summed: the gradient average divides by this."""
        return len(self.batches)

    def extra_of(self, rid: int) -> tuple[tuple[int, int], ...]:
        return tuple(self.extra.get(rid, ()))

    def micro_of(self, rid: int) -> tuple[tuple[int, int, int], ...]:
        return tuple(self.micro.get(rid, ()))

    def skip_of(self, rid: int) -> tuple[int, ...]:
        return tuple(self.skip.get(rid, ()))


def round_batches(policy: str, contributors: Sequence[int], cursors: Mapping[int, int], slots: int,
                  slot_cursors: Sequence[int] = (), shrunk: Sequence[tuple[int, int, int]] = ()) -> RoundBatches:
    """The round's batches under `policy`.

    `contributors`: replica ids that train, in ring order; `cursors`: each contributor's
    own cursor (as it reported it); `slots`: R; `slot_cursors`: the cursor of every slot
    0..R-1 at this round (needed by `constant` when some slot is absent); `shrunk`: the
    round's (rid, g, n) splits (`Quorum.shrunk`)."""
    shrunk_ids = {e[0] for e in shrunk}
    rb = _slot_batches(policy, contributors, cursors, slots, slot_cursors, shrunk_ids)
    helpers = [c for c in contributors if c not in shrunk_ids]
    bad = [e for e in shrunk if e[0] not in contributors or not 0 < e[1] < e[2]]
    if bad or (shrunk and not helpers):
        raise ValueError(f"shrunk {list(shrunk)} does not fit contributors {list(contributors)}")
    micro: dict[int, list[tuple[int, int, int]]] = {}
    i = 0
    for rid, g, n in sorted(shrunk):
        for j in range(n - g, n):
            micro.setdefault(helpers[i % len(helpers)], []).append((rid, int(cursors[rid]), j))
            i += 1
    return RoundBatches(rb.batches, rb.extra, {c: tuple(v) for c, v in micro.items()},
                        {rid: tuple(range(n - g, n)) for rid, g, n in shrunk})


def _slot_batches(policy: str, contributors: Sequence[int], cursors: Mapping[int, int], slots: int,
                  slot_cursors: Sequence[int], shrunk: set[int]) -> RoundBatches:
    """The slot batches of the round, and the absent slots' dealt to contributors (`constant`;
    shrunk stragglers get none while another contributor can take them)."""
    if policy not in POLICIES:
        raise ValueError(f"batch_policy {policy!r} is not one of {', '.join(POLICIES)}")
    missing = [c for c in contributors if c not in cursors]
    if missing:
        raise ValueError(f"contributors {missing} have no cursor in {dict(cursors)}")
    batches = {c: int(cursors[c]) for c in contributors}
    absent = [s for s in range(slots) if s not in batches]
    if policy == "shrink" or not absent or not contributors:
        return RoundBatches(batches)
    if len(slot_cursors) != slots:
        raise ValueError(f"batch_policy constant needs the cursors of all {slots} slots to train absent slots "
                         f"{absent}; the quorum carried {len(slot_cursors)}")
    ring = [c for c in contributors if c not in shrunk] or list(contributors)
    extra: dict[int, list[tuple[int, int]]] = {}
    for i, s in enumerate(absent):
        k = int(slot_cursors[s])
        batches[s] = k
        extra.setdefault(ring[i % len(ring)], []).append((s, k))
    return RoundBatches(dict(sorted(batches.items())), {c: tuple(v) for c, v in extra.items()})


def own_todo(done: Collection[int], n: int, skip: Collection[int]) -> tuple[bool, list[int]]:
    """A shrunk (or formerly shrunk) replica's own slot batch: (zero the local gradients first,
    the micro-batches still to compute) so that they hold exactly every micro-batch of `n` but
    `skip`, given that they hold `done`. Computing before its round's plan arrived, it skipped
    what the previous quorum announced (`ReplicaManager.planned_skip`); when the round decided
    otherwise, a missing micro-batch is computed now, and one it should have given away means
    starting over (gradients cannot be taken back out)."""
    want = set(range(n)) - set(skip)
    if set(done) - want:
        return True, sorted(want)
    return False, sorted(want - set(done))
