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

from lightning_ft.launch import zygote_inherit
from lightning_ft.launch.zygote import MAX_MSG, python_target

REPORT_WAIT_S = 3.0
"""How long the zygote waits for a forked child to become the program (it takes milliseconds)."""
_path0: Optional[str] = None
"""The zygote's own sys.path[0] (its working directory at start, for `-m`): not a program's."""
_start_env: dict[str, str] = {}
"""The zygote's environment as it started (before a preloaded module could change it)."""


def _child(sock: socket.socket, wake: tuple[int, int], msg: dict[str, Any], fds: list[int], report: int) -> None:
    """In the forked child: become the program and never return. Until it runs the program it
    answers on `report`: closed when the child is the program a fresh exec would have been, an
    error message (and the child leaves) when it cannot be."""
    code = 1
    try:
        sock.close()
        for fd in wake:
            os.close(fd)
        signal.set_wakeup_fd(-1)
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
        # signal dispositions and mask, limits, umask, nice, CPUs: the launcher's (zygote_inherit.py)
        zygote_inherit.apply(msg["inherit"], env)
        kind, target, args = python_target(msg["argv"]) or ("", "", [])
    except BaseException as e:  # noqa: BLE001  (not the program yet: the supervisor starts it afresh)
        try:
            os.write(report, f"{type(e).__name__}: {e}".encode()[:4000])
        finally:
            os._exit(1)
    os.close(report)  # the zygote answers the spawn now; the reseeding below runs meanwhile
    try:
        _fresh_state(env)
        code = _run(kind, target, args)
    except BaseException:  # noqa: BLE001  (before the program ran: report it in its log and leave)
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

    # sys.path[0] as `python -m` (the working directory) or `python script.py` (the script's real
    # directory) sets it, instead of the zygote's own (its working directory when it started)
    if _path0 is not None and _path0 in sys.path:
        sys.path.remove(_path0)
    if not sys.flags.safe_path:
        sys.path.insert(0, os.getcwd() if kind == "module" else os.path.dirname(os.path.realpath(target)))
    sys.argv = [target, *args]
    try:
        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
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


def _spawn(sock: socket.socket, wake: tuple[int, int], msg: dict[str, Any], fds: list[int]) -> tuple[int, str]:
    """Fork the program `msg` asks for: (its pid, "") once the child is the program a fresh exec
    would have been, else (0, why not) with no child left."""
    try:
        differs = zygote_inherit.start_env_differs(_start_env, msg["env"])
        if differs:  # read at the interpreter's start: a fork would keep the zygote's
            return 0, f"the environment sets {', '.join(differs)} differently from the zygote's"
        report_r, report_w = os.pipe()
        try:
            pid = os.fork()
        except OSError as e:
            os.close(report_r)
            os.close(report_w)
            return 0, str(e)
        if pid == 0:
            os.close(report_r)
            _child(sock, wake, msg, fds, report_w)
        os.close(report_w)
    finally:
        for f in fds:
            os.close(f)
    import select

    error = b""
    try:
        while True:
            ready, _, _ = select.select([report_r], [], [], REPORT_WAIT_S)
            if not ready:
                error = b"the forked child did not start the program in time"
                os.kill(pid, signal.SIGKILL)
                break
            data = os.read(report_r, 4096)
            if not data:
                break
            error += data
    finally:
        os.close(report_r)
    if error:
        os.waitpid(pid, 0)
        return 0, error.decode(errors="replace")
    return pid, ""


def serve(fd: int, preload: Sequence[str]) -> int:
    """The zygote's loop (`python -m lightning_ft.launch.zygote_server FD MODULE...`)."""
    global _path0, _start_env
    sock = socket.socket(fileno=fd)
    t0 = time.perf_counter()
    _path0 = sys.path[0] if sys.path and not sys.flags.safe_path else None
    _start_env = dict(os.environ)
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
                pid, error = _spawn(sock, (wake_r, wake_w), msg, fds)
                if pid:
                    forked.add(pid)
                sock.send(json.dumps({"id": msg["id"], "pid": pid} if pid else {"id": msg["id"], "error": error})
                          .encode())
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
