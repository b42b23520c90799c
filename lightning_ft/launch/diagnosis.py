"""Where a hung replica hangs, read while it still hangs (docs/ARCHITECTURE.md, "Hang
diagnosis"; the pure part is coord/hang.py): a thread the supervision loop starts the moment a
replica's member key vanished (launch/policy.py `Missing`), one per replica at a time.

Threads: the thread gets an immutable snapshot (the replica's id, incarnation and live ranks'
pids, when the key vanished) and touches no supervisor state. It reads etcd through the run's
view (read-only queries) and writes one `hang` event to the event log (its own lock). The loop
joins it, bounded, before it kills a replica the policy found hung."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from lightning_ft.coord.hang import culprit_rank, diagnose
from lightning_ft.launch.event_log import EventLog
from lightning_ft.launch.run_view import RunView
from lightning_ft.launch.stacks import STOPPED, dump_stack, process_state

log = logging.getLogger(__name__)

STALL_MAX_AGE_S = 15.0
"""A hang diagnosis uses the other replicas' stall reports (stall/{rid}) younger than this."""


@dataclass(frozen=True)
class Suspect:
    """What the diagnosis is told of the replica: a snapshot taken by the loop."""

    rid: int
    incarnation: int
    live: dict[int, int]
    """Rank -> pid of its ranks still running when its key vanished."""
    missing_since: float
    """Monotonic time its member key was first seen gone."""
    grace_s: float
    """supervisor `hang_grace_s`: a key gone this long while the leader runs is a hang."""


def start(view: RunView, events: EventLog, s: Suspect) -> threading.Thread:
    """Start the diagnosis of `s` on its own thread (daemon: it never holds the launcher's exit)."""
    t = threading.Thread(target=_diagnose, name=f"lft-hang-r{s.rid}", args=(view, events, s), daemon=True)
    t.start()
    return t


def _diagnose(view: RunView, events: EventLog, s: Suspect) -> None:
    """A `hang` event that says where replica `s.rid` hangs (coord/hang.py): its ranks' process
    states and Python stacks, read from outside while it still hangs (launch/stacks.py), and
    the other replicas' stall reports (which FTAR link waits on it). A stopped rank is a hang at
    once; otherwise the event waits for the grace, and is dropped if the replica exited
    meanwhile (a leader that revoked its lease on its way out)."""
    try:
        if view.left_cleanly(s.rid, s.incarnation) or not s.live:
            return
        states = {r: process_state(pid) for r, pid in s.live.items()}
        culprit = culprit_rank(states)
        stacks = {r: dump_stack(pid) for r, pid in s.live.items() if r in (0, culprit)}
        d = diagnose(s.rid, states, view.stall_reports(), stacks, pids=s.live, max_age_s=STALL_MAX_AGE_S,
                     why=f"members/{s.rid} of incarnation {s.incarnation} vanished (lease expired) while "
                         f"its processes run")
        if d.state not in (*STOPPED, "D"):
            time.sleep(max(0.0, s.missing_since + s.grace_s - time.monotonic()))
            if (view.left_cleanly(s.rid, s.incarnation) or process_state(s.live.get(0, -1)) in ("Z", "X", "?")
                    or view.member_back(s.rid, s.incarnation)):
                return  # the leader exited, or its key is back: no hang (the supervisor's own rule)
        log.warning("hang: %s", d.reason)
        events.replica(s.rid, s.incarnation, "hang", diagnosis=True, **d.event())
    except Exception as e:  # a diagnosis must never stop the supervision
        log.warning("replica %d: hang diagnosis failed: %s: %s", s.rid, type(e).__name__, e)
