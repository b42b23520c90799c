"""Rule 13 of the quorum decision (lightning_ft/coord/quorum.py): under batch_policy
"constant" a train round carries every slot's cursor, and steady rounds advance them all."""
from __future__ import annotations

import dataclasses

from lightning_ft.coord.quorum import LocalView, compute_quorum, steady_next
from lightning_ft.coord.round_records import SYNC, History, JobSpec, Quorum, Report

FP = {"job": "j", "replicas": 4, "nproc_per_replica": 1}
CONSTANT = JobSpec(replicas=4, min_replicas=1, init_timeout_s=10.0, fingerprint=FP, batch_policy="constant")
SHRINK = dataclasses.replace(CONSTANT, batch_policy="shrink")


def report(rid, step, cursor, round=1, synced=True, lagging=False):
    return Report(rid=rid, incarnation=0, step=step - (1 if lagging else 0), round=round, fingerprint=FP,
                  cursor=cursor, synced=synced)


def previous(members, step):
    return Quorum(round=0, epoch=0, members=tuple(members), incarnations=(0,) * len(members), max_step=step,
                  contributors=tuple(members), lagging=())


def decide(job, reports, prev, cursors):
    return compute_quorum(1, {r.rid: r for r in reports}, frozenset(), prev, job, 0.0,
                          History(committed_step=prev.max_step, cursors=cursors)).quorum


def test_absent_and_lagging_slots_take_the_ledger_cursor_members_their_own():
    # r2 is dead (no report), r3 lags a step behind; the ledger knows their slots' cursors
    reps = [report(0, 9, cursor=9), report(1, 9, cursor=9), report(3, 9, cursor=4, lagging=True)]
    q = decide(CONSTANT, reps, previous((0, 1, 2, 3), 8), cursors={0: 9, 1: 9, 2: 6, 3: 8})
    assert q.contributors == (0, 1) and q.lagging == (3,)
    assert q.slot_cursors == (9, 9, 6, 8)  # r3's stale report (4) is not used: it does not train
    assert Quorum.from_json(q.to_json()) == q


def test_shrink_rounds_carry_no_slot_cursors():
    reps = [report(0, 9, cursor=9), report(1, 9, cursor=9)]
    q = decide(SHRINK, reps, previous((0, 1, 2, 3), 8), cursors={2: 6, 3: 8})
    assert q.slot_cursors == ()


def test_sync_rounds_carry_no_slot_cursors():
    reps = [report(r, 0, cursor=0, round=0, synced=False) for r in range(4)]
    q = compute_quorum(0, {r.rid: r for r in reps}, frozenset(), None, CONSTANT, 0.0, History())
    assert q.quorum.kind == SYNC and q.quorum.slot_cursors == ()


def test_steady_rounds_advance_every_slot_cursor():
    reps = [report(0, 9, cursor=9), report(1, 9, cursor=9), report(3, 9, cursor=9)]
    q = decide(CONSTANT, reps, previous((0, 1, 3), 8), cursors={2: 6})
    assert q.slot_cursors == (9, 9, 6, 9)
    n = steady_next(q, LocalView(committed=True, changed=False, digest_due=False))
    assert n is not None and n.slot_cursors == (10, 10, 7, 10) and n.cursors == (10, 10, 10)
