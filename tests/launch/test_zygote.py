"""The zygote (launch/zygote.py): which commands it forks, and forked programs that behave as
if `python script.py` had started them: argv, environment, working directory, exit codes,
tracebacks, signals and process groups, torch threads, fresh random state; exits reported
without reaping, reaped on wait; its children survive the zygote."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightning_ft.launch.zygote import Zygote, ZygoteProc, default_preload, python_target

PY = sys.executable


@pytest.mark.parametrize("cmd, want", [
    ([PY, "train.py", "--x", "1"], ("path", "train.py", ["--x", "1"])),
    ([PY, "train.py"], ("path", "train.py", [])),
    ([PY, "-m", "pkg.mod", "a"], ("module", "pkg.mod", ["a"])),
    ([PY, "-u", "train.py"], None),  # interpreter options: a plain start
    ([PY, "-m"], None),
    ([PY, "-m", "-x"], None),
    ([PY, "-c", "print(1)"], None),
    ([PY, "script"], None),  # not a .py file
    (["/bin/sh", "train.py"], None),  # not this interpreter
    ([PY], None),
    ([], None),
])
def test_python_target(cmd, want):
    assert python_target(cmd) == want


@pytest.mark.parametrize("src, more", [
    ("import torch\n", []),
    ("import lightning as L\n", ["lightning.pytorch"]),
    ("from lightning.pytorch import Trainer\n", ["lightning.pytorch"]),
    ("    import lightning.pytorch as pl\n", ["lightning.pytorch"]),
    ("import lightning_ft  # registers ft_hsdp\nimport torch\n", []),  # not Lightning
    ("# uses lightning one day\nx = 'import lightning'\n", []),
    ("import lightning_ft\nfrom lightning_ft.replica.manager import ReplicaManager\n",
     ["lightning_ft.replica.manager"]),
    ("import lightning\nfrom lightning_ft.replica.data import SlotStream\n",
     ["lightning.pytorch", "lightning_ft.replica.manager"]),
])
def test_default_preload_follows_what_the_script_imports(tmp_path, src, more):
    script = tmp_path / "train.py"
    script.write_text(src)
    assert default_preload(python_target([PY, str(script)])) == ["torch", "torch._dynamo", *more]


def test_default_preload_without_a_readable_script_is_torch():
    assert default_preload(python_target([PY, "-m", "x"])) == ["torch", "torch._dynamo"]
    assert default_preload(python_target([PY, "/nonexistent/train.py"])) == ["torch", "torch._dynamo"]


SIGNALS = ("SIGPIPE", "SIGINT", "SIGTERM", "SIGHUP", "SIGCHLD", "SIGUSR1")

PROG = "SIGNALS = " + repr(SIGNALS) + "\n" + textwrap.dedent("""
    import json, os, random, signal, sys, threading, time, atexit
    import torch
    out = os.environ["OUT"]
    a = torch.randn(256, 256)
    row = {"argv": sys.argv, "cwd": os.getcwd(), "x": os.environ.get("X"), "rand": random.random(),
           "threads": torch.get_num_threads(), "mm": float((a @ a).abs().sum()) > 0, "pid": os.getpid(),
           "ppid": os.getppid(), "pgid": os.getpgid(0), "sid": os.getsid(0), "name": __name__,
           "main_file": sys.modules["__main__"].__file__,
           "signals": {n: str(signal.getsignal(getattr(signal, n))) for n in SIGNALS}}
    with open(out, "w") as f:
        json.dump(row, f)
    action = os.environ.get("ACTION", "")
    if action == "raise":  # what the main thread's end sees, as in a fresh python (fabric/compat.py)
        threading._register_atexit(lambda: open(out + ".last", "w").write(repr(getattr(sys, "last_value", None))))
        raise ValueError("boom from the program")
    if action == "sleep":
        import subprocess
        gc = subprocess.Popen(["sleep", "1000"])
        with open(out + ".gc", "w") as f:
            f.write(str(gc.pid))
        time.sleep(1000)
    if action == "thread":  # a non-daemon thread and an atexit handler finish before the exit
        def late():
            time.sleep(0.3)
            with open(out + ".thread", "w") as f:
                f.write("done")
        threading.Thread(target=late).start()
        atexit.register(lambda: open(out + ".atexit", "w").write("ran"))
    print("stdout line", flush=False)
    sys.exit(int(os.environ.get("CODE", "0")))
""")


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    log = tmp_path_factory.mktemp("zygote") / "zygote.log"
    z = Zygote(["torch"], log_path=str(log))
    assert z.ready.wait(120), log.read_text()
    yield z
    z.close()


def _spawn(z: Zygote, tmp_path: Path, name: str, **env: str) -> tuple[ZygoteProc, Path, Path]:
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    out, log = tmp_path / f"{name}.json", tmp_path / f"{name}.log"
    with open(log, "wb") as f:
        p = z.spawn([PY, str(prog), "--flag", name], {**os.environ, "OUT": str(out), **env}, str(tmp_path),
                    f.fileno(), f.fileno())
    assert p is not None
    return p, out, log


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_forked_program_runs_as_a_fresh_python_would(zygote, tmp_path):
    import json

    p1, out1, log1 = _spawn(zygote, tmp_path, "a", X="1", CODE="3", OMP_NUM_THREADS="2")
    p2, out2, _ = _spawn(zygote, tmp_path, "b", X="2", OMP_NUM_THREADS="1")
    assert p1.wait(60) == 3 and p2.wait(60) == 0
    assert p1.returncode == 3 and p1.poll() == 3
    r1, r2 = json.loads(out1.read_text()), json.loads(out2.read_text())
    assert r1["argv"] == [str(tmp_path / "prog.py"), "--flag", "a"] and r1["cwd"] == str(tmp_path)
    assert (r1["x"], r2["x"]) == ("1", "2") and r1["name"] == "__main__"
    assert r1["main_file"] == str(tmp_path / "prog.py")
    assert (r1["threads"], r2["threads"]) == (2, 1) and r1["mm"]  # OpenMP works after the fork
    assert r1["rand"] != r2["rand"]  # reseeded: not the zygote's state
    assert r1["ppid"] == zygote.proc.pid and r1["pgid"] == r1["sid"] == r1["pid"]  # own session
    assert log1.read_text() == "stdout line\n"  # stdout flushed at exit, on the passed descriptor
    # the signal dispositions a fresh python starts with: SIGPIPE ignored (a write to a closed
    # socket raises BrokenPipeError; CI saw a forked rank killed by SIGPIPE instead), SIGINT raising
    # KeyboardInterrupt, the others default
    code = ("import json, signal; SIGNALS = " + repr(SIGNALS) +
            "; print(json.dumps({n: str(signal.getsignal(getattr(signal, n))) for n in SIGNALS}))")
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r1["signals"] == json.loads(fresh.stdout), (r1["signals"], fresh.stdout)


def test_an_uncaught_exception_exits_1_with_the_programs_traceback_only(zygote, tmp_path):
    p, out, log = _spawn(zygote, tmp_path, "raise", ACTION="raise")
    assert p.wait(60) == 1
    text = log.read_text()
    assert "ValueError: boom from the program" in text and 'prog.py", line' in text
    assert "zygote.py" not in text and "runpy" not in text
    assert Path(str(out) + ".last").read_text() == "ValueError('boom from the program')"  # sys.last_value


def test_threads_and_atexit_finish_before_the_exit(zygote, tmp_path):
    p, out, _ = _spawn(zygote, tmp_path, "thread", ACTION="thread")
    assert p.wait(60) == 0
    assert Path(str(out) + ".thread").read_text() == "done"
    assert Path(str(out) + ".atexit").read_text() == "ran"


def test_exit_is_reported_unreaped_so_the_group_can_still_be_killed_then_wait_reaps(zygote, tmp_path):
    p, out, _ = _spawn(zygote, tmp_path, "sleep", ACTION="sleep")
    gc_file = Path(str(out) + ".gc")
    deadline = time.monotonic() + 60
    while not gc_file.exists():
        assert time.monotonic() < deadline and p.poll() is None, "the program did not start its grandchild"
        time.sleep(0.05)
    grandchild = int(gc_file.read_text())
    os.kill(p.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while p.poll() is None:
        assert time.monotonic() < deadline, "the exit was not reported"
        time.sleep(0.01)
    assert p.poll() == -signal.SIGKILL and p.returncode is None  # reported, not reaped
    assert os.read(p.exit_fd(), 1) == b"x"  # what the supervisor sleeps on
    assert Path(f"/proc/{p.pid}").exists()  # the zombie holds the PID: killpg by it is safe
    os.killpg(p.pid, signal.SIGKILL)  # what the supervisor does to what is left of the group
    assert p.wait(5) == -signal.SIGKILL
    assert not Path(f"/proc/{p.pid}").exists()  # reaped by wait
    deadline = time.monotonic() + 5
    while _alive(grandchild):
        assert time.monotonic() < deadline, "the grandchild survived the group kill"
        time.sleep(0.02)
    os.close(p.exit_fd())


def test_wait_times_out_like_popen(zygote, tmp_path):
    p, out, _ = _spawn(zygote, tmp_path, "slow", ACTION="sleep")
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.2)
    os.killpg(p.pid, signal.SIGKILL)
    assert p.wait(10) == -signal.SIGKILL


def test_children_outlive_the_zygote_and_their_exit_is_still_noticed(tmp_path):
    z = Zygote(["json"], log_path=str(tmp_path / "z.log"))
    try:
        assert z.ready.wait(60)
        p, out, _ = _spawn(z, tmp_path, "orphan", ACTION="sleep")
        deadline = time.monotonic() + 60
        while not out.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        z.proc.kill()
        z.proc.wait(10)
        time.sleep(0.3)
        assert _alive(p.pid) and p.poll() is None  # like a Popen child of a dead launcher
        assert z.spawn([PY, "x.py"], dict(os.environ), str(tmp_path), 1, 2) is None  # gone: start it yourself
        os.killpg(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while p.poll() is None:
            assert time.monotonic() < deadline, "the orphan's exit was never noticed"
            time.sleep(0.02)
    finally:
        z.close()


def test_spawn_before_ready_returns_none(tmp_path):
    z = Zygote(["time"], log_path=str(tmp_path / "z.log"))
    try:
        assert z.ready.wait(60)
        z.ready.clear()  # as if its imports were still running
        assert z.spawn([PY, "x.py"], dict(os.environ), str(tmp_path), 1, 2) is None
    finally:
        z.close()
