"""A test worker for FTAR's device path: one rank in its own process (the Triton interpreter
is not thread-safe, so ranks under TRITON_INTERPRET=1 cannot share a process). Prints one
JSON line per event.

    python tests/ftar/device_worker.py DIR RANK N SCENARIO

FTAR_DEVICE=cpu (default) forces the device path on CPU tensors (device_staging=True);
FTAR_DEVICE=cuda runs it on the GPU. FTAR_STAGED=1 bridges the host link through its own
slots (the shm/rdma way) instead of tcp's direct send/recv. Scenarios:
  sums  the CASES below; prints each result's digest, the kernels used and the call counts
  loop  all-reduce 64K-element tensors until an error (a peer is SIGKILLed), report it
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker import addrs_of, digest, emit  # noqa: E402

from lightning_ft.ftar.engine import FTAR, FTARSettings  # noqa: E402
from lightning_ft.ftar.transport.base import FatalError, RecoverableError  # noqa: E402

CHUNK_BYTES, NUM_CHUNKS = 4096, 2
# (dtype, sizes, divide): sizes that are not multiples of a chunk, of a segment or of a
# partition (S*C*N bytes), an empty and a one-element tensor.
CASES = [(torch.float32, [1, 7, 5003, 4096 + 3, 0], False),
         (torch.float32, [2049, 12345], True),
         (torch.bfloat16, [3, 9999, 4096], False),
         (torch.bfloat16, [5001], True),
         (torch.float16, [3001], True)]


def inputs(rank: int, case: int, sizes, dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(case * 1000 + rank)
    return [torch.randn(n, generator=g).to(dtype) for n in sizes]


def make(rank: int, timeout: float) -> FTAR:
    return FTAR("devjob", rank, 0, "secret",
                FTARSettings(chunk_bytes=CHUNK_BYTES, num_chunks=NUM_CHUNKS, timeout_s=timeout,
                             start_timeout_s=timeout * 3, connect_timeout_s=20,
                             staged=os.environ.get("FTAR_STAGED") == "1", device_staging=True))


def main() -> int:
    d, rank, n, scenario = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    device = os.environ.get("FTAR_DEVICE", "cpu")
    f = make(rank, float(os.environ.get("FTAR_TIMEOUT", "10")))
    tmp = os.path.join(d, f"addr.{rank}.tmp")
    with open(tmp, "w") as fh:
        fh.write(f.address)
    os.rename(tmp, os.path.join(d, f"addr.{rank}"))
    f.reconfigure(1, addrs_of(d, list(range(n)), 1, timeout_s=60), rank)
    emit(event="connected")
    if scenario == "sums":
        for i, (dtype, sizes, divide) in enumerate(CASES):
            mine = [t.to(device) for t in inputs(rank, i, sizes, dtype)]
            f.allreduce(mine, divisor=float(n) if divide else None).wait(120)
            emit(event="result", case=i, digest=digest([t.cpu() for t in mine]))
        st = f.staging(device)
        emit(event="done", kernels=st.kernels.name, calls=dict(st.calls), paths=f.paths, pinned=st.pinned,
             buffers=[b.data_ptr() for b in st.buffers()])
        f.close()
        return 0
    if scenario == "loop":
        x = inputs(rank, 0, [1 << 16], torch.float32)[0].to(device)
        it = 0
        while True:
            try:
                f.allreduce([x.clone()]).wait(120)
                it += 1
                if it == 1:
                    emit(event="running")
            except RecoverableError as e:
                emit(event="error", kind="recoverable", peer=e.peer, reason=e.reason, iters=it)
                break
        f.close()
        return 0
    raise SystemExit(f"unknown scenario {scenario}")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except FatalError as e:
        emit(event="fatal", reason=str(e))
        sys.exit(3)
