"""Fixtures of the replica tests with real processes (bench/localjob.py)."""
from __future__ import annotations

import sys

import pytest

from lightning_ft.bench.localjob import LOOP, Job
from lightning_ft.launch.zygote import Zygote, default_preload, python_target


@pytest.fixture(scope="session")
def plain_loop_zygote(tmp_path_factory):
    """One zygote for the session (launch/zygote.py), as `lightning-ft run` starts one per job:
    the replicas of `job_factory` jobs are forked from it instead of importing torch each (a
    test restarts one cold with `start(..., forked=False)`); None if it is not ready in time."""
    z = Zygote(default_preload(python_target([sys.executable, LOOP])),
               log_path=str(tmp_path_factory.mktemp("zygote") / "zygote.log"))
    yield z if z.ready.wait(120) else None
    z.close()


@pytest.fixture
def job_factory(etcd_endpoint, tmp_path, plain_loop_zygote):
    jobs = []

    def make(**kw):
        j = Job(etcd_endpoint, tmp_path, zygote=plain_loop_zygote, **kw)
        jobs.append(j)
        return j

    yield make
    for j in jobs:
        j.close()
