"""How the supervision loop sleeps (launch/supervisor.py): until a child process exits (its
pidfd turns readable), someone calls `notify`, or a timeout. Nothing wakes it per training step.

`notify` is the hand-off from other threads to the loop: the members/ watch callback (a
report changed, a lease expired) and the SIGINT/SIGTERM handler write one byte to a pipe; the
loop's `sleep` polls the pipe with the pidfds and drains it. The pipe is never closed: a late
signal or watch callback may still write to it, and a closed descriptor's number may by then
belong to some other file."""
from __future__ import annotations

import os
import select
from typing import Iterable


class Waker:
    """A self-pipe the loop sleeps on; `notify` from any thread or a signal handler."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def notify(self) -> None:
        """Wake the sleeping loop now (any thread, or a signal handler)."""
        try:
            os.write(self._w, b"x")
        except (BlockingIOError, OSError):
            pass

    def sleep(self, timeout_s: float, fds: Iterable[int] = ()) -> None:
        """Sleep up to `timeout_s`, waking at once when one of `fds` turns readable or `notify`
        was called (since the last sleep, too)."""
        poller = select.poll()
        poller.register(self._r, select.POLLIN)
        for fd in fds:
            poller.register(fd, select.POLLIN)
        try:
            poller.poll(max(0.0, timeout_s) * 1e3)
        except InterruptedError:
            pass
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
