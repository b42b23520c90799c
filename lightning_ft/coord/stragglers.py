"""Stragglers: which replica is slower than the others, and what the quorum does about it
(docs/ARCHITECTURE.md, "Stragglers"). Pure: no I/O, no clock.

The measure. Each member reports `compute_ms`, the mean of the time from the end of its
previous step to ready-to-exchange (data, forward, backward) over its newest cleanly trained
steps that cover `MEASURE_S` (1 s) and number at least `window` (`compute_n` of them), or -1
until it has that many since it last (re)joined (`pace_over`). The mean, not the median: a
replica stopped 0.2 s in every 0.3 s trains most steps at full speed and a few very slowly,
and only the mean sees that it costs the job two thirds of its time. Over a second, not a
number of steps: at 100 steps a second ten steps are a tenth of a second, in which one
process of a loaded host is often 1.3x slower than the others by chance, and a stop of 0.2 s
lands in some windows and not in others. A benched replica (below) reports its *probe*: its
pace while it waits outside the rounds (`Probe`).

Detection. A replica's ratio is its compute time over the median of the others' (`ratios`). One
at or above `threshold`, slower than the median of all (a minority) and `MIN_EXCESS_MS` over
it, is flagged (`flag`), but only while at least `least_measured(R)` replicas are measured
(min(3, R)): replicas are compared with each other, and two of three are not a majority. With
two, one process's share of a loaded host decided: CI excluded healthy replica 0 again and
again while the throttled replica, back from its probation, was not measured yet (and so kept
in: at most `max_excluded` sit out at once). A flagged replica is a suspect; a flag by a
measure whose window begins after the first flag's ended (a window that does not overlap)
makes it a straggler; only a measure within the threshold whose window begins after its newest
flag clears it (`Quorum.suspects` holds both rounds): a replica throttled in bursts has clean
windows among its slow ones, and one clean window must not clear it. Load on the whole machine
slows every replica alike, and no ratio moves. Between the periodic full rounds (every 64
steps: 19 s at 3 throttled steps a second) a member whose own measure is slow against the last
full round's pace asks for a full round (`self_check`), once per window, so the decider flags
it, confirms it, or clears it, in seconds at any step rate.

What the round does with a straggler is the policy (`stragglers.policy`):
- `wait`: nothing; the job runs at the straggler's pace, and the `straggler` event says so.
- `exclude`: the straggler is *benched* (`Quorum.slow`: (rid, the round that benched it, k) on
  its k-th exclusion). It is no member: the round neither waits for it nor trains its slot
  (exactly once holds: its batches wait). It keeps measuring its pace outside the rounds (its
  caller computes its current batch again and again and commits nothing) and reports it
  (`Probe`). It is readmitted (a member again: it catches up, then trains) once its pace over
  its last `probe_span(k)` seconds (1 s, doubling with each exclusion, at most
  `MAX_PROBE_S` 4 s) and at least `window` probes is within the threshold of the members'
  (`ready`): in time and in its own pace, not after a number of rounds, which a job at 100
  steps a second passed in under a second and readmitted a replica still stopped 0.2 s in
  every 0.3 s, again and again. One that cannot probe (manual optimization, a replica
  before its first batch) is readmitted after `probe_span(k)` seconds unmeasured. Readmitted,
  it is on parole (`Quorum.parole`): flagged again, its next exclusion is k+1; forgiven
  (k resets) once it has trained `FORGIVE_ROUNDS` rounds unflagged and measured within the
  threshold. At most one replica is benched per round, never one that would leave fewer
  than `min_replicas` members (benched ones are readmitted, the fastest first, when the
  members fall below it), and at most `max_excluded(R)` = max(1, (R-1)//2) sit out at once.
- `shrink`: the straggler keeps training, but gives the last `g` of its slot batch's `n`
  micro-batches to the others (`split`: the `g` that evens its time with theirs), so the global
  batch stays the same and the job waits for `max((n-g)*ratio, n + ceil(g/helpers))` micro-batch
  times instead of `n*ratio`. A replica that cannot split its batch (it reports `micro` < 2: no
  gradient accumulation, manual optimization, a stream loader), or has no helper that can (the
  other members report another `micro`), is benched as under `exclude`. A split is announced
  one round ahead (`Quorum.shrink_next`) and takes effect in the rounds after it
  (`Quorum.shrunk`): a straggler computes its micro-batches before its round's quorum arrives
  (overlap), so it must know its share before. It lasts while the replica is a suspect (its
  measure, normalized to a whole slot batch, stays slow), its `g` follows each new flag's ratio,
  and it ends when a whole window is measured within the threshold. At most
  `max_excluded(R)` replicas are shrunk at once, the slowest first, and at least one helper
  stays; replica/batch_policy.py deals the given-away micro-batches to the helpers in ring order.
- `adaptive`: shrink first, exclude what shrinking cannot fix: a straggler whose best split
  brings the round within the threshold of the others' time (`split_cost`) is shrunk; one
  that is slower than that (a stopped process stalls the exchange whatever its share), or
  becomes so while shrunk, or cannot split, is benched.
"""
from __future__ import annotations

import math
import statistics
from typing import Collection, Mapping, NamedTuple, Optional, Sequence

WAIT, EXCLUDE, SHRINK, ADAPTIVE = "wait", "exclude", "shrink", "adaptive"
POLICIES = (WAIT, EXCLUDE, SHRINK, ADAPTIVE)
MIN_EXCESS_MS = 5.0
"""A straggler's compute time exceeds the median of the others' by at least this much."""
MEASURE_S = 1.0
"""The seconds a member's compute measure covers (at least; and at least `window` steps)."""
PROBE_S = 1.0
"""The seconds a benched replica's pace is measured over before it may return, on its first
exclusion (doubling on each repeat): at least three cycles of a 0.2 s in 0.3 s stop, whatever
the step rate."""
MAX_PROBE_S = 4.0
"""The longest span a benched replica's pace is measured over: one that is healthy again is
back within about this plus a full round and a catch-up (the target is 5 s)."""
FORGIVE_ROUNDS = 256
"""Rounds a readmitted straggler trains unflagged (and measured within the threshold) before
its exclusions are forgotten (k resets)."""


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


def least_measured(replicas: int) -> int:
    """How many replicas must be measured before any is flagged: min(3, R) (two when R is 2)."""
    return max(2, min(3, replicas))


def flag(compute_ms: Mapping[int, float], threshold: float, least: int = 2) -> dict[int, float]:
    """The stragglers and their ratios: ratio >= threshold (threshold <= 0: detection off), once
    at least `least` replicas are measured. With two replicas measured (and `least` 2), the
    slower one is flagged when it is `threshold` times the other (a majority of one)."""
    if threshold <= 0:
        return {}
    known = [float(ms) for ms in compute_ms.values() if ms > 0]
    if len(known) < max(2, least):
        return {}
    middle = statistics.median(known)
    # ... and slower than the middle of all (when most replicas are slow, the fast one is the
    # outlier, and excluding a majority would leave the job to it), by at least MIN_EXCESS_MS
    # (a 2 ms step against a 1.4 ms one is noise, not a straggler)
    return {r: x for r, x in ratios(compute_ms).items()
            if x >= threshold and compute_ms[r] > middle and compute_ms[r] - compute_ms[r] / x >= MIN_EXCESS_MS}


def within(ms: float, pace_ms: float, threshold: float) -> bool:
    """A measure `ms` is within the threshold of the pace `pace_ms` (unknown pace: yes)."""
    return pace_ms <= 0 or ms < threshold * pace_ms or ms - pace_ms < MIN_EXCESS_MS


def max_excluded(replicas: int) -> int:
    """How many replicas may sit out (benched) at once: a minority of the job, and one even for
    two replicas (then `min_replicas` decides)."""
    return max(1, (replicas - 1) // 2)


def probe_span(k: int) -> float:
    """The seconds a replica benched for the k-th time must show its pace over before it returns."""
    return min(PROBE_S * 2 ** max(0, k - 1), MAX_PROBE_S)


class Probe(NamedTuple):
    """What a benched replica reports of itself (Report: compute_ms, probe_s, bench, bench_s)."""

    ms: float
    """Its mean compute time per slot batch over its last `probe_span(k)` seconds and at least
    `window` probes; -1 until it has that many."""
    span_s: float
    """The seconds `ms` covers; -1: its caller cannot probe (it is readmitted unmeasured)."""
    bench: int
    """The round that benched it, as it learned (-1: it does not know it is benched)."""
    out_s: float
    """Seconds since it learned it is benched."""


def ready(probe: Probe, since: int, k: int, pace_ms: float, threshold: float) -> bool:
    """Whether a replica benched in round `since` (its k-th exclusion) may return: its probe
    answers this exclusion and covers `probe_span(k)`, at a pace within the threshold of
    `pace_ms` (the members'; strictly below `threshold` times it); one that cannot probe, once
    benched for `probe_span(k)`."""
    if probe.bench != since:
        return False
    if probe.span_s < 0:
        return probe.out_s >= probe_span(k)
    # No MIN_EXCESS_MS allowance here: a step of 2 ms of compute (and 8 of exchange) stopped 0.2 s
    # in every 0.3 s probes at 2x, under 5 ms over the pace, and slows the job 3x.
    return probe.ms > 0 and probe.span_s >= probe_span(k) and (pace_ms <= 0 or probe.ms < threshold * pace_ms)


def pace_over(samples: Sequence[tuple[float, float, float]], span_s: float, least: int) -> tuple[float, float, int]:
    """A measure from timed samples (start, end, seconds measured), oldest first: (the mean of
    their seconds in ms, the seconds they cover, how many) over the newest samples that cover
    `span_s` seconds and number at least `least`; (-1, seconds covered, n) until there are that
    many. A member's samples are its cleanly trained steps; a benched replica's, its probes."""
    n, covered, total = 0, 0.0, 0.0
    end = samples[-1][1] if samples else 0.0
    for start, _, secs in reversed(samples):
        n, total, covered = n + 1, total + secs, end - start
        if n >= max(1, least) and covered >= span_s:
            return total / n * 1e3, covered, n
    return -1.0, covered, n


class Rules(NamedTuple):
    """The job's straggler settings (JobSpec)."""

    threshold: float
    policy: str
    min_replicas: int
    replicas: int
    window: int


class Standing(NamedTuple):
    """The stragglers' standing a quorum records (`Quorum.slow`, `parole`, `suspects`, `pace_ms`)."""

    slow: tuple = ()
    """(rid, round that benched it, k) of the benched."""
    parole: tuple = ()
    """(rid, round it returned, k) of readmitted stragglers not forgiven yet."""
    suspects: tuple = ()
    """(rid, round of its first flag, round of its newest flag)."""
    pace_ms: float = -1.0
    """The median of the members' measures (-1: none measured)."""


class Verdict(NamedTuple):
    """One round's straggler decision."""

    stragglers: dict[int, float]
    """Confirmed stragglers (flagged by two non-overlapping windows) and their ratios."""
    excluded: Optional[tuple[int, int, int]]
    """(rid, round, k) of the one benched now, or None."""
    readmitted: tuple[int, ...]
    """Benched replicas that return in this round (members again: they catch up)."""
    standing: Standing
    """The new standing."""

    @property
    def out(self) -> set[int]:
        """The replicas that sit this round out."""
        return {rid for rid, _, _ in self.standing.slow}


def decide(round: int, measures: Mapping[int, tuple], members: tuple[int, ...], rules: Rules,
           before: Optional[Standing] = None, probes: Optional[Mapping[int, Probe]] = None,
           returnable: Optional[Collection[int]] = None, micro: Optional[Mapping[int, int]] = None) -> Verdict:
    """One round's straggler decision.

    `measures` maps the round's members (valid, not benched) to (compute_ms, the round of the
    newest step measured[, how many steps it covers: default `window`]); `before` is the
    previous round's standing. `probes`: what each benched replica that still has a report says
    (a benched replica with none, gone, leaves the bench for parole, its k kept); `returnable`:
    those of them whose report counts for this round (default: all). `micro`: each member's
    micro-batches per slot batch (policies "shrink" and "adaptive": who can be shrunk instead
    of benched)."""
    before = before or Standing()
    probes = probes or {}
    returnable = set(probes) if returnable is None else set(returnable)
    bench = {rid: (since, k) for rid, since, k in before.slow}
    parole = {rid: (back, k) for rid, back, k in before.parole}
    for r in [r for r in bench if r not in probes]:  # gone (its lease lapsed, it left): keep its count
        parole[r] = (round, bench.pop(r)[1])
    usable = {r: (m[0], m[1], m[2] if len(m) > 2 and m[2] > 0 else rules.window) for r, m in measures.items()
              if r in members and (r not in parole or m[1] >= parole[r][0])}  # not from before it sat out
    member_ms = {r: m[0] for r, m in usable.items()}
    known = [ms for ms in member_ms.values() if ms > 0]
    pace = statistics.median(known) if known else before.pace_ms

    # Readmission: a pace within the threshold over a whole span; or to keep min_replicas.
    back = [r for r in sorted(bench) if r in returnable and ready(probes[r], *bench[r], pace, rules.threshold)]
    short = max(1, rules.min_replicas) - len(members) - len(back)
    if short > 0:
        def speed(r: int) -> tuple[float, int]:
            p = probes[r]
            return (p.ms if p.ms > 0 and p.bench == bench[r][0] else math.inf), r
        back += sorted((r for r in bench if r in returnable and r not in back), key=speed)[:short]
    for r in back:
        parole[r] = (round, bench.pop(r)[1])

    # Detection: members' measures beside the benched replicas' probes of this exclusion.
    compare = dict(member_ms)
    compare.update({r: p.ms for r, p in probes.items() if r in bench and p.bench == bench[r][0] and p.ms > 0})
    raw = {r: x for r, x in flag(compare, rules.threshold, least_measured(rules.replicas)).items() if r in member_ms}
    first = {s[0]: (s[1], s[-1]) for s in before.suspects if s[0] in members}  # (rid, at) of old records
    flagged: dict[int, float] = {}
    for r in member_ms:
        _, at, n = usable[r]
        begins = at - n + 1  # the round of the oldest step in the window
        if r not in first:
            if r in raw:
                first[r] = (at, at)
        elif r in raw:
            if begins > first[r][0]:  # a window that does not overlap the first confirms it
                flagged[r] = raw[r]
            first[r] = (first[r][0], max(first[r][1], at))
        elif member_ms[r] > 0 and begins > first[r][1]:
            del first[r]  # a whole window within the threshold since its last flag

    # Exclusion: the slowest straggler the policy benches.
    victim: Optional[int] = None
    pool = {r: x for r, x in flagged.items() if benchable(rules.policy, r, x, micro or {}, rules.threshold)}
    keeps = len(members) + len(back) - 1 >= max(1, rules.min_replicas)
    if pool and keeps and len(bench) < max_excluded(rules.replicas):
        top = max(pool.values())
        victim = max(r for r, x in pool.items() if x == top)  # the slowest; ties: the highest id
        k = parole.pop(victim, (0, 0))[1]
        bench[victim] = (round, k + 1)
        del first[victim]  # measured afresh when it is back
    for r in member_ms:  # back for FORGIVE_ROUNDS unflagged, measured within: forgiven
        if r in parole and r not in raw and r not in first and member_ms[r] > 0 \
                and parole[r][0] + FORGIVE_ROUNDS <= round:
            del parole[r]
    excluded_now = (victim, *bench[victim]) if victim is not None else None
    return Verdict(flagged, excluded_now, tuple(back), Standing(
        tuple(sorted((r, since, k) for r, (since, k) in bench.items())),
        tuple(sorted((r, at, k) for r, (at, k) in parole.items())),
        tuple(sorted((r, a, b) for r, (a, b) in first.items())), pace))


def benchable(policy: str, rid: int, ratio: float, micro: Mapping[int, int], threshold: float) -> bool:
    """Whether the policy benches a confirmed straggler: "exclude" always; "shrink" when it
    cannot be shrunk; "adaptive" also when its best split leaves the round `threshold` times
    the others' time or more; "wait" never."""
    if policy == EXCLUDE:
        return True
    if policy not in (SHRINK, ADAPTIVE):
        return False
    if rid not in splittable(micro):
        return True
    helpers = sum(1 for m, n in micro.items() if m != rid and n == micro[rid])
    return policy == ADAPTIVE and split_cost(micro[rid], ratio, helpers) >= threshold


def bench_entry(slow: tuple, rid: int) -> Optional[tuple[int, int]]:
    """(round that benched it, k) of `rid` in a quorum's `slow`, or None."""
    return next(((since, k) for r, since, k in slow if r == rid), None)


# -- policy "shrink" -----------------------------------------------------------------------------

def _cost(n: int, g: int, ratio: float, helpers: int) -> float:
    return max((n - g) * ratio, n + math.ceil(g / helpers)) if g else n * ratio


def split(n: int, ratio: float, helpers: int) -> int:
    """Policy "shrink": how many of its `n` micro-batches a straggler `ratio` times slower than
    the others gives to `helpers` replicas: the `g` in [0, n-1] that minimizes the round's
    compute, max((n-g)*ratio, n + ceil(g/helpers)) micro-batch times; the smallest such `g`
    (0: giving any away would not make the round shorter)."""
    if n < 2 or helpers < 1 or not ratio > 1.0:
        return 0
    best_g, best = 0, n * ratio
    for g in range(1, n):
        t = _cost(n, g, ratio, helpers)
        if t < best - 1e-9:
            best_g, best = g, t
    return best_g


def split_cost(n: int, ratio: float, helpers: int) -> float:
    """The round's compute with the best split, in units of the others' (1.0: as fast as them)."""
    if n < 1:
        return ratio
    return _cost(n, split(n, ratio, helpers), ratio, max(1, helpers)) / n


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


# -- a member's own view between full rounds ----------------------------------------------------------

def self_check(compute: Optional[tuple[float, int, int]], rid: int, pace_ms: float, suspects: tuple,
               reported: int, rules: Rules, shrunk: bool = False) -> bool:
    """Whether a member asks for a full round now, instead of a steady one, so the decider sees
    its measure `compute` (ms, round of its newest step, steps it covers): slow against the last
    full round's pace and not a suspect (to be flagged), slow and a suspect since before this
    window began (to be confirmed; not under "wait", nor while shrunk: the periodic full rounds
    follow it), or a suspect within the pace since before this window began (to be cleared).
    A member's first measure, while the rounds carry no pace yet, asks for one full round too
    (else the first pace waits for the periodic full round, MAX_STEADY_STEPS steps on). At most
    once per window: its window begins after `reported`, the round of the newest step of the
    measure it last reported."""
    if compute is None or rules.threshold <= 0:
        return False
    ms, at, n = compute
    begins = at - max(1, n) + 1
    if begins <= reported:
        return False
    if pace_ms <= 0:  # no full round has seen a measure yet (steady rounds carry the pace): ask for one
        return True
    slow = not within(ms, pace_ms, rules.threshold)
    suspect = next((s for s in suspects if s[0] == rid), None)
    if suspect is None:
        return slow
    if not slow:
        return begins > suspect[-1]
    return rules.policy != WAIT and not shrunk and begins > suspect[1]
