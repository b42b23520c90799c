"""A quorum-only demo and test driver: replica leaders that do nothing but agree.

`python -m lightning_ft.coord.demo leader --etcd H:P --rid 0 ...` runs one leader that
takes part in rounds, advancing its step when it trains, and prints one JSON line per round:
    {"t": <unix time>, "rid": 0, "inc": 0, "round": 3, "epoch": 1, "members": [...], ...}
A lagging leader pretends to catch up (it jumps to max_step), as the replica core will.

`python -m lightning_ft.coord.demo show` (what `make demo` runs) starts an embedded etcd and
three leaders, SIGKILLs one, evicts it as the supervisor would, restarts it, and prints
each quorum decision with its reason as it happens.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from typing import Optional

from .coordinator import Coordinator
from .membership import MembershipSettings
from .round_records import JobSpec
from .etcd_store import EtcdStore
from lightning_ft.jsonlines import JsonLines


def leader_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lightning_ft.coord.demo leader")
    p.add_argument("--etcd", required=True)
    p.add_argument("--job", default="demo")
    p.add_argument("--rid", type=int, required=True)
    p.add_argument("--inc", type=int, default=0)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--step-ms", type=float, default=20.0, help="mean simulated step time")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="uniform random extra delay per round")
    p.add_argument("--ttl", type=float, default=1.0)
    p.add_argument("--hang-timeout", type=float, default=30.0)
    p.add_argument("--init-timeout", type=float, default=5.0)
    p.add_argument("--nproc", type=int, default=1, help="only part of the job fingerprint")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    rng = random.Random(a.seed * 1000 + a.rid)
    spec = JobSpec(a.replicas, a.min_replicas, a.init_timeout,
                   {"job": a.job, "replicas": a.replicas, "nproc_per_replica": a.nproc})
    store = EtcdStore(a.etcd)
    coord = Coordinator(store, a.job, a.rid, a.inc, spec,
                        MembershipSettings(lease_ttl_s=a.ttl, hang_timeout_s=a.hang_timeout, poll_interval_s=0.02))
    step = 0
    coord.register(step, addrs=(f"127.0.0.1:{20000 + a.rid}",))
    emit({"event": "registered", "rid": a.rid, "inc": a.inc, "t": time.time()})
    try:
        for _ in range(a.rounds):
            t0 = time.monotonic()
            q = coord.quorum(step, timeout_s=60.0)
            emit({"t": time.time(), "rid": a.rid, "inc": a.inc, "round": q.round, "epoch": q.epoch,
                  "members": list(q.members), "incarnations": list(q.incarnations),
                  "contributors": list(q.contributors), "lagging": list(q.lagging), "max_step": q.max_step,
                  "step": step, "quorum_ms": round((time.monotonic() - t0) * 1000, 3), "reason": q.reason})
            step = q.max_step + 1  # contributors train; lagging ones catch up and train too
            time.sleep((a.step_ms + rng.uniform(0, a.jitter_ms)) / 1000.0)
    finally:
        coord.close()
        store.close()
    return 0


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class LeaderProc:
    """A leader subprocess whose JSON lines are collected by a reader thread."""

    def __init__(self, etcd: str, rid: int, inc: int = 0, extra: tuple[str, ...] = ()) -> None:
        self.rid, self.inc = rid, inc
        cmd = [sys.executable, "-m", "lightning_ft.coord.demo", "leader", "--etcd", etcd,
               "--rid", str(rid), "--inc", str(inc), *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        assert self.proc.stdout is not None  # stdout=PIPE
        self.out = JsonLines(self.proc.stdout)

    @property
    def lines(self) -> list[dict]:
        return self.out.rows

    def rounds(self) -> list[dict]:
        return self.out.select(lambda l: "round" in l)

    def wait_for(self, pred, timeout_s: float) -> Optional[dict]:
        return self.out.wait_for(pred, timeout_s)

    def signal(self, sig: int) -> None:
        try:
            os.kill(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def show_main(argv: list[str]) -> int:
    from .etcd_server import EtcdServer

    p = argparse.ArgumentParser(prog="lightning_ft.coord.demo show")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--seconds", type=float, default=12.0)
    a = p.parse_args(argv)
    leaders: list[LeaderProc] = []
    with EtcdServer() as etcd:
        print(f"embedded etcd on {etcd.endpoint}")
        extra = ("--replicas", str(a.replicas), "--rounds", "100000", "--step-ms", "100", "--ttl", "2")
        store = EtcdStore(etcd.endpoint)
        try:
            leaders = [LeaderProc(etcd.endpoint, r, 0, extra) for r in range(a.replicas)]
            seen_round = -1
            last_members: Optional[tuple] = None
            t0 = time.monotonic()
            killed = restarted = False
            victim = a.replicas - 1
            while time.monotonic() - t0 < a.seconds:
                time.sleep(0.05)
                el = time.monotonic() - t0
                if not killed and el > a.seconds * 0.3:
                    killed = True
                    leaders[victim].kill()
                    store.put(f"/lft/demo/evict/{victim}/0", b"SIGKILL (demo)")
                    print(f"[{el:5.2f}s] SIGKILL replica {victim}; supervisor writes evict/{victim}/0")
                if killed and not restarted and el > a.seconds * 0.55:
                    restarted = True
                    leaders[victim] = LeaderProc(etcd.endpoint, victim, 1, extra)
                    print(f"[{el:5.2f}s] restart replica {victim} as incarnation 1")
                rows = sorted((r for l in leaders for r in l.rounds() if r["round"] > seen_round),
                              key=lambda r: r["round"])
                for r in rows:
                    if r["round"] <= seen_round:
                        continue
                    seen_round = r["round"]
                    key = (tuple(r["members"]), tuple(r["lagging"]))
                    if key != last_members or r["round"] % 20 == 0:
                        print(f"[{el:5.2f}s] {r['reason']}  (quorum in {r['quorum_ms']:.1f} ms)")
                        last_members = key
            final = [l.rounds()[-1] for l in leaders if l.rounds()]
            agree = len({(f["round"], tuple(f["members"])) for f in final})
            print(f"done: {seen_round + 1} rounds decided; every quorum was adopted by all its members "
                  f"(last rounds seen: {[f['round'] for f in final]}, {agree} distinct)")
        finally:
            for l in leaders:
                l.kill()
            store.close()
    return 0


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    if len(sys.argv) < 2 or sys.argv[1] not in ("leader", "show"):
        print("usage: python -m lightning_ft.coord.demo {leader|show} ...", file=sys.stderr)
        return 2
    return leader_main(sys.argv[2:]) if sys.argv[1] == "leader" else show_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
