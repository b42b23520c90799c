"""Network faults between "hosts" (network namespaces on a bridge, tests/netns.py; issue 18 §4).

Three replicas of examples/plain_loop.py, each under its own `lightning-ft run --replica-ids i`
in its own namespace, etcd in a fourth:
- a replica's whole link is cut (FTAR and etcd alike): the others exclude it within
  TTL + 1 s and go on; when the link returns it comes back, catches up and ends identical;
- only the path between two replicas is cut while etcd reaches both: no livelock, the
  quorum excludes one side within a bounded number of rounds (the strikes rule of
  coord/quorum.py), the job goes on and finishes with an exact ledger.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest

from lightning_ft.bench.localjob import LOOP
from lightning_ft.coord.etcd_store import EtcdStore
from lightning_ft.replica.ledger import read_cursors, verify_ledger
from tests import netns
from tests.launch.test_multihost import clean_env, start_etcd, tail
from tests.strategy.runs import run_root

pytestmark = pytest.mark.skipif(netns.skip_reason() is not None, reason=str(netns.skip_reason()))

TTL = 2.0
LOOP_ARGS = ["--dim", "16", "--hidden", "32", "--batch", "8", "--ttl", str(TTL), "--init-timeout", "60",
             "--step-sleep", "0.1"]


def rows(run_dir, rid: int) -> list[dict]:
    """Every JSON line of replica `rid`'s leader, all incarnations, in order."""
    out = []
    for path in sorted((run_dir / "logs").glob(f"r{rid}.i*.rank0.log"), key=lambda p: int(p.name.split(".")[1][1:])):
        try:
            out += [json.loads(line) for line in open(path) if line.startswith("{")]
        except (OSError, ValueError):
            pass
    return out


def committed(run_dir, rid: int) -> list[dict]:
    return [r for r in rows(run_dir, rid) if r.get("event") == "step"]


class Job:
    def __init__(self, tmp_path, net: netns.Net, steps: int) -> None:
        self.tmp, self.steps = tmp_path, steps
        self.job = "part" + uuid.uuid4().hex[:6]
        self.stop_file = tmp_path / "STOP"
        """Created: the job stops at a step every replica agrees on, before `steps`."""
        self.secret = tmp_path / "secret"
        self.secret.write_text("partition-test-secret-0123456789\n")
        self.secret.chmod(0o600)
        he = net.host("e")
        self.hosts = [net.host(n) for n in ("a", "b", "c")]
        self.etcd = start_etcd(he, tmp_path)
        self.dirs = [tmp_path / f"host_{i}" for i in range(3)]
        self.procs = []
        for rid, h in enumerate(self.hosts):
            self.procs.append(h.popen(
                [sys.executable, "-m", "lightning_ft.launch.cli", "run", "--replicas", "3", "--nproc-per-replica",
                 "1", "--etcd", self.etcd, "--replica-ids", str(rid), "--job", self.job, "--run-dir",
                 str(self.dirs[rid]), "--no-status", "--timeout", "400", "--max-restarts", "5", LOOP, *LOOP_ARGS,
                 "--steps", str(steps), "--stop-file", str(self.stop_file), "failure.restart_delay_s=0.2",
                 "etcd.connect_timeout_s=30",
                 # A round that fails on the cut waits for a connection the cut swallows
                 # (ftar.connect_timeout_s), and a member waiting for a first chunk over it leaves
                 # when its lease lapses, hang_timeout_s after its last progress. 2 s and 10 s,
                 # not 5 s and 30 s: the cut test took 48-79 s, now about 40 (same mechanisms).
                 "ftar.connect_timeout_s=2", "etcd.hang_timeout_s=10"],
                env=clean_env(LFT_SECRET_FILE=str(self.secret)), stdout=open(tmp_path / f"launcher{rid}.log", "w"),
                stderr=subprocess.STDOUT))

    def diag(self) -> str:
        out = [tail(self.tmp / f"launcher{rid}.log") for rid in range(3)]
        for d in self.dirs:
            out += [tail(p, 2000) for p in sorted((d / "logs").glob("*.rank0.log"))]
        return "\n".join(out)

    def wait_for(self, cond, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while True:
            got = cond()
            if got:
                return got
            for p in self.procs:
                assert p.poll() is None, f"{what}: a launcher exited early with {p.returncode}\n{self.diag()}"
            assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}\n{self.diag()}"
            time.sleep(0.1)

    def finish(self, timeout_s: float = 300) -> list[dict]:
        for p in self.procs:
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the job did not finish within {timeout_s:.0f} s\n{self.diag()}") from None
        assert [p.returncode for p in self.procs] == [0, 0, 0], self.diag()
        finals = []
        for rid in range(3):
            f = [r for r in rows(self.dirs[rid], rid) if r.get("event") == "final"]
            finals.append(f[-1] if f else None)
        return finals

    def ledger(self):
        store = EtcdStore(self.etcd)
        try:
            root = run_root(store, self.job)
            return verify_ledger(store, root, read_cursors(store, root, range(3)))
        finally:
            store.close()


@pytest.mark.timeout(600)
def test_a_replica_whose_link_is_cut_is_excluded_within_ttl_and_comes_back_identical(tmp_path):
    steps = 120  # at most: the test stops the job once replica 2 is back
    with netns.Net() as net:
        job = Job(tmp_path, net, steps)
        job.wait_for(lambda: any(len(r["contributors"]) == 3 and r["step"] >= 10 for r in committed(job.dirs[0], 0)),
                     240, "all three replicas training")
        cut_at = time.time()
        net.cut(job.hosts[2])
        row = job.wait_for(lambda: next((r for r in committed(job.dirs[0], 0)
                                         if r["t"] > cut_at and 2 not in r["contributors"]), None),
                           60, "replica 2 excluded")
        excluded_after = row["t"] - cut_at
        job.wait_for(lambda: [r for r in committed(job.dirs[0], 0) if r["t"] > row["t"]][5:], 30,
                     "the others going on without replica 2")
        time.sleep(max(0.0, cut_at + 6.0 - time.time()))  # the link stays down 6 s (3 TTLs)
        net.restore(job.hosts[2])
        restored_at = time.time()
        progress = [r for r in committed(job.dirs[0], 0) if row["t"] <= r["t"] <= restored_at]
        job.wait_for(lambda: any(r["t"] > time.time() - 60 and 2 in r["contributors"]
                                 for r in committed(job.dirs[0], 0)[-20:]), 120, "replica 2 back in the quorum")
        job.stop_file.touch()  # what this test checks is done: the job stops at a step all agree on
        finals = job.finish()
        ledger = job.ledger()
    print(json.dumps({"test": "link_cut", "excluded_after_s": round(excluded_after, 3), "ttl_s": TTL,
                      "steps_without_it": len(progress)}))
    # "within TTL + 1 s": the committed row also carries one step (0.1 s of compute here)
    assert excluded_after <= TTL + 1.0 + 0.5, excluded_after
    end = finals[0]["step"] if finals[0] is not None else -1
    assert end > 10 and all(f is not None and f["step"] == end for f in finals), finals
    assert finals[0]["digest"] == finals[1]["digest"] == finals[2]["digest"], finals
    back = [r for r in rows(job.dirs[2], 2) if r.get("event") == "step" and r["t"] > cut_at]
    assert back and back[0]["role"] in ("catchup", "adopt"), back[:2]  # it caught up before training again
    assert ledger.ok and ledger.steps == end, (ledger.duplicates, ledger.gaps, ledger.conflicts)


@pytest.mark.timeout(600)
def test_a_cut_between_two_replicas_excludes_one_side_without_livelock(tmp_path):
    steps = 100  # at most: cut at step 10; the exclusion takes about 4 failed rounds, 10 steps are checked, it stops
    with netns.Net() as net:
        job = Job(tmp_path, net, steps)
        job.wait_for(lambda: any(len(r["contributors"]) == 3 and r["step"] >= 10 for r in committed(job.dirs[2], 2)),
                     240, "all three replicas training")
        cut_at = time.time()
        net.cut_path(job.hosts[0], job.hosts[1])  # etcd still reaches both; replica 2 reaches both
        row = job.wait_for(lambda: next((r for r in committed(job.dirs[2], 2)
                                         if r["t"] > cut_at and len(r["contributors"]) == 2), None),
                           90, "the quorum excluding one side of the cut")
        excluded = sorted({0, 1} - set(row["contributors"]))
        failed_rounds = [r for r in rows(job.dirs[2], 2)
                         if r.get("event") != "step" and r.get("round") is not None and cut_at < r["t"] <= row["t"]]
        job.wait_for(lambda: [r for r in committed(job.dirs[2], 2) if r["t"] > row["t"]][10:], 60,
                     "training going on with one side excluded")
        net.restore_path(job.hosts[0], job.hosts[1])
        going = [r for r in committed(job.dirs[2], 2) if r["t"] > row["t"]]
        job.stop_file.touch()  # what this test checks is done: the job stops at a step all agree on
        finals = job.finish()
        ledger = job.ledger()
    print(json.dumps({"test": "path_cut", "excluded": excluded, "excluded_after_s": round(row["t"] - cut_at, 3),
                      "failed_rounds": len(failed_rounds), "steps_after": len(going)}))
    assert len(excluded) == 1 and 2 in row["contributors"], row
    assert len(failed_rounds) <= 10, failed_rounds  # bounded: no livelock
    end = max(f["step"] for f in finals if f is not None)
    done = [f for f in finals if f is not None and f["step"] == end]
    assert len(done) >= 2 and all(f["digest"] == done[0]["digest"] for f in done), finals
    assert ledger.ok and ledger.steps == end, (ledger.duplicates, ledger.gaps, ledger.conflicts)
