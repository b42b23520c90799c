"""State transfer of one rank (docs/ARCHITECTURE.md, "Catch-up"): what travels when a replica
takes another's state (a catch-up, a sync round, the final state at the end of the job), and
persistent checkpoints loaded into the same objects.

A state is this rank's tensors (`state_tensors`: parameters and optimizer state, the rank's
shards) and the meta that travels with them (param groups, the LR scheduler, the loss scale,
committed batches, the caller's callbacks). `publish` hands a snapshot to this rank's server
for the replicas that will fetch it; `fetch` overwrites ours with a peer's and applies its
meta. The transport (transport.py) is the job's HTTP one or, in tests, the in-memory one.

Owned by the training thread; `publish` may run on the thread that runs a round (the quorum
thread, while the training thread computes gradients: the tensors it serves are not written
until the step is applied, which waits for the round)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightning_ft.coord.round_records import Quorum
from lightning_ft.replica import startup
from lightning_ft.replica.catchup.transport import CatchupTransport
from lightning_ft.replica.catchup.wire import CatchupError
from lightning_ft.replica.optimizers import unwrap
from lightning_ft.replica.plan import FAILED, LOST, OK
from lightning_ft.replica.state import materialize_optimizer_state, state_tensors

log = logging.getLogger(__name__)


def wire_version(gen: int, step: int) -> int:
    """A publication's version on the wire: the state's generation and step. A rewind makes a
    step again with other contents in a new generation, and a server may still hold the old
    one: a fetcher that asked for the step alone took it (the simulator, seed 1496: a rewind's
    adopter fetched its source's publication of step 0 from the previous rewind). An older
    generation's publication reads as not yet published; a newer one as moved on."""
    return (max(gen, 0) << 32) | step


@dataclass
class StateExtras:
    """What travels with a rank's tensors besides the optimizer's: set by the replica's caller
    (the replica holds it, the transfer reads it)."""

    scaler: Any = None
    """fp16 loss scaling (replica/scaler.py)."""
    callbacks: Any = None
    """The caller's other state (state_dict() -> str or None, load_state_dict(str)): Lightning
    callbacks' (strategy/callback_state.py)."""


class StateTransfer:
    """This rank's state as it is published, fetched and loaded."""

    def __init__(self, transport: CatchupTransport, model: torch.nn.Module, optimizer: Any,
                 named_params: list[tuple[str, torch.nn.Parameter]], scheduler: Any, extras: StateExtras, who: str,
                 fetch_timeout_s: float) -> None:
        self.transport = transport
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self._named_params = named_params
        self.extras = extras
        self.who = who
        """This rank's name for a server ("{rid}/{rank}"): what it says when it fetches."""
        self.fetch_timeout_s = fetch_timeout_s
        self.stats: dict[str, float] = {}
        """The last fetch: seconds, gbps, mb."""

    def tensors(self) -> dict[str, torch.Tensor]:
        return state_tensors(self._named_params, self.model, self.optimizer)

    def meta(self, step: int, batches: int) -> dict:
        return {
            "step": step,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.extras.scaler.state_dict() if self.extras.scaler is not None else None,
            "batches": batches,
            "callbacks": self.extras.callbacks.state_dict() if self.extras.callbacks is not None else None,
        }

    def publish(self, step: int, batches: int, expected: set[str], gen: int) -> None:
        """Serve state version `step` of generation `gen` to the fetchers named in `expected`
        ("{rid}/{rank}")."""
        self.transport.publish(wire_version(gen, step), self.tensors(), self.meta(step, batches), expected)

    def publish_for(self, q: Quorum, rid: int, rank: int, step: int, batches: int) -> None:
        """A contributor of round `q`: serve our state to the lagging members that fetch this
        rank's shard from us (`contributors[(lagging + rank) % len]`)."""
        expected = {f"{lag}/{rank}" for lag in q.lagging
                    if q.contributors[(lag + rank) % len(q.contributors)] == rid}
        self.publish(step, batches, expected, q.gen)

    def fetch(self, addr: str, step: int, src: int, deadline_s: float, gen: int) -> tuple[int, Optional[dict]]:
        """Fetch version `step` of generation `gen` of replica `src`'s state (this rank's shard,
        from `addr`) into our tensors and apply its meta. Returns (vote, meta): OK, FAILED
        (nothing written) or LOST (partly overwritten)."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + deadline_s
        materialize_optimizer_state(self.optimizer)
        into = self.tensors()
        while True:
            try:
                with torch.no_grad():
                    meta, stats = self.transport.fetch(addr, wire_version(gen, step), into, self.who,
                                                       timeout_s=max(10.0, self.fetch_timeout_s),
                                                       param_groups=self.optimizer.param_groups)
                break
            except CatchupError as e:
                # The source publishes right after it gets the same quorum (or, in a rewind, after
                # it loaded the checkpoint); we may be early.
                if e.not_yet_published(wire_version(gen, step)) and time.monotonic() < deadline:
                    time.sleep(0.002)
                    continue
                log.warning("%s: catch-up from replica %d failed: %s", self.who, src, e)
                return (LOST if e.partial else FAILED), None
        # verified (catchup/wire.check_meta): as many groups as ours, known keys only
        for g, saved in zip(self.optimizer.param_groups, meta["param_groups"], strict=True):
            g.update(saved)
        if self.scheduler is not None and meta.get("scheduler") is not None:
            self.scheduler.load_state_dict(meta["scheduler"])
        if self.extras.scaler is not None and meta.get("scaler") is not None:
            self.extras.scaler.load_state_dict(meta["scaler"])
        if self.extras.callbacks is not None and meta.get("callbacks"):
            self.extras.callbacks.load_state_dict(meta["callbacks"])
        startup.mark("caught_up")
        self.stats = {"seconds": time.perf_counter() - t0, "gbps": stats.get("gbps", 0.0),
                      "mb": stats.get("bytes", 0) / 1e6}
        return OK, meta

    def freeze(self) -> float:
        """The step is about to be applied: copies of a published state still being fetched are
        taken now (seconds it took)."""
        return self.transport.freeze()

    def close(self) -> None:
        self.transport.close()


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: Any, scheduler: Any, scaler: Any, pg: Any) -> dict:
    """Load a persistent checkpoint into this rank's model, optimizer, scheduler and loss scale
    (before `start` for `--resume`, and in a rewind); returns its meta (`step`, `batches`, ...)."""
    from lightning_ft.replica.checkpoint import load

    materialize_optimizer_state(optimizer)
    got = load(path, model, unwrap(optimizer), pg=pg)
    extra = got["extra"]
    for g, saved in zip(optimizer.param_groups, extra["param_groups"], strict=True):
        g.update(saved)
    if scheduler is not None and extra.get("schedulers") is not None:
        scheduler.load_state_dict(extra["schedulers"])
    if scaler is not None and extra.get("scaler"):
        scaler.load_state_dict(extra["scaler"])
    return got["meta"]
