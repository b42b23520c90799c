"""Process-tree helpers for tests that kill launchers: children by /proc, liveness."""
from __future__ import annotations

import os


def children(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc/*/stat)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
