"""Persistent checkpoints (docs/ARCHITECTURE.md, "Checkpoints"): manifest and verification, pruning, async writes that
do not block on storage, and a whole-job restart that is bitwise equal to an uninterrupted
run, skipping a corrupted and a partial checkpoint with warnings that name them."""
from __future__ import annotations

import pytest

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import torch

from lightning_ft.replica import checkpoint as ck
from lightning_ft.replica.digest import state_digest
from tests.procs import descendants
from tests.strategy.runs import SCRIPT, lft_run, ok


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(3):
        m(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def kill_job_after_checkpoint(cmd: list[str], root: str, step: int, timeout_s: float = 150) -> None:
    """Start `lightning-ft run` (`cmd`), and once the checkpoint of `step` is complete under
    `root`, SIGKILL the launcher and every replica at once (a whole-job kill)."""
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kids: list[int] = []
    try:
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(os.path.join(ck.step_dir(root, step), "manifest.json")):
            assert time.monotonic() < deadline and p.poll() is None, f"no step-{step} checkpoint"
            kids = descendants(p.pid) or kids
            time.sleep(0.05)
        kids = descendants(p.pid) or kids
        for pid in [p.pid, *kids]:
            os.kill(pid, signal.SIGKILL)
    finally:
        p.kill()
        p.wait(10)
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def test_async_save_then_load_roundtrip_and_manifest(tmp_path):
    m, opt = _model()
    w = ck.CheckpointWriter(str(tmp_path), keep=2, rank=0)
    before = state_digest(m, opt)
    stats = w.save(3, m, opt, {"schedulers": [], "param_groups": []}, {"step": 3, "cursors": {"0": 3}})
    # training goes on at once: the staged copy, not the live tensors, is written
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    w.wait(30)
    assert w.error is None and stats.stage_s >= 0 and stats.bytes > 0
    d = ck.step_dir(str(tmp_path), 3)
    manifest = ck.verify(d)
    assert set(manifest["files"]) >= {".metadata", "extra.pt", "meta.json"}
    m2, opt2 = _model()
    with torch.no_grad():
        for p in m2.parameters():
            p.zero_()
    got = ck.load(d, m2, opt2)
    assert state_digest(m2, opt2) == before and got["meta"]["step"] == 3


def test_verify_names_the_corrupted_or_missing_file_and_newest_valid_skips(tmp_path):
    m, opt = _model()
    w = ck.CheckpointWriter(str(tmp_path), keep=5, rank=0)
    for step in (10, 20, 30):
        w.save(step, m, opt, {"schedulers": [], "param_groups": []}, {"step": step})
        w.wait(30)
    d30, d20 = ck.step_dir(str(tmp_path), 30), ck.step_dir(str(tmp_path), 20)
    bad = os.path.join(d30, "extra.pt")
    with open(bad, "r+b") as f:
        f.seek(10)
        f.write(b"\xff\xfe")
    os.remove(os.path.join(d20, ".metadata"))
    os.makedirs(ck.step_dir(str(tmp_path), 40))  # a partial one: its writer died
    warnings = []
    assert ck.newest_valid(str(tmp_path), warn=warnings.append) == (10, ck.step_dir(str(tmp_path), 10))
    assert "step 40" in warnings[0] and "no manifest.json" in warnings[0]
    assert bad in warnings[1] and "corrupted" in warnings[1]
    assert os.path.join(d20, ".metadata") in warnings[2] and "missing" in warnings[2]


def test_prune_keeps_the_newest_k(tmp_path):
    m, opt = _model()
    w = ck.CheckpointWriter(str(tmp_path), keep=2, rank=0)
    for step in (1, 2, 3, 4):
        w.save(step, m, opt, {"schedulers": [], "param_groups": []}, {"step": step})
    w.wait(30)
    assert ck.list_steps(str(tmp_path)) == [3, 4]


def test_prune_hashes_only_what_changed_since_this_process_verified_it(tmp_path, monkeypatch):
    """Pruning after every save re-verified all K kept checkpoints (rehashing every file); it
    now trusts files it hashed itself while they keep their inode, size and mtime. A file
    rewritten since (a corruption) is hashed again and the checkpoint stops counting as kept."""
    m, opt = _model()
    w = ck.CheckpointWriter(str(tmp_path), keep=2, rank=0)
    for step in (1, 2):
        w.save(step, m, opt, {"schedulers": [], "param_groups": []}, {"step": step})
        w.wait(30)
    hashed: list[str] = []
    real = ck.sha256_file
    monkeypatch.setattr(ck, "sha256_file", lambda path: hashed.append(path) or real(path))
    assert ck.prune(str(tmp_path), keep=2) == []
    assert hashed == []  # both written (and hashed) by this process, unchanged since
    d2 = ck.step_dir(str(tmp_path), 2)
    victim = next(os.path.join(d2, n) for n in sorted(os.listdir(d2)) if n.endswith(".distcp"))
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0xFF
    time.sleep(0.01)
    open(victim, "wb").write(bytes(data))  # same size; a new mtime
    w.save(3, m, opt, {"schedulers": [], "param_groups": []}, {"step": 3})
    w.wait(30)
    assert victim in hashed  # changed since: hashed again, and it fails its manifest
    assert ck.list_steps(str(tmp_path)) == [1, 2, 3]  # so step 2 is not one of the 2 kept: 1 stays
    with pytest.raises(ck.CheckpointInvalid, match="sha256"):
        ck.verify(d2)


def test_whole_job_restart_equals_an_uninterrupted_run(tmp_path, etcd_endpoint):
    steps = 30
    ckpt = ("checkpoint.every_n_steps=10", "checkpoint.keep=5")
    clean = lft_run(tmp_path, etcd_endpoint, "--steps", str(steps), "--steplr", overrides=ckpt)
    assert clean.proc.returncode == 0, ok(clean)
    rows = [json.loads(l) for l in open(os.path.join(clean.run_dir, "replica_0", "checkpoints.jsonl"))]
    assert [r["step"] for r in rows] == [10, 20, 30] and all(r["bytes"] > 0 for r in rows)

    # the same job, killed whole (launcher and every replica, SIGKILL) after the step-20 checkpoint
    job = "ckpt" + uuid.uuid4().hex[:8]
    run_dir = str(tmp_path / job)
    root = os.path.join(run_dir, "checkpoints")
    cmd = [sys.executable, "-m", "lightning_ft.launch.cli", "run", "--replicas", "2", "--etcd", etcd_endpoint,
           "--job", job, "--run-dir", run_dir, "--no-status", SCRIPT, "--steps", str(steps), "--steplr",
           "--step-sleep", "0.25", "etcd.lease_ttl_s=1", "quorum.init_timeout_s=60", *ckpt]
    kill_job_after_checkpoint(cmd, root, 20)
    steps_done = [json.loads(l)["step"] for l in open(os.path.join(run_dir, "replica_0", "steps.jsonl"))]
    assert 20 <= max(steps_done) < steps
    # damage the newest checkpoint and leave a partial one: resume must skip both, by name
    bad = os.path.join(ck.step_dir(root, 20), "__0_0.distcp")
    with open(bad, "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    os.makedirs(ck.step_dir(root, 25), exist_ok=True)
    # a run given `secret=` saved it redacted: the resume must never take "***" for the secret
    config = os.path.join(run_dir, "config.yaml")
    text = open(config).read()
    assert "secret: ''" in text
    open(config, "w").write(text.replace("secret: ''", "secret: '***'"))
    env = {k: v for k, v in os.environ.items() if k not in ("LFT_SECRET", "LFT_SECRET_FILE")}
    resume = [sys.executable, "-m", "lightning_ft.launch.cli", "run", "--resume", run_dir, "--etcd", etcd_endpoint,
              "--no-status", "--timeout", "150"]
    multi = subprocess.run([*resume, "--replica-ids", "0,1", SCRIPT, "--steps", str(steps), "--steplr"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert multi.returncode == 2 and "launchers on several nodes must share the job secret: set LFT_SECRET_FILE" \
        in multi.stderr, multi.stderr[-2000:]
    r = subprocess.run([*resume, SCRIPT, "--steps", str(steps), "--steplr"], env=env, capture_output=True, text=True,
                       timeout=200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    from lightning_ft.coord.runs import recorded_run
    from lightning_ft.coord.etcd_store import EtcdStore
    from lightning_ft.secret import REDACTED, tag

    store = EtcdStore(etcd_endpoint)
    try:  # the resumed run's record carries the tag of the secret its replicas used
        assert recorded_run(store, "/lft", job).tag != tag(REDACTED, job)
    finally:
        store.close()
    assert "skipping checkpoint step 25" in r.stderr and f"{bad}: sha256 does not match" in r.stderr
    assert "resuming from" in r.stdout and "step_00000010" in r.stdout
    finals = [json.load(open(os.path.join(run_dir, f"replica_{i}", "final.json"))) for i in (0, 1)]
    assert finals[0]["step"] == finals[1]["step"] == steps
    # bitwise: the resumed job equals the uninterrupted one
    assert finals[0]["digest"] == finals[1]["digest"] == clean.finals[0]["digest"]


@pytest.mark.slow  # the baseline mode; bench.goodput runs it against ft_hsdp
def test_restart_the_world_baseline_resumes_everyone_from_the_checkpoint(tmp_path, etcd_endpoint):
    """`--restart world` (the goodput baseline): a kill stops every replica; all restart from the
    newest checkpoint and redo the steps since; the result equals an uninterrupted run."""
    steps = 20
    ckpt = ("checkpoint.every_n_steps=5",)
    clean = lft_run(tmp_path, etcd_endpoint, "--steps", str(steps), overrides=ckpt)
    assert clean.proc.returncode == 0, ok(clean)
    job = "world" + uuid.uuid4().hex[:8]
    run_dir = str(tmp_path / job)
    r = subprocess.run([sys.executable, "-m", "lightning_ft.launch.cli", "run", "--replicas", "2", "--etcd",
                        etcd_endpoint, "--job", job, "--run-dir", run_dir, "--no-status", "--timeout", "200",
                        "--restart", "world", SCRIPT, "--steps", str(steps), "etcd.lease_ttl_s=1",
                        "failure.restart_delay_s=0.2", "quorum.init_timeout_s=60",
                        "failure.events=[{replica: 1, step: 12, kind: kill}]", *ckpt],
                       capture_output=True, text=True, timeout=260)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    events = [json.loads(l) for l in open(os.path.join(run_dir, "events.jsonl"))]
    kinds = [(e["event"], e["replica"]) for e in events if e["event"] in ("evict", "world_stop", "world_restart")]
    assert ("world_stop", 0) in kinds and ("world_restart", 0) in kinds and ("world_restart", 1) in kinds
    restart = [e for e in events if e["event"] == "world_restart"][0]
    assert restart["step"] == 10 and restart["checkpoint"].endswith("step_00000010")
    # replica 0 was healthy but restarted too, and redid steps 11.. from the checkpoint
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "replica_0", "steps.jsonl"))]
    inc1 = [x["step"] for x in rows if x["inc"] == 1 and x["role"] == "train"]  # after the sync round
    assert inc1[0] == 11 and max(x["step"] for x in rows if x["inc"] == 0) >= 12
    finals = [json.load(open(os.path.join(run_dir, f"replica_{i}", "final.json"))) for i in (0, 1)]
    assert finals[0]["digest"] == finals[1]["digest"] == clean.finals[0]["digest"]
