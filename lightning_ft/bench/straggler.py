"""A straggler among three replicas, under each policy, throttle and step rate (coord/stragglers.py,
quorum rule 14), and a hung one (coord/hang.py).

    python -m lightning_ft.bench.straggler [--policies wait exclude shrink adaptive] [--throttles stop compute]
                                           [--rates 10 30 100] [--throttle-s 20] [--no-hang]

One job per rate, throttle and policy: 3 replicas of examples/plain_loop.py (real processes,
embedded etcd), each step 4 micro-batches (`--micro`: a straggler can be shrunk) whose "compute"
sleeps so that the job runs at about `--rates` steps a second (0: no sleep, the fastest this
machine reaches). After a steady stretch, replica 1 is throttled to about a third of its speed
for --throttle-s seconds, then released:
- `stop`: SIGSTOP 0.2 s, SIGCONT 0.1 s (the outside test of issue 42): the whole process stops,
  its exchange and its catch-up server too;
- `compute`: its compute takes 3x (`--slow-file`): a throttled accelerator, whose network still
  runs at full speed.
Replica 0's committed step rate is measured before the throttle and during it: `during` from the
policy's answer (the first step without replica 1, or in which it is shrunk; "wait": a second
into the throttle) to the release, `whole` from the throttle's start (detection included).
`batches` counts slot batches committed a second (an excluded replica's slot waits; a shrunk
one's is trained by the others). Once replica 1 trains again (`readmitted_s`: from the release
to its first step training), the job stops at an agreed step (`--stop-file`). Prints one line
per job:

    {"bench": "straggler", "policy": "exclude", "throttle": "stop", "rate": 100, "before_steps_s": ...,
     "during_steps_s": ..., "ratio": during / before, "whole_ratio": ..., "batch_ratio": ...,
     "detect_s": ..., "benched": 1, "readmitted_while_slow": 0, "readmitted_s": ...,
     "identical": true, "exactly_once": true, ...}

"shrink" and "adaptive" add `kept` (the micro-batches replica 1 kept of 4) and `whole_again_s`
(from the release to its first step training its whole slot batch again).

Then the hang figure: 3 replicas of the plain loop under the real Supervisor; replica 1's leader
SIGSTOPs itself a few ms into step 30's exchange (inside its FTAR all-reduce; `--stop-in-exchange`).
The time from the stop to the supervisor's `hang` diagnosis event (target: <= TTL + 2 s), and
whether it named the right replica, rank and state, a link to or from it in the right direction,
and a stack of the stopped process:

    {"bench": "hang", "ttl_s": 2.0, "detect_s": ..., "within_target": true, "culprit_ok": true,
     "link_ok": true, "stack_ok": true, "links": [...], "reason": "..."}
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Optional

from lightning_ft.bench.localjob import LOOP, Job
from lightning_ft.coord.etcd_server import EtcdServer
from lightning_ft.coord.stragglers import POLICIES

MODEL = ("--dim", "16", "--hidden", "32", "--batch", "8", "--ttl", "1", "--ftar-timeout", "5", "--init-timeout", "30",
         "--digest-every", "10")
"""The plain loop's model; digests every 10 steps, as `consistency.every_n_steps` by default (a
full round at each: between them, steady rounds without etcd)."""


def throttle(job: Job, rid: int, seconds: float, stop_s: float = 0.2, run_s: float = 0.1,
             release: Optional[threading.Event] = None) -> threading.Thread:
    """SIGSTOP/SIGCONT replica `rid` in a cycle for `seconds`, or until `release` is set, from a
    thread (ends with SIGCONT)."""
    def go() -> None:
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end and not (release is not None and release.is_set()):
                job.replicas[rid].signal(signal.SIGSTOP)
                time.sleep(stop_s)
                job.replicas[rid].signal(signal.SIGCONT)
                time.sleep(run_s)
        finally:
            job.replicas[rid].signal(signal.SIGCONT)

    t = threading.Thread(target=go, name="throttle", daemon=True)
    t.start()
    return t


def rate(rows: list[dict], t0: float, t1: float) -> float:
    """Committed steps per second of a replica in [t0, t1]."""
    n = sum(1 for r in rows if r.get("event") == "step" and t0 <= r["t"] <= t1)
    return n / max(1e-9, t1 - t0)


def batch_rate(rows: list[dict], t0: float, t1: float) -> float:
    """Slot batches the job committed per second in [t0, t1], from one replica's rows (each step
    commits one batch per contributor)."""
    n = sum(len(r["contributors"]) for r in rows if r.get("event") == "step" and t0 <= r["t"] <= t1)
    return n / max(1e-9, t1 - t0)


def read_events(run_dir: str, name: str) -> list[dict]:
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [e for e in (json.loads(line) for line in f if line.strip()) if e.get("event") == name]


def identical(job: Job) -> bool:
    """Every digested step's digest agrees across the replicas that printed one, and so do
    their final states."""
    by_step: dict[int, set[str]] = {}
    for r in job.history:
        for row in r.steps():
            if "digest" in row:
                by_step.setdefault(row["step"], set()).add(row["digest"])
    finals = job.finals()
    return bool(by_step) and all(len(d) == 1 for d in by_step.values()) and len(
        {tuple(d) for d in finals.values()}) == 1


THROTTLES = {"stop": "SIGSTOP 0.2 s / SIGCONT 0.1 s", "compute": "compute slower (--slow-file, --factor)"}


def slow_compute(path: str, seconds: float, factor: float = 3.0,
                 release: Optional[threading.Event] = None) -> threading.Thread:
    """Make the replica whose --slow-file is `path` compute `factor` times slower for `seconds`
    (or until `release` is set), from a thread."""
    with open(path, "w") as f:
        f.write(str(factor))

    def go() -> None:
        try:
            if release is not None:
                release.wait(seconds)
            else:
                time.sleep(seconds)
        finally:
            os.unlink(path)

    t = threading.Thread(target=go, name="slow-compute", daemon=True)
    t.start()
    return t


SLEEP_S = {10: 0.09, 30: 0.025, 100: 0.004}
"""--step-sleep for a target rate on this 2-core machine (steps of the tiny model take about 5-10 ms
of Python and FTAR; at "100" a little sleep stays for the compute throttle to multiply); other
rates: 1/rate, less 10 ms."""


def step_sleep(rate_s: float) -> float:
    if rate_s <= 0:
        return 0.0
    return SLEEP_S.get(int(rate_s), max(0.0, 1.0 / rate_s - 0.01))


def run_policy(etcd: str, policy: str, a: argparse.Namespace, how: str = "stop", rate_s: float = 30) -> dict:
    from lightning_ft.replica.ledger import read_cursors, verify_ledger

    with tempfile.TemporaryDirectory(prefix="lft-straggler-") as tmp:
        if a.keep:  # the run directory (logs, events) stays there
            tmp = os.path.join(a.keep, f"{policy}-{how}-{rate_s:g}")
            os.makedirs(tmp, exist_ok=True)
        slow = os.path.join(tmp, "slow.{rid}")
        stop = os.path.join(tmp, "STOP")
        job = Job(etcd, tmp, args=MODEL + ("--steps", "1000000", "--step-sleep", str(step_sleep(rate_s)),
                                           "--micro", str(a.micro), "--slow-file", slow, "--stop-file", stop,
                                           "--set", f"stragglers.policy={policy}"),
                  env={(r, 0): {"LFT_RUN_DIR": tmp} for r in range(3)})
        release = threading.Event()
        try:
            job.start_all()
            r0, r1 = job.replicas[0], job.replicas[1]
            r0.wait_for(lambda x: x.get("event") == "step" and x["step"] >= 30, a.timeout)
            t0 = time.time()
            time.sleep(a.before_s)
            t_throttle = time.time()
            before, before_b = rate(r0.rows, t0, t_throttle), batch_rate(r0.rows, t0, t_throttle)
            th = throttle(job, 1, a.throttle_s, release=release) if how == "stop" else \
                slow_compute(slow.replace("{rid}", "1"), a.throttle_s, factor=a.factor, release=release)
            first: Optional[dict] = None
            if policy != "wait":
                # benched, or shrunk (a replica that cannot split its batch is benched)
                try:
                    first = r0.wait_for(lambda x: x.get("event") == "step" and x["t"] > t_throttle and (
                        bool(x.get("shrunk")) or 1 not in x["members"]), a.throttle_s)
                except AssertionError:
                    first = None  # never acted on within the throttle: `during` is the whole throttle
            th.join(a.throttle_s + 30)
            t_release = time.time()
            start = first["t"] if first is not None else t_throttle + 1.0
            during, during_b = rate(r0.rows, start, t_release), batch_rate(r0.rows, start, t_release)
            whole = rate(r0.rows, t_throttle, t_release)
            back = r1.wait_for(lambda x: x.get("event") == "step" and x["t"] > t_release
                               and x["role"] == "train", a.timeout)
            whole_again = r1.wait_for(lambda x: x.get("event") == "step" and x["t"] > t_release and x["role"] == "train"
                                      and not x.get("skip"), a.timeout) if policy in ("shrink", "adaptive") else None
            open(stop, "w").close()  # the job stops at a step every replica agrees on
            job.wait_done(a.timeout)
            cursors = read_cursors(job.store, job.root, range(job.R))
            ledger = verify_ledger(job.store, job.root, cursors)
            ev = read_events(tmp, "straggler")
            back_ev = read_events(tmp, "readmitted")
            kept = sorted({a.micro - len(x["skip"]) for x in r1.rows if x.get("event") == "step" and x.get("skip")})
            healthy = [e for e in ev if e["replica"] != 1 and e.get("benched")]
            out = {"bench": "straggler", "policy": policy, "replicas": 3, "throttle": how, "rate": rate_s,
                   "throttled": THROTTLES[how], "micro": a.micro, "throttle_s": a.throttle_s,
                   "step_sleep": step_sleep(rate_s), "before_steps_s": round(before, 2),
                   "during_steps_s": round(during, 2), "ratio": round(during / before, 3) if before else None,
                   "whole_ratio": round(whole / before, 3) if before else None,
                   "batch_ratio": round(during_b / before_b, 3) if before_b else None,
                   "detect_s": round(first["t"] - t_throttle, 3) if first is not None else None,
                   "benched": sum(1 for e in ev if e["replica"] == 1 and e.get("benched")
                                  and t_throttle - 1 <= e["t"] <= t_release),
                   "readmitted_while_slow": sum(1 for e in back_ev if e["replica"] == 1
                                                and t_throttle <= e["t"] < t_release),
                   "healthy_benched": len(healthy), "straggler_events": len(ev),
                   "first_ratio": ev[0]["ratio"] if ev else None,
                   "readmitted_s": round(back["t"] - t_release, 3), "identical": identical(job),
                   "exactly_once": ledger.ok, "steps": max(x["step"] for x in r0.rows if x.get("event") == "step"),
                   "loadavg": round(os.getloadavg()[0], 2)}
            if policy in ("shrink", "adaptive"):
                out.update(kept=kept, excluded=bool(first is not None and not first.get("shrunk")),
                           whole_again_s=round(whole_again["t"] - t_release, 3) if whole_again is not None else None)
            return out
        finally:
            release.set()
            for r in job.replicas.values():
                r.signal(signal.SIGCONT)
            job.close()


def _rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def stop_in_exchange(etcd: str, run_dir: str, ttl_s: float = 2.0, report_after_s: float = 0.5,
                     timeout_s: float = 120.0, step: int = 30) -> dict:
    """Run 3 replicas under the Supervisor, stop replica 1's leader inside step `step`'s exchange,
    and wait for the hang diagnosis. Returns the figure (and `event`, `stopping`: the raw rows)."""
    import uuid

    from lightning_ft.launch.supervisor import Supervisor
    from lightning_ft.launch.supervisor_settings import Placement, SupervisorSettings

    cmd = [sys.executable, LOOP, "--dim", "16", "--hidden", "32", "--batch", "8", "--steps", "3000",
           "--step-sleep", "0.02", "--ttl", str(ttl_s), "--ftar-timeout", "5", "--init-timeout", "30",
           "--stop-in-exchange", f"1@{step}", "--set", f"hang.report_after_s={report_after_s}"]
    sup = Supervisor(cmd, Placement("hang" + uuid.uuid4().hex[:8], replicas=3, nproc_per_replica=1, etcd=etcd,
                                    secret="hang-bench-secret-0123456789", run_dir=run_dir),
                     SupervisorSettings(restart_delay_s=0.5, max_restarts=2))
    events = os.path.join(run_dir, "events.jsonl")
    log1 = os.path.join(run_dir, "logs", "r1.i0.rank0.log")

    def diagnosed() -> list[dict]:
        return [e for e in _rows(events) if e.get("event") == "hang" and e.get("diagnosis")]

    stopping: list[dict] = []
    try:
        sup.start()
        sup.run(until=lambda: bool(diagnosed()), timeout_s=timeout_s)
        stopping = [r for r in _rows(log1) if r.get("event") == "stopping"]
        ev = diagnosed()
    finally:
        for r in stopping:
            try:
                os.kill(r["pid"], signal.SIGCONT)
            except ProcessLookupError:
                pass
        sup.shutdown()
    out: dict = {"bench": "hang", "ttl_s": ttl_s, "report_after_s": report_after_s, "stopped": bool(stopping),
                 "diagnosed": bool(ev), "loadavg": os.getloadavg()[0], "event": ev[0] if ev else None,
                 "stopping": stopping[0] if stopping else None}
    if not (ev and stopping):
        return out
    d, st = ev[0], stopping[0]
    mine = [k for k in d["links"] if 1 in (k["from"], k["to"])]
    out.update(detect_s=round(d["t"] - st["t"], 3),
               within_target=d["t"] - st["t"] <= ttl_s + 2.0,
               culprit_ok=(d["replica"], d["rank"], d["incarnation"], d["state"]) == (1, 0, 0, "T"),
               link_ok=bool(mine) and all(
                   (k["direction"] == "rx" and k["from"] == 1 and k["to"] == k["seen_by"])
                   or (k["direction"] == "tx" and k["to"] == 1 and k["from"] == k["seen_by"]) for k in mine),
               stack_ok=f"Process {st['pid']}" in d["stack"] and "plain_loop.py" in d["stack"],
               links=d["links"], reason=d["reason"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lightning_ft.bench.straggler", description=__doc__.split("\n")[0])
    p.add_argument("--policies", nargs="*", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--throttles", nargs="*", default=["stop", "compute"], choices=list(THROTTLES))
    p.add_argument("--micro", type=int, default=4, help="micro-batches per step (a straggler can be shrunk)")
    p.add_argument("--no-hang", action="store_true", help="skip the hang figure")
    p.add_argument("--ttl", type=float, default=2.0, help="the hang figure's lease TTL (target: TTL + 2 s)")
    p.add_argument("--rates", nargs="*", type=float, default=[10, 30, 100],
                   help="steps a second to run the job at (by --step-sleep; 0: no sleep, the fastest here)")
    p.add_argument("--factor", type=float, default=3.0, help="the compute throttle: compute this many times slower")
    p.add_argument("--before-s", type=float, default=3.0)
    p.add_argument("--throttle-s", type=float, default=20.0, help="40: as long as the outside test of issue 42")
    p.add_argument("--timeout", type=float, default=240.0)
    p.add_argument("--keep", default="", help="keep each job's run directory (logs, events) under this folder")
    a = p.parse_args(argv)
    with EtcdServer() as etcd:
        for rate_s in a.rates:
            for how in a.throttles:
                for policy in a.policies:
                    print(json.dumps(run_policy(etcd.endpoint, policy, a, how, rate_s)), flush=True)
        if not a.no_hang:
            with tempfile.TemporaryDirectory(prefix="lft-hang-") as tmp:
                fig = stop_in_exchange(etcd.endpoint, tmp, ttl_s=a.ttl, timeout_s=a.timeout)
            fig.pop("event", None), fig.pop("stopping", None)
            print(json.dumps(fig), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
