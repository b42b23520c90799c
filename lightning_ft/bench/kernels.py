"""Benchmark of the FTAR data-plane kernels (docs/ARCHITECTURE.md, "The device data plane").

Measures, on one GPU:
- GB/s of the Triton copy and reduce (few programs, persistent loop) next to their torch peers
  (`dst.copy_`, `torch.add(out=)`), counting useful bytes: 2 tensors for copy, 3 for reduce,
  4 for reduce with the fused out2 write;
- how much a large bf16 matmul on another stream slows down while each of them runs beside it.

Prints one JSON object per line; without a GPU (or triton) it prints a skip line and exits 0.

    python -m lightning_ft.bench.kernels [--quick] [--programs 1,2,4,8] [--iters 10]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from typing import Optional

import torch

from lightning_ft.ops import triton_available

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TENSORS_MOVED = {"copy": 2, "reduce": 3, "reduce_out2": 4}
MATMUL_N = 8192
MATMULS_PER_TRIAL = 20
PEER_MB = 256
"""Buffer size of the reduce that runs beside the matmuls; large, so few launches cover them."""
TRIALS = 3


def emit(**fields: object) -> None:
    print(json.dumps({"bench": "kernels", **fields}), flush=True)


def time_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median milliseconds of one fn() on the current stream, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def buffers(size_mb: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """out, out2, recv and local: flat buffers of size_mb MiB each, on the GPU."""
    n = size_mb * 2**20 // torch.empty((), dtype=dtype).element_size()
    return {name: torch.randn(n, device="cuda").to(dtype) for name in ("out", "out2", "recv", "local")}


def op_calls(op: str, b: dict[str, torch.Tensor], num_programs: int) -> tuple[Callable[[], object],
                                                                                  Callable[[], object]]:
    """The Triton call and its torch peer for one op; both leave their result in b["out"]."""
    from lightning_ft.ops import triton_ops

    out, out2, recv, local = b["out"], b["out2"], b["recv"], b["local"]
    if op == "copy":
        return (lambda: triton_ops.copy_(out, recv, num_programs=num_programs), lambda: out.copy_(recv))
    if op == "reduce":
        return (lambda: triton_ops.reduce_(out, recv, local, num_programs=num_programs),
                lambda: torch.add(recv, local, out=out))

    def torch_reduce_out2() -> None:
        torch.add(recv, local, out=out)
        out2.copy_(out)

    return (lambda: triton_ops.reduce_(out, recv, local, out2, num_programs=num_programs), torch_reduce_out2)


def bench_throughput(op: str, dtype_name: str, size_mb: int, programs: list[int], iters: int) -> None:
    b = buffers(size_mb, DTYPES[dtype_name])
    gigabytes = TENSORS_MOVED[op] * b["out"].numel() * b["out"].element_size() / 1e9
    _, torch_call = op_calls(op, b, 1)
    torch_call()
    expected = b["out"].clone()
    torch_ms = time_ms(torch_call, iters)
    for num_programs in programs:
        triton_call, _ = op_calls(op, b, num_programs)
        b["out"].zero_()
        triton_call()
        bitwise_equal = torch.equal(b["out"].view(torch.int16), expected.view(torch.int16))
        triton_ms = time_ms(triton_call, iters)
        emit(op=op, dtype=dtype_name, size_mb=size_mb, num_programs=num_programs,
             triton_gbps=round(gigabytes / triton_ms * 1e3, 1), torch_gbps=round(gigabytes / torch_ms * 1e3, 1),
             triton_ms=round(triton_ms, 4), torch_ms=round(torch_ms, 4), bitwise_equal=bitwise_equal)


def matmul_ms(matmuls: Callable[[], None], stream: torch.cuda.Stream) -> tuple[float, torch.cuda.Event]:
    """Run the matmul batch on stream; return ms per matmul (after a sync) and the batch's start event."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        matmuls()
        end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / MATMULS_PER_TRIAL, start


def matmul_beside(peer: Callable[[], object], peer_ms: float, alone_ms: float, matmuls: Callable[[], None],
                  mm_stream: torch.cuda.Stream, peer_stream: torch.cuda.Stream) -> tuple[float, bool]:
    """ms per matmul while peer loops on peer_stream, and whether the peer outlasted the matmuls."""
    reps = math.ceil(3 * MATMULS_PER_TRIAL * alone_ms / peer_ms) + 1  # ~3x the matmul batch
    results = []
    for _ in range(TRIALS):
        torch.cuda.synchronize()
        peer_end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(peer_stream):
            for _ in range(reps):
                peer()
            peer_end.record()
        ms, start = matmul_ms(matmuls, mm_stream)
        results.append((ms, start.elapsed_time(peer_end) >= ms * MATMULS_PER_TRIAL))
    ms = statistics.median(r[0] for r in results)
    return ms, all(r[1] for r in results)


def bench_matmul_slowdown(programs: list[int], iters: int) -> None:
    a = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)

    def matmuls() -> None:
        for _ in range(MATMULS_PER_TRIAL):
            torch.matmul(a, w, out=c)

    mm_stream, peer_stream = torch.cuda.Stream(), torch.cuda.Stream()
    matmul_ms(matmuls, mm_stream)  # warm up cuBLAS
    alone_ms = statistics.median(matmul_ms(matmuls, mm_stream)[0] for _ in range(TRIALS))
    b = buffers(PEER_MB, torch.bfloat16)
    peers: list[tuple[str, Optional[int], Callable[[], object]]] = [
        ("triton_reduce", p, op_calls("reduce", b, p)[0]) for p in programs]
    peers.append(("torch_add", None, op_calls("reduce", b, 1)[1]))
    for name, num_programs, peer in peers:
        peer_ms = time_ms(peer, iters)
        ms, covered = matmul_beside(peer, peer_ms, alone_ms, matmuls, mm_stream, peer_stream)
        emit(case="matmul_slowdown", matmul=f"{MATMUL_N}x{MATMUL_N} bf16", peer=name, num_programs=num_programs,
             dtype="bfloat16", size_mb=PEER_MB, matmul_ms_alone=round(alone_ms, 4), matmul_ms=round(ms, 4),
             slowdown=round(ms / alone_ms, 3), matmul_tflops_alone=round(2 * MATMUL_N**3 / alone_ms / 1e9, 1),
             peer_covered_matmuls=covered)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small buffers (1 and 4 MiB) for a fast check")
    parser.add_argument("--programs", default="2", help="comma-separated Triton grid sizes to sweep, e.g. 1,2,4,8")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per measurement (median)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        emit(skipped="no GPU")
        return
    if not triton_available():
        emit(skipped="triton not installed")
        return
    programs = [int(p) for p in args.programs.split(",")]
    props = torch.cuda.get_device_properties(0)
    emit(case="device", gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__)
    sizes = [1, 4] if args.quick else [16, 64, 256]
    for dtype_name in DTYPES:
        for size_mb in sizes:
            for op in TENSORS_MOVED:
                bench_throughput(op, dtype_name, size_mb, programs, args.iters)
    bench_matmul_slowdown(programs, args.iters)


if __name__ == "__main__":
    main()
