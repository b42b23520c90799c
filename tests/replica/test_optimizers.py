"""replica/optimizers.py: several optimizers as one replica state (manual optimization)."""
from __future__ import annotations

import pytest
import torch

from lightning_ft.replica.optimizers import OptimizerError, Optimizers, unwrap
from lightning_ft.replica.state import hyperparameters, materialize_optimizer_state, state_tensors


def gan():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"g": torch.nn.Linear(3, 4), "d": torch.nn.Linear(4, 1)})
    opt_g = torch.optim.Adam(model["g"].parameters(), lr=0.1)
    opt_d = torch.optim.SGD(model["d"].parameters(), lr=0.2, momentum=0.9)
    return model, opt_g, opt_d


def test_shared_parameters_are_refused_naming_both_optimizers():
    model, opt_g, _ = gan()
    other = torch.optim.SGD(list(model["g"].parameters())[:1], lr=0.1)
    with pytest.raises(OptimizerError, match=r"optimizers 0 and 1 share a parameter \(shape \(4, 3\)\)"):
        Optimizers([opt_g, other])


def test_param_groups_and_state_cover_every_optimizer_and_step_only_the_active_one():
    model, opt_g, opt_d = gan()
    opts = Optimizers([opt_g, opt_d])
    assert [g["lr"] for g in opts.param_groups] == [0.1, 0.2]
    assert opts.param_groups[1] is opt_d.param_groups[0]  # the same dicts: an update reaches the optimizer
    assert unwrap(opts) == [opt_g, opt_d] and unwrap(opt_g) is opt_g
    materialize_optimizer_state(opts)  # a fresh replica: every optimizer's state exists, zeroed
    names = set(state_tensors(list(model.named_parameters()), model, opts))
    assert {n for n in names if n.startswith("optim.")} == {
        "optim.0.exp_avg", "optim.0.exp_avg_sq", "optim.0.step", "optim.1.exp_avg", "optim.1.exp_avg_sq",
        "optim.1.step", "optim.2.momentum_buffer", "optim.3.momentum_buffer"}
    assert set(hyperparameters(opts)) >= {"hparam.0.lr", "hparam.1.lr", "hparam.1.momentum"}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    g0 = [p.detach().clone() for p in model["g"].parameters()]
    d0 = [p.detach().clone() for p in model["d"].parameters()]
    opts.active = 1
    opts.step()
    # the generator did not move
    assert all(torch.equal(a, b) for a, b in zip(g0, model["g"].parameters(), strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(d0, model["d"].parameters(), strict=True))
    opts.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model["d"].parameters())
    assert all(p.grad is not None for p in model["g"].parameters())
    assert len(opts.state) == 4 and all(p in opts.state for p in model.parameters())
