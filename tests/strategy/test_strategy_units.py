"""In-process pieces of the strategy: the exactly-once sampler, scheduler bookkeeping,
registration on import and the launcher-environment error."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from lightning_ft.replica.ledger import SlotStream
from lightning_ft.strategy.sampler import FTBatchSampler


def test_sampler_splits_slot_batches_over_ranks_and_micro_batches():
    stream = SlotStream(num_samples=96, batch_size=8, slots=2, seed=3)
    pos = [5]
    ranks = [FTBatchSampler(stream, slot=1, rank=r, world=2, micro_batches=2, start=lambda: pos[0]) for r in (0, 1)]
    assert len(ranks[0]) == 96 // 8 // 2 * 2
    out = [list(s) for s in ranks]
    for k in range(len(out[0]) // 2):
        full = stream.batch(1, 5 + k)
        got = out[0][2 * k] + out[1][2 * k] + out[0][2 * k + 1] + out[1][2 * k + 1]
        assert sorted(got) == sorted(full)  # the slot batch, each sample once
        assert out[0][2 * k] == full[0:4][0::2] and out[1][2 * k + 1] == full[4:8][1::2]
    assert list(ranks[0].tags)[:4] == [(5, 0), (5, 1), (6, 0), (6, 1)]


def test_sampler_restarts_at_the_cursor_read_at_iter_time_and_clears_old_tags():
    stream = SlotStream(num_samples=64, batch_size=4, slots=2)
    pos = [0]
    s = FTBatchSampler(stream, 0, 0, 1, 1, start=lambda: pos[0])
    it = iter(s)
    next(it), next(it)
    assert list(s.tags) == [(0, 0), (1, 0)]
    pos[0] = 7
    assert next(iter(s)) == stream.batch(0, 7) and list(s.tags) == [(7, 0)]


def test_sampler_rejects_indivisible_batches():
    with pytest.raises(ValueError, match="not divisible"):
        FTBatchSampler(SlotStream(64, 6, 2), 0, 0, 4, 1, start=lambda: 0)


def _configs(opt):
    sch = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ep = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    return sch, ep, [SimpleNamespace(scheduler=sch, interval="step", reduce_on_plateau=False),
                     SimpleNamespace(scheduler=ep, interval="epoch", reduce_on_plateau=False)]


def test_schedulers_step_once_per_committed_step():
    from lightning_ft.strategy.schedulers import CommittedSchedulers as _Schedulers

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sch, ep, configs = _configs(opt)
    sync = _Schedulers(configs)
    sch.step()  # Lightning's call with nothing committed: no-op
    assert sch.last_epoch == 0
    sync.committed()  # a catch-up step ...
    # ... and the step trained right after it in the same optimizer_step call sees the next
    # step's rate, as the contributors do (the soak's repeated divergence: it saw the old one)
    assert sch.last_epoch == 1 and opt.param_groups[0]["lr"] == 1.0
    sync.committed()
    assert sch.last_epoch == 2 and opt.param_groups[0]["lr"] == 0.5
    sch.step()  # Lightning's (or the user's) calls change nothing: the commits stepped it
    sch.step()
    assert sch.last_epoch == 2
    sync.committed()
    assert sch.last_epoch == 3
    # a catch-up loads the healthy replica's state, which already counts its steps
    state = sync.state_dict()
    assert "step" not in state[0] and state[0]["last_epoch"] == 3
    sync.committed()
    sync.load_state_dict(state)
    sch.step()
    assert sch.last_epoch == 3
    # epoch schedulers follow the job's epochs (committed steps), not this replica's Lightning epochs
    ep.step()
    assert ep.last_epoch == 0
    sync.steps_per_epoch = 4
    sync.committed(3)
    assert ep.last_epoch == 0
    before = opt.param_groups[0]["lr"]
    sync.committed(4)  # the step scheduler steps to 5 (no change at an odd step), the epoch one to 1
    assert ep.last_epoch == 1 and sch.last_epoch == 5 and opt.param_groups[0]["lr"] == before * 0.9


def test_import_registers_ft_hsdp_without_importing_lightning():
    code = ("import sys, lightning_ft; assert 'lightning' not in sys.modules; "
            "import lightning.pytorch as L; from lightning.pytorch.strategies import StrategyRegistry; "
            "print(StrategyRegistry['ft_hsdp']['strategy'].__name__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "FTHSDPStrategy"


def _trainer_without_launcher(tmp_path, extra_env: dict) -> subprocess.CompletedProcess:
    code = ("import lightning_ft, lightning.pytorch as L\n"
            "L.Trainer(strategy='ft_hsdp', accelerator='cpu', max_steps=1, logger=False)\n")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("LFT_")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**env, **extra_env})


def test_without_launcher_variables_a_program_that_is_no_script_file_is_told_how_to_launch(tmp_path):
    r = _trainer_without_launcher(tmp_path, {})  # python -c: self-launch has no script to start again
    assert r.returncode != 0
    assert "self-launch starts the program's script file again" in r.stderr, r.stderr[-2000:]
    assert "has none (python -c, stdin or an interactive session)" in r.stderr
    assert "lightning-ft run --replicas R --nproc-per-replica W train.py" in r.stderr


def test_a_partial_launcher_environment_is_an_error_not_a_self_launch(tmp_path):
    r = _trainer_without_launcher(tmp_path, {"RANK": "1", "WORLD_SIZE": "2"})
    assert r.returncode != 0
    assert "lightning-ft run --replicas R" in r.stderr and "lightning-ft env --replica-id R" in r.stderr
    assert "LFT_JOB, LFT_REPLICA_ID, LFT_NUM_REPLICAS, LFT_ETCD not set" in r.stderr
    assert "a launcher started this process: RANK, WORLD_SIZE set" in r.stderr, r.stderr[-2000:]
