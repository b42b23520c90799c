"""What a program exec'd by the launcher inherits besides its argv, environment and working
directory, and how a program forked by the zygote takes the same on (launch/zygote.py, issue 45).

A replica started as a new process (`subprocess.Popen(..., start_new_session=True)`) inherits
from the launcher's thread that starts it, at that moment: the ignored signals (exec keeps
SIG_IGN and resets handled signals to SIG_DFL; Popen puts SIGPIPE and SIGXFSZ back to SIG_DFL
first), the signal mask, the resource limits, the umask, the nice value and the CPU affinity.
Python then ignores SIGPIPE and SIGXFSZ and, only where SIGINT is not ignored, makes SIGINT
raise KeyboardInterrupt. So under `nohup` a fresh replica has SIGINT and SIGHUP ignored; under
`lightning-ft run`, which handles SIGHUP, SIGHUP is default again.

A forked program would instead keep the zygote's, which are the launcher's when the zygote
started, with the zygote's own handlers on top. So the supervisor sends `capture()` (taken in the
thread that spawns, as Popen would fork from it) with each spawn, and the child calls `apply()`
before it becomes the program. What the child cannot take on (a limit above the zygote's hard
one, a lower nice value without the privilege, a CPU outside the zygote's set) raises: the
zygote answers the spawn with the error and the supervisor starts the process afresh.

`start_env_differs` names the environment variables that the interpreter reads only at its
start (sys.path, hash seed, encodings, ...): where a spawn's differ from the zygote's, the
zygote does not fork it (a fork cannot reproduce them).
"""
from __future__ import annotations

import os
import resource
import signal
from typing import Any, Mapping

RLIMITS = sorted(n for n in dir(resource) if n.startswith("RLIMIT_"))

EXEC_RESTORED = (signal.SIGPIPE, signal.SIGXFSZ)
"""Popen's restore_signals sets these to SIG_DFL before exec, and Python ignores them at start."""

START_ONLY_SAFE = {"PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "PYTHONBREAKPOINT"}
"""PYTHON* variables a forked child reproduces (its stdio, faulthandler) or Python reads late."""


def _status() -> dict[str, str]:
    """This thread's /proc status (its signal mask is per thread), {} where there is none."""
    for path in ("/proc/thread-self/status", "/proc/self/status"):
        try:
            with open(path) as f:
                return {k: v.strip() for k, _, v in (line.partition(":") for line in f)}
        except OSError:
            continue
    return {}


def _signals(hexmask: str) -> list[int]:
    bits = int(hexmask, 16)
    return [i + 1 for i in range(bits.bit_length()) if bits >> i & 1]


def capture() -> dict[str, Any]:
    """What a process exec'd from the calling thread now would inherit (JSON-able)."""
    st = _status()
    if "SigIgn" in st:  # the kernel's view: also what C code set, not only signal.signal
        ignored = _signals(st["SigIgn"])
    else:
        ignored = [int(s) for s in signal.valid_signals() if _getsignal(s) == signal.SIG_IGN]
    return {
        "ignored": ignored,
        "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "rlimits": {n: list(resource.getrlimit(getattr(resource, n))) for n in RLIMITS},
        "umask": int(st["Umask"], 8) if "Umask" in st else None,  # reading it by os.umask would race
        "nice": os.getpriority(os.PRIO_PROCESS, 0),  # this thread's, on Linux
        "cpus": sorted(os.sched_getaffinity(0)),
    }


def _getsignal(s: int) -> Any:
    try:
        return signal.getsignal(s)
    except (OSError, ValueError):
        return None


def start_env_differs(zygote_env: Mapping[str, str], env: Mapping[str, str]) -> list[str]:
    """The variables Python reads only at its start (PYTHON*, the locale's) that `env` sets
    differently from the zygote's own environment: a fork would run with the zygote's."""
    names = {n for n in (*zygote_env, *env) if n.startswith("PYTHON") or n in ("LANG", "LC_ALL", "LC_CTYPE")}
    return sorted(n for n in names - START_ONLY_SAFE if zygote_env.get(n) != env.get(n))


def apply(state: Mapping[str, Any], env: Mapping[str, str]) -> None:
    """In the forked child, single-threaded, before the program runs: take on `state` (from
    `capture()` in the launcher) as exec would have. Raises OSError saying what it could not."""
    _signal_dispositions(set(state["ignored"]), env)
    for name, (soft, hard) in state["rlimits"].items():
        which = getattr(resource, name, None)
        if which is None or list(resource.getrlimit(which)) == [soft, hard]:
            continue
        try:
            resource.setrlimit(which, (soft, hard))
        except (OSError, ValueError) as e:
            raise OSError(f"cannot set {name} to the launcher's {(soft, hard)} "
                          f"(the zygote has {resource.getrlimit(which)}): {e}") from e
    if state.get("umask") is not None:
        os.umask(state["umask"])
    if os.getpriority(os.PRIO_PROCESS, 0) != state["nice"]:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, state["nice"])
        except OSError as e:
            raise OSError(f"cannot take the launcher's nice value {state['nice']} (the zygote has "
                          f"{os.getpriority(os.PRIO_PROCESS, 0)}): {e}") from e
    if sorted(os.sched_getaffinity(0)) != state["cpus"]:
        try:
            os.sched_setaffinity(0, state["cpus"])
        except OSError as e:
            raise OSError(f"cannot take the launcher's CPUs {state['cpus']}: {e}") from e
    signal.pthread_sigmask(signal.SIG_SETMASK, state["mask"])  # last: the launcher's blocked signals


def _signal_dispositions(ignored: set[int], env: Mapping[str, str]) -> None:
    """Every signal as exec then Python's start leave it: ignored where the launcher ignores it,
    else default; SIGPIPE and SIGXFSZ ignored; SIGINT raising KeyboardInterrupt unless ignored."""
    import faulthandler

    if faulthandler.is_enabled():  # the zygote's (PYTHONFAULTHANDLER): re-enabled below if wanted
        faulthandler.disable()
    signal.set_wakeup_fd(-1)
    ignored -= set(EXEC_RESTORED)
    for s in signal.valid_signals():
        if s in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(s, signal.SIG_IGN if s in ignored else signal.SIG_DFL)
        except (OSError, ValueError):  # C library's own (glibc's 32, 33): no program sets them
            pass
    for s in EXEC_RESTORED:
        signal.signal(s, signal.SIG_IGN)
    if signal.SIGINT not in ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable(all_threads=True)

