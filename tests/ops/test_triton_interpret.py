"""Triton data-plane kernels under TRITON_INTERPRET=1 (lightning_ft/ops/triton_ops.py,
docs/ARCHITECTURE.md, "The device data plane").

TRITON_INTERPRET must be set before the kernels are defined, so the kernel checks (`check_*`)
run in a pytest subprocess with TRITON_INTERPRET=1, started by
test_kernel_checks_pass_under_the_interpreter; its report shows each check. To run them directly:
    TRITON_INTERPRET=1 pytest tests/ops/test_triton_interpret.py -o python_functions=check_*
Every result must equal the torch path bit for bit.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the Triton kernels cannot be tested")

from bitcheck import assert_same_bits, bits  # noqa: E402

from lightning_ft import ops  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The interpreter computes with numpy, which warns when a special-value case overflows or makes a NaN.
numpy_overflow_ok = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
numpy_nan_ok = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (n, block): small blocks make the persistent loop go round many times; 65535 uses the default block.
SHAPES = [(1, 64), (7, 4), (4097, 128), (65535, 4096)]
PROGRAMS = [1, 2, 3]


def random_pair(n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype), (torch.randn(n, generator=g) * 0.3).to(dtype)


def special_pair(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Ties, overflow, subnormals, signed zeros, inf and NaN, each in a small sum."""
    fin = torch.finfo(dtype)
    half_ulp_at_max = fin.max / (2 - fin.eps) * fin.eps / 2
    tiny = fin.smallest_normal * fin.eps
    inf, nan = float("inf"), float("nan")
    pairs = [(1.0, fin.eps / 2), (1.0 + fin.eps, fin.eps / 2), (-(1.0 + fin.eps), -fin.eps / 2),
             (fin.max, fin.max), (fin.max, half_ulp_at_max), (fin.max, -half_ulp_at_max),
             (tiny, tiny), (tiny, -tiny), (fin.smallest_normal / 2, tiny), (-0.0, -0.0), (0.0, -0.0),
             (inf, 1.0), (-inf, -inf), (inf, -inf), (nan, 1.0), (-nan, -1.0)]
    recv = torch.tensor([p[0] for p in pairs], dtype=torch.float64).to(dtype)
    local = torch.tensor([p[1] for p in pairs], dtype=torch.float64).to(dtype)
    return recv, local


def torch_sum(recv: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    expected = torch.empty_like(recv)
    ops.torch_reduce_(expected, recv, local)
    return expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "block"), SHAPES)
def check_reduce_equals_torch_bitwise(dtype: torch.dtype, n: int, block: int) -> None:
    recv, local = random_pair(n, dtype, seed=n)
    expected = torch_sum(recv, local)
    for num_programs in PROGRAMS:
        out = torch.full_like(recv, 7.0)
        ops.triton_reduce_(out, recv, local, num_programs=num_programs, block=block)
        assert torch.equal(bits(out), bits(expected)), f"num_programs={num_programs}"


@numpy_overflow_ok
@numpy_nan_ok
@pytest.mark.parametrize("dtype", DTYPES)
def check_reduce_special_values_equal_torch(dtype: torch.dtype) -> None:
    recv, local = special_pair(dtype)
    out = torch.empty_like(recv)
    ops.triton_reduce_(out, recv, local, block=4)
    assert_same_bits(out, torch_sum(recv, local))


@numpy_nan_ok
def check_reduce_bf16_nan_stays_a_quiet_nan_with_its_sign() -> None:
    recv = torch.tensor([0x7F81, 0xFF81, 0x7FC0], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    out = torch.empty_like(recv)
    ops.triton_reduce_(out, recv, torch.ones_like(recv))
    assert [b & 0xFFFF for b in bits(out).tolist()] == [0x7FC1, 0xFFC1, 0x7FC0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alias", ["recv", "local"])
def check_reduce_out_may_alias_an_input(dtype: torch.dtype, alias: str) -> None:
    for num_programs in PROGRAMS:
        recv, local = random_pair(4097, dtype)
        expected = torch_sum(recv, local)
        out2 = torch.zeros_like(recv)
        ops.triton_reduce_(recv if alias == "recv" else local, recv, local, out2,
                           num_programs=num_programs, block=256)
        out = recv if alias == "recv" else local
        assert torch.equal(bits(out), bits(expected)), f"num_programs={num_programs}"
        assert torch.equal(bits(out2), bits(expected)), f"num_programs={num_programs}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "block"), SHAPES)
def check_reduce_fused_out2_gets_the_same_sum(dtype: torch.dtype, n: int, block: int) -> None:
    recv, local = random_pair(n, dtype, seed=n + 1)
    expected = torch_sum(recv, local)
    out, out2 = torch.zeros_like(recv), torch.zeros_like(recv)
    ops.triton_reduce_(out, recv, local, out2, num_programs=3, block=block)
    assert torch.equal(bits(out), bits(expected)) and torch.equal(bits(out2), bits(expected))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "block"), SHAPES)
def check_copy_is_bit_exact(dtype: torch.dtype, n: int, block: int) -> None:
    src, _ = random_pair(n, dtype)
    src[0] = float("nan")
    for num_programs in PROGRAMS:
        dst = torch.zeros_like(src)
        ops.triton_copy_(dst, src, num_programs=num_programs, block=block)
        assert torch.equal(bits(dst), bits(src)), f"num_programs={num_programs}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("divisor", [3.0, 7.0])
def check_scale_equals_torch_bitwise(dtype: torch.dtype, divisor: float) -> None:
    t, _ = random_pair(4097, dtype)
    special, _ = special_pair(dtype)
    t[: special.numel()] = special
    expected = t.clone()
    ops.torch_scale_(expected, divisor)
    for num_programs in PROGRAMS:
        actual = t.clone()
        ops.triton_scale_(actual, divisor, num_programs=num_programs, block=128)
        assert_same_bits(actual, expected)


def check_launch_arguments_are_checked() -> None:
    x = torch.zeros(8)
    with pytest.raises(ValueError, match=r"num_programs must be >= 1, got 0"):
        ops.triton_reduce_(x, x, x, num_programs=0)
    with pytest.raises(ValueError, match=r"block must be a power of two, got 96"):
        ops.triton_copy_(x, x, block=96)
    with pytest.raises(TypeError, match=r"local dtype torch.float16 != out dtype torch.float32"):
        ops.triton_reduce_(x, x, x.half())


@pytest.mark.skipif(INTERPRET, reason="checks the error without the interpreter")
def test_cpu_tensors_without_interpreter_are_refused() -> None:
    x = torch.zeros(8)
    with pytest.raises(ValueError, match=r"reduce_: Triton kernels need CUDA tensors"):
        ops.triton_reduce_(x, x, x)


def test_kernel_checks_pass_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-p", "no:cacheprovider",
         "-o", "python_functions=check_*"],
        cwd=root, env=env, capture_output=True, text=True, timeout=120,
    )
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    summary = proc.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 40 and "skipped" not in summary, report
