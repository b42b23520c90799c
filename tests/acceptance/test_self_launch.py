"""Acceptance: `python app.py`, an unmodified Lightning program with strategy="ft_hsdp" and no
launcher, launches its own job (lightning_ft/strategy/self_launch.py). The process the user
started supervises and never trains; a replica SIGKILLed at a random moment is restarted and
the job ends with identical replicas and an exact ledger; the exit code is the job's; Ctrl-C
stops every process it started."""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid

from lightning_ft.launch.environment import LAUNCHER_VARIABLES
from tests.acceptance.faults import _pids, _steps
from tests.acceptance.test_lightning_demos import assert_consistent
from tests.strategy.runs import collect, ok

APP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "self_launch_app.py")


def _user_env(**extra: str) -> dict[str, str]:
    """A shell's environment: no launcher variables (PYTHONPATH stays)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("LFT_")}
    return {**env, **extra}


def _start(tmp_path, name: str, args: list[str], **env: str) -> tuple[subprocess.Popen, str]:
    out = str(tmp_path / f"{name}.out")
    with open(out, "w") as log:
        proc = subprocess.Popen([sys.executable, APP, *args], cwd=tmp_path, env=_user_env(**env), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, out


def _wait(proc: subprocess.Popen, timeout_s: float) -> int:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        raise


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _collect(proc: subprocess.Popen, out: str, run_dir: str, job: str, etcd_endpoint: str, replicas: int):
    """(the launcher's output, the run read back) once the job ended."""
    text = open(out).read()
    proc.stdout, proc.stderr = text, ""
    return text, collect(run_dir, job, etcd_endpoint, replicas, proc)


def _overrides(etcd_endpoint: str, job: str, run_dir: str) -> list[str]:
    return [f"etcd.endpoint={etcd_endpoint}", f"job={job}", f"run_dir={run_dir}", "etcd.lease_ttl_s=1",
            "failure.restart_delay_s=0.2", "quorum.init_timeout_s=60"]


def _trainers(run_dir: str) -> list[dict]:
    """The harness's line of every process that trained (tests/acceptance/self_launch_app.py)."""
    rows = []
    logs = os.path.join(run_dir, "logs")
    for name in sorted(os.listdir(logs)):
        rows += [json.loads(l) for l in open(os.path.join(logs, name), errors="replace")
                 if l.startswith('{"event": "trains"')]
    return rows


def test_python_app_py_launches_its_job_which_survives_a_random_kill(tmp_path, etcd_endpoint):
    rng = random.Random(11)
    steps, replicas, devices = 60, 2, 2
    job = "self" + uuid.uuid4().hex[:8]
    run_dir = str(tmp_path / job)
    proc, out = _start(tmp_path, job, ["code", str(steps), str(devices), str(replicas),
                                       *_overrides(etcd_endpoint, job, run_dir)])
    fault = "no kill"
    try:
        deadline = time.monotonic() + 180
        while (time.monotonic() < deadline and proc.poll() is None
               and min(_steps(run_dir, r) for r in range(replicas)) < 3):
            time.sleep(0.05)
        delay = rng.uniform(0.2, 2.0)
        until = time.monotonic() + delay
        while time.monotonic() < until and max(_steps(run_dir, r) for r in range(replicas)) < steps // 2:
            time.sleep(0.02)
        rid = rng.randrange(replicas)
        pid = rng.choice(_pids(run_dir)[rid])
        fault = f"SIGKILL replica {rid} pid {pid} near step {_steps(run_dir, rid)} (delay {delay:.2f}s)"
        os.kill(pid, signal.SIGKILL)
        _wait(proc, 240)
    finally:
        _stop(proc)
    text, run = _collect(proc, out, run_dir, job, etcd_endpoint, replicas)
    assert_consistent(run, steps, replicas, fault)  # rc 0, final step, identical digests, exact ledger
    assert [e["replica"] for e in run.events if e["event"] == "restart"] == [rid], (fault, ok(run))
    # The process the user started printed where the job runs, supervised, and never trained:
    assert (f"launches the job: {replicas} replicas x {devices} processes of self_launch_app.py under "
            f"`lightning-ft run`, run dir {run_dir}") in text, text[-3000:]
    assert '"event": "trains"' not in text
    trainers = _trainers(run_dir)
    launched = {p for e in run.events if e["event"] in ("start", "restart") for p in e["pids"]}
    assert {t["pid"] for t in trainers} == launched and proc.pid not in launched, (trainers, proc.pid)
    # its children, or the zygote's (a child of it that only forks replicas), never itself forked into training
    parent = {p: e.get("zygote_pid", proc.pid) for e in run.events if e["event"] in ("start", "restart")
              for p in e["pids"]}
    assert proc.pid not in {e.get("zygote_pid") for e in run.events}, run.events
    assert {t["pid"]: t["ppid"] for t in trainers} == parent, (trainers, run.events)
    assert len(trainers) == replicas * devices + devices  # both ranks of the killed replica trained again
    # The status lines show what was committed, and the exit code is the job's.
    for r in range(replicas):
        assert re.search(rf"^replica {r}: done, incarnation {1 if r == rid else 0}, restarts {1 if r == rid else 0}, "
                         rf"step {steps}$", text, re.M), text[-3000:]
    assert "lightning-ft run: exit code 0;" in text


def test_the_exit_code_is_the_jobs_when_every_replica_fails(tmp_path, etcd_endpoint):
    job = "selffail" + uuid.uuid4().hex[:6]
    run_dir = str(tmp_path / job)
    proc, out = _start(tmp_path, job, ["raise", "20", "1", "2", *_overrides(etcd_endpoint, job, run_dir),
                                       "supervisor.crash_loop=1"])
    rc = _wait(proc, 180)
    text = open(out).read()
    assert rc == 1, text[-3000:]  # EXIT_GAVE_UP: every replica was given up on
    assert "lightning-ft run: exit code 1;" in text
    assert re.search(r"^replica 0: failed", text, re.M) and re.search(r"^replica 1: failed", text, re.M), text[-3000:]
    logs = "".join(open(os.path.join(run_dir, "logs", n), errors="replace").read()
                   for n in os.listdir(os.path.join(run_dir, "logs")))
    assert logs.count("RuntimeError: this program fails in every replica") >= 2
    assert "this program fails in every replica" not in text.split("launches the job:")[0]  # not in the user's process


def _descendants(root: int) -> dict[int, str]:
    """pid -> start time (field 22 of /proc/PID/stat) of every live descendant of `root`."""
    parent, start = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = open(f"/proc/{d}/stat").read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        parent[int(d)], start[int(d)] = int(fields[1]), fields[19]
    out, todo = {}, [root]
    while todo:
        p = todo.pop()
        for child, pp in parent.items():
            if pp == p and child not in out:
                out[child] = start[child]
                todo.append(child)
    return out


def _alive(pid: int, started: str) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[19] == started and fields[0] != "Z"


def test_ctrl_c_stops_the_job_and_every_process_it_started(tmp_path):
    run_dir = str(tmp_path / "run")
    cfg = tmp_path / "job.yaml"  # Trainer(strategy="ft_hsdp"): the job config comes from $LFT_CONFIG
    cfg.write_text(f"replicas: 2\nrun_dir: {run_dir}\netcd:\n  lease_ttl_s: 1\n")
    proc, out = _start(tmp_path, "ctrlc", ["string", "100000", "1"], LFT_CONFIG=str(cfg))
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None and min(_steps(run_dir, r) for r in (0, 1)) < 2:
            time.sleep(0.1)
        assert proc.poll() is None, open(out).read()[-3000:]
        tree = _descendants(proc.pid)
        replicas = {p for pids in _pids(run_dir).values() for p in pids}
        assert replicas and replicas < set(tree), (replicas, tree)  # and the embedded etcd
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in its terminal does
        rc = _wait(proc, 30)
        bound = time.monotonic() + 10
        while time.monotonic() < bound and any(_alive(p, s) for p, s in tree.items()):
            time.sleep(0.1)
        left = [p for p, s in tree.items() if _alive(p, s)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    text = open(out).read()
    assert rc == 128 + signal.SIGINT, text[-3000:]
    assert not left, f"still running after Ctrl-C: {left}"
    assert "launches the job: 2 replicas x 1 processes" in text and "(embedded)" in text
    assert "lightning-ft run: exit code 130;" in text, text[-3000:]


def test_python_app_py_with_a_warm_spare_of_two_ranks_heals_a_kill_from_it(tmp_path, etcd_endpoint):
    """`FTHSDPStrategy(overrides=["supervisor.standby=1"])` under self-launch: the job keeps a
    spare of W=2 processes; a replica SIGKILLed once the spare is registered becomes the spare's
    (both ranks promoted together), and the job ends identical and exactly once."""
    from lightning_ft.coord import keys
    from lightning_ft.coord.etcd_store import EtcdStore
    from tests.strategy.runs import run_root

    steps, replicas, devices = 80, 2, 2
    job = "selfsb" + uuid.uuid4().hex[:6]
    run_dir = str(tmp_path / job)
    proc, out = _start(tmp_path, job, ["code", str(steps), str(devices), str(replicas), "supervisor.standby=1",
                                       *_overrides(etcd_endpoint, job, run_dir)])
    store = EtcdStore(etcd_endpoint)
    try:
        deadline = time.monotonic() + 240
        spares: list = []
        while time.monotonic() < deadline and proc.poll() is None and not spares:
            try:
                spares = store.get_prefix(keys.standby(run_root(store, job)))[0]
            except AssertionError:  # no run recorded yet
                pass
            time.sleep(0.1)
        assert spares, f"no spare registered; {open(out).read()[-2000:]}"
        assert max(_steps(run_dir, r) for r in range(replicas)) < steps, "the job ended before the kill"
        pid = _pids(run_dir)[1][1]  # rank 1 of replica 1: the whole replica is replaced
        os.kill(pid, signal.SIGKILL)
        _wait(proc, 240)
    finally:
        store.close()
        _stop(proc)
    _, run = _collect(proc, out, run_dir, job, etcd_endpoint, replicas)
    assert_consistent(run, steps, replicas, f"SIGKILL replica 1 rank 1 pid {pid}")
    (restart,) = [e for e in run.events if e["event"] == "restart"]
    assert restart["replica"] == 1 and restart.get("standby"), (restart, ok(run))
    assert len(restart["pids"]) == devices
    (bd,) = [e for e in run.events if e["event"] == "restart_breakdown"]
    assert bd["standby"] is True and bd["total_s"] < 10, bd
