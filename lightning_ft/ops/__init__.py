"""FTAR data plane (docs/ARCHITECTURE.md, "The device data plane"): copy into the send buffer, reduce, scale.

`copy_`, `reduce_` and `scale_` pick the implementation by device: CUDA tensors go to the
Triton kernels when triton imports, everything else to torch. `torch_*` and `triton_*` name
one implementation explicitly, for tests and benchmarks.

`DeviceKernels` is what FTAR's device data path calls (docs/ARCHITECTURE.md, "The device
data plane"): the Triton kernels wherever they can run on the tensors (CUDA, or CPU tensors
under TRITON_INTERPRET=1, so that the device path's logic is testable on a CPU), torch
otherwise; it counts its calls.

`triton_ops` is imported on first use, never at import time, so that TRITON_INTERPRET=1
set before that first use still takes effect.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from lightning_ft.ops.torch_ops import SUPPORTED_DTYPES, torch_copy_, torch_reduce_, torch_scale_

__all__ = [
    "SUPPORTED_DTYPES",
    "DeviceKernels",
    "copy_",
    "reduce_",
    "scale_",
    "torch_copy_",
    "torch_reduce_",
    "torch_scale_",
    "triton_available",
    "triton_copy_",
    "triton_reduce_",
    "triton_scale_",
]

_TRITON_NAMES = {"triton_copy_": "copy_", "triton_reduce_": "reduce_", "triton_scale_": "scale_"}


@functools.cache
def triton_available() -> bool:
    """Whether triton imports in this environment."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_ops() -> ModuleType:
    from lightning_ft.ops import triton_ops

    return triton_ops


def __getattr__(name: str) -> Any:
    """Resolve triton_copy_, triton_reduce_ and triton_scale_ lazily."""
    if name in _TRITON_NAMES:
        return getattr(_triton_ops(), _TRITON_NAMES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_PROGRAMS: dict[str, int] = {}


def set_num_programs(n: int) -> None:
    """The grid size of the Triton kernels in this process (`ftar.num_programs`: the SMs the
    data plane may take from the model); the kernels' own default when never set."""
    if n < 1:
        raise ValueError(f"num_programs={n} must be >= 1")
    _PROGRAMS["n"] = int(n)


def _kw() -> dict[str, int]:
    return {"num_programs": _PROGRAMS["n"]} if "n" in _PROGRAMS else {}


def _use_triton(t: Tensor) -> bool:
    return t.is_cuda and triton_available()


def copy_(dst: Tensor, src: Tensor) -> None:
    """Copy src into dst (same dtype and numel), e.g. a user-buffer chunk into the send buffer."""
    if _use_triton(dst):
        _triton_ops().copy_(dst, src, **_kw())
    else:
        torch_copy_(dst, src)


def reduce_(out: Tensor, recv: Tensor, local: Tensor, out2: Tensor | None = None) -> None:
    """Write recv + local to out (the next hop's send buffer) and, if given, out2 (the user's buffer).

    fp32 compute, round to nearest even for 16-bit dtypes. out may be the same tensor as recv or local.
    """
    if _use_triton(out):
        _triton_ops().reduce_(out, recv, local, out2, **_kw())
    else:
        torch_reduce_(out, recv, local, out2)


def scale_(t: Tensor, divisor: float) -> None:
    """Divide t by divisor in place (fp32 compute, round to nearest even), e.g. to average."""
    if _use_triton(t):
        _triton_ops().scale_(t, divisor, **_kw())
    else:
        torch_scale_(t, divisor)


def interpreting() -> bool:
    """TRITON_INTERPRET=1: the Triton kernels run on CPU tensors (tests; slow)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


class DeviceKernels:
    """The data-plane ops of FTAR's device path for tensors on `device`.

    Triton (grid: `set_num_programs`, 2 by default) on CUDA tensors, and on CPU tensors when
    TRITON_INTERPRET=1; torch otherwise (CUDA without triton, or a forced device path on CPU
    without the interpreter). `calls` counts each op, for tests and reports.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.triton = triton_available() and (self.device.type == "cuda" or interpreting())
        self.name = "triton" if self.triton else "torch"
        self.calls: Counter = Counter()

    def copy_(self, dst: Tensor, src: Tensor) -> None:
        self.calls["copy"] += 1
        if self.triton:
            _triton_ops().copy_(dst, src, **_kw())
        else:
            torch_copy_(dst, src)

    def reduce_(self, out: Tensor, recv: Tensor, local: Tensor, out2: Tensor | None = None) -> None:
        self.calls["reduce"] += 1
        if self.triton:
            _triton_ops().reduce_(out, recv, local, out2, **_kw())
        else:
            torch_reduce_(out, recv, local, out2)

    def scale_(self, t: Tensor, divisor: float) -> None:
        self.calls["scale"] += 1
        if self.triton:
            _triton_ops().scale_(t, divisor, **_kw())
        else:
            torch_scale_(t, divisor)
