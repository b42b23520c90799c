"""The future of one FTAR all-reduce (engine.py completes it from its control thread)."""
from __future__ import annotations

import threading
from typing import Optional

import torch

from .transport.base import RecoverableError


class Work:
    """The future of one `allreduce` call."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.ready: list = []
        """CUDA events on the caller's streams at `allreduce`: the device path waits for them."""
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self.skipped = False
        self.seconds = 0.0
        """Wall time the control thread spent on it."""

    def _finish(self, error: Optional[BaseException] = None, skipped: bool = False) -> None:
        self._error = error
        self.skipped = skipped
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def exception(self) -> Optional[BaseException]:
        return self._error

    def wait_done(self, timeout: float) -> bool:
        """Block until done or `timeout`; whether it is done (raises nothing)."""
        return self._done.wait(timeout)

    def wait(self, timeout: Optional[float] = None) -> list[torch.Tensor]:
        """Block until done; raises the Work's error. `timeout` bounds the wait itself."""
        if not self._done.wait(timeout):
            raise RecoverableError(None, f"Work.wait timed out after {timeout}s")
        if self._error is not None:
            raise self._error
        return self.tensors
