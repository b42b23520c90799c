"""A test worker: one FTAR rank in its own process. Prints one JSON line per event.

    python tests/ftar/worker.py DIR RANK N SCENARIO [victim]

Ranks find each other through address files in DIR; FTAR_TRANSPORT picks the transport
(default tcp) and FTAR_TIMEOUT the timeouts. Scenarios:
  correct  several all-reduces of fp32/bf16 buckets with odd sizes; prints result hashes
  loop     all-reduce forever until an error, then reconfigure without the victim and do
           one more checked all-reduce
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import torch

from lightning_ft.ftar.engine import FTAR, FTARSettings
from lightning_ft.ftar.transport.base import FatalError, RecoverableError


def emit(**kw):
    print(json.dumps({"t": time.time(), **kw}), flush=True)


def tensors(rank: int, seed: int, sizes, dtype):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return [torch.randn(n, generator=g).to(dtype) for n in sizes]


def addrs_of(d: str, ranks, epoch: int, timeout_s: float = 20.0):
    out = []
    deadline = time.monotonic() + timeout_s
    for r in ranks:
        path = os.path.join(d, f"addr.{r}")
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {r} never published its address")
            time.sleep(0.01)
        out.append(open(path).read())
    return out


def digest(ts) -> str:
    h = hashlib.sha256()
    for t in ts:
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def main() -> int:
    d, rank, n, scenario = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    victim = int(sys.argv[5]) if len(sys.argv) > 5 else -1
    timeout = float(os.environ.get("FTAR_TIMEOUT", "5"))
    # The configured timeout also bounds the wait for the first chunk (no eviction watch here).
    f = FTAR("testjob", rank, 0, "secret", FTARSettings(chunk_bytes=64 << 10, num_chunks=4, timeout_s=timeout,
                                                       start_timeout_s=timeout, connect_timeout_s=10,
                                                       transport=os.environ.get("FTAR_TRANSPORT", "tcp")))
    tmp = os.path.join(d, f"addr.{rank}.tmp")
    with open(tmp, "w") as fh:
        fh.write(f.address)
    os.rename(tmp, os.path.join(d, f"addr.{rank}"))
    ranks = list(range(n))
    f.reconfigure(1, addrs_of(d, ranks, 1), rank)
    emit(event="connected")
    if scenario == "correct":
        for i, (dtype, sizes) in enumerate([(torch.float32, [1, 7, 100003, 4097, 0, 65536 * 3 + 5]),
                                            (torch.bfloat16, [3, 50001, 65536]),
                                            (torch.float32, [13] * 40)]):
            mine = tensors(rank, i, sizes, dtype)
            want = [sum(tensors(r, i, sizes, dtype)[k].double() for r in ranks) for k in range(len(sizes))]
            f.allreduce(mine).wait(60)
            err = max([(m.double() - w).abs().max().item() / (w.abs().max().item() + 1)
                       for m, w in zip(mine, want, strict=True)
                       if m.numel()] or [0.0])
            emit(event="result", case=i, digest=digest(mine), rel_err=err)
        f.close()
        return 0
    if scenario == "loop":
        x = tensors(rank, 0, [1 << 20], torch.float32)[0]  # 4 MB per all-reduce
        it = 0
        while True:
            try:
                f.allreduce([x.clone()]).wait(60)
                it += 1
                if it == 3:
                    emit(event="running")
            except RecoverableError as e:
                emit(event="error", kind="recoverable", peer=e.peer, reason=e.reason, iters=it)
                break
        survivors = [r for r in ranks if r != victim]
        t0 = time.perf_counter()
        f.reconfigure(2, addrs_of(d, survivors, 2), survivors.index(rank))
        emit(event="reconfigured", ms=(time.perf_counter() - t0) * 1000)
        y = tensors(rank, 7, [300007], torch.float32)[0]
        want = sum(tensors(r, 7, [300007], torch.float32)[0].double() for r in survivors)
        f.allreduce([y]).wait(30)
        emit(event="after", digest=digest([y]), max_err=(y.double() - want).abs().max().item())
        f.close()
        return 0
    raise SystemExit(f"unknown scenario {scenario}")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except FatalError as e:
        emit(event="fatal", reason=str(e))
        sys.exit(3)
