"""Stream loaders under ft_hsdp with real faults (docs/ARCHITECTURE.md, "Exactly once: streams"):
torchdata's StatefulDataLoader and litdata's StreamingDataLoader, unmodified, 3 replicas, a
SIGKILL at a random moment and a rejoin; then every replica down at once (a rewind that restores
every slot's loader state from the checkpoint). Replicas end identical, the ledger is exact by
batch, and by sample id against an uninterrupted reading of each process's stream."""
from __future__ import annotations

import os

import pytest

from tests.acceptance.faults import run_with_faults
from tests.strategy.id_streams import build_litdata, check_sample_ids, id_rows, reference
from tests.strategy.runs import lft_run, ok

APP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stream_app.py")
N = 600  # ids: 3 slots x 50 steps x 4 per batch, one pass of every process's part


def assert_exact(run, kind: str, steps: int, replicas: int, why: str, workers: int, data: str = "",
                 world: int = 1, n: int = N):
    why = why + "\n" + ok(run)
    assert run.proc.returncode == 0, why
    assert {f["step"] for f in run.finals.values()} == {steps} and set(run.finals) == set(range(replicas)), why
    assert len({tuple(f["digest"]) for f in run.finals.values()}) == 1, f"replicas differ: {run.finals}\n{why}"
    led = run.ledger
    assert led.ok and led.steps == steps, (led.duplicates, led.gaps, led.conflicts, why)
    longest = max(max(ks) + 1 for ks in led.trained.values())
    rep = check_sample_ids(id_rows(run.run_dir), led.trained, world=world,
                           expected=reference(kind, n, workers, replicas, world, data, batches=longest))
    print(rep)
    assert rep.ok, (str(rep), rep.duplicates[:10], rep.missing[:10], rep.conflicts[:10], rep.mismatches[:3], why)
    assert rep.batches == world * sum(len(ks) for ks in led.trained.values()) and rep.samples == 4 * rep.batches
    return rep


@pytest.fixture(scope="module")
def litdata_dir(tmp_path_factory):
    return build_litdata(str(tmp_path_factory.mktemp("litdata") / "ids"), N)


def test_torchdata_stateful_loader_survives_a_random_kill_exactly_once_by_sample_id(tmp_path, etcd_endpoint):
    steps = 50
    run, faults = run_with_faults(tmp_path, etcd_endpoint, APP, "torchdata", str(steps), "--samples", str(N),
                                  "--workers", "2", "--step-sleep", "0.05", "--degraded-sleep", "1.5", replicas=3,
                                  steps=steps, seed=5,
                                  kill=True)
    assert "kill replica" in faults, faults
    assert [e for e in run.events if e["event"] == "restart"], run.events
    assert_exact(run, "torchdata", steps, 3, faults, workers=2)
    restarted = [k for k in run.rows if k[1] > 0]
    assert restarted, run.rows.keys()


def test_litdata_streaming_loader_survives_a_random_kill_exactly_once_by_sample_id(tmp_path, etcd_endpoint,
                                                                                     litdata_dir):
    steps = 50
    run, faults = run_with_faults(tmp_path, etcd_endpoint, APP, "litdata", str(steps), "--data", litdata_dir,
                                  "--workers", "1", "--step-sleep", "0.05", "--degraded-sleep", "1.5", replicas=3,
                                  steps=steps, seed=6,
                                  kill=True)
    assert "kill replica" in faults, faults
    assert_exact(run, "litdata", steps, 3, faults, workers=1, data=litdata_dir)


ALL_DIE_AT_16 = "failure.events=[{replica: 0, step: 16, kind: kill}, {replica: 1, step: 16, kind: kill}]"


def test_every_replica_down_at_once_rewinds_and_restores_every_loader_state_from_the_checkpoint(
        tmp_path, etcd_endpoint, litdata_dir):
    steps = 30
    run = lft_run(tmp_path, etcd_endpoint, "litdata", str(steps), "--data", litdata_dir, "--workers", "1",
                  "--step-sleep", "0.05", replicas=2, script=APP,
                  overrides=(ALL_DIE_AT_16, "checkpoint.every_n_steps=10", "data.state_every_n_steps=4"))
    rewinds = [e for e in run.events if e["event"] == "rewind"]
    assert len(rewinds) == 1 and rewinds[0]["to"] == 10, (rewinds, ok(run))
    assert [r["to"] for r in run.ledger.rewinds] == [10], run.ledger
    assert_exact(run, "litdata", steps, 2, "rewind", workers=1, data=litdata_dir)
    # every slot resumed from the state pinned at the checkpoint's cursor, reading nothing forward
    for rid in range(2):
        log = run.log(rid, 1)
        assert "train stream at slot batch 10: restored from the state saved at slot batch 10, skipped 0" in log, log


def test_a_plain_iterable_loader_is_refused_with_why_and_what_to_use(tmp_path, etcd_endpoint):
    # (data.exactly_once=false, which trains it at-least-once, is tested in test_streaming.py)
    refused = lft_run(tmp_path, etcd_endpoint, "plain", "4", replicas=1, script=APP,
                      overrides=("supervisor.crash_loop=1",))
    assert refused.proc.returncode != 0
    log = refused.log(0, 0)
    assert "FTHSDPError: ft_hsdp trains every batch exactly once" in log, ok(refused)
    assert "StatefulDataLoader" in log and "data.exactly_once=false" in log, ok(refused)
    assert not id_rows(refused.run_dir)  # nothing trained


@pytest.mark.slow
def test_two_ranks_per_replica_stay_in_step_through_a_kill_exactly_once_by_sample_id(tmp_path, etcd_endpoint):
    steps, n = 40, 800  # 2 x 2 processes x 40 batches of 4 stay within one pass
    run, faults = run_with_faults(tmp_path, etcd_endpoint, APP, "torchdata", str(steps), "--samples", str(n),
                                  "--workers", "1", "--step-sleep", "0.05", "--degraded-sleep", "1.5", replicas=2,
                                  steps=steps, seed=8, kill=True, nproc=2)
    assert "kill replica" in faults, faults
    assert_exact(run, "torchdata", steps, 2, faults, workers=1, world=2, n=n)
