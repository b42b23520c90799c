"""Whole jobs in the simulator (lightning_ft/sim/job.py): the project's coordinator, round client,
ledger and step core under seeded faults, the promises checked as they run.

Each regression scenario is a seed (and the faults of its schedule it needs, as the shrinker
left them) that once found a defect in the real code; it stays here so that the defect stays
fixed."""
from __future__ import annotations

import multiprocessing
from dataclasses import replace

import pytest

from lightning_ft.sim.faults import Fault, schedule
from lightning_ft.sim.job import SimConfig, SimJob, run_seed

CFG = SimConfig()
SPAN = CFG.steps * CFG.step_s * 1.2


def faults(seed: int, *keep: int, cfg: SimConfig = CFG) -> tuple[Fault, ...]:
    got = schedule(seed, cfg.replicas, cfg.steps * cfg.step_s * 1.2, cfg.faults)
    return tuple(got[i] for i in keep) if keep else got


def test_a_fault_free_job_trains_every_step_once_and_ends_identical():
    v = run_seed(1, CFG, faults=())
    assert v.ok, v.violations
    assert v.steps == CFG.steps and v.restarts == 0


def test_the_same_seed_replays_the_same_run():
    a, b = run_seed(7), run_seed(7)
    assert a.ok and a.trace == b.trace and a.events == b.events
    assert run_seed(8).trace != a.trace


def test_the_checks_see_a_broken_promise():
    """The simulator is only as good as its checks: a replica that trains a batch twice, and one that
    skips one, each fail a run."""
    job = SimJob(3, CFG, faults=())
    real = job.check_step

    def twice(r, plan, trained):
        real(r, plan, trained + trained[:1] if plan.step == 40 and r.rid == 1 else trained)
    job.check_step = twice  # type: ignore[method-assign]
    v = job.run()
    assert not v.ok and "trained" in v.violations[0]
    from lightning_ft.replica import ledger

    job = SimJob(3, CFG, faults=())
    orig = ledger.LedgerWriter.add

    def skip_one(self, step, epoch, round, gen, batches):  # a commit recorded without one slot's batch
        orig(self, step, epoch, round, gen, {s: k for s, k in batches.items() if not (step == 30 and s == 2)})
    ledger.LedgerWriter.add = skip_one  # type: ignore[method-assign]
    try:
        v = job.run()
    finally:
        ledger.LedgerWriter.add = orig  # type: ignore[method-assign]
    assert not v.ok and any("exactly once" in x for x in v.violations), v.violations


@pytest.mark.parametrize("seed,keep,what", [
    # A replica whose adoption in a rewind failed (its source's links were cut), and that was then
    # the source of a sync round of the new generation, kept its old generation's cursor: its
    # slot's batches 0-24 were never trained in generation 1 (replica/step.py `_sync` now reads
    # the cursor in every sync round).
    # Seed 55 found it; once steady rounds compared digests on the ring (fewer full rounds) its
    # schedule no longer reached the bug, and seed 208 (shrunk to five faults) does.
    (55, (1, 2, 3), "resume, a cut source, then a kill of two"),
    (208, (0, 4, 7, 8, 9), "a cut, a resume, kills of one and of all, a cut"),
    # Faults that once ended in a liveness failure of the simulation's own etcd model (leases must
    # outlive a server outage) and in a busy loop of its ring model: kept as scenarios.
    (195, (2, 6, 8), "resume, slow, outage"),
    (16, (), "late start, corruption, resume, kills"),
    # Two whole-job kills 0.2 s apart: the first one's start must not outlive the second (two
    # incarnations of every replica then rewound each other forever).
    (1075, (4, 5, 7), "two resumes, then a cut"),
    # A replica cut off around a halt (corruption with no majority) missed the halted round, came
    # back reporting for the next one, decided it alone and trained alone, recording commits the
    # others had recorded with other states (a member now checks the halt key in every full round).
    (189, (1, 2, 5, 6, 7, 8, 9), "isolation across a halt"),
    # A replica cut off from etcd decided a rewind alone: its own unrecorded steady view looked
    # newer than the round recorded before it (coord/round_log.py `recorded_before`: a record
    # of the round before beats our own view).
    (1095, (), "an isolated replica and a record of the round before"),
    # An intruder that started before the job's configuration existed (the model's own bug).
    (1484, (), "an intruder at the start"),
    # A catch-up fetched a publication of an older generation with the same step (publications
    # are versioned by generation and step: replica/catchup/transfer.py `wire_version`), and a
    # round that failed after a fetch replaced the state kept it as its own (Step._fetched_in_vain
    # disowns it).
    (1496, (), "a fetch across generations, then a failed round"),
    # A member whose commit failed (a veto) was left behind while the others went on in steady
    # rounds; after they recorded round 89 it decided the unrecorded round 88 alone, and two
    # rewinds each made a generation 1 (coord/coordinator.py: nobody decides a round the others
    # passed; it takes a later decision that has it, or reports for the next round).
    (2858, (0, 3, 4), "an isolation, a failed commit, a kill of two"),
    (2978, (5, 8, 9), "a hang, a failed commit, a kill"),
    # A full round whose reports were past the previous round's step read no checkpoints, and the
    # rewind that followed (no usable state held that step: a disowned replica's report) went to
    # step 0 past the checkpoint of step 150 (coord/coordinator.py `_history` reads them always).
    (7573, (1, 2, 5, 7, 8, 9), "isolations, a hang, a warm spare, a kill of two"),
    # Every replica down at once between two full rounds (steady rounds are recorded sparsely):
    # the rewind's history saw no commit at the checkpoint's own step and went to step 0 past the
    # checkpoint of step 50 (a checkpoint of step N is published once the commit of step N - 1 is
    # recorded: coord/coordinator.py `_history`; sim/job.py `rewound` checks it).
    (427, (), "a kill of every replica after a checkpoint"),
    (9332, (4, 7, 8, 9), "two isolations, a kill, a cut: a rewind past a checkpoint"),
    # The source of a rewind to step 0 hung before it wrote the new generation's record (`rewinds/g`,
    # with the cursors); the next round synced fresh step-0 states into that generation without the
    # rewind, so nobody wrote it, and batches were trained twice or never (coord/quorum.py: the
    # rewind is carried into the next sync round, whose source writes the record).
    (2357, (1, 3, 9), "a whole-job kill before any checkpoint, a hang, a kill of all"),
    (3762, (), "a resume without a checkpoint, then kills"),
    (5255, (), "a rewind's source hung, then kills of all and a resume"),
])

def test_regression_scenarios(seed, keep, what):
    v = run_seed(seed, CFG, faults(seed, *keep))
    assert v.ok, (what, v.violations)


KNOWN = pytest.mark.xfail(strict=True, reason="found by `make sim SEEDS=10000`, not fixed yet (see the issue notes)")


@pytest.mark.parametrize("seed,keep,what", [
    # Every replica killed just after the job recorded that it finished: nobody is restarted and no
    # process holds the final state (its checkpoint may not be written yet): a final checkpoint
    # before `finished` would make the end durable.
    pytest.param(3604, (2, 3, 4, 5), "a kill of every replica right after the end", marks=KNOWN),
])
def test_known_defects_the_simulator_found(seed, keep, what):
    v = run_seed(seed, CFG, faults(seed, *keep))
    assert v.ok, (what, v.violations)


def test_a_replica_that_spins_is_a_liveness_violation_not_a_hang(monkeypatch):
    """Seed 1036 benches a straggler that was restarted: while its first (preparing) step has no
    batch to probe with, its rounds must wait (replica/step.py sets `can_probe` per step). With a
    replica that claims it always probes, it asked again at once, forever, at one virtual
    instant: the run reports that, instead of hanging the slice."""
    from lightning_ft.replica import pace

    assert run_seed(1036, CFG).ok
    monkeypatch.setattr(pace.Pace, "can_probe", property(lambda self: True, lambda self, v: None), raising=False)
    v = run_seed(1036, CFG)
    assert not v.ok and any("liveness" in x and "without time passing" in x for x in v.violations), v.violations


def test_corruption_after_the_last_digest_is_caught_at_the_end():
    """Seed 1728 (`make sim SEEDS=2000`, shrunk to a late start and a corruption at 11.59 s, after
    the last digest compared): the end compares final digests (catchup/ending.py `end_verdict`)
    and the corrupted replica takes a majority replica's final state."""
    v = run_seed(1728, CFG, faults(1728, 0, 8))
    assert v.ok, v.violations


def test_the_old_cursor_of_a_failed_adoption_loses_batches_without_the_fix(monkeypatch):
    """Seed 208 against the code before the fix: the simulator finds the lost batches."""
    from lightning_ft.sim import replica as sim_replica

    real_sync = sim_replica.SimReplica._sync

    def old_sync_gen(self, plan):
        cursor = self.state.cursor
        out = yield from real_sync(self, plan)
        if plan.quorum.rewind is None and out.ok:
            from lightning_ft.replica.core import Synced
            self.state = replace(self.state, cursor=cursor)
            out = Synced(True, cursor)
        return out
    monkeypatch.setattr(sim_replica.SimReplica, "_sync", old_sync_gen)
    v = run_seed(208, CFG, faults(208, 0, 4, 7, 8, 9))
    assert not v.ok and any("exactly once" in x and "gaps" in x for x in v.violations), v.violations


def _slice(lo_hi: tuple[int, int]) -> list[tuple[int, list[str]]]:
    lo, hi = lo_hi
    out = []
    for s in range(lo, hi):
        v = run_seed(s, CFG)
        if not v.ok:
            out.append((s, v.violations))
    return out


def test_a_slice_of_500_seeds_holds_every_promise():
    """500 schedules of 200 steps and 10 faults each (kills of one, several or all replicas,
    hangs, slow replicas, cut links, etcd member loss and outages, whole-job kills with resume,
    corruption, failed commits, intruders, late joiners, warm spares): CI's slice of
    `make sim SEEDS=10000`."""
    chunks = [(i, i + 50) for i in range(1000, 1500, 50)]
    with multiprocessing.get_context("fork").Pool(2) as pool:
        bad = [b for got in pool.map(_slice, chunks) for b in got]
    assert bad == [], bad[:3]


def test_a_replica_cut_off_from_etcd_and_its_peers_is_back_within_a_second_of_the_cut():
    """A host cut off for 6 s: its lease lapses, it re-registers as a joiner (its report stands for
    every round, whatever the newest round recorded in etcd: steady rounds are recorded one in 32),
    and the others take it in at their next round. Before that rule it came back only when a later
    record happened to cover its round (7 s later here) or, in the netns test, never."""
    from lightning_ft.sim import replica as sim_replica

    back = []
    real = sim_replica.SimReplica._apply

    def watch(self, plan):
        if self.rid == 0 and plan.role == "train" and self.world.now > 8.0 and 2 in plan.quorum.contributors:
            back.append(self.world.now)
        return real(self, plan)
    sim_replica.SimReplica._apply = watch  # type: ignore[method-assign]
    try:
        v = run_seed(1, replace(CFG, steps=400), (Fault(2.0, "isolate", 2, seconds=6.0),))
    finally:
        sim_replica.SimReplica._apply = real  # type: ignore[method-assign]
    assert v.ok, v.violations
    assert back and back[0] - 8.0 < 1.0, back[:1]
