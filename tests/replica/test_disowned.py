"""A replica whose commit records the ledger refused (its lease lapsed, or it was evicted) holds
a state the job may have redone without it: it must not count as the job's state again.

The halted 100-fault soak: r's lease lapsed while its last ring completed and the others'
failed. It kept step S+1, re-registered as a joiner and reported S+1 beside the others' S+1,
which they had redone without it. Majorities healed it by the divergence guard; with one
replica down the two disagreeing ones halted the job."""
from __future__ import annotations

import time

from lightning_ft.coord.coordinator import Coordinator
from lightning_ft.coord.membership import MembershipSettings
from lightning_ft.coord.round_records import JobSpec, Quorum
from lightning_ft.coord.store import MemoryStore
from lightning_ft.replica import ledger
from lightning_ft.replica.guard import Digests
from lightning_ft.replica.group import ReplicaGroup
from lightning_ft.replica.replica_state import ReplicaState
from lightning_ft.replica.rounds import RoundClient, RoundView
from lightning_ft.replica.settings import Settings


def _writer(store: MemoryStore, hang_timeout_s: float) -> tuple[Coordinator, ledger.LedgerWriter]:
    coord = Coordinator(store, "j", 1, 0, JobSpec(2, 1, 0.1, {}),
                        MembershipSettings(lease_ttl_s=0.3, hang_timeout_s=hang_timeout_s))
    coord.register(5, gen=0, synced=True)
    w = ledger.LedgerWriter(store, coord.root, 1, coord.fence)
    w.add(5, 0, 3, 0, {1: 7})  # (step, epoch, round, gen, batches) of our last commit
    return coord, w


def _report(state: ReplicaState, digest=None) -> dict:
    """What the leader's full-round report says of `state` (rounds.py)."""
    group = ReplicaGroup(0, 1, None)
    rounds = RoundClient(1, group, None, Digests(0, 0, group), None, [], Settings(), 2)  # type: ignore[arg-type]
    return rounds._report(RoundView(state, committed_round=-1), state, digest)


def test_records_refused_after_a_lapsed_lease_disown_the_state():
    s = MemoryStore()
    coord, w = _writer(s, hang_timeout_s=0.4)
    deadline = time.monotonic() + 5
    while s.get(f"{coord.root}members/1") is not None:  # no progress: the keepalive lets the lease lapse
        assert time.monotonic() < deadline, "the lease did not lapse"
        time.sleep(0.02)
    assert w.flush() == (5, 5)  # refused: our records of step 5
    assert not ledger.recorded(s, coord.root, 0, 5)  # fenced: the lapsed incarnation records nothing
    state = _report(ReplicaState(step=6, gen=0, synced=True).disown())
    assert state["gen"] == -1 and state["synced"] is False  # not usable: the quorum makes it adopt
    coord.close(), s.close()


def test_records_written_under_a_live_lease_keep_the_state_the_jobs():
    s = MemoryStore()
    coord, w = _writer(s, hang_timeout_s=30.0)
    assert w.flush() is None and w.pending == 0
    assert ledger.recorded(s, coord.root, 0, 5)
    state = _report(ReplicaState(step=6, gen=0, synced=True), digest=(6, "ab"))
    assert state["gen"] == 0 and state["synced"] is True and state["digest"] == "ab" and state["digest_step"] == 6
    coord.close(), s.close()


def test_a_commit_names_its_round_in_the_next_report():
    """Provenance (quorum rule 8): the report says which round made the state, so a state kept
    from a round the others redid without us is stale even when nothing fenced our records."""
    st = ReplicaState(step=6, gen=0, synced=True)
    assert _report(ReplicaState())["made"] == (-1, -1)  # a fresh process: not known
    q = Quorum(round=12, epoch=4, members=(0, 1), incarnations=(0, 0), max_step=6, contributors=(0, 1), lagging=(),
               gen=0)
    st = st.committed(6, q.gen, (q.round, q.epoch), trained=True, new_batch=True, mine=7)
    assert st.step == 7 and _report(st)["made"] == (12, 4)
