"""What a study's runs say: noise bands, deviations, recovery, and conclusions computed from
the table (pure; docs/study/summary.md is written from these).

Definitions (all on the per-step train loss smoothed by a trailing mean of `k` steps):
- the *band* of a precision is, per step, mean +- 2 sample standard deviations over its
  baseline seeds (`spread`; with 3 seeds a [min, max] band puts the reference seed on
  its edge, so a run equal to it up to float noise would fall out);
- a setting's *deviation* at step n is its smoothed loss minus that of the baseline with
  the same seed (the same initialization and data order), in nats;
- *failure windows* are the steps in which some replica did not train;
- *max deviation* is the deviation of largest magnitude inside the failure windows;
- *steps to recover* counts from the end of the last failure window to the first step
  from which the loss stays inside the band for `k` steps (0: it never left; None: never,
  or a replica was still down at the end: `down_at_end`);
- a final value is *in band* when it lies within mean +- 2 sd of the baseline seeds' final
  values (train: the smoothed loss at the last step; held-out: the last evaluation).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from lightning_ft.study.settings import Setting, failure_windows


def smooth(xs: Sequence[float], k: int) -> list[float]:
    """Trailing mean over the last k values (fewer at the start)."""
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x
        if i >= k:
            total -= xs[i - k]
        out.append(total / min(i + 1, k))
    return out


@dataclass(frozen=True)
class Band:
    lo: list[float]
    hi: list[float]
    final_train: tuple[float, float]
    final_eval: tuple[float, float]

    def inside(self, n: int, value: float) -> bool:
        return self.lo[n] <= value <= self.hi[n]


SPREAD = 2.0
"""Half-width of the band in sample standard deviations of the baseline seeds."""


def spread(xs: Sequence[float], width: float = SPREAD) -> tuple[float, float]:
    """(mean - width * sd, mean + width * sd) of `xs` (sample sd, n - 1)."""
    n = len(xs)
    mean = sum(xs) / n
    sd = (sum((x - mean) ** 2 for x in xs) / (n - 1)) ** 0.5
    return mean - width * sd, mean + width * sd


def band(curves: Sequence[Sequence[float]], finals_eval: Sequence[float], width: float = SPREAD) -> Band:
    """The band of smoothed baseline curves (one per seed) and their final evaluations."""
    if len(curves) < 2:
        raise ValueError(f"a noise band needs at least 2 baseline seeds, got {len(curves)}")
    per_step = [spread([c[n] for c in curves], width) for n in range(len(curves[0]))]
    lo, hi = [p[0] for p in per_step], [p[1] for p in per_step]
    return Band(lo, hi, (lo[-1], hi[-1]), spread(list(finals_eval), width))


@dataclass(frozen=True)
class Row:
    """One line of the summary table."""

    name: str
    source: str
    """"real" or "sim"."""
    final_train: float
    final_eval: float
    max_dev: Optional[float]
    """Signed deviation of largest magnitude in the failure windows (None: no failure)."""
    recover_steps: Optional[int]
    train_in_band: bool
    eval_in_band: bool
    down_steps: float
    """Mean steps a failure event kept its replicas from training."""
    seconds: Optional[float] = None
    """Real runs: wall-clock seconds from the first to the last commit."""
    degraded_step_s: Optional[float] = None
    """Real runs: median seconds per step inside failure windows (healthy: `healthy_step_s`)."""
    healthy_step_s: Optional[float] = None
    down_at_end: bool = False
    """Some replica was still down at the last step (no recovery to count)."""


def analyze(name: str, source: str, run: Mapping, base_smoothed: Sequence[float], b: Band, k: int,
            replicas: int, events: int, con: int) -> Row:
    """The table row of one run against the baseline of its seed and the band."""
    s = smooth(run["train_loss"], k)
    windows = failure_windows([tuple(c) for c in run["contributors"]], replicas)
    inside = [n for lo, hi in windows for n in range(lo, hi)]
    max_dev = None
    if inside:
        devs = [s[n] - base_smoothed[n] for n in inside]
        max_dev = max(devs, key=abs)
    down_at_end = bool(windows) and windows[-1][1] >= len(s)
    recover = recovery_steps(s, b, windows[-1][1], k) if windows and not down_at_end else None
    final_eval = run["eval"][max(run["eval"])]
    missed = sum(replicas - len(c) for c in run["contributors"])
    secs = healthy = degraded = None
    if run.get("wall"):
        wall = run["wall"]
        secs = wall[-1] - wall[0]
        gaps = [(wall[n] - wall[n - 1], n in set(inside)) for n in range(1, len(wall))]
        healthy = _median([g for g, bad in gaps if not bad])
        degraded = _median([g for g, bad in gaps if bad]) if inside else None
    return Row(name, source, s[-1], final_eval, max_dev, recover,
               b.final_train[0] <= s[-1] <= b.final_train[1], b.final_eval[0] <= final_eval <= b.final_eval[1],
               missed / (events * con) if events and con else 0.0,
               secs, degraded, healthy, down_at_end)


def recovery_steps(smoothed: Sequence[float], b: Band, end: int, hold: int) -> Optional[int]:
    """Steps from `end` until the curve enters the band and stays there `hold` steps (or to
    the end of the run); None if it never does."""
    n = len(smoothed)
    for m in range(end, n):
        if all(b.inside(i, smoothed[i]) for i in range(m, min(n, m + hold))):
            return m - end
    return None


def _median(xs: list[float]) -> Optional[float]:
    if not xs:
        return None
    ys = sorted(xs)
    m = len(ys) // 2
    return ys[m] if len(ys) % 2 else (ys[m - 1] + ys[m]) / 2


def conclusions(rows: Sequence[Row], settings: Mapping[str, Setting]) -> list[str]:
    """Sentences computed from the table: LR interventions and the batch policy compared in
    each group of otherwise equal settings, concurrency, failure length, precision, final
    values against the band, and the cost in time of each policy (real runs)."""
    out: list[str] = []
    by = {(r.name, r.source): r for r in rows}

    def dev(r: Optional[Row]) -> str:
        return "n/a" if r is None or r.max_dev is None else f"{abs(r.max_dev):.3f}"

    groups: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        s = settings[r.name]
        if s.baseline:
            continue
        key = (r.source, s.fp, s.freq, s.length, s.con)
        label = "batch constant" if s.batch_policy == "constant" else s.lr
        groups.setdefault(key, {})[label] = r
    for (source, fp, freq, length, con), g in sorted(groups.items()):
        if len(g) < 2:
            continue
        where = f"d{freq}x_{fp}_for{length}_{con}reps ({source})"
        ranked = sorted(g.items(), key=lambda kv: abs(kv[1].max_dev or 0.0))
        parts = ", ".join(f"{label} {dev(r)}" for label, r in ranked)
        out.append(f"{where}: max deviation in failure windows, smallest first: {parts} nats; "
                   f"closest to the baseline: {ranked[0][0]}.")
        if "none" in g and "sqrt" in g:
            out.append(f"{where}: sqrt vs none: max deviation {dev(g['sqrt'])} vs {dev(g['none'])} nats.")
    for label, field, a, b in _contrasts([settings[r.name] for r in rows]):
        pairs = []
        for r in rows:
            s = settings[r.name]
            if s.baseline or getattr(s, field) != a:
                continue
            other = by.get((_swap(s, field, b).name, r.source))
            if other is not None:
                pairs.append(f"{r.name} {dev(r)} vs {other.name} {dev(other)}")
        if pairs:
            out.append(f"{label}: max deviation " + "; ".join(pairs) + " nats.")
    failed = [r for r in rows if not settings[r.name].baseline]
    if failed:
        tr = sum(r.train_in_band for r in failed)
        ev = sum(r.eval_in_band for r in failed)
        outside = [r.name + f" ({r.source})" for r in failed if not (r.train_in_band and r.eval_in_band)]
        out.append(f"Final values inside the baseline noise band: train loss {tr} of {len(failed)}, held-out "
                   f"{ev} of {len(failed)}" + (f"; outside: {', '.join(outside)}." if outside else "."))
    for r in rows:
        if r.source == "real" and r.degraded_step_s and r.healthy_step_s:
            out.append(f"{r.name} (real): {r.degraded_step_s:.3f} s per step during failures vs "
                       f"{r.healthy_step_s:.3f} s healthy ({r.degraded_step_s / r.healthy_step_s:.2f}x), "
                       f"{r.seconds:.0f} s in all.")
    return out


def _contrasts(present: Sequence[Setting]) -> list[tuple[str, str, object, object]]:
    """(label, field, a, b) for each of concurrency, failure length and precision that takes
    two or more values among the failure settings: the smallest against the largest."""
    failed = [s for s in present if not s.baseline]
    out: list[tuple[str, str, object, object]] = []
    for field, fmt in (("con", "{} vs {} concurrent failures"), ("length", "for{} vs for{}"),
                       ("fp", "{} vs {}")):
        values = sorted({getattr(s, field) for s in failed})
        if len(values) >= 2:
            out.append((fmt.format(values[0], values[-1]), field, values[0], values[-1]))
    return out


def _swap(s: Setting, field: str, value: object) -> Setting:
    from dataclasses import replace

    changes: dict[str, Any] = {field: value}
    return replace(s, **changes)
