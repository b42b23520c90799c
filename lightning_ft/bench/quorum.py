"""Quorum latency against a real etcd (docs/ARCHITECTURE.md, "The quorum").

    python -m lightning_ft.bench.quorum [--leaders 2 4 8 16] [--rounds 50] [--etcd HOST:PORT]

N leaders run back-to-back rounds (a fixed 10 ms "step" between rounds). Up to 4 leaders
are separate processes; beyond that each of 4 processes hosts several leader threads, each
with its own etcd client. One JSON line per N:
    {"bench": "quorum", "leaders": N, "rounds": R, "p50_ms": ..., "p99_ms": ..., "max_ms": ...}
where the latency is one leader's `Coordinator.quorum()` call: report, wait for the round's
decision, adopt it. It includes waiting for the slowest leader to report, as in training.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import uuid

STEP_S = 0.01


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def worker(endpoint: str, job: str, rids: list[int], total: int, rounds: int) -> None:
    from lightning_ft.coord.coordinator import Coordinator
    from lightning_ft.coord.membership import MembershipSettings
    from lightning_ft.coord.round_records import JobSpec
    from lightning_ft.coord.etcd_store import EtcdStore

    spec = JobSpec(total, total, 60.0, {"job": job})
    lat: dict[int, list[float]] = {r: [] for r in rids}

    def run(rid: int) -> None:
        store = EtcdStore(endpoint)
        c = Coordinator(store, job, rid, 0, spec, MembershipSettings(lease_ttl_s=5.0, poll_interval_s=0.02))
        c.register(0)
        step = 0
        for i in range(rounds + 1):
            t0 = time.perf_counter()
            q = c.quorum(step, timeout_s=60)
            if i:  # round 0 includes process start-up skew
                lat[rid].append((time.perf_counter() - t0) * 1000)
            step = q.max_step + 1
            time.sleep(STEP_S)
        c.close()
        store.close()

    ts = [threading.Thread(target=run, args=(r,)) for r in rids]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    print(json.dumps({"lat_ms": [x for r in rids for x in lat[r]]}), flush=True)


def run_case(endpoint: str, leaders: int, rounds: int) -> dict:
    job = "bench-" + uuid.uuid4().hex[:8]
    nproc = min(leaders, 4)
    groups = [list(range(p, leaders, nproc)) for p in range(nproc)]
    procs = [subprocess.Popen([sys.executable, "-m", "lightning_ft.bench.quorum", "--worker", endpoint, job,
                               ",".join(map(str, g)), str(leaders), str(rounds)],
                              stdout=subprocess.PIPE, text=True) for g in groups]
    lat: list[float] = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=300)
            if p.returncode != 0:
                raise RuntimeError(f"quorum bench worker exited with {p.returncode}")
            lat += json.loads(out.strip().splitlines()[-1])["lat_ms"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return {"bench": "quorum", "leaders": leaders, "processes": nproc, "rounds": rounds,
            "p50_ms": round(_percentile(lat, 0.5), 3), "p99_ms": round(_percentile(lat, 0.99), 3),
            "max_ms": round(max(lat), 3)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        endpoint, job, rids, total, rounds = argv[1:6]
        worker(endpoint, job, [int(r) for r in rids.split(",")], int(total), int(rounds))
        return 0
    p = argparse.ArgumentParser(prog="python -m lightning_ft.bench.quorum")
    p.add_argument("--leaders", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--etcd", default="", help="external etcd host:port (default: embedded)")
    a = p.parse_args(argv)
    from lightning_ft.coord.etcd_server import EtcdServer

    server = None if a.etcd else EtcdServer().start()
    endpoint = a.etcd if server is None else server.endpoint
    try:
        for n in a.leaders:
            print(json.dumps(run_case(endpoint, n, a.rounds)), flush=True)
    finally:
        if server is not None:
            server.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
