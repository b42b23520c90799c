"""What the etcd watches told one replica leader (coord/membership.py): the decisions stored
under `quorum/`, the evictions, which members of the current quorum are dead (evicted, or
their lease expired), and, while it decides rounds, the members' reports.

This is the hand-off between the watch callbacks and the round thread (coord/coordinator.py).
The callbacks (EtcdStore: one thread per watch, `lft-watch <prefix>`; MemoryStore: the thread
that wrote) write it through `apply`; the round thread reads it and hands over the quorum
failures are judged against (`follow`). Every field is under `_lock`; every read is a copy."""
from __future__ import annotations

import json
import threading
from typing import Optional

from . import stragglers
from .round_records import Quorum, Report
from .store import Event


class Watched:
    """The watched state of one leader (thread-safe)."""

    def __init__(self, root: str, rid: int, threshold: float = 0.0) -> None:
        self._root, self._rid = root, rid
        self._threshold = threshold
        """stragglers.threshold: a benched straggler's report asks for a full round once it is ready."""
        self._lock = threading.Lock()
        self._quorum: Optional[Quorum] = None
        """The round the round thread is in (`follow`): its members' failures are failures."""
        self._dead: set[tuple[int, int]] = set()
        """Members of `_quorum` seen evicted or expired."""
        self._evicted: set[tuple[int, int]] = set()
        """Every eviction the evict/ watch delivered."""
        self._reports: dict[int, Report] = {}
        """Reports the members/ watch delivered, by replica id (only while it is held)."""
        self._decisions: dict[int, bytes] = {}
        """Decisions the quorum/ watch delivered, by round (saves non-deciders a read per wake)."""

    # -- the watch threads -----------------------------------------------------------------------
    def apply(self, ev: Event) -> tuple[bool, Optional[tuple[int, str]]]:
        """Take in one watch event: (whether the next round must be a full round, the member of
        the current quorum that failed with why, or None)."""
        parts = ev.key[len(self._root):].split("/")
        changed, failed = False, None
        with self._lock:
            q = self._quorum
            if parts[0] == "quorum" and ev.kind == "put":
                self._decisions[int(parts[1])] = ev.value
            elif parts[0] == "evict" and ev.kind == "put" and len(parts) == 3:
                rid, inc = int(parts[1]), int(parts[2])
                self._evicted.add((rid, inc))
                if q is not None and (rid, inc) in q.member_set():
                    self._dead.add((rid, inc))
                    changed, failed = True, (rid, f"evicted: {ev.value.decode(errors='replace')}")
            elif parts[0] == "alive" and len(parts) == 2 and q is not None:
                rid = int(parts[1])
                if rid in q.members:
                    inc = q.incarnations[q.members.index(rid)]
                    if ev.kind == "delete":
                        self._dead.add((rid, inc))
                        changed, failed = True, (rid, "lease expired")
                    elif json.loads(ev.value)["incarnation"] == inc:
                        self._dead.discard((rid, inc))  # back from a lapse (evictions are re-checked in quorum)
                    else:
                        changed = True  # a new incarnation replaces a member
                elif ev.kind == "put" and rid != self._rid:
                    changed = True  # a joiner: take it in at the next round
            elif parts[0] == "members" and len(parts) == 2:  # the decider's watch only
                rid = int(parts[1])
                report = Report.from_json(ev.value) if ev.kind == "put" else None
                if report is None:
                    self._reports.pop(rid, None)
                else:
                    self._reports[rid] = report
                if report is not None and rid != self._rid and q is not None and (
                        rid not in q.members or report.incarnation != q.incarnations[q.members.index(rid)]):
                    # a joiner still reporting (left out of a round), or a new incarnation of a member
                    # (a warm spare promoted before the old one's lease lapsed): take it in; a benched
                    # straggler only once its probe says it is fast again (rule 14)
                    bench = stragglers.bench_entry(q.slow, rid)
                    changed = bench is None or stragglers.ready(
                        stragglers.Probe(report.compute_ms, report.probe_s, report.bench, report.bench_s),
                        *bench, q.pace_ms, self._threshold)
        return changed, failed

    # -- the round thread ------------------------------------------------------------------------
    def follow(self, q: Optional[Quorum], *, prune: bool = False) -> None:
        """Judge failures against `q` from now on; `prune`: forget the dead that are not in it."""
        with self._lock:
            self._quorum = q
            if prune and q is not None:
                self._dead = {m for m in self._dead if m in q.member_set()}

    def alive(self, q: Quorum) -> list[int]:
        """The members of `q`, in order, not seen dead."""
        with self._lock:
            return [r for r, i in zip(q.members, q.incarnations, strict=True) if (r, i) not in self._dead]

    def reports(self) -> tuple[dict[int, Report], set[tuple[int, int]]]:
        """(the watched reports, every eviction seen), copied."""
        with self._lock:
            return dict(self._reports), set(self._evicted)

    def set_reports(self, reports: dict[int, Report]) -> None:
        """The members/ watch starts (`reports` read at its start revision) or stops ({})."""
        with self._lock:
            self._reports = reports

    def decision(self, round: int) -> Optional[bytes]:
        with self._lock:
            return self._decisions.get(round)

    def decisions_after(self, round: int) -> list[tuple[int, bytes]]:
        """(round, stored decision) of the rounds after `round` the watch delivered, in order."""
        with self._lock:
            return sorted((r, raw) for r, raw in self._decisions.items() if r > round)

    def forget_decisions(self, through: int) -> None:
        """Drop the decisions of rounds up to `through` (adopted or passed)."""
        with self._lock:
            for r in [r for r in self._decisions if r <= through]:
                del self._decisions[r]
