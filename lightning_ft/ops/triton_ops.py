"""Triton data-plane kernels for FTAR (docs/ARCHITECTURE.md, "The device data plane"): copy, reduce, scale.

Each kernel runs on a small fixed grid (2 programs by default) and loops persistently over
blocks, so the all-reduce leaves nearly every SM to the training kernels beside it.
Arithmetic is fp32. bf16 is handled as raw int16 bits: the upcast is a shift and the
round to nearest even is integer arithmetic. This is exact on a GPU and also under
TRITON_INTERPRET=1, whose own bf16 add and bf16 cast are wrong (the cast truncates).

Import this module lazily (lightning_ft.ops does): TRITON_INTERPRET must be set before
the @triton.jit functions below are defined. Under the interpreter the ops take CPU tensors.
Kernels launch on the current CUDA stream of the tensors' device.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_ft.ops.torch_ops import check_divisor, check_operands

NUM_PROGRAMS = 2
"""Default grid size: programs (one per SM at most) that share the buffer."""
BLOCK = 4096
"""Default elements one program handles per loop iteration (a power of two)."""
NUM_WARPS = 8
"""Default warps per program."""

# KIND, the dtype a kernel computes on: fp32 is 0.
_FP16 = tl.constexpr(1)
_BF16 = tl.constexpr(2)
_KINDS = {torch.float32: 0, torch.float16: _FP16.value, torch.bfloat16: _BF16.value}
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


@triton.jit
def _load_f32(ptr, offs, mask, KIND: tl.constexpr):
    """Load a block as fp32; for bf16, ptr points at int16 bits."""
    if KIND == _BF16:
        bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _from_f32(x, KIND: tl.constexpr):
    """Round fp32 to the storage type (nearest even); bf16 comes back as int16 bits."""
    if KIND == _BF16:
        bits = x.to(tl.uint32, bitcast=True)
        mag = bits & 0x7FFFFFFF  # without the sign the add below cannot overflow
        rounded = (mag + (0x7FFF + ((mag >> 16) & 1))) >> 16
        quiet_nan = (mag >> 16) | 0x40
        half = tl.where(mag > 0x7F800000, quiet_nan, rounded) | ((bits >> 16) & 0x8000)
        return half.to(tl.int16)
    elif KIND == _FP16:
        return x.to(tl.float16)
    else:
        return x


@triton.jit
def _copy_kernel(dst_ptr, src_ptr, n, BLOCK: tl.constexpr):
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


@triton.jit
def _reduce_kernel(out_ptr, out2_ptr, recv_ptr, local_ptr, n,
                   BLOCK: tl.constexpr, KIND: tl.constexpr, HAS_OUT2: tl.constexpr):
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        total = _load_f32(recv_ptr, offs, mask, KIND) + _load_f32(local_ptr, offs, mask, KIND)
        value = _from_f32(total, KIND)
        tl.store(out_ptr + offs, value, mask=mask)
        if HAS_OUT2:
            tl.store(out2_ptr + offs, value, mask=mask)


@triton.jit
def _scale_kernel(ptr, divisor, n, BLOCK: tl.constexpr, KIND: tl.constexpr):
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        # div_rn: IEEE division; a plain `/` lowers to an approximate division on GPU.
        value = _from_f32(tl.math.div_rn(_load_f32(ptr, offs, mask, KIND), divisor), KIND)
        tl.store(ptr + offs, value, mask=mask)


def _check_launch(op: str, t: Tensor, num_programs: int, block: int) -> None:
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{op}: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {t.device}")
    if num_programs < 1:
        raise ValueError(f"{op}: num_programs must be >= 1, got {num_programs}")
    if block < 1 or block & (block - 1):
        raise ValueError(f"{op}: block must be a power of two, got {block}")
    if t.numel() >= 2**31:
        raise ValueError(f"{op}: {t.numel()} elements overflow int32 offsets; split the buffer")


def _kernel_view(t: Tensor) -> Tensor:
    """What the reduce and scale kernels read and write: int16 bits for bf16, else t."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _on_device(t: Tensor) -> contextlib.AbstractContextManager:
    """Launch on t's device, whatever the calling thread's current device is."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def copy_(dst: Tensor, src: Tensor, *, num_programs: int = NUM_PROGRAMS, block: int = BLOCK,
          num_warps: int = NUM_WARPS) -> None:
    """Copy src into dst (same dtype and numel) as raw bits."""
    check_operands("copy_", dst=dst, src=src)
    _check_launch("copy_", dst, num_programs, block)
    bits = _BITS[dst.dtype]
    with _on_device(dst):
        _copy_kernel[(num_programs,)](dst.view(bits), src.view(bits), dst.numel(),
                                      BLOCK=block, num_warps=num_warps)


def reduce_(out: Tensor, recv: Tensor, local: Tensor, out2: Tensor | None = None, *,
            num_programs: int = NUM_PROGRAMS, block: int = BLOCK, num_warps: int = NUM_WARPS) -> None:
    """Write recv + local (fp32 compute, round to nearest even) to out and, if given, to out2.

    out may be the same tensor as recv or local: each element is read before it is written.
    """
    check_operands("reduce_", out=out, recv=recv, local=local, out2=out2)
    _check_launch("reduce_", out, num_programs, block)
    out_v = _kernel_view(out)
    out2_v = out_v if out2 is None else _kernel_view(out2)
    with _on_device(out):
        _reduce_kernel[(num_programs,)](out_v, out2_v, _kernel_view(recv), _kernel_view(local), out.numel(),
                                        BLOCK=block, KIND=_KINDS[out.dtype], HAS_OUT2=out2 is not None,
                                        num_warps=num_warps)


def scale_(t: Tensor, divisor: float, *, num_programs: int = NUM_PROGRAMS, block: int = BLOCK,
           num_warps: int = NUM_WARPS) -> None:
    """Divide t by divisor in place (fp32 compute, round to nearest even)."""
    check_operands("scale_", t=t)
    check_divisor(divisor)
    _check_launch("scale_", t, num_programs, block)
    with _on_device(t):
        _scale_kernel[(num_programs,)](_kernel_view(t), float(divisor), t.numel(),
                                       BLOCK=block, KIND=_KINDS[t.dtype], num_warps=num_warps)
