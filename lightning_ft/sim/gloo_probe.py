"""Measure the quorum fan-out on real gloo processes on this machine (docs/ARCHITECTURE.md, "A step", 1).

`probe(world, message)` starts `world` processes on loopback that form a gloo group, as a
replica's ranks do, and times three broadcasts from rank 0, each many times:
- `hop`:    dist.broadcast of one int64: the latency of a tiny message through the tree;
- `bulk`:   dist.broadcast of `bulk_bytes` bytes: with `hop`, the point-to-point bandwidth;
- `object`: dist.broadcast_object_list([message]): what the replica manager sends its ranks
            after every quorum (the quorum and the cursor).
Before each broadcast the ranks meet at a barrier and rank 0 waits 2 ms, so every other rank
is already blocked in its receive, as the ranks are while their leader talks to etcd. A
rank's latency is its return time minus rank 0's start time, on the machine-wide monotonic
clock. `fit(probe at W=2)` turns the measurements into a `fanout.HopModel`.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from lightning_ft.sim.fanout import HopModel

OPS = ("hop", "bulk", "object")


@dataclass
class ProbeResult:
    world: int
    message_bytes: int
    """Pickled size of the broadcast object (what broadcast_object_list sends)."""
    bulk_bytes: int
    latency_ms: dict
    """Per op: one list per iteration of the non-root ranks' latencies (ms), by rank."""

    def last_rank_ms(self, op: str) -> list[float]:
        """Per iteration: when the last rank held the data (the fan-out's completion)."""
        return [max(row) for row in self.latency_ms[op]]

    def one_hop_ms(self, op: str) -> list[float]:
        """Every rank-1 latency (rank 1 is the root's first send: one hop)."""
        return [row[0] for row in self.latency_ms[op]]


def _worker(rank: int, world: int, port: int, iters: int, bulk_bytes: int, message_path: str, out: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    with open(message_path, "rb") as f:
        message = pickle.load(f)
    tiny, bulk = torch.zeros(1, dtype=torch.int64), torch.zeros(bulk_bytes, dtype=torch.uint8)
    ops = {
        "hop": lambda: dist.broadcast(tiny, src=0),
        "bulk": lambda: dist.broadcast(bulk, src=0),
        "object": lambda: dist.broadcast_object_list([message if rank == 0 else None], src=0),
    }
    times: dict[str, list[int]] = {op: [] for op in OPS}
    for op in OPS:
        fn = ops[op]
        for it in range(iters + 2):  # two warm-up iterations (connections, allocator)
            dist.barrier()
            if rank == 0:
                time.sleep(0.002)
                t = time.perf_counter_ns()
                fn()
            else:
                fn()
                t = time.perf_counter_ns()
            if it >= 2:
                times[op].append(t)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, times)
    if rank == 0:
        lat = {op: [[(gathered[r][op][i] - gathered[0][op][i]) / 1e6 for r in range(1, world)]
                    for i in range(iters)] for op in OPS}
        with open(out, "w") as f:
            json.dump(lat, f)
    dist.barrier()
    dist.destroy_process_group()


def _setup_child(cpus: Optional[Sequence[int]], nice: int) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    if nice:
        os.nice(nice)


def probe(world: int, message: Any, iters: int = 200, bulk_bytes: int = 1 << 20,
          timeout_s: float = 180.0, cpus: Optional[Sequence[int]] = None, nice: int = 0) -> ProbeResult:
    """Run the three broadcasts over `world` real gloo processes; see the module docstring.
    `cpus`: pin every process to these CPUs (to see what sharing cores costs); `nice`: their
    niceness (negative needs root: woken ranks then preempt other work, as if each had a core)."""
    if world < 2:
        raise ValueError(f"a broadcast probe needs at least 2 processes, got {world}")
    from lightning_ft.coord.etcd_server import free_port

    with tempfile.TemporaryDirectory(prefix="lft-probe-") as tmp:
        msg_path, out = os.path.join(tmp, "message.pkl"), os.path.join(tmp, "latency.json")
        with open(msg_path, "wb") as f:
            pickle.dump(message, f)
        port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        procs = [subprocess.Popen([sys.executable, "-m", "lightning_ft.sim.gloo_probe", "--worker", str(r), str(world),
                                   str(port), str(iters), str(bulk_bytes), msg_path, out],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  preexec_fn=lambda: _setup_child(cpus, nice))
                 for r in range(world)]
        deadline = time.monotonic() + timeout_s
        try:
            for p in procs:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise TimeoutError(f"gloo probe with {world} processes did not finish in {timeout_s:.0f}s "
                                       "(is the machine overloaded?)") from None
            bad = [(r, p.returncode, p.stderr.read()[-1500:] if p.stderr else "") for r, p in enumerate(procs)
                   if p.returncode != 0]
            if bad:
                r, code, err = bad[0]
                raise RuntimeError(f"gloo probe rank {r} of {world} exited with {code}:\n{err}")
            with open(out) as f:
                lat = json.load(f)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(5)
                if p.stderr:
                    p.stderr.close()
    return ProbeResult(world, len(pickle.dumps(message)), bulk_bytes, lat)


def fit(two: ProbeResult) -> HopModel:
    """A hop model from a probe over 2 processes (one hop per broadcast):
    latency = the `hop` samples; bandwidth from the `bulk` median over the `hop` median;
    overhead = the `object` median minus its two tree broadcasts."""
    if two.world != 2:
        raise ValueError(f"fit a hop model on a 2-process probe (one hop per broadcast), not {two.world}")
    hop = two.one_hop_ms("hop")
    h50 = statistics.median(hop)
    bulk_ms = max(statistics.median(two.one_hop_ms("bulk")) - h50, 1e-3)
    bw = two.bulk_bytes / (bulk_ms / 1e3)
    overhead = statistics.median(two.one_hop_ms("object")) - 2 * h50 - two.message_bytes / bw * 1e3
    return HopModel(latency_ms=tuple(hop), bytes_per_s=bw, overhead_ms=max(0.0, overhead))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        r, w, port, iters, bulk = (int(x) for x in argv[1:6])
        _worker(r, w, port, iters, bulk, argv[6], argv[7])
        return 0
    p = argparse.ArgumentParser(prog="python -m lightning_ft.sim.gloo_probe",
                                description="time gloo broadcasts over W local processes")
    p.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--message-bytes", type=int, default=300, help="size of a bytes object to broadcast")
    a = p.parse_args(argv)
    for w in a.world:
        res = probe(w, b"x" * a.message_bytes, iters=a.iters)
        print(json.dumps({"probe": "gloo_broadcast", "world": w, "message_bytes": res.message_bytes,
                          **{f"{op}_last_rank_p50_ms": round(statistics.median(res.last_rank_ms(op)), 4)
                             for op in OPS}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
