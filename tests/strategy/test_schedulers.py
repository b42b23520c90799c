"""strategy/schedulers.py: schedulers stepped by committed steps; with several optimizers a step
scheduler follows its own optimizer's commits and epoch schedulers count batches."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_ft.strategy.schedulers import CommittedSchedulers


def config(opt, interval, gamma):
    sch = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=gamma)
    return SimpleNamespace(scheduler=sch, interval=interval, reduce_on_plateau=False)


def test_step_schedulers_follow_their_own_optimizer_and_hand_steps_do_nothing():
    g = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    d = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    e = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    cs = CommittedSchedulers([config(g, "step", 0.5), config(d, "step", 0.1), config(e, "epoch", 0.9)])
    cs.steps_per_epoch = 2
    for batch in range(1, 5):  # a batch: d's step starts it, g's continues it
        cs.committed(batch, optimizer=d, new_batch=True)
        cs.committed(batch, optimizer=g, new_batch=False)
        for c in cs.configs:
            c.scheduler.step()  # the program's own calls (self.lr_schedulers()): no-ops
    assert g.param_groups[0]["lr"] == pytest.approx(0.5 ** 4, rel=1e-12)
    assert d.param_groups[0]["lr"] == pytest.approx(0.1 ** 4, rel=1e-12)
    assert e.param_groups[0]["lr"] == pytest.approx(0.9 ** 2, rel=1e-12)  # batches 2 and 4 ended an epoch; once each


def test_one_optimizer_steps_every_scheduler_at_every_commit():
    g = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    cs = CommittedSchedulers([config(g, "step", 0.5)])
    cs.committed(1)
    cs.committed(2)
    assert g.param_groups[0]["lr"] == 0.25


def test_a_hand_stepped_epoch_schedule_under_manual_optimization_warns_once():
    """Under DDP a manual-optimization program's sch.step() calls are the schedule; here the
    configured interval is (Lightning's default is 'epoch'): the first hand call says so."""
    import warnings

    g = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    d = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    cs = CommittedSchedulers([config(g, "epoch", 0.5), config(d, "step", 0.5)], manual=True)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for _ in range(3):
            for c in cs.configs:
                c.scheduler.step()
    assert len(got) == 1 and "'interval': 'step'" in str(got[0].message) and "ExponentialLR" in str(got[0].message)
    auto = CommittedSchedulers([config(g, "epoch", 0.5)])  # automatic: Lightning's own epoch-end calls
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        auto.configs[0].scheduler.step()
    assert not got
