"""Quorum rule 14 on the round's records (coord/quorum.py, `compute_quorum`): the members' and
the benched stragglers' reports in; the verdict of coord/stragglers.py, who trains, the split
announced and what the round's reason says, out. Pure, like the rules it applies."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from . import stragglers
from .round_records import Decision, JobSpec, Quorum, Report


def probe_of(rep: Report) -> stragglers.Probe:
    """What a benched straggler's report says of its pace."""
    return stragglers.Probe(rep.compute_ms, rep.probe_s, rep.bench, rep.bench_s)


def standing(previous: Optional[Quorum]) -> stragglers.Standing:
    """The stragglers' standing the previous quorum recorded."""
    if previous is None:
        return stragglers.Standing()
    return stragglers.Standing(previous.slow, previous.parole, previous.suspects, previous.pace_ms)


def set_aside(valid: dict[int, Report], previous: Optional[Quorum]) -> dict[int, Report]:
    """Take the benched stragglers' reports out of `valid` (they count for every round, and must
    not make the members look changed to rule 5)."""
    benched = {rid for rid, _, _ in standing(previous).slow}
    return {r: valid.pop(r) for r in sorted(valid) if r in benched}


@dataclass
class Rule14:
    """One round's rule 14."""

    verdict: stragglers.Verdict
    shrink_next: tuple = ()
    """The split announced for the next rounds (policies "shrink" and "adaptive")."""
    readmitted: dict[int, tuple[int, float]] = field(default_factory=dict)
    """Readmitted -> (exclusions, its probe over the members' pace; -1: not measured)."""

    def notes(self, threshold: float) -> list[str]:
        """What the round's reason says of the stragglers."""
        v, out = self.verdict, []
        if v.stragglers:
            benched = f"; r{v.excluded[0]} benched (exclusion {v.excluded[2]}): it waits outside until its pace " \
                      f"is within {threshold}x" if v.excluded is not None else ""
            out.append("straggler " + ", ".join(f"r{r} ({x:.2f}x the others' compute)"
                                                for r, x in sorted(v.stragglers.items())) + benched)
        if self.readmitted:
            out.append("readmitted " + ", ".join(f"r{r} ({'unmeasured' if x < 0 else f'{x:.2f}x the pace'})"
                                                 for r, (_, x) in sorted(self.readmitted.items())))
        if v.standing.slow:
            out.append("benched " + " ".join(f"r{r}" for r, _, _ in v.standing.slow))
        return out


def apply(round: int, valid: dict[int, Report], benched: Mapping[int, Report], reports: Mapping[int, Report],
          evicted, refused: Mapping[int, str], previous: Optional[Quorum], job: JobSpec) -> Rule14:
    """Rule 14: decide, then make `valid` the round's members (readmitted stragglers in, the one
    benched now out). `benched`: what `set_aside` took out; `reports`, `evicted`, `refused`: the
    round's (a benched straggler with no report left is gone)."""
    before = standing(previous)
    rules = stragglers.Rules(job.straggler_threshold, job.straggler_policy, job.min_replicas, job.replicas,
                             job.straggler_window)
    present = {r: rep for r, _, _ in before.slow if (rep := reports.get(r)) is not None
               and (r, rep.incarnation) not in evicted and r not in refused}
    micro = {r: rep.micro for r, rep in valid.items()}
    verdict = stragglers.decide(round, {r: (rep.compute_ms, rep.compute_round, rep.compute_n)
                                        for r, rep in valid.items()}, tuple(sorted(valid)), rules, before,
                                {r: probe_of(rep) for r, rep in present.items()}, set(benched), micro)
    for r in verdict.readmitted:
        valid[r] = benched[r]
    if verdict.excluded is not None:
        valid.pop(verdict.excluded[0])
        micro.pop(verdict.excluded[0])
    shrink_next: tuple = ()
    if job.straggler_policy in (stragglers.SHRINK, stragglers.ADAPTIVE):
        shrink_next = stragglers.shrink({r: x for r, x in verdict.stragglers.items() if r in micro},
                                        verdict.standing.suspects, previous.shrink_next if previous else (), micro,
                                        job.replicas)
    pace = verdict.standing.pace_ms
    back = {}
    for r in verdict.readmitted:
        ms = present[r].compute_ms
        k = next((k for rid, _, k in verdict.standing.parole if rid == r), 0)
        back[r] = (k, float(f"{ms / pace:.3f}") if ms > 0 and pace > 0 else -1.0)
    return Rule14(verdict, shrink_next, back)


def events(decision: Decision, q: Quorum, spec: JobSpec, said: set[int]) -> list[tuple[str, dict[str, Any]]]:
    """The decider's rule-14 events of a round: a `straggler` event for each new straggler (`said`:
    the last round's, already told; one benched now is told again) with its ratio, and `benched`
    or its split; a `readmitted` event for each straggler back."""
    out: list[tuple[str, dict[str, Any]]] = []
    for rid, ratio in sorted(decision.stragglers.items()):
        excluded = decision.excluded_straggler if decision.excluded_straggler and \
            decision.excluded_straggler[0] == rid else None
        split = next(((g, n) for r, g, n in q.shrink_next if r == rid), None)  # policy "shrink"
        if excluded is None and rid in said:
            continue  # still slow, already said (policy "wait"; "shrink": its split follows in the reasons)
        out.append(("straggler", dict(replica=rid, ratio=float(f"{ratio:.3f}"), window=spec.straggler_window,
                                      threshold=spec.straggler_threshold, policy=spec.straggler_policy,
                                      step=q.max_step, round=q.round,
                                      **({"benched": True, "exclusions": excluded[2]} if excluded else {}),
                                      **({"gives": split[0], "of": split[1]} if split else {}))))
    for rid, (k, ratio) in sorted(decision.readmitted.items()):
        out.append(("readmitted", dict(replica=rid, round=q.round, step=q.max_step, exclusions=k, probe_ratio=ratio)))
    return out
