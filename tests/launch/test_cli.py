"""`lightning-ft etcd` runs a usable etcd in the foreground and stops cleanly on SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from lightning_ft.coord.etcd_server import free_port
from lightning_ft.coord.store import EtcdStore
from tests.procs import alive, children


def test_lightning_ft_etcd_serves_and_stops_on_sigterm(procs):
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "lightning_ft.launch.cli", "etcd", "--port", str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(p)
    line = p.stdout.readline()
    assert f"etcd listening on 127.0.0.1:{port}" in line
    s = EtcdStore(f"127.0.0.1:{port}", connect_timeout_s=5)
    s.put("/x", b"1")
    assert s.get("/x").value == b"1"
    s.close()
    p.send_signal(signal.SIGTERM)
    assert p.wait(10) == 0
    t0 = time.monotonic()
    try:
        EtcdStore(f"127.0.0.1:{port}", connect_timeout_s=0.3, rpc_timeout_s=0.2)
        raise AssertionError("etcd still serving after SIGTERM")
    except Exception as e:
        assert "unreachable" in str(e)
    assert time.monotonic() - t0 < 3


def test_lightning_ft_etcd_without_binary_says_what_to_do(tmp_path):
    import os

    env = {**os.environ, "LFT_ETCD_BIN": str(tmp_path / "missing")}
    r = subprocess.run([sys.executable, "-m", "lightning_ft.launch.cli", "etcd", "--port", str(free_port())],
                       capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 1
    assert "LFT_ETCD_BIN" in r.stderr and "is not an executable file" in r.stderr


def test_embedded_etcd_dies_with_a_sigkilled_launcher(tmp_path):
    """The launcher itself is killed (no cleanup runs): its etcd must not be orphaned."""
    import signal
    import time

    from lightning_ft.bench.localjob import LOOP

    p = subprocess.Popen([sys.executable, "-m", "lightning_ft.launch.cli", "run", "--replicas", "1", "--run-dir",
                          str(tmp_path / "run"), "--no-status", LOOP, "--steps", "100000", "--step-sleep", "0.05"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    etcd = []
    try:
        deadline = time.monotonic() + 60
        while not etcd and time.monotonic() < deadline:
            etcd = [c for c in children(p.pid) if "etcd" in open(f"/proc/{c}/cmdline").read()]
            time.sleep(0.1)
        assert etcd, "the launcher started no etcd"
        replicas = [c for c in children(p.pid) if c not in etcd]
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        deadline = time.monotonic() + 5
        while alive(etcd[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(etcd[0])
    finally:
        p.kill()
        for c in etcd + children(p.pid):
            try:
                os.kill(c, signal.SIGKILL)
            except OSError:
                pass
    # the replica loses etcd and exits on its own (bounded retries); make sure it is gone
    for c in replicas:
        try:
            os.kill(c, signal.SIGKILL)
        except OSError:
            pass


def test_sigterm_to_the_launcher_stops_replicas_and_etcd(tmp_path):
    import signal
    import time

    from lightning_ft.bench.localjob import LOOP

    p = subprocess.Popen([sys.executable, "-m", "lightning_ft.launch.cli", "run", "--replicas", "2", "--run-dir",
                          str(tmp_path / "run"), "--no-status", LOOP, "--steps", "100000", "--step-sleep", "0.05"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kids = []
    try:
        deadline = time.monotonic() + 60
        while len(kids) < 3 and time.monotonic() < deadline:
            kids = children(p.pid)
            time.sleep(0.1)
        assert len(kids) >= 3, kids  # etcd + 2 replicas
        time.sleep(1.0)
        p.send_signal(signal.SIGTERM)
        p.wait(30)
        assert p.returncode != 0
        deadline = time.monotonic() + 5
        while any(alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [k for k in kids if alive(k)]
    finally:
        p.kill()
        for c in kids:
            try:
                os.kill(c, signal.SIGKILL)
            except OSError:
                pass
