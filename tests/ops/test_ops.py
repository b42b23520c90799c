"""Torch data-plane ops and device dispatch (lightning_ft/ops, docs/ARCHITECTURE.md "The device data plane").

Values are checked bitwise against numpy: an independent nearest-even reference for bf16,
numpy's own float16 cast for fp16.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from bitcheck import assert_same_bits, bits

from lightning_ft import ops
from lightning_ft.ops import torch_copy_, torch_reduce_, torch_scale_

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 7, 4097, 65535]


def bf16_rne_reference(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits, nearest even, by comparing distances to both neighbours in float64.

    NaN inputs give some NaN. Independent of the bias trick the kernels use.
    """
    x = x.astype(np.float32)
    u = x.view(np.uint32)
    lo = (u >> 16).astype(np.uint32)  # truncated toward zero
    hi = lo + 1  # next bf16 away from zero; 0x7F80 / 0xFF80 is inf
    lo_val = (lo << 16).view(np.float32).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        hi_val = (hi << 16).view(np.float32).astype(np.float64)
        # Rounding treats inf as the next step (2**128) after the largest finite value.
        hi_val = np.where(np.isinf(hi_val) & ~np.isinf(lo_val), np.sign(hi_val) * 2.0**128, hi_val)
        x64 = x.astype(np.float64)
        d_lo, d_hi = np.abs(x64 - lo_val), np.abs(hi_val - x64)
    up = (d_hi < d_lo) | ((d_hi == d_lo) & (lo & 1 == 1))
    out = np.where(up, hi, lo).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), out)


def numpy_sum(recv: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """recv + local computed by numpy in fp32 and rounded to recv's dtype."""
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN are part of the special cases
        total = recv.float().numpy() + local.float().numpy()  # float32 + float32 in numpy: IEEE fp32
        if recv.dtype == torch.bfloat16:
            return torch.from_numpy(bf16_rne_reference(total).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(total.astype(np.float16 if recv.dtype == torch.float16 else np.float32))


def special_pairs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs whose sum rounds at a tie, just past one, overflows, is subnormal, signed zero, inf or NaN."""
    fin = torch.finfo(dtype)
    half_ulp_at_1 = fin.eps / 2
    half_ulp_at_max = fin.max / (2 - fin.eps) * fin.eps / 2  # max = (2 - eps) * 2**emax; ulp = eps * 2**emax
    inf, nan = float("inf"), float("nan")
    pairs = [
        (1.0, half_ulp_at_1),  # tie, 1.0 even: stays
        (1.0 + fin.eps, half_ulp_at_1),  # tie, odd: rounds up
        (-(1.0 + fin.eps), -half_ulp_at_1),  # same, negative
        (1.0, half_ulp_at_1 * (1 + 2**-4)),  # just past the tie: rounds up
        (1.0, half_ulp_at_1 * 0.75),  # below the tie: stays
        (fin.max, fin.max),  # overflow to inf
        (fin.max, half_ulp_at_max),  # tie at max (odd mantissa): rounds to inf
        (-fin.max, -fin.max),
        (fin.smallest_normal / 2, fin.smallest_normal / 4),  # subnormals
        (fin.smallest_normal * fin.eps, fin.smallest_normal * fin.eps),  # smallest subnormal, doubled
        (fin.smallest_normal * fin.eps, -fin.smallest_normal * fin.eps),  # +0
        (-0.0, -0.0),
        (0.0, -0.0),
        (inf, 1.0),
        (-inf, -inf),
        (inf, -inf),  # NaN
        (nan, 1.0),
        (-nan, 2.0),
        (3.0, 5.0),
    ]
    recv = torch.tensor([p[0] for p in pairs], dtype=torch.float64).to(dtype)
    local = torch.tensor([p[1] for p in pairs], dtype=torch.float64).to(dtype)
    return recv, local


def random_pair(n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype), (torch.randn(n, generator=g) * 0.3).to(dtype)


def test_bf16_reference_rounds_ties_to_even_and_overflows() -> None:
    tie_at_max = 2.0**128 - 2.0**119  # halfway between the largest bf16 (odd mantissa) and 2**128
    x = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20, -(1.0 + 3 * 2**-8),
                  tie_at_max, tie_at_max - 2.0**104, 1e-45], dtype=np.float32)
    assert bf16_rne_reference(x).tolist() == [0x3F80, 0x3F82, 0x3F81, 0xBF82, 0x7F80, 0x7F7F, 0x0000]


def test_torch_bf16_cast_is_round_to_nearest_even() -> None:
    g = np.random.default_rng(0)
    u = g.integers(0, 2**32, size=65535, dtype=np.uint32)
    u[:4096] = (u[:4096] & 0xFFFF0000) | 0x8000  # exact ties
    u[4096:8192] = (u[4096:8192] & 0xFFFF0000) | g.choice([0x7FFF, 0x8001], size=4096)  # near ties
    x = u.view(np.float32)
    x = x[~np.isnan(x)]
    got = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(got, bf16_rne_reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_reduce_matches_numpy_bitwise(dtype: torch.dtype, n: int) -> None:
    recv, local = random_pair(n, dtype, seed=n)
    out = torch.full_like(recv, 7.0)
    torch_reduce_(out, recv, local)
    assert torch.equal(bits(out), bits(numpy_sum(recv, local)))


def test_bf16_random_sums_include_ties_and_round_them_to_even() -> None:
    recv, local = random_pair(65535, torch.bfloat16)
    total = recv.float() + local.float()
    ties = (total.view(torch.int32) & 0xFFFF) == 0x8000
    assert ties.sum() > 1000  # the data exercises the tie rule
    out = torch.empty_like(recv)
    torch_reduce_(out, recv, local)
    truncated = (total.view(torch.int32) >> 16).to(torch.int16)
    assert torch.equal(bits(out)[ties] & 1, torch.zeros_like(bits(out)[ties]))
    assert not torch.equal(bits(out)[ties], truncated[ties])  # some ties round up, unlike truncation


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_special_values(dtype: torch.dtype) -> None:
    recv, local = special_pairs(dtype)
    out = torch.empty_like(recv)
    torch_reduce_(out, recv, local)
    assert_same_bits(out, numpy_sum(recv, local))
    assert out[5].isinf() and out[6].isinf() and out[15].isnan() and out[16].isnan()
    assert bits(out)[11] == bits(torch.tensor([-0.0], dtype=dtype))[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alias", ["recv", "local"])
def test_reduce_out_may_alias_an_input(dtype: torch.dtype, alias: str) -> None:
    recv, local = random_pair(4097, dtype)
    expected = numpy_sum(recv, local)
    out = recv if alias == "recv" else local
    torch_reduce_(out, recv, local)
    assert torch.equal(bits(out), bits(expected))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_fused_out2_gets_the_same_sum(dtype: torch.dtype) -> None:
    recv, local = random_pair(4097, dtype)
    out, out2 = torch.zeros_like(recv), torch.zeros_like(recv)
    torch_reduce_(out, recv, local, out2)
    expected = numpy_sum(recv, local)
    assert torch.equal(bits(out), bits(expected)) and torch.equal(bits(out2), bits(expected))


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_is_bit_exact(dtype: torch.dtype) -> None:
    src, _ = random_pair(4097, dtype)
    src[:3] = torch.tensor([float("nan"), -0.0, float("-inf")])
    dst = torch.zeros_like(src)
    torch_copy_(dst, src)
    assert torch.equal(bits(dst), bits(src))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("divisor", [3.0, 7.0])
def test_scale_divides_in_fp32_and_rounds(dtype: torch.dtype, divisor: float) -> None:
    t, _ = random_pair(4097, dtype)
    quotient = t.float().numpy() / np.float32(divisor)
    if dtype == torch.bfloat16:
        expected = torch.from_numpy(bf16_rne_reference(quotient).view(np.int16)).view(torch.bfloat16)
    else:
        expected = torch.from_numpy(quotient.astype(np.float16 if dtype == torch.float16 else np.float32))
    torch_scale_(t, divisor)
    assert torch.equal(bits(t), bits(expected))


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: (torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)), TypeError,
         r"recv dtype torch.bfloat16 != out dtype torch.float32"),
        (lambda: (torch.zeros(4), torch.zeros(5)), ValueError, r"recv has 5 elements != out 4"),
        (lambda: (torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)), TypeError,
         r"out has dtype torch.float64; supported"),
        (lambda: (torch.zeros(2, 2), torch.zeros(2, 2)), ValueError, r"out must be a flat contiguous 1-D"),
        (lambda: (torch.zeros(8), torch.zeros(8)[::2]), ValueError, r"recv must be a flat contiguous 1-D"),
    ],
)
def test_reduce_rejects_mismatched_operands(make, error: type, match: str) -> None:
    out, recv = make()
    with pytest.raises(error, match=match):
        ops.reduce_(out, recv, out)


def test_reduce_rejects_mismatched_out2() -> None:
    x = torch.zeros(4, dtype=torch.float16)
    with pytest.raises(TypeError, match=r"out2 dtype torch.float32 != out dtype torch.float16"):
        ops.reduce_(x, x, x, torch.zeros(4))
    with pytest.raises(ValueError, match=r"out2 has 3 elements != out 4"):
        ops.reduce_(x, x, x, torch.zeros(3, dtype=torch.float16))


def test_copy_and_scale_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"copy_: src has 3 elements != dst 4"):
        ops.copy_(torch.zeros(4), torch.zeros(3))
    with pytest.raises(TypeError, match=r"copy_: src dtype torch.float16 != dst dtype torch.float32"):
        ops.copy_(torch.zeros(4), torch.zeros(4, dtype=torch.float16))
    for divisor in (0.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"scale_: divisor must be finite and non-zero"):
            ops.scale_(torch.ones(4), divisor)


def test_cpu_tensors_dispatch_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_triton():
        raise AssertionError("CPU tensors must not reach the Triton kernels")

    monkeypatch.setattr(ops, "_triton_ops", no_triton)
    recv, local = random_pair(7, torch.bfloat16)
    out, out2 = torch.empty_like(recv), torch.empty_like(recv)
    ops.reduce_(out, recv, local, out2)
    assert torch.equal(bits(out), bits(numpy_sum(recv, local))) and torch.equal(bits(out2), bits(out))
    ops.copy_(out2, recv)
    assert torch.equal(bits(out2), bits(recv))
    ops.scale_(out2, 2.0)
    assert torch.equal(bits(out2), bits(recv / 2))


def test_importing_ops_does_not_import_the_triton_kernels() -> None:
    code = "import sys, lightning_ft.ops; print('lightning_ft.ops.triton_ops' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_dispatch_matches_torch_bitwise(dtype: torch.dtype) -> None:
    recv, local = (t.cuda() for t in random_pair(65535, dtype))
    out, out2, expected = torch.empty_like(recv), torch.empty_like(recv), torch.empty_like(recv)
    ops.reduce_(out, recv, local, out2)
    torch_reduce_(expected, recv, local)
    assert torch.equal(bits(out), bits(expected)) and torch.equal(bits(out2), bits(expected))
    recv_s, local_s = (t.cuda() for t in special_pairs(dtype))
    out_s, expected_s = torch.empty_like(recv_s), torch.empty_like(recv_s)
    ops.reduce_(out_s, recv_s, local_s)
    torch_reduce_(expected_s, recv_s, local_s)
    assert_same_bits(out_s, expected_s)
    ops.copy_(out, recv)
    assert torch.equal(bits(out), bits(recv))
