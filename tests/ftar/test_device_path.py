"""FTAR's device path (engine._allreduce_device, transport/staging.py; docs/ARCHITECTURE.md,
"The device data plane") on a machine without a GPU: `device_staging=True` forces it on CPU
tensors, so the same chunking, staging-slot reuse and kernel/copy call sequence runs.

- In-process rings (torch kernels): bitwise equal to the CPU path, call counts, staging
  reuse, a peer failing mid-all-reduce.
- One process per rank under TRITON_INTERPRET=1 (the interpreter is not thread-safe): the
  same all-reduces with the Triton kernels, bitwise equal to the CPU path and, for 2 ranks,
  to torch sums; a SIGKILLed peer mid-all-reduce gives a RecoverableError, no hang.
- On CUDA (skipped without a GPU): the device path on CUDA tensors, pinned host staging.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from lightning_ft import ops
from lightning_ft.ftar.engine import FTAR, FTARSettings
from lightning_ft.ftar.ring import chunks, partitions, schedule, segments
from lightning_ft.ftar.transport.base import RecoverableError
from lightning_ft.jsonlines import JsonLines

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import device_worker as dw  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "device_worker.py")
INTERPRET = ops.interpreting()
no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here); not run")
in_process = pytest.mark.skipif(INTERPRET, reason="in-process rings share the Triton interpreter, which is not "
                                                  "thread-safe; the subprocess tests cover it")


def ring(n, **kw):
    fs = [FTAR("devjob", r, 0, "secret", FTARSettings(chunk_bytes=dw.CHUNK_BYTES, num_chunks=dw.NUM_CHUNKS,
                                                     timeout_s=10, **kw)) for r in range(n)]
    addrs = [f.address for f in fs]
    errors = []

    def go(i, f):
        try:
            f.reconfigure(1, addrs, i)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=go, args=(i, f)) for i, f in enumerate(fs)]
    [t.start() for t in ts]
    [t.join(20) for t in ts]
    assert not errors, errors
    return fs


def close(fs):
    for f in fs:
        f.close()


def run_case(fs, xs, divisor):
    for w in [f.allreduce(x, divisor=divisor) for f, x in zip(fs, xs, strict=True)]:
        w.wait(60)


def digest(ts) -> str:
    h = hashlib.sha256()
    for t in ts:
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def cpu_path_digests(n):
    """Every rank's result of each device_worker case through the CPU path (the reference)."""
    fs = ring(n)
    try:
        out = []
        for i, (dtype, sizes, divide) in enumerate(dw.CASES):
            xs = [dw.inputs(r, i, sizes, dtype) for r in range(n)]
            run_case(fs, xs, float(n) if divide else None)
            assert len({digest(x) for x in xs}) == 1
            out.append(digest(xs[0]))
        assert all(f.paths == {"cpu": sum(len(c[1]) for c in dw.CASES)} for f in fs)
        return out
    finally:
        close(fs)


def torch_sum_digests():
    """2 ranks: recv + local rounded to nearest even (fp32 compute), then the divisor."""
    out = []
    for i, (dtype, sizes, divide) in enumerate(dw.CASES):
        a, b = dw.inputs(0, i, sizes, dtype), dw.inputs(1, i, sizes, dtype)
        res = []
        for x, y in zip(a, b, strict=True):
            s = torch.empty_like(x)
            ops.torch_reduce_(s, x, y)
            if divide and s.numel():
                ops.torch_scale_(s, 2.0)
            res.append(s)
        out.append(digest(res))
    return out


def expected_calls(n, numel, es, divide):
    """The device path's calls for one all-reduce on one rank (index 0), from the pure schedule."""
    S, C = dw.CHUNK_BYTES, dw.NUM_CHUNKS
    calls = {"copy": 0, "reduce": 0, "scale": 0, "h2d": 0, "d2h": 0}
    plan = schedule(n, 0)
    for part in partitions(numel, es, n, S, C):
        segs = segments(part, n)
        k = len(chunks(segs[plan[0].send_seg], es, S))
        calls["copy"] += k  # pack
        calls["d2h"] += k
        for st in plan:
            k = len(chunks(segs[st.recv_seg], es, S))
            calls["h2d"] += k
            if st.phase == "rs":
                calls["reduce"] += k
                calls["d2h"] += k
                if st.last_rs and divide:
                    calls["scale"] += k
                    calls["copy"] += k
            else:
                calls["copy"] += k  # unpack
    return calls


# -- in process -----------------------------------------------------------------------------------
@in_process
@pytest.mark.parametrize("staged", [False, True], ids=["tcp-direct", "link-slots"])
@pytest.mark.parametrize("n", [2, 3])
def test_device_path_equals_the_cpu_path_bitwise(n, staged):
    ref = cpu_path_digests(n)
    fs = ring(n, device_staging=True, staged=staged)
    try:
        for i, (dtype, sizes, divide) in enumerate(dw.CASES):
            xs = [dw.inputs(r, i, sizes, dtype) for r in range(n)]
            run_case(fs, xs, float(n) if divide else None)
            assert [digest(x) for x in xs] == [ref[i]] * n, f"case {i} ({dtype}, {sizes}, divide={divide})"
        if n == 2:
            assert ref == torch_sum_digests()
        assert all(set(f.paths) == {"device"} for f in fs)
    finally:
        close(fs)


@in_process
@pytest.mark.parametrize(("n", "numel", "dtype", "divide"), [(2, 5003, torch.float32, True),
                                                            (3, 4096 * 3 + 1, torch.bfloat16, False),
                                                            (3, 1, torch.float32, True)])
def test_each_chunk_runs_the_kernels_and_copies_the_schedule_says(n, numel, dtype, divide):
    fs = ring(n, device_staging=True)
    try:
        xs = [[torch.randn(numel).to(dtype)] for _ in range(n)]
        run_case(fs, xs, float(n) if divide else None)
        st = fs[0].staging("cpu")
        want = expected_calls(n, numel, torch.empty(0, dtype=dtype).element_size(), divide)
        assert {k: st.calls[k] for k in want} == want
    finally:
        close(fs)


@in_process
def test_staging_is_allocated_once_and_reused_across_all_reduces_and_epochs():
    fs = ring(2, device_staging=True)
    try:
        run_case(fs, [[torch.ones(3000)] for _ in fs], None)
        before = [[b.data_ptr() for b in f.staging("cpu").buffers()] for f in fs]
        run_case(fs, [[torch.ones(9000), torch.ones(7)] for _ in fs], 2.0)
        addrs = [f.address for f in fs]
        ts = [threading.Thread(target=f.reconfigure, args=(2, addrs, i)) for i, f in enumerate(fs)]
        [t.start() for t in ts]
        [t.join(20) for t in ts]
        xs = [[torch.full((5000,), float(i + 1))] for i in range(2)]
        run_case(fs, xs, 2.0)
        assert all(torch.equal(x[0], torch.full((5000,), 1.5)) for x in xs)
        assert [[b.data_ptr() for b in f.staging("cpu").buffers()] for f in fs] == before
        assert all(len(f._staging) == 1 for f in fs)
        assert all(f.staging("cpu").nbytes == {"device": 2 * dw.CHUNK_BYTES * dw.NUM_CHUNKS,
                                               "host": 2 * dw.CHUNK_BYTES * dw.NUM_CHUNKS} for f in fs)
    finally:
        close(fs)


@in_process
def test_single_member_ring_scales_on_the_device_path():
    (f,) = [FTAR("j", 0, 0, "s", FTARSettings(device_staging=True))]
    try:
        f.reconfigure(1, [f.address], 0)
        x = torch.full((5,), 4.0)
        f.allreduce([x], divisor=2.0).wait(5)
        assert torch.equal(x, torch.full((5,), 2.0)) and f.staging("cpu").calls["scale"] == 1
    finally:
        f.close()


@in_process
def test_a_peer_lost_mid_all_reduce_is_recoverable_on_the_device_path():
    fs = ring(3, device_staging=True)
    try:
        st = fs[1].staging("cpu")
        real = st.kernels.reduce_
        seen = []

        def dying_reduce(*a, **kw):  # rank 1 dies after a few chunks: its links close
            seen.append(1)
            if len(seen) == 3:
                fs[1].transport.abort("simulated death of rank 1")
            return real(*a, **kw)

        st.kernels.reduce_ = dying_reduce
        t0 = time.monotonic()
        works = [f.allreduce([torch.randn(20000)]) for f in fs]
        for w in works:
            with pytest.raises(RecoverableError):
                w.wait(10)
        assert time.monotonic() - t0 < 3.0, "survivors must fail at once, not at a timeout"
        assert all(f.broken for f in fs)
    finally:
        close(fs)


# -- one process per rank, Triton interpreter -----------------------------------------------------
def spawn(tmp_path, n, scenario, env):
    pytest.importorskip("triton", reason="triton is not installed; the Triton kernels cannot be tested")
    full = {**os.environ, "TRITON_INTERPRET": "1", "FTAR_DEVICE": "cpu", **env}
    return [subprocess.Popen([sys.executable, WORKER, str(tmp_path), str(r), str(n), scenario],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full)
            for r in range(n)]


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(5)


@pytest.mark.parametrize("n", [2, 3])
def test_triton_kernels_under_the_interpreter_equal_the_cpu_path_bitwise(tmp_path, procs, n):
    ps = spawn(tmp_path, n, "sums", {"FTAR_STAGED": "1" if n == 3 else "0"})
    procs.extend(ps)
    outs = []
    for p in ps:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        outs.append([json.loads(x) for x in out.splitlines() if x.startswith("{")])
    ref = cpu_path_digests(n)
    for rank, rows in enumerate(outs):
        got = [r["digest"] for r in rows if r["event"] == "result"]
        assert got == ref, f"rank {rank}: device path (Triton, interpreted) != CPU path"
        done = next(r for r in rows if r["event"] == "done")
        assert done["kernels"] == "triton" and done["paths"] == {"device": sum(len(c[1]) for c in dw.CASES)}
        assert done["calls"]["reduce"] > 0 and done["calls"]["copy"] > 0 and done["calls"]["scale"] > 0
    if n == 2:
        assert ref == torch_sum_digests()


def test_sigkill_mid_all_reduce_under_the_interpreter_is_recoverable_without_a_hang(tmp_path, procs):
    ps = spawn(tmp_path, 3, "loop", {"FTAR_TIMEOUT": "20"})
    procs.extend(ps)
    outs = [JsonLines(p.stdout) for p in ps]
    for o, p in zip(outs, ps, strict=True):
        assert o.wait_for(lambda e: e["event"] == "running", 300) is not None, p.stderr.read()[-3000:]
    t_kill = time.time()
    ps[1].send_signal(signal.SIGKILL)
    for o in (outs[0], outs[2]):
        e = o.wait_for(lambda e: e["event"] == "error", 15)
        assert e is not None and e["kind"] == "recoverable", o.rows
        assert e["t"] - t_kill < 10.0, "well before the 20 s timeout: the closed connection is seen"


# -- CUDA -------------------------------------------------------------------------------------------
@no_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_tensors_take_the_device_path_with_pinned_staging(dtype):
    fs = ring(2)
    ref = ring(2)
    try:
        g = torch.Generator().manual_seed(5)
        base = [torch.randn(300007, generator=g).to(dtype) for _ in range(2)]
        xs = [[b.cuda()] for b in base]
        ys = [[b.clone()] for b in base]
        run_case(fs, xs, 2.0)
        run_case(ref, ys, 2.0)
        assert all(torch.equal(x[0].cpu().view(torch.uint8), y[0].view(torch.uint8))
                   for x, y in zip(xs, ys, strict=True))
        st = fs[0].staging(xs[0][0].device)
        assert st.pinned and st.kernels.name == ("triton" if ops.triton_available() else "torch")
        assert fs[0].paths == {"device": 1}
    finally:
        close(fs + ref)


@no_cuda
def test_cuda_device_path_waits_for_the_callers_stream():
    fs = ring(2)
    try:
        side = torch.cuda.Stream()
        xs = []
        with torch.cuda.stream(side):
            for i in range(2):
                a = torch.randn(4096, 4096, device="cuda")
                x = (a @ a).view(-1)[:200000].contiguous()  # still being computed at allreduce
                x.fill_(float(i + 1))
                xs.append([x])
            works = [f.allreduce(x, divisor=2.0) for f, x in zip(fs, xs, strict=True)]
        for w in works:
            w.wait(60)
        assert all(torch.equal(x[0], torch.full_like(x[0], 1.5)) for x in xs)
    finally:
        close(fs)
