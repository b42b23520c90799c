"""Stragglers: which replica is slower than the others, and what the quorum does about it
(docs/ARCHITECTURE.md, "Stragglers"). Pure: no I/O, no clock.

Each leader reports `compute_ms`, the mean over its last `window` cleanly trained steps of
the time from the end of its previous step to ready-to-exchange (data, forward, backward),
or -1 while it has fewer such steps since it last (re)joined. The mean, not the median: a
replica throttled in bursts (stopped 0.2 s in every 0.3 s) trains most steps at full speed
and a few very slowly, and only the mean sees that it costs the job two thirds of its time. The decider of a full round
compares them (`ratios`): a replica's ratio is its compute time over the median of the
others'. One at or above `threshold`, and slower than the median of all (a minority), is
flagged (`flag`); it is a straggler once flagged by two measures whose windows do not overlap
(a flag by a measure `window` or more rounds newer than the first flag confirms it), and it
stays a suspect until a whole window is measured within the threshold after its newest flag
(`Quorum.suspects` holds both rounds). One window is not enough: on a shared host, load slows
one healthy replica's window by 1.3x now and then, and a single window then excluded it (CI:
replica 0 sat out twice while the throttled replica trained on, because at most
`max_excluded` replicas sit out at once). And one clean window must not clear a suspect: a
replica throttled in bursts (its stops land in its compute or in the exchange, by chance) has
clean windows among its slow ones, and when the confirming measure alone decided, CI saw one
trained back in for 82 rounds. With full rounds every 64 steps the second measure is the next
full round's; with a digest every step, `window` rounds later.

What the round does with it is the policy (`stragglers.policy`):
- `wait`: nothing; the job runs at the straggler's pace, and the `straggler` event says so.
- `exclude`: the straggler sits out `PROBATION_ROUNDS * 2**k` rounds on its k-th exclusion
  (in `Quorum.slow`, beside rule 5's quarantine), so the others train at their own pace;
  its slot's batches wait (exactly once holds), and it rejoins as lagging: a catch-up, then
  it trains and is measured afresh. One that is measured within the threshold after it
  came back, and is not flagged for a probation's length of rounds, is forgiven (k resets):
  one good window of a replica throttled in bursts must not reset its backoff. At most one
  replica is excluded per round, never one that would leave fewer than `min_replicas`
  members, and at most `max_excluded(R)` = max(1, (R-1)//2) sit out at once, so a majority of
  the job keeps training. Without that cap, load that slows replicas in turn (a shared host)
  excluded them in turn: a 100-fault soak under `exclude` trained most of its steps on one
  replica of three while the other two sat out doubling probations.
- `shrink`: the straggler keeps training, but gives the last `g` of its slot batch's `n`
  micro-batches to the others (`split`: the `g` that evens its time with theirs), so the global
  batch stays the same and the job waits for `max((n-g)*ratio, n + ceil(g/helpers))` micro-batch
  times instead of `n*ratio`. A replica that cannot split its batch (it reports `micro` < 2: no
  gradient accumulation, manual optimization, a stream loader), or has no helper that can (the
  other members report another `micro`), is excluded as under `exclude`. A split is announced
  one round ahead (`Quorum.shrink_next`) and takes effect in the rounds after it
  (`Quorum.shrunk`): a straggler computes its micro-batches before its round's quorum arrives
  (overlap), so it must know its share before. It lasts while the replica is a suspect (its
  measure, normalized to a whole slot batch, stays slow), its `g` follows each new flag's ratio,
  and it ends when a whole window is measured within the threshold. At most
  `max_excluded(R)` replicas are shrunk at once, the slowest first, and at least one helper
  stays; replica/batch_policy.py deals the given-away micro-batches to the helpers in ring order.
"""
from __future__ import annotations

import math
import statistics
from typing import Collection, Mapping, NamedTuple, Optional

WAIT, EXCLUDE, SHRINK = "wait", "exclude", "shrink"
POLICIES = (WAIT, EXCLUDE, SHRINK)
MIN_EXCESS_MS = 5.0
"""A straggler's compute time exceeds the median of the others' by at least this much."""
PROBATION_ROUNDS = 64
"""Rounds a straggler sits out on its first exclusion (doubling on each repeat): long enough
that a replica that stays slow costs the job little (it slows only the rounds between its
return and its next measurement), short enough that a recovered one is back within seconds."""


def ratios(compute_ms: Mapping[int, float]) -> dict[int, float]:
    """Replica -> its compute time over the median of the others' (replicas with a measure,
    compute_ms > 0; none when fewer than two are measured)."""
    known = {r: float(ms) for r, ms in compute_ms.items() if ms > 0}
    if len(known) < 2:
        return {}
    out = {}
    for r, ms in known.items():
        others = statistics.median(v for o, v in known.items() if o != r)
        out[r] = ms / others if others > 0 else float("inf")
    return out


def flag(compute_ms: Mapping[int, float], threshold: float) -> dict[int, float]:
    """The stragglers and their ratios: ratio >= threshold (threshold <= 0: detection off).
    With two replicas measured, the slower one is flagged when it is `threshold` times the
    other (a majority of one)."""
    if threshold <= 0:
        return {}
    known = [float(ms) for ms in compute_ms.values() if ms > 0]
    middle = statistics.median(known) if known else 0.0
    # ... and slower than the middle of all (when most replicas are slow, the fast one is the
    # outlier, and excluding a majority would leave the job to it), by at least MIN_EXCESS_MS
    # (a 2 ms step against a 1.4 ms one is noise, not a straggler)
    return {r: x for r, x in ratios(compute_ms).items()
            if x >= threshold and compute_ms[r] > middle and compute_ms[r] - compute_ms[r] / x >= MIN_EXCESS_MS}


def max_excluded(replicas: int) -> int:
    """How many replicas may sit out a straggler probation at once: a minority of the job, and
    one even for two replicas (then `min_replicas` decides)."""
    return max(1, (replicas - 1) // 2)


class Verdict(NamedTuple):
    """One round's straggler decision."""

    stragglers: dict[int, float]
    """Confirmed stragglers (flagged by two non-overlapping windows) and their ratios."""
    excluded: Optional[tuple[int, int, int]]
    """(rid, until_round, exclusions) of the one excluded now, or None."""
    slow: tuple[tuple[int, int, int], ...]
    """The new `Quorum.slow`."""
    suspects: tuple[tuple[int, int, int], ...]
    """The new `Quorum.suspects`: (rid, round of the measure that first flagged it, round of the
    newest measure that flagged it)."""


def decide(round: int, measures: Mapping[int, tuple[float, int]], members: tuple[int, ...], slow_before: tuple,
           threshold: float, policy: str, min_replicas: int, replicas: int, window: int,
           suspects_before: tuple = (), excludable: Optional[Collection[int]] = None) -> Verdict:
    """One round's straggler decision.

    `measures` maps the round's valid members (after rule 5) to (compute_ms, the round of the
    newest step measured); `slow_before` and `suspects_before` are the previous round's
    `Quorum.slow` and `Quorum.suspects`. A measure older than the replica's return from
    probation does not count (it was made before it sat out). A flagged replica becomes a
    suspect at its measure's round; a flag by a measure `window` or more rounds newer (a window
    that does not overlap) makes it a straggler, and a measure within the threshold `window` or
    more rounds after its newest flag clears it. Anything in between only moves its newest flag.
    A suspect that is no longer a member is forgotten. Entries of `slow` whose probation is
    over stay (their count k) until the replica, no suspect, is measured within the threshold
    a probation's length of rounds after its return, which forgives it. `replicas` is the job's R
    (`max_excluded`). `excludable`: the stragglers policy "exclude" may take out (None: any);
    under "shrink", those that cannot be shrunk."""
    entries = {rid: (until, k) for rid, until, k in slow_before}
    usable = {r: (ms, at) for r, (ms, at) in measures.items()
              if r in members and (r not in entries or at >= entries[r][0])}
    compute_ms = {r: ms for r, (ms, _) in usable.items()}
    raw = flag(compute_ms, threshold)
    first = {s[0]: (s[1], s[-1]) for s in suspects_before if s[0] in members}  # (rid, at) of old records
    span = max(1, window)
    flagged: dict[int, float] = {}
    for r in compute_ms:
        at = usable[r][1]
        if r not in first:
            if r in raw:
                first[r] = (at, at)
        elif r in raw:
            if at - first[r][0] >= span:  # a window that does not overlap the first confirms it
                flagged[r] = raw[r]
            first[r] = (first[r][0], max(first[r][1], at))
        elif compute_ms[r] > 0 and at - first[r][1] >= span:
            del first[r]  # a whole window within the threshold since its last flag
    victim: Optional[int] = None
    sitting_out = sum(1 for until, _ in entries.values() if round < until)
    pool = {r: x for r, x in flagged.items() if excludable is None or r in excludable}
    if policy in (EXCLUDE, SHRINK) and pool and len(members) - 1 >= max(1, min_replicas) \
            and sitting_out < max_excluded(replicas):
        top = max(pool.values())
        victim = max(r for r, x in pool.items() if x == top)  # the slowest; ties: the highest id
        k = entries.get(victim, (0, 0))[1]
        entries[victim] = (round + PROBATION_ROUNDS * 2 ** k, k + 1)
        del first[victim]  # measured afresh after its probation
    for r in members:  # back for a probation's length without being flagged, and measured within: forgiven
        if r in entries and r != victim and r not in raw and r not in first and compute_ms.get(r, -1.0) > 0 \
                and entries[r][0] + PROBATION_ROUNDS <= round:
            del entries[r]
    excluded_now = (victim, *entries[victim]) if victim is not None else None
    return Verdict(flagged, excluded_now, tuple(sorted((r, until, k) for r, (until, k) in entries.items())),
                   tuple(sorted((r, a, b) for r, (a, b) in first.items())))


def excluded(round: int, slow: tuple) -> set[int]:
    """Replicas on probation in `round` (from the previous round's `Quorum.slow`)."""
    return {rid for rid, until, _ in slow if round < until}


def split(n: int, ratio: float, helpers: int) -> int:
    """Policy "shrink": how many of its `n` micro-batches a straggler `ratio` times slower than
    the others gives to `helpers` replicas: the `g` in [0, n-1] that minimizes the round's
    compute, max((n-g)*ratio, n + ceil(g/helpers)) micro-batch times; the smallest such `g`
    (0: giving any away would not make the round shorter)."""
    if n < 2 or helpers < 1 or not ratio > 1.0:
        return 0
    best_g, best = 0, n * ratio
    for g in range(1, n):
        t = max((n - g) * ratio, n + math.ceil(g / helpers))
        if t < best - 1e-9:
            best_g, best = g, t
    return best_g


def splittable(micro: Mapping[int, int]) -> set[int]:
    """Members that can be shrunk: they split their slot batch (`micro` >= 2 micro-batches) and
    some other member splits into as many, so it can train what they give away."""
    return {r for r, n in micro.items() if n >= 2 and any(o != r and m == n for o, m in micro.items())}


def shrink(flagged: Mapping[int, float], suspects: tuple, before: tuple, micro: Mapping[int, int],
           replicas: int) -> tuple[tuple[int, int, int], ...]:
    """Policy "shrink": the split announced for the next rounds (`Quorum.shrink_next`), as
    (rid, g, n) entries: rid gives the last g of its n micro-batches away.

    `flagged`: this round's confirmed stragglers and their ratios; `suspects`: the new
    `Quorum.suspects` (a shrunk replica stays shrunk while it is one); `before`: the previous
    round's `shrink_next`; `micro`: each valid member's reported micro-batches per slot batch.
    A flagged replica's g follows its ratio (`split`); one still a suspect keeps its g; the
    slowest come first, at most `max_excluded(replicas)`, each leaving at least one helper (a
    member not shrunk that splits into as many micro-batches)."""
    still = {s[0] for s in suspects}
    kept = {rid: g for rid, g, n in before if rid in still and rid not in flagged and micro.get(rid) == n}
    can = splittable(micro)
    order = sorted((r for r in set(flagged) | set(kept) if r in can),
                   key=lambda r: (-flagged.get(r, 0.0), -kept.get(r, 0), r))
    out: dict[int, tuple[int, int]] = {}
    for r in order:
        if len(out) >= max_excluded(replicas):
            break
        n = micro[r]
        helpers = [m for m, k in micro.items() if k == n and m != r and m not in out]
        if not helpers:
            continue
        g = split(n, flagged[r], len(helpers)) if r in flagged else kept[r]
        if g > 0:
            out[r] = (g, n)
    for r in list(out):  # one shrunk later may have taken a helper an earlier one counted on
        if not any(m not in out and micro[m] == out[r][1] for m in micro if m != r):
            del out[r]
    return tuple(sorted((r, g, n) for r, (g, n) in out.items()))


def effective(shrink_next: tuple, contributors: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """The split a train round applies: the previous round's announcement (`shrink_next`) for
    those of its replicas that contribute, while at least one contributor is not shrunk."""
    out = tuple(e for e in shrink_next if e[0] in contributors)
    shrunk = {e[0] for e in out}
    return out if any(c not in shrunk for c in contributors) else ()
