"""Manual optimization with several optimizers under ft_hsdp (quorum rule 15; issue 24 part 2):
a GAN (tests/strategy/lit_script.py --gan: two optimizers, toggle_optimizer, manual_backward,
a StepLR per optimizer stepped by hand) on real replica processes against a real etcd. Every
optimizer.step() is a round: global_step counts optimizer steps (two per batch, as under
DDP), the ledger records each batch once (at its first step), replicas end bitwise identical."""
from __future__ import annotations

import pytest

from tests.strategy.runs import lft_run, ok


def gan_rows(run, rid):
    import json

    out = []
    for (r, inc) in sorted(run.rows):
        if r == rid:
            out += [json.loads(l) for l in run.log(r, inc).splitlines() if l.startswith('{"event": "gan"')]
    return out


def assert_identical_and_exact(run, steps, replicas):
    why = ok(run)
    assert run.proc.returncode == 0, why
    assert set(run.finals) == set(range(replicas)), why
    assert {f["step"] for f in run.finals.values()} == {steps}, (run.finals, why)
    assert len({tuple(f["digest"]) for f in run.finals.values()}) == 1, (run.finals, why)
    assert run.ledger.ok, (run.ledger.duplicates, run.ledger.gaps, run.ledger.conflicts, why)
    assert run.ledger.steps == steps, why  # one record per optimizer step ...
    batches = sum(len(ks) for ks in run.ledger.trained.values())
    return batches


def lr_d(n):  # StepLR(step_size=3, gamma=0.5) from 0.01 after n discriminator steps
    return 0.01 * 0.5 ** (n // 3)


def lr_g(n):  # StepLR(step_size=2, gamma=0.7) from 0.02 after n generator steps
    return 0.02 * 0.7 ** (n // 2)


def test_gan_two_optimizers_three_replicas_identical_exact_ledger_two_steps_per_batch(tmp_path, etcd_endpoint):
    steps = 24  # 12 batches of two optimizer steps
    run = lft_run(tmp_path, etcd_endpoint, "--gan", "--steps", str(steps), "--steplr", "--unseeded", replicas=3)
    batches = assert_identical_and_exact(run, steps, 3)
    assert batches == 3 * steps // 2, run.ledger.trained  # every replica's slot trained each batch once
    assert {s: sorted(ks) for s, ks in run.ledger.trained.items()} == {s: list(range(steps // 2)) for s in range(3)}
    rows = gan_rows(run, 0)
    assert [r["step"] for r in rows] == list(range(2, steps + 1, 2)), rows  # global_step: 2 per batch
    for r in rows:  # each schedule stepped once per commit of its own optimizer
        assert r["lrs"] == pytest.approx([lr_d(r["step"] // 2), lr_g(r["step"] // 2)], rel=1e-9), r


def test_gan_sigkill_between_the_two_optimizer_steps_of_a_batch(tmp_path, etcd_endpoint):
    steps = 64  # a restart takes 10-20 s on a loaded machine: leave it 28 batches of 1 s to rejoin in
    run = lft_run(tmp_path, etcd_endpoint, "--gan", "--steps", str(steps), "--steplr", "--degraded-sleep", "1.0",
                  "--kill-between", "1:7", replicas=3)
    batches = assert_identical_and_exact(run, steps, 3)
    killed = [l for l in run.log(1, 0).splitlines() if l.startswith('{"event": "kill_between"')]
    # after the discriminator's step (6 -> 7) of batch 3, before the generator's (7 -> 8)
    assert len(killed) == 1 and '"step": 7' in killed[0], killed
    assert ("restart", 1) in [(e["event"], e["replica"]) for e in run.events], run.events
    assert batches < 3 * steps // 2  # replica 1's slot waited while it was away (shrink)
    for rid in range(3):  # the survivors' schedules, and the restarted replica's, are the job's
        rows = gan_rows(run, rid)
        assert rows and rows[-1]["step"] == steps
        for r in rows:
            assert r["step"] % 2 == 0, r
            assert r["lrs"] == pytest.approx([lr_d(r["step"] // 2), lr_g(r["step"] // 2)], rel=1e-9), r


def test_gan_checkpoint_carries_both_optimizers_and_schedulers(tmp_path, etcd_endpoint):
    """A whole-job restart from a checkpoint (every optimizer's state, every scheduler, the
    committed batch count) ends bitwise where the uninterrupted GAN ends."""
    import json
    import os
    import subprocess
    import sys
    import uuid

    from lightning_ft.replica import checkpoint as ck
    from tests.strategy.runs import SCRIPT
    from tests.strategy.test_checkpoint import kill_job_after_checkpoint

    steps = 24
    ckpt = ("checkpoint.every_n_steps=8", "checkpoint.keep=5")
    clean = lft_run(tmp_path, etcd_endpoint, "--gan", "--steps", str(steps), "--steplr", overrides=ckpt)
    assert clean.proc.returncode == 0, ok(clean)
    meta = json.load(open(os.path.join(ck.step_dir(os.path.join(clean.run_dir, "checkpoints"), 16), "meta.json")))
    assert meta["step"] == 16 and meta["batches"] == 8, meta

    job = "gck" + uuid.uuid4().hex[:8]
    run_dir = str(tmp_path / job)
    root = os.path.join(run_dir, "checkpoints")
    cmd = [sys.executable, "-m", "lightning_ft.launch.cli", "run", "--replicas", "2", "--etcd", etcd_endpoint,
           "--job", job, "--run-dir", run_dir, "--no-status", SCRIPT, "--gan", "--steps", str(steps), "--steplr",
           "--step-sleep", "0.25", "etcd.lease_ttl_s=1", "quorum.init_timeout_s=60", *ckpt]
    kill_job_after_checkpoint(cmd, root, 8)
    resume = [sys.executable, "-m", "lightning_ft.launch.cli", "run", "--resume", run_dir, "--etcd", etcd_endpoint,
              "--no-status", "--timeout", "150", SCRIPT, "--gan", "--steps", str(steps), "--steplr"]
    r = subprocess.run(resume, capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "resuming from" in r.stdout, r.stdout[-2000:]
    finals = [json.load(open(os.path.join(run_dir, f"replica_{i}", "final.json"))) for i in (0, 1)]
    assert finals[0]["step"] == finals[1]["step"] == steps
    assert finals[0]["digest"] == finals[1]["digest"] == clean.finals[0]["digest"], (finals, clean.finals)



def test_gan_fsdp2_two_ranks_per_replica_identical_exact_ledger(tmp_path, etcd_endpoint):
    """W = 2 (FSDP2 shards inside each replica): each optimizer's flat buffer holds its rank's
    shards. With toggle_optimizer, as Lightning documents the GAN: before
    sharding.reshard_on_toggle the generator's loss had no grad_fn at the first batch (`element 0
    of tensors does not require grad`: FSDP2 kept the root modules' unsharded parameters, with
    the flags of the discriminator's toggle)."""
    steps = 16
    run = lft_run(tmp_path, etcd_endpoint, "--gan", "--steps", str(steps), "--steplr", replicas=2, nproc=2)
    batches = assert_identical_and_exact(run, steps, 2)
    assert batches == steps  # 2 slots x 8 batches
    assert len(run.finals[0]["digest"]) == 2  # one digest per rank: both ranks' shards compared


def test_gan_clip_gradients_clips_the_averaged_gradients_as_lightning_ddp_does(tmp_path, etcd_endpoint):
    """`self.clip_gradients(opt_d, ...)` before `opt_d.step()`: under DDP the gradients are
    already averaged there; under ft_hsdp the call is deferred to the averaged gradients
    (strategy/manual_clip.py). Clipping each replica's local gradients (as before) trained on
    the mean of clipped gradients and left DDP's losses from the second batch on."""
    import json
    import subprocess
    import sys

    from tests.strategy.runs import SCRIPT

    steps = 16
    args = ("--gan", "--steps", str(steps), "--clip", "0.01")
    run = lft_run(tmp_path, etcd_endpoint, *args, replicas=2)
    assert_identical_and_exact(run, steps, 2)
    ddp = subprocess.run([sys.executable, SCRIPT, *args, "--ddp", "2"], capture_output=True, text=True, timeout=180,
                         cwd=str(tmp_path))
    assert ddp.returncode == 0, ddp.stdout[-2000:] + ddp.stderr[-2000:]
    ref = [json.loads(l)["loss"] for l in ddp.stdout.splitlines() if l.startswith('{"event": "gan"')]
    got = [r["loss"] for r in gan_rows(run, 0)]
    assert len(ref) == len(got) == steps // 2
    assert got == pytest.approx(ref, rel=1e-5, abs=1e-7), (got, ref)


def test_gan_fit_from_a_lightning_checkpoint_continues_at_its_batch_count_and_ends_as_the_uninterrupted_run(
        tmp_path, etcd_endpoint):
    """trainer.fit(ckpt_path=...) with two optimizers: global_step counts optimizer steps (8 at
    step=8.ckpt) but the job had trained 4 batches. The resume continues at batch 4 of every slot
    with both schedules where they were, and ends bitwise where the uninterrupted run ended.
    Before: the batch count was set to the step (8), which moved epochs and step schedulers."""
    steps = 16
    common = ("--gan", "--steps", str(steps), "--steplr", "--samples", "48")  # epochs of 3 batches
    first = lft_run(tmp_path, etcd_endpoint, *common, "--save-every", "8", "--ckpt-dir", str(tmp_path / "ft"))
    assert_identical_and_exact(first, steps, 2)
    run = lft_run(tmp_path, etcd_endpoint, *common, "--ckpt-path", str(tmp_path / "ft" / "step=8.ckpt"))
    assert run.proc.returncode == 0, ok(run)
    assert {f["step"] for f in run.finals.values()} == {steps}, ok(run)
    assert run.ledger.ok and run.ledger.steps == steps - 8, (run.ledger.steps, ok(run))
    assert {s: sorted(ks) for s, ks in run.ledger.trained.items()} == {0: [4, 5, 6, 7], 1: [4, 5, 6, 7]}
    for rid in (0, 1):
        rows = gan_rows(run, rid)
        assert [r["step"] for r in rows] == [10, 12, 14, 16], rows
        ref = {r["step"]: r for r in gan_rows(first, rid)}
        assert [r["epoch"] for r in rows] == [ref[r["step"]]["epoch"] for r in rows] == [1, 1, 2, 2], rows
        for r in rows:
            assert r["lrs"] == pytest.approx([lr_d(r["step"] // 2), lr_g(r["step"] // 2)], rel=1e-9), r
    assert {tuple(f["digest"]) for f in run.finals.values()} == {tuple(first.finals[0]["digest"])}
