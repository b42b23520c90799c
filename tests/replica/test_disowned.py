"""A replica whose commit records the ledger refused (its lease lapsed, or it was evicted) holds
a state the job may have redone without it: it must not count as the job's state again.

The halted 100-fault soak: r's lease lapsed while its last ring completed and the others'
failed. It kept step S+1, re-registered as a joiner and reported S+1 beside the others' S+1,
which they had redone without it. Majorities healed it by the divergence guard; with one
replica down the two disagreeing ones halted the job."""
from __future__ import annotations

import time

import torch

from lightning_ft.coord.coordinator import Coordinator
from lightning_ft.coord.membership import MembershipSettings
from lightning_ft.coord.round_records import JobSpec
from lightning_ft.coord.store import MemoryStore
from lightning_ft.replica import ledger
from lightning_ft.replica.manager import ReplicaManager
from lightning_ft.replica.replica_state import ReplicaState
from lightning_ft.replica.settings import Identity


def _manager(store: MemoryStore, hang_timeout_s: float) -> ReplicaManager:
    model = torch.nn.Linear(4, 2)
    m = ReplicaManager(model, torch.optim.SGD(model.parameters(), lr=0.1), Identity("j", 1, 0, 2, "s" * 16),
                       store=store)
    m.coord = Coordinator(store, "j", 1, 0, JobSpec(2, 1, 0.1, {}),
                          MembershipSettings(lease_ttl_s=0.3, hang_timeout_s=hang_timeout_s))
    m.coord.register(5, gen=0, synced=True)
    m.root, m.state = m.coord.root, ReplicaState(step=6, gen=0, synced=True)
    m._unrecorded.append((5, 0, 3, 0, {1: 7}))  # (step, epoch, round, gen, batches) of our last commit
    return m


def test_records_refused_after_a_lapsed_lease_disown_the_state():
    s = MemoryStore()
    m = _manager(s, hang_timeout_s=0.4)
    deadline = time.monotonic() + 5
    while s.get(f"{m.root}members/1") is not None:  # no progress: the keepalive lets the lease lapse
        assert time.monotonic() < deadline, "the lease did not lapse"
        time.sleep(0.02)
    m.flush_ledger()
    assert not ledger.recorded(s, m.root, 0, 5)  # fenced: the lapsed incarnation records nothing
    state = m._report_state()
    assert state["gen"] == -1 and state["synced"] is False  # not usable: the quorum makes it adopt
    m.coord.close(), s.close()


def test_records_written_under_a_live_lease_keep_the_state_the_jobs():
    s = MemoryStore()
    m = _manager(s, hang_timeout_s=30.0)
    m.flush_ledger()
    assert ledger.recorded(s, m.root, 0, 5)
    state = m._report_state(digest=(6, "ab"))
    assert state["gen"] == 0 and state["synced"] is True and state["digest"] == "ab" and state["digest_step"] == 6
    m.coord.close(), s.close()


class _Server:
    def freeze(self) -> float:
        return 0.0


def test_a_commit_names_its_round_in_the_next_report():
    """Provenance (quorum rule 8): the report says which round made the state, so a state kept
    from a round the others redid without us is stale even when nothing fenced our records."""
    from lightning_ft.coord.round_records import Quorum
    from lightning_ft.replica.manager import OK, StepPlan

    s = MemoryStore()
    m = _manager(s, hang_timeout_s=30.0)
    m.catchup = _Server()
    assert m._report_state()["made"] == (-1, -1)  # a fresh process: not known
    q = Quorum(round=12, epoch=4, members=(0, 1), incarnations=(0, 0), max_step=6, contributors=(0, 1), lagging=(),
               gen=0)
    m.last_plan = StepPlan(step=6, quorum=q, role="train", divisor=2, lr_factor=1.0, batch_index=7,
                           batches={0: 6, 1: 7})
    for p in m.model.parameters():
        p.grad = torch.ones_like(p)
    assert m.commit(OK)
    assert m.step == 7 and m._report_state()["made"] == (12, 4)
    assert not m.commit(0)  # a failed commit changes nothing
    assert m._report_state()["made"] == (12, 4)
    m.coord.close(), s.close()
