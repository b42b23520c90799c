"""What the acceptance runs of issue 41 check, read back from a run directory: identical replicas
(final.json digests), the exactly-once ledger, and the loss against a fault-free run's band."""
from __future__ import annotations

import json
import os
import statistics


def step_losses(run_dir: str, replicas: int) -> dict[int, float]:
    """Committed step -> the mean of the loss every replica that trained it logged (steps.jsonl)."""
    by_step: dict[int, list[float]] = {}
    for rid in range(replicas):
        path = os.path.join(run_dir, f"replica_{rid}", "steps.jsonl")
        for line in open(path) if os.path.exists(path) else []:
            row = json.loads(line)
            if row.get("loss") is not None and row.get("role") == "train":
                by_step.setdefault(int(row["step"]), []).append(float(row["loss"]))
    return {s: statistics.fmean(v) for s, v in sorted(by_step.items())}


def tail(losses: dict[int, float], steps: int, window: int) -> list[float]:
    return [v for s, v in losses.items() if s > steps - window]


def summary(name: str, clean, faulted, replicas: int, steps: int, faults: str, window: int = 20) -> dict:
    """One line per acceptance program, as the report quotes it: steps, identical, ledger, loss
    (the faulted run's mean over the last `window` steps) against the fault-free run's band: the
    mean of its per-step losses over the same steps +- 3 standard deviations of them (a step's
    loss is one global batch's: that is the noise a run's loss moves in)."""
    digests = {rid: f["digest"] for rid, f in faulted.finals.items()}
    ref = tail(step_losses(clean.run_dir, replicas), steps, window)
    got = tail(step_losses(faulted.run_dir, replicas), steps, window)
    led = faulted.ledger
    out = {"acceptance": name, "faults": faults, "steps": {r: f["step"] for r, f in faulted.finals.items()},
           "identical": len(digests) == replicas and len({json.dumps(d) for d in digests.values()}) == 1,
           "ledger": {"ok": led.ok, "steps": led.steps, "duplicates": len(led.duplicates), "gaps": len(led.gaps),
                      "batches": {s: len(k) for s, k in led.trained.items()}},
           "loss": round(statistics.fmean(got), 4) if got else None,
           "fault_free_mean": round(statistics.fmean(ref), 4) if ref else None}
    if len(ref) >= 2 and got:
        mean, sd = statistics.fmean(ref), statistics.stdev(ref)
        out["fault_free_band"] = [round(mean - 3 * sd, 4), round(mean + 3 * sd, 4)]
        out["in_band"] = mean - 3 * sd <= out["loss"] <= mean + 3 * sd
    else:
        out["fault_free_band"], out["in_band"] = None, False
    print(json.dumps(out), flush=True)
    return out
