"""Persistent checkpoints of a replica under Lightning (docs/ARCHITECTURE.md, "Checkpoints").

Every `checkpoint.every_n_steps` committed steps the lowest-id contributor writes one
(asynchronously: the step waits only for an in-memory copy). The ledger record of the step
is flushed first, so a checkpoint never holds a step the ledger does not know: when the ledger
refuses the writer's records (it was evicted, or its lease lapsed: `disowned`), no checkpoint
is written. A rewind to such a checkpoint would restore a state, and cursors, past batches
the ledger never recorded: the final history would miss them."""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import torch.distributed as dist

from lightning_ft.replica import ledger
from lightning_ft.replica.checkpoint import CheckpointWriter, publish, unpublish_missing
from lightning_ft.replica.optimizers import unwrap
from lightning_ft.strategy.runlog import replica_dir

log = logging.getLogger(__name__)


class ReplicaCheckpoints:
    def __init__(self, mgr: Any, root: str, keep: int, every: int, rank: int, world: int, rid: int) -> None:
        self.mgr, self.root, self.every, self.rid = mgr, root, every, rid
        pg = dist.new_group(backend="gloo") if world > 1 else None
        self.writer = CheckpointWriter(root, keep, rank, pg, on_done=self._done)
        self.stage_ms = 0.0
        # Imported at set-up, where a job pays its other one-time costs: the first save would
        # otherwise spend about 0.8 s of CPU importing torch.distributed.checkpoint mid-training.
        import torch.distributed.checkpoint  # noqa: F401
        import torch.distributed.checkpoint.state_dict  # noqa: F401

    def maybe_save(self, model: Any, optimizer: Any, schedulers: Any, committed: int, rank: int) -> None:
        mgr = self.mgr
        plan = mgr.last_plan
        if plan is None or committed == 0 or mgr.step % self.every or self.rid != min(plan.quorum.contributors):
            return
        q = plan.quorum
        cursors = {}
        recorded = mgr.flush_ledger() if rank == 0 else True
        if not mgr.broadcast(recorded):  # every rank of the writer saves, or none does
            log.warning("replica %d: no checkpoint at step %d: the ledger refused this replica's records",
                        self.rid, mgr.step)
            return
        if rank == 0:
            for slot in range(mgr.R):
                if slot in q.contributors:  # a round continuing a batch advanced none (rule 15)
                    cursors[slot] = q.cursor_of(slot) + (0 if q.cont else 1)
                else:
                    cursors[slot] = ledger.read_cursor(mgr.store, mgr.root, slot, mgr.gen)
        meta = {"step": mgr.step, "batches": mgr.batches, "job": mgr.job, "replicas": mgr.R, "writer": mgr.rid,
                "gen": mgr.gen,
                "cursors": {str(k): v for k, v in cursors.items()},
                "quorum": {"round": q.round, "epoch": q.epoch, "members": list(q.members),
                           "contributors": list(q.contributors)}}
        extra = {"step": mgr.step, "schedulers": schedulers.state_dict(),
                 "scaler": mgr.scaler.state_dict() if mgr.scaler is not None else None,
                 "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}
        self.writer.protect = q.verified_step
        stats = self.writer.save(mgr.step, model, unwrap(optimizer), extra, meta)
        self.stage_ms = stats.stage_s * 1e3

    def _done(self, step: int, path: str, stats: Any) -> None:
        """Writer rank 0, background thread: publish and record the complete checkpoint."""
        mgr = self.mgr
        try:
            publish(mgr.store, mgr.root, step, path, mgr.gen)
            unpublish_missing(mgr.store, mgr.root, self.root)
        except Exception as e:
            log.warning("could not publish checkpoint %s in etcd: %s", path, e)
        with open(os.path.join(replica_dir(self.rid), "checkpoints.jsonl"), "a") as f:
            f.write(json.dumps({"t": time.time(), "step": step, "path": path, "stage_s": round(stats.stage_s, 4),
                                "write_s": round(stats.write_s, 4), "bytes": stats.bytes}) + "\n")

    def close(self) -> None:
        self.writer.wait(120)  # let the last checkpoint finish writing
