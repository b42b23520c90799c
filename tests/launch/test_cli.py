"""`lightning-ft etcd` runs a usable etcd in the foreground and stops cleanly on SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from lightning_ft.coord.etcd_server import free_port
from lightning_ft.coord.etcd_store import EtcdStore
from tests.procs import alive, children, descendants, replica_pid


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
        replicas = [c for c in descendants(p.pid) if c not in etcd]  # the zygote's forks too
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        deadline = time.monotonic() + 5
        while alive(etcd[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(etcd[0])
    finally:
        p.kill()
        for c in etcd + descendants(p.pid):
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
        started = lambda: all(replica_pid(str(tmp_path / "run"), rid, 0) for rid in (0, 1))  # noqa: E731
        while not started() and time.monotonic() < deadline:
            time.sleep(0.1)
        kids = descendants(p.pid)  # etcd, the zygote and the replicas it forked (or started ones)
        assert started() and len(kids) >= 3, kids
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


def readline(stream, timeout_s: float = 30.0) -> str:
    """One line from a child's pipe, or AssertionError after `timeout_s`."""
    import select

    if not select.select([stream], [], [], timeout_s)[0]:
        raise AssertionError(f"no output within {timeout_s}s")
    return stream.readline()


def free_port_block(n: int) -> int:
    """A base port P with P..P+n-1 all free on loopback (for `lightning-ft etcd --members`)."""
    import socket

    for _ in range(50):
        base = free_port()
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError(f"no block of {n} free ports")


def etcd_children(pid: int) -> dict[str, int]:
    """The etcd processes started by `pid`, by member name."""
    out = {}
    for c in children(pid):
        try:
            argv = open(f"/proc/{c}/cmdline").read().split("\0")
        except OSError:
            continue
        if "--name" in argv:
            out[argv[argv.index("--name") + 1]] = c
    return out


def test_lightning_ft_etcd_creates_a_missing_data_dir_keeps_fsync_on_and_keeps_data(tmp_path, procs):
    port = free_port()
    data = tmp_path / "not" / "there"
    for run in range(2):
        p = subprocess.Popen([sys.executable, "-m", "lightning_ft.launch.cli", "etcd", "--port", str(port),
                              "--data-dir", str(data)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(p)
        lines = [readline(p.stdout) for _ in range(2 if run == 0 else 1)]
        if run == 0:
            assert f"created the data dir {data}" in lines[0]
        assert f"etcd listening on 127.0.0.1:{port} (1 member, data in {data}, fsync on)" in lines[-1]
        (pid,) = etcd_children(p.pid).values()
        assert "--unsafe-no-fsync" not in open(f"/proc/{pid}/cmdline").read().split("\0")
        s = EtcdStore(f"127.0.0.1:{port}", connect_timeout_s=5)
        if run == 0:
            s.put("/kept", b"1")
        else:
            assert s.get("/kept").value == b"1"  # the second server found the first one's data
        s.close()
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 0


def test_lightning_ft_etcd_members_3_restarts_a_killed_member(procs):
    port = free_port_block(6)
    p = subprocess.Popen([sys.executable, "-m", "lightning_ft.launch.cli", "etcd", "--members", "3", "--port",
                          str(port), "--unsafe-no-fsync"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(p)
    endpoints = f"127.0.0.1:{port},127.0.0.1:{port + 2},127.0.0.1:{port + 4}"
    line = readline(p.stdout)
    assert f"etcd listening on {endpoints} (3 members" in line and "fsync OFF" in line
    members = etcd_children(p.pid)
    assert sorted(members) == ["m0", "m1", "m2"]
    s = EtcdStore(endpoints, connect_timeout_s=5)
    try:
        os.kill(members["m1"], signal.SIGKILL)
        s.put("/while-m1-down", b"1")
        assert "member m1 exited (code -9); replaced it by an empty member, which rejoins" in readline(p.stderr)
        back = EtcdStore(f"127.0.0.1:{port + 2}", connect_timeout_s=10)
        try:
            assert back.get("/while-m1-down").value == b"1"
        finally:
            back.close()
    finally:
        s.close()
    p.send_signal(signal.SIGTERM)
    assert p.wait(15) == 0


def test_lightning_ft_etcd_serves_tls_and_checks_its_tls_flags(tmp_path, procs):
    from tests.coord.certs import CA

    ca = CA(str(tmp_path))
    server, client = ca.issue("etcd-server", server=True), ca.issue("client", server=False)
    etcd = [sys.executable, "-m", "lightning_ft.launch.cli", "etcd", "--unsafe-no-fsync"]
    r = subprocess.run(etcd + ["--cert-file", server.cert], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--cert-file and --key-file go together" in r.stderr
    port = free_port()
    p = subprocess.Popen(etcd + ["--port", str(port), "--cert-file", server.cert, "--key-file", server.key,
                                 "--client-ca-file", ca.path],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(p)
    assert f"etcd listening on https://127.0.0.1:{port} " in readline(p.stdout)
    s = EtcdStore(f"https://127.0.0.1:{port}", connect_timeout_s=5, ca_cert=ca.path, cert=client.cert, key=client.key)
    s.put("/tls", b"1")
    assert s.get("/tls").value == b"1"
    s.close()
    p.send_signal(signal.SIGTERM)
    assert p.wait(10) == 0
