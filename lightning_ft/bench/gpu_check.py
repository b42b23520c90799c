"""Every GPU check in one script (at most about 5 minutes on one GPU).

    python -m lightning_ft.bench.gpu_check [--mb 256] [--ftar-mb 64] [--skip-job]

1. kernel correctness: the Triton copy/reduce/scale kernels (2 programs) against torch, for
   fp32, bf16 and fp16 (bitwise for copy, round-to-nearest-even checked for 16-bit reduces);
2. FTAR's device path (the training path for CUDA gradients): 2 in-process ranks over tcp
   on CUDA tensors, bitwise equal to the CPU path (fp32, bf16, with a divisor), Triton
   kernels and pinned staging in use; its GB/s beside the CPU path's;
3. GB/s of the 2-program kernels against the device's own memory bandwidth (a torch copy of
   the same size, which uses the whole GPU);
4. the slowdown of a concurrent bf16 matmul while the kernels run on another stream;
5. 2 replicas of ft_hsdp (examples/train_lm.py on cuda) on this GPU, one SIGKILLed and
   rejoining, replicas identical at the end, every rank's gradients through FTAR's device
   path (LFT_FTAR_PATHS: each process reports the data paths it used).

Prints one JSON line per check, and a final {"check": "summary", "ok": ..., "wall_s": ...};
exits 1 if a check failed. Without CUDA it prints {"bench": "gpu_check", "skipped": "no GPU",
...} and exits 0: nothing here can run on a CPU-only machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_LM = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "train_lm.py")


def emit(**kw) -> None:
    print(json.dumps({"bench": "gpu_check", **kw}), flush=True)


def _time(fn, iters: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def kernels_correct() -> bool:
    import torch

    from lightning_ft.ops import torch_reduce_, torch_scale_
    from lightning_ft.ops import triton_ops as tk

    ok = True
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        n = (1 << 20) + 3
        a = torch.randn(n, device="cuda").to(dtype)
        b = torch.randn(n, device="cuda").to(dtype)
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
        emit(check="kernels", dtype=str(dtype).removeprefix("torch."), copy_bitwise=copy_ok,
             reduce_bitwise=reduce_ok, scale_bitwise=scale_ok)
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


def ftar_device_path(ftar_mb: int) -> bool:
    """Two ranks of FTAR over loopback tcp: CUDA tensors (device path) against CPU tensors (CPU path)."""
    import torch

    from lightning_ft.ops import triton_available

    dev, cpu = _ring(2), _ring(2)
    ok = True
    try:
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(1)
            base = [torch.randn((3 << 20) + 5, generator=g).to(dtype) for _ in range(2)]
            xs, ys = [b.cuda() for b in base], [b.clone() for b in base]
            _allreduce(dev, xs, 2.0)
            _allreduce(cpu, ys, 2.0)
            bitwise = all(torch.equal(x.cpu().view(torch.uint8), y.view(torch.uint8))
                          for x, y in zip(xs, ys, strict=True))
            st = dev[0].staging(xs[0].device)
            kernels_ok = st.kernels.name == "triton" or not triton_available()
            emit(check="ftar_device_path", dtype=str(dtype).removeprefix("torch."), bitwise_vs_cpu_path=bitwise,
                 kernels=st.kernels.name, pinned=st.pinned, paths=dev[0].paths, calls=dict(st.calls))
            ok &= bitwise and st.pinned and kernels_ok and set(dev[0].paths) == {"device"}
        n = ftar_mb * (1 << 20) // 4
        xs, ys = [torch.randn(n, device="cuda") for _ in range(2)], [torch.randn(n) for _ in range(2)]
        _allreduce(dev, xs)
        _allreduce(cpu, ys)  # warm
        dev_s = min(_allreduce(dev, xs) for _ in range(3))
        cpu_s = min(_allreduce(cpu, ys) for _ in range(3))
        emit(check="ftar_device_gbps", mb=ftar_mb, ranks=2, transport="tcp",
             device_path_gbps=round(n * 4 / dev_s / 1e9, 2), cpu_path_gbps=round(n * 4 / cpu_s / 1e9, 2),
             ratio=round(cpu_s / dev_s, 3))
    finally:
        for f in dev + cpu:
            f.close()
    return ok


def bandwidth(mb: int) -> None:
    import torch

    from lightning_ft.ops import triton_ops as tk

    n = mb * (1 << 20) // 4
    a, b, out = (torch.randn(n, device="cuda") for _ in range(3))
    device_s = _time(lambda: out.copy_(a), 20)
    copy_s = _time(lambda: tk.copy_(out, a, num_programs=2), 20)
    reduce_s = _time(lambda: tk.reduce_(out, a, b, num_programs=2), 20)
    nbytes = n * 4
    emit(check="bandwidth", mb=mb, device_copy_gbps=round(2 * nbytes / device_s / 1e9, 1),
         kernel_copy_gbps=round(2 * nbytes / copy_s / 1e9, 1), kernel_reduce_gbps=round(3 * nbytes / reduce_s / 1e9, 1),
         programs=2)


def matmul_slowdown(mb: int) -> None:
    import torch

    from lightning_ft.ops import triton_ops as tk

    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    alone = _time(lambda: x @ x, 10)
    n = mb * (1 << 20) // 4
    a, b, out = (torch.randn(n, device="cuda") for _ in range(3))
    side = torch.cuda.Stream()

    def both() -> None:
        with torch.cuda.stream(side):
            for _ in range(4):
                tk.reduce_(out, a, b, num_programs=2)
        x @ x

    together = _time(both, 10)
    emit(check="matmul_slowdown", matmul_ms=round(alone * 1e3, 3), with_kernels_ms=round(together * 1e3, 3),
         slowdown=round(together / alone, 4))


def replicas_job() -> bool:
    with tempfile.TemporaryDirectory(prefix="lft-gpucheck-") as d:
        paths_file = os.path.join(d, "ftar_paths.jsonl")
        cmd = [sys.executable, "-m", "lightning_ft.launch.cli", "run", "--replicas", "2", "--run-dir", d,
               "--no-status", "--timeout", "200", TRAIN_LM, "--steps", "150", "--accelerator", "cuda",
               "failure.events=[{replica: 1, step: 30, kind: kill}]", "failure.restart_delay_s=0.5"]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=260,
                           env={**os.environ, "LFT_FTAR_PATHS": paths_file})
        finals = []
        for rid in (0, 1):
            path = os.path.join(d, f"replica_{rid}", "final.json")
            if os.path.exists(path):
                finals.append(json.load(open(path)))
        identical = len(finals) == 2 and finals[0]["digest"] == finals[1]["digest"]
        rows = []
        if os.path.exists(paths_file):
            with open(paths_file) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        # every training process (the killed one, its restart and the survivor) exchanged on the GPU
        pids = {r["pid"] for r in rows}
        on_gpu = {r["pid"] for r in rows if r["path"] == "device" and r["device"].startswith("cuda") and r["pinned"]}
        device_path = len(pids) >= 3 and on_gpu == pids
        emit(check="replicas_kill_rejoin", rc=p.returncode, identical=identical,
             wall_s=round(time.perf_counter() - t0, 1),
             steps=[f["step"] for f in finals], device_path=device_path,
             ftar_paths=sorted({(r["replica"], r["path"], r["device"], r["kernels"]) for r in rows}),
             processes=len({r["pid"] for r in rows}), tail=(p.stdout + p.stderr)[-400:] if p.returncode else "")
        return p.returncode == 0 and identical and device_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=256, help="buffer size of the kernel bandwidth and matmul checks")
    p.add_argument("--ftar-mb", type=int, default=64, help="all-reduce size of the FTAR device path's GB/s")
    p.add_argument("--skip-job", action="store_true", help="skip the 2-replica ft_hsdp job (kill and rejoin)")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        import torch
    except ImportError:
        emit(skipped="no GPU", reason="torch does not import")
        return 0
    if not torch.cuda.is_available():
        emit(skipped="no GPU", reason="torch.cuda.is_available() is False: no check ran; this script checks the "
                                      "GPU data plane and must run on a GPU machine")
        return 0
    emit(device=torch.cuda.get_device_name(0))
    ok = kernels_correct()
    ok &= ftar_device_path(a.ftar_mb)
    bandwidth(a.mb)
    matmul_slowdown(a.mb)
    if not a.skip_job:
        ok &= replicas_job()
    emit(check="summary", ok=bool(ok), wall_s=round(time.perf_counter() - t0, 1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
