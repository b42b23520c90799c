"""The zygote process itself (launch/zygote.py has the whole story and the supervisor's side):
`python -m lightning_ft.launch.zygote_server FD MODULE...` imports the preload modules, then
forks each requested program into its own session with the replica's descriptors, environment
and argv, runs it as `__main__`, and reports exit codes without reaping."""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Optional, Sequence

from lightning_ft.launch.zygote import MAX_MSG, python_target


def _child(sock: socket.socket, wake: tuple[int, int], msg: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become the program and never return."""
    code = 1
    try:
        sock.close()
        for fd in wake:
            os.close(fd)
        signal.set_wakeup_fd(-1)
        for s in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_DFL)
        # as a fresh python starts: a write to a closed socket raises BrokenPipeError; with the
        # default disposition it killed a forked rank whose FTAR peer had closed (CI, -13)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
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
        # and records it, as Python does before its exit (threading._shutdown hooks read it:
        # lightning_ft/fabric/compat.py::exited_by_exception)
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, e.__traceback__
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
    """The zygote's loop (`python -m lightning_ft.launch.zygote_server FD MODULE...`)."""
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
