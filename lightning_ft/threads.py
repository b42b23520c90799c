"""Our background threads carry their names to the OS (`top -H`, `py-spy`, and the CPU account
of `bench.overhead`, which reads /proc/PID/task/TID/comm to say which thread used the CPU).

Python names a thread only for itself: the kernel sees every thread of a process as
"python". `Thread` sets the kernel's name (15 characters) from the Python name when it
starts; `name_current` does it for a thread someone else started (a ThreadPoolExecutor's
initializer)."""
from __future__ import annotations

import ctypes
import ctypes.util
import threading
from typing import Optional

_PR_SET_NAME = 15


def _load_libc() -> Optional[ctypes.CDLL]:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


_libc = _load_libc()  # at import: threads starting together must not race to load it


def name_current(name: str) -> None:
    """Set the kernel's name of the calling thread (Linux; a no-op elsewhere)."""
    if _libc is not None:
        try:
            _libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
        except (AttributeError, OSError):
            pass


class Thread(threading.Thread):
    """threading.Thread whose kernel name is its Python name."""

    def run(self) -> None:
        name_current(self.name)
        super().run()
