"""Lightning callbacks' state, carried by catch-up and sync (docs/ARCHITECTURE.md, "Lightning
semantics").

A replica that catches up takes a healthy peer's weights, optimizer and schedulers; without
its callbacks' state it would also differ in what they decide. ModelCheckpoint keeps its top-k
in memory: a restarted one with fewer than `save_top_k` files saves without asking the others
(`reduce_boolean_decision`), the others ask, and the cross-replica reductions of that
validation pair different questions (CI: a 30 s wait for an answer that never came, and a
val_loss that differed between replicas). EarlyStopping's patience counter would restart at 0.

The states are Lightning's own (`Callback.state_dict`, keyed by `state_key`, as in a `.ckpt`),
beside the strategy's own per-step state that a catch-up must repeat (`extras`: the clip
that manual optimization asked for, strategy/manual_clip.py), serialized with torch.save and
loaded with `weights_only=True`: tensors, numbers, strings and containers. A state that holds
anything else is not carried (a warning says so).
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

    def __init__(self, trainer: Callable[[], Any], extras: Optional[dict[str, Any]] = None) -> None:
        """`extras`: name -> an object with state_dict() / load_state_dict(state)."""
        self._trainer = trainer
        self.extras = extras if extras is not None else {}
        self._warned: set[str] = set()

    def state_dict(self) -> Optional[str]:
        from lightning_ft.strategy.lightning_compat import callbacks_state_dict

        trainer = self._trainer()
        payload: dict[str, Any] = {name: obj.state_dict() for name, obj in self.extras.items()}
        payload = {k: v for k, v in payload.items() if v}
        states = callbacks_state_dict(trainer) if trainer is not None else {}
        if states:
            payload["callbacks"] = states
        if not payload:
            return None
        buf = io.BytesIO()
        torch.save(payload, buf)
        return base64.b64encode(buf.getvalue()).decode("ascii")

    def load_state_dict(self, encoded: str) -> None:
        from lightning_ft.strategy.lightning_compat import load_callbacks_state

        if not encoded:
            return
        try:
            payload = torch.load(io.BytesIO(base64.b64decode(encoded)), weights_only=True)
        except Exception as e:  # a user callback's state that weights_only refuses
            key = type(e).__name__
            if key not in self._warned:
                self._warned.add(key)
                log.warning("catch-up: the callbacks' state could not be loaded (%s); callbacks keep their own", e)
            return
        if not isinstance(payload, dict):
            return
        for name, obj in self.extras.items():
            obj.load_state_dict(payload.get(name))
        trainer = self._trainer()
        if trainer is not None and isinstance(payload.get("callbacks"), dict):
            load_callbacks_state(trainer, payload["callbacks"])
