"""One job across three "hosts" (network namespaces on a bridge, tests/netns.py): etcd on
one, a replica of W = 2 (FSDP2, Lightning) on each of the other two, no address options
set (issue 10 §2). Replica 0 runs under torchrun (`--max-restarts`, incarnation from
TORCHELASTIC_RESTART_COUNT, variables from `lightning-ft env`), replica 1 under
`lightning-ft run --replica-ids 1`. One rank of each is SIGKILLed in turn: torchrun and the
launcher restart their replica, which catches up from the other host; both end bitwise
identical with an exact ledger."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from lightning_ft.coord import keys
from lightning_ft.coord.addresses import decode_blocks
from lightning_ft.coord.etcd_store import EtcdStore
from lightning_ft.replica.ledger import read_cursors, verify_ledger
from tests import netns
from tests.procs import children, replica_pid
from tests.strategy.runs import SCRIPT, run_root

pytestmark = pytest.mark.skipif(netns.skip_reason() is not None, reason=str(netns.skip_reason()))

ETCD = """
import signal, sys, time
from lightning_ft.coord.etcd_server import EtcdServer
srv = EtcdServer(host=sys.argv[1], port=2379).start()
print(srv.endpoint, flush=True)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
try:
    while srv.proc.poll() is None:
        time.sleep(0.5)
finally:
    srv.cleanup()
"""
OVERRIDES = ("etcd.lease_ttl_s=2", "quorum.init_timeout_s=60", "failure.restart_delay_s=0.2")


def start_etcd(host: netns.Host, log_dir) -> str:
    """etcd inside `host`, on its own address; returns HOST:PORT once it answers."""
    p = host.popen([sys.executable, "-c", ETCD, host.ip], stdout=subprocess.PIPE,
                   stderr=open(log_dir / "etcd.log", "w"), text=True)
    line = p.stdout.readline().strip()  # EtcdServer.start() waits until it answers
    assert line.endswith(":2379"), f"etcd did not start in {host.ns}: {line!r}; see {log_dir / 'etcd.log'}"
    return f"{host.ip}:2379"


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LFT_", "TORCHELASTIC", "MASTER_"))}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def wait_for(cond, timeout_s: float, what: str, procs=()):
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        for p in procs:
            assert p.poll() is None, f"{what}: a launcher exited early with {p.returncode}"
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.2)


def rows(path) -> list[dict]:
    try:
        return [json.loads(line) for line in open(path) if line.strip()]
    except (OSError, ValueError):
        return []


def rank_pid(parent: int, rid: int, rank: int) -> int:
    """The process of `rank` of replica `rid` among the children of a launcher (torchrun or ours)."""
    for pid in children(parent):
        try:
            env = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
        except OSError:
            continue
        if env.get("LFT_REPLICA_ID") == str(rid) and env.get("RANK") == str(rank):
            return pid
    return 0


def tail(path, n: int = 3000) -> str:
    try:
        return f"--- {path}\n" + open(path, errors="replace").read()[-n:]
    except OSError:
        return f"--- {path}: none"


@pytest.mark.timeout(600)
def test_torchrun_and_launcher_replicas_on_two_hosts_restart_catch_up_and_end_identical(tmp_path):
    steps = 50
    job = "mh" + uuid.uuid4().hex[:6]
    secret_file = tmp_path / "secret"
    secret_file.write_text("multihost-test-secret-0123456789\n")
    secret_file.chmod(0o600)
    script_args = ["--steps", str(steps), "--step-sleep", "0.1", "--degraded-sleep", "3"]
    with netns.Net() as net:
        he, ha, hb = net.host("e"), net.host("a"), net.host("b")
        etcd = start_etcd(he, tmp_path)
        dir_a, dir_b = tmp_path / "host_a", tmp_path / "host_b"

        # host a: replica 0 under torchrun, with what `lightning-ft env` prints
        env_cmd = [sys.executable, "-m", "lightning_ft.launch.cli", "env", "--replica-id", "0", "--replicas", "2",
                   "--etcd", etcd, "--job", job, "--run-dir", str(dir_a), "--format", "json", *OVERRIDES]
        r = subprocess.run(env_cmd, capture_output=True, text=True, timeout=60,
                           env=clean_env(LFT_SECRET_FILE=str(secret_file)))
        assert r.returncode == 0, r.stderr
        variables = json.loads(r.stdout)
        assert variables["LFT_SECRET_FILE"] == str(secret_file)
        tr = ha.popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       "--max-restarts", "2", "--monitor-interval", "0.2", SCRIPT, *script_args],
                      env=clean_env(**variables), stdout=open(tmp_path / "torchrun.log", "w"),
                      stderr=subprocess.STDOUT)
        # host b: replica 1 under the launcher
        run = hb.popen([sys.executable, "-m", "lightning_ft.launch.cli", "run", "--replicas", "2",
                        "--nproc-per-replica", "2", "--etcd", etcd, "--replica-ids", "1", "--job", job,
                        "--run-dir", str(dir_b), "--no-status", "--timeout", "400", "--max-restarts", "2",
                        SCRIPT, *script_args, *OVERRIDES],
                       env=clean_env(LFT_SECRET_FILE=str(secret_file)), stdout=open(tmp_path / "launcher.log", "w"),
                       stderr=subprocess.STDOUT)
        launchers = (tr, run)

        def diag() -> str:
            return "\n".join([tail(tmp_path / "torchrun.log"), tail(tmp_path / "launcher.log"),
                              *(tail(p) for p in sorted((dir_b / "logs").glob("*.rank0.log")))])

        steps_a, steps_b = dir_a / "replica_0" / "steps.jsonl", dir_b / "replica_1" / "steps.jsonl"
        try:
            # both train together, then SIGKILL rank 1 of replica 0: torchrun restarts the replica
            wait_for(lambda: any(len(x.get("contributors", [])) == 2 and x["step"] >= 6 for x in rows(steps_a)),
                     240, "both replicas training", launchers)
            # the listeners' addresses, published once per incarnation (gone with the lease at the end)
            probe = EtcdStore(etcd)
            try:
                published = probe.get_prefix(keys.addrs(run_root(probe, job)))[0]
            finally:
                probe.close()
            victim = rank_pid(tr.pid, 0, 1)
            assert victim, "torchrun's rank-1 worker not found"
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda: any(x["inc"] == 1 and x["role"] == "train" for x in rows(steps_a)), 240,
                     "replica 0 restarted by torchrun and training again", launchers)
            # then SIGKILL rank 1 of replica 1: the launcher restarts it
            victim = replica_pid(str(dir_b), 1, 1)  # forked by the launcher's zygote: from its events
            assert victim, "the launcher's rank-1 process not found"
            os.kill(victim, signal.SIGKILL)
            for p in launchers:
                p.wait(timeout=300)
        except (AssertionError, subprocess.TimeoutExpired) as e:
            raise AssertionError(f"{e}\n{diag()}") from None
        assert tr.returncode == 0 and run.returncode == 0, diag()

        finals = {0: json.load(open(dir_a / "replica_0" / "final.json")),
                  1: json.load(open(dir_b / "replica_1" / "final.json"))}
        assert finals[0]["step"] == finals[1]["step"] == steps, finals
        assert finals[0]["digest"] == finals[1]["digest"], (finals, diag())
        assert len(finals[0]["digest"]) == 2 and finals[0]["digest"][0] != finals[0]["digest"][1], "FSDP2 shards"
        assert finals[0]["incarnation"] == 1 and finals[1]["incarnation"] == 1  # torchrun's restart count
        # each restarted replica caught up from the other host before it trained again
        for path in (steps_a, steps_b):
            back = [x for x in rows(path) if x["inc"] == 1]
            assert back and back[0]["caught_up"] and back[0]["role"] == "catchup", back[:2]
        events_b = [json.loads(line) for line in open(dir_b / "events.jsonl")]
        assert [(e["event"], e["replica"]) for e in events_b if e["event"] in ("evict", "restart")] == [
            ("evict", 1), ("restart", 1)]
        store = EtcdStore(etcd)  # reached over the bridge
        try:
            root = run_root(store, job)
            ledger = verify_ledger(store, root, read_cursors(store, root, range(2)))
        finally:
            store.close()
        assert ledger.ok and ledger.steps == steps, (ledger.duplicates, ledger.gaps, ledger.conflicts)
        # no address options were set: every listener advertised its host's routable address
        hosts = {0: ha.ip, 1: hb.ip}
        assert sorted(kv.key.split("/")[-3] for kv in published) == ["0", "1"], [kv.key for kv in published]
        for kv in published:
            rid = int(kv.key.split("/")[-3])
            ftar, state = decode_blocks([kv.value], 2)
            assert all(a.startswith(hosts[rid] + ":") for a in (*ftar, *state)), (rid, ftar, state)


@pytest.mark.timeout(400)
def test_a_warm_spare_on_another_host_takes_over_a_killed_replica(tmp_path):
    """Issue 25 §1, multi-host: one launcher runs replica r on host r (`LFT_REPLICA_WRAP`, a
    network namespace each) and keeps one warm spare, placed beside replica 1. Replica 0 is
    SIGKILLed: the spare on replica 1's host becomes replica 0's next incarnation, catches up
    over the bridge, and the job ends identical with an exact ledger."""
    from lightning_ft.bench.localjob import LOOP

    steps = 200
    with netns.Net() as net:
        he = net.host("e")
        for rid in range(2):
            net.host(f"r{rid}")
        etcd = start_etcd(he, tmp_path)
        job, run_dir = "spare" + uuid.uuid4().hex[:6], tmp_path / "run"
        wrap = f"ip netns exec {net.tag}r{{rid}}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_ft.launch.cli", "run", "--replicas", "2", "--nproc-per-replica", "1",
             "--etcd", etcd, "--job", job, "--run-dir", str(run_dir), "--no-status", "--timeout", "300",
             LOOP, "--dim", "16", "--hidden", "32", "--batch", "8", "--ttl", "2", "--init-timeout", "60",
             "--step-sleep", "0.05", "--steps", str(steps), *OVERRIDES, "supervisor.standby=1",
             "etcd.connect_timeout_s=30"],
            env=clean_env(LFT_REPLICA_WRAP=wrap), stdout=open(tmp_path / "launcher.log", "w"),
            stderr=subprocess.STDOUT)
        events = run_dir / "events.jsonl"

        def diag() -> str:
            return "\n".join([tail(tmp_path / "launcher.log"), tail(events)] +
                             [tail(p, 1500) for p in sorted((run_dir / "logs").glob("*.log"))])

        def spare_waiting() -> bool:
            from lightning_ft.coord import standby

            store = EtcdStore(etcd)
            try:
                return bool(standby.spares(store, run_root(store, job)))
            except Exception:  # the run is not recorded yet
                return False
            finally:
                store.close()

        try:
            wait_for(spare_waiting, 150, "the spare registered", [proc])
            wait_for(lambda: [r for r in rows(run_dir / "logs" / "r0.i0.rank0.log") if r.get("event") == "step"
                              and r.get("step", 0) >= 20], 120, "replica 0 training", [proc])
            start = next(e for e in rows(events) if e["event"] == "start" and e["replica"] == 0)
            os.kill(start["pids"][0], signal.SIGKILL)
            proc.wait(timeout=240)
        except BaseException:
            proc.kill()
            raise AssertionError(diag()) from None
        assert proc.returncode == 0, diag()
        store = EtcdStore(etcd)
        try:
            root = run_root(store, job)
            ledger = verify_ledger(store, root, read_cursors(store, root, range(2)))
        finally:
            store.close()
    ev = rows(events)
    spare = next(e for e in ev if e["event"] == "spare_start")
    restart = next(e for e in ev if e["event"] == "restart" and e["replica"] == 0)
    assert spare["host"] == wrap.format(rid=1), spare  # placed beside replica 1, on its host
    assert restart.get("standby") == spare["token"] and restart.get("host") == spare["host"], (restart, diag())
    finals = {}
    for path in sorted((run_dir / "logs").glob("r*.rank0.log")):  # a promoted spare's: linked as r0.i1
        for line in open(path, errors="replace"):
            if line.startswith('{"t"') and '"event": "final"' in line:
                finals[int(path.name[1:path.name.index(".")])] = json.loads(line)
    assert set(finals) == {0, 1} and {f["step"] for f in finals.values()} == {steps}, (finals, diag())
    assert finals[0]["digest"] == finals[1]["digest"], finals
    assert ledger.ok and ledger.steps == steps, (ledger.duplicates, ledger.gaps, ledger.conflicts)
