"""Control-plane latency of an R x W job, up to 100K ranks, on this machine (docs/ARCHITECTURE.md, "The quorum").

    python -m lightning_ft.bench.scale [--replicas 2 4 8 12 16 32 64] [--ranks 8 128 1024 8192]
                                       [--rounds 30] [--step-s 0.2] [--probe-world 2 4 8]
                                       [--shapes 12x8192 32x3072 64x1536] [--quick]

Real: etcd, the coordinator and quorum code, R replica leaders (threads in a few processes,
each with its own etcd clients) running back-to-back rounds (and, for --with-ledger, the
commit ledger between rounds), and gloo broadcasts over W <= 8 local processes. Every etcd
message is the coordinator's own: leaders register their ranks' real addresses (W of them;
--sweep-ranks in the R sweep, the shape's W in --shapes) and read their ring neighbours'
when the epoch changes. Shadowed:
forward/backward/exchange (a sleep of --step-s) and the fan-out of each quorum from a
leader to its W ranks, which follows gloo's binomial tree (sim/fanout.py) with hop costs
measured here on the W = 2 gloo probe.

Prints, in order:
- `scale_hop_model`: the measured hop (latency samples, bandwidth, per-call overhead), at
  --probe-nice (the one used) and at the default priority;
- `scale_fanout_check`, per probe W: measured against modelled broadcast_object_list time;
- `scale_cpu_check`: the probe at W = --cpu-check-world on all cores and pinned to one core
  (with more processes than cores, the tree's hops queue for a CPU: what the model, with a
  core per rank as on a cluster, leaves out);
- `scale_cost`, per R: CPU of the leaders and of etcd, RPCs and watch events per round;
- `scale`, per (R, W): {"bench": "scale", "replicas": R, "ranks_per_replica": W,
  "p50_ms": ..., "p99_ms": ...}, a leader's quorum() latency plus the modelled fan-out to
  its W ranks (sampled independently and added), with both parts alongside;
- `scale_shape`, per --shapes R x W: R leaders that each register W addresses, the round's
  p50/p99 (quorum + modelled fan-out), the largest etcd message, the neighbour-address read
  at an epoch change and the registration (`--addr-ranks W ... --addr-replicas R` adds shapes);
- `scale_env`: cores and load average (this machine is shared).
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import statistics
import sys
import time
from typing import Optional

import numpy as np

from lightning_ft.sim.fanout import HopModel, receive_times, sample_fanout, percentile
from lightning_ft.sim.leaders import LeaderRun, run_leaders


def _ms(x: float) -> float:
    return round(float(x), 3)


def _log(msg: str) -> None:
    print(f"bench.scale: {msg}", file=sys.stderr, flush=True)


def _short_error(text: str) -> str:
    m = re.search(r"(etcd \w+ \S+) failed.*?(received message larger than max \(\d+ vs\. \d+\))", text, re.S)
    return f"{m.group(1)} refused: {m.group(2)}" if m else text.splitlines()[0][:300]


def fanout_check(model: HopModel, world: int, measured: list[list[float]], message_bytes: int,
                 rng: np.random.Generator) -> dict:
    """The modelled broadcast_object_list to `world` ranks against the measured one."""
    last = [max(row) for row in measured]
    sim = sample_fanout(world, model, message_bytes, 4000, rng)
    lat = np.asarray(model.latency_ms)
    wire = message_bytes / model.bytes_per_s * 1e3
    per_rank = model.overhead_ms + receive_times(world, np.full(world, float(np.median(lat)))) \
        + receive_times(world, np.full(world, float(np.median(lat)) + wire), send_ms=wire)
    return {"bench": "scale_fanout_check", "world": world, "message_bytes": message_bytes,
            "measured_p50_ms": _ms(percentile(last, 0.5)), "measured_p99_ms": _ms(percentile(last, 0.99)),
            "model_p50_ms": _ms(percentile(sim, 0.5)), "model_p99_ms": _ms(percentile(sim, 0.99)),
            "measured_rank_p50_ms": [_ms(statistics.median(col)) for col in zip(*measured, strict=True)],
            "model_rank_p50_ms": [_ms(x) for x in per_rank[1:]]}


def scale_rows(run: LeaderRun, ranks: list[int], model: HopModel, message_bytes: int,
               rng: np.random.Generator, bench: str = "scale") -> list[dict]:
    """Per W: a leader's quorum latency (measured) + its fan-out to W ranks (modelled)."""
    q = np.asarray(run.latency_ms)
    k = max(1, 4000 // len(q))
    rows = []
    for w in ranks:
        fan = sample_fanout(w, model, message_bytes, len(q) * k, rng)
        total = np.repeat(q, k) + fan
        rows.append({"bench": bench, "replicas": run.replicas, "ranks_per_replica": w, "gpus": run.replicas * w,
                     "ledger": run.ledger,
                     "p50_ms": _ms(percentile(total, 0.5)), "p99_ms": _ms(percentile(total, 0.99)),
                     "quorum_p50_ms": _ms(percentile(q, 0.5)), "quorum_p99_ms": _ms(percentile(q, 0.99)),
                     "fanout_p50_ms": _ms(percentile(fan, 0.5)), "fanout_p99_ms": _ms(percentile(fan, 0.99)),
                     "message_bytes": message_bytes})
    return rows


def cost_row(run: LeaderRun, cores: int) -> dict:
    rounds = run.rounds + 3  # measured rounds and warm-up: the CPU window covers both
    rpcs = sum(n for n, _ in run.rpc.values())
    return {"bench": "scale_cost", "replicas": run.replicas, "ledger": run.ledger, "rounds": run.rounds,
            "agreed": run.agreed(),
            "round_ms": _ms(run.wall_s / rounds * 1e3),
            "leader_cpu_ms_per_round": _ms(run.leader_cpu_s / rounds * 1e3),
            "etcd_cpu_ms_per_round": None if run.etcd_cpu_s is None else _ms(run.etcd_cpu_s / rounds * 1e3),
            "cores": cores, "rpcs_per_round": round(rpcs / rounds, 1),
            "rpc_ms_per_round": {k: _ms(ms / rounds) for k, (n, ms) in run.rpc.items() if n},
            "watch_events_per_round": round(run.events / rounds, 1),
            "evaluations_per_round": round(run.evaluations / rounds, 2),
            "max_etcd_message_bytes": run.max_message_bytes,
            "ledger_p50_ms": _ms(percentile(run.ledger_ms, 0.5)) if run.ledger_ms else None,
            "quorum_json_bytes": run.quorum_json_bytes}


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def measure_leaders(a: argparse.Namespace, endpoint: str, etcd_pid: Optional[int]) -> tuple[list, list]:
    """The real part: R leaders per case against etcd; and the runs with W addresses each."""
    runs = []
    cases = [(r, False) for r in a.replicas] + [(r, True) for r in a.with_ledger]
    for r, led in cases:
        t0 = time.monotonic()
        runs.append(run_leaders(endpoint, r, rounds=a.rounds, step_s=a.step_s, ledger=led, addr_ranks=a.sweep_ranks,
                                processes=a.processes, etcd_pid=etcd_pid))
        _log(f"{r} leaders x {a.rounds} rounds{' with the ledger' if led else ''} in {time.monotonic() - t0:.1f}s")
    shape_runs: list[tuple[int, int, LeaderRun | str]] = []
    for r, w in shapes_of(a):
        t0 = time.monotonic()
        try:
            shape_runs.append((r, w, run_leaders(endpoint, r, rounds=max(5, a.rounds // 3), step_s=a.step_s,
                                                 addr_ranks=w, ledger=False, processes=a.processes,
                                                 etcd_pid=etcd_pid)))
        except RuntimeError as e:  # e.g. etcd refusing a message too large for one request
            shape_runs.append((r, w, _short_error(str(e))))
        _log(f"{r} leaders with {w} addresses each in {time.monotonic() - t0:.1f}s")
    return runs, shape_runs


def shapes_of(a: argparse.Namespace) -> list[tuple[int, int]]:
    """(R, W) of every shape to run: --shapes, then --addr-replicas x each --addr-ranks."""
    out = []
    for text in a.shapes:
        r, _, w = text.lower().partition("x")
        if not (r.isdigit() and w.isdigit()):
            raise SystemExit(f"bench.scale: --shapes takes RxW, like 12x8192; got {text!r}")
        out.append((int(r), int(w)))
    return out + [(a.addr_replicas, w) for w in a.addr_ranks]


def shape_row(r: int, w: int, run: LeaderRun, model: HopModel, rng: np.random.Generator) -> dict:
    row = scale_rows(run, [w], model, len(pickle.dumps(run.message)), rng, bench="scale_shape")[0]
    row.update(quorum_json_bytes=run.quorum_json_bytes, max_etcd_message_bytes=run.max_message_bytes,
               resolve_p50_ms=_ms(percentile(run.resolve_ms, 0.5)) if run.resolve_ms else None,
               register_p50_ms=_ms(percentile(run.register_ms, 0.5)) if run.register_ms else None,
               agreed=run.agreed(), watch_events_per_round=round(run.events / (run.rounds + 3), 1))
    return row


def measure_fanout(a: argparse.Namespace, message: object, rng: np.random.Generator,
                   cores: int) -> tuple[HopModel, list[dict]]:
    """Real gloo probes: the hop model (fitted at W = 2) and the rows that check it."""
    from lightning_ft.sim.gloo_probe import fit, probe

    rows, probes = [], {}
    for w in a.probe_world:
        probes[w] = probe(w, message, iters=a.probe_iters, nice=a.probe_nice)
        _log(f"gloo probe over {w} processes done")
    models = {a.probe_nice: fit(probes[2])}
    if a.probe_nice != 0:  # the same at the default priority, for comparison
        models[0] = fit(probe(2, message, iters=a.probe_iters))
    for nice, m in sorted(models.items()):
        rows.append({"bench": "scale_hop_model", "nice": nice, "hop_p50_ms": _ms(percentile(m.latency_ms, 0.5)),
                     "hop_p99_ms": _ms(percentile(m.latency_ms, 0.99)), "hop_max_ms": _ms(max(m.latency_ms)),
                     "bytes_per_s": round(m.bytes_per_s), "overhead_ms": _ms(m.overhead_ms),
                     "message_bytes": probes[2].message_bytes, "samples": len(m.latency_ms),
                     "used": nice == a.probe_nice, "loadavg": _loadavg()})
    model = models[a.probe_nice]
    for w, res in probes.items():
        rows.append(fanout_check(model, w, res.latency_ms["object"], res.message_bytes, rng))
    w = a.cpu_check_world
    if w and cores > 1:
        spread = probes.get(w) or probe(w, message, iters=a.probe_iters, nice=a.probe_nice)
        pinned = probe(w, message, iters=a.probe_iters, nice=a.probe_nice, cpus=[min(os.sched_getaffinity(0))])
        rows.append({"bench": "scale_cpu_check", "world": w, "cores": cores,
                     "all_cores_p50_ms": _ms(percentile(spread.last_rank_ms("object"), 0.5)),
                     "one_core_p50_ms": _ms(percentile(pinned.last_rank_ms("object"), 0.5)),
                     "all_cores_hop_p50_ms": _ms(percentile(spread.last_rank_ms("hop"), 0.5)),
                     "one_core_hop_p50_ms": _ms(percentile(pinned.last_rank_ms("hop"), 0.5))})
    return model, rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lightning_ft.bench.scale", description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8, 12, 16, 32, 64])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 128, 1024, 8192], help="W of the fan-out model")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--step-s", type=float, default=0.2, help="shadowed compute per step")
    p.add_argument("--with-ledger", type=int, nargs="*", default=[12, 64],
                   help="replica counts to run again with the commit ledger written between rounds")
    p.add_argument("--probe-world", type=int, nargs="+", default=[2, 4, 8], help="real gloo processes (first is 2)")
    p.add_argument("--probe-iters", type=int, default=200)
    p.add_argument("--probe-nice", type=int, default=-10 if os.geteuid() == 0 else 0,
                   help="niceness of the probe processes (default -10 as root: woken ranks get a core at once, "
                        "as on a cluster, rather than queueing behind other work on this machine)")
    p.add_argument("--cpu-check-world", type=int, default=4,
                   help="also probe this many processes pinned to one core (0: skip)")
    p.add_argument("--shapes", nargs="*", default=["12x8192", "32x3072", "64x1536"],
                   help="RxW jobs to run with W real per-rank addresses per leader")
    p.add_argument("--addr-ranks", type=int, nargs="*", default=[],
                   help="more shapes: --addr-replicas x each of these W")
    p.add_argument("--addr-replicas", type=int, default=12)
    p.add_argument("--sweep-ranks", type=int, default=8, help="addresses each leader registers in the R sweep")
    p.add_argument("--processes", type=int, default=4, help="processes the leader threads are spread over")
    p.add_argument("--etcd", default="", help="external etcd host:port (default: embedded; its CPU is measured)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a small sweep (tests)")
    a = p.parse_args(argv)
    if a.quick:
        a.replicas, a.ranks, a.rounds, a.probe_world, a.probe_iters, a.addr_ranks, a.shapes = \
            [2, 3], [2, 8192], 5, [2, 3], 40, [], ["3x600"]
        a.cpu_check_world, a.step_s, a.with_ledger, a.probe_nice = 0, 0.05, [3], 0
    if a.probe_world[0] != 2:
        p.error("--probe-world must start with 2: the hop model is fitted on a 2-process probe")
    from lightning_ft.coord.etcd_server import EtcdServer

    rng = np.random.default_rng(a.seed)
    cores = len(os.sched_getaffinity(0))
    load0 = _loadavg()
    server = None if a.etcd else EtcdServer().start()
    try:
        runs, shape_runs = measure_leaders(a, a.etcd if server is None else server.endpoint,
                                           server.proc.pid if server is not None and server.proc is not None else None)
    finally:
        if server is not None:
            server.cleanup()
    # the probe broadcasts what a leader really sends: the quorum of the middle run
    model, rows = measure_fanout(a, runs[len(a.replicas) // 2].message, rng, cores)
    for row in rows:
        print(json.dumps(row), flush=True)
    for run in runs:
        print(json.dumps(cost_row(run, cores)), flush=True)
    for run in runs:
        for row in scale_rows(run, a.ranks, model, len(pickle.dumps(run.message)), rng):
            print(json.dumps(row), flush=True)
    for r, w, run in shape_runs:
        if isinstance(run, str):
            print(json.dumps({"bench": "scale_shape", "replicas": r, "ranks_per_replica": w, "error": run}),
                  flush=True)
            continue
        print(json.dumps(shape_row(r, w, run, model, rng)), flush=True)
    print(json.dumps({"bench": "scale_env", "cores": cores, "loadavg_start": load0, "loadavg_end": _loadavg()}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
