"""What the supervisor knows of each replica and spare it owns (launch/supervisor.py). The
supervision loop owns these records: only its thread writes them (docs/ARCHITECTURE.md, "Threads")."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterable, Optional

from lightning_ft.launch.zygote import Proc


@dataclass
class ReplicaSpec:
    """A replica this supervisor owns: its id and its number of processes (W)."""

    rid: int
    nproc: int


@dataclass
class ReplicaRecord:
    """Supervision state of one replica."""

    spec: ReplicaSpec
    incarnation: int = 0
    state: str = "restarting"
    """"running" | "restarting" | "done" | "failed" | "stopped" (after shutdown)."""
    procs: list[Proc] = field(default_factory=list)
    """Indexed by local rank; kept after exit so the return codes stay readable."""
    logged_exits: set[int] = field(default_factory=set)
    """Ranks whose clean exit is already in the event log."""
    port: int = 0
    """MASTER_PORT of the current incarnation."""
    restarts: int = 0
    step: Optional[int] = None
    """The last step its leader reported in `members/{rid}` (hang_check only)."""
    compute_ms: float = -1.0
    """Its last reported compute time per step (coord/stragglers.py; the status table)."""
    kill_reason: str = ""
    """Why kill_replica() signalled it; added to the eviction reason."""
    member_seen: bool = False
    """Its leader's member key existed for the current incarnation."""
    started_at: float = 0.0
    """Monotonic time of the current incarnation's start."""
    missing_since: Optional[float] = None
    """When the member key was first seen gone after member_seen."""
    restart_at: float = 0.0
    """Monotonic time of the next start (time-based restart)."""
    restart_step: Optional[int] = None
    """Restart once the job's step reaches this (downtime-based restart)."""
    failed_at: float = 0.0
    first_step: Optional[int] = None
    """The step its leader first reported in this incarnation."""
    progressed: bool = False
    """This incarnation committed something (its reported step grew)."""
    crash_code: Optional[int] = None
    """Exit code of the last failure that came before any commit (crash-loop detection)."""
    crash_streak: int = 0
    diagnosis: Optional[threading.Thread] = None
    """The hang diagnosis running since its member key vanished (launch/diagnosis.py); the
    loop only starts and joins it: the thread reads none of this record."""
    host: str = ""
    """Where its processes run: the command prefix they were started with (`wrap`), "" without one;
    a promoted spare's replica runs where the spare ran."""
    leaving_since: Optional[float] = None
    """When it was first seen on its way out (left/{rid}/{inc} written, or a rank exited 0 while
    others still run): past exit_timeout_s from then it is hung on exit."""

    @property
    def rid(self) -> int:
        return self.spec.rid


@dataclass
class SpareRecord:
    """A warm spare this supervisor started (coord/standby.py)."""

    token: str
    procs: list[Proc]
    port: int
    host: str = ""
    """Where it runs: the command prefix it was started with (`wrap`), "" without one."""
    registered: bool = False
    """Its standby/ key was seen in etcd."""


def ports_in_use(replicas: Iterable[ReplicaRecord], spares: Iterable[SpareRecord]) -> set[int]:
    """MASTER_PORTs handed to running replicas and to live spares (a new one must differ)."""
    return {rep.port for rep in replicas if rep.state == "running"} | {sp.port for sp in spares}
