"""The plain loop under the real Supervisor with injected failures (kill, hang, exception):
the supervisor evicts and restarts, restarted replicas catch up, and the invariants hold at
the end (docs/ARCHITECTURE.md, "Invariants and where they are tested")."""
from __future__ import annotations

import pytest

import json
import os
import sys
import uuid

from lightning_ft.bench.localjob import LOOP
from lightning_ft.coord.etcd_store import EtcdStore
from lightning_ft.launch.supervisor import Supervisor
from lightning_ft.launch.supervisor_settings import Placement, SupervisorSettings
from lightning_ft.replica.ledger import read_cursors, verify_ledger
from tests.strategy.runs import run_root


def rows_of(path: str) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            if line.startswith("{"):
                out.append(json.loads(line))
    return out


@pytest.mark.slow  # 230 steps with three failures; bench.soak's small run covers the mix in `make test`
def test_supervised_job_survives_kill_hang_and_exception(etcd_endpoint, tmp_path):
    job = "s" + uuid.uuid4().hex[:8]
    # Failures far enough apart (~9 s) for a restarted replica (Python + torch start-up) to
    # rejoin before the next one: if every replica with the trained state died at once, the
    # job would have to restart from a checkpoint instead.
    cmd = [sys.executable, LOOP, "--dim", "16", "--hidden", "32", "--batch", "8", "--steps", "230",
           "--step-sleep", "0.1", "--ttl", "1", "--ftar-timeout", "3", "--init-timeout", "30",
           "--failures", "1@10:kill,2@80:hang,0@150:exception"]
    sup = Supervisor(cmd, Placement(job, replicas=3, nproc_per_replica=1, etcd=etcd_endpoint,
                                    secret="supervised-test-secret-0123", run_dir=str(tmp_path)),
                     SupervisorSettings(restart_delay_s=0.5, max_restarts=3))
    try:
        sup.start()
        rc = sup.run(timeout_s=400)
    finally:
        sup.shutdown()
    assert rc == 0, sup.status()
    events = rows_of(str(tmp_path / "events.jsonl"))
    kinds = [(e["event"], e["replica"]) for e in events]
    for rid in (0, 1, 2):
        assert ("evict", rid) in kinds and ("restart", rid) in kinds, kinds
    assert ("hang", 2) in kinds
    logs = tmp_path / "logs"
    finals = {}
    # On a loaded machine a restart can outlast the gap to the next failure; then every replica
    # holding the state is down at once and the job rewinds (to step 0: no checkpoints here)
    # instead of catching up. Either way nothing is lost, and the replicas end identical.
    rewound = [e for e in events if e["event"] == "rewind"]
    for rid in range(3):
        last = max(int(p.split(".i")[1].split(".")[0]) for p in os.listdir(logs) if p.startswith(f"r{rid}.i"))
        assert last == 1
        rows = rows_of(str(logs / f"r{rid}.i{last}.rank0.log"))
        finals[rid] = [r for r in rows if r["event"] == "final"][0]["digest"]
        if not rewound:
            assert any(r["event"] == "step" and r["lag"] for r in rows), f"replica {rid} never caught up"
        assert rows[-1]["step"] == 230
    assert len({tuple(d) for d in finals.values()}) == 1, finals
    store = EtcdStore(etcd_endpoint)
    try:
        root = run_root(store, job)
        rep = verify_ledger(store, root, read_cursors(store, root, range(3)))
        assert rep.ok, (rep.duplicates, rep.gaps, rep.conflicts)
    finally:
        store.close()
