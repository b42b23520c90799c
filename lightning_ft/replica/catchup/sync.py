"""The parts of a sync round (docs/ARCHITECTURE.md, "Sync rounds", "Rewinds"): the job's first
round, a resume, or a rewind makes one member's state everyone's. The source (after loading the
rewind's checkpoint, if any; its leader starts the rewind's generation) publishes its state and
every other member adopts it; all ranks of a replica then agree, or none does.

replica/step.py runs the round; these are its steps, functions over the replica."""
from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Optional

from lightning_ft.coord.round_records import Quorum
from lightning_ft.replica import ledger
from lightning_ft.replica.plan import FAILED, LOST, OK, ReplicaStateLost
from lightning_ft.replica.state import materialize_optimizer_state

if TYPE_CHECKING:
    from lightning_ft.replica.replica import Replica

log = logging.getLogger(__name__)


def load_rewind_checkpoint(r: Replica, path: str) -> tuple[int, Optional[dict[int, int]]]:
    """The source of a rewind: load its checkpoint (every rank its shard). Returns (vote, the
    slot cursors of the checkpoint's meta)."""
    from lightning_ft.replica.checkpoint import CheckpointInvalid, verify

    why = ""
    if r.is_leader:
        try:
            verify(path)
        except CheckpointInvalid as e:
            why = str(e)
    why = r.group.broadcast(why)  # every rank loads, or none does (the load is a collective)
    if why:
        log.error("replica %d: the rewind's checkpoint does not verify: %s", r.rid, why)
        return FAILED, None
    try:
        r.load_checkpoint(path)
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        return OK, {int(s): int(k) for s, k in meta.get("cursors", {}).items()}
    except (CheckpointInvalid, OSError, RuntimeError, ValueError, KeyError) as e:
        log.error("replica %d: cannot load the rewind's checkpoint %s: %s", r.rid, path, e)
        return FAILED, None


def start_generation(r: Replica, q: Quorum, cursors: Optional[dict[int, int]]) -> int:
    """Leader of a rewind's source: seed the new generation's cursors (the checkpoint's, or the
    ledger's at the step we hold) and retire the checkpoints of the discarded future. Returns
    our slot's cursor in it."""
    from lightning_ft.replica.checkpoint import supersede

    T = q.max_step
    if cursors is None:
        cursors = ledger.cursors_at(r.store, r.root, T, range(r.R))
    rw = q.rewind
    assert rw is not None  # a rewind's round
    ledger.seed_generation(r.store, r.root, q.gen, T, cursors, **{
        "from": rw["from"], "checkpoint": rw["checkpoint"], "source": r.rid, "round": q.round})
    if r.settings.checkpoint_root:
        supersede(r.store, r.root, r.settings.checkpoint_root, T, q.gen)
    print(f"lightning-ft: replica {r.rid}: rewind from step {rw['from']} to {T} (generation {q.gen}"
          f"{', checkpoint ' + str(rw['checkpoint']) if rw['checkpoint'] else ''})", flush=True)
    return cursors.get(r.rid, 0)


def publish_source(r: Replica, q: Quorum) -> None:
    """The source: serve our state (now at the round's step) to the members that adopt it."""
    materialize_optimizer_state(r.optimizer)  # a fresh source has no optimizer state yet
    r.transfer.publish_for(q, r.rid, r.rank, r.step, r.batches)


def agreed(r: Replica, q: Quorum, vote: int) -> bool:
    """Every rank of the replica took its part (loaded and published, or adopted), or none
    counts it. A rank whose state a failed fetch partly overwrote ends the replica."""
    vote = r.group.vote(vote)
    if vote == LOST:
        raise ReplicaStateLost(f"replica {r.rid}: adopting replica {q.source}'s state failed midway; the "
                               "state is partly overwritten, so this replica exits to restart fresh")
    return vote == OK


def announce(r: Replica, q: Quorum, seconds: float) -> None:
    """Leader of a replica that adopted: say so (the process log and events.jsonl)."""
    st = r.stats
    print(f"lightning-ft: replica {r.rid} adopted replica {q.source}'s state at step {q.max_step}"
          f"{' (rewind)' if q.rewind else ''}: {st.catchup_mb:.1f} MB per rank in {seconds:.3f} s "
          f"({st.catchup_gbps:.2f} GB/s)", flush=True)
    r.event("sync", replica=r.rid, source=q.source, step=q.max_step, gen=q.gen,
            rewind=q.rewind is not None, seconds=round(seconds, 4), mb=round(st.catchup_mb, 3))
