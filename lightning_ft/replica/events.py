"""The run's event log, `{run_dir}/events.jsonl` (docs/ARCHITECTURE.md, "Observability"): one JSON
line per event, appended in one write (O_APPEND), so that the launcher and every replica can
write it at once. `lightning-ft report` reads it."""
from __future__ import annotations

import json
import os
import time
from typing import Any


def append_event(run_dir: str, name: str, by: int, incarnation: int, fields: dict[str, Any]) -> None:
    """Append event `name`, written by replica `by` (of `incarnation`), about `fields["replica"]`
    (default: itself)."""
    fields.setdefault("replica", by)
    fields.setdefault("incarnation", incarnation if fields["replica"] == by else None)
    line = json.dumps({"t": time.time(), "event": name, "by": by, **fields}) + "\n"
    fd = os.open(os.path.join(run_dir, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
