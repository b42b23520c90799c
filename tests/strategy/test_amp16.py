"""fp16 loss scaling under ft_hsdp (replica/scaler.py; docs/ARCHITECTURE.md, "16-bit: the loss scale").

On CPU Lightning turns `precision="16-mixed"` into bf16 (no scaler), so these runs use Lightning's
own `MixedPrecision("16-mixed", "cpu")` plugin: fp16 autocast and a real `torch.amp.GradScaler`
on CPU (lit_script.py --amp16). The CUDA path differs only in the autocast device.

Before replica/scaler.py the strategy's optimizer_step bypassed the plugin's: the gradients were
never unscaled, the scale never moved, and one overflow turned every replica's weights into the
same NaNs (digests still equal)."""
from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest

from tests.strategy.runs import SCRIPT, lft_run, ok


def _rows(stdout: str) -> list[dict]:
    return [json.loads(l) for l in stdout.splitlines() if l.startswith('{"event": "batch"')]


def _skipped(rows: list[dict]) -> list[int]:
    """Steps whose optimizer step was skipped: the parameters did not move."""
    return [b["step"] for a, b in itertools.pairwise(rows) if b["psum"] == a["psum"]]


def test_an_overflow_on_one_replica_skips_the_step_on_every_replica_as_lightning_ddp_does(tmp_path, etcd_endpoint):
    """Replica 1 alone overflows at global steps 3 and 6: the averaged gradients hold inf on
    every replica, so both skip those steps and halve the scale; the scale grows after every 3
    clean steps. Lightning's DDP with the same plugin, data and overflow is the reference."""
    steps = 12
    args = ("--steps", str(steps), "--amp16", "1024", "--overflow-at", "3,6")
    ft = lft_run(tmp_path, etcd_endpoint, *args)
    assert ft.proc.returncode == 0, ok(ft)
    ddp = subprocess.run([sys.executable, SCRIPT, *args, "--ddp", "2"], capture_output=True, text=True,
                         timeout=180, cwd=str(tmp_path))
    assert ddp.returncode == 0, ddp.stdout[-2000:] + ddp.stderr[-2000:]
    ref = _rows(ddp.stdout)
    r0, r1 = ft.replica_rows(0), ft.replica_rows(1)
    assert len(ref) == len(r0) == len(r1) == steps
    assert all(r["finite"] for r in r0 + r1), ok(ft)
    # the scale: 1024, grows to 2048 after 3 clean steps, halves at each overflow
    expected = [1024.0, 1024.0, 2048.0, 1024.0, 1024.0, 1024.0, 512.0, 512.0, 512.0, 1024.0, 1024.0, 1024.0]
    assert [r["scale"] for r in ref] == expected
    assert [r["scale"] for r in r0] == [r["scale"] for r in r1] == expected, ok(ft)
    assert [r["growth"] for r in r0] == [r["growth"] for r in r1] == [r["growth"] for r in ref]
    # the skipped steps are the overflowed batches (global step 3 -> row 4), on both replicas
    assert _skipped(ref) == _skipped(r0) == _skipped(r1) == [4, 7]
    assert [r["loss"] for r in r0] == pytest.approx([r["loss"] for r in ref], rel=1e-4, abs=1e-6)
    assert ft.finals[0]["digest"] == ft.finals[1]["digest"], ok(ft)
    assert ft.finals[0]["scaler"] == ft.finals[1]["scaler"] and ft.finals[0]["scaler"]["scale"] == 1024.0
    assert ft.finals[0]["amp_skipped"] == ft.finals[1]["amp_skipped"] == 2
    assert ft.ledger.ok and ft.ledger.steps == steps  # a skipped step is a committed step: its batches count


def test_the_loss_scale_travels_in_catch_up_fsdp2_w2(tmp_path, etcd_endpoint):
    """A huge initial scale overflows fp16 for the first steps (every replica skips them alike,
    FSDP2 with 2 ranks per replica: the OR of the ranks' shards decides); replica 1 is killed at
    step 5 and its new incarnation, whose own GradScaler starts at 1e12, catches up to the job's
    scale and growth tracker: it trains with the same scale from its first row and ends identical
    (a different scale would show as a divergence the guard cannot heal with two replicas)."""
    steps = 30
    run = lft_run(tmp_path, etcd_endpoint, "--steps", str(steps), "--amp16", "1e12", "--growth-interval", "2",
                  "--degraded-sleep", "0.5", nproc=2, overrides=("failure.events=[{replica: 1, step: 5, kind: kill}]",))
    assert run.proc.returncode == 0, ok(run)
    assert ("restart", 1) in [(e["event"], e["replica"]) for e in run.events], ok(run)
    r0, back = run.replica_rows(0), run.rows.get((1, 1), [])
    assert back, ok(run)
    assert all(r["finite"] for r in r0 + back), ok(run)
    assert r0[0]["scale"] == pytest.approx(5e11, rel=1e-6)  # the first step overflowed: 1e12 halved
    assert len(_skipped(r0)) >= 10, [r["scale"] for r in r0]
    assert back[0]["scale"] < 1e12 / 2 ** 5  # the job's scale, not its own scaler's initial one
    by_step = {r["step"]: (r["scale"], r["growth"], r["psum"]) for r in r0}
    assert [(r["scale"], r["growth"], r["psum"]) for r in back] == [by_step[r["step"]] for r in back], ok(run)
    assert run.finals[0]["step"] == run.finals[1]["step"] == steps
    assert run.finals[0]["digest"] == run.finals[1]["digest"], ok(run)
    assert run.finals[0]["scaler"] == run.finals[1]["scaler"], ok(run)
    assert run.ledger.ok and run.ledger.steps == steps


@pytest.mark.parametrize("bad", [{"scale": float("inf"), "_growth_tracker": 0}, {"scale": -1.0},
                                 {"scale": 2.0, "_growth_tracker": -3}, {"scale": "big"}, [1.0]])
def test_a_catch_up_refuses_a_loss_scale_that_cannot_be_one(bad):
    from lightning_ft.replica.catchup.http import CatchupError, check_meta

    with pytest.raises(CatchupError, match="loss scale cannot be applied"):
        check_meta({"step": 3, "param_groups": [{"lr": 0.1}], "scaler": bad}, [{"lr": 0.1, "params": []}])
    got = check_meta({"step": 3, "param_groups": [{"lr": 0.1}], "scaler": {"scale": 8.0, "_growth_tracker": 2}},
                     [{"lr": 0.1, "params": []}])
    assert got["scaler"] == {"scale": 8.0, "_growth_tracker": 2}
