"""Read a process's state and Python stack from outside (docs/ARCHITECTURE.md, "Hang diagnosis").

A SIGSTOPped process cannot dump its own stack (faulthandler runs in the process, and only once it
resumes), so the launcher, its parent, reads it: `py-spy dump --nonblocking` reads the
interpreter's memory without suspending the process (py-spy's default mode ptrace-attaches, which
fails on a process that is already stopped: "Failed to suspend process"). Being the parent also
satisfies Yama's ptrace scope 1. Without py-spy (`pip install py-spy`, the dev extra) the stack
says so; the diagnosis still names the rank and the link.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

DUMP_TIMEOUT_S = 5.0
"""Bound on one `py-spy dump`."""


STOPPED = ("T", "t")
"""`process_state` letters of a stopped process (SIGSTOP, or a tracer's stop): it never runs again by itself."""


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (R, S, D, T = stopped, Z, ...), or "?" when unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
        return raw.rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def py_spy() -> str:
    """The py-spy executable: beside our interpreter (a virtualenv), else on PATH; "" if none."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("py-spy") or ""


def dump_stack(pid: int, timeout_s: float = DUMP_TIMEOUT_S, native: bool = False) -> str:
    """The Python stack of every thread of `pid` (py-spy's text), or a line saying why not.
    `native`: with C frames (it stops the process while it reads; a process hung in
    interpreter shutdown has no Python frame left to show)."""
    exe = py_spy()
    if not exe:
        return "no stack: py-spy is not installed (pip install py-spy, or the dev extra: pip install -e '.[dev]')"
    try:
        how = ["--native"] if native else ["--nonblocking"]
        r = subprocess.run([exe, "dump", *how, "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"no stack: py-spy dump --pid {pid} took longer than {timeout_s:g}s"
    except OSError as e:
        return f"no stack: could not run {exe}: {e}"
    if r.returncode != 0:
        err = (r.stderr or r.stdout).strip().splitlines()
        return f"no stack: py-spy dump --pid {pid} failed: " + " / ".join(err[:3])
    return r.stdout
