"""Shared fixtures: a real etcd server per test module, and process cleanup by PID."""
from __future__ import annotations

import os
import signal

import pytest

from lightning_ft.coord.etcd_server import EtcdServer


@pytest.fixture(scope="module")
def etcd_server():
    srv = EtcdServer().start()
    yield srv
    srv.cleanup()


@pytest.fixture
def etcd_endpoint(etcd_server) -> str:
    return etcd_server.endpoint


@pytest.fixture
def procs():
    """A list to append subprocess.Popen objects to; every one is SIGKILLed (and SIGCONTed
    first, in case a test stopped it) at teardown."""
    started: list = []
    yield started
    for p in started:
        if p.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass
            try:
                p.wait(5)
            except Exception:
                pass
