"""The soak's pure parts (lightning_ft/bench/soak.py): the fault plan, and what a run directory
says afterwards (stalls, a halt, which guards fired). No processes, no clock."""
from __future__ import annotations

import json
import os
import random
from itertools import pairwise
from typing import Iterator


def plan_kinds(kinds: list[str], n: int, rng: random.Random) -> list[str]:
    """The kinds of n faults: every kind at least once, whole-job kills about 1 in 20 (each
    costs a full restart), the rest drawn uniformly from the others."""
    cheap = [k for k in kinds if k != "job"] or ["kill"]
    out = [k for k in kinds]  # each once
    jobs = max(0, round(n / 20) - 1) if "job" in kinds else 0
    out += ["job"] * jobs
    out += [rng.choice(cheap) for _ in range(max(0, n - len(out)))]
    first, rest = out[:1], out[1:]
    rng.shuffle(rest)
    return (first + rest)[:n] if n >= len(kinds) else rng.sample(out, n)


def hangs(run_dir: str, replicas: int, hang_s: float) -> int:
    """Stretches of at least hang_s with no committed step on any replica."""
    ts: list[float] = []
    for rid in range(replicas):
        path = os.path.join(run_dir, f"replica_{rid}", "steps.jsonl")
        if os.path.exists(path):
            for line in open(path):
                try:
                    ts.append(json.loads(line)["t"])
                except (ValueError, KeyError):
                    pass
    ts.sort()
    return sum(1 for x, y in pairwise(ts) if y - x >= hang_s)


def _events(run_dir: str) -> Iterator[dict]:
    """The events of events.jsonl (a torn last line skipped)."""
    path = os.path.join(run_dir, "events.jsonl")
    if os.path.exists(path):
        for line in open(path):
            try:
                yield json.loads(line)
            except ValueError:
                continue


def halt_reason(run_dir: str) -> str:
    """Why the job halted (the coordinator's `halt` or the launcher's `job_halted` event), or ""."""
    return next((str(ev.get("reason") or "halted") for ev in _events(run_dir)
                 if ev.get("event") in ("halt", "job_halted")), "")


HEALS = ("disowned", "stale", "diverged")


def heals(run_dir: str) -> dict[str, int]:
    """How often each guard against a second state at one step fired (events.jsonl): a replica
    whose ledger records were refused (disowned), a state made by a redone round (stale), a
    digest that disagreed with the majority (diverged)."""
    got = dict.fromkeys(HEALS, 0)
    for ev in _events(run_dir):
        if ev.get("event") in got:
            got[ev["event"]] += 1
    return got
