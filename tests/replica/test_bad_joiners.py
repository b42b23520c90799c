"""Bad joiners against a healthy job, as real processes (issue 10 §3-§4): a joiner with a
wrong secret, another `chunk_bytes` or another model shape is refused at registration with
an error naming what differs, and the two healthy replicas neither fail a round nor exit."""
from __future__ import annotations

import time

import pytest

from lightning_ft.bench.localjob import TEST_SECRET, Job
from lightning_ft.replica.ledger import read_cursors, verify_ledger

ARGS = ("--steps", "100000", "--dim", "16", "--hidden", "32", "--batch", "8", "--ttl", "2", "--ftar-timeout", "5",
        "--init-timeout", "5", "--step-sleep", "0.1")
BAD = {  # incarnation of replica 2 -> (extra arguments, extra environment, what its error must say)
    0: ((), {"LFT_SECRET": "another-secret-" + "x" * 16},
        ["is in use on this etcd by another job", "another secret", "give it the job's secret"]),
    1: (("--chunk-bytes", str(1 << 16)), {}, ["refused: job config differs in chunk_bytes (65536 != 1048576)"]),
    2: (("--hidden", "48"), {},
        ["refused: job config differs in params (the model's parameter names, shapes and dtypes: 'n=6 numel=3217"]),
}


def last_error(job: Job, rid: int, inc: int) -> str:
    lines = [l for l in open(f"{job.log_dir}/r{rid}.i{inc}.rank0.log", errors="replace").read().splitlines() if l]
    return lines[-1] if lines else ""


@pytest.mark.timeout(240)
def test_bad_joiners_are_refused_by_field_and_healthy_replicas_keep_committing(etcd_endpoint, tmp_path,
                                                                              plain_loop_zygote):
    assert TEST_SECRET not in BAD[0][1]["LFT_SECRET"]
    job = Job(etcd_endpoint, tmp_path, R=3, args=ARGS, extra={(2, i): list(a) for i, (a, _, _) in BAD.items()},
              env={(2, i): e for i, (_, e, _) in BAD.items()}, zygote=plain_loop_zygote)
    try:
        job.start(0)
        job.start(1)
        for rid in (0, 1):
            job.replicas[rid].wait_for(lambda r: r.get("event") == "step" and r["contributors"] == [0, 1], 120)
        joined_at = max(r["step"] for r in job.replicas[0].steps())
        joiners = [job.start(2, inc) for inc in BAD]  # all at once: each is refused on its own
        deadline = time.monotonic() + 120
        for r in joiners:
            for p in r.procs:
                p.wait(max(1.0, deadline - time.monotonic()))
        refused_at = max(r["step"] for r in job.replicas[0].steps())
        for inc, (_, _, words) in BAD.items():
            assert joiners[inc].procs[0].returncode not in (0, None)
            err = last_error(job, 2, inc)
            assert all(w in err for w in words), (inc, err)
            assert TEST_SECRET not in err and BAD[0][1]["LFT_SECRET"] not in err  # refusals reveal no secret
        # the healthy pair trains on, every round committed by both, and neither exits; past a
        # multiple of 64 (a full round, which writes the buffered ledger records) after the joiners came
        until = max(refused_at + 10, (joined_at // 64 + 1) * 64 + 1)
        for rid in (0, 1):
            job.replicas[rid].wait_for(lambda r: r.get("event") == "step" and r["step"] >= until, 90)
            assert job.replicas[rid].alive(), f"healthy replica {rid} exited"
            rows = job.replicas[rid].rows
            assert not [r for r in rows if r.get("event") == "retry"], f"replica {rid} failed a round"
            trained = [r for r in rows if r.get("event") == "step" and r["contributors"] == [0, 1]]
            assert all(r["members"] == [0, 1] for r in trained), "a refused joiner became a member"
        job.replicas[0].signal(19)  # SIGSTOP both, so that the ledger holds still while it is read
        job.replicas[1].signal(19)
        rep = verify_ledger(job.store, job.root, read_cursors(job.store, job.root, range(3)))
        assert rep.ok and rep.steps > joined_at, (rep.steps, joined_at, rep.duplicates, rep.gaps, rep.conflicts)
    finally:
        job.close()
