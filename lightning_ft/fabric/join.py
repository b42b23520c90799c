"""How a Fabric process joins its job (docs/ARCHITECTURE.md, "Fabric": "Joining").

Before its loop's first batch, or in `fabric.load`, a replica runs the replica layer's
`prepare` (sync, catch-up and rewind rounds) and holds the job's model and optimizer at the
job's committed step S. The loop's own state must be at S too:

- it is when the job is where the loop starts (a new job at 0, or every replica resuming from
  one checkpoint: the sync round's step is the checkpoint's);
- `fabric.load(path, state)` on a restarted or late replica fills the loop's dict from a live
  replica's snapshot at S (fabric/loop_state.py): its counters, schedulers, learning rate;
- a loop that did not call `fabric.load` (LitGPT with resume="auto" before the job's first
  checkpoint) starts its counters from the beginning, and its learning rate with them. It would
  apply another update than the others at every step, so it does not train: it leaves the job,
  waits for the job's next `fabric.save` (or its end), and exits so that the launcher restarts
  it, and the restarted loop loads that checkpoint (`sit_out`). Until then the job trains on
  the other replicas; the replica's slot waits (exactly once holds).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Optional

from lightning_ft.fabric import checkpoints
from lightning_ft.fabric.loop_state import LoopState, fill
from lightning_ft.strategy.errors import FTHSDPError


class FTFabricError(FTHSDPError):
    """A Fabric program that ft_hsdp cannot run as it stands, or a replica that must restart; the
    message says why and what to change."""


class Join:
    """One process's start in its job (see the module docstring)."""

    poll_s = 0.5

    def __init__(self, replica: Any, loop: LoopState, steplog: Any, cfg: Any, env: Any, secret: str, directory: str,
                 rank: int, in_replica: Callable[[Any], Any]) -> None:
        self.replica, self.loop, self.steplog = replica, loop, steplog
        self.cfg, self.env, self.secret, self.dir, self.rank = cfg, env, secret, directory, rank
        self.in_replica = in_replica
        self.left = False
        """It sat out: the replica layer is closed."""

    def finished(self) -> Optional[str]:
        """The job's `finished` record (rank 0 reads etcd), None while it runs."""
        from lightning_ft.replica.catchup.ending import finished_record

        env = self.env
        return finished_record(self.cfg.etcd, env.job, env.etcd, self.secret, env.run_id)

    def run(self, optimizer: Any, loaded: bool, loop_step: int, into: Optional[dict]) -> bool:
        """prepare, then the loop's state at the job's step (`loaded`: from `fabric.load`, whose
        dict is `into` and whose loop state is at `loop_step`). Returns whether the job already
        finished (this replica adopted its final state)."""
        t0 = time.perf_counter()
        res = self.replica.prepare()
        self.replica.step_log(self.steplog, None, time.perf_counter() - t0)
        ended = bool(res.caught_up and self.replica.finished() is not None)
        job = self.replica.step_count
        if job == loop_step:
            return ended
        if not loaded or into is None:
            self.sit_out(job)
        try:
            payload = self.loop.wait(job, float(self.cfg.etcd.hang_timeout_s),
                                     lambda: f"the job finished ({done})" if (done := self.finished()) else None)
        except TimeoutError as e:
            raise FTFabricError(f"replica {self.replica.rid} took the job's model and optimizer at step {job}, but "
                                f"not its loop's own state: {e}. Every replica's loop must pass the same state dict "
                                "to fabric.save and fabric.load") from None
        keys = fill(into, payload, optimizer)  # type: ignore[arg-type]  # checked above
        if self.rank == 0:
            print(f"lightning-ft: replica {self.replica.rid} continues at the job's step {job} (loop state "
                  f"{sorted(keys)} from the live job)", file=sys.stderr, flush=True)
        return ended

    def sit_out(self, job: int) -> None:
        """The loop starts from its beginning but the job is at step `job`: leave the job, wait for
        its next checkpoint (or its end), then exit so that the launcher restarts this replica."""
        rid = self.replica.rid
        if self.rank == 0:
            print(f"lightning-ft: replica {rid}: the job is at step {job}, but this loop did not call "
                  "fabric.load(path, state) before training: its own counters (and a learning rate computed from "
                  "them) start from the beginning, so it cannot train the job's next step with the others. It leaves "
                  "the job until the job's next checkpoint (fabric.save), then exits to be restarted: a loop that "
                  "resumes from that checkpoint (LitGPT's resume='auto') joins through fabric.load. To join at once, "
                  "call fabric.load(path, state) before the loop.", file=sys.stderr, flush=True)
        self.replica.close()
        self.left = True
        since = time.time()
        while True:
            why = None
            if self.rank == 0:
                saved = checkpoints.read_json(self.dir, "saved.json")
                if self.finished() is not None:
                    why = "finished"
                elif float(saved.get("t", 0.0)) > since:
                    why = f"saved at step {saved.get('step')} in {saved.get('path')}"
            why = self.in_replica(why)
            if why == "finished":
                print(f"lightning-ft: replica {rid}: the job finished while it sat out", file=sys.stderr, flush=True)
                raise SystemExit(0)
            if why:
                raise FTFabricError(f"replica {rid} sat out (its loop did not load the job's state); the job "
                                    f"{why}, so it exits to be restarted from that checkpoint")
            time.sleep(self.poll_s)


def directory(cfg: Any) -> str:
    """`{checkpoint dir}/fabric`: the files the replicas of a Fabric job share."""
    from lightning_ft.config import checkpoint_dir

    return os.path.join(checkpoint_dir(cfg), "fabric")
