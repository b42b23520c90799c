"""What one round asks of a replica and what one step did: the votes of the two-phase commit,
the LR factor, `StepPlan`, `StepStats`, `StepResult` and the errors that end a replica
(docs/ARCHITECTURE.md, "A step")."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_ft.constants import LR_MODES
from lightning_ft.coord.round_records import Quorum

OK, FAILED, LOST = 1, 0, -1
"""Votes: MIN over the replica's ranks decides."""


def lr_factor(mode: str, healthy: int, total: int) -> float:
    """f(healthy/total) for the LR intervention: 1, x or sqrt(x)."""
    x = healthy / total
    if mode == "none":
        return 1.0
    if mode == "linear":
        return x
    if mode == "sqrt":
        return math.sqrt(x)
    raise ValueError(f"lr_intervention {mode!r} is not one of {LR_MODES}")


class ReplicaStateLost(RuntimeError):
    """A failed catch-up left this replica's state partly overwritten; it must restart fresh."""


class StaleManualStep(RuntimeError):
    """Manual optimization computed gradients on weights a catch-up then replaced."""


@dataclass(frozen=True)
class StepPlan:
    step: int
    """The step this round trains (committed steps of the healthy replicas)."""
    quorum: Quorum
    role: str
    """"train", "catchup", "source" or "adopt" (see the module docstring)."""
    divisor: int
    lr_factor: float
    batch_index: int
    """The batch of this replica's slot to train (train role only)."""
    batches: Any = None
    """Slot -> batch index trained in this round by all contributors (train rounds; the
    commit's ledger record). None in sync rounds."""
    extra: tuple[tuple[int, int], ...] = ()
    """(slot, k) batches of absent slots this replica trains besides its own (batch_policy
    "constant"; `run_step(extra=...)` computes them)."""
    micro: tuple[tuple[int, int, int], ...] = ()
    """(slot, k, j) micro-batches of shrunk stragglers' slots this replica trains besides its own
    (stragglers policy "shrink"; `run_step(extra=...)` computes them)."""
    skip: tuple[int, ...] = ()
    """The micro-batches of its own slot batch this replica does not train (it is shrunk): the
    helpers train them."""
    opt: int = 0
    """The optimizer this round steps (quorum rule 15; -1: not known yet)."""
    cont: bool = False
    """The round continues a batch: no batch in its ledger record, no cursor advances."""

    @property
    def extras(self) -> tuple:
        """What this replica trains besides its whole slot batch, or instead of part of it: the
        local gradients must hold exactly this besides the slot batch before the exchange."""
        return (self.extra, self.micro, self.skip) if (self.extra or self.micro or self.skip) else ()

    @property
    def contribute(self) -> bool:
        return self.role == "train"

    @property
    def lagging(self) -> bool:
        return self.role != "train"

    @property
    def sync(self) -> bool:
        return self.role in ("source", "adopt")


@dataclass
class StepStats:
    quorum_s: float = 0.0
    reconfigure_s: float = 0.0
    exchange_s: float = 0.0
    catchup_s: float = 0.0
    catchup_gbps: float = 0.0
    catchup_mb: float = 0.0
    freeze_s: float = 0.0
    digest_s: float = 0.0
    retries: int = 0


@dataclass
class StepResult:
    """What one `run_step` call did."""

    committed: int = 0
    """Steps committed (catch-ups included)."""
    trained: bool = False
    """A step that trained the requested batch committed."""
    caught_up: bool = False
    synced: bool = False
    stale: bool = False
    """The slot's cursor went back (a rewind): the delivered batch is not the next to train;
    the caller must re-position its data source at `ReplicaManager.cursor`."""
    loss: Any = None
    step: int = 0
    """The job's committed steps after the call (what this replica holds)."""
    role: str = ""
    """The last round's role ("train", "catchup", "source", "adopt"; "" before any round)."""
    stop: bool = False
    """The job agreed to stop at a step this call committed: every replica stops after it."""
    writer: bool = False
    """This replica writes the job's files (checkpoints): the lowest-id contributor of the last
    round; replica 0 before any round."""
