"""Reading the JSON lines a child process prints (demo leaders, benchmark replicas, tests).

A reader thread parses each line of the stream (non-JSON lines are skipped) and keeps them;
`wait_for` blocks, with a deadline, until a line matches.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Callable, Iterable, Optional


class JsonLines:
    def __init__(self, stream: Iterable[str]) -> None:
        self.rows: list[dict] = []
        self.eof = False
        self.cv = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: Iterable[str]) -> None:
        for line in stream:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            with self.cv:
                self.rows.append(row)
                self.cv.notify_all()
        with self.cv:
            self.eof = True
            self.cv.notify_all()

    def select(self, pred: Callable[[dict], bool]) -> list[dict]:
        with self.cv:
            return [r for r in self.rows if pred(r)]

    def wait_for(self, pred: Callable[[dict], bool], timeout_s: float) -> Optional[dict]:
        """The first row matching `pred`, or None at the deadline or once the stream ended."""
        deadline = time.monotonic() + timeout_s
        with self.cv:
            while True:
                for r in self.rows:
                    if pred(r):
                        return r
                left = deadline - time.monotonic()
                if left <= 0 or self.eof:
                    return None
                self.cv.wait(min(left, 0.1))
