"""The goodput model: the paper's figures, the accounting per failure, its limits, and the
replica-count recommendation."""
from __future__ import annotations

import random
import math
from dataclasses import replace

import pytest

from lightning_ft.sim import goodput as gp
from lightning_ft.sim.goodput import PAPER, Inputs, Memory


def test_paper_preset_gives_44_and_80_percent():
    g = gp.goodput(PAPER)
    assert g.restart_ett == pytest.approx(8 / 18)  # 18 min between failures, 10 lost
    assert round(g.restart_ett, 2) == 0.44
    assert g.ft_ett == pytest.approx((8 + 7 * 11 / 12) / 18)  # 3 min stall, 7 min at 11/12
    assert round(g.ft_ett, 2) == 0.80
    assert (g.ft_stall_s, g.ft_degraded_s, g.restart_lost_s) == (180, 420, 600)


def base(**kw) -> Inputs:
    d = dict(gpus=64, replicas=4, mtbf_job_s=3600, detect_s=5, restart_s=100, catchup_s=20, step_s=2,
             ckpt_every=50, ckpt_cost_s=4)
    d.update(kw)
    return Inputs(**d)


def test_each_failure_costs_what_the_docstring_says():
    inp = base()
    g = gp.goodput(inp)
    ck = 100 / 104  # 50 steps x 2 s of training per 4 s checkpoint
    assert g.ckpt_factor == pytest.approx(ck)
    assert g.restart_lost_s == pytest.approx(5 + 100 + 25 * 2)  # rollback: half an interval
    assert g.restart_ett == pytest.approx((1 - 155 / 3600) * ck)
    assert g.ft_stall_s == pytest.approx(5 + 2)  # detection + the retried step
    assert g.ft_degraded_s == pytest.approx(5 + 100 + 20 - 7)
    assert g.ft_ett == pytest.approx((1 - (7 + 118 / 4) / 3600) * ck)


def test_explicit_stall_rollback_and_world_restart_are_used():
    g = gp.goodput(base(stall_s=30, rollback_steps=10, world_restart_s=400, ckpt_every=0))
    assert g.ckpt_factor == 1.0
    assert g.restart_lost_s == pytest.approx(5 + 400 + 10 * 2)
    assert g.ft_lost_s == pytest.approx(30 + (125 - 30) / 4)


def test_survivors_stepping_slower_lose_more():
    g = gp.goodput(base(degraded_step_s=4.0, stall_s=7))  # half the fault-free rate while one is away
    assert g.ft_lost_s == pytest.approx(7 + 118 * (1 - 3 / 4 * 0.5))
    assert gp.goodput(base(degraded_step_s=2.0, stall_s=7)).ft_lost_s == pytest.approx(7 + 118 / 4)
    # stepping faster alone can win back the missing replica's share, never more than that
    assert gp.goodput(base(replicas=2, degraded_step_s=1.0, stall_s=7)).ft_lost_s == pytest.approx(7)
    assert gp.goodput(base(replicas=2, degraded_step_s=0.5, stall_s=7)).ft_lost_s == pytest.approx(7)


def test_one_replica_is_restart_the_world():
    g = gp.goodput(base(replicas=1))
    assert g.ft_ett == g.restart_ett


def test_failures_faster_than_recovery_give_zero_not_negative():
    g = gp.goodput(base(mtbf_job_s=60))
    assert g.restart_ett == 0.0 and g.ft_ett >= 0.0


def random_inputs(rng: random.Random) -> Inputs:
    gpus = rng.choice([8, 64, 1024, 98304])
    return Inputs(gpus=gpus, replicas=rng.randint(1, min(gpus, 64)), mtbf_job_s=rng.uniform(60, 1e6),
                  detect_s=rng.uniform(0, 120), restart_s=rng.uniform(0, 1200), catchup_s=rng.uniform(0, 300),
                  step_s=rng.uniform(0, 30), ckpt_every=rng.choice([0, 10, 100, 1000]),
                  ckpt_cost_s=rng.uniform(0, 60), stall_s=rng.choice([None, rng.uniform(0, 300)]))


def test_properties_over_random_inputs():
    rng = random.Random(0)
    for _ in range(2000):
        inp = random_inputs(rng)
        g = gp.goodput(inp)
        assert 0.0 <= g.restart_ett <= 1.0 and 0.0 <= g.ft_ett <= 1.0
        more = gp.goodput(replace(inp, replicas=min(inp.gpus, inp.replicas * 2)))
        assert more.restart_ett == g.restart_ett  # the baseline does not care about replicas
        if inp.replicas > 1:
            assert more.ft_ett >= g.ft_ett - 1e-12  # more replicas lose less per failure
        rarer = gp.goodput(replace(inp, mtbf_job_s=inp.mtbf_job_s * 2))
        assert rarer.ft_ett >= g.ft_ett and rarer.restart_ett >= g.restart_ett
        # ft wins whenever its stall and its replica's absence are no longer than a world restart
        if inp.stall <= g.restart_lost_s and inp.down_s <= g.restart_lost_s:
            assert g.ft_ett >= g.restart_ett - 1e-12


def test_at_scale_keeps_the_per_gpu_failure_rate():
    big = gp.at_scale(PAPER, 2 * PAPER.gpus)
    assert big.mtbf_job_s == pytest.approx(PAPER.mtbf_job_s / 2) and big.replicas == 12
    assert gp.at_scale(PAPER, 4).replicas == 4
    assert gp.goodput(big).restart_ett == 0.0 < gp.goodput(big).ft_ett


@pytest.mark.parametrize("kw,msg", [({"replicas": 0}, "at least one"), ({"replicas": 65}, "at least as many GPUs"),
                                    ({"mtbf_job_s": 0}, "MTBF"), ({"restart_s": -1}, "restart_s")])
def test_bad_inputs_are_refused_by_name(kw, msg):
    with pytest.raises(ValueError, match=msg):
        base(**kw)


def test_candidate_counts_split_whole_nodes():
    assert gp.candidate_counts(96) == [2, 3, 4, 6, 12]  # 96 GPUs = 12 nodes of 8
    assert gp.candidate_counts(6) == [2, 3, 6]  # not whole nodes of 8: any divisor
    assert gp.candidate_counts(98304, max_replicas=64) == [2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]


def test_recommendation_takes_the_fewest_replicas_near_the_best():
    counts = gp.candidate_counts(PAPER.gpus)
    rec = gp.recommend(PAPER, counts, tolerance=0.01)
    etts = {c.replicas: c.ft_ett for c in rec.candidates}
    best = max(etts.values())
    assert rec.replicas == min(r for r, e in etts.items() if e >= best - 0.01) == 32
    assert "32 replicas of 3072 GPUs" in rec.reason and f"{best:.3f} at 64" in rec.reason
    assert gp.recommend(PAPER, counts, tolerance=0.0).replicas == 64


def test_memory_caps_the_replica_count():
    # 405B parameters x 16 bytes = 6.48 TB of state; 40 GB per GPU allows 6.48e12 x R / 98304 <= 40e9
    mem = Memory(405e9 * 16, 80e9, 0.5)
    counts = gp.candidate_counts(PAPER.gpus)
    assert all(mem.fits(PAPER.gpus, c) for c in counts)  # R <= 606: all fit
    tight = Memory(405e9 * 16, 80e9, 0.005)  # 0.4 GB per GPU: R <= 6
    rec = gp.recommend(PAPER, counts, tight, tolerance=0.01)
    assert rec.replicas == 6 and "do not fit in memory" in rec.reason
    assert [c.fits for c in rec.candidates] == [c <= 6 for c in counts]
    none = gp.recommend(PAPER, counts, Memory(405e9 * 16, 80e9, 1e-4), tolerance=0.01)
    assert none.replicas is None and "no replica count fits" in none.reason


def test_overhead_divides_ft_hsdps_ett_only():
    g0, g = gp.goodput(base()), gp.goodput(base(overhead=0.25))
    assert g.restart_ett == g0.restart_ett and g.ft_lost_s == g0.ft_lost_s
    assert g.ft_ett == pytest.approx(g0.ft_ett / 1.25) and g.overhead_factor == pytest.approx(0.8)
    assert gp.goodput(base(replicas=1, overhead=0.25)).ft_ett == pytest.approx(g0.restart_ett / 1.25)
    with pytest.raises(ValueError, match="overhead must be > -1"):
        base(overhead=-1)


def flat(**kw) -> Inputs:
    """Losses per failure known exactly: restart-the-world 600 s, ft_hsdp 600 / R s (no stall,
    no steps, no checkpoints); one GPU fails every 1e6 s."""
    d = dict(gpus=100, replicas=10, mtbf_job_s=1e6 / 100, detect_s=0, restart_s=600, catchup_s=0, step_s=0,
             stall_s=0)
    d.update(kw)
    return Inputs(**d)


@pytest.mark.parametrize("kw,want", [
    # G* = X m / ((1 + X) Lr - Lf), rounded up: 0.05e6 / (630 - 60) = 87.7
    ({"overhead": 0.05}, 88),
    ({"overhead": 0.10}, 167),  # 0.1e6 / (660 - 60) = 166.7
    ({"overhead": 0.05, "replicas": 2}, 152),  # Lf = 300: 0.05e6 / (630 - 300) = 151.5
    ({"overhead": 0.5}, 596),  # 0.5e6 / (900 - 60) = 595.2
])
def test_crossover_is_where_the_overhead_meets_the_cheaper_failures(kw, want):
    inp = flat(**kw)
    x, lf, lr = inp.overhead, 600 / inp.replicas, 600
    analytic = x * 1e6 / ((1 + x) * lr - lf)
    c = gp.crossover(inp)
    assert c.gpus == math.ceil(analytic) == want
    assert f"restart-the-world wins below {want} GPUs" in c.reason
    below, at = gp.goodput(gp.at_scale(inp, want - 1)), gp.goodput(gp.at_scale(inp, want))
    assert below.ft_ett <= below.restart_ett and at.ft_ett > at.restart_ett


def test_crossover_without_overhead_is_the_smallest_job():
    c = gp.crossover(flat())
    assert c.gpus == 10 and c.reason.startswith("ft_hsdp wins at every size from 10 GPUs")


def test_crossover_never_when_ft_hsdp_loses_more_per_failure():
    c = gp.crossover(flat(stall_s=700, overhead=0.01))  # a 700 s full stall against a 600 s restart
    assert c.gpus is None
    assert "a failure costs ft_hsdp 700 s, restart-the-world 600 s" in c.reason
    # any tax is paid back before restart-the-world's ETT reaches 0 (at 1e6 / 600 = 1667 GPUs)
    assert gp.crossover(flat(overhead=100.0)).gpus == 1652  # 100e6 / (60600 - 60) = 1651.8
    c = gp.crossover(flat(overhead=0.05), max_gpus=64)
    assert c.gpus is None and c.reason.startswith("restart-the-world wins at every size up to 64 GPUs")


def test_crossover_of_the_paper_with_a_tax_of_6_5_to_13_percent():
    # issue 22: with the measured tax restart-the-world wins below 16K-30K GPUs at the paper's failure rate
    lo, hi = gp.crossover(replace(PAPER, overhead=0.065)).gpus, gp.crossover(replace(PAPER, overhead=0.13)).gpus
    assert lo is not None and hi is not None and 15_000 < lo < hi < 31_000
