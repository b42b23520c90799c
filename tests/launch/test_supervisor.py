"""The supervisor with real processes (tests/launch/child.py) and a real etcd: environment,
crash -> kill the replica + evict at once + restart, give-up, hang detection by lease expiry,
downtime, shutdown by PID, and two supervisors sharing one job."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest

from lightning_ft.coord.etcd_store import EtcdStore
from lightning_ft.coord.store import MemoryStore
from lightning_ft.constants import ExitCode
from lightning_ft.launch.processes import TERM_GRACE_S
from lightning_ft.launch.supervisor import Supervisor
from lightning_ft.launch.supervisor_settings import split

CHILD = str(Path(__file__).with_name("child.py"))


@pytest.fixture
def store(etcd_endpoint):
    s = EtcdStore(etcd_endpoint)
    yield s
    s.close()


@pytest.fixture
def make(etcd_endpoint, tmp_path):
    """make(*specs, **kwargs) -> Supervisor running child.py with `specs`; every one is shut down
    at teardown. Children write their env and exit times to tmp_path/out."""
    out = tmp_path / "out"
    out.mkdir()
    job = f"t{uuid.uuid4().hex[:8]}"
    made: list[Supervisor] = []

    def _make(*specs: str, **kw) -> Supervisor:
        kw = {"replicas": 2, "nproc_per_replica": 2, "job": job, "etcd": etcd_endpoint, "secret": "s3cret",
              "run_dir": str(tmp_path / "run"), "restart_delay_s": 0.2, **kw}
        store = kw.pop("store", None)
        sup = Supervisor([sys.executable, CHILD, str(out), *specs], *split(**kw), store=store)
        made.append(sup)
        return sup

    _make.out = out
    _make.job = job
    _make.run_dir = tmp_path / "run"
    yield _make
    for sup in made:
        sup.shutdown()


def wait_for(cond: Callable[[], object], timeout_s: float, what: str, poll: Callable[[], None] = lambda: None):
    deadline = time.monotonic() + timeout_s
    while True:
        poll()
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.01)


def events(run_dir: Path, replica: int | None = None) -> list[dict]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    evs = [json.loads(line) for line in lines]
    return [e for e in evs if replica is None or e["replica"] == replica]


def seq(evs: list[dict]) -> list[tuple[str, int]]:
    """The supervision events in order (hang diagnoses, written from their own thread, left out)."""
    return [(e["event"], e["incarnation"]) for e in evs if not e.get("diagnosis")]


def env_of(out: Path, rid: int, inc: int, rank: int) -> dict:
    return json.loads((out / f"r{rid}.i{inc}.rank{rank}.env.json").read_text())


def alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (grandchildren may be reparented to a PID 1
    that does not reap them)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def status(sup: Supervisor, rid: int) -> dict:
    return next(s for s in sup.status() if s["rid"] == rid)


def test_env_of_two_replicas_of_two_ranks(make):
    sup = make("*:*:*=exit:0:0")
    assert sup.run(timeout_s=20) == 0
    envs = {(r, k): env_of(make.out, r, 0, k) for r in (0, 1) for k in (0, 1)}
    for (rid, rank), env in envs.items():
        assert {k: env[k] for k in ("LFT_JOB", "LFT_REPLICA_ID", "LFT_NUM_REPLICAS", "LFT_ETCD", "LFT_SECRET",
                                    "LFT_INCARNATION", "LFT_RUN_DIR", "MASTER_ADDR", "RANK", "LOCAL_RANK",
                                    "WORLD_SIZE", "LOCAL_WORLD_SIZE")} == {
            "LFT_JOB": make.job, "LFT_REPLICA_ID": str(rid), "LFT_NUM_REPLICAS": "2", "LFT_ETCD": sup.etcd,
            "LFT_SECRET": "s3cret", "LFT_INCARNATION": "0", "LFT_RUN_DIR": str(make.run_dir),
            "MASTER_ADDR": "127.0.0.1", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2"}
        assert env["PATH"] == os.environ["PATH"]  # the parent's environment is passed on
        assert env["LFT_RUN_ID"] == sup.run_id and sup.root.endswith(f"/runs/{sup.run_id}/")
    ports = {rid: {envs[rid, 0]["MASTER_PORT"], envs[rid, 1]["MASTER_PORT"]} for rid in (0, 1)}
    assert len(ports[0]) == len(ports[1]) == 1 and ports[0] != ports[1]  # one port per replica
    assert sorted(p.name for p in (make.run_dir / "logs").iterdir()) == [
        f"r{r}.i0.rank{k}.log" for r in (0, 1) for k in (0, 1)]
    for rid in (0, 1):
        assert seq(events(make.run_dir, rid)) == [("start", 0), ("exit", 0), ("exit", 0)]
        assert status(sup, rid)["state"] == "done"


def test_extra_env_is_passed_to_every_process(make):
    sup = make("*:*:*=exit:0:0", replicas=1, nproc_per_replica=1, env={"LFT_TEST_EXTRA": "yes"})
    assert sup.run(timeout_s=20) == 0
    assert env_of(make.out, 0, 0, 0)["LFT_TEST_EXTRA"] == "yes"


def test_crash_kills_replica_evicts_within_200ms_and_restarts(make, store):
    sup = make("1:0:1=exit:3:500", restart_delay_s=0.5)
    seen: dict[str, float] = {}

    def watch_key() -> None:
        key = f"{sup.root}evict/1/0"  # the run's keyspace, known once the supervisor started
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and store.get(key) is None:
            time.sleep(0.005)
        seen["t"] = time.time()

    watcher = threading.Thread(target=watch_key, daemon=True)
    sup.start()
    watcher.start()
    old = {rid: status(sup, rid)["pids"] for rid in (0, 1)}
    assert sup.run(until=lambda: status(sup, 1)["state"] == "running" and status(sup, 1)["incarnation"] == 1,
                   timeout_s=15) == 0
    watcher.join(15)
    key = f"{sup.root}evict/1/0"
    exited_at = float((make.out / "r1.i0.rank1.exit").read_text())
    assert seen["t"] - exited_at < 0.2, f"eviction visible {seen['t'] - exited_at:.3f}s after the exit"
    assert store.get(key).value == b"rank 1 exited with 3"
    assert not alive(old[1][0])  # the rest of replica 1 was killed
    assert status(sup, 0)["pids"] == old[0] and status(sup, 0)["incarnation"] == 0  # replica 0 untouched
    evs = events(make.run_dir, 1)
    assert seq(evs) == [("start", 0), ("exit", 0), ("evict", 0), ("restart", 1)]
    assert (evs[1]["rank"], evs[1]["code"]) == (1, 3)
    assert evs[2]["reason"] == "rank 1 exited with 3" and evs[2]["killed_ranks"] == [0]
    assert evs[3]["t"] - evs[2]["t"] >= 0.45  # restart_delay_s
    wait_for(lambda: all((make.out / f"r1.i1.rank{k}.env.json").exists() for k in (0, 1)), 10,
             "incarnation 1 to start")
    assert env_of(make.out, 1, 1, 0)["LFT_INCARNATION"] == "1"
    assert status(sup, 1)["restarts"] == 1 and len(status(sup, 1)["pids"]) == 2


def test_sigkill_of_one_rank_evicts_with_the_signal(make, store):
    sup = make(replicas=1, restart_delay_s=0.1)
    sup.start()
    pids = status(sup, 0)["pids"]
    os.kill(pids[1], signal.SIGKILL)
    wait_for(lambda: status(sup, 0)["incarnation"] == 1, 10, "the restart", poll=sup.poll)
    assert store.get(f"{sup.root}evict/0/0").value == b"rank 1 exited with -9"
    assert not alive(pids[0]) and not alive(pids[1])


def test_max_restarts_gives_up(make, store):
    sup = make("*:*:*=exit:3:0", replicas=1, nproc_per_replica=1, restart_delay_s=0.05, max_restarts=2,
               crash_loop=10)  # the restart limit, not the crash-loop detector, stops it
    assert sup.run(timeout_s=20) == ExitCode.GAVE_UP
    assert seq(events(make.run_dir)) == [
        ("start", 0), ("exit", 0), ("evict", 0), ("restart", 1), ("exit", 1), ("evict", 1),
        ("restart", 2), ("exit", 2), ("evict", 2), ("give_up", 2)]
    assert "max_restarts=2" in events(make.run_dir)[-1]["reason"]
    assert status(sup, 0)["state"] == "failed" and status(sup, 0)["restarts"] == 2
    kvs, _ = store.get_prefix(f"{sup.root}evict/0/")
    assert [kv.key.rsplit("/", 1)[1] for kv in kvs] == ["0", "1", "2"]


def test_hang_by_lease_expiry_kills_evicts_and_restarts(make, store):
    sup = make("0:0:0=member:300:hang:0", "0:1:0=member:-1:hang:0", replicas=1, hang_grace_s=0.2)
    sup.start()
    pids = status(sup, 0)["pids"]
    wait_for(lambda: status(sup, 0)["incarnation"] == 1, 15, "the hang to be detected", poll=sup.poll)
    assert not any(alive(p) for p in pids)
    ev = [e for e in events(make.run_dir) if not e.get("diagnosis")]
    assert seq(ev) == [("start", 0), ("hang", 0), ("evict", 0), ("restart", 1)]
    assert "vanished (lease expired)" in ev[1]["reason"] and ev[2]["killed_ranks"] == [0, 1]
    assert store.get(f"{sup.root}evict/0/0").value.decode() == ev[1]["reason"]
    # The diagnosis, read before the kill: the rank, its state, its stack from outside (py-spy).
    diag = [e for e in events(make.run_dir) if e.get("diagnosis")]
    assert len(diag) == 1 and (diag[0]["replica"], diag[0]["rank"], diag[0]["incarnation"]) == (0, 0, 0), diag
    assert diag[0]["state"] in "RS" and diag[0]["links"] == [] and "vanished (lease expired)" in diag[0]["reason"]
    assert "child.py" in diag[0]["stack"], diag[0]["stack"]
    # Incarnation 1 keeps its lease alive: it is not taken for hung.
    wait_for(lambda: store.get(f"{sup.root}members/0"), 10, "incarnation 1 to register", poll=sup.poll)
    assert sup.run(timeout_s=2.0) == ExitCode.TIMEOUT
    assert status(sup, 0)["incarnation"] == 1 and status(sup, 0)["state"] == "running"


def test_a_halted_job_ends_even_when_an_eviction_races_the_halt(make, store):
    # The 100-fault soak: replica 0 halted the job while replica 1 was being declared hung; the
    # eviction left replica 1 "restarting", a halted job restarts nobody, and the launcher
    # waited forever with no process left.
    sup = make("0:0:0=halt:300", "1:0:0=member:400:hang:0", replicas=2, nproc_per_replica=1, hang_grace_s=0.2)
    t0 = time.monotonic()
    assert sup.run(timeout_s=30) == ExitCode.HALTED
    assert time.monotonic() - t0 < 15
    ev = events(make.run_dir)
    names = [e["event"] for e in ev]
    assert "job_halted" in names and "restart" not in names, names
    assert all(s["state"] == "failed" and not s["pids"] for s in sup.status()), sup.status()


def test_leader_that_revokes_its_lease_and_exits_is_not_hung(make):
    sup = make("0:0:0=member:300:revoke:0", "0:0:1=exit:0:1500", replicas=1, hang_grace_s=1.0)
    assert sup.run(timeout_s=15) == 0
    assert [e["event"] for e in events(make.run_dir)] == ["start", "exit", "exit"]


def test_downtime_keeps_replica_down_until_the_job_advances(make, store):
    # Replica 0 reports 20 steps/s; replica 1 is killed and must stay down for 10 steps (~0.5 s),
    # not the 30 s restart delay.
    sup = make("0:*:*=member:-1:hang:20", "1:*:*=sleep", nproc_per_replica=1, restart_delay_s=30)
    sup.start()
    wait_for(lambda: status(sup, 0)["step"], 10, "replica 0 to report steps", poll=sup.poll)
    sup.set_downtime(1, 10)
    sup.kill_replica(1, reason="injected kill")
    wait_for(lambda: status(sup, 1)["incarnation"] == 1, 10, "the restart", poll=sup.poll)
    ev = {e["event"]: e for e in events(make.run_dir, 1)}
    assert ev["evict"]["reason"] == "rank 0 exited with -9 (injected kill)"
    assert store.get(f"{sup.root}evict/1/0").value == b"rank 0 exited with -9 (injected kill)"
    assert 0.3 < ev["restart"]["down_s"] < 5
    reported = json.loads(store.get(f"{sup.root}members/0").value)["step"]
    assert reported >= ev["restart"]["wait_step"] >= 10


def test_shutdown_kills_every_child_and_grandchild_by_pid(make, store):
    sup = make("1:0:1=ignore_term")
    sup.start()
    gc_file = make.out / "r1.i0.rank1.grandchild"
    wait_for(gc_file.exists, 10, "the grandchild", poll=sup.poll)
    grandchild = int(gc_file.read_text())
    pids = [p for s in sup.status() for p in s["pids"]]
    assert len(pids) == 4 and all(alive(p) for p in pids + [grandchild])
    t0 = time.monotonic()
    sup.shutdown()
    took = time.monotonic() - t0
    assert TERM_GRACE_S - 0.1 < took < TERM_GRACE_S + 3  # one child ignored SIGTERM: SIGKILL after the grace
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    wait_for(lambda: not alive(grandchild), 5, "the grandchild to die")
    assert [s["state"] for s in sup.status()] == ["stopped", "stopped"]
    assert seq(events(make.run_dir))[-2:] == [("shutdown", 0), ("shutdown", 0)]
    assert store.get(f"{sup.root}evict/1/0").value == b"supervisor shut down"
    sup.shutdown()  # idempotent


def test_sigterm_to_a_running_supervisor_shuts_down_its_children(make, etcd_endpoint, tmp_path, procs):
    script = textwrap.dedent(f"""
        import sys
        from lightning_ft.launch.supervisor import Supervisor
        from lightning_ft.launch.supervisor_settings import split
        sup = Supervisor([sys.executable, {CHILD!r}, {str(make.out)!r}], *split(replicas=1, nproc_per_replica=2,
                         job={make.job!r}, etcd={etcd_endpoint!r}, secret="", run_dir={str(tmp_path / 'run2')!r}))
        sys.exit(sup.run(timeout_s=30))
    """)
    p = subprocess.Popen([sys.executable, "-c", script])
    procs.append(p)
    env_files = [make.out / f"r0.i0.rank{k}.env.json" for k in (0, 1)]
    wait_for(lambda: all(f.exists() for f in env_files), 15, "the children to start")
    pids = events(tmp_path / "run2")[0]["pids"]
    p.send_signal(signal.SIGTERM)
    assert p.wait(10) == 128 + signal.SIGTERM
    assert not any(alive(pid) for pid in pids)
    assert events(tmp_path / "run2")[-1]["event"] == "shutdown"


def test_two_supervisors_with_disjoint_replica_ids_share_one_job(make, store):
    specs = ("1:0:1=exit:3:300", "*:*:0=member:-1:hang:0")
    a = make(*specs, replica_ids=[0], run_dir=str(make.run_dir / "a"))
    b = make(*specs, replica_ids=[1], run_dir=str(make.run_dir / "b"))
    a.start()
    b.start()

    def poll_both() -> None:
        a.poll()
        b.poll()

    wait_for(lambda: status(b, 1)["incarnation"] == 1, 15, "replica 1 to restart", poll=poll_both)
    assert [s["rid"] for s in a.status()] == [0] and [s["rid"] for s in b.status()] == [1]
    assert status(a, 0)["incarnation"] == 0 and status(a, 0)["restarts"] == 0
    assert a.root == b.root and a.run_id == b.run_id, "the second launcher joins the first one's run"
    assert store.get(f"{a.root}evict/1/0").value == b"rank 1 exited with 3"
    members = f"{a.root}members/"
    wait_for(lambda: [json.loads(kv.value)["incarnation"] for kv in store.get_prefix(members)[0]] == [0, 1],
             15, "both replicas registered with their incarnations", poll=poll_both)
    for rid, sup in ((0, a), (1, b)):
        env = env_of(make.out, rid, status(sup, rid)["incarnation"], 0)
        assert (env["LFT_REPLICA_ID"], env["LFT_NUM_REPLICAS"], env["LFT_JOB"]) == (str(rid), "2", make.job)


def test_replica_ids_out_of_range_are_refused(make):
    with pytest.raises(ValueError, match=r"replica_ids \[0, 2\] must be distinct and between 0 and replicas - 1"):
        make(replica_ids=[0, 2])


def test_a_command_that_cannot_start_says_so(etcd_endpoint, tmp_path):
    sup = Supervisor([str(tmp_path / "no-such-program")], *split(replicas=1, nproc_per_replica=2, job="nostart",
                     etcd=etcd_endpoint, secret="", run_dir=str(tmp_path / "run")))
    try:
        with pytest.raises(RuntimeError, match="cannot start replica 0 rank 0 .*no-such-program"):
            sup.start()
    finally:
        sup.shutdown()


def _leaving_leader(path, tail: str, first_only: bool = False):
    """A leader script that registers in the run, leaves the job a second later (left/{rid}/{inc}
    written, lease revoked), then runs `tail` (its teardown). `first_only`: later incarnations
    exit 0 at once."""
    path.write_text(
        "import os, signal, time\n"
        "from lightning_ft.coord.coordinator import Coordinator\n"
        "from lightning_ft.coord.membership import MembershipSettings\n"
        "from lightning_ft.coord.round_records import JobSpec\n"
        "from lightning_ft.coord.etcd_store import EtcdStore\n"
        + ("if os.environ['LFT_INCARNATION'] != '0':\n    raise SystemExit(0)\n" if first_only else "")
        + "s = EtcdStore(os.environ['LFT_ETCD'])\n"
        "c = Coordinator(s, os.environ['LFT_JOB'], 0, int(os.environ['LFT_INCARNATION']), JobSpec(1, 1, 0.0, {}),\n"
        "                MembershipSettings(lease_ttl_s=1), run=os.environ['LFT_RUN_ID'])\n"
        "c.register(0)\n"
        "time.sleep(1.0)\n"
        "c.close(revoke=True)\n" + tail)
    return path


def test_clean_exit_marker_is_not_mistaken_for_a_hang(etcd_endpoint, tmp_path):
    """A leader that writes left/{rid}/{inc} and revokes its lease, then takes a while to
    exit, is waited for, not killed as hung."""
    job = "left" + uuid.uuid4().hex[:6]
    script = _leaving_leader(tmp_path / "slow_exit.py", "time.sleep(1.5)  # a slow interpreter teardown\n")
    sup = Supervisor([sys.executable, str(script)], *split(replicas=1, nproc_per_replica=1, job=job,
                     etcd=etcd_endpoint, secret="s", run_dir=str(tmp_path / "run"), hang_grace_s=0.3,
                     restart_delay_s=0.1))
    try:
        sup.start()
        assert sup.run(timeout_s=30) == 0
    finally:
        sup.shutdown()
    events = [json.loads(l)["event"] for l in open(tmp_path / "run" / "events.jsonl")]
    assert "hang" not in events and "restart" not in events, events


def test_a_restarted_replica_does_not_get_the_resume_checkpoint(make, store):
    """`--resume` hands the checkpoint to the job's first processes only: a replica restarted
    later catches up from the live ones, and the checkpoint may have been pruned meanwhile
    (the 100-fault soak crash-looped on a pruned one)."""
    sup = make("0:0:*=exit:1:300", replicas=2, nproc_per_replica=1, restart_delay_s=0.05,
               env={"LFT_RESUME": "/ckpt/step_00000800"})
    sup.start()
    wait_for(lambda: (make.out / "r0.i1.rank0.env.json").exists(), 15, "replica 0 to restart", poll=sup.poll)
    first = json.loads((make.out / "r0.i0.rank0.env.json").read_text())
    again = json.loads((make.out / "r0.i1.rank0.env.json").read_text())
    other = json.loads((make.out / "r1.i0.rank0.env.json").read_text())
    assert first["LFT_RESUME"] == other["LFT_RESUME"] == "/ckpt/step_00000800"
    assert "LFT_RESUME" not in again


def test_a_replica_hung_before_it_registers_is_restarted_after_the_start_timeout(make, store):
    """A leader stopped (or deadlocked) in initialization never registers, so no lease can
    lapse: the start timeout catches it (the 100-fault soak SIGSTOPped two freshly restarted
    replicas, which then sat out the rest of the job)."""
    sup = make("0:0:*=sleep", "*:*:*=member:-1:hang:0", replicas=2, nproc_per_replica=1,
               start_timeout_s=1.0, restart_delay_s=0.05)
    sup.start()
    pid = status(sup, 0)["pids"][0]
    wait_for(lambda: status(sup, 0)["incarnation"] == 1, 15, "replica 0 to restart", poll=sup.poll)
    assert not alive(pid)
    hangs = [e for e in events(make.run_dir) if e["event"] == "hang"]
    assert hangs and hangs[0]["replica"] == 0 and "did not register with etcd within 1s" in hangs[0]["reason"], hangs
    assert status(sup, 1)["incarnation"] == 0  # the registered one is left alone


def test_a_resume_right_after_a_whole_job_kill_waits_for_the_dead_jobs_leases_then_seeds(make, store, tmp_path):
    """The soak relaunches `--resume` a second after killing the whole job: the dead launcher's
    hold and its members' leases still make the run look live. The resume waits for them to
    lapse and seeds the run (a new generation; the dead job's evictions gone), instead of
    joining a run nobody runs, where the new incarnation 0 met the dead one's eviction."""
    from lightning_ft.coord import keys
    from lightning_ft.coord.runs import RunRecord
    from lightning_ft.replica.ledger import read_rewinds
    from lightning_ft.secret import tag

    run_dir = make.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run_id").write_text("run-before\n")
    root = keys.root("/lft", make.job, "run-before")
    store.put(keys.run_record("/lft", make.job), RunRecord("run-before", tag("s3cret", make.job)).to_json())
    store.put(keys.evict(root, 0, 0), b"the dead job's eviction")
    store.put(keys.launchers(root, "dead-launcher"), b"{}", lease=store.lease_grant(2))
    ckpt = tmp_path / "step_00000005"
    ckpt.mkdir()
    (ckpt / "meta.json").write_text(json.dumps({"step": 5, "cursors": {"0": 5}}))
    sup = make("*:*:*=sleep", replicas=1, nproc_per_replica=1, seed_from=str(ckpt), resume_wait_s=10.0)
    t0 = time.monotonic()
    sup.start()
    assert sup.run_id == "run-before" and time.monotonic() - t0 >= 1.0  # it waited for the lease
    assert store.get(keys.evict(root, 0, 0)) is None
    assert [r["to"] for r in read_rewinds(store, root).values()] == [5]


@pytest.mark.parametrize("how", ["stopped", "deadlocked"])
def test_a_leader_hung_after_it_left_the_job_is_killed_and_restarted(etcd_endpoint, tmp_path, how):
    """The 10-fault soak: an injected exception made a replica leave the job (left/{rid}/{inc}
    written, lease revoked), then a SIGSTOP froze it in teardown. A clean leave means "wait for
    the exit code", and the launcher waited for it forever. Stopped, it never exits: hung past
    the hang grace (0.3 s here). Deadlocked (it runs, or sleeps): hung past exit_timeout_s. Both
    are killed, evicted and restarted."""
    job = "stop" + uuid.uuid4().hex[:6]
    teardown = "os.kill(os.getpid(), signal.SIGSTOP)\n" if how == "stopped" else "time.sleep(3600)\n"
    script = _leaving_leader(tmp_path / "hangs_in_teardown.py", teardown, first_only=True)
    sup = Supervisor([sys.executable, str(script)], *split(replicas=1, nproc_per_replica=1, job=job,
                     etcd=etcd_endpoint, secret="s", run_dir=str(tmp_path / "run"), hang_grace_s=0.3,
                     restart_delay_s=0.1, exit_timeout_s=4.0))
    try:
        sup.start()
        pid = status(sup, 0)["pids"][0]
        assert sup.run(timeout_s=40) == 0
        assert not alive(pid)
    finally:
        sup.shutdown()
    evs = [json.loads(l) for l in open(tmp_path / "run" / "events.jsonl")]
    assert seq(evs)[:4] == [("start", 0), ("hang", 0), ("evict", 0), ("restart", 1)], seq(evs)
    assert "hung on exit" in evs[1]["reason"] and "left the job" in evs[1]["reason"], evs[1]
    assert evs[-1]["event"] == "exit" and evs[-1]["code"] == 0 and evs[-1]["incarnation"] == 1
    if how == "stopped":
        assert "rank 0 is stopped (SIGSTOP)" in evs[1]["reason"], evs[1]
    else:  # the whole exit timeout, and the stack of where it hangs (C frames: sleep)
        assert evs[1]["reason"].startswith("hung on exit for 4s (supervisor.exit_timeout_s=4)"), evs[1]
        assert "time_sleep" in evs[1]["stacks"]["0"] or "no stack" in evs[1]["stacks"]["0"], evs[1]


def test_a_rank_left_running_after_another_exited_0_is_killed_after_the_exit_timeout(make):
    """Rank 0 finished, rank 1 never does (deadlocked in teardown): the replica is not done, and
    without a bound the launcher would wait for rank 1 forever."""
    sup = make("0:0:0=exit:0:100", "0:0:1=sleep", "0:1:*=exit:0:100", replicas=1, nproc_per_replica=2,
               exit_timeout_s=1.0, hang_check=False)
    sup.start()
    pid = status(sup, 0)["pids"][1]
    assert sup.run(timeout_s=20) == 0
    assert not alive(pid)
    ev = events(make.run_dir)
    hang = [e for e in ev if e["event"] == "hang"]
    assert len(hang) == 1 and "rank 0 exited 0 but ranks [1] still run" in hang[0]["reason"], hang
    assert ("restart", 1) in seq(ev) and status(sup, 0)["state"] == "done"


def test_a_slow_but_finite_exit_within_the_exit_timeout_is_waited_for(make):
    sup = make("0:0:0=exit:0:100", "0:0:1=exit:0:1200", replicas=1, nproc_per_replica=2, exit_timeout_s=5.0,
               hang_check=False)
    assert sup.run(timeout_s=20) == 0
    assert [e["event"] for e in events(make.run_dir)] == ["start", "exit", "exit"]


def test_spares_that_keep_dying_before_they_register_are_not_started_again(etcd_endpoint, tmp_path, caplog):
    """A program that cannot be a spare (here: it exits 3 when LFT_STANDBY is set) costs three
    spare starts, then restarts are cold; the replica itself is unaffected."""
    job = "spr" + uuid.uuid4().hex[:6]
    script = tmp_path / "no_spare.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ.get('LFT_STANDBY'):\n    assert 'LFT_REPLICA_ID' not in os.environ\n"
                      "    sys.exit(3)\n"
                      "time.sleep(4.0)\n")
    sup = Supervisor([sys.executable, str(script)], *split(replicas=1, nproc_per_replica=1, job=job,
                     etcd=etcd_endpoint, secret="s", run_dir=str(tmp_path / "run"), standby=1, hang_check=False))
    try:
        sup.start()
        with caplog.at_level(logging.WARNING):
            assert sup.run(timeout_s=60) == 0
    finally:
        sup.shutdown()
    events = [json.loads(l) for l in open(tmp_path / "run" / "events.jsonl")]
    exits = [e for e in events if e["event"] == "spare_exit"]
    assert len([e for e in events if e["event"] == "spare_start"]) == 3 == len(exits)
    assert all(e["codes"] == [3] and not e["registered"] for e in exits)
    assert "no more spares" in caplog.text


def test_standby_is_refused_with_world_restarts(tmp_path):
    with pytest.raises(ValueError, match="world"):
        Supervisor(["true"], *split(replicas=2, nproc_per_replica=1, job="j", etcd="127.0.0.1:1", secret="s",
                   run_dir=str(tmp_path), standby=1, restart="world"), store=MemoryStore())


def test_restarts_fork_from_the_zygote_exits_are_seen_and_shutdown_kills_their_groups(make, store):
    """supervisor.zygote (launch/zygote.py): a restarted replica's processes are forked by the
    zygote, not started afresh; their exits (a signal too) are seen as a started child's, the
    replica is restarted again the same way, and shutdown kills them and their grandchildren."""
    sup = make("1:2:1=ignore_term", replicas=2, restart_delay_s=0.1, zygote=True)
    sup.start()
    assert sup._procs.zygote is not None
    wait_for(lambda: sup._procs.zygote.ready.is_set(), 120, "the zygote to import torch", poll=sup.poll)
    zpid = sup._procs.zygote.proc.pid
    for inc in (0, 1):  # SIGKILL a rank of replica 1: its next incarnation comes from the zygote
        pids = status(sup, 1)["pids"]
        os.kill(pids[1], signal.SIGKILL)
        back = lambda i=inc: status(sup, 1)["incarnation"] == i + 1 and status(sup, 1)["state"] == "running"  # noqa: E731
        assert sup.run(until=back, timeout_s=30) == 0
        wait_for(lambda i=inc: all((make.out / f"r1.i{i + 1}.rank{k}.env.json").exists() for k in (0, 1)), 30,
                 f"incarnation {inc + 1} to start", poll=sup.poll)
        new = status(sup, 1)["pids"]
        assert all(int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) == zpid for p in new)
        assert env_of(make.out, 1, inc + 1, 0)["LFT_INCARNATION"] == str(inc + 1)
    evs = [e for e in events(make.run_dir, 1) if e["event"] == "exit"]
    assert [(e["incarnation"], e["rank"], e["code"]) for e in evs] == [(0, 1, -9), (1, 1, -9)]
    assert store.get(f"{sup.root}evict/1/1").value == b"rank 1 exited with -9"
    gc_file = make.out / "r1.i2.rank1.grandchild"
    wait_for(gc_file.exists, 30, "the grandchild", poll=sup.poll)
    grandchild = int(gc_file.read_text())
    forked = status(sup, 1)["pids"]
    sup.shutdown()  # rank 1 ignores SIGTERM: SIGKILL after the grace, to its whole group
    for pid in forked:
        assert not Path(f"/proc/{pid}").exists()  # killed and reaped
    wait_for(lambda: not alive(grandchild), 5, "the grandchild to die")
    assert sup._procs.zygote.proc.poll() is not None  # the zygote stopped with the supervisor
