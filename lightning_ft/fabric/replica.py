"""The one place the Fabric strategy calls the replica layer (docs/ARCHITECTURE.md, "Fabric").

A Fabric loop drives its own step: it fetches batches, runs forward and backward, then calls
`optimizer.step()`. By then the gradients are computed, as under the Trainer's manual
optimization, so a step here is `Replica.begin(computed=True, recompute=False)`: a catch-up
between the loop's backward and its step makes the replica layer raise `StaleManualStep`,
and the replica restarts and rejoins through `fabric.load` (strategy.py). The step asks this
class for what the loop cannot be asked in the middle of `optimizer.step()`: the check of the
averaged gradients (Fabric's deferred clipping, clip.py) and a catch-up's clip.

`FabricReplica` holds the `Replica` of one process (one rank of one replica) and offers what the
strategy needs in the replica layer's public terms: start, a checkpoint's starting point,
prepare, one step, the end of the job, close, and read-only views (step, cursor, who writes).
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, NoReturn, Optional

from lightning_ft.replica.core import Do
from lightning_ft.replica.plan import StepResult


class FabricReplica:
    """The replica layer for one Fabric process."""

    def __init__(self, model: Any, optimizer: Any, env: Any, cfg: Any, secret: str, rank: int, world: int,
                 group: Any) -> None:
        """`env`: the process's ReplicaEnv (launch/environment.py); `group`: a gloo process group
        over the replica's ranks, apart from FSDP2's (None for W = 1)."""
        from lightning_ft.replica.group import ReplicaGroup
        from lightning_ft.replica.replica import Replica
        from lightning_ft.replica.settings import Identity, Settings

        who = Identity(env.job, env.replica_id, env.incarnation, env.num_replicas, secret, env.etcd,
                       run_id=env.run_id, standby=env.standby)
        self.replica = Replica(model, optimizer, who, Settings.from_config(cfg), group=ReplicaGroup(rank, world, group),
                           run_dir=env.run_dir)
        self.last: StepResult = StepResult()
        """What the last `prepare` or `step` did."""
        self.cfg = cfg
        self._clip_catchup: Callable[[], None] = lambda: None

    # -- the replica's life -------------------------------------------------------------------------
    def start(self, meta: Any, clip_catchup: Callable[[], None]) -> None:
        """Listeners and registration. `meta`: state the catch-up carries to a late replica
        (state_dict() -> str | None, load_state_dict(str)); `clip_catchup`: a catch-up's clip."""
        self.replica.callbacks = meta
        self._clip_catchup = clip_catchup
        self.replica.start()

    def resume_at(self, step: int, cursors: dict[int, int], source: str) -> bool:
        """Start the job's history at a checkpoint's step unless it has begun (strategy/resume.py);
        returns whether this replica starts there."""
        from lightning_ft.strategy.resume import ResumePoint, begin

        return begin(self.replica, ResumePoint(step, dict(cursors), source), self.replica.broadcast)

    def prepare(self) -> StepResult:
        """Sync, catch-up and rewind rounds until this replica holds the job's state. The job
        finished meanwhile: `ended` (SystemExit 0)."""
        from lightning_ft.coord.membership import JobFinished

        try:
            step = self.replica.prepare()
            for ask in step:
                if ask.do is Do.CLIP:
                    self._clip_catchup()
            self.last = step.result
        except JobFinished as e:
            self.ended(e)
        return self.last

    def step(self, batch: int, after_exchange: Callable[[], Any]) -> StepResult:
        """One optimizer step of the loop: its gradients of slot batch `batch` are computed;
        rounds until one commits (quorum, exchange, `after_exchange` on the averaged gradients,
        the two-phase commit, retries). The job finished without this replica: `ended`."""
        from lightning_ft.coord.membership import JobFinished

        try:
            step = self.replica.begin(batch=batch, computed=True, recompute=False)
            for ask in step:
                if ask.do is Do.CHECK:
                    step.veto = after_exchange() is False
                elif ask.do is Do.CLIP:
                    self._clip_catchup()
            self.last = step.result
        except JobFinished as e:
            self.ended(e)
        return self.last

    def ended(self, why: Exception) -> NoReturn:
        """The job finished while this replica was behind it: the loop ends here (exit code 0)."""
        if self.replica.rank == 0:
            print(f"lightning-ft: replica {self.rid}: {why}; its loop ends here", file=sys.stderr, flush=True)
        raise SystemExit(0)

    def finish(self, model: Any, optimizer: Any, rank: int) -> None:
        """The loop ended: a replica started from now on finds nothing to train; final.json."""
        from lightning_ft.strategy.runlog import write_final

        self.replica.mark_finished()
        write_final(self.replica, model, optimizer, rank, 0)

    def close(self) -> None:
        self.replica.close()

    # -- views --------------------------------------------------------------------------------------
    @property
    def rid(self) -> int:
        return self.replica.rid

    @property
    def incarnation(self) -> int:
        return self.replica.incarnation

    @property
    def step_count(self) -> int:
        """The job's committed steps this replica holds."""
        return self.replica.step

    @property
    def cursor(self) -> int:
        """The next slot batch of this replica's slot."""
        return self.replica.cursor

    @property
    def writer(self) -> bool:
        """This replica writes the job's files (the lowest-id contributor of the last round)."""
        return self.last.writer if self.last.role else self.rid == 0

    @property
    def is_leader(self) -> bool:
        return self.replica.is_leader

    def finished(self) -> Optional[int]:
        """The step the job finished at, or None while it runs."""
        return self.replica.finished_step()

    def describe(self) -> Optional[dict]:
        """The job's position for a checkpoint (leader; None before the first round)."""
        from lightning_ft.strategy.resume import describe

        return describe(self.replica) if self.replica.last_plan is not None else None

    def broadcast(self, obj: Any) -> Any:
        """The leader's `obj` on every rank of this replica."""
        return self.replica.broadcast(obj)

    @functools.cached_property
    def reducer(self) -> Any:
        """Values reduced over the live replicas through etcd (strategy/evaluation.py)."""
        from lightning_ft.strategy.evaluation import CrossReplicaReducer

        return CrossReplicaReducer(self.replica, timeout_s=self.cfg.etcd.hang_timeout_s / 2)

    def step_log(self, log: Any, loss: Any, seconds: float) -> None:
        """One row of steps.jsonl (strategy/runlog.py)."""
        log.write(self.replica, loss, self.last.caught_up or self.last.synced, seconds, {})
