"""Every GPU check of the device data plane (at most about 4 minutes on one GPU).

    python -m lightning_ft.bench.gpu_check [--checks compile,kernels,ftar,bandwidth,matmul,job] [--mb 256]
    python -m lightning_ft.bench.gpu_check --dry-run ...   # the same logic on the CPU, tiny sizes

1. compile: the Triton kernels compiled ahead of time for the GPU's architecture (sm_90, an H100
   or H200, when there is no GPU): the installed Triton's front end, LLVM and ptxas, no GPU needed;
2. kernels: the Triton copy/reduce/scale kernels (2 programs) against torch, for fp32, bf16 and
   fp16 (bitwise for copy, round-to-nearest-even checked for 16-bit reduces);
3. ftar: FTAR's device path (the training path for CUDA gradients): 2 in-process ranks over tcp
   on CUDA tensors, bitwise equal to the CPU path (fp32, bf16, with a divisor), Triton kernels
   and pinned staging in use; its GB/s beside the CPU path's;
4. bandwidth: GB/s of the 2-program kernels against the device's own copy bandwidth (a torch
   copy of the same size, which uses the whole GPU), and a sweep of the grid size;
5. matmul: the slowdown of a bf16 matmul while the reduce kernel runs on another stream the
   whole time (CUDA events on the matmul's stream);
6. job: 2 replicas of ft_hsdp (examples/train_lm.py) on this GPU, one SIGKILLed and rejoining
   (bench/gpu_job.py).

Prints one JSON line per check and a final {"check": "summary", "ok": ..., "wall_s": ...}; exits 1
if a check failed. Without CUDA (and without --dry-run) it prints {"bench": "gpu_check",
"skipped": "no GPU", ...} and exits 0.

--dry-run runs the same code on the CPU with tiny sizes (bench/gpu_run.py's dry run, a test of the
suite): the kernels need TRITON_INTERPRET=1 in the environment; the ftar check forces the device
path on CPU tensors (`device_staging`, torch kernels: the interpreter is not thread-safe); the
matmul check, which needs CUDA streams, prints {"check": "matmul", "skipped": reason}.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import threading
import time

CHECKS = ("compile", "kernels", "ftar", "bandwidth", "matmul", "job")
DRY_ARCH = 90
"""The architecture compiled for without a GPU: sm_90 (H100, H200), what every lent machine had."""


def emit(**kw) -> None:
    print(json.dumps({"bench": "gpu_check", **kw}), flush=True)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, iters: int, device) -> float:
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / iters


def compile_kernels(arch: int) -> bool:
    """The three kernels, every variant the data plane launches, compiled for sm_`arch` to a cubin."""
    import triton
    import triton.compiler as tc
    from triton.backends.compiler import GPUTarget

    from lightning_ft.ops import triton_ops as tk

    target = GPUTarget("cuda", arch, 32)
    variants: list[tuple] = [(tk._copy_kernel, {"dst_ptr": "*i32", "src_ptr": "*i32", "n": "i32"}, {})]
    for kind, ptr in ((0, "*fp32"), (tk._FP16.value, "*fp16"), (tk._BF16.value, "*i16")):
        for out2 in (False, True):
            variants.append((tk._reduce_kernel, {"out_ptr": ptr, "out2_ptr": ptr, "recv_ptr": ptr, "local_ptr": ptr,
                                                 "n": "i32"}, {"KIND": kind, "HAS_OUT2": out2}))
        variants.append((tk._scale_kernel, {"ptr": ptr, "divisor": "fp32", "n": "i32"}, {"KIND": kind}))
    ok, sizes, errors = True, [], []
    t0 = time.perf_counter()
    for fn, sig, cx in variants:
        cx = {"BLOCK": tk.BLOCK, **cx}
        try:
            k = triton.compile(tc.ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in cx}}, constexprs=cx),
                               target=target, options={"num_warps": tk.NUM_WARPS})
            sizes.append(len(k.asm.get("cubin", b"")))
            ok &= sizes[-1] > 0
        except Exception as e:  # noqa: BLE001  (reported, and the check fails)
            ok = False
            errors.append(f"{fn.fn.__name__} {cx}: {type(e).__name__}: {str(e)[:300]}")
    emit(check="compile", ok=ok, arch=f"sm_{arch}", triton=triton.__version__, variants=len(variants),
         cubin_bytes=sizes, s=round(time.perf_counter() - t0, 2), errors=errors)
    return ok


def kernels_correct(device, n: int) -> bool:
    import torch

    from lightning_ft.ops import torch_reduce_, torch_scale_
    from lightning_ft.ops import triton_ops as tk

    ok = True
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        a = torch.randn(n, device=device).to(dtype)
        b = torch.randn(n, device=device).to(dtype)
        out = torch.empty_like(a)
        tk.copy_(out, a)
        copy_ok = torch.equal(out, a)
        tk.reduce_(out, a, b)
        ref_cpu = torch.empty(n, dtype=dtype)  # the CPU reference rounds to nearest even too
        torch_reduce_(ref_cpu, a.cpu(), b.cpu())
        reduce_ok = torch.equal(out.cpu(), ref_cpu)
        s, s_ref = a.clone(), a.cpu().clone()
        tk.scale_(s, 3.0)
        torch_scale_(s_ref, 3.0)
        scale_ok = torch.equal(s.cpu(), s_ref)
        emit(check="kernels", dtype=str(dtype).removeprefix("torch."), n=n, device=str(device),
             copy_bitwise=copy_ok, reduce_bitwise=reduce_ok, scale_bitwise=scale_ok)
        ok &= copy_ok and reduce_ok and scale_ok
    return ok


def _ring(n: int, **kw) -> list:
    from lightning_ft.ftar.engine import FTAR, FTARSettings

    fs = [FTAR("gpu-check", r, 0, "gpu-check-secret", FTARSettings(timeout_s=30, **kw)) for r in range(n)]
    addrs = [f.address for f in fs]
    ts = [threading.Thread(target=f.reconfigure, args=(1, addrs, i)) for i, f in enumerate(fs)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return fs


def _allreduce(fs, xs, divisor=None) -> float:
    t0 = time.perf_counter()
    for w in [f.allreduce([x], divisor=divisor) for f, x in zip(fs, xs, strict=True)]:
        w.wait(120)
    return time.perf_counter() - t0


def ftar_device_path(device, n: int, ftar_mb: float) -> bool:
    """Two ranks of FTAR over loopback tcp: tensors on `device` (device path; forced on the CPU)
    against CPU tensors (CPU path), bitwise; then the GB/s of both."""
    import torch

    from lightning_ft.ops import triton_available

    cuda = device.type == "cuda"
    dev, cpu = _ring(2, device_staging=not cuda), _ring(2)
    ok = True
    try:
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(1)
            base = [torch.randn(n, generator=g).to(dtype) for _ in range(2)]
            xs, ys = [b.to(device) for b in base], [b.clone() for b in base]
            _allreduce(dev, xs, 2.0)
            _allreduce(cpu, ys, 2.0)
            bitwise = all(torch.equal(x.cpu().view(torch.uint8), y.view(torch.uint8))
                          for x, y in zip(xs, ys, strict=True))
            st = dev[0].staging(xs[0].device)
            kernels_ok = st.kernels.name == "triton" or not triton_available() or not cuda
            emit(check="ftar_device_path", dtype=str(dtype).removeprefix("torch."), device=str(device), n=n,
                 bitwise_vs_cpu_path=bitwise, kernels=st.kernels.name, pinned=st.pinned, paths=dev[0].paths,
                 calls=dict(st.calls))
            ok &= bitwise and (st.pinned or not cuda) and kernels_ok and set(dev[0].paths) == {"device"}
        m = int(ftar_mb * (1 << 20)) // 4
        xs, ys = [torch.randn(m, device=device) for _ in range(2)], [torch.randn(m) for _ in range(2)]
        _allreduce(dev, xs)
        _allreduce(cpu, ys)  # warm
        dev_s = min(_allreduce(dev, xs) for _ in range(3))
        cpu_s = min(_allreduce(cpu, ys) for _ in range(3))
        emit(check="ftar_device_gbps", mb=ftar_mb, ranks=2, transport="tcp", device=str(device),
             device_path_gbps=round(m * 4 / dev_s / 1e9, 2), cpu_path_gbps=round(m * 4 / cpu_s / 1e9, 2),
             ratio=round(cpu_s / dev_s, 3))
    finally:
        for f in dev + cpu:
            f.close()
    return ok


def bandwidth(device, mb: float, iters: int, sweep: tuple[int, ...]) -> None:
    import torch

    from lightning_ft.ops import triton_ops as tk

    n = int(mb * (1 << 20)) // 4
    a, b, out = (torch.randn(n, device=device) for _ in range(3))
    nbytes = n * 4
    device_gbps = 2 * nbytes / _time(lambda: out.copy_(a), iters, device) / 1e9

    def gbps(programs: int) -> tuple[float, float]:
        copy_s = _time(lambda: tk.copy_(out, a, num_programs=programs), iters, device)
        reduce_s = _time(lambda: tk.reduce_(out, a, b, num_programs=programs), iters, device)
        return 2 * nbytes / copy_s / 1e9, 3 * nbytes / reduce_s / 1e9

    copy2, reduce2 = gbps(2)
    emit(check="bandwidth", mb=mb, device=str(device), programs=2, device_copy_gbps=round(device_gbps, 1),
         kernel_copy_gbps=round(copy2, 1), kernel_reduce_gbps=round(reduce2, 1),
         copy_vs_device=round(copy2 / device_gbps, 3), reduce_vs_device=round(reduce2 / device_gbps, 3),
         sweep={p: [round(x, 1) for x in gbps(p)] for p in sweep}, sweep_is="programs: [copy GB/s, reduce GB/s]")


def matmul_slowdown(device, mb: float, size: int = 8192, reps: int = 20) -> None:
    """A bf16 matmul timed by CUDA events on its own stream, alone, then while the reduce kernel
    (2 programs) runs back to back on a side stream for longer than the matmuls take."""
    import torch

    from lightning_ft.ops import triton_ops as tk

    x = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    n = int(mb * (1 << 20)) // 4
    a, b, out = (torch.randn(n, device=device) for _ in range(3))
    main, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)

    def matmuls() -> tuple:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        for _ in range(reps):
            x @ x
        end.record(main)
        return start, end

    x @ x
    torch.cuda.synchronize(device)
    s0, e0 = matmuls()
    torch.cuda.synchronize(device)
    alone_ms = s0.elapsed_time(e0) / reps
    reduce_ms = _time(lambda: tk.reduce_(out, a, b, num_programs=2), 5, device) * 1e3
    count = max(1, math.ceil(1.5 * alone_ms * reps / reduce_ms))
    side_end = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        for _ in range(count):  # queued first: the side stream is busy before and after the matmuls
            tk.reduce_(out, a, b, num_programs=2)
        side_end.record(side)
    s1, e1 = matmuls()
    torch.cuda.synchronize(device)
    together_ms = s1.elapsed_time(e1) / reps
    emit(check="matmul_slowdown", size=size, dtype="bfloat16", matmul_ms=round(alone_ms, 4),
         with_kernels_ms=round(together_ms, 4), slowdown=round(together_ms / alone_ms, 4),
         side_reduces=count, reduce_ms=round(reduce_ms, 3), side_outlasted=e1.elapsed_time(side_end) > 0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated, of {','.join(CHECKS)}")
    p.add_argument("--mb", type=float, default=256, help="buffer size of the kernel bandwidth and matmul checks")
    p.add_argument("--ftar-mb", type=float, default=64, help="all-reduce size of the FTAR device path's GB/s")
    p.add_argument("--dry-run", action="store_true", help="on the CPU, tiny sizes; CUDA-only checks print skipped")
    p.add_argument("--job-kill-step", type=int, default=30, help="the step at which replica 1 is SIGKILLed")
    p.add_argument("--job-after-steps", type=int, default=50, help="steps its restart trains before the job stops")
    p.add_argument("--job-timeout", type=float, default=200)
    p.add_argument("--keep-dir", default="", help="keep the job's run directory here (logs)")
    p.add_argument("--skip-job", action="store_true", help="leave out the job check")
    a = p.parse_args(argv)
    checks = [c for c in a.checks.split(",") if c and not (a.skip_job and c == "job")]
    unknown = set(checks) - set(CHECKS)
    if unknown:
        p.error(f"unknown checks {sorted(unknown)}; known: {','.join(CHECKS)}")
    t0 = time.perf_counter()
    try:
        import torch
    except ImportError:
        emit(skipped="no GPU", reason="torch does not import")
        return 0
    if a.dry_run:
        device = torch.device("cpu")
        if "kernels" in checks or "bandwidth" in checks:
            if os.environ.get("TRITON_INTERPRET") != "1":
                p.error("--dry-run runs the Triton kernels on the CPU: set TRITON_INTERPRET=1 in the environment")
    elif not torch.cuda.is_available():
        emit(skipped="no GPU", reason="torch.cuda.is_available() is False: no check ran; this script checks the "
                                      "GPU data plane and must run on a GPU machine (or with --dry-run)")
        return 0
    else:
        device = torch.device("cuda", 0)
    import lightning
    import triton

    emit(device=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (dry run)",
         capability=list(torch.cuda.get_device_capability(0)) if device.type == "cuda" else None,
         torch=torch.__version__, triton=triton.__version__, lightning=lightning.__version__,
         python=platform.python_version(), checks=checks)
    dry = a.dry_run
    ok = True
    if "compile" in checks:
        ok &= compile_kernels(DRY_ARCH if dry else 10 * torch.cuda.get_device_capability(0)[0]
                              + torch.cuda.get_device_capability(0)[1])
    if "kernels" in checks:
        ok &= kernels_correct(device, (1 << 14) + 3 if dry else (1 << 20) + 3)
    if "ftar" in checks:
        ok &= ftar_device_path(device, (1 << 14) + 5 if dry else (3 << 20) + 5, 0.25 if dry else a.ftar_mb)
    if "bandwidth" in checks:
        bandwidth(device, 0.25 if dry else a.mb, 2 if dry else 20, (1, 4) if dry else (1, 2, 4, 8, 16, 32, 132))
    if "matmul" in checks:
        if dry:
            emit(check="matmul", skipped="dry run: the concurrent matmul needs CUDA streams and events")
        else:
            matmul_slowdown(device, a.mb)
    if "job" in checks:
        from lightning_ft.bench.gpu_job import replicas_job

        ok &= replicas_job("cpu" if dry else "cuda", a.job_kill_step, a.job_after_steps, a.keep_dir, a.job_timeout)
    emit(check="summary", ok=bool(ok), wall_s=round(time.perf_counter() - t0, 1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
