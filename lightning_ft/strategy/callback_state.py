"""Lightning callbacks' state, carried by catch-up and sync (docs/ARCHITECTURE.md, "Lightning
semantics").

A replica that catches up takes a healthy peer's weights, optimizer and schedulers; without
its callbacks' state it would also differ in what they decide. ModelCheckpoint keeps its top-k
in memory: a restarted one with fewer than `save_top_k` files saves without asking the others
(`reduce_boolean_decision`), the others ask, and the cross-replica reductions of that
validation pair different questions (CI: a 30 s wait for an answer that never came, and a
val_loss that differed between replicas). EarlyStopping's patience counter would restart at 0.

The states are Lightning's own (`Callback.state_dict`, keyed by `state_key`, as in a `.ckpt`),
serialized with torch.save and loaded with `weights_only=True`: tensors, numbers, strings and
containers. A callback whose state holds anything else is not carried (a warning says which).
"""
from __future__ import annotations

import base64
import io
import logging
from typing import Any, Callable, Optional

import torch

log = logging.getLogger("lightning_ft.strategy")


class CallbackState:
    """`state_dict()` -> the trainer's callbacks' states as a string (None: none to carry);
    `load_state_dict(s)` applies one. The manager puts it in the catch-up meta."""

    def __init__(self, trainer: Callable[[], Any]) -> None:
        self._trainer = trainer
        self._warned: set[str] = set()

    def state_dict(self) -> Optional[str]:
        from lightning.pytorch.trainer import call

        trainer = self._trainer()
        if trainer is None:
            return None
        states = call._call_callbacks_state_dict(trainer)
        if not states:
            return None
        buf = io.BytesIO()
        torch.save(states, buf)
        return base64.b64encode(buf.getvalue()).decode("ascii")

    def load_state_dict(self, encoded: str) -> None:
        from lightning.pytorch.trainer import call

        trainer = self._trainer()
        if trainer is None or not encoded:
            return
        try:
            states = torch.load(io.BytesIO(base64.b64decode(encoded)), weights_only=True)
        except Exception as e:  # a user callback's state that weights_only refuses
            key = type(e).__name__
            if key not in self._warned:
                self._warned.add(key)
                log.warning("catch-up: the callbacks' state could not be loaded (%s); callbacks keep their own", e)
            return
        if isinstance(states, dict):
            call._call_callbacks_load_state_dict(trainer, {"callbacks": states})
