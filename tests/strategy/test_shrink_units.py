"""The strategy's side of stragglers.policy=shrink, in process (strategy/stepping.py): after the
round's plan, `train_extra` leaves in the local gradients exactly every micro-batch of our slot
batch but `plan.skip`, plus the micro-batches of shrunk slots dealt to us (`plan.micro`),
whatever this replica computed before the plan (what the previous quorum announced), and
`training_step` skips a given-away micro-batch inside Lightning's loop."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import TensorDataset, default_collate

from lightning_ft.replica.ledger import SlotStream
from lightning_ft.strategy.stepping import LightningStep
from lightning_ft.strategy.sampler import FTBatchSampler

N, B, R, RID, K = 4, 2, 3, 1, 5


def loss_of(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def strategy(model):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 3, generator=g), torch.randn(256, 1, generator=g))
    sampler = FTBatchSampler(SlotStream(len(data), B * N, R, seed=0), RID, 0, 1, N, start=lambda: 0)
    s = SimpleNamespace(train_data=(data, default_collate), sampler=sampler, rid=RID, root_device=torch.device("cpu"),
                        module=SimpleNamespace(automatic_optimization=True,
                                               trainer=SimpleNamespace(accumulate_grad_batches=N)),
                        batch_to_device=lambda b: b, backward=lambda loss, opt: loss.backward())
    step = LightningStep(s, SimpleNamespace(micro_batches=N))  # type: ignore[arg-type]
    s.training_step = lambda batch, idx: step.training_step(lambda: loss_of(model, batch))
    return step, data, sampler


def grads_of(model, data, parts):
    """The gradients of the micro-batches `parts` ((slot, k, j), ...), each loss / N."""
    model.zero_grad(set_to_none=True)
    sampler = FTBatchSampler(SlotStream(len(data), B * N, R, seed=0), RID, 0, 1, N, start=lambda: 0)
    for slot, k, j in parts:
        ids = sampler.micro_batches(slot, k)[j]
        (loss_of(model, default_collate([data[i] for i in ids])) / N).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("done,skip,micro", [
    ({0, 1}, (2, 3), ()),                        # shrunk as announced
    ({0, 1}, (), ()),                            # the split ended (no helper left): make up 2 and 3
    ({0, 1, 2}, (3,), ()),                       # it gives fewer away than announced
    ({0, 1, 2, 3}, (2, 3), ()),                  # newly shrunk after it computed all: start over
    ({0, 1, 2, 3}, (), ((2, 7, 3), (0, 4, 2))),  # a helper: others' micro-batches add to its own
    ({0}, (1, 2, 3), ((2, 7, 0),)),              # shrunk and, for another straggler, a helper
])
def test_after_the_plan_the_gradients_hold_exactly_what_the_round_assigns(done, skip, micro):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    s, data, sampler = strategy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads_of(model, data, [(RID, K, j) for j in sorted(done)])  # what it computed before the plan
    s.st.own_done = set(done)
    plan = SimpleNamespace(batch_index=K, skip=skip, extra=(), micro=micro)
    s._train_extra(plan, opt, 0)
    got = [p.grad.clone() for p in model.parameters()]
    want = grads_of(model, data, [(RID, K, j) for j in range(N) if j not in skip] + list(micro))
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-6), (done, skip, micro)
    assert s.st.own_done == set(range(N)) - set(skip)
    assert s.recomputes == (1 if set(done) - (set(range(N)) - set(skip)) else 0)


def test_inside_lightnings_loop_a_given_away_micro_batch_is_not_computed():
    model = torch.nn.Linear(3, 1)
    s, data, sampler = strategy(model)
    calls = []
    st = s.st
    st.skip = {2, 3}
    for j in range(N):
        st.position = (K, j)
        out = s.training_step(lambda j=j: calls.append(j) or torch.ones(()))
        skipped = s.skip_backward()
        assert (float(out) == 0.0 and skipped) if j in st.skip else (float(out) == 1.0 and not skipped)
    assert calls == [0, 1] and st.own_done == {0, 1}
    # outside the loop (train_extra, recompute) every call computes
    st.direct = True
    st.position = (K, 3)
    assert float(s.training_step(lambda: torch.ones(()))) == 1.0
    # a replica that cannot be shrunk never skips
    st.direct, s.replica.micro_batches = False, 0
    assert float(s.training_step(lambda: torch.ones(()))) == 1.0
