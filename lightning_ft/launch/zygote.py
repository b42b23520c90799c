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
with SCM_RIGHTS. Supervisor -> zygote: {"op": "spawn", "id", "argv", "env", "cwd"} with
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
import time
from typing import Any, Callable, Optional, Sequence, Union

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
            mods.append("lightning_ft.replica.manager")
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
    """Starts the zygote process (`python -m lightning_ft.launch.zygote`) and forks programs
    through it once it has imported `preload`. `spawn` returns None while it is not ready or
    when it failed: the caller starts the process itself."""

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
        self.failed = ""
        """Why the zygote is unusable ("" while it works)."""
        self.preloaded_s: Optional[float] = None
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lightning_ft.launch.zygote", str(theirs.fileno()), *self.preload],
                env=dict(os.environ if env is None else env), pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT if log_path else subprocess.DEVNULL,
                start_new_session=True)
        finally:
            theirs.close()
            if log_path:
                out.close()  # type: ignore[union-attr]
        self._reader = threading.Thread(target=self._read, name="zygote", daemon=True)
        self._reader.start()

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
        # the zygote is gone: its children's exits can no longer be learned from it
        self.failed = self.failed or "the zygote process exited"
        self.ready.clear()
        with self._lock:
            procs = list(self._procs.values())
            pending = list(self._pending.values())
        for ev, _ in pending:
            ev.set()
        for proc in procs:
            if not proc._exited.is_set():
                threading.Thread(target=_await_foreign_exit, args=(proc,), daemon=True).start()

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
            self._send({"op": "spawn", "id": rid, "argv": list(argv), "env": env, "cwd": cwd}, [stdout, stderr])
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
            self.failed = f"its socket failed: {e}"
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
def _child(sock: socket.socket, wake: tuple[int, int], msg: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become the program and never return."""
    code = 1
    try:
        sock.close()
        for fd in wake:
            os.close(fd)
        signal.set_wakeup_fd(-1)
        for s in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in {devnull, *fds} - {0, 1, 2}:
            os.close(fd)
        env = {str(k): str(v) for k, v in msg["env"].items()}
        os.environ.clear()
        os.environ.update(env)
        os.chdir(msg["cwd"])
        _fresh_stdio(env)
        _fresh_state(env)
        kind, target, args = python_target(msg["argv"]) or ("", "", [])
        code = _run(kind, target, args)
    except BaseException:  # noqa: BLE001  (anything before the program ran: report it and leave)
        import traceback

        traceback.print_exc()
    _exit(code)


def _fresh_stdio(env: dict[str, str]) -> None:
    import io

    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    out = io.open(1, "wb", buffering=0 if unbuffered else -1, closefd=False)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(out, encoding="utf-8", line_buffering=False,  # type: ignore[misc]
                                                   write_through=unbuffered)
    err = io.open(2, "wb", buffering=0, closefd=False)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(err, encoding="utf-8", errors="backslashreplace",  # type: ignore[misc]
                                                   line_buffering=True, write_through=True)
    sys.stdin = sys.__stdin__ = open(0, encoding="utf-8", closefd=False)  # type: ignore[misc]


def _fresh_state(env: dict[str, str]) -> None:
    """What a fresh interpreter would have differently from the zygote's fork."""
    import random

    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
    marks = sys.modules.get("lightning_ft.replica.startup")
    if marks is not None:  # the zygote's own start-up marks are not this program's
        marks.forked()
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _run(kind: str, target: str, args: list[str]) -> int:
    import runpy

    try:
        if kind == "module":
            sys.argv = [target, *args]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
        code = 0
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt as e:
        _print_exception(e)
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 128 + signal.SIGINT
    except BaseException as e:  # noqa: BLE001  (the program's uncaught exception: Python prints it, exits 1)
        _print_exception(e)
        code = 1
    _finish()
    return code


def _print_exception(e: BaseException) -> None:
    """The traceback Python prints for an uncaught exception: from the program's first frame
    (runpy's and ours left out)."""
    import traceback

    tb = e.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")
                              or tb.tb_frame.f_code.co_filename.endswith("runpy.py")):
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb or e.__traceback__)


def _finish() -> None:
    """What the interpreter does at a normal exit: join non-daemon threads, run atexit handlers."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:  # noqa: BLE001
        pass
    import atexit

    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        pass


def _exit(code: int) -> None:
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except BaseException:  # noqa: BLE001
            pass
    os._exit(code & 0xFF if code >= 0 else 1)


def serve(fd: int, preload: Sequence[str]) -> int:
    """The zygote's loop (`python -m lightning_ft.launch.zygote FD MODULE...`)."""
    sock = socket.socket(fileno=fd)
    t0 = time.perf_counter()
    for name in preload:
        try:
            __import__(name)
        except Exception as e:  # noqa: BLE001  (a missing optional module: preload less)
            print(f"lightning-ft zygote: cannot preload {name}: {e}", file=sys.stderr, flush=True)
    if threading.active_count() > 1:  # a preloaded module started a thread: forking is unsafe
        print(f"lightning-ft zygote: preloading {list(preload)} started threads "
              f"{[t.name for t in threading.enumerate()]}; not forking", file=sys.stderr, flush=True)
        return 2
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the supervisor; it stops us
    sock.send(json.dumps({"ready": True, "preloaded": list(preload),
                          "seconds": round(time.perf_counter() - t0, 3)}).encode())
    import select

    watched: set[int] = set()  # children the supervisor registered, exit not yet reported
    forked: set[int] = set()  # every child not yet reaped
    while True:
        try:
            readable, _, _ = select.select([sock.fileno(), wake_r], [], [], 1.0)
        except InterruptedError:
            readable = [wake_r]
        if wake_r in readable:
            try:
                while os.read(wake_r, 4096):
                    pass
            except OSError:
                pass
        if sock.fileno() in readable:
            try:
                data, fds, _, _ = socket.recv_fds(sock, MAX_MSG, 4)
            except OSError:
                data, fds = b"", []
            if not data:  # the supervisor is gone: reap what exited (PID 1 may not), leave the rest
                for pid in forked:
                    try:
                        os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:
                        pass
                return 0
            msg = json.loads(data)
            if msg["op"] == "spawn":
                try:
                    pid = os.fork()
                except OSError as e:
                    for f in fds:
                        os.close(f)
                    sock.send(json.dumps({"id": msg["id"], "error": str(e)}).encode())
                    continue
                if pid == 0:
                    _child(sock, (wake_r, wake_w), msg, fds)
                for f in fds:
                    os.close(f)
                forked.add(pid)
                sock.send(json.dumps({"id": msg["id"], "pid": pid}).encode())
            elif msg["op"] == "watch":
                watched.add(int(msg["pid"]))
            elif msg["op"] == "reap":
                pid = int(msg["pid"])
                if pid in forked and pid not in watched:
                    os.waitpid(pid, 0)
                    forked.discard(pid)
                    sock.send(json.dumps({"reaped": pid}).encode())
        for pid in list(watched):  # every pass: a SIGCHLD may have come before the watch
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                info = None
                watched.discard(pid)
                forked.discard(pid)
                continue
            if info is None:
                continue
            code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            watched.discard(pid)
            sock.send(json.dumps({"exit": pid, "code": code}).encode())


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return serve(int(argv[0]), argv[1:])


if __name__ == "__main__":
    sys.exit(main())
