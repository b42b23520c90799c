"""What a `Supervisor` is built from (launch/supervisor.py): where the job runs (`Placement`) and
how it is supervised (`SupervisorSettings`, from the job config's `supervisor`, `failure` and
`min_replicas`, and `lightning-ft run`'s options).

    sup = Supervisor(cmd, Placement(job, replicas=3, nproc_per_replica=2, etcd=..., secret=...,
                                    run_dir=...), SupervisorSettings(standby=1))
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional, Sequence

RESUME_LIVE_WAIT_S = 10.0
"""How long `--resume` waits for a dead job's leases to lapse (a launcher's hold: 5 s)."""


@dataclass(frozen=True)
class Placement:
    """The job, and the replicas of it this supervisor runs."""

    job: str
    replicas: int
    """R: the job's replicas (this supervisor may own a subset, `replica_ids`)."""
    nproc_per_replica: int
    etcd: str
    secret: str
    run_dir: str
    replica_ids: Optional[Sequence[int]] = None
    """The replicas this supervisor owns (default: all): one disjoint subset per node when
    several supervisors share one etcd."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Added to every process's environment (`LFT_CONFIG` names the job config)."""
    prefix: str = "/lft"
    wrap: str = ""
    """A command prefix per replica, `{rid}` replaced (e.g. `ip netns exec ns{rid}`: fault
    harnesses put each replica in its own network namespace; `LFT_REPLICA_WRAP`)."""


@dataclass(frozen=True)
class SupervisorSettings:
    """How failures are handled (docs/ARCHITECTURE.md, "Launch and supervision")."""

    restart: str = "replica"
    """"replica" (FT-HSDP: only the failed replica restarts and catches up) or "world" (the
    baseline, like torchrun elastic: any failure stops every replica, and all restart from the
    newest valid checkpoint under `checkpoint_root`, or from scratch)."""
    restart_delay_s: float = 0.2
    max_restarts: int = 10
    crash_loop: int = 3
    """A replica that exits with the same non-zero code this many times in a row without
    committing a step is not restarted (its log tail is printed); if fewer than `min_replicas`
    are left, the job stops."""
    min_replicas: int = 1
    hang_check: bool = True
    hang_grace_s: float = 2.0
    """A vanished member key counts as a hang only if it stays gone this long while the leader
    still runs (a leader that revokes its lease on a clean exit is not hung)."""
    start_timeout_s: float = 600.0
    """A leader not registered this long after its start is hung in initialization (0: never)."""
    exit_timeout_s: float = 120.0
    """A replica on its way out (it left the job, or some ranks exited 0) that still runs this
    long after is hung on exit: killed and restarted (0: never)."""
    resume_wait_s: float = RESUME_LIVE_WAIT_S
    standby: int = 0
    """Warm spares to keep (launch/spares.py)."""
    zygote: bool = False
    """Replicas (first starts, restarts, spares) fork from a process that imported torch (and
    Lightning) once (launch/zygote.py)
    instead of starting Python afresh; only for `[python, script, ...]` (or `-m module`)
    commands without a `wrap`. Anything it cannot do starts as before."""
    checkpoint_root: str = ""
    seed_from: str = ""
    """A checkpoint directory (`--resume`): a new run started by this launcher gets its cursors."""
    downtime_steps: Mapping[int, int] = field(default_factory=dict)
    """Replica -> steps the job trains before it is restarted (`set_downtime`)."""

    def __post_init__(self) -> None:
        if self.restart not in ("replica", "world"):
            raise ValueError(f"restart={self.restart!r} must be 'replica' or 'world'")
        if self.standby < 0:
            raise ValueError(f"standby={self.standby} must be >= 0")
        if self.standby and self.restart != "replica":
            raise ValueError("standby spares replace failed replicas; restart='world' restarts every replica")


def split(**kw: Any) -> tuple[Placement, SupervisorSettings]:
    """Keyword arguments of either (by field name) as the two values; an unknown name is an error."""
    p = {f.name for f in fields(Placement)}
    s = {f.name for f in fields(SupervisorSettings)}
    bad = sorted(set(kw) - p - s)
    if bad:
        raise TypeError(f"unknown supervisor argument(s) {bad}")
    return (Placement(**{k: v for k, v in kw.items() if k in p}),
            SupervisorSettings(**{k: v for k, v in kw.items() if k in s}))
