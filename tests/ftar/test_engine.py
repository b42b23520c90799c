"""FTAR over each transport (tcp and shm here; rdma where a verbs device exists):
correctness, SIGKILL, SIGSTOP, abort, refusals and fatal mismatches. Multi-process tests
bound every wait and kill their processes by PID.

The rdma cases need a verbs device (`ibv_devices` lists one) and pyverbs; run them with
`LFT_RDMA_DEVICE=mlx5_0 .venv/bin/python -m pytest -q tests/ftar -k rdma` (see docs/GUIDE.md)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from lightning_ft.ftar.engine import FTAR, FTARSettings
from lightning_ft.jsonlines import JsonLines
from lightning_ft.ftar.transport.base import FatalError, RecoverableError
from lightning_ft.ftar.transport.rdma import rdma_skip_reason

WORKER = os.path.join(os.path.dirname(__file__), "worker.py")


@pytest.fixture(params=["tcp", "shm", "rdma"])
def transport(request):
    if request.param == "rdma" and rdma_skip_reason():
        pytest.skip(rdma_skip_reason())
    return request.param


class Worker:
    def __init__(self, d, rank, n, scenario, victim=-1, env=None, transport="tcp"):
        self.rank = rank
        self.proc = subprocess.Popen([sys.executable, WORKER, str(d), str(rank), str(n), scenario, str(victim)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "FTAR_TRANSPORT": transport, **(env or {})})
        self.out = JsonLines(self.proc.stdout)

    @property
    def events(self) -> list[dict]:
        return self.out.rows

    def wait_event(self, name, timeout_s):
        e = self.out.wait_for(lambda e: e["event"] == name, timeout_s)
        if e is None:
            err = self.proc.stderr.read() if self.proc.poll() is not None else "(running)"
            raise AssertionError(f"rank {self.rank} never reported {name!r}; events {self.events}; {err}")
        return e


@pytest.fixture
def workers():
    started: list[Worker] = []
    yield started
    for w in started:
        if w.proc.poll() is None:
            os.kill(w.proc.pid, signal.SIGCONT)
            w.proc.kill()
        w.proc.wait(5)


def spawn(workers, d, n, scenario, victim=-1, env=None, transport="tcp"):
    ws = [Worker(d, r, n, scenario, victim, env, transport) for r in range(n)]
    workers.extend(ws)
    return ws


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sums_match_torch_and_are_bitwise_identical_on_every_rank(tmp_path, workers, n, transport):
    ws = spawn(workers, tmp_path, n, "correct", transport=transport)
    for w in ws:
        assert w.proc.wait(120) == 0, w.proc.stderr.read()
    results = [[e for e in w.events if e["event"] == "result"] for w in ws]
    assert all(len(r) == 3 for r in results)
    for case in range(3):
        digests = {r[case]["digest"] for r in results}
        assert len(digests) == 1, f"case {case}: ranks differ"
        tol = 1e-2 if case == 1 else 1e-6  # bf16 buckets
        assert all(r[case]["rel_err"] < tol for r in results), results


@pytest.mark.parametrize("n", [3, 4])
def test_sigkill_mid_allreduce_fails_survivors_fast_and_smaller_ring_works(tmp_path, workers, n, transport):
    victim = 1
    ws = spawn(workers, tmp_path, n, "loop", victim, transport=transport)
    for w in ws:
        w.wait_event("running", 60)
    t_kill = time.time()
    ws[victim].proc.send_signal(signal.SIGKILL)
    survivors = [w for w in ws if w.rank != victim]
    for w in survivors:
        e = w.wait_event("error", 5)
        assert e["kind"] == "recoverable"
        assert e["t"] - t_kill < 1.0, f"rank {w.rank} took {e['t'] - t_kill:.3f}s to notice"
    for w in survivors:
        assert w.wait_event("reconfigured", 10)["ms"] < 100
    digests = {w.wait_event("after", 30)["digest"] for w in survivors}
    assert len(digests) == 1
    assert all(w.wait_event("after", 1)["max_err"] < 1e-4 for w in survivors)


def test_sigstopped_peer_gives_recoverable_error_at_the_timeout(tmp_path, workers, transport):
    victim = 2
    ws = spawn(workers, tmp_path, 3, "loop", victim, env={"FTAR_TIMEOUT": "1.0"}, transport=transport)
    for w in ws:
        w.wait_event("running", 60)
    t_stop = time.time()
    ws[victim].proc.send_signal(signal.SIGSTOP)
    for w in ws[:2]:
        e = w.wait_event("error", 5)
        # The stopped rank's neighbours time out (1 s); the other learns from them sooner or at 1 s.
        # Margins for a loaded 2-core machine: the timeout counts from a neighbour's last progress,
        # which may precede t_stop, and its error may be scheduled late (the default is 5 s).
        assert e["t"] - t_stop < 1.0 + 1.0, e
    assert max(w.wait_event("error", 0)["t"] for w in ws[:2]) - t_stop >= 0.6
    assert len({w.wait_event("after", 30)["digest"] for w in ws[:2]}) == 1


# -- in-process: several FTARs in one process, over real loopback sockets -----------------------

def make_ring(n, epochs=None, secrets=None, jobs=None, transport="tcp", **kw):
    fs = [FTAR((jobs or ["j"] * n)[r], r, 0, (secrets or ["s"] * n)[r],
               FTARSettings(chunk_bytes=1 << 12, num_chunks=2, transport=transport, **kw)) for r in range(n)]
    return fs


def connect_all(fs, epochs=None, timeout=5):
    addrs = [f.address for f in fs]
    errors: dict[int, BaseException] = {}

    def go(i, f):
        try:
            f.reconfigure((epochs or [1] * len(fs))[i], addrs, i)
        except BaseException as e:
            errors[i] = e

    ts = [threading.Thread(target=go, args=(i, f)) for i, f in enumerate(fs)]
    [t.start() for t in ts]
    [t.join(timeout) for t in ts]
    return errors


def close_all(fs):
    for f in fs:
        f.close()


def test_abort_from_another_thread_interrupts_a_blocked_allreduce_within_100ms(transport):
    fs = make_ring(2, timeout_s=30, transport=transport)
    try:
        assert connect_all(fs) == {}
        w = fs[0].allreduce([torch.ones(10000)])  # rank 1 never joins: rank 0 blocks
        queued = fs[0].allreduce([torch.ones(10)])
        time.sleep(0.2)
        t0 = time.monotonic()
        threading.Thread(target=fs[0].abort, args=("eviction of replica 1",)).start()
        with pytest.raises(RecoverableError, match="aborted: eviction of replica 1"):
            w.wait(5)
        assert time.monotonic() - t0 < 0.1
        with pytest.raises(RecoverableError, match="skipped"):
            queued.wait(1)
        assert queued.skipped
        later = fs[0].allreduce([torch.ones(10)])
        assert later.skipped and later.done()
    finally:
        close_all(fs)


def test_reconfigure_after_failure_restores_service(transport):
    fs = make_ring(3, transport=transport)
    try:
        assert connect_all(fs) == {}
        fs[0].abort("test")
        fs[1].abort("test")
        fs[2].abort("test")
        assert connect_all(fs, epochs=[2, 2, 2]) == {}
        xs = [torch.full((1001,), float(i + 1)) for i in range(3)]
        for w in [f.allreduce([x], divisor=3.0) for f, x in zip(fs, xs, strict=True)]:
            w.wait(10)
        assert all(torch.equal(x, torch.full((1001,), 2.0)) for x in xs)
    finally:
        close_all(fs)


def test_wrong_secret_is_refused(transport):
    fs = make_ring(2, secrets=["s", "other"], connect_timeout_s=1.0, transport=transport)
    try:
        errors = connect_all(fs)
        assert set(errors) == {0, 1}
        assert all(isinstance(e, RecoverableError) for e in errors.values())
        text = " ".join(str(e) for e in errors.values())
        assert "authentication failed (wrong job secret)" in text or "failed authentication" in text
    finally:
        close_all(fs)


def test_wrong_job_is_refused(transport):
    fs = make_ring(2, jobs=["a", "b"], connect_timeout_s=1.0, transport=transport)
    try:
        errors = connect_all(fs)
        text = " ".join(str(e) for e in errors.values())
        assert "another job, or a wrong job secret" in text and "'a'" not in text and "'b'" not in text, \
            "the peer learns neither job name"
        # The acceptor notes its refusal as it closes the connection: the dialer may fail first.
        deadline = time.monotonic() + 5.0
        while not any("job mismatch" in r for f in fs for r in f.transport.refusals) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert any("job mismatch" in r for f in fs for r in f.transport.refusals), "our own log says why"
    finally:
        close_all(fs)


def test_stale_epoch_is_refused(transport):
    fs = make_ring(2, connect_timeout_s=1.0, transport=transport)
    try:
        errors = connect_all(fs, epochs=[2, 1])
        assert isinstance(errors[1], RecoverableError)
        assert "stale epoch 1 < 2" in str(errors[1])
        assert any("stale epoch 1 < 2" in r for r in fs[0].transport.refusals)
    finally:
        close_all(fs)


def test_shape_mismatch_is_fatal_on_every_rank_without_a_hang(transport):
    fs = make_ring(3, timeout_s=10, transport=transport)
    try:
        assert connect_all(fs) == {}
        sizes = [5000, 5001, 5000]
        t0 = time.monotonic()
        works = [f.allreduce([torch.ones(n)]) for f, n in zip(fs, sizes, strict=True)]
        for w in works:
            with pytest.raises(FatalError, match="size/dtype mismatch"):
                w.wait(5)
        assert time.monotonic() - t0 < 2.0
    finally:
        close_all(fs)


def test_dtype_mismatch_is_fatal(transport):
    fs = make_ring(2, timeout_s=10, transport=transport)
    try:
        assert connect_all(fs) == {}
        works = [fs[0].allreduce([torch.ones(100)]), fs[1].allreduce([torch.ones(100, dtype=torch.bfloat16)])]
        for w in works:
            with pytest.raises(FatalError, match="dtype"):
                w.wait(5)
    finally:
        close_all(fs)


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_both_data_paths_agree_bitwise(staged, dtype, transport):
    fs = make_ring(3, staged=staged, transport=transport)
    try:
        assert connect_all(fs) == {}
        g = torch.Generator().manual_seed(3)
        base = [torch.randn(7777, generator=g).to(dtype) for _ in range(3)]
        xs = [b.clone() for b in base]
        for w in [f.allreduce([x], divisor=3.0) for f, x in zip(fs, xs, strict=True)]:
            w.wait(10)
        assert all(torch.equal(xs[0].view(torch.uint8), x.view(torch.uint8)) for x in xs)
        want = sum(b.double() for b in base) / 3
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (xs[0].double() - want).abs().max().item() < tol
    finally:
        close_all(fs)


def test_single_member_ring_only_scales():
    (f,) = make_ring(1)
    try:
        f.reconfigure(1, [f.address], 0)
        x = torch.full((5,), 4.0)
        f.allreduce([x], divisor=2.0).wait(1)
        assert torch.equal(x, torch.full((5,), 2.0))
    finally:
        f.close()


def test_bad_arguments_are_fatal_at_once():
    (f,) = make_ring(1)
    try:
        with pytest.raises(FatalError, match="contiguous"):
            f.allreduce([torch.ones(4, 4).t()])
        with pytest.raises(FatalError, match="op='sum' only"):
            f.allreduce([torch.ones(4)], op="max")
        with pytest.raises(FatalError, match="out of range"):
            f.reconfigure(1, [f.address], 3)
    finally:
        f.close()


def test_replica_leader_can_abort_another_rank_of_its_replica():
    # Two rings of rank 1 (replicas 0 and 1); the leader (rank 0) of replica 0 aborts its rank 1.
    # Any member of the job may abort (steady rounds need it); a process without the job's
    # secret may not.
    r1 = [FTAR("j", rid, 1, "s", FTARSettings(chunk_bytes=1 << 12, num_chunks=2, timeout_s=30)) for rid in range(2)]
    leader = FTAR("j", 0, 0, "s")
    stranger = FTAR("j", 1, 0, "not the job's secret")
    try:
        assert connect_all(r1) == {}
        w = r1[0].allreduce([torch.ones(1000)])  # replica 1's rank 1 never joins
        with pytest.raises(RecoverableError):
            stranger.abort_peer(r1[0].address, "not of this job", 1, timeout_s=1)
        assert not w.done()
        leader.abort("replica 2 evicted: SIGKILL")  # the leader aborts itself first, then forwards
        leader.abort_peer(r1[0].address, "stale: about epoch 0", 0)  # the ring is at epoch 1: ignored
        time.sleep(0.05)
        assert not w.done()
        t0 = time.monotonic()
        leader.abort_peer(r1[0].address, "replica 2 evicted: SIGKILL", 1)
        with pytest.raises(RecoverableError, match="aborted: replica 2 evicted: SIGKILL"):
            w.wait(5)
        # at once, not at the ring's 30 s timeout (bound loose for a loaded 2-core machine)
        assert time.monotonic() - t0 < 1.0
    finally:
        close_all(r1 + [leader, stranger])


def test_first_chunk_waits_for_a_late_peer_but_later_silence_times_out(transport):
    """A lagging replica calls in at once while contributors still run their backward: the
    first chunk may take long (start_timeout_s); silence mid-collective (timeout_s) may not."""
    fs = make_ring(2, timeout_s=0.3, start_timeout_s=5.0, transport=transport)
    try:
        assert connect_all(fs) == {}
        early = fs[0].allreduce([torch.ones(50000)])
        time.sleep(1.0)  # > timeout_s: the late peer is "still computing"
        late = fs[1].allreduce([torch.ones(50000)])
        early.wait(10)
        late.wait(10)
        assert torch.equal(early.tensors[0], torch.full((50000,), 2.0))
    finally:
        close_all(fs)


@pytest.mark.parametrize("bad, match", [
    (dict(chunk_bytes=0), "chunk_bytes=0 num_chunks=4"),
    (dict(num_chunks=0), "chunk_bytes=4194304 num_chunks=0"),
    (dict(chunk_bytes=1001), "chunk_bytes=1001 must be a multiple of 8"),
    (dict(timeout_s=0), "timeout_s=0 must be > 0"),
    (dict(connect_timeout_s=-1), "connect_timeout_s=-1 must be > 0"),
    (dict(start_timeout_s=-1), "start_timeout_s=-1 must be >= 0"),
])
def test_ftar_settings_refuse_impossible_values(bad, match):
    with pytest.raises(FatalError, match=match):
        FTARSettings(**bad)
