"""The exchange buffer: gradients are views of it (no copy in or out), zero_grad keeps them,
and a foreign .grad is still exchanged (copied)."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn as nn

from lightning_ft.replica.buckets import GradBuckets


def _setup(overlap: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sent = []

    def send(view, plan):
        sent.append(view)
        return SimpleNamespace(wait=lambda timeout=None: None)

    b = GradBuckets([p for g in opt.param_groups for p in g["params"]], send, "test")
    b.attach()
    opt.zero_grad = b.zero
    if overlap:
        b.enable_overlap(bucket_bytes=64)
    return model, opt, b, sent


def _loss(model):
    x = torch.arange(12, dtype=torch.float32).view(3, 4) / 10
    return model(x).pow(2).sum()


def test_backward_accumulates_straight_into_the_flat_buffer():
    model, opt, b, _ = _setup()
    _loss(model).backward()
    ref = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert torch.equal(b.flat, ref) and b.flat.abs().sum() > 0
    for p, v in zip(model.parameters(), b.views, strict=True):
        assert p.grad.data_ptr() == v.data_ptr()
    opt.zero_grad(set_to_none=True)  # Lightning's call: zeroed, still views
    assert b.flat.abs().sum() == 0
    assert all(p.grad is not None and p.grad.data_ptr() == v.data_ptr()
               for p, v in zip(model.parameters(), b.views, strict=True))
    _loss(model).backward()
    _loss(model).backward()  # accumulation: twice the gradient
    assert torch.allclose(b.flat, 2 * ref)


def test_the_exchange_result_is_the_gradient_without_a_copy_back():
    model, opt, b, sent = _setup()
    _loss(model).backward()
    plan = SimpleNamespace(contribute=True)
    works = b.send_all(plan, save=False)
    assert len(works) == 1 and sent[0].data_ptr() == b.flat.data_ptr()
    b.flat.mul_(0.5)  # what an all-reduce over two replicas with equal gradients would leave
    b.write_grads()
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in model.parameters()]), b.flat)


def test_a_foreign_grad_is_copied_in_and_replaced_by_the_view():
    model, opt, b, _ = _setup()
    first = next(model.parameters())
    first.grad = torch.full_like(first, 3.0)  # someone assigned a tensor of its own
    b.send_all(SimpleNamespace(contribute=True), save=False)
    lo, hi = b.offsets[0]
    assert torch.equal(b.flat[lo:hi], torch.full((hi - lo,), 3.0))
    b.write_grads()
    assert first.grad.data_ptr() == b.views[0].data_ptr() and torch.equal(first.grad, torch.full_like(first, 3.0))


def test_lagging_rounds_send_zeros_and_hooks_send_buckets_in_canonical_order():
    model, opt, b, sent = _setup(overlap=True)
    b.arm(save=False)
    b.plan_known(SimpleNamespace(contribute=True))
    _loss(model).backward()
    assert len(sent) == len(b.buckets) and [v.data_ptr() for v in sent] == [b.flat[lo:hi].data_ptr()
                                                                              for lo, hi in b.buckets]
    sent.clear()
    b.send_all(SimpleNamespace(contribute=False), save=False)
    assert b.flat.abs().sum() == 0 and len(sent) == len(b.buckets)


def test_saved_gradients_restore_after_a_failed_commit():
    model, opt, b, _ = _setup()
    _loss(model).backward()
    before = b.flat.clone()
    b.send_all(SimpleNamespace(contribute=True), save=True)
    b.flat.zero_()
    assert b.restore() and torch.equal(b.flat, before)


def test_the_flat_buffer_lives_on_the_parameters_device():
    _, _, b, _ = _setup()
    assert b.device == torch.device("cpu") and b.flat.device == b.device


def test_parameters_on_several_devices_are_refused():
    import pytest

    from lightning_ft.ftar.transport.base import FatalError

    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3, device="meta"))]
    with pytest.raises(FatalError, match="several devices"):
        GradBuckets(params, lambda v, p: None, "test")


def test_cuda_gradients_accumulate_into_a_flat_buffer_on_the_gpu():
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (none here); not run")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    b = GradBuckets([p for g in opt.param_groups for p in g["params"]], lambda v, p: None, "test")
    b.attach()
    assert b.flat.is_cuda
    x = torch.arange(12, dtype=torch.float32, device="cuda").view(3, 4) / 10
    model(x).pow(2).sum().backward()
    assert all(p.grad.data_ptr() == v.data_ptr() for p, v in zip(model.parameters(), b.views, strict=True))
    assert torch.equal(b.flat, torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
