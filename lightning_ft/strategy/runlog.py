"""The strategy's run logs: `replica_{rid}/steps.jsonl` (one row per optimizer step),
`replica_{rid}/final.json` (state digests at the end) and the per-step FT metrics through
the Lightning logger (docs/ARCHITECTURE.md, "Observability")."""
from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


def replica_dir(rid: int) -> str:
    d = os.path.join(os.environ.get("LFT_RUN_DIR", "."), f"replica_{rid}")
    os.makedirs(d, exist_ok=True)
    return d


class StepLog:
    """steps.jsonl of one replica (written by its rank 0)."""

    def __init__(self, rid: int, incarnation: int) -> None:
        self.rid, self.incarnation = rid, incarnation
        self._file: Any = None

    def write(self, mgr: Any, loss: Any, caught_up: bool, seconds: float, phases: dict[str, float]) -> None:
        plan, st = mgr.last_plan, mgr.stats
        if plan is None:
            return
        if self._file is None:
            self._file = open(os.path.join(replica_dir(self.rid), "steps.jsonl"), "a", buffering=1)
        row = {"t": time.time(), "rid": self.rid, "inc": self.incarnation, "step": mgr.step, "gen": mgr.gen,
               "loss": float(loss) if torch.is_tensor(loss) or isinstance(loss, float) else None,
               "contributors": list(plan.quorum.contributors), "epoch": plan.quorum.epoch, "role": plan.role,
               "lr_factor": plan.lr_factor, "slots": 1 + len(plan.extra) if plan.role == "train" else 0,
               "caught_up": caught_up, "call_s": round(seconds, 6),
               "quorum_ms": round(st.quorum_s * 1e3, 3), "reconf_ms": round(st.reconfigure_s * 1e3, 3),
               "exchange_ms": round(st.exchange_s * 1e3, 3), "freeze_ms": round(st.freeze_s * 1e3, 3),
               "catchup_ms": round(st.catchup_s * 1e3, 3), "digest_ms": round(st.digest_s * 1e3, 3),
               "retries": st.retries, **{k: round(v, 3) for k, v in phases.items()}}
        self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def write_final(mgr: Any, model: torch.nn.Module, optimizer: Any, rank: int, recomputes: int) -> None:
    """final.json: committed steps and a sha256 digest of every rank's state."""
    from lightning_ft.replica.digest import state_digest

    digests = mgr.gather(state_digest(model, optimizer))
    if rank == 0:
        with open(os.path.join(replica_dir(mgr.rid), "final.json"), "w") as f:
            json.dump({"rid": mgr.rid, "incarnation": mgr.incarnation, "step": mgr.step, "gen": mgr.gen,
                       "cursor": mgr.cursor, "digest": digests, "recomputes": recomputes,
                       "scaler": mgr.scaler.state_dict() if mgr.scaler is not None else None,
                       "amp_skipped": mgr.scaler.skipped if mgr.scaler is not None else 0}, f)


def metrics(mgr: Any, num_replicas: int) -> dict[str, float]:
    plan = mgr.last_plan if mgr is not None else None
    if plan is None:
        return {}
    st = mgr.stats
    gb = mgr.exchange.buckets.nbytes / 1e9 if mgr.started else 0.0
    return {"ft/healthy": float(len(plan.quorum.contributors)), "ft/total": float(num_replicas),
            "ft/epoch": float(plan.quorum.epoch), "ft/lr_factor": plan.lr_factor,
            "ft/ftar_gbps": gb / st.exchange_s if st.exchange_s > 0 else 0.0,
            "ft/retries": float(st.retries), "ft/catchup_ms": st.catchup_s * 1e3}


class FTMetrics(Callback):
    """Per-step FT metrics through the Lightning logger (read by `lightning-ft report`)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        from lightning_ft.strategy.lightning_compat import should_update_logs

        if not should_update_logs(trainer):
            return  # logging every step costs milliseconds; loggers only write every n steps
        m: Optional[dict] = metrics(self.strategy.replica, self.strategy.num_replicas)
        if m:
            pl_module.log_dict(m, on_step=True, on_epoch=False, batch_size=1, sync_dist=False)
