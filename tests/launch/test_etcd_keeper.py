"""Training under `lightning-ft run` while etcd fails (issue 18 §3):

- the leader member of an embedded 3-member etcd is SIGKILLed mid-training: not one step is
  lost, no replica restarts, and the launcher restarts the member, which rejoins;
- an external `lightning-ft etcd --data-dir D` is SIGKILLed and restarted 4 s later on the
  same data (shorter than etcd.connect_timeout_s): training pauses and resumes, no replica
  exits or is dropped from the quorum, and the ledger is exact;
- etcd stays away longer than connect_timeout_s: the replicas exit with a clear StoreError,
  the launcher stops the job with an error naming the newest checkpoint, which verifies.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from itertools import pairwise

from lightning_ft.bench.localjob import LOOP
from lightning_ft.coord.etcd_server import EtcdServer, free_port
from lightning_ft.coord.quorum import MAX_STEADY_STEPS
from lightning_ft.coord.etcd_store import EtcdStore
from lightning_ft.constants import ExitCode
from lightning_ft.replica.checkpoint import newest_valid, verify
from lightning_ft.replica.ledger import read_cursors, verify_ledger
from tests.launch.test_cli import etcd_children, readline
from tests.procs import alive, descendants
from tests.strategy.runs import run_root

# TTL 3 s (the default): a 1 s TTL can lapse on a loaded machine at start-up, which is not what these test.
LOOP_ARGS = ["--dim", "16", "--hidden", "32", "--batch", "8", "--ttl", "3", "--init-timeout", "30"]


class Launcher:
    """`lightning-ft run ...` in the background; its stdout and stderr collected by threads."""

    def __init__(self, procs: list, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "lightning_ft.launch.cli", "run", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(self.proc)
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, k=sink: k.extend(iter(s.readline, "")), daemon=True).start()

    def wait_for_line(self, text: str, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.out + self.err:
                if text in line:
                    return line
            assert self.proc.poll() is None, self.tail()
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} within {timeout_s}s:\n{self.tail()}")

    def wait(self, timeout_s: float) -> int:
        rc = self.proc.wait(timeout_s)
        time.sleep(0.2)  # let the reader threads drain the pipes
        return rc

    def tail(self) -> str:
        return "".join(self.out)[-2000:] + "".join(self.err)[-3000:]

    def stop(self) -> None:
        """If it still runs: SIGTERM (it stops its replicas and etcd), then SIGKILL what is left, by PID."""
        if self.proc.poll() is not None:
            return
        kids = descendants(self.proc.pid)  # the zygote's forks too
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        for pid in kids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def rows(run_dir, rid: int, inc: int = 0) -> list[dict]:
    path = os.path.join(run_dir, "logs", f"r{rid}.i{inc}.rank0.log")
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.startswith("{")]


def wait_for_step(run_dir, step: int, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(r.get("event") in ("step", "batch") and r["step"] >= step for r in rows(run_dir, 0)):
            return
        time.sleep(0.1)
    raise AssertionError(f"replica 0 never reached step {step}")


def assert_no_step_lost(run_dir, steps: int, replicas: int = 2) -> list[list[dict]]:
    """Every replica committed steps 0..steps-1 once each, each on its own slot's batch of that
    step, with every replica in every quorum, never restarted, and ended identical."""
    events = [json.loads(line) for line in open(os.path.join(run_dir, "events.jsonl"))]
    assert [e for e in events if e["event"] in ("evict", "restart", "hang")] == []
    out, finals = [], []
    for rid in range(replicas):
        assert not os.path.exists(os.path.join(run_dir, "logs", f"r{rid}.i1.rank0.log"))
        rs = rows(run_dir, rid)
        committed = [r for r in rs if r["event"] == "step"]
        assert [r["step"] for r in committed] == list(range(steps))
        assert all(r["batch"] == r["step"] and r["members"] == list(range(replicas)) for r in committed)
        finals.append([r for r in rs if r["event"] == "final"][0]["digest"])
        out.append(committed)
    assert all(f == finals[0] for f in finals)
    return out


def member_url(pid: int, path: str) -> str:
    argv = open(f"/proc/{pid}/cmdline").read().split("\0")
    return argv[argv.index("--listen-metrics-urls") + 1] + path


def get(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.read().decode()
    except OSError:
        return ""


def test_sigkilled_etcd_leader_member_loses_no_step_and_rejoins(tmp_path, procs):
    run_dir, steps, job = tmp_path / "run", 120, "lead" + uuid.uuid4().hex[:6]
    run = Launcher(procs, "--replicas", "2", "--etcd-members", "3", "--run-dir", str(run_dir), "--no-status",
                   "--timeout", "200", LOOP, *LOOP_ARGS, "--steps", str(steps), "--step-sleep", "0.05", f"job={job}")
    try:
        job_line = run.wait_for_line("(embedded, 3 members)")
        endpoints = job_line.split("etcd ", 1)[1].split(" ")[0].split(",")
        assert len(endpoints) == 3
        wait_for_step(run_dir, 30)
        members = etcd_children(run.proc.pid)
        leader = [name for name, pid in members.items()
                  if "\netcd_server_is_leader 1" in get(member_url(pid, "/metrics"))]
        assert len(leader) == 1, members
        url = member_url(members[leader[0]], "/health")
        os.kill(members[leader[0]], signal.SIGKILL)
        run.wait_for_line(f"etcd member {leader[0]} exited (code -9); replaced it by an empty member")
        deadline = time.monotonic() + 30
        while '"health":"true"' not in get(url):
            assert time.monotonic() < deadline, "the restarted member never became healthy"
            time.sleep(0.1)
        back = EtcdStore(endpoints[int(leader[0][1:])], connect_timeout_s=10)
        try:  # linearizable reads served by the rejoined member: it follows the job's progress
            root = run_root(back, job)
            first = json.loads(back.get(f"{root}members/0").value)["step"]
            deadline = time.monotonic() + 20
            while json.loads(back.get(f"{root}members/0").value)["step"] <= first:
                assert time.monotonic() < deadline, "no progress seen through the rejoined member"
                time.sleep(0.2)
        finally:
            back.close()
        assert run.wait(150) == 0, run.tail()
    finally:
        run.stop()
    assert_no_step_lost(run_dir, steps)


def test_short_etcd_outage_pauses_training_which_resumes_with_nothing_lost(tmp_path, procs):
    port, data = free_port(), tmp_path / "etcd-data"
    etcd_cmd = [sys.executable, "-m", "lightning_ft.launch.cli", "etcd", "--port", str(port), "--data-dir", str(data)]

    def start_etcd() -> subprocess.Popen:
        p = subprocess.Popen(etcd_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(p)
        while "etcd listening" not in readline(p.stdout):
            pass
        return p

    etcd = start_etcd()
    run_dir, steps, job = tmp_path / "run", 100, "out" + uuid.uuid4().hex[:6]
    run = Launcher(procs, "--replicas", "2", "--etcd", f"127.0.0.1:{port}", "--run-dir", str(run_dir),
                   "--no-status", "--timeout", "200", LOOP, *LOOP_ARGS, "--steps", str(steps), "--step-sleep",
                   "0.05", f"job={job}", "etcd.connect_timeout_s=10")
    try:
        wait_for_step(run_dir, 25)
        (server_pid,) = etcd_children(etcd.pid).values()
        etcd.send_signal(signal.SIGKILL)  # the measured failure: its etcd dies with it
        etcd.wait(10)
        deadline = time.monotonic() + 10
        while alive(server_pid):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        down_at = time.time()
        time.sleep(4.0)  # longer than the lease TTL (3 s), shorter than connect_timeout_s
        etcd = start_etcd()
        up_at = time.time()
        assert run.wait(150) == 0, run.tail()
        committed = assert_no_step_lost(run_dir, steps)
        for rs in committed:
            # Steady rounds go on without etcd, at most MAX_STEADY_STEPS; then training waits
            # for etcd (a gap as long as the rest of the outage) ...
            during = [r for r in rs if down_at < r["t"] < up_at]
            assert len(during) <= MAX_STEADY_STEPS + 1, len(during)
            gaps = [(b["t"] - a["t"], a["step"]) for a, b in pairwise(rs)]
            paused, at = max(gaps)
            if not during:
                assert paused > 3.5, gaps
            else:
                assert paused > up_at - max(r["t"] for r in during) - 0.5, (gaps, during[-1])
            assert any(r["t"] > up_at for r in rs) and any(r["t"] < down_at for r in rs)  # ... and went on
        store = EtcdStore(f"127.0.0.1:{port}")
        try:
            root = run_root(store, job)
            rep = verify_ledger(store, root, read_cursors(store, root, range(2)))
            assert rep.ok and rep.steps == steps, (rep.duplicates, rep.gaps, rep.conflicts)
        finally:
            store.close()
    finally:
        run.stop()
        if etcd.poll() is None:
            etcd.send_signal(signal.SIGTERM)
            etcd.wait(15)


def test_long_etcd_outage_stops_the_job_with_a_clear_error_and_the_checkpoint_intact(tmp_path, procs):
    from tests.strategy.runs import SCRIPT

    srv = EtcdServer(data_dir=str(tmp_path / "etcd")).start()
    run_dir, job = tmp_path / "run", "long" + uuid.uuid4().hex[:6]
    run = Launcher(procs, "--replicas", "2", "--etcd", srv.endpoint, "--run-dir", str(run_dir), "--no-status",
                   "--timeout", "200", SCRIPT, "--steps", "100000", "--step-sleep", "0.05", f"job={job}",
                   "checkpoint.every_n_steps=5", "etcd.connect_timeout_s=3",
                   "quorum.init_timeout_s=60")
    try:
        ckpts = str(run_dir / "checkpoints")
        deadline = time.monotonic() + 120
        while not (os.path.isdir(ckpts) and (newest_valid(ckpts, warn=lambda m: None) or (0,))[0] >= 10):
            assert time.monotonic() < deadline and run.proc.poll() is None, run.tail()
            time.sleep(0.2)
        srv.kill()
        t0 = time.monotonic()
        rc = run.wait(90)
        stopped_after = time.monotonic() - t0
    finally:
        run.stop()
    err = "".join(run.err)
    assert rc == ExitCode.ETCD_LOST, run.tail()
    assert 3.0 < stopped_after < 60, stopped_after
    assert f"etcd at {srv.endpoint} has been unreachable for" in err and "etcd.connect_timeout_s=3" in err
    line = [l for l in err.splitlines() if "stopped the job" in l][0]
    step = int(line.split("(step ")[1].split(")")[0])
    assert f"resume with `lightning-ft run --resume {run_dir}" in line
    logs = "".join(open(os.path.join(run_dir, "logs", f"r{rid}.i0.rank0.log")).read() for rid in (0, 1))
    assert "StoreError" in logs and "no etcd member answered for 3.0s" in logs
    # The checkpoint the error names is intact, and etcd (back on its data) still points at it.
    found = newest_valid(ckpts, warn=lambda m: None)
    assert found is not None and found[0] == step >= 10
    verify(found[1])
    srv.start()
    try:
        store = EtcdStore(srv.endpoint)
        try:
            latest = json.loads(store.get(f"{run_root(store, job)}ckpt/latest").value)
            assert latest["step"] <= step and os.path.isdir(latest["path"])
        finally:
            store.close()
    finally:
        srv.cleanup()
