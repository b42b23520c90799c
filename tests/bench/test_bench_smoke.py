"""Benchmarks run at small sizes: they print the JSON they promise, with sane values."""
from __future__ import annotations

import json
import subprocess
import sys


def run_bench(*args: str, timeout: float = 300) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]


def test_quorum_bench_prints_percentiles():
    rows = run_bench("lightning_ft.bench.quorum", "--leaders", "2", "--rounds", "10")
    assert rows[0]["bench"] == "quorum" and rows[0]["leaders"] == 2
    assert 0 < rows[0]["p50_ms"] <= rows[0]["p99_ms"] < 5000


def test_ftar_bench_runs_ftar_and_gloo_side_by_side():
    rows = run_bench("lightning_ft.bench.ftar", "--ranks", "2", "--size-mb", "1", "--iters", "2")
    assert [r["transport"] for r in rows] == ["tcp", "shm"]
    for r in rows:
        assert r["bench"] == "ftar" and r["ranks"] == 2 and r["ftar_busbw_gbps"] > 0 and r["gloo_busbw_gbps"] > 0
        assert abs(r["ratio"] - r["ftar_busbw_gbps"] / r["gloo_busbw_gbps"]) < 0.01
        assert len(r["loadavg"].split()) == 3


def test_kernels_bench_says_no_gpu_on_cpu():
    import torch

    rows = run_bench("lightning_ft.bench.kernels", "--quick")
    if not torch.cuda.is_available():
        assert rows == [{"bench": "kernels", "skipped": "no GPU"}]


def test_recovery_bench_quick_meets_its_stall_bounds():
    (r,) = run_bench("lightning_ft.bench.recovery", "--quick", "--ttl", "1", timeout=400)
    assert r["bench"] == "recovery"
    assert r["kill_stall_s"] < 1.0
    assert r["hang_stall_s"] <= r["ttl_s"] + 1.0
    assert r["catchup_gbps"] > 0


def test_overhead_bench_runs_ft_hsdp_and_ddp_side_by_side():
    rows = run_bench("lightning_ft.bench.overhead", "--steps", "14", "--warmup", "4", "--rounds", "1",
                     "--width", "64", "--depth", "2", "--batch", "16", timeout=400)
    final = rows[-1]
    assert final["bench"] == "overhead" and final["ft_step_s"] > 0 and final["ddp_step_s"] > 0
    assert abs(final["ratio"] - final["ft_step_s"] / final["ddp_step_s"]) < 1e-3
    assert {r["strategy"] for r in rows if r["bench"] == "overhead_round"} == {"ft", "ddp"}


import pytest  # noqa: E402


@pytest.mark.slow
def test_goodput_bench_ft_beats_restart_the_world():
    rows = run_bench("lightning_ft.bench.goodput", "--steps", "130", "--every", "60", "--ckpt-every", "50",
                     timeout=900)
    final = rows[-1]
    assert final["bench"] == "goodput" and final["failures"] >= 1 and final["restart_failures"] >= 1
    assert final["ft_ett"] > final["restart_ett"] > 0
