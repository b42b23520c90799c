"""The soak's signals to processes (lightning_ft/bench/soak.py): whether one is alive, a signal
that may find it gone, and the `slow` fault's throttle."""
from __future__ import annotations

import os
import signal
import time
from typing import Callable


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def send(pid: int, sig: int) -> None:
    try:
        if pid < 0:
            os.killpg(-pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def throttle(pids: Callable[[], list[int]], until: Callable[[], float]) -> None:
    """A `slow` fault: stop the processes `pids()` names (whatever incarnation runs) 0.2 s in every
    0.3 s until `until()` (a monotonic time) has passed, then let them run."""
    now: list[int] = []
    try:
        while time.monotonic() < until():
            now = pids()
            for pid in now:
                send(pid, signal.SIGSTOP)
            time.sleep(0.2)
            for pid in now:
                send(pid, signal.SIGCONT)
            time.sleep(0.1)
    finally:
        for pid in now:
            send(pid, signal.SIGCONT)
