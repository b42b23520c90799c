"""batch_policy=constant under `lightning-ft run`: while a replica is down (kept down for
`failure.events[].downtime_steps`), the survivors train its slot's batches too, so every
step trains the full global batch, exactly once, and the run follows one without failures
(computed in process from the same batches)."""
from __future__ import annotations

import argparse

import pytest
import torch

from lightning_ft.replica.ledger import SlotStream
from tests.strategy.lit_script import MLP, Teacher
from tests.strategy.runs import lft_run, ok

STEPS, R, BATCH, LR = 60, 3, 8, 1e-2
KILL = "failure.events=[{replica: 1, step: 5, kind: kill, downtime_steps: 10}]"


def losses_without_failures(steps: int) -> list[float]:
    """Replica 0's batch loss before each step of a fault-free job: one model, the mean
    gradient of the R slot batches of every step (lit_script's model, data and optimizer)."""
    torch.manual_seed(0)
    net = MLP(argparse.Namespace(unseeded=False, manual=False)).net
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    data = Teacher()
    stream = SlotStream(len(data), BATCH, R, seed=0)
    out = []
    for k in range(steps):
        opt.zero_grad()
        for slot in range(R):
            x, y = data[stream.batch(slot, k)]
            loss = torch.nn.functional.mse_loss(net(x), y)
            (loss / R).backward()
            if slot == 0:
                out.append(loss.item())
        opt.step()
    return out


def test_constant_batch_survivors_train_the_dead_slot_and_match_a_run_without_failures(tmp_path, etcd_endpoint):
    run = lft_run(tmp_path, etcd_endpoint, "--steps", str(STEPS), "--degraded-sleep", "0.5", "--lr-mode", "linear",
                  replicas=R, overrides=(KILL, "batch_policy=constant"))
    assert run.proc.returncode == 0, ok(run)
    assert [(e["event"], e["replica"]) for e in run.events if e["event"] in ("evict", "restart")] == [
        ("evict", 1), ("restart", 1)], ok(run)
    # exactly once, and every slot trained one batch per step although slot 1 was away
    assert run.ledger.ok, (run.ledger.duplicates, run.ledger.gaps, run.ledger.conflicts)
    assert run.ledger.steps == STEPS
    assert {s: run.ledger.trained[s] for s in range(R)} == {s: list(range(STEPS)) for s in range(R)}
    r0 = run.replica_rows(0)
    assert [r for r in r0 if r["contributors"] == [0, 2]], ok(run)
    assert {r["lr_factor"] for r in r0} == {1.0}  # a full global batch: no LR intervention applies
    # the supervisor kept replica 1 down for its downtime (10 steps after the kill at 5) ...
    assert (1, 1) in run.rows, ok(run)
    back = run.rows[(1, 1)]
    assert back[0]["step"] >= 15, back[:2]
    # ... and its slot resumed past the batches the survivors trained for it
    assert back[0]["batch"] > run.rows[(1, 0)][-1]["batch"] + 1
    assert run.finals[0]["digest"] == run.finals[1]["digest"] == run.finals[2]["digest"], ok(run)
    # the same batches every step as without failures: only the order of gradient sums differs
    assert [r["step"] for r in r0] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in r0] == pytest.approx(losses_without_failures(STEPS), rel=1e-4)
