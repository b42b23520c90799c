"""`lightning-ft etcd` runs a usable etcd in the foreground and stops cleanly on SIGTERM."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

from lightning_ft.coord.etcd_server import free_port
from lightning_ft.coord.store import EtcdStore


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
