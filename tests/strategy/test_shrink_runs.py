"""stragglers.policy=shrink on a Lightning program under `lightning-ft run`: replica 1's
"accelerator" is three times slower than the others' (tests/strategy/lit_script.py
--slow-replica). The quorum finds it and shrinks it: it computes 2 of its slot batch's 4
micro-batches (accumulate_grad_batches=4) and the other two replicas train the rest
(coord/stragglers.py, replica/batch_policy.py, strategy/stepping.py). The global batch stays
the same: the run follows, micro-batch by micro-batch, one with no straggler computed in
process from the same batches, and it ends identical with an exact ledger."""
from __future__ import annotations

import argparse

import pytest
import torch

from lightning_ft.replica.ledger import SlotStream
from tests.strategy.lit_script import MLP, Teacher
from tests.strategy.runs import lft_run, ok

STEPS, R, BATCH, N, LR = 48, 3, 8, 4, 1e-2
SHRINK = ("stragglers.policy=shrink", "stragglers.window=4", "consistency.every_n_steps=1")
"""A full round every step (a digest each), so the straggler is confirmed within a few steps."""


def micro_losses_without_a_straggler(steps: int) -> list[float]:
    """Replica 0's micro-batch losses, in order, in a job whose every step averages the R slot
    batches of N micro-batches each (lit_script's model, data and optimizer)."""
    torch.manual_seed(0)
    net = MLP(argparse.Namespace(unseeded=False, manual=False)).net
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    data = Teacher()
    stream = SlotStream(len(data), BATCH * N, R, seed=0)
    out = []
    for k in range(steps):
        opt.zero_grad()
        for slot in range(R):
            ids = stream.batch(slot, k)
            for j in range(N):
                x, y = data[ids[j * BATCH:(j + 1) * BATCH]]
                loss = torch.nn.functional.mse_loss(net(x), y)
                (loss / N / R).backward()
                if slot == 0:
                    out.append(loss.item())
        opt.step()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_shrunk_straggler_gives_micro_batches_away_and_the_job_trains_the_same_batches(tmp_path, etcd_endpoint,
                                                                                         nproc):
    """nproc 2: FSDP2 inside each replica; every rank of the straggler skips the same micro-batches."""
    run = lft_run(tmp_path, etcd_endpoint, "--steps", str(STEPS), "--accumulate", str(N), "--batch", str(BATCH),
                  "--step-sleep", "0.01", "--slow-replica", "1", "--slow-factor", "3", replicas=R, overrides=SHRINK,
                  nproc=nproc, timeout=280)
    assert run.proc.returncode == 0, ok(run)
    ev = [e for e in run.events if e["event"] == "straggler"]
    assert ev and all(e["replica"] == 1 and e["policy"] == "shrink" for e in ev), ev
    r0, r1, r2 = (run.replica_rows(r) for r in range(R))
    shrunk = [r for r in r1 if r.get("shrunk")]
    assert len(shrunk) >= 0.4 * len(r1), ok(run)  # it was shrunk for most of the run, from early on
    g = shrunk[-1]["shrunk"][0][1]
    assert shrunk[-1]["shrunk"] == [[1, g, N]] and 0 < g < N and shrunk[-1]["skip"] == list(range(N - g, N))
    # it computed only what it kept (its own rows are per micro-batch Lightning delivered) ...
    # (g follows the measured ratio: under load it can move between rounds; each round's own split)
    took = [(tuple(m), r["shrunk"][0][1]) for r in r0 + r2 if r.get("shrunk") for m in r["took"]]
    assert took and all(m[0] == 1 and m[2] >= N - gr for m, gr in took)
    # ... and the helpers took the rest: every step trained all R slot batches, exactly once
    assert run.ledger.ok and run.ledger.steps == STEPS, (run.ledger.duplicates, run.ledger.gaps)
    assert {s: run.ledger.trained[s] for s in range(R)} == {s: list(range(STEPS)) for s in range(R)}
    assert run.finals[0]["digest"] == run.finals[1]["digest"] == run.finals[2]["digest"], ok(run)
    # the same gradients every step as with no straggler: only the order of their sums differs
    assert {r["lr_factor"] for r in r0 if r["step"] > 0} == {1.0}  # before the first commit: the sync round's
    if nproc > 1:  # each rank trains half of every micro-batch (FSDP2): the rows are rank 0's halves
        assert len(run.finals[0]["digest"]) == nproc
        return
    assert [r["loss"] * N for r in r0] == pytest.approx(micro_losses_without_a_straggler(STEPS), rel=1e-4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("factor,benched", [(1.6, False), (4.0, True)])
def test_adaptive_shrinks_what_a_split_evens_out_and_benches_the_rest(tmp_path, etcd_endpoint, factor, benched):
    """stragglers.policy=adaptive: replica 1 computes `factor` times slower. At 1.6x a split of its
    4 micro-batches brings the round within 1.3x of the others' time: it is shrunk. At 4x no
    split can (its best, 2 of 4 kept, is 1.5x the others' time and more): it is benched, and
    the strategy's probe (its window computed again, nothing committed) keeps it out to the
    end; it adopts the final state. Identical, exact ledger."""
    run = lft_run(tmp_path, etcd_endpoint, "--steps", str(STEPS), "--accumulate", str(N), "--batch", str(BATCH),
                  "--step-sleep", "0.01", "--slow-replica", "1", "--slow-factor", str(factor), replicas=R,
                  overrides=("stragglers.policy=adaptive",) + SHRINK[1:], timeout=280)
    assert run.proc.returncode == 0, ok(run)
    ev = [e for e in run.events if e["event"] == "straggler"]
    assert ev and all(e["replica"] == 1 and e["policy"] == "adaptive" for e in ev), ev
    r1 = run.replica_rows(1)
    if benched:
        assert any(e.get("benched") for e in ev), ev
        out = min(e["step"] for e in ev if e.get("benched"))
        assert not [r for r in r1 if r["step"] > out + 1 and 1 in r.get("contributors", ())], ok(run)  # out to the end
    else:
        assert not any(e.get("benched") for e in ev) and any(r.get("shrunk") for r in r1), ok(run)
    assert run.ledger.ok, (run.ledger.duplicates, run.ledger.gaps)
    assert run.finals[0]["digest"] == run.finals[1]["digest"] == run.finals[2]["digest"], ok(run)
