"""Torch data-plane ops for FTAR (docs/ARCHITECTURE.md, "The device data plane"): copy, reduce, scale.

This is the CPU fallback and the reference the Triton kernels are tested against.
It also holds the argument checks both implementations share.
All ops take flat, contiguous 1-D tensors of one dtype (float32, bfloat16 or float16).
16-bit inputs are computed in fp32 and rounded to nearest even on the way back.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_operands(op: str, **tensors: Tensor | None) -> None:
    """Check that every given tensor is flat, contiguous and matches the first one.

    Tensors passed as None (an absent optional operand) are ignored. A dtype problem raises
    TypeError, anything else ValueError; the message names the op and both operands.
    """
    given = [(name, t) for name, t in tensors.items() if t is not None]
    ref_name, ref = given[0]
    for name, t in given:
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; supported are float32, bfloat16, float16")
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(
                f"{op}: {name} must be a flat contiguous 1-D tensor, got shape {tuple(t.shape)} "
                f"stride {t.stride()}; pass t.view(-1) of a contiguous buffer"
            )
        if t.dtype != ref.dtype:
            raise TypeError(f"{op}: {name} dtype {t.dtype} != {ref_name} dtype {ref.dtype}")
        if t.numel() != ref.numel():
            raise ValueError(f"{op}: {name} has {t.numel()} elements != {ref_name} {ref.numel()}")
        if t.device != ref.device:
            raise ValueError(f"{op}: {name} is on {t.device} != {ref_name} on {ref.device}")


def check_divisor(divisor: float) -> None:
    """Reject a divisor that would turn the average into inf or NaN."""
    if divisor == 0 or not math.isfinite(divisor):
        raise ValueError(f"scale_: divisor must be finite and non-zero, got {divisor}")


def torch_copy_(dst: Tensor, src: Tensor) -> None:
    """Copy src into dst (same dtype and numel)."""
    check_operands("copy_", dst=dst, src=src)
    dst.copy_(src)


def torch_reduce_(out: Tensor, recv: Tensor, local: Tensor, out2: Tensor | None = None) -> None:
    """Write recv + local (fp32 compute, round to nearest even) to out and, if given, to out2.

    out may be the same tensor as recv or local.
    """
    check_operands("reduce_", out=out, recv=recv, local=local, out2=out2)
    # .float() is a no-op for fp32; for 16-bit it upcasts exactly, and writing into out rounds RNE.
    torch.add(recv.float(), local.float(), out=out)
    if out2 is not None:
        out2.copy_(out)


def torch_scale_(t: Tensor, divisor: float) -> None:
    """Divide t by divisor in place (fp32 compute, round to nearest even)."""
    check_operands("scale_", t=t)
    check_divisor(divisor)
    torch.div(t.float(), divisor, out=t)
