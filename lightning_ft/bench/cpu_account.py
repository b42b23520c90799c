"""CPU time of every thread of a job's processes, read from /proc (bench.overhead's account).

Wall time on a shared machine swings by 2x; CPU time barely moves with load. `Account`
samples `/proc/PID/task/TID/stat` (utime + stime) of every process under a root PID (the
launcher or Lightning's DDP main process, and everything it started) a few times a second
and keeps each thread's largest reading. A thread's last fraction of a sample interval
before it exits is missed. `per_step` differences two snapshots taken inside one run, when
the job reached its first and its last measured step (bench.overhead's step marks), so
start-up and teardown stay outside the window and what is left is the CPU of the steady-state
steps. (It used to difference a short and a long run; at smoke-test sizes the runs' start-up
noise exceeded the steps' CPU and the account came out negative.)

Each thread is counted under its process's role and its own class:
- roles: `etcd` (the etcd binary), `launcher` (`lightning-ft run`), `worker` (anything else:
  the training processes);
- classes: `main` (the process's main thread), `ftar` (FTAR's control and send threads),
  `quorum`, `lease`, `watch`, `bg`, `hold`, `ckpt`, `loader`, `catchup` (our named threads,
  lightning_ft/threads.py), `grpc` (grpc's own threads), `etcd` (all of etcd's), `other`
  (unnamed threads: gloo's, torch's, Python's).
"""
from __future__ import annotations

import os
import threading
from typing import Optional

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")

_CLASSES = (("ftar", "ftar"), ("lft-quorum", "quorum"), ("lft-lease", "lease"), ("lft-watch", "watch"),
            ("lft-bg", "bg"), ("lft-run-hold", "hold"), ("lft-ckpt", "ckpt"), ("lft-loader", "loader"),
            ("lft-etcd-probe", "launcher-etcd"), ("catchup", "catchup"), ("lft-", "lft-other"))
_GRPC = ("event_engine", "grpc", "default-execut", "resolver-execu", "lifeguard", "timer_manager", "global-cq")


def thread_class(role: str, comm: str, is_main: bool) -> str:
    if role == "etcd":
        return "etcd"
    if is_main:
        return "main"
    for prefix, cls in _CLASSES:
        if comm.startswith(prefix):
            return cls
    if comm.startswith(_GRPC):
        return "grpc"
    return "other"


def process_role(cmdline: list[str]) -> str:
    if cmdline and os.path.basename(cmdline[0]) == "etcd":
        return "etcd"
    if "lightning_ft.launch.cli" in cmdline or any(c.endswith("/lightning-ft") for c in cmdline[:2]):
        return "launcher"
    return "worker"


def _read(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def _stat_fields(text: str) -> list[str]:
    """Fields of a /proc stat line after the command name (which may hold spaces)."""
    return text[text.rindex(")") + 2:].split()


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        st = _read(f"/proc/{name}/stat")
        if st is None:
            continue
        try:
            ppid = int(_stat_fields(st)[1])
        except (ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    return kids


class Account:
    """Samples the CPU of every thread under `root_pid` from a background thread."""

    def __init__(self, root_pid: int, interval_s: float = 0.2) -> None:
        self.root_pid, self.interval_s = root_pid, interval_s
        self._threads: dict[tuple[int, int, str], tuple[str, str, int]] = {}
        """(pid, tid, start time) -> (role, class, largest utime + stime seen, in ticks)."""
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="cpu-account", daemon=True)

    def start(self) -> "Account":
        self._thread.start()
        return self

    def stop(self) -> dict:
        """One last sample, then the totals (see `totals`)."""
        self._stop.set()
        self._thread.join()
        return self.totals()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)
        self.sample()

    def snapshot(self) -> dict:
        """Sample now, then the totals so far (see `totals`)."""
        self.sample()
        return self.totals()

    def sample(self) -> None:
        with self._lock:
            self._sample()

    def _sample(self) -> None:
        kids = _children()
        todo, seen = [self.root_pid], set()
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            todo.extend(kids.get(pid, ()))
            self._sample_process(pid)

    def _sample_process(self, pid: int) -> None:
        # Read every time, not cached: a child seen between its fork and its exec still shows its
        # parent's command line (CI counted the embedded etcd as the launcher that way).
        raw = _read(f"/proc/{pid}/cmdline")
        if raw is None:
            return
        role = process_role([c for c in raw.split("\0") if c])
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return
        for t in tids:
            st = _read(f"/proc/{pid}/task/{t}/stat")
            comm = _read(f"/proc/{pid}/task/{t}/comm")
            if st is None or comm is None:
                continue
            f = _stat_fields(st)
            ticks, start = int(f[11]) + int(f[12]), f[19]
            tid = int(t)
            key = (pid, tid, start)
            cls = thread_class(role, comm.strip(), tid == pid)
            old = self._threads.get(key)
            self._threads[key] = (role, cls, ticks if old is None else max(ticks, old[2]))  # the latest role

    def totals(self) -> dict:
        """{"total": s, "by_role": {role: s}, "by_thread": {"role/class": s}} in CPU seconds."""
        by_role: dict[str, float] = {}
        by_thread: dict[str, float] = {}
        with self._lock:
            threads = list(self._threads.values())
        for role, cls, ticks in threads:
            s = ticks * TICK_S
            by_role[role] = by_role.get(role, 0.0) + s
            by_thread[f"{role}/{cls}"] = by_thread.get(f"{role}/{cls}", 0.0) + s
        return {"total": sum(by_role.values()), "by_role": by_role, "by_thread": by_thread}


def per_step(short: dict, long: dict, extra_steps: int) -> dict:
    """Milliseconds of CPU per step: (later totals - earlier totals) / the steps between them."""
    def diff(a: dict, b: dict) -> dict:
        return {k: round((b.get(k, 0.0) - a.get(k, 0.0)) * 1e3 / extra_steps, 3) for k in sorted(set(a) | set(b))}

    return {"total": round((long["total"] - short["total"]) * 1e3 / extra_steps, 3),
            "by_role": diff(short["by_role"], long["by_role"]),
            "by_thread": diff(short["by_thread"], long["by_thread"])}
