"""The soak at small size (`make soak` runs 100+ faults): mixed, overlapping faults at random
moments, including a whole-job kill with `--resume` and an etcd leader kill; nothing lost,
nothing trained twice, identical replicas, no stall."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lightning_ft.bench import netns


@pytest.mark.timeout(900)
def test_ten_mixed_faults_lose_nothing_and_end_identical():
    cmd = [sys.executable, "-m", "lightning_ft.bench.soak", "--faults", "10", "--every-s", "3", "--overlap", "0.3",
           "--seed", "4", "--steps", "700", "--ckpt-every", "20", "--timeout", "800"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=880)
    lines = [json.loads(l) for l in p.stdout.splitlines() if l.startswith('{"bench": "soak"')]
    assert lines, p.stdout[-3000:] + p.stderr[-6000:]
    r = lines[-1]
    assert r["faults"] >= 10 and r["overlapping"] >= 1, (r, p.stderr[-4000:])
    assert r["lost_batches"] == 0 and r["duplicate_batches"] == 0 and r["conflicts"] == 0, (r, p.stderr[-4000:])
    assert r["identical"] and r["hangs"] == 0 and r["launcher_rc"] == 0, (r, p.stderr[-4000:])
    assert r["at_end"] >= 2, r  # a majority trained to the end (a late restart may find the job done)
    assert r["steps"] == 700, r  # the ledger of the job's run holds every step of the final history
    if netns.skip_reason() is None:
        assert r["by_kind"].get("link", 0) >= 1, r  # a replica's network link was cut
    assert p.returncode == 0, p.stderr[-3000:]
