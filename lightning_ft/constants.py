"""Values more than one layer uses, defined once: the LR modes, the batch policies, a replica's
roles in a round, and the exit codes of replicas and of `lightning-ft run`.

The modes, policies and roles are `StrEnum`s: each member *is* its string, so configs, etcd
records and events keep their plain strings, and a comparison with the string still holds.
This module imports nothing of ours, so that any layer may import it."""
from __future__ import annotations

from enum import IntEnum, StrEnum


class LRMode(StrEnum):
    """How the learning rate follows the fraction x = contributors / R of healthy replicas
    (`lr_intervention`; docs/ARCHITECTURE.md, "A step")."""

    NONE = "none"
    """f(x) = 1"""
    LINEAR = "linear"
    """f(x) = x"""
    SQRT = "sqrt"
    """f(x) = sqrt(x): the paper's"""


LR_MODES: tuple[str, ...] = tuple(m.value for m in LRMode)


class BatchPolicy(StrEnum):
    """What happens to absent replicas' batches while they are down (`batch_policy`;
    replica/batch_policy.py)."""

    SHRINK = "shrink"
    """The global batch shrinks to the contributors' slots; the others' batches wait for them."""
    CONSTANT = "constant"
    """Contributors also train the absent slots' batches: every step trains R slot batches."""


BATCH_POLICIES: tuple[str, ...] = tuple(p.value for p in BatchPolicy)


class Role(StrEnum):
    """A replica's role in one round (coord/quorum.py `adopt_role`)."""

    TRAIN = "train"
    """A contributor of a train round."""
    CATCHUP = "catchup"
    """A member of a train round that lags: it sends zeros and fetches the contributors' state."""
    SOURCE = "source"
    """The replica whose state a sync round publishes."""
    ADOPT = "adopt"
    """A member of a sync round that takes the source's state."""
    BENCH = "bench"
    """A straggler benched by rule 14, outside the round: it computes its batch to measure its
    pace and commits nothing (coord/stragglers.py)."""


class ExitCode(IntEnum):
    """Exit codes with a meaning of ours (any other non-zero code is the program's own failure)."""

    GAVE_UP = 1
    """`lightning-ft run`: every replica stopped and at least one was given up on."""
    ETCD_LOST = 75
    """`lightning-ft run`: etcd stayed unreachable too long (EX_TEMPFAIL)."""
    HALTED = 86
    """A replica, and then `lightning-ft run`, when the job halted (coord/keys.py `halt`).
    Distinctive: a user program exiting 3 is a failure, not a halt."""
    TIMEOUT = 124
    """`lightning-ft run`: its `--timeout` passed (as timeout(1) does)."""
