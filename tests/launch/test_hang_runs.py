"""Hang diagnosis end to end (coord/hang.py, launch/stacks.py): three replicas of the plain loop
under the real Supervisor; replica 1's leader is SIGSTOPped a few ms into a step's exchange (inside
its FTAR all-reduce). Within TTL + 2 s the supervisor's `hang` event names replica 1 rank 0, the
FTAR link waiting on it with its direction (from the others' stall reports), and carries the
stopped process's Python stack, read from outside while it is stopped."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid

import pytest

from lightning_ft.bench.localjob import LOOP
from lightning_ft.launch.supervisor import Supervisor

TTL_S = 2.0


def rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


@pytest.mark.timeout(180)
def test_a_rank_stopped_inside_ftar_is_named_with_link_and_stack_within_ttl_plus_2s(etcd_endpoint, tmp_path):
    job = "h" + uuid.uuid4().hex[:8]
    cmd = [sys.executable, LOOP, "--dim", "16", "--hidden", "32", "--batch", "8", "--steps", "2000",
           "--step-sleep", "0.02", "--ttl", str(TTL_S), "--ftar-timeout", "5", "--init-timeout", "30",
           "--stop-in-exchange", "1@30", "--set", "hang.report_after_s=0.5"]
    sup = Supervisor(cmd, replicas=3, nproc_per_replica=1, job=job, etcd=etcd_endpoint,
                     secret="hang-test-secret-0123456789", run_dir=str(tmp_path), restart_delay_s=0.5,
                     max_restarts=2)
    log1 = str(tmp_path / "logs" / "r1.i0.rank0.log")
    stopped_pid = None

    def diagnosed() -> list[dict]:
        return [e for e in rows(str(tmp_path / "events.jsonl")) if e.get("event") == "hang" and e.get("diagnosis")]

    try:
        sup.start()
        sup.run(until=lambda: bool(diagnosed()), timeout_s=120)
        stopping = [r for r in rows(log1) if r.get("event") == "stopping"]
        assert stopping, "replica 1 never reached step 30's exchange"
        stopped_pid = stopping[0]["pid"]
        ev = diagnosed()
        assert ev, "no hang diagnosis within the run's bound"
        d = ev[0]
        print(json.dumps({"detect_s": d["t"] - stopping[0]["t"], "reason": d["reason"]}))
        assert (d["replica"], d["rank"], d["incarnation"], d["state"]) == (1, 0, 0, "T"), d
        assert d["t"] - stopping[0]["t"] <= TTL_S + 2.0, d["t"] - stopping[0]["t"]
        # the link: a survivor waits to receive from r1, or is blocked sending to it
        mine = [k for k in d["links"] if 1 in (k["from"], k["to"])]
        assert mine, d
        assert all((k["direction"] == "rx" and k["from"] == 1 and k["to"] == k["seen_by"]) or
                   (k["direction"] == "tx" and k["to"] == 1 and k["from"] == k["seen_by"]) for k in mine), mine
        assert "link r" in d["reason"] and "replica 1 rank 0" in d["reason"] and "stopped" in d["reason"]
        # the stack of the stopped process, read while it was stopped: its own frames and FTAR thread
        assert "plain_loop.py" in d["stack"] and "ftar-r1-rank0" in d["stack"], d["stack"]
        assert f"Process {stopped_pid}" in d["stack"]
    finally:
        if stopped_pid is not None:
            try:
                os.kill(stopped_pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        sup.shutdown()
