"""Runs a study: real runs, simulated runs, the checks between them, and the outputs
(`lightning-ft study CONFIG.yaml`, `python -m lightning_ft.study`; docs/study/).

Order: the real runs first, one at a time (each `lightning-ft run` has the machine to
itself, so its wall-clock is its own), against one etcd the study starts; then, in
`jobs` processes, the simulator: every baseline seed of every precision (the noise band),
every setting with seed 0 on its nominal schedule, and a replay of every real run's ledger
(the validation). Each run's result is a JSON file in OUT/results/ keyed by a hash of what
it depends on (its spec and the script's bytes), so an interrupted study resumes where it
stopped; `fresh=True` recomputes everything. Then summary.md and the plots.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import time
import uuid
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from lightning_ft.study.config import StudyConfig
from lightning_ft.study.real import RealSpec, run_real
from lightning_ft.study.settings import batch_schedule
from lightning_ft.study.sim import SimSpec, simulate


@dataclass(frozen=True)
class Job:
    name: str
    source: str
    """"real", "sim" (the nominal schedule) or "replay" (a real run's ledger)."""
    seed: int = 0

    @property
    def key(self) -> str:
        return f"{self.name}.{self.source}.s{self.seed}"


def plan(cfg: StudyConfig) -> list[Job]:
    """Every run of the study, real ones first."""
    settings = cfg.all_settings()
    jobs = [Job(n, "real") for n in cfg.real.settings]
    for name, s in settings.items():
        if s.baseline:
            jobs += [Job(name, "sim", seed) for seed in range(cfg.seeds)]
    jobs += [Job(n, "sim") for n in cfg.settings if not settings[n].baseline]
    jobs += [Job(n, "replay") for n in cfg.real.settings]
    seen, out = set(), []
    for j in jobs:
        if j.key not in seen:
            seen.add(j.key)
            out.append(j)
    return out


def _sha(path: str) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()[:16]


class Study:
    def __init__(self, cfg: StudyConfig, fresh: bool = False, log: Callable[[str], None] = print) -> None:
        self.cfg = cfg
        self.fresh = fresh
        self.log = log
        self.settings = cfg.all_settings()
        self.results_dir = os.path.join(cfg.out, "results")
        self.script_sha = _sha(cfg.script)
        self.results: dict[str, dict] = {}
        self.reused: set[str] = set()
        """Keys of the runs taken from results/ rather than run by this invocation."""

    # -- specs ------------------------------------------------------------------------------
    def real_spec(self, job: Job) -> RealSpec:
        s = self.settings[job.name]
        return RealSpec(self.cfg.script, list(self.cfg.script_args), job.seed, s.precision, s.lr, s.batch_policy,
                        self.cfg.replicas, self.cfg.steps, self.cfg.schedule.failure_events(s), self.cfg.real.timeout_s)

    def sim_spec(self, job: Job) -> SimSpec:
        s = self.settings[job.name]
        if job.source == "replay":
            real = self.results[Job(job.name, "real", job.seed).key]
            batches = [{int(k): v for k, v in b.items()} for b in real["batches"]]
            contributors = real["contributors"]
        else:
            contributors = [list(c) for c in self.cfg.schedule.contributors(s)]
            batches = batch_schedule([tuple(c) for c in contributors], self.cfg.replicas, s.batch_policy)
        return SimSpec(self.cfg.script, list(self.cfg.script_args), job.seed, s.precision, s.lr, self.cfg.replicas,
                       batches, contributors)

    def _spec_hash(self, spec: SimSpec | RealSpec) -> str:
        raw = json.dumps({"spec": asdict(spec), "script": self.script_sha}, sort_keys=True, default=str)
        return hashlib.sha256(raw.encode()).hexdigest()[:16]

    def _cached(self, job: Job, h: str) -> Optional[dict]:
        path = os.path.join(self.results_dir, job.key + ".json")
        if self.fresh or not os.path.exists(path):
            return None
        got = json.load(open(path))
        if got.get("hash") != h:
            return None
        got["eval"] = {int(k): v for k, v in got["eval"].items()}
        return got

    def _store(self, job: Job, h: str, result: dict) -> dict:
        result = {**result, "hash": h, "name": job.name, "source": job.source, "seed": job.seed}
        result["eval"] = {int(k): v for k, v in result["eval"].items()}
        os.makedirs(self.results_dir, exist_ok=True)
        tmp = os.path.join(self.results_dir, f".{job.key}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, os.path.join(self.results_dir, job.key + ".json"))
        return result

    # -- running ----------------------------------------------------------------------------
    def run(self) -> dict[str, dict]:
        jobs = plan(self.cfg)
        t0 = time.time()
        real = [j for j in jobs if j.source == "real"]
        sims = [j for j in jobs if j.source != "real"]
        self.log(f"lightning-ft study: {len(real)} real runs, {len(sims)} simulated runs of {self.cfg.steps} steps, "
                 f"{self.cfg.replicas} replicas; results in {self.results_dir}")
        if real:
            self._run_real(real, t0)
        self._run_sims(sims, t0, done=len(real), total=len(jobs))
        self.log(f"lightning-ft study: all {len(jobs)} runs done in {time.time() - t0:.0f} s")
        return self.results

    def _run_real(self, jobs: list[Job], t0: float) -> None:
        from lightning_ft.coord.etcd_server import EtcdServer

        server = None
        try:
            for i, job in enumerate(jobs):
                spec = self.real_spec(job)
                h = self._spec_hash(spec)
                got = self._cached(job, h)
                if got is None:
                    if server is None:
                        server = EtcdServer().start()
                    self.log(f"[{i + 1}/{len(jobs)} real] {job.key}: lightning-ft run, {len(spec.events)} kills "
                             f"({time.time() - t0:.0f} s in)")
                    tag = f"{job.name.replace('_', '-')}-{uuid.uuid4().hex[:6]}"
                    run_dir = os.path.join(self.cfg.work_dir, tag)
                    got = self._store(job, h, run_real(spec, run_dir, "study-" + tag, server.endpoint))
                    self.log(f"  done in {got['seconds']:.0f} s: loss {got['train_loss'][-1]:.3f}, held-out "
                             f"{got['eval'][max(got['eval'])]:.3f} bpb, run dir {run_dir}")
                else:
                    self.log(f"[{i + 1}/{len(jobs)} real] {job.key}: cached")
                    self.reused.add(job.key)
                self.results[job.key] = got
        finally:
            if server is not None:
                server.cleanup()

    def _run_sims(self, jobs: list[Job], t0: float, done: int, total: int) -> None:
        todo = []
        for job in jobs:
            spec = self.sim_spec(job)
            h = self._spec_hash(spec)
            got = self._cached(job, h)
            if got is not None:
                self.results[job.key] = got
                self.reused.add(job.key)
                done += 1
                self.log(f"[{done}/{total} sim] {job.key}: cached")
            else:
                todo.append((job, spec, h))
        if not todo:
            return
        if self.cfg.jobs <= 1:  # in this process, one after the other
            for job, spec, h in todo:
                done += 1
                self._finish(job, h, spec, simulate(spec), f"[{done}/{total} sim]", t0)
            return
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=self.cfg.jobs, mp_context=ctx) as pool:
            futures = {pool.submit(simulate, spec): (job, h, spec) for job, spec, h in todo}
            for fut in as_completed(futures):
                job, h, spec = futures[fut]
                done += 1
                self._finish(job, h, spec, fut.result(), f"[{done}/{total} sim]", t0)

    def _finish(self, job: Job, h: str, spec: SimSpec, result: dict, tag: str, t0: float) -> None:
        got = self._store(job, h, {**result, "contributors": spec.contributors, "batches": spec.batches})
        self.results[job.key] = got
        self.log(f"{tag} {job.key}: {got['seconds']:.0f} s, loss {got['train_loss'][-1]:.3f}, "
                 f"held-out {got['eval'][max(got['eval'])]:.3f} bpb ({time.time() - t0:.0f} s in)")

