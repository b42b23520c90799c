"""Bitwise comparison helpers shared by the ops tests (torch path and Triton interpreter)."""
import torch

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.dtype])


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bitwise equal, except that any NaN matches any NaN (implementations pick different NaN bits)."""
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan), "NaN positions differ"
    diff = (bits(actual) != bits(expected)) & ~nan
    assert not diff.any(), f"{int(diff.sum())} elements differ, first at {int(diff.nonzero()[0])}"
