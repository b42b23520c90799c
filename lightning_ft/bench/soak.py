"""`make soak`: many mixed, overlapping faults against 3 replicas of examples/train_lm.py.

    python -m lightning_ft.bench.soak [--faults 100] [--replicas 3] [--overlap 0.15] [--seed 0] [--standby N]
                                      [--kinds kill,hang,exception,link,job,etcd] [--set KEY=VALUE ...]

Faults land at random moments chosen from outside (never at step boundaries by design),
about `--every-s` apart, each once the job has committed a step since the previous one (so a
stall of `--hang-s` is a hang, not a job starved by faults faster than its restarts):
kill (SIGKILL a process), hang (SIGSTOP a replica's leader until the launcher declares it
hung), exception (SIGUSR1: the next batch raises, `failure.signal_exception`), link (the
replica's network link goes down for 2-6 s: FTAR and etcd alike; each replica runs in its own
network namespace on a bridge, lightning_ft/bench/netns.py, which needs root: without it the
kind is left out, and the soak says why), job (kill the launcher and every replica, then
`lightning-ft run --resume`), and etcd (SIGKILL the etcd leader member; a few seconds later it
is replaced by an empty member, `EtcdCluster.replace_dead`, as an operator replaces a crashed
one: restarted on its own data, a member killed under load can diverge with etcd 3.5.1,
etcd-io/etcd#13766, and seed 47 hit it: a replica's fenced ledger writes failed on that member
while the others applied them, and the ledger came out 1887 batches short). Not by default:
slow (a straggler: every process of the replica stopped 0.2 s in every 0.3 s for 5-15 s, so
the stragglers policy acts; with `--set stragglers.policy=shrink --accumulate 4` it is shrunk).
With probability `--overlap` a fault hits two replicas at once.
etcd is a 3-member cluster outside the job with data directories, so the ledger survives
whole-job kills, and checks span every restart.

Once the faults are done, the job trains `--tail-steps` more, fault-free, until every replica
has committed again (at most `TAIL_WAIT_S`), then the soak creates train_lm's `--stop-file`
and the replicas agree to stop after one step (Lightning's `trainer.should_stop`);
`--tail-steps 0` trains to `--steps` instead. A fixed step count either ran out before the
faults did (a fast machine: 6 of 10 landed) or trained a long fault-free tail (a slow one).

The soak ends when the job does: a launcher that exited, or a job that halted (no majority of
replica states agreed), stops the faults at once; the line then says `"halted": true` with
the reason, and the soak fails. At the end it verifies the final model's history from the
ledger (lost and duplicated batches), the replicas' final digests, stalls (no committed step
for `--hang-s`), and prints one line:

    {"bench": "soak", "faults": N, "overlapping": n, "lost_batches": 0, "duplicate_batches": 0,
     "at_end": replicas that trained to the last step (compared for "identical"),
     "final_step": the step they ended at, "steps": the ledger's steps of the final history,
     "rewinds": r, "identical": true, "hangs": 0, "ett": ...,
     "heals": {"disowned": .., "stale": .., "diverged": ..}: how often each guard against two
     states at one step fired (docs/ARCHITECTURE.md, "History generations"), ...}
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

from lightning_ft.bench.soak_parts import halt_reason, hangs, heals, plan_kinds
from lightning_ft.bench.soak_procs import alive, send, throttle

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_LM = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "train_lm.py")


TAIL_WAIT_S = 180.0
"""The longest the tail waits for every replica to commit again before the job stops."""


def log(msg: str) -> None:
    print(f"soak: {msg}", file=sys.stderr, flush=True)


class Job:
    """One `lightning-ft run` of the soak's training job (restarted by `--resume`)."""

    def __init__(self, a: argparse.Namespace, cluster, run_dir: str, net=None) -> None:
        self.a, self.cluster, self.etcd, self.run_dir = a, cluster, cluster.endpoint, run_dir
        self.proc: Optional[subprocess.Popen] = None
        self.launches = 0
        self.etcd_down_since: Optional[float] = None
        self.net = net
        """The bridge and one namespace per replica (hosts[rid]), or None: all on loopback."""
        self.links_down: dict[int, float] = {}
        """Replica -> when its cut link comes back."""
        self.slow_until: dict[int, float] = {}
        """Replica -> when its throttling (a `slow` fault) ends."""
        self.hung_at: dict[int, float] = {}
        """Replica -> when a `hang` fault stopped it (a throttle's SIGCONT must not resume it)."""

    def heal_links(self) -> None:
        now = time.monotonic()
        for rid, at in list(self.links_down.items()):
            if now >= at:
                self.net.restore(self.net.hosts[rid])
                del self.links_down[rid]

    def heal_etcd(self, after_s: float) -> None:
        """Replace a killed etcd member by an empty one once it has been down `after_s`."""
        if self.etcd_down_since is not None and time.monotonic() - self.etcd_down_since >= after_s:
            self.cluster.heal_dead()
            self.etcd_down_since = None

    @property
    def stop_file(self) -> str:
        """train_lm's --stop-file: created to end the job after the fault-free tail. In the run
        directory: beside it, a --keep directory's parent (/tmp) would be shared by every soak."""
        return os.path.join(self.run_dir, "STOP")

    def launch(self, resume: bool = False) -> None:
        a = self.a
        cmd = [sys.executable, "-m", "lightning_ft.launch.cli", "run", "--replicas", str(a.replicas),
               "--nproc-per-replica", "1", "--etcd", self.etcd, "--job", "soak", "--no-status",
               "--max-restarts", "100000",
               "--timeout", str(a.timeout + 120)]  # a backstop: the soak's own deadline reports and kills
        cmd += ["--resume", self.run_dir] if resume else ["--run-dir", self.run_dir]
        cmd += [TRAIN_LM, "--steps", str(a.steps), "--val-every", "1000000", "--batch", "8", "--d", "32",
                "--accumulate", str(a.accumulate),
                "--stop-file", self.stop_file,
                "etcd.lease_ttl_s=1", "etcd.hang_timeout_s=20", "failure.restart_delay_s=0.3",
                "failure.signal_exception=true", "quorum.init_timeout_s=20", "supervisor.start_timeout_s=120",
                "supervisor.exit_timeout_s=20",
                f"checkpoint.every_n_steps={a.ckpt_every}", "checkpoint.keep=3", "secret=soak-secret-0123456789",
                *a.set]
        out = open(os.path.join(self.run_dir, f"launcher.{self.launches}.log"), "w")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if self.net is not None:  # replica rid runs in namespace hosts[rid]
            env["LFT_REPLICA_WRAP"] = f"ip netns exec {self.net.tag}r{{rid}}"
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        self.launches += 1

    @property
    def launcher(self) -> subprocess.Popen:
        """The current launcher process (a whole-job restart replaces it)."""
        assert self.proc is not None, "launch() first"
        return self.proc

    def replica_pids(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        path = os.path.join(self.run_dir, "events.jsonl")
        if os.path.exists(path):
            for line in open(path):
                ev = json.loads(line)
                if ev.get("event") in ("start", "restart") and "pids" in ev:
                    out[ev["replica"]] = ev["pids"]
        return {r: [p for p in ps if alive(p)] for r, ps in out.items()}

    def spare_pids(self) -> list[int]:
        """The live processes of warm spares (`supervisor.standby`; a promoted one is a replica's)."""
        path = os.path.join(self.run_dir, "events.jsonl")
        if not os.path.exists(path):
            return []
        pids = [p for line in open(path) for ev in (json.loads(line),) if ev.get("event") == "spare_start"
                for p in ev["pids"]]
        return [p for p in pids if alive(p)]

    def kill_all(self) -> None:
        """The whole job dies at once: the launcher, every replica process and every spare."""
        pids = [p for ps in self.replica_pids().values() for p in ps] + self.spare_pids()
        if self.proc is not None and self.proc.poll() is None:
            send(-self.proc.pid, signal.SIGKILL)
        for p in pids:
            send(p, signal.SIGCONT)
            send(-p, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(30)

    def replica_states(self) -> dict[int, dict]:
        """Replica -> its newest steps.jsonl row (step, incarnation) and newest launcher event."""
        states: dict[int, dict] = {r["rid"]: {"step": r["step"], "inc": r["inc"]} for r in self._last_rows()}
        path = os.path.join(self.run_dir, "events.jsonl")
        if os.path.exists(path):
            for line in open(path):
                ev = json.loads(line)
                if isinstance(ev.get("replica"), int):
                    states.setdefault(ev["replica"], {})["event"] = \
                        f"{ev['event']} (incarnation {ev.get('incarnation')})"
        return states

    def _last_rows(self) -> list[dict]:
        """Each replica's newest complete steps.jsonl row (a replica without one is left out)."""
        rows = []
        for rid in range(self.a.replicas):
            path = os.path.join(self.run_dir, f"replica_{rid}", "steps.jsonl")
            if not os.path.exists(path):
                continue
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 4096))
                lines = f.read().decode(errors="replace").splitlines()
            for line in reversed(lines):
                try:
                    row = json.loads(line)
                    rows.append({"t": float(row["t"]), "step": row["step"], "rid": rid, "inc": row.get("inc")})
                    break
                except (ValueError, KeyError):
                    continue
        return rows

    def all_back_since(self, t: float) -> bool:
        """Every replica committed a step after wall time `t`."""
        rows = self._last_rows()
        return len(rows) == self.a.replicas and all(r["t"] > t for r in rows)

    def last_commit_t(self) -> float:
        """Wall time of the newest committed step of any replica (0 before the first)."""
        return max((r["t"] for r in self._last_rows()), default=0.0)

    def committed(self) -> int:
        return max((r["step"] for r in self._last_rows()), default=0)


def inject(job: Job, kind: str, rid: int, rng: random.Random, a: argparse.Namespace) -> bool:
    pids = job.replica_pids().get(rid, [])
    if kind != "job" and not pids:
        return False
    if kind == "kill":
        send(rng.choice(pids), signal.SIGKILL)
    elif kind == "exception":
        send(pids[0], signal.SIGUSR1)
    elif kind == "hang":  # stopped until the launcher declares it hung (lease TTL + grace) and kills it
        if job.slow_until.get(rid, 0.0) > time.monotonic():
            return False  # the throttle would resume it
        job.hung_at[rid] = time.monotonic()
        send(pids[0], signal.SIGSTOP)
    elif kind == "slow":
        if job.slow_until.get(rid, 0.0) > time.monotonic() or time.monotonic() - job.hung_at.get(rid, -1e9) < 30:
            return False
        job.slow_until[rid] = time.monotonic() + rng.uniform(5.0, 15.0)
        threading.Thread(target=throttle, args=(lambda: job.replica_pids().get(rid, []),
                                                lambda: job.slow_until.get(rid, 0.0)),
                         name=f"slow-r{rid}", daemon=True).start()
    elif kind == "link":
        if job.net is None or rid in job.links_down:
            return False
        job.net.cut(job.net.hosts[rid])
        job.links_down[rid] = time.monotonic() + rng.uniform(2.0, 6.0)
    elif kind == "job":
        job.kill_all()
        time.sleep(rng.uniform(0.5, 2.0))
        job.launch(resume=True)
    elif kind == "etcd":
        cluster = job.cluster
        i = cluster.leader()
        i = rng.randrange(len(cluster.servers)) if i is None else i
        proc = cluster.servers[i].proc
        if proc is None or proc.poll() is not None:
            return False
        proc.kill()
        job.etcd_down_since = time.monotonic()
    return True


HALT_EXIT_GRACE_S = 60.0
"""A launcher still running this long after the job halted is hung on the halt: the soak kills it."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--faults", type=int, default=100)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--overlap", type=float, default=0.15, help="probability that a fault hits two replicas")
    p.add_argument("--kinds", default="kill,hang,exception,link,job,etcd")
    p.add_argument("--every-s", type=float, default=4.0, help="mean seconds between faults")
    p.add_argument("--steps", type=int, default=0, help="training steps at most (default: enough for the faults)")
    p.add_argument("--tail-steps", type=int, default=300,
                   help="fault-free steps after the last fault, then the job stops (0: train to --steps)")
    p.add_argument("--ckpt-every", type=int, default=25)
    p.add_argument("--accumulate", type=int, default=1,
                   help="train_lm's accumulate_grad_batches (with --set stragglers.policy=shrink: splittable steps)")
    p.add_argument("--hang-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=7200)
    p.add_argument("--keep", default="", help="keep the run directory here")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for the job, after the soak's own (repeatable)")
    p.add_argument("--standby", type=int, default=0,
                   help="N > 0: soak twice with this seed, without spares and then with N warm spares "
                        "(supervisor.standby), and print both ETTs side by side")
    a = p.parse_args(argv)
    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so the finally below kills the job by PID
    # and deletes the namespaces and the etcd cluster instead of leaving them behind.
    signal.signal(signal.SIGTERM, _interrupt)
    if a.standby <= 0:
        return _soak(a)[0]
    rows, rc = {}, 0
    for n in (0, a.standby):  # the same faults at the same moments: only the spares differ
        log(f"soak with supervisor.standby={n}")
        b = argparse.Namespace(**{**vars(a), "set": [*a.set, f"supervisor.standby={n}"],
                                  "keep": f"{a.keep}.standby{n}" if a.keep else ""})
        code, rows[n] = _soak(b)
        rc = rc or code
    print(json.dumps({"bench": "soak_standby", "seed": a.seed, "standby": a.standby,
                      "ett": rows[0].get("ett"), "ett_standby": rows[a.standby].get("ett"),
                      **{f"{k}{sfx}": rows[n].get(k) for n, sfx in ((0, ""), (a.standby, "_standby"))
                         for k in ("lost_batches", "duplicate_batches", "identical", "faults", "wall_s")},
                      "ok": rc == 0}), flush=True)
    return rc


def _soak(a: argparse.Namespace) -> tuple[int, dict]:
    """One soak: its exit code (0: every check held) and its printed line."""
    from lightning_ft.bench import netns
    from lightning_ft.coord.runs import recorded_root
    from lightning_ft.coord.etcd_server import EtcdCluster
    from lightning_ft.coord.etcd_store import EtcdStore
    from lightning_ft.replica.ledger import read_cursors, verify_ledger

    row: dict = {}
    kinds = [k for k in a.kinds.split(",") if k]
    if "link" in kinds and netns.skip_reason():
        log(f"link cuts left out: {netns.skip_reason()}")
        kinds.remove("link")
    rng = random.Random(a.seed)
    planned = plan_kinds(kinds, a.faults, rng)
    tmp = tempfile.mkdtemp(prefix="lft-soak-")
    keep_dir = ""
    run_dir = a.keep or os.path.join(tmp, "run")
    os.makedirs(run_dir, exist_ok=True)
    if not a.steps:  # up to 40 steps a second here (restarts fork from the zygote), a fault every ~7 s:
        # generous, so that every planned fault lands before the fault-free tail (at 8 steps per second
        # of the plan, a 100-fault run stopped at 54); the job trains the rest fault-free
        a.steps = int(a.faults * (a.every_s + 15) * 20 + 1000)
    net = None
    if "link" in kinds:
        net = netns.Net()
        for rid in range(a.replicas):
            net.host(f"r{rid}")
    host = f"{net.subnet}.1" if net is not None else "127.0.0.1"  # the bridge: every namespace reaches it
    srv = EtcdCluster(3, host=host, data_dir=os.path.join(tmp, "etcd")).start()
    job = Job(a, srv, run_dir, net)
    t0 = time.monotonic()
    injected = overlapping = 0
    by_kind: dict[str, int] = {}
    try:
        job.launch()
        while job.committed() < 5 and time.monotonic() - t0 < 300:
            time.sleep(0.2)
        last_fault_t = 0.0
        planned_i = 0

        def ended() -> bool:
            """The job is over: its launcher exited, or the job halted (no fault is injected into it)."""
            return job.launcher.poll() is not None or bool(halt_reason(run_dir))

        while injected < a.faults and not ended():
            # The next fault waits for the job to commit a step after the last one: faults faster
            # than a restart (Lightning starts in 10-30 s here) would only starve the job, and a
            # stall would then say nothing about hangs. Faults still overlap (two at once, or a
            # fault while the last victim restarts); a job that never trains again times out.
            waited = time.monotonic()
            while job.last_commit_t() <= last_fault_t and not ended():
                if time.monotonic() - waited > a.hang_s * 3:
                    log(f"no committed step {a.hang_s * 3:.0f} s after the last fault; injecting anyway")
                    break
                time.sleep(0.5)
                job.heal_etcd(after_s=3.0)
                job.heal_links()
            wait = rng.expovariate(1.0 / a.every_s)
            while wait > 0 and not ended():
                time.sleep(min(wait, 0.5))
                wait -= 0.5
                job.heal_etcd(after_s=3.0)
                job.heal_links()
            if ended():
                break
            if job.committed() >= a.steps - max(50, a.steps // 6):  # a fault-free end: replicas rejoin
                log("training is about to end before the faults are done; stopping early")
                break
            kind = planned[min(planned_i, len(planned) - 1)]  # not by `injected`: an overlapping fault counts 2
            if kind == "etcd" and job.etcd_down_since is not None:
                kind = "kill"  # one etcd member down at a time (a 3-member cluster survives one)
            replica_kinds = [k for k in kinds if k in ("kill", "hang", "exception", "link")] or ["kill"]
            if kind in replica_kinds and rng.random() < a.overlap and a.replicas > 1:
                rids = rng.sample(range(a.replicas), 2)
                done = [inject(job, kind if i == 0 else rng.choice(replica_kinds), rid, rng, a)
                        for i, rid in enumerate(rids)]
                n = sum(done)
                overlapping += 1 if n == 2 else 0
            else:
                n = int(inject(job, kind, rng.randrange(a.replicas), rng, a))
            injected += n
            planned_i += 1 if n else 0
            last_fault_t = time.time()
            by_kind[kind] = by_kind.get(kind, 0) + n
            if n:
                log(f"fault {injected}/{a.faults}: {kind} at job step {job.committed()}")
        stop_at = job.committed() + a.tail_steps if a.tail_steps > 0 else None
        tail_from = time.time()
        log(f"{injected} faults injected ({overlapping} overlapping); waiting for the job to finish"
            + (f" (it stops at step {stop_at} or so)" if stop_at is not None else ""))
        halted_at = None
        while job.launcher.poll() is None and time.monotonic() - t0 < a.timeout:
            # the tail is fault-free steps with every replica back (two replicas hung by the last
            # faults come back after the launcher's hang timeout), or TAIL_WAIT_S at most
            if stop_at is not None and job.committed() >= stop_at and not os.path.exists(job.stop_file) and (
                    job.all_back_since(tail_from) or time.time() - tail_from > TAIL_WAIT_S):
                open(job.stop_file, "w").close()
                log(f"{a.tail_steps} fault-free steps after the last fault: the job stops (step {job.committed()}; "
                    f"every replica back: {job.all_back_since(tail_from)})")
            job.heal_etcd(after_s=3.0)
            job.heal_links()
            if halted_at is None and halt_reason(run_dir):
                halted_at = time.monotonic()
                log(f"the job halted: {halt_reason(run_dir)}; waiting for the launcher to exit")
            if halted_at is not None and time.monotonic() - halted_at > HALT_EXIT_GRACE_S:
                log(f"the launcher still runs {HALT_EXIT_GRACE_S:.0f} s after the halt; killing the job")
                break
            time.sleep(0.5)
        halted = halt_reason(run_dir)
        timed_out = job.launcher.poll() is None and not halted
        if job.launcher.poll() is None:  # say where each replica stood, then end it: the figures below still come out
            if timed_out:
                log(f"the job did not finish within --timeout {a.timeout:.0f} s; last rows: {job.replica_states()}; "
                    f"killing it")
            job.kill_all()
        job.launcher.wait(30)
        wall = time.monotonic() - t0
        store = EtcdStore(srv.endpoint)
        try:
            root = recorded_root(store, "/lft", "soak")  # the job's run (coord/runs.py)
            rep = verify_ledger(store, root, read_cursors(store, root, range(a.replicas)))
        finally:
            store.close()
        finals = []
        for rid in range(a.replicas):
            path = os.path.join(run_dir, f"replica_{rid}", "final.json")
            if os.path.exists(path):
                finals.append(json.load(open(path)))
        # Replicas that trained to the end; one restarted by a late fault may find the job finished
        # (it has nothing to train) and is counted as absent, not compared.
        final_step = finals[0]["step"] if finals else -1
        identical = bool(finals) and len({tuple(f["digest"]) for f in finals}) == 1 and all(
            f["step"] == final_step for f in finals)
        ett = None
        try:
            from lightning_ft.report import report

            ett = report(run_dir).get("ett")
        except Exception as e:  # the soak's figures do not depend on the report
            log(f"report failed: {e}")
        row = {"bench": "soak", "seed": a.seed, "faults": injected, "planned_faults": a.faults,
               "overlapping": overlapping,
               "lost_batches": len(rep.gaps), "duplicate_batches": len(rep.duplicates),
               "conflicts": len(rep.conflicts), "rewinds": len(rep.rewinds), "identical": identical,
               "at_end": len(finals), "final_step": final_step,
               "hangs": hangs(run_dir, a.replicas, a.hang_s), "ett": ett, "steps": rep.steps,
               "superseded": rep.superseded, "heals": heals(run_dir), "by_kind": by_kind,
               "launches": job.launches,
               "launcher_rc": job.launcher.returncode, "timed_out": timed_out,
               "halted": bool(halted), **({"halt_reason": halted} if halted else {}),
               "wall_s": round(wall, 1)}
        print(json.dumps(row), flush=True)
        if injected < a.faults:
            log(f"only {injected} of {a.faults} faults landed before the fault-free tail (raise --steps)")
        ok = (not timed_out and not halted and injected >= a.faults and identical and not rep.gaps
              and not rep.duplicates and job.launcher.returncode == 0
              and rep.steps == final_step > 0  # an empty or wrong keyspace has no gaps either
              and len(finals) > a.replicas // 2)
        if not ok:  # what went wrong is in there (the ledger is in etcd's data): keep it for whoever looks next
            keep_dir = tmp
            log(f"the soak failed; its run directory is kept at {run_dir} (events.jsonl, launcher.*.log, logs/), "
                f"etcd's data at {os.path.join(tmp, 'etcd')}")
        return (0 if ok else 1), row
    finally:
        job.kill_all()
        if net is not None:
            net.close()
        srv.cleanup()
        if not keep_dir:  # with --keep the run directory is elsewhere: tmp holds only etcd's data
            shutil.rmtree(tmp, ignore_errors=True)


def _interrupt(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM must not cut the cleanup short
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
