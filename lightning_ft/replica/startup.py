"""A restarted replica's start-up in parts: the `restart_breakdown` event (issue 25 §2).

A process records wall-clock marks (`mark`) as it passes the milestones in `PARTS`; the
first mark of a name counts. `breakdown` (pure) turns them into the seconds each part took,
from the launcher's spawn time (`$LFT_SPAWN_T`, set by `lightning-ft run` and bench.localjob
right before they start the process) or, without it, the kernel's start time of this process.

    python      spawn -> interpreter up (a program that marks it, as examples/plain_loop.py does;
                else folded into the next part)
    torch       `import torch` done (likewise; under Lightning folded into `lightning`)
    lightning   `lightning_ft.strategy.ft_hsdp` imported (Lightning with it; Lightning runs only)
    script      the user's script reached `fit` (the strategy's setup_environment)
    setup       the strategy set the model and optimizer up (the replica manager exists)
    registered  FTAR, the state server and the leader's registration in etcd done (`start()`)
    caught_up   the first catch-up's bytes verified and applied
    first_step  the first step committed (trained, or caught up) by this incarnation

A warm spare also marks `promoted` (not a part): its breakdown starts there. A process the
zygote forked (launch/zygote.py) imported Python, torch and Lightning before it existed: its
marks start empty at the fork (`forked`), so `script` holds the time from the spawn request to
`fit`, and the event says `"zygote": true`.

A missing mark folds its time into the next one present; parts are never negative (a mark
earlier than the one before it counts as 0 s), so the parts sum to `total_s`.
"""
from __future__ import annotations

import os
import time
from typing import Mapping, Optional

PARTS = ("python", "torch", "lightning", "script", "setup", "registered", "caught_up", "first_step")
SPAWN_ENV = "LFT_SPAWN_T"
"""Unix time the launcher started this process at (set in the child's environment)."""

_marks: dict[str, float] = {}
_forked = False


def forked() -> None:
    """This process was forked from the zygote: forget the marks the zygote made."""
    global _forked
    _marks.clear()
    _forked = True


PRELOADED = ("python", "torch", "lightning")
"""The parts a forked process does not have: the zygote imported them before it existed."""


def mark(name: str, t: Optional[float] = None) -> None:
    """Record that this process reached `name` (one of PARTS) now, or at `t`; the first call counts
    (a forked process ignores the parts the zygote did for it)."""
    if _forked and name in PRELOADED:
        return
    _marks.setdefault(name, time.time() if t is None else t)


def marks() -> dict[str, float]:
    return dict(_marks)


def spawn_time(environ: Mapping[str, str] = os.environ) -> Optional[float]:
    """When this process was started: the launcher's `$LFT_SPAWN_T`, else the kernel's start time
    (/proc/self/stat, in clock ticks after boot), else None."""
    try:
        return float(environ[SPAWN_ENV])
    except (KeyError, ValueError):
        pass
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def breakdown(spawn_t: Optional[float], marks: Mapping[str, float], parts: tuple[str, ...] = PARTS) -> dict:
    """{"parts": {name: seconds}, "total_s": seconds from spawn to the last mark} over the marks
    present, in `parts` order; each part runs from the previous present mark (or the spawn) and
    is clipped at 0, so they are monotone and sum to total_s. No spawn time: from the first mark."""
    present = [(p, marks[p]) for p in parts if p in marks]
    if not present:
        return {"parts": {}, "total_s": 0.0}
    start = spawn_t if spawn_t is not None else present[0][1]
    prev, out = start, {}
    for name, t in present:
        out[name] = round(max(0.0, t - prev), 4)
        prev = max(prev, t)
    return {"parts": out, "total_s": round(prev - start, 4)}


def restart_breakdown(environ: Mapping[str, str] = os.environ) -> dict:
    """This process's breakdown so far (the event's fields). A promoted warm spare
    (coord/standby.py) started up before it was needed: its parts run from the promotion."""
    if "promoted" in _marks:
        t0 = _marks["promoted"]
        after = {k: v for k, v in _marks.items() if k in PARTS[PARTS.index("registered"):]}
        return {"spawn_t": t0, "standby": True, **breakdown(t0, after)}
    spawn = spawn_time(environ)
    return {"spawn_t": spawn, **({"zygote": True} if _forked else {}), **breakdown(spawn, _marks)}
