"""FTAR (tcp and shm links) against torch.distributed gloo all_reduce over TCP, in the same
processes (docs/ARCHITECTURE.md, "The device data plane": the CPU path).

    python -m lightning_ft.bench.ftar [--ranks 2 4] [--size-mb 16 64 256] [--iters 5]
                                      [--transports tcp shm]
                                      [--sweep]  # sweep chunk_bytes S x num_chunks C instead

N processes on loopback each hold an fp32 tensor. Each iteration runs FTAR and gloo back to
back on the same data (alternating which goes first), with a barrier before each, and the
time of an iteration is the slowest rank's. One JSON line per case:
    {"bench": "ftar", "transport": T, "ranks": N, "size_mb": M, "ftar_busbw_gbps": ...,
     "gloo_busbw_gbps": ..., "ratio": ..., "loadavg": "..."}
busbw = algbw * 2(N-1)/N (nccl-tests), from the median iteration; `loadavg` is
/proc/loadavg when the case ends (the machine may be shared). Memory: about 3x the size
per rank (the tensor, its copy, gloo's buffers).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Sequence

import torch


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return ""


def _worker(rank: int, world: int, port: int, sizes_mb: list[float], iters: int, geoms: list[tuple[int, int]],
            transports: list[str]) -> None:
    import torch.distributed as dist

    from lightning_ft.ftar.engine import FTAR, FTARSettings

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=__import__("datetime").timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    results = []
    for (S, C), transport in [(g, t) for t in transports for g in geoms]:
        ftar = FTAR("bench", rank, 0, "bench-secret",
                    FTARSettings(chunk_bytes=S, num_chunks=C, timeout_s=30, transport=transport))
        key = f"addr/{transport}/{S}/{C}"
        store.set(f"{key}/{rank}", ftar.address)
        addrs = [store.get(f"{key}/{r}").decode() for r in range(world)]
        ftar.reconfigure(1, addrs, rank)
        for mb in sizes_mb:
            numel = int(mb * (1 << 20)) // 4
            x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
            times: dict[str, list[float]] = {"ftar": [], "gloo": []}
            for it in range(iters + 1):
                order = ("ftar", "gloo") if it % 2 == 0 else ("gloo", "ftar")
                for name in order:
                    y = x.clone()
                    dist.barrier()
                    t0 = time.perf_counter()
                    if name == "ftar":
                        ftar.allreduce([y]).wait(120)
                    else:
                        dist.all_reduce(y)
                    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                    if it > 0:  # the first iteration warms up connections and caches
                        times[name].append(dt.item())
            if rank == 0:
                nbytes = numel * 4
                bus = {k: nbytes / statistics.median(v) * 2 * (world - 1) / world / 1e9 for k, v in times.items()}
                results.append({"bench": "ftar", "transport": transport, "ranks": world, "size_mb": mb,
                                "chunk_bytes": S, "num_chunks": C,
                                "ftar_busbw_gbps": round(bus["ftar"], 3), "gloo_busbw_gbps": round(bus["gloo"], 3),
                                "ratio": round(bus["ftar"] / bus["gloo"], 3), "iters": iters,
                                "loadavg": _loadavg()})
                print(json.dumps(results[-1]), flush=True)
        dist.barrier()
        ftar.close()
    dist.destroy_process_group()


def run(ranks: int, sizes_mb: list[float], iters: int, geoms: list[tuple[int, int]],
        transports: Sequence[str] = ("tcp",), timeout_s: float = 900) -> int:
    from lightning_ft.coord.etcd_server import free_port

    port = free_port()
    spec = json.dumps([sizes_mb, iters, geoms, list(transports)])
    procs = [subprocess.Popen([sys.executable, "-m", "lightning_ft.bench.ftar", "--worker", str(r), str(ranks),
                               str(port), spec], stdout=None if r == 0 else subprocess.DEVNULL)
             for r in range(ranks)]
    rc = 0
    try:
        deadline = time.monotonic() + timeout_s
        for p in procs:
            rc |= p.wait(max(1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                rc = 1
    return rc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        rank, world, port = int(argv[1]), int(argv[2]), int(argv[3])
        sizes, iters, geoms, transports = json.loads(argv[4])
        _worker(rank, world, port, sizes, iters, [tuple(g) for g in geoms], transports)
        return 0
    p = argparse.ArgumentParser(prog="python -m lightning_ft.bench.ftar")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--size-mb", type=float, nargs="+", default=[16, 64, 256])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--chunk-bytes", type=int, default=4 << 20)
    p.add_argument("--num-chunks", type=int, default=4)
    p.add_argument("--transports", nargs="+", default=["tcp", "shm"], choices=["tcp", "shm", "rdma", "auto"])
    p.add_argument("--sweep", action="store_true", help="sweep S in {1M,4M,8M,16M} x C in {2,4}")
    a = p.parse_args(argv)
    geoms = [(a.chunk_bytes, a.num_chunks)]
    if a.sweep:
        geoms = [(s, c) for s in (1 << 20, 4 << 20, 8 << 20, 16 << 20) for c in (2, 4)]
    rc = 0
    for n in a.ranks:
        rc |= run(n, a.size_mb, a.iters, geoms, a.transports)
    return rc


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
