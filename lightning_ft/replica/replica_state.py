"""`ReplicaState`: where a replica's state stands in the job's history, as one value
(docs/ARCHITECTURE.md, "A step").

The replica layer holds one `ReplicaState` and replaces it whole at each transition (a commit,
an adoption, a refused ledger write, a start), so a reader on another thread (the overlapped
quorum's report) sees one consistent state, never a step of one commit beside the generation
of another. The transitions are pure; `tests/replica/test_replica_state.py` checks each.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional


@dataclass(frozen=True)
class ReplicaState:
    step: int = 0
    """Committed steps (the state is at the end of step `step - 1`)."""
    gen: int = 0
    """History generation of the state (a rewind starts a new one)."""
    synced: bool = False
    """The state comes from the job's history: it adopted or committed in `gen`."""
    disowned: bool = False
    """The ledger refused our records of commits (our lease lapsed, or we were evicted): the
    others may have redone those steps without us, so the state is not the job's history even
    at the same step. Reported with no generation (not usable) until we adopt a state."""
    made: tuple[int, int] = (-1, -1)
    """(round, epoch) of the round that made the state: the last commit, or the sync round it
    adopted in or was the source of (quorum rule 8, provenance)."""
    cursor: int = 0
    """The next batch of this replica's slot to train."""
    batches: int = 0
    """Committed batches (several optimizers: a batch spans several steps)."""

    def committed(self, step: int, gen: int, made: tuple[int, int], trained: bool, new_batch: bool,
                  mine: Optional[int]) -> "ReplicaState":
        """After committing `step` (made by round `made`): `trained` says this replica contributed
        (a catch-up's state is the contributors', so it is no longer disowned; a disowned replica
        never trains); `mine` is the slot batch the round trained for us, if any."""
        return replace(self, step=step + 1, gen=gen, synced=True, made=made,
                       disowned=self.disowned if trained else False,
                       batches=self.batches + (1 if new_batch else 0),
                       cursor=max(self.cursor, mine + 1) if mine is not None else self.cursor)

    def adopted(self, step: int, gen: int, made: tuple[int, int]) -> "ReplicaState":
        """After a sync round made the job's state ours (as its source or by adopting it)."""
        return replace(self, step=step, gen=gen, synced=True, disowned=False, made=made)

    def disown(self) -> "ReplicaState":
        return replace(self, disowned=True)

    def report(self) -> dict[str, Any]:
        """What a report says of it: a disowned state claims no generation, so the quorum never
        counts it as the job's."""
        return dict(gen=-1 if self.disowned else self.gen, synced=self.synced and not self.disowned,
                    made=self.made)
