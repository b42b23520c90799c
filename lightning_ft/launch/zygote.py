"""A pre-imported process that forks replicas: cold restarts without the import cost (issue 25 §2).

A restarted replica spends most of its cold start importing: `import torch` and, at the first
`Optimizer(...)` (or `import lightning`), `torch._dynamo` with sympy; together 2-3 s of the
heal on this machine, far more under load. The zygote pays that once. `lightning-ft run`
starts it beside the replicas (`supervisor.zygote`); it imports the preload modules and then
only waits. A restart asks it for the replica's processes: it forks, and the child becomes the
user's program as `python script.py args` would have run it:

- its own session (`setsid`: the supervisor signals its process group, as for a Popen child);
- stdin from /dev/null, stdout and stderr on the descriptors the supervisor passed (its log);
- the environment replaced by the replica's, the working directory and `sys.argv` set;
  `sys.stdout`/`sys.stderr` rebuilt on the new descriptors (`PYTHONUNBUFFERED` honoured);
  torch's thread count taken from `OMP_NUM_THREADS` (OpenMP read the zygote's at import);
  `random` and numpy's global generator reseeded (a fork shares the zygote's state);
- what an exec from the launcher's spawning thread would inherit at that moment: ignored
  signals (nohup's SIGINT/SIGHUP), the signal mask, limits, umask, nice, CPUs
  (launch/zygote_inherit.py); a spawn it cannot reproduce is answered with an error and started
  afresh by the caller;
- the program run by `runpy` as `__main__`; its exit code as Python's own: `sys.exit(n)`,
  1 for an uncaught exception (traceback on stderr), SIGINT for an uncaught
  KeyboardInterrupt; atexit handlers and non-daemon threads finish first.

The zygote never runs a parallel op or creates a thread (GNU OpenMP and many libraries are not
fork-safe after that), never touches CUDA, and holds no etcd or socket state of a replica.

Exits are reported, not reaped: the zygote watches its children with `waitid(WNOWAIT)` and
tells the supervisor each exit code, leaving the zombie, so the supervisor can still SIGKILL
what is left of that process group by PID (as it does with its own children); it reaps on the
supervisor's `wait()`. When the supervisor goes away (its socket closes) the zygote exits; its
children stay, as Popen children do (they leave through etcd, docs/ARCHITECTURE.md).

Control channel: a SOCK_SEQPACKET socketpair, one JSON object a message, descriptors passed
with SCM_RIGHTS. Supervisor -> zygote: {"op": "spawn", "id", "argv", "env", "cwd", "inherit"} with
[stdout, stderr]; {"op": "reap", "pid"}. Zygote -> supervisor: {"ready": true, "preloaded"},
{"id", "pid"} or {"id", "error"}, {"exit": pid, "code"}.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from typing import Any, Callable, Optional, Sequence, Union

from lightning_ft.launch import zygote_inherit

log = logging.getLogger(__name__)

MAX_MSG = 1 << 20
SPAWN_TIMEOUT_S = 5.0
"""A spawn the zygote does not answer within this long falls back to a plain start."""
REAP_ACK_S = 2.0
"""`ZygoteProc.wait` waits this long at most for the zygote to confirm it reaped the process."""


def python_target(cmd: Sequence[str]) -> Optional[tuple[str, str, list[str]]]:
    """("path", script, args) for `[python, script.py, args...]`, ("module", name, args) for
    `[python, -m, name, args...]`, where python is this interpreter; None for anything else
    (another interpreter, interpreter options, not Python): those start as plain processes."""
    if len(cmd) < 2 or not _same_python(cmd[0]):
        return None
    if cmd[1] == "-m" and len(cmd) >= 3 and not cmd[2].startswith("-"):
        return "module", cmd[2], list(cmd[3:])
    if cmd[1].startswith("-") or not cmd[1].endswith(".py"):
        return None
    return "path", cmd[1], list(cmd[2:])


def _same_python(exe: str) -> bool:
    try:
        return os.path.samefile(exe, sys.executable)
    except OSError:
        return False


def default_preload(target: Optional[tuple[str, str, list[str]]]) -> list[str]:
    """torch with `torch._dynamo` (a torch optimizer's first construction imports it: about as
    long as torch itself), then what the script's source names: Lightning, and our replica
    layer for a script that drives it by hand (examples/plain_loop.py). None of them starts a
    thread at import (the zygote checks)."""
    mods = ["torch", "torch._dynamo"]
    if target is not None and target[0] == "path":
        try:
            with open(target[1], encoding="utf-8", errors="replace") as f:
                src = f.read()
        except OSError:
            src = ""
        if re.search(r"^\s*(?:import|from)\s+lightning\b", src, re.M):  # not lightning_ft
            mods.append("lightning.pytorch")
        if re.search(r"^\s*(?:import|from)\s+lightning_ft\.replica\b", src, re.M):
            mods.append("lightning_ft.replica.replica")
    return mods


# -- the supervisor's side ------------------------------------------------------------------------
class ZygoteProc:
    """A forked replica process, as much of `subprocess.Popen` as the supervisor uses: `pid`,
    `returncode` (set once reaped), `poll()` (the exit code, without reaping), `wait(timeout)`
    (reaps), `exit_fd()` (readable once the exit code is known: the supervisor sleeps on it
    as on a pidfd)."""

    def __init__(self, zygote: "Zygote", pid: int) -> None:
        self._zygote = zygote
        self.pid = pid
        self.zygote_pid = zygote.proc.pid
        """The process's parent."""
        self.returncode: Optional[int] = None
        self._code: Optional[int] = None
        self._exited = threading.Event()
        self._reaped = threading.Event()
        self._r, self._w = os.pipe()

    def _set_exit(self, code: int) -> None:
        self._code = code
        self._exited.set()
        try:
            os.write(self._w, b"x")
            os.close(self._w)
        except OSError:
            pass

    def exit_fd(self) -> int:
        """A descriptor (the caller closes it) that turns readable when the exit code is known."""
        return self._r

    def poll(self) -> Optional[int]:
        if self.returncode is not None:
            return self.returncode
        return self._code

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
        if self.returncode is None:
            try:  # like Popen.wait: the PID is free when this returns (bounded: the zygote may be gone)
                self._zygote._send({"op": "reap", "pid": self.pid})
                self._reaped.wait(REAP_ACK_S)
            except OSError:
                pass
            self.returncode = self._code
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """Starts the zygote process (`python -m lightning_ft.launch.zygote_server`) and forks programs
    through it once it has imported `preload`. `spawn` returns None while it is not ready or
    when it failed: the caller starts the process itself.

    Threads: the supervision loop calls `spawn` and `close`; the reader thread (`zygote`)
    reads the socket. They share `_procs` and `_pending` under `_lock`, the socket's sends
    under `_send_lock`, the events `ready` and each process's exit, and one field each: the
    reader writes `_gone` and `preloaded_s`, the loop `_broken` (`failed` reads both)."""

    def __init__(self, preload: Sequence[str], env: Optional[dict[str, str]] = None,
                 on_exit: Optional[Callable[[], None]] = None, log_path: Optional[str] = None) -> None:
        self.preload = list(preload)
        self._on_exit = on_exit
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._send_lock = threading.Lock()
        self._procs: dict[int, ZygoteProc] = {}
        self._pending: dict[int, tuple[threading.Event, dict[str, Any]]] = {}
        self._seq = 0
        self._lock = threading.Lock()
        self.ready = threading.Event()
        self._gone = ""
        """The zygote process exited (the reader thread writes it)."""
        self._broken = ""
        """Its socket failed in a spawn (the loop's thread writes it)."""
        self.preloaded_s: Optional[float] = None
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lightning_ft.launch.zygote_server", str(theirs.fileno()), *self.preload],
                env=dict(os.environ if env is None else env), pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT if log_path else subprocess.DEVNULL,
                start_new_session=True)
        finally:
            theirs.close()
            if log_path:
                out.close()  # type: ignore[union-attr]
        self._reader = threading.Thread(target=self._read, name="zygote", daemon=True)
        self._reader.start()

    @property
    def failed(self) -> str:
        """Why the zygote is unusable ("" while it works)."""
        return self._broken or self._gone

    def _send(self, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
        data = json.dumps(msg).encode()
        with self._send_lock:
            if fds:
                socket.send_fds(self._sock, [data], list(fds))
            else:
                self._sock.send(data)

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_MSG)
            except OSError:
                data = b""
            if not data:
                break
            try:
                msg = json.loads(data)
            except ValueError:
                continue
            if msg.get("ready"):
                self.preloaded_s = msg.get("seconds")
                self.ready.set()
            elif "exit" in msg:
                with self._lock:
                    proc = self._procs.get(int(msg["exit"]))
                if proc is not None:
                    proc._set_exit(int(msg["code"]))
                    if self._on_exit is not None:
                        self._on_exit()
            elif "reaped" in msg:
                with self._lock:
                    proc = self._procs.pop(int(msg["reaped"]), None)
                if proc is not None:
                    proc._reaped.set()
            elif "id" in msg:
                with self._lock:
                    waiter = self._pending.get(int(msg["id"]))
                if waiter is not None:
                    waiter[1].update(msg)
                    waiter[0].set()
                elif "pid" in msg:  # forked after spawn gave up (and the caller started it afresh)
                    self._drop_late(int(msg["pid"]))
        # the zygote is gone: its children's exits can no longer be learned from it
        self._gone = "the zygote process exited"
        self.ready.clear()
        with self._lock:
            procs = list(self._procs.values())
            pending = list(self._pending.values())
        for ev, _ in pending:
            ev.set()
        for proc in procs:
            if not proc._exited.is_set():
                threading.Thread(target=_await_foreign_exit, args=(proc,), daemon=True).start()

    def _drop_late(self, pid: int) -> None:
        """Kill a program forked after its spawn timed out, and have the zygote reap it."""
        log.warning("zygote: process %d was forked after its spawn gave up; killing it", pid)
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            self._send({"op": "reap", "pid": pid})
        except OSError:
            pass

    def spawn(self, argv: Sequence[str], env: dict[str, str], cwd: str, stdout: int,
              stderr: int) -> Optional[ZygoteProc]:
        """Fork `argv` (`[python, script, args...]` or `[python, -m, mod, ...]`) with `env`,
        `cwd` and the given stdout/stderr descriptors; None when the zygote cannot (not ready,
        gone, or it did not answer): start the process yourself."""
        if self.failed or not self.ready.is_set() or python_target(argv) is None:
            return None
        with self._lock:
            self._seq += 1
            rid = self._seq
            ev, reply = threading.Event(), dict[str, Any]()
            self._pending[rid] = (ev, reply)
        try:
            # what a process exec'd from this thread now would inherit (signals, limits, ...)
            inherit = zygote_inherit.capture()
            self._send({"op": "spawn", "id": rid, "argv": list(argv), "env": env, "cwd": cwd, "inherit": inherit},
                       [stdout, stderr])
            if not ev.wait(SPAWN_TIMEOUT_S) or "pid" not in reply:
                why = reply.get("error", "no answer" if not self.failed else self.failed)
                log.warning("zygote: could not fork %s (%s); starting it as a new process", argv[1:2], why)
                return None
            pid = int(reply["pid"])
            with self._lock:
                # an exit may be reported before we registered the process: the zygote waits
                # for our registration (it reports only pids we acknowledged)
                proc = ZygoteProc(self, pid)
                self._procs[pid] = proc
            self._send({"op": "watch", "pid": pid})
            return proc
        except OSError as e:
            self._broken = f"its socket failed: {e}"
            return None
        finally:
            with self._lock:
                self._pending.pop(rid, None)

    def close(self) -> None:
        """Stop the zygote (its children keep running; the caller owns them)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if self.proc.poll() is None:
            try:
                self.proc.wait(2.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _await_foreign_exit(proc: ZygoteProc) -> None:
    """The zygote died before `proc` exited: `proc` is init's child now. Learn that it exited
    from a pidfd (its exit code is lost: reported as -SIGKILL)."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # already gone
        proc._set_exit(-signal.SIGKILL)
        return
    try:
        import select

        select.select([fd], [], [])
    finally:
        os.close(fd)
    proc._set_exit(-signal.SIGKILL)


Proc = Union[subprocess.Popen, ZygoteProc]
"""A replica process the supervisor started itself, or one the zygote forked."""


# -- the zygote process ----------------------------------------------------------------------------
