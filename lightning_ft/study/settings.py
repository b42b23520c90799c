"""Study settings, their names, and the failure schedule each one implies (pure; no I/O).

A setting is named like the paper's (FT-HSDP §7.2): `{freq}_{fp}_{len}_{con}reps_lr_{lr}`,
e.g. `d2x_bf16_for40_2reps_lr_sqrt`:

- `d{n}x`: n failure events per window of `window_steps` steps, from `start_step` on;
- fp: `fp32` or `bf16` (the example's `--precision 32-true` / `bf16-emulated`);
- `for{len}`: each failed replica stays down `len` steps (`failure.events[].downtime_steps`);
- `{con}reps`: replicas killed at once in each event;
- `lr_{none|linear|sqrt}`: the LR intervention f(contributors / R).

Beyond the paper, `batch_policy: constant` (survivors also train the absent slots' batches)
is written as the suffix `_batch_constant`, e.g. `d1x_fp32_for40_2reps_lr_none_batch_constant`.
The baseline (no failures) of a precision is `baseline_{fp}`.

Each event kills the same `con` replicas, the highest ids (R-con .. R-1), so replica 0 (the
checkpoint writer and first decider) stays up and at most `con` replicas are ever down,
even when a restart takes longer than the gap to the next event (the next injection then
fires as soon as the replica is back: the launcher's firing rule). `batch_schedule` gives
the per-step contributors and slot batches the simulator trains for the nominal schedule.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from lightning_ft.replica.batch_policy import round_batches

PRECISIONS = {"fp32": "32-true", "bf16": "bf16-emulated"}
"""Setting precision -> the example's `--precision`."""
_NAME = re.compile(r"^d(?P<freq>\d+)x_(?P<fp>fp32|bf16)_for(?P<len>\d+)_(?P<con>\d+)reps_lr_(?P<lr>none|linear|sqrt)"
                   r"(?P<constant>_batch_constant)?$")
_BASELINE = re.compile(r"^baseline_(?P<fp>fp32|bf16)$")


@dataclass(frozen=True)
class Setting:
    fp: str = "fp32"
    freq: int = 0
    """Failure events per window; 0 = the baseline."""
    length: int = 0
    """Steps each failed replica stays down."""
    con: int = 0
    """Replicas killed at once."""
    lr: str = "none"
    batch_policy: str = "shrink"

    @property
    def baseline(self) -> bool:
        return self.freq == 0

    @property
    def name(self) -> str:
        if self.baseline:
            return f"baseline_{self.fp}"
        tail = "_batch_constant" if self.batch_policy == "constant" else ""
        return f"d{self.freq}x_{self.fp}_for{self.length}_{self.con}reps_lr_{self.lr}{tail}"

    @property
    def precision(self) -> str:
        return PRECISIONS[self.fp]


def parse(name: str) -> Setting:
    """The setting a name describes; ValueError says what the form is."""
    m = _BASELINE.match(name)
    if m:
        return Setting(fp=m["fp"])
    m = _NAME.match(name)
    if not m:
        raise ValueError(f"setting {name!r} is not of the form {{freq}}_{{fp}}_{{len}}_{{con}}reps_lr_{{lr}}"
                         f"[_batch_constant] (e.g. d2x_bf16_for40_2reps_lr_sqrt) nor baseline_{{fp32|bf16}}")
    s = Setting(fp=m["fp"], freq=int(m["freq"]), length=int(m["len"]), con=int(m["con"]), lr=m["lr"],
                batch_policy="constant" if m["constant"] else "shrink")
    if s.freq < 1 or s.length < 1 or s.con < 1:
        raise ValueError(f"setting {name!r}: freq, len and con must be >= 1")
    return s


@dataclass(frozen=True)
class Schedule:
    """Where failures happen in a run of `steps` steps with `replicas` replicas."""

    replicas: int
    steps: int
    start_step: int
    window_steps: int

    def event_steps(self, s: Setting) -> list[int]:
        """Steps at which the events of `s` start: `freq` per window, evenly spaced, from
        start_step on, while the replicas are back before the run ends."""
        if s.baseline:
            return []
        gap = self.window_steps / s.freq
        out: list[int] = []
        j = 0
        while True:
            step = self.start_step + round(j * gap)
            if step + s.length >= self.steps:
                return out
            out.append(step)
            j += 1

    def victims(self, s: Setting) -> tuple[int, ...]:
        if s.con >= self.replicas:
            raise ValueError(f"{s.name}: killing {s.con} of {self.replicas} replicas at once leaves nobody to train")
        return tuple(range(self.replicas - s.con, self.replicas))

    def failure_events(self, s: Setting) -> list[dict]:
        """`failure.events` of the real run (a SIGKILL of each victim, kept down `len` steps)."""
        return [{"replica": r, "step": step, "kind": "kill", "downtime_steps": s.length}
                for step in self.event_steps(s) for r in self.victims(s)]

    def contributors(self, s: Setting) -> list[tuple[int, ...]]:
        """Per step, the replicas that train under the nominal schedule (victims absent for
        exactly `len` steps from each event; events closer than `len` merge)."""
        down: list[set[int]] = [set() for _ in range(self.steps)]
        for step in self.event_steps(s):
            for n in range(step, min(self.steps, step + s.length)):
                down[n].update(self.victims(s))
        return [tuple(r for r in range(self.replicas) if r not in d) for d in down]


def batch_schedule(contributors: list[tuple[int, ...]], replicas: int, policy: str) -> list[dict[int, int]]:
    """Per step, the slot batches {slot: k} trained, with cursors advancing as commits do."""
    cursors = [0] * replicas
    out = []
    for who in contributors:
        rb = round_batches(policy, who, {c: cursors[c] for c in who}, replicas, tuple(cursors))
        for slot, k in rb.batches.items():
            cursors[slot] = k + 1
        out.append(dict(rb.batches))
    return out


def failure_windows(contributors: list[tuple[int, ...]], replicas: int) -> list[tuple[int, int]]:
    """[start, end) step ranges in which some replica did not train."""
    out: list[tuple[int, int]] = []
    start: Optional[int] = None
    for n, who in enumerate(contributors):
        if len(who) < replicas and start is None:
            start = n
        elif len(who) == replicas and start is not None:
            out.append((start, n))
            start = None
    if start is not None:
        out.append((start, len(contributors)))
    return out
