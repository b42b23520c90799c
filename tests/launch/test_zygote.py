"""The zygote (launch/zygote.py): which commands it forks, and forked programs that behave as
if `python script.py` had started them: argv, environment, working directory, exit codes,
tracebacks, signals and process groups, torch threads, fresh random state; what an exec from the
launcher would inherit (signal dispositions and mask, limits, umask, nice, CPUs, sys.path), from a
terminal and under nohup, also after the launcher changed it; exits reported without reaping,
reaped on wait; its children survive the zygote."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightning_ft.launch import zygote_inherit
from lightning_ft.launch.zygote import Zygote, ZygoteProc, default_preload, python_target

PY = sys.executable
ROOT = Path(__file__).resolve().parents[2]


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
    ("import lightning_ft\nfrom lightning_ft.replica.replica import Replica\n",
     ["lightning_ft.replica.replica"]),
    ("import lightning\nfrom lightning_ft.replica.ledger import SlotStream\n",
     ["lightning.pytorch", "lightning_ft.replica.replica"]),
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


PROBE = textwrap.dedent("""
    import faulthandler, json, os, resource, signal, sys
    st = {k: v.strip() for k, _, v in (line.partition(":") for line in open("/proc/self/status"))}
    glibc = (1 << 31) | (1 << 32)  # its own signals 32 and 33: no program can set them
    row = {"signals": {signal.Signals(s).name if s in signal.Signals._value2member_map_ else str(int(s)):
                       str(signal.getsignal(s)) for s in signal.valid_signals() if s not in (9, 19)},
           "kernel": {k: int(st[k], 16) & ~glibc for k in ("SigIgn", "SigBlk", "SigCgt")},
           "umask": st["Umask"], "nice": os.getpriority(os.PRIO_PROCESS, 0),
           "cpus": sorted(os.sched_getaffinity(0)),
           "rlimits": {n: resource.getrlimit(getattr(resource, n)) for n in dir(resource) if n.startswith("RLIMIT_")},
           "cwd": os.getcwd(), "x": os.environ.get("X"), "path": sys.path, "argv": sys.argv,
           "own_session": os.getpgid(0) == os.getsid(0) == os.getpid(), "fds": sorted(os.listdir("/proc/self/fd")),
           "faulthandler": faulthandler.is_enabled()}
    with open(os.environ["OUT"], "w") as f:
        json.dump(row, f)
""")

LAUNCHER = textwrap.dedent("""
    import json, os, resource, signal, subprocess, sys
    from lightning_ft.launch.zygote import Zygote
    out_dir, preload = sys.argv[1], sys.argv[2:]
    z = Zygote(preload, log_path=os.path.join(out_dir, "zygote.log"))
    assert z.ready.wait(120), "the zygote did not start"

    def both(name, cmd):
        rows = []
        for how in ("forked", "fresh"):
            out = os.path.join(out_dir, name + "." + how + ".json")
            env = {**os.environ, "OUT": out}
            with open(out + ".log", "wb") as f:
                if how == "forked":
                    p = z.spawn(cmd, env, os.getcwd(), f.fileno(), f.fileno())
                    assert p is not None, "the zygote did not fork " + name
                else:  # as the supervisor starts a process without the zygote (launch/processes.py)
                    p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
                assert p.wait(60) == 0, (name, how, open(out + ".log").read())
            rows.append(json.load(open(out)))
        return rows

    probe = os.path.join(out_dir, "probe.py")
    result = {"as started": both("started", [sys.executable, probe])}
    # the launcher changes what an exec inherits after the zygote started
    os.environ["X"] = "changed"
    os.chdir(out_dir)
    os.umask(0o027)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024) - 7, hard))
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + 2)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # ignored: stays ignored across exec
    signal.signal(signal.SIGHUP, lambda *_: None)  # handled (as lightning-ft run does): default after exec
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cpus[-1:])
    result["changed"] = both("changed", [sys.executable, probe])
    result["module"] = both("module", [sys.executable, "-m", "probe"])  # found in the working directory
    result["launcher"] = {"nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
                          "nice": os.getpriority(os.PRIO_PROCESS, 0), "cpus": cpus[-1:], "cwd": os.getcwd()}
    z.close()
    print(json.dumps(result))
""")


@pytest.mark.parametrize("start", ["terminal", "nohup"])
def test_a_forked_program_inherits_what_a_fresh_exec_from_the_launcher_would(tmp_path, start):
    """The launcher (with the zygote it starts) runs as from a terminal (SIGINT and SIGHUP default)
    or in the background under nohup (both ignored), whatever the test suite itself runs under.
    Its forked programs and its fresh ones see the same signal dispositions and mask, limits,
    umask, nice value, CPUs, environment, working directory and sys.path: as started, and after
    the launcher changed them."""
    import json

    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    start_dir = tmp_path / "start"  # the zygote's own working directory: not the programs'
    start_dir.mkdir()
    disposition = signal.SIG_IGN if start == "nohup" else signal.SIG_DFL

    def as_started() -> None:
        for s in (signal.SIGINT, signal.SIGHUP):
            signal.signal(s, disposition)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("X", None)
    run = subprocess.run([PY, str(tmp_path / "launcher.py"), str(tmp_path), "torch"], cwd=start_dir, env=env,
                         preexec_fn=as_started, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr + (tmp_path / "zygote.log").read_text()
    result = json.loads(run.stdout.splitlines()[-1])
    for when in ("as started", "changed", "module"):
        forked, fresh = result[when]
        for key in fresh:
            assert forked[key] == fresh[key], (when, key, forked[key], fresh[key])
    started, changed, module = (result[w][1] for w in ("as started", "changed", "module"))
    # what was compared is what the start and the changes made it
    want_int = "1" if start == "nohup" else "<built-in function default_int_handler>"
    assert (started["signals"]["SIGINT"], started["signals"]["SIGHUP"]) == (want_int, "1" if start == "nohup" else "0")
    assert started["signals"]["SIGPIPE"] == started["signals"]["SIGXFSZ"] == "1"
    assert started["x"] is None and started["cwd"] == str(start_dir) and started["path"][0] == str(tmp_path)
    assert started["own_session"] and started["fds"] == ["0", "1", "2", "3"]
    assert (changed["signals"]["SIGINT"], changed["signals"]["SIGHUP"]) == (want_int, "0")
    assert changed["signals"]["SIGUSR1"] == "1" and changed["signals"]["SIGTERM"] == "0"
    assert changed["kernel"]["SigBlk"] == 1 << (signal.SIGUSR2 - 1)
    assert changed["umask"] == "0027" and changed["x"] == "changed" and changed["cwd"] == str(tmp_path)
    launcher = result["launcher"]
    assert changed["rlimits"]["RLIMIT_NOFILE"] == launcher["nofile"] != started["rlimits"]["RLIMIT_NOFILE"]
    assert changed["rlimits"]["RLIMIT_CORE"][0] == 0
    assert changed["nice"] == launcher["nice"] and changed["cpus"] == launcher["cpus"]
    assert module["path"][0] == str(tmp_path) and module["argv"] == [str(tmp_path / "probe.py")]


@pytest.mark.parametrize("zygote_env, env, want", [
    ({"PATH": "/bin"}, {"PATH": "/usr/bin", "X": "1"}, []),  # read when used: the child has the new ones
    ({"PYTHONPATH": "/a"}, {"PYTHONPATH": "/b"}, ["PYTHONPATH"]),
    ({}, {"PYTHONHASHSEED": "0", "LC_ALL": "C"}, ["LC_ALL", "PYTHONHASHSEED"]),
    ({"LANG": "C.UTF-8", "PYTHONSAFEPATH": "1"}, {"LANG": "C.UTF-8"}, ["PYTHONSAFEPATH"]),
    ({}, {"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", "PYTHONBREAKPOINT": "0"}, []),  # reproduced
])
def test_start_env_differs_names_what_only_the_interpreters_start_reads(zygote_env, env, want):
    assert zygote_inherit.start_env_differs(zygote_env, env) == want


def _children(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()


def test_what_a_fork_cannot_take_on_is_started_afresh_by_the_caller(tmp_path, monkeypatch, caplog):
    import logging

    z = Zygote(["json"], log_path=str(tmp_path / "z.log"))
    try:
        assert z.ready.wait(60)
        (tmp_path / "prog.py").write_text("import sys; sys.exit(5)\n")
        cmd = [PY, str(tmp_path / "prog.py")]
        with caplog.at_level(logging.WARNING):
            # an interpreter-start variable that differs: the zygote does not fork
            assert z.spawn(cmd, {**os.environ, "PYTHONHASHSEED": "7"}, str(tmp_path), 1, 2) is None
            # a state the child cannot set (a soft limit above the hard one): the child leaves, reaped
            real = zygote_inherit.capture()
            bad = {**real, "rlimits": {**real["rlimits"], "RLIMIT_NOFILE": [64, 32]}}
            monkeypatch.setattr(zygote_inherit, "capture", lambda: bad)
            assert z.spawn(cmd, dict(os.environ), str(tmp_path), 1, 2) is None
        assert "PYTHONHASHSEED differently from the zygote's" in caplog.text
        assert "cannot set RLIMIT_NOFILE to the launcher's (64, 32)" in caplog.text
        assert _children(z.proc.pid) == []  # no child left, not even a zombie
        monkeypatch.undo()
        p = z.spawn(cmd, dict(os.environ), str(tmp_path), 1, 2)  # the zygote still forks
        assert p is not None and p.wait(60) == 5
    finally:
        z.close()


def test_a_program_forked_after_its_spawn_gave_up_is_killed_and_reaped(tmp_path, monkeypatch):
    import lightning_ft.launch.zygote as zygote_mod

    z = Zygote(["json"], log_path=str(tmp_path / "z.log"))
    try:
        assert z.ready.wait(60)
        done = tmp_path / "ran"
        (tmp_path / "prog.py").write_text(f"import time; time.sleep(1); open({str(done)!r}, 'w').write('x')\n")
        monkeypatch.setattr(zygote_mod, "SPAWN_TIMEOUT_S", 0.0)  # the caller gives up before the answer
        assert z.spawn([PY, str(tmp_path / "prog.py")], dict(os.environ), str(tmp_path), 1, 2) is None
        time.sleep(2.0)  # the late answer came; the program would have finished by now
        assert not done.exists()  # it did not run on beside the caller's fresh start
        assert _children(z.proc.pid) == []  # killed and reaped (a zombie would be listed)
    finally:
        z.close()
