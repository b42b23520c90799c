"""`trainer.fit(model, ckpt_path=...)` under ft_hsdp (strategy/resume.py): the job continues at the
checkpoint's step from one state on every replica, with its optimizer, schedulers, loss scale and
(for ft_hsdp checkpoints) its data position. Before: a single-file checkpoint failed to load with
one process per replica ("Could not find a distributed model"), and global_step restarted at 1."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.strategy.runs import SCRIPT, lft_run, ok
from tests.strategy.test_ft_hsdp_runs import sched_lr


def _rows(stdout: str) -> list[dict]:
    return [json.loads(l) for l in stdout.splitlines() if l.startswith('{"event": "batch"')]


def test_a_plain_ddp_checkpoint_moves_to_ft_hsdp_and_continues_at_its_step(tmp_path, etcd_endpoint):
    """DDP (2 processes, the slot order ft_hsdp uses) writes step=4.ckpt; ft_hsdp (2 replicas, one
    process each) resumes from it: global steps 5..12, the StepLR schedule continues, every slot
    starts at cursor 4 (the foreign checkpoint's step), so steps 5..8 train DDP's batches 4..7 and
    give DDP's losses; replicas end identical and the ledger is exact from base 4."""
    ddp = subprocess.run([sys.executable, SCRIPT, "--steps", "8", "--ddp", "2", "--steplr", "--save-every", "4",
                          "--ckpt-dir", str(tmp_path / "ddp")], capture_output=True, text=True, timeout=180,
                         cwd=str(tmp_path))
    assert ddp.returncode == 0, ddp.stdout[-2000:] + ddp.stderr[-2000:]
    ref = {r["step"]: r for r in _rows(ddp.stdout)}
    steps = 12
    run = lft_run(tmp_path, etcd_endpoint, "--steps", str(steps), "--steplr", "--ckpt-path",
                  str(tmp_path / "ddp" / "step=4.ckpt"))
    assert run.proc.returncode == 0, ok(run)
    for rid in (0, 1):
        rows = run.replica_rows(rid)
        assert [r["step"] for r in rows] == list(range(5, steps + 1)), ok(run)
        assert all(r["lr"] == pytest.approx(sched_lr(r["step"]), rel=1e-9) for r in rows)
        assert [r["batch"] for r in rows] == list(range(4, steps))
    assert [r["loss"] for r in run.replica_rows(0)[:4]] == pytest.approx([ref[s]["loss"] for s in range(5, 9)],
                                                                          rel=1e-4, abs=1e-6)
    assert run.finals[0]["digest"] == run.finals[1]["digest"], ok(run)
    assert run.finals[0]["step"] == run.finals[1]["step"] == steps
    assert run.ledger.ok and run.ledger.steps == steps - 4
    assert run.ledger.trained == {0: list(range(4, steps)), 1: list(range(4, steps))}


def test_an_ft_hsdp_checkpoint_resumes_exactly_fsdp2_w2_16_mixed(tmp_path, etcd_endpoint):
    """ft_hsdp (W=2, fp16 with a GradScaler that overflows at first) writes distributed
    checkpoints with ModelCheckpoint; a new job resumed from step=6 retrains steps 7..10 exactly as
    the first job did (loss, lr, loss scale, skipped steps), from the checkpoint's slot cursors."""
    common = ("--steplr", "--amp16", "1e8", "--growth-interval", "2")
    first = lft_run(tmp_path, etcd_endpoint, "--steps", "10", *common, "--save-every", "6", "--ckpt-dir",
                    str(tmp_path / "ft"), nproc=2)
    assert first.proc.returncode == 0, ok(first)
    ref = {rid: {r["step"]: r for r in first.replica_rows(rid)} for rid in (0, 1)}  # each trains its own slot
    assert (tmp_path / "ft" / "step=6.ckpt").is_dir()  # ModelParallelStrategy's distributed checkpoint
    run = lft_run(tmp_path, etcd_endpoint, "--steps", "14", *common,
                  "--ckpt-path", str(tmp_path / "ft" / "step=6.ckpt"),
                  nproc=2)
    assert run.proc.returncode == 0, ok(run)
    for rid in (0, 1):
        rows = run.replica_rows(rid)
        assert [r["step"] for r in rows] == list(range(7, 15)), ok(run)
        for r in rows[:4]:
            want = ref[rid][r["step"]]
            assert (r["loss"], r["lr"], r["scale"], r["growth"], r["psum"]) == (
                want["loss"], want["lr"], want["scale"], want["growth"], want["psum"]), (r, want)
    assert run.finals[0]["digest"] == run.finals[1]["digest"], ok(run)
    assert run.ledger.ok and run.ledger.steps == 8
    assert run.ledger.trained == {0: list(range(6, 14)), 1: list(range(6, 14))}
