"""A whole job in one process, on one thread and a virtual clock (docs/ARCHITECTURE.md, "The
simulator"): R replicas run the project's coordinator, round client, ledger and step core
(sim/replica.py) against a simulated etcd (sim/etcd.py) and network (sim/net.py), under a seeded
fault schedule (sim/faults.py), with a supervisor that restarts what fails, and the protocol's
promises checked as it runs and at its end:

- every batch trained exactly once (the ledger: `verify_ledger`);
- every replica whose commit of a step the ledger accepted holds the same state after it, and a
  committed step's gradients are exactly the round's batches;
- a rewind never goes past the newest checkpoint;
- once the faults stop, the job finishes within `liveness_s`;
- the job's end is agreed: every replica ends at the same step with the same state.

    python -m lightning_ft.sim.job --seed 17                 # one schedule, its verdict and trace
    python -m lightning_ft.sim.job --seeds 0:1000 --jobs 2   # a slice of seeds, in 2 processes

A violation prints its seed and a shrunk schedule, with the command that replays it.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from lightning_ft.coord import keys
from lightning_ft.coord.membership import JobFinished, JobHalted
from lightning_ft.coord.round_records import JobSpec, Quorum
from lightning_ft.replica import ledger
from lightning_ft.replica.checkpoint import publish as publish_checkpoint
from lightning_ft.replica.plan import StepPlan
from lightning_ft.replica.settings import Settings
from lightning_ft.sim.etcd import SimStore
from lightning_ft.sim.faults import Fault, schedule, shrink
from lightning_ft.sim.net import ModelState, Net
from lightning_ft.sim.replica import JOB, SimReplica
from lightning_ft.sim.world import Livelock, Proc, World


@dataclass(frozen=True)
class SimConfig:
    """A simulated job and its timing (virtual seconds)."""

    replicas: int = 3
    steps: int = 200
    step_s: float = 0.05
    ttl_s: float = 1.0
    hang_timeout_s: float = 3.0
    ftar_timeout_s: float = 1.0
    poll_s: float = 0.05
    init_timeout_s: float = 2.0
    sync_timeout_s: float = 5.0
    etcd_connect_s: float = 10.0
    restart_s: float = 0.5
    spare_restart_s: float = 0.05
    hang_grace_s: float = 1.0
    linger_s: float = 3.0
    ckpt_every: int = 50
    ckpt_s: float = 0.2
    digest_every: int = 25
    min_replicas: int = 1
    micro: int = 1
    batch_policy: str = "shrink"
    straggler_policy: str = "exclude"
    faults: int = 10
    liveness_s: float = 120.0
    """After the last fault, the job must finish within this many virtual seconds."""


@dataclass
class Verdict:
    seed: int
    ok: bool
    violations: list[str] = field(default_factory=list)
    trace: str = ""
    end_t: float = 0.0
    steps: int = 0
    events: int = 0
    restarts: int = 0
    faults: tuple[Fault, ...] = ()

    def line(self) -> str:
        return json.dumps({"seed": self.seed, "ok": self.ok, "violations": self.violations[:3], "trace": self.trace,
                           "end_t": round(self.end_t, 3), "steps": self.steps, "events": self.events,
                           "restarts": self.restarts, "faults": [str(f) for f in self.faults]})


class SimJob:
    """One simulated job under one fault schedule."""

    def __init__(self, seed: int, cfg: SimConfig = SimConfig(), faults: Optional[tuple[Fault, ...]] = None,
                 trace: bool = False) -> None:
        self.seed, self.cfg = seed, cfg
        self.world = World(seed, trace=trace)
        self.store = SimStore(self.world)
        self.net = Net(self.world)
        span = cfg.steps * cfg.step_s * 1.2
        self.faults = schedule(seed, cfg.replicas, span, cfg.faults) if faults is None else faults
        fp = {"job": JOB, "replicas": cfg.replicas, "secret_tag": "s"}
        self.spec = JobSpec(cfg.replicas, cfg.min_replicas, cfg.init_timeout_s, fp, batch_policy=cfg.batch_policy,
                            straggler_threshold=3.0 if cfg.straggler_policy != "wait" else 0.0,
                            straggler_policy=cfg.straggler_policy, straggler_window=10)
        self.settings = Settings(min_replicas=cfg.min_replicas, lease_ttl_s=cfg.ttl_s,
                                 hang_timeout_s=cfg.hang_timeout_s, init_timeout_s=cfg.init_timeout_s,
                                 poll_interval_s=cfg.poll_s,
                                 quorum_timeout_s=None, batch_policy=cfg.batch_policy, digest_every=cfg.digest_every,
                                 checkpoint_every=cfg.ckpt_every)
        self.root = keys.root(self.settings.prefix, JOB, "")
        self.replicas: dict[int, SimReplica] = {}
        self.procs: dict[int, tuple[Proc, Proc]] = {}
        self.incarnations = {r: 0 for r in range(cfg.replicas)}
        self.checkpoints: dict[int, tuple[ModelState, dict[int, int]]] = {}
        self.published: dict[int, int] = {}
        """Checkpoint step -> the generation that published it."""
        self.violations: list[str] = []
        self.refused: list[str] = []
        """Why each intruder's process ended (ConfigMismatch: refused before it registered)."""
        self.decisions: list[tuple[float, str, dict]] = []
        """(when, name, fields) of every decision event (a scenario reads what the job decided)."""
        self.digests: dict[tuple[int, int], tuple[int, int]] = {}
        """(gen, step) -> (a replica whose commit the ledger accepted, the state digest after it)."""
        self.slow: dict[int, tuple[float, float]] = {}
        self.isolated: dict[int, float] = {}
        """rid -> until when its host is cut off (FTAR and etcd: its lease lapses meanwhile)."""
        self.veto: set[int] = set()
        self.split_at_end = False
        """A replica found the final states differing with no strict majority (catchup/ending.py)."""
        self.spare = False
        self.finals: dict[int, ModelState] = {}
        self.restarts = 0
        self.halted = ""
        self.corrupted = 0
        """Corruption faults injected: a halt for no majority is then the promised outcome."""
        self.resuming = False
        self.launches = 0
        self.last_fault_t = max((f.t + f.seconds for f in self.faults), default=0.0)

    # -- what the replicas tell the job --------------------------------------------------------------
    def note(self, r: SimReplica, what: str) -> None:
        self.world.note(f"r{r.rid}.{r.inc} {what}")

    def decided(self, name: str, **fields: Any) -> None:
        """The coordinator's decision events (rewind, diverged, halt, straggler, excluded, stale)."""
        self.world.note(f"decided {name} {sorted(fields.items())}")
        self.decisions.append((self.world.now, name, fields))
        if name == "halt":
            self.halted = str(fields.get("reason", ""))

    def accepted(self, r: SimReplica, commits: list[tuple[int, int]]) -> None:
        """The ledger accepted `commits` ((gen, step)) of replica r: its states must agree with the
        other accepted ones at those steps."""
        for gs in commits:
            got = r.own.get(gs)
            if got is None:
                continue
            seen = self.digests.setdefault(gs, (r.rid, got))
            if seen[1] != got:
                self.violations.append(f"t={self.world.now:.3f}: replicas {seen[0]} and {r.rid} both recorded a "
                                       f"commit of generation {gs[0]} step {gs[1]} with different states")

    def check_source(self, r: SimReplica, q: Quorum) -> None:
        """The source of a sync round serves the state it claims: the step it reported."""
        if r.model.step != q.max_step:
            self.violations.append(f"t={self.world.now:.3f}: replica {r.rid} is the source of step {q.max_step} "
                                   f"(round {q.round}) but holds a state at step {r.model.step}")

    def check_step(self, r: SimReplica, plan: StepPlan, trained: tuple) -> None:
        """A commit applies exactly the round's batches, on the state of the step it commits."""
        if r.model.step != plan.step:
            self.violations.append(f"t={self.world.now:.3f}: replica {r.rid} applied step {plan.step} on a state at "
                                   f"step {r.model.step} ({plan.role})")
        if plan.batches and not plan.cont:
            want = sorted((s, k, j) for s, k in plan.batches.items() for j in range(self.cfg.micro))
            if sorted(trained) != want:
                self.violations.append(f"t={self.world.now:.3f}: replica {r.rid} step {plan.step}: trained {trained} "
                                       f"but the round's batches are {dict(plan.batches)}")

    def rewound(self, r: SimReplica, q: Quorum, to: int) -> None:
        newest = max((s for s in self.checkpoints if s <= int(str((q.rewind or {}).get("from", to)))), default=-1)
        self.world.note(f"rewind to {to} (newest checkpoint {newest})")
        if to < newest:
            self.violations.append(f"t={self.world.now:.3f}: rewind to step {to}, past the newest checkpoint {newest}")
        # The job trained at least to each checkpoint its generation published once the ledger
        # accepted the commit before it: a rewind must not go back past it (every replica down
        # at once between two full rounds: the rewind's history must see the checkpoint).
        reached = max((s for s, g in self.published.items() if g == q.gen - 1 and s in self.checkpoints
                       and (g, s - 1) in self.digests), default=-1)
        if to < reached:
            self.violations.append(f"t={self.world.now:.3f}: rewind to step {to}, past checkpoint {reached} that "
                                   f"generation {q.gen - 1} published after recording its steps")

    def vetoes(self, r: SimReplica, plan: StepPlan) -> bool:
        if r.rid in self.veto:
            self.veto.discard(r.rid)
            return True
        return False

    def slowness(self, rid: int) -> float:
        factor, until = self.slow.get(rid, (1.0, -1.0))
        return factor if until > self.world.now else 1.0

    def save_checkpoint(self, step: int, gen: int, model: ModelState, cursors: dict[int, int]) -> None:
        def done() -> None:
            if self.store.down_until > self.world.now:
                return
            self.checkpoints[step] = (model, cursors)
            self.published[step] = gen
            publish_checkpoint(self.store, self.root, step, f"sim/ckpt/{step}", gen)
        self.world.after(self.cfg.ckpt_s, done)

    def finished_record(self) -> Optional[dict]:
        from lightning_ft.replica.catchup.ending import read_finished

        return read_finished(self.store, self.root) if self.store.down_until <= self.world.now else None

    def finished(self, r: SimReplica) -> None:
        self.finals[r.rid] = r.model
        self.note(r, f"finished at step {r.state.step}")

    # -- the supervisor ------------------------------------------------------------------------------
    def start(self, rid: int, model: Optional[ModelState] = None, delay: float = 0.0) -> None:
        inc = self.incarnations[rid]
        r = SimReplica(self, rid, inc, model or ModelState())
        self.replicas[rid] = r
        main = self.world.spawn(f"r{rid}.{inc}", r.body(), delay)
        keep = self.world.spawn(f"r{rid}.{inc}.keepalive", r.keepalive(), delay)
        main.on_exit = lambda p, r=r: self._exited(r, p)
        self.procs[rid] = (main, keep)
        self.net.alive[(rid, inc)] = True

    def _exited(self, r: SimReplica, p: Proc) -> None:
        main, keep = self.procs.get(r.rid, (None, None))
        if main is not p:
            return
        self.world.kill(keep)  # type: ignore[arg-type]
        self.net.died(r.rid, r.inc)
        if isinstance(p.error, JobHalted):
            self.halted = self.halted or str(p.error)
        if r.done or isinstance(p.error, (JobFinished, JobHalted)) or (p.error is None and r.coord is None):
            return
        if p.error is None and self.finished_record() is not None:
            return  # left a finished job (its start found it finished)
        self.note(r, f"exited: {type(p.error).__name__ if p.error else 'exit 0'}: {str(p.error)[:120]}")
        self._restart(r, f"exited: {type(p.error).__name__ if p.error else 0}")

    def kill(self, rid: int) -> None:
        main, keep = self.procs.get(rid, (None, None))
        if main is None or not main.alive:
            return
        r = self.replicas[rid]
        self.note(r, "SIGKILL")
        self.world.kill(keep)  # type: ignore[arg-type]
        main.on_exit = None
        self.world.kill(main)
        self.net.died(rid, r.inc)
        if r.coord is not None:
            r.coord.membership.close(revoke=False) if self.store.down_until <= self.world.now else None
        self._restart(r, "killed")

    def _restart(self, r: SimReplica, why: str) -> None:
        def evict_and_restart() -> None:
            if self.store.down_until > self.world.now:
                self.world.at(self.store.down_until, evict_and_restart)
                return
            self.store.put(keys.evict(self.root, r.rid, r.inc), why.encode())
            if self.halted or self.finished_record() is not None or self.resuming:
                return
            self.incarnations[r.rid] = r.inc + 1
            self.restarts += 1
            delay = self.cfg.spare_restart_s if self.spare else self.cfg.restart_s
            self.spare = False
            self.start(r.rid, delay=delay)
        self.world.after(0.01, evict_and_restart)

    def hang(self, rid: int, seconds: float) -> None:
        main, keep = self.procs.get(rid, (None, None))
        if main is None or not main.alive:
            return
        r = self.replicas[rid]
        self.note(r, f"SIGSTOP for {seconds:.2f}s")
        self.world.stop(main)
        self.world.stop(keep)  # type: ignore[arg-type]
        # the supervisor kills a replica whose lease lapsed and that stays silent past its grace
        if seconds > self.cfg.ttl_s + self.cfg.hang_grace_s:
            self.world.after(self.cfg.ttl_s + self.cfg.hang_grace_s, self._hung_kill, rid, main)
        self.world.after(seconds, self._cont, main, keep)

    def _hung_kill(self, rid: int, main: Proc) -> None:
        if self.procs.get(rid, (None,))[0] is main and main.alive and main.stopped:
            self.kill(rid)

    def _cont(self, main: Proc, keep: Proc) -> None:
        self.world.cont(main)
        self.world.cont(keep)

    def resume(self) -> None:
        """The whole job is killed, then `lightning-ft run --resume` starts it again: every replica
        from the newest checkpoint (etcd keeps the ledger)."""
        self.world.note("whole-job kill")
        self.resuming = True
        self.launches += 1
        launch = self.launches  # a later whole-job kill cancels this one's start
        for rid in list(self.procs):
            self.kill(rid)

        def again() -> None:
            if launch != self.launches:
                return
            self.resuming = False
            newest = max(self.checkpoints, default=-1)
            model = self.checkpoints[newest][0] if newest >= 0 else ModelState()
            self.world.note(f"resume from checkpoint {newest}")
            for rid in range(self.cfg.replicas):
                self.incarnations[rid] += 1
                self.start(rid, model, delay=self.world.rng.uniform(0, 0.3))
        self.world.after(self.cfg.restart_s * 2, again)

    def intruder(self, rid: int) -> None:
        """A process with another secret (another fingerprint) tries to join the running job as
        replica `rid`. It comes once the job exists (a replica registered its config): the first
        process to register defines the job, so one that comes before every replica of the job
        starts a job of its own, and the job's replicas are the ones refused (seed 1484)."""
        if self.store.down_until > self.world.now or self.store.get(keys.config(self.root)) is None:
            self.world.after(0.1, self.intruder, rid)
            return
        r = SimReplica(self, rid, 97, ModelState(), fingerprint={**self.spec.fingerprint, "secret_tag": "other"})
        p = self.world.spawn(f"intruder{rid}", r.body())
        def refused(p: Proc) -> None:
            self.refused.append(type(p.error).__name__)
            self.world.note(f"intruder refused: {type(p.error).__name__}")
        p.on_exit = refused

    # -- faults --------------------------------------------------------------------------------------
    def _fault(self, f: Fault) -> None:
        self.world.note(f"fault {f}")
        if f.kind == "kill":
            for rid in (f.rid, *f.several):
                self.kill(rid)
        elif f.kind == "hang":
            self.hang(f.rid, f.seconds)
        elif f.kind == "slow":
            self.slow[f.rid] = (f.factor, self.world.now + f.seconds)
        elif f.kind == "cut":
            self.net.cut[f.rid] = self.world.now + f.seconds
        elif f.kind == "isolate":
            self.net.cut[f.rid] = self.isolated[f.rid] = self.world.now + f.seconds
        elif f.kind in ("etcd_loss", "outage"):
            self.store.outage(f.seconds)
        elif f.kind == "resume":
            self.resume()
        elif f.kind == "corrupt":
            r = self.replicas.get(f.rid)
            if r is not None and self.procs[f.rid][0].alive:
                r.model = replace(r.model, digest=r.model.digest ^ 0x5A5A, tainted=True)
                self.corrupted += 1
        elif f.kind == "veto":
            self.veto.add(f.rid)
        elif f.kind == "intruder":
            self.intruder(f.rid)
        elif f.kind == "spare":
            self.spare = True

    # -- the run -------------------------------------------------------------------------------------
    def run(self) -> Verdict:
        cfg = self.cfg
        late = {f.rid: f.seconds for f in self.faults if f.kind == "late"}
        for rid in range(cfg.replicas):
            self.start(rid, delay=late.get(rid, 0.0))
        for f in self.faults:
            if f.kind != "late":
                self.world.at(f.t, self._fault, f)
        deadline = self.last_fault_t + cfg.liveness_s + cfg.steps * cfg.step_s * 3
        try:
            self.world.run(deadline, stop=self._over)
        except Livelock as e:
            self.violations.append(f"liveness: {e}")
        self._check_end(deadline)
        return Verdict(self.seed, not self.violations, self.violations, self.world.trace, self.world.now,
                       max((m.step for m in self.finals.values()), default=0), self.world.events, self.restarts,
                       self.faults)

    def _over(self) -> bool:
        if self.violations:
            return True
        if self.halted:
            return not any(main.alive for main, _ in self.procs.values())
        live = [rid for rid, (main, _) in self.procs.items() if main.alive]
        return not live and (self.finished_record() is not None)

    def _check_end(self, deadline: float) -> None:
        v = self.violations
        if self.halted:
            if not (self.corrupted and "no majority" in self.halted):
                v.append(f"the job halted: {self.halted}")
            return
        if v:
            return
        if self.finished_record() is None or any(main.alive for main, _ in self.procs.values()):
            v.append(f"liveness: the job did not finish within {deadline - self.last_fault_t:.0f} s of the last "
                     f"fault (t={self.world.now:.1f})")
            return
        ends = {rid: (m.step, m.digest) for rid, m in self.finals.items()}
        if len(set(ends.values())) != 1 and not (self.corrupted and self.split_at_end):
            # (a replica killed after the end, or hung past it, ends with none; a corrupted state
            # that no strict majority outvotes at the end is reported, as a halt is mid-job)
            v.append(f"the end is not agreed: replicas ended at {ends}")
        elif next(iter(ends.values()))[0] != self.cfg.steps:
            v.append(f"the job ended at step {next(iter(ends.values()))[0]}, not {self.cfg.steps}")
        report = ledger.verify_ledger(self.store, self.root)
        if not report.ok:
            v.append(f"exactly once: duplicates {report.duplicates[:5]}, gaps {report.gaps[:5]}, "
                     f"conflicts {report.conflicts[:3]}")


def run_seed(seed: int, cfg: SimConfig = SimConfig(), faults: Optional[tuple[Fault, ...]] = None,
             trace: bool = False) -> Verdict:
    logging.disable(logging.CRITICAL)  # the protocol's warnings are its business, not the verdict's
    return SimJob(seed, cfg, faults, trace).run()


def _fails(seed: int, cfg: SimConfig, faults: tuple[Fault, ...]) -> bool:
    return not run_seed(seed, cfg, faults).ok


def _worker(args: tuple[int, int, SimConfig]) -> list[str]:
    lo, hi, cfg = args
    return [run_seed(s, cfg).line() for s in range(lo, hi)]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, help="one schedule: print its verdict (and its trace with --trace)")
    p.add_argument("--seeds", default="0:100", help="LO:HI, the slice of seeds to run")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--trace", action="store_true")
    p.add_argument("--faults", type=int, default=SimConfig.faults)
    p.add_argument("--steps", type=int, default=SimConfig.steps)
    p.add_argument("--replicas", type=int, default=SimConfig.replicas)
    p.add_argument("--micro", type=int, default=SimConfig.micro)
    p.add_argument("--batch-policy", default=SimConfig.batch_policy, choices=["shrink", "constant"])
    p.add_argument("--stragglers", default=SimConfig.straggler_policy, choices=["wait", "exclude", "shrink"])
    p.add_argument("--only", default="", help="keep only these faults of the schedule (indices, comma-separated)")
    a = p.parse_args(argv)
    cfg = replace(SimConfig(), faults=a.faults, steps=a.steps, replicas=a.replicas, micro=a.micro,
                  batch_policy=a.batch_policy, straggler_policy=a.stragglers)
    if a.seed is not None:
        faults = schedule(a.seed, cfg.replicas, cfg.steps * cfg.step_s * 1.2, cfg.faults)
        if a.only:
            faults = tuple(faults[int(i)] for i in a.only.split(","))
        v = run_seed(a.seed, cfg, faults, trace=a.trace)
        if a.trace:
            job = SimJob(a.seed, cfg, faults, trace=True)
            job.run()
            print("\n".join(job.world.lines or []))
        print(v.line())
        return 0 if v.ok else 1
    lo, hi = (int(x) for x in a.seeds.split(":"))
    t0 = time.perf_counter()
    chunks = [(s, min(s + 25, hi), cfg) for s in range(lo, hi, 25)]
    if a.jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(a.jobs) as pool:
            lines = [line for got in pool.imap(_worker, chunks) for line in got]
    else:
        lines = [line for c in chunks for line in _worker(c)]
    bad = [json.loads(line) for line in lines if not json.loads(line)["ok"]]
    seconds = time.perf_counter() - t0
    for b in bad[:5]:
        seed = int(b["seed"])
        faults = schedule(seed, cfg.replicas, cfg.steps * cfg.step_s * 1.2, cfg.faults)
        small = shrink(faults, functools.partial(_fails, seed, cfg))
        keep = ",".join(str(faults.index(f)) for f in small)
        print(json.dumps({"violation": b["violations"], "seed": b["seed"], "shrunk": [str(f) for f in small],
                          "replay": f"python -m lightning_ft.sim.job --seed {b['seed']} --only {keep} --trace"}))
    print(json.dumps({"bench": "sim", "seeds": hi - lo, "failed": len(bad),
                      "failing_seeds": [b["seed"] for b in bad][:20],
                      "seconds": round(seconds, 2), "schedules_per_minute": round((hi - lo) / seconds * 60, 1),
                      "steps": cfg.steps, "faults": cfg.faults, "replicas": cfg.replicas, "jobs": a.jobs}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
