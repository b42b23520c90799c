"""Acceptance: programs none of us wrote, unmodified and unseeded, under real faults at random
moments. Every replica (the restarted ones included) ends at max_steps with bitwise-identical
state, and the exactly-once ledger is exact."""
from __future__ import annotations

import os

import pytest

from tests.acceptance.faults import run_with_faults
from tests.strategy.runs import ok

APP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boring_app.py")


def assert_consistent(run, steps: int, replicas: int, faults: str) -> None:
    why = faults + "\n" + ok(run)
    assert run.proc.returncode == 0, why
    assert set(run.finals) == set(range(replicas)), why
    assert {f["step"] for f in run.finals.values()} == {steps}, why
    digests = {tuple(f["digest"]) for f in run.finals.values()}
    assert len(digests) == 1, f"replicas differ: {run.finals}\n{why}"
    assert run.ledger.ok, (run.ledger.duplicates, run.ledger.gaps, run.ledger.conflicts, why)
    assert run.ledger.steps == steps, why


@pytest.mark.parametrize("seed", [1])
def test_boring_model_unseeded_survives_a_random_kill_and_a_stop(tmp_path, etcd_endpoint, seed):
    steps = 60  # about three epochs of BoringDataModule over 3 slots: StepLR steps per (job) epoch
    run, faults = run_with_faults(tmp_path, etcd_endpoint, APP, "boring", str(steps), replicas=3, steps=steps,
                                  seed=seed, kill=True, stop_s=3.5)
    assert_consistent(run, steps, 3, faults)
    syncs = [e for e in run.events if e["event"] == "sync"]
    assert syncs and {e["source"] for e in syncs} == {0}, "replicas adopted replica 0's state at the start"


def test_demo_transformer_unseeded_survives_a_random_kill(tmp_path, etcd_endpoint):
    steps = 40
    run, faults = run_with_faults(tmp_path, etcd_endpoint, APP, "transformer", str(steps), replicas=2, steps=steps,
                                  seed=2, kill=True)
    assert_consistent(run, steps, 2, faults)


TYPICAL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "typical_app.py")


def _rows(run, event):
    import json

    out = []
    for name in sorted(os.listdir(os.path.join(run.run_dir, "logs"))):
        if name.endswith(".rank0.log"):
            out += [json.loads(l) for l in open(os.path.join(run.run_dir, "logs", name), errors="replace")
                    if l.startswith(f'{{"event": "{event}"')]
    return out


def test_typical_program_with_callbacks_bf16_clipping_accumulation_under_faults(tmp_path, etcd_endpoint):
    steps = 60
    run, faults = run_with_faults(tmp_path, etcd_endpoint, TYPICAL, str(steps), replicas=3, steps=steps, seed=3,
                                  kill=True, stop_s=3.5)
    assert_consistent(run, steps, 3, faults)
    vals = _rows(run, "val")
    # One evaluation = (step, epoch): at the last step every replica logged two validations on the
    # same weights (epoch 4 and epoch 5 rows, both at step 60) whose means differed in the 7th
    # digit (0.53611052 and 0.53611046), across a rounding boundary. Every replica logs the same
    # value for each evaluation.
    by_step: dict[tuple[int, int], set] = {}
    for v in vals:
        by_step.setdefault((v["step"], v["epoch"]), set()).add(round(v["val_loss"], 6))
    # No validation waits out etcd.hang_timeout_s (30 s) for an answer another replica never
    # gives: a restarted ModelCheckpoint asked fewer questions than the others (two 30 s stalls).
    import itertools
    import json

    for rid in range(3):
        with open(os.path.join(run.run_dir, f"replica_{rid}", "steps.jsonl")) as f:
            ts = [json.loads(line)["t"] for line in f if line.strip()]
        gaps = [b - a for a, b in itertools.pairwise(ts)]
        assert max(gaps) < 20, (rid, max(gaps), faults)
    differ = [v for v in vals if len(by_step[v["step"], v["epoch"]]) > 1]
    assert by_step and not differ, (differ, faults, ok(run))  # the same val_loss everywhere
    tests = _rows(run, "test")  # trainer.test, .validate and .predict after fit, on the final weights
    assert len(tests) == 3 and len({round(t["test_loss"], 6) for t in tests}) == 1, tests
    assert len({round(t["val_loss"], 6) for t in tests}) == 1 and {t["predicted"] for t in tests} == {200}, tests
    assert len({round(t["pred_sum"], 4) for t in tests}) == 1, tests
    ckpts = os.listdir(os.path.join(run.run_dir, "lightning_ckpts"))
    # One writer at a time (the lowest-id contributor), save_top_k=2. Lightning's ModelCheckpoint
    # keeps its top-k in memory; catch-up carries it (strategy/callback_state.py), but a writer
    # restarted into a sync that carried none starts afresh and never removes the files written
    # before it: each callback instance that writes leaves at most save_top_k files.
    with open(os.path.join(run.run_dir, "events.jsonl")) as f:
        restarts = sum(1 for line in f if '"event": "restart"' in line)
    assert 1 <= len(ckpts) <= 2 * (3 + restarts), (ckpts, restarts, faults)


def test_val_loss_is_the_whole_validation_set_evaluated_once(tmp_path, etcd_endpoint):
    from tests.strategy.runs import lft_run

    run = lft_run(tmp_path, etcd_endpoint, "30", "--precision", "32-true", replicas=3, script=TYPICAL)
    assert run.proc.returncode == 0, ok(run)
    vals = _rows(run, "val")
    assert len(vals) >= 9 and len(vals) % 3 == 0, vals  # every 10 batches (5 steps), on 3 replicas
    for v in vals:
        assert abs(v["val_loss"] - v["full"]) <= 1e-5 * abs(v["full"]), v


def test_early_stopping_stops_every_replica_at_the_same_step(tmp_path, etcd_endpoint):
    from tests.strategy.runs import lft_run

    run = lft_run(tmp_path, etcd_endpoint, "60", "--stop-below", "100", replicas=2, script=TYPICAL)
    assert run.proc.returncode == 0, ok(run)
    # the first validation (10 batches = 5 steps) asks to stop; the job stops after the next round, everywhere
    assert {f["step"] for f in run.finals.values()} == {6}, run.finals
    assert len({tuple(f["digest"]) for f in run.finals.values()}) == 1


GAN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gan_app.py")
AMP16 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "amp16_app.py")


def test_gan_with_manual_optimization_unseeded_survives_a_random_kill(tmp_path, etcd_endpoint):
    """Two optimizers under manual optimization (issue 24 part 2): the kill lands anywhere, also
    between the discriminator's and the generator's steps of one batch. global_step counts
    optimizer steps (two per batch), as under DDP; the ledger records each batch once."""
    steps = 80  # 40 batches
    run, faults = run_with_faults(tmp_path, etcd_endpoint, GAN, str(steps), replicas=3, steps=steps, seed=4,
                                  kill=True)
    assert_consistent(run, steps, 3, faults)
    trained = sum(len(ks) for ks in run.ledger.trained.values())
    assert trained <= 3 * steps // 2, (run.ledger.trained, faults)  # a batch per two optimizer steps, at most


def test_amp16_program_unseeded_survives_a_random_kill_and_a_stop(tmp_path, etcd_endpoint):
    """fp16 autocast with a real GradScaler (16-mixed on CPU): the scale, its growth tracker and
    the skipped steps are the same on every replica, the restarted one included."""
    steps = 60
    run, faults = run_with_faults(tmp_path, etcd_endpoint, AMP16, str(steps), replicas=3, steps=steps, seed=5,
                                  kill=True, stop_s=3.5)
    assert_consistent(run, steps, 3, faults)
    scalers = {json_key(f["scaler"]) for f in run.finals.values()}
    assert len(scalers) == 1 and None not in scalers, (run.finals, faults)  # one loss scale everywhere


def json_key(state):
    import json

    return None if state is None else json.dumps(state, sort_keys=True, default=float)


METRICS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "metrics_app.py")


def test_torchmetrics_classifier_unseeded_survives_a_random_kill_and_reports_the_whole_validation_set(
        tmp_path, etcd_endpoint):
    """torchmetrics objects logged as objects (issue 24 §4): each validation is sharded over the
    replicas, and the logged accuracy is the whole validation set's, the same on every replica
    (a torchmetrics object syncs its state inside a replica only; the replicas' states are
    summed across them), evaluated once."""
    steps = 60
    run, faults = run_with_faults(tmp_path, etcd_endpoint, METRICS, str(steps), replicas=3, steps=steps, seed=6,
                                  kill=True)
    assert_consistent(run, steps, 3, faults)
    vals = _rows(run, "val")
    by_step: dict[int, list[dict]] = {}
    for v in vals:
        by_step.setdefault(v["step"], []).append(v)
    assert set(by_step) >= {20, 40, 60}, (vals, faults)
    for step, rows in by_step.items():
        assert len({(r["val_acc"], r["val_f1"]) for r in rows}) == 1, (step, rows, faults)  # one value everywhere
        for r in rows:
            assert abs(r["val_acc"] - r["whole_acc"]) < 1e-6, (step, r, faults)  # the whole set, once


CLI = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cli_app.py")


def test_lightningcli_app_takes_its_arguments_and_survives_a_random_kill(tmp_path, etcd_endpoint):
    """A LightningCLI app (issue 24 §4): `--trainer.*`, `--model.*` and `--data.*` after the
    script are the app's, `key=value` ones are ours; the strategy itself comes from
    `--trainer.strategy ft_hsdp`. Every process, the restarted one too, gets the same arguments,
    and the job ends identical with an exact ledger."""
    steps = 60
    args = ("fit", "--trainer.strategy", "ft_hsdp", "--trainer.accelerator=cpu", f"--trainer.max_steps={steps}",
            "--trainer.logger", "false", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", "--model.hidden", "24", "--model.lr=0.1", "--model.momentum=0.5",
            "--data.batch_size=8", f"--trainer.default_root_dir={tmp_path / 'cli_root'}")
    run, faults = run_with_faults(tmp_path, etcd_endpoint, CLI, *args, replicas=3, steps=steps, seed=7, kill=True)
    assert_consistent(run, steps, 3, faults)
    got = _rows(run, "args")
    assert len(got) >= 4, (got, faults)  # three replicas and the restarted incarnation
    assert {(a["strategy"], a["max_steps"], a["hidden"], a["lr"], a["momentum"], a["batch_size"]) for a in got} == {
        ("FTHSDPStrategy", steps, 24, 0.1, 0.5, 8)}, (got, faults)
    # the job's config, written once (by replica 0), as the CLI parsed it
    import yaml

    saved = yaml.safe_load(open(tmp_path / "cli_root" / "config.yaml"))
    assert (saved["trainer"]["strategy"], saved["model"]["hidden"], saved["data"]["batch_size"]) == ("ft_hsdp", 24, 8)
