"""Hang diagnosis, the pure part (docs/ARCHITECTURE.md, "Hang diagnosis"; issue 27).

A replica hangs: its lease lapsed while its processes still run (a SIGSTOP, a deadlock). Who is
missing is known (the supervisor's lapsed member key); `diagnose` says *where*, from what was
gathered at that moment, with a reason string as `compute_quorum` gives one:

- `states`: the hung replica's ranks' process states (/proc/PID/stat: R, S, D, T = stopped, ...);
  a stopped rank is the culprit, else the leader (rank 0), whose lease lapsed;
- `stalls`: the other replicas' *stall reports* (`Coordinator.report_stall`): each leader whose
  exchange waited longer than `hang.report_after_s` published its FTAR ring neighbours and link
  counters (ftar/linkstate.py). A member waiting to receive from the hung replica names the link
  `culprit -> it` (direction rx); one blocked sending to it names `it -> culprit` (tx);
- `stacks`: the ranks' Python stacks, read from outside (launch/stacks.py): a stopped process
  cannot dump its own.

No I/O, no clock: ages come in with the reports. Tests: tests/coord/test_hang.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

STATE_NAMES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped (SIGSTOP)",
               "t": "stopped by a tracer", "Z": "a zombie", "X": "dead"}


@dataclass(frozen=True)
class Link:
    """One FTAR link with bytes outstanding, as its live end saw it."""

    src: int
    """Replica that sends on the link."""
    dst: int
    """Replica that receives on it."""
    direction: str
    """"rx": `dst` waits to receive from `src`; "tx": `src` is blocked sending to `dst`."""
    outstanding: int
    """Bytes of the blocked call (-1: the tail of the all-reduce, waiting for sends to drain)."""
    seen_by: int
    """The replica whose counters these are."""
    waited_s: float
    """How long that replica's exchange had been waiting."""

    def describe(self) -> str:
        what = "the send tail" if self.outstanding < 0 else f"{self.outstanding} bytes"
        if self.direction == "rx":
            return f"r{self.dst} waits to receive {what} from r{self.src} (link r{self.src} -> r{self.dst}, rx)"
        return f"r{self.src} is blocked sending {what} to r{self.dst} (link r{self.src} -> r{self.dst}, tx)"


@dataclass(frozen=True)
class Diagnosis:
    replica: int
    rank: int
    state: str
    """Process state letter of that rank ("?" if unknown)."""
    links: tuple[Link, ...]
    """Links with bytes outstanding; those touching the culprit first."""
    stack: str
    """The culprit rank's Python stack, or why there is none."""
    reason: str
    stacks: dict[int, str] = field(default_factory=dict)
    """Every rank's stack (or why none), by rank."""

    def event(self) -> dict[str, Any]:
        """The `hang` event's fields."""
        return {"replica": self.replica, "rank": self.rank, "state": self.state,
                "links": [{"from": k.src, "to": k.dst, "direction": k.direction, "outstanding": k.outstanding,
                           "seen_by": k.seen_by, "waited_s": k.waited_s} for k in self.links],
                "stack": self.stack, "stacks": {str(r): s for r, s in self.stacks.items()}, "reason": self.reason}


def culprit_rank(states: dict[int, str]) -> int:
    """The rank to blame: a stopped one (lowest), else one in uninterruptible I/O, else rank 0."""
    for want in ("T", "t", "D"):
        hit = sorted(r for r, s in states.items() if s == want)
        if hit:
            return hit[0]
    return 0


def stalled_links(culprit: int, stalls: dict[int, dict[str, Any]], max_age_s: float) -> list[Link]:
    """Links with bytes outstanding in the other replicas' fresh stall reports, the culprit's first."""
    out: list[Link] = []
    for rid, st in sorted(stalls.items()):
        if rid == culprit or float(st.get("age_s", 0.0)) > max_age_s:
            continue
        c = st.get("links") or {}
        waited = round(float(st.get("waited_s", 0.0)), 3)
        if c.get("rx_outstanding"):
            out.append(Link(int(st["left"]), rid, "rx", int(c["rx_outstanding"]), rid, waited))
        if c.get("tx_outstanding"):
            out.append(Link(rid, int(st["right"]), "tx", int(c["tx_outstanding"]), rid, waited))
    out.sort(key=lambda k: (culprit not in (k.src, k.dst), k.seen_by, k.direction))
    return out


def diagnose(culprit: int, states: dict[int, str], stalls: dict[int, dict[str, Any]],
             stacks: dict[int, str], *, why: str = "its lease lapsed", max_age_s: float = 30.0,
             pids: Optional[dict[int, int]] = None) -> Diagnosis:
    """Where replica `culprit` hangs: its rank to blame, the FTAR links waiting on it, the stack."""
    rank = culprit_rank(states)
    state = states.get(rank, "?")
    links = stalled_links(culprit, stalls, max_age_s)
    stack = stacks.get(rank, "no stack was read")
    pid = (pids or {}).get(rank)
    who = f"replica {culprit} rank {rank}" + (f" (pid {pid})" if pid else "")
    parts = [f"{who} is {STATE_NAMES.get(state, 'in state ' + state)}; {why}"]
    mine = [k for k in links if culprit in (k.src, k.dst)]
    if mine:
        parts.append("; ".join(k.describe() for k in mine))
    elif links:
        parts.append("no link names it; " + "; ".join(k.describe() for k in links))
    else:
        parts.append("no member reported an FTAR link waiting (none was in an exchange, or none stalled "
                     "longer than hang.report_after_s)")
    frame = top_frame(stack)
    if frame:
        parts.append(f"its stack ends in {frame}")
    return Diagnosis(culprit, rank, state, tuple(links), stack, "; ".join(parts), dict(stacks))


WAIT_FILES = ("threading.py", "queue.py", "selectors.py", "socket.py", "subprocess.py")
"""Standard-library waits: `top_frame` names the first frame of ours below them."""


def top_frame(stack: str) -> str:
    """Where the first thread (the main thread) of a py-spy dump is: its innermost frame outside
    the standard library's waits ("function (file:line)"), or ""."""
    lines = [ln.strip() for ln in stack.splitlines()]
    for i, ln in enumerate(lines):
        if ln.startswith("Thread "):
            frames = []
            for nxt in lines[i + 1:]:
                if not nxt or nxt.startswith("Thread "):
                    break
                frames.append(nxt)
            ours = [f for f in frames if not any(f"{w}:" in f or f"/{w}" in f for w in WAIT_FILES)]
            return (ours or frames or [""])[0]
    return ""
