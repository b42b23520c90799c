"""Fixtures of the replica tests with real processes (bench/localjob.py)."""
from __future__ import annotations

import pytest

from lightning_ft.bench.localjob import Job


@pytest.fixture
def job_factory(etcd_endpoint, tmp_path):
    jobs = []

    def make(**kw):
        j = Job(etcd_endpoint, tmp_path, **kw)
        jobs.append(j)
        return j

    yield make
    for j in jobs:
        j.close()
