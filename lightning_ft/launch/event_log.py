"""The supervisor's event log: one JSON line per event in `{run_dir}/events.jsonl`
(launch/supervisor.py), and the last event of each replica (the status table's column).

Two kinds of thread write it: the supervision loop, and the hang-diagnosis threads
(launch/diagnosis.py). Every write, and the `last` map, is under `_lock`."""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


class EventLog:
    """Appends events to `path`; thread-safe."""

    def __init__(self, path: str) -> None:
        self._lock = threading.Lock()
        """Guards the file and `_last`: the loop and the diagnosis threads write, status() reads."""
        self._file = open(path, "a", encoding="utf-8")
        self._last: dict[int, str] = {}
        """Replica id -> its last event ("hang: <reason>" when the event had a reason)."""

    def replica(self, rid: int, incarnation: int, event: str, **details: Any) -> None:
        """An event of replica `rid` in `incarnation`."""
        rec = {"t": time.time(), "event": event, "replica": rid, "incarnation": incarnation, **details}
        with self._lock:
            self._last[rid] = event + (f": {details['reason']}" if "reason" in details else "")
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()
        log.info("replica %d incarnation %d: %s %s", rid, incarnation, event, details)

    def line(self, row: dict[str, Any]) -> None:
        """An event of no replica (the spares'); dropped once the log is closed."""
        with self._lock:
            if not self._file.closed:
                self._file.write(json.dumps({"t": time.time(), **row}) + "\n")
                self._file.flush()

    def last(self, rid: int) -> str:
        """Replica `rid`'s last event ("" before any)."""
        with self._lock:
            return self._last.get(rid, "")

    def close(self) -> None:
        with self._lock:
            self._file.close()
