"""State transfer (docs/ARCHITECTURE.md, "Catch-up"; "Sync rounds"): publishing a snapshot for
the lagging, fetching one (a catch-up, with our zeros on the wire), sync rounds (the job's
start, resumes, rewinds: a source publishes and the others adopt), and loading checkpoints."""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Optional, cast

import torch

from lightning_ft.coord.quorum import Quorum
from lightning_ft.replica import ledger
from lightning_ft.replica import startup
from lightning_ft.replica.catchup.wire import CatchupError
from lightning_ft.replica.optimizers import unwrap
from lightning_ft.replica.state import (materialize_optimizer_state)

from lightning_ft.replica.history import History
from lightning_ft.replica.plan import FAILED, LOST, OK, ReplicaStateLost, StepPlan

log = logging.getLogger(__name__)


class Sync(History):
    """Catch-up fetches, sync rounds and checkpoint loads (over history)."""

    def _publish_snapshot(self, q: Quorum) -> None:
        expected = set()
        for lag in q.lagging:
            if q.contributors[(lag + self.rank) % len(q.contributors)] == self.rid:
                expected.add(f"{lag}/{self.rank}")
        self.catchup.publish(self.step, self.state_tensors(), self._meta(), expected)

    def _fetch(self, plan: StepPlan, deadline_s: float) -> int:
        """Fetch the state of version plan.step from our source into our tensors: OK, FAILED
        (nothing written: retry next round) or LOST (partly overwritten)."""
        q = plan.quorum
        src = q.contributors[(self.rid + self.rank) % len(q.contributors)]
        got_round, addr = self._src_state
        if got_round != q.round or not addr:
            log.warning("replica %d rank %d: no state-server address of replica %d for round %d (it is gone)",
                        self.rid, self.rank, src, q.round)
            return FAILED
        vote = self.fetch_from(addr, plan.step, src, deadline_s)
        if vote == OK:
            st = self.stats
            log.info("replica %d rank %d %s step %d from replica %d: %.1f MB in %.3fs (%.2f GB/s)", self.rid,
                     self.rank, "adopted" if plan.sync else "caught up to", plan.step, src, st.catchup_mb,
                     st.catchup_s, st.catchup_gbps)
        return vote

    def fetch_from(self, addr: str, step: int, src: int, deadline_s: float) -> int:
        """Fetch version `step` of replica `src`'s state (this rank's shard, from `addr`) into our
        tensors and apply its meta: OK, FAILED (nothing written) or LOST (partly overwritten)."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + deadline_s
        materialize_optimizer_state(self.optimizer)
        into = self.state_tensors()
        while True:
            try:
                with torch.no_grad():
                    meta, stats = self.catchup.fetch(addr, step, into, f"{self.rid}/{self.rank}",
                                                     timeout_s=max(10.0, self.settings.ftar_timeout_s * 2),
                                                     param_groups=self.optimizer.param_groups)
                break
            except CatchupError as e:
                # The source publishes right after it gets the same quorum (or, in a rewind, after
                # it loaded the checkpoint); we may be early.
                if e.not_yet_published(step) and time.monotonic() < deadline:
                    time.sleep(0.002)
                    continue
                log.warning("replica %d rank %d: catch-up from replica %d failed: %s", self.rid, self.rank, src, e)
                return LOST if e.partial else FAILED
        # verified (catchup_wire.check_meta): as many groups as ours, known keys only
        for g, saved in zip(self.optimizer.param_groups, meta["param_groups"], strict=True):
            g.update(saved)
        if self.scheduler is not None and meta.get("scheduler") is not None:
            self.scheduler.load_state_dict(meta["scheduler"])
        if self.scaler is not None and meta.get("scaler") is not None:
            self.scaler.load_state_dict(meta["scaler"])
        self.batches = int(meta.get("batches", step))
        if self.callbacks is not None and meta.get("callbacks"):
            self.callbacks.load_state_dict(meta["callbacks"])
        self.stats.catchup_s = time.perf_counter() - t0
        startup.mark("caught_up")
        self.stats.catchup_gbps = stats.get("gbps", 0.0)
        self.stats.catchup_mb = stats.get("bytes", 0) / 1e6
        return OK

    # -- sync rounds: the job's start, resumes and rewinds ---------------------------------------
    def _sync(self, plan: StepPlan) -> bool:
        """A sync round: the source (loading the rewind's checkpoint first, if any) publishes
        its state, every other member adopts it. Returns whether the round succeeded here."""
        q = plan.quorum
        t0 = time.perf_counter()
        self.disarm()
        vote, cursors = OK, None
        if plan.role == "source":
            rw = q.rewind or {}
            if rw.get("checkpoint"):
                at = int(cast(int, rw["checkpoint_step"]))
                vote, cursors = self._load_rewind_checkpoint(str(rw["checkpoint"]), at)
            if vote == OK and rw and self.is_leader:
                self._start_generation(q, cursors)
            if vote == OK:
                self.step = q.max_step
                materialize_optimizer_state(self.optimizer)  # a fresh source has no optimizer state yet
                self._publish_snapshot(q)
        else:
            vote = self._fetch(plan, deadline_s=self.settings.sync_timeout_s)
        vote = self.group.vote(vote)
        if vote == LOST:
            raise ReplicaStateLost(f"replica {self.rid}: adopting replica {q.source}'s state failed midway; the "
                                   "state is partly overwritten, so this replica exits to restart fresh")
        if vote != OK:
            return False
        self.state = self.state.adopted(q.max_step, q.gen, (q.round, q.epoch))
        if q.rewind is not None:
            cur = ledger.read_cursor(self.store, self.root, self.rid, q.gen) if self.is_leader else 0
            self.cursor = self.group.broadcast(cur)
        self._take_digest()
        seconds = time.perf_counter() - t0
        if plan.role == "adopt" and self.is_leader:
            st = self.stats
            print(f"lightning-ft: replica {self.rid} adopted replica {q.source}'s state at step {q.max_step}"
                  f"{' (rewind)' if q.rewind else ''}: {st.catchup_mb:.1f} MB per rank in {seconds:.3f} s "
                  f"({st.catchup_gbps:.2f} GB/s)", flush=True)
            self.event("sync", replica=self.rid, source=q.source, step=q.max_step, gen=q.gen,
                       rewind=q.rewind is not None, seconds=round(seconds, 4), mb=round(st.catchup_mb, 3))
        if self.on_state_replaced is not None:
            self.on_state_replaced(plan)
        return True

    def _load_rewind_checkpoint(self, path: str, step: int) -> tuple[int, Optional[dict]]:
        """Load the rewind's checkpoint (every rank its shard); (vote, cursors of its meta)."""
        from lightning_ft.replica.checkpoint import CheckpointInvalid, verify

        why = ""
        if self.is_leader:
            try:
                verify(path)
            except CheckpointInvalid as e:
                why = str(e)
        why = self.group.broadcast(why)  # every rank loads, or none does (the load is a collective)
        if why:
            log.error("replica %d: the rewind's checkpoint does not verify: %s", self.rid, why)
            self._bad_ckpts.add(step)
            return FAILED, None
        try:
            self.load_checkpoint(path)
            meta = json.load(open(os.path.join(path, "meta.json")))
            return OK, {int(s): int(k) for s, k in meta.get("cursors", {}).items()}
        except (CheckpointInvalid, OSError, RuntimeError, ValueError, KeyError) as e:
            log.error("replica %d: cannot load the rewind's checkpoint %s: %s", self.rid, path, e)
            self._bad_ckpts.add(step)
            return FAILED, None

    def load_checkpoint(self, path: str) -> dict:
        """Load a persistent checkpoint into this rank's model, optimizer and scheduler;
        returns its meta. Used by `--resume` (before `start`) and by rewinds."""
        from lightning_ft.replica.checkpoint import load

        materialize_optimizer_state(self.optimizer)
        got = load(path, self.model, unwrap(self.optimizer), pg=None if self.world == 1 else self.pg)
        extra = got["extra"]
        for g, saved in zip(self.optimizer.param_groups, extra["param_groups"], strict=True):
            g.update(saved)
        if self.scheduler is not None and extra.get("schedulers") is not None:
            self.scheduler.load_state_dict(extra["schedulers"])
        if self.scaler is not None and extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])
        self.step = int(got["meta"]["step"])
        self.batches = int(got["meta"].get("batches", self.step))
        return got["meta"]

    def _start_generation(self, q: Quorum, cursors: Optional[dict[int, int]]) -> None:
        """Leader of a rewind's source: seed the new generation's cursors (the checkpoint's, or
        the ledger's at the step we hold) and retire the checkpoints of the discarded future."""
        from lightning_ft.replica.checkpoint import supersede

        T = q.max_step
        if cursors is None:
            cursors = ledger.cursors_at(self.store, self.root, T, range(self.R))
        rw = q.rewind
        assert rw is not None  # a rewind's round
        ledger.seed_generation(self.store, self.root, q.gen, T, cursors, **{
            "from": rw["from"], "checkpoint": rw["checkpoint"], "source": self.rid, "round": q.round})
        if self.checkpoint_root:
            supersede(self.store, self.root, self.checkpoint_root, T, q.gen)
        self.cursor = cursors.get(self.rid, 0)
        print(f"lightning-ft: replica {self.rid}: rewind from step {rw['from']} to {T} (generation {q.gen}"
              f"{', checkpoint ' + str(rw['checkpoint']) if rw['checkpoint'] else ''})", flush=True)
