"""Process-tree helpers for tests that kill launchers: children and descendants by /proc, a
replica rank's process from the launcher's events, liveness.

`lightning-ft run` forks its replicas from the zygote (launch/zygote.py) once it has imported
torch: they are the launcher's grandchildren, and their /proc/PID/environ is the zygote's (the
environment a process was exec'd with), so a rank is found from the run's events, not from its
environment."""
from __future__ import annotations

import json
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


def descendants(pid: int) -> list[int]:
    """Children of `pid`, their children, and so on (a zygote's forks included)."""
    out, todo = [], [pid]
    while todo:
        for c in children(todo.pop()):
            out.append(c)
            todo.append(c)
    return out


def replica_pid(run_dir: str, rid: int, rank: int) -> int:
    """The process of `rank` of replica `rid`'s newest incarnation, from the launcher's events
    (`start`, `restart` and `promote` name its processes' pids in rank order); 0 if none yet."""
    pid = 0
    try:
        with open(os.path.join(run_dir, "events.jsonl")) as f:
            for line in f:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e.get("replica") == rid and isinstance(e.get("pids"), list) and len(e["pids"]) > rank:
                    pid = int(e["pids"][rank])
    except OSError:
        pass
    return pid
