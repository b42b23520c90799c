"""Shadow replicas: R real replica leaders against a real etcd, with the GPU work shadowed
(docs/ARCHITECTURE.md, "The quorum"; the control-plane half of `python -m lightning_ft.bench.scale`).

Each leader is a thread running the coordinator exactly as a replica leader does, through
its public API: `Coordinator(...)`, `.register(step, addrs, state_addrs)`, then per step
`.quorum(step)`, a sleep in place of forward/backward/exchange (`step_s`), and, with
`ledger=True`, the commit record and cursor advances of `replica.data.record_commit` that
the replica manager writes before its next report. Leaders are spread over a few
processes (each with its own etcd clients), as in bench.quorum.

Every message is the coordinator's own: each leader registers W real per-rank addresses
(`addr_ranks`; published once, in blocks, by coord/addresses.py), reports and adopts
quorums, and, when the ring epoch changes, reads its two ring neighbours' addresses as a
replica leader does before it hands each rank its own (`Coordinator.addresses`; timed
as `resolve_ms` and counted in that round's latency).

Measured per leader and round: the `quorum()` call (report, wait for the round's decision,
adopt it; it includes waiting for the slowest leader to report), the ledger write, the
etcd RPCs and watch events each leader's store saw, the largest etcd request or response
(`max_message_bytes`), and the CPU time of the leader processes and of etcd. Each leader also
records the quorum it adopted, so a caller can check that all leaders agreed on every round (the protocol really ran).
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, cast

RPCS = ("get", "get_prefix", "put", "create", "cas", "delete", "lease_keepalive")
PREFIX = "/lft"
"""The coordinator's key prefix; a job's keys are under {PREFIX}/{job}/."""


class CountingStore:
    """A Store that forwards to another and counts RPCs, their wall time and watch events."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self.calls: dict[str, list[float]] = {name: [0, 0.0] for name in RPCS}
        self.events = 0
        self.max_bytes = 0
        """The largest request or response payload seen (keys and values; etcd's framing not counted)."""

    def __getattr__(self, name: str) -> Any:  # everything not counted (leases, revision, close)
        attr = getattr(self._inner, name)
        if name not in RPCS:
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            size = sum(len(a) for a in args if isinstance(a, (str, bytes)))
            out = None
            try:
                out = attr(*args, **kwargs)
                return out
            finally:
                size = max(size, _payload(out))
                with self._lock:
                    c = self.calls[name]
                    c[0] += 1
                    c[1] += (time.perf_counter() - t0) * 1e3
                    self.max_bytes = max(self.max_bytes, size)

        return timed

    def watch_prefix(self, prefix: str, callback: Callable, start_revision: int = 0) -> Callable[[], None]:
        def counted(ev: Any) -> None:
            with self._lock:
                self.events += 1
                self.max_bytes = max(self.max_bytes, len(ev.key) + len(ev.value or b""))
            callback(ev)

        return self._inner.watch_prefix(prefix, counted, start_revision)


def _payload(out: Any) -> int:
    """Bytes of keys and values in a store call's result (a KV, (kvs, rev), or nothing)."""
    if isinstance(out, tuple) and out and isinstance(out[0], list):
        return sum(_payload(kv) for kv in out[0])
    key, value = getattr(out, "key", None), getattr(out, "value", None)
    return (len(key) if isinstance(key, (str, bytes)) else 0) + (len(value) if isinstance(value, bytes) else 0)


def rank_addresses(world: int, port: int = 29500) -> tuple[str, ...]:
    """Plausible per-rank endpoints of a W-rank replica: 8 ranks per host, one port each."""
    return tuple(f"10.{h // 62500 % 250}.{h // 250 % 250}.{h % 250 + 1}:{port + r % 8}"
                 for r, h in ((r, r // 8) for r in range(world)))


def _leader(cfg: dict, rid: int, out: dict, ready: threading.Barrier) -> None:
    from lightning_ft.coord.coordinator import Coordinator
    from lightning_ft.coord.membership import MembershipSettings
    from lightning_ft.coord.round_records import JobSpec
    from lightning_ft.coord.etcd_store import EtcdStore
    from lightning_ft.coord.store import Store
    from lightning_ft.replica.ledger import record_commit

    R, W = cfg["replicas"], cfg["addr_ranks"]
    counting = CountingStore(EtcdStore(cfg["endpoint"]))
    # CountingStore is a proxy: __getattr__ forwards the whole Store contract to the EtcdStore.
    store = cast(Store, counting)
    spec = JobSpec(replicas=R, min_replicas=R, init_timeout_s=120.0, fingerprint={"job": cfg["job"]})
    c = Coordinator(store, cfg["job"], rid, 0, spec,
                    MembershipSettings(prefix=PREFIX, lease_ttl_s=cfg["lease_ttl_s"], hang_timeout_s=3600.0,
                                       poll_interval_s=cfg["poll_s"]))
    root = f"{PREFIX}/{cfg['job']}/"
    mine: dict[str, Any] = {"lat_ms": [], "ledger_ms": [], "resolve_ms": [], "decisions": []}
    out[rid] = mine
    try:
        t0 = time.perf_counter()
        c.register(0, rank_addresses(W, 29500), rank_addresses(W, 29600))
        mine["register_ms"] = (time.perf_counter() - t0) * 1e3
        ready.wait(120)
        step, prev = 0, None
        for i in range(cfg["warmup"] + cfg["rounds"]):
            if cfg["ledger"] and prev is not None:
                t0 = time.perf_counter()
                record_commit(store, root, prev.max_step + 1, rid, prev.epoch, prev.round,
                              {s: prev.max_step for s in prev.contributors})
                if i >= cfg["warmup"]:
                    mine["ledger_ms"].append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            q = c.quorum(step, timeout_s=cfg["quorum_timeout_s"])
            if prev is None or q.epoch != prev.epoch:  # a new ring: the neighbours' addresses
                t1 = time.perf_counter()
                _resolve_neighbours(c, q, rid, W)
                mine["resolve_ms"].append((time.perf_counter() - t1) * 1e3)
            dt = (time.perf_counter() - t0) * 1e3
            if i >= cfg["warmup"]:
                mine["lat_ms"].append(dt)
            mine["decisions"].append([q.round, q.epoch, list(q.members), q.max_step])
            if rid == 0 and i == 0:
                mine["quorum_json_bytes"] = len(q.to_json())
                mine["message"] = pickle.dumps((q, 0, False)).hex()  # what the leader broadcasts to its ranks
            step, prev = q.max_step + 1, q
            time.sleep(cfg["step_s"])  # the shadowed forward, backward and exchange
    except Exception as e:  # reported to the parent, which fails with it
        mine["error"] = f"leader {rid}: {type(e).__name__}: {e}"
        ready.abort()
    finally:
        mine["rpc"] = counting.calls
        mine["events"] = counting.events
        mine["max_bytes"] = counting.max_bytes
        mine["evaluations"] = c.evaluations
        c.close()
        store.close()


def _resolve_neighbours(c: Any, q: Any, rid: int, world: int) -> None:
    """What a replica leader reads when its ring changes: both neighbours' addresses."""
    from lightning_ft.ftar.ring import neighbours

    incs = dict(zip(q.members, q.incarnations, strict=True))
    for j in set(neighbours(len(q.members), q.index(rid))):
        peer = q.members[j]
        if peer != rid:
            got = c.addresses(peer, incs[peer])
            if got is None or len(got[0]) != world:
                raise RuntimeError(f"leader {rid}: replica {peer}'s addresses are missing or short")


def _worker(cfg: dict) -> None:
    out: dict[int, dict] = {}
    ready = threading.Barrier(len(cfg["rids"]))
    ts = [threading.Thread(target=_leader, args=(cfg, rid, out, ready), daemon=True) for rid in cfg["rids"]]
    cpu0, t0 = time.process_time(), time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    print(json.dumps({"leaders": out, "cpu_s": time.process_time() - cpu0, "wall_s": time.monotonic() - t0}),
          flush=True)


@dataclass
class LeaderRun:
    job: str
    """The job id in etcd (its keys stay under {PREFIX}/{job}/ for inspection)."""
    replicas: int
    rounds: int
    ledger: bool
    """Whether the leaders wrote the commit ledger between rounds."""
    latency_ms: list[float]
    """Every leader's `quorum()` latency, every measured round."""
    ledger_ms: list[float]
    decisions: dict[int, list]
    """Per leader: [round, epoch, members, max_step] of every round it adopted."""
    rpc: dict[str, list[float]]
    """RPC name -> [count, total ms], summed over leaders and all rounds."""
    events: int
    leader_cpu_s: float
    etcd_cpu_s: Optional[float]
    wall_s: float
    quorum_json_bytes: int
    message: Any = field(repr=False, default=None)
    """The object a leader broadcasts to its ranks after a quorum: (Quorum, cursor, scatter)."""
    max_message_bytes: int = 0
    """The largest etcd request, response or watch event any leader saw."""
    resolve_ms: list[float] = field(default_factory=list)
    """Reading both ring neighbours' addresses, at each epoch change."""
    register_ms: list[float] = field(default_factory=list)
    evaluations: int = 0
    """Decisions evaluated from etcd, all leaders, all rounds."""

    def agreed(self) -> bool:
        """Every leader adopted the same quorum in every round it took part in."""
        by_round: dict[int, tuple] = {}
        for ds in self.decisions.values():
            for rnd, epoch, members, max_step in ds:
                if by_round.setdefault(rnd, (epoch, tuple(members), max_step)) != (epoch, tuple(members), max_step):
                    return False
        return True


def _proc_cpu_s(pid: int) -> Optional[float]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def run_leaders(endpoint: str, replicas: int, rounds: int = 30, warmup: int = 3, step_s: float = 0.2,
                addr_ranks: int = 8, ledger: bool = True, processes: int = 4, lease_ttl_s: float = 10.0,
                poll_s: float = 0.02, etcd_pid: Optional[int] = None, timeout_s: float = 600.0) -> LeaderRun:
    """R shadow leaders over `processes` processes against etcd at `endpoint`; see the module
    docstring. `addr_ranks`: how many per-rank FTAR and state addresses each leader
    registers (a real leader registers one per rank of its replica, W)."""
    if replicas < 1 or rounds < 1:
        raise ValueError(f"need at least one replica and one round, got {replicas} and {rounds}")
    job = "sim-" + uuid.uuid4().hex[:8]
    nproc = max(1, min(processes, replicas))
    base = {"endpoint": endpoint, "job": job, "replicas": replicas, "rounds": rounds, "warmup": warmup,
            "step_s": step_s, "addr_ranks": addr_ranks, "ledger": ledger, "lease_ttl_s": lease_ttl_s,
            "poll_s": poll_s, "quorum_timeout_s": max(60.0, timeout_s / 2)}
    procs = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for i in range(nproc):
        cfg = {**base, "rids": list(range(i, replicas, nproc))}
        procs.append(subprocess.Popen([sys.executable, "-m", "lightning_ft.sim.leaders", json.dumps(cfg)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    etcd0 = _proc_cpu_s(etcd_pid) if etcd_pid else None
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    results = []
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"{replicas} shadow leaders did not finish {rounds} rounds in {timeout_s:.0f}s") \
                    from None
            if p.returncode != 0 or not out.strip():
                raise RuntimeError(f"shadow leader process exited with {p.returncode}:\n{err[-2000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    wall = time.monotonic() - t0
    etcd1 = _proc_cpu_s(etcd_pid) if etcd_pid else None
    leaders = {int(rid): d for r in results for rid, d in r["leaders"].items()}
    errors = [d["error"] for d in leaders.values() if "error" in d]
    if errors:
        raise RuntimeError("shadow leaders failed: " + "; ".join(errors[:3]))
    rpc = {name: [0, 0.0] for name in RPCS}
    for d in leaders.values():
        for name, (n, ms) in d["rpc"].items():
            rpc[name][0] += n
            rpc[name][1] += ms
    first = leaders[0]
    return LeaderRun(
        job=job, replicas=replicas, rounds=rounds, ledger=ledger,
        latency_ms=[x for d in leaders.values() for x in d["lat_ms"]],
        ledger_ms=[x for d in leaders.values() for x in d["ledger_ms"]],
        decisions={rid: d["decisions"] for rid, d in leaders.items()},
        rpc=rpc, events=sum(d["events"] for d in leaders.values()),
        leader_cpu_s=sum(r["cpu_s"] for r in results),
        etcd_cpu_s=None if etcd0 is None or etcd1 is None else etcd1 - etcd0,
        wall_s=wall, quorum_json_bytes=first.get("quorum_json_bytes", 0),
        message=pickle.loads(bytes.fromhex(first["message"])) if "message" in first else None,
        max_message_bytes=max(d.get("max_bytes", 0) for d in leaders.values()),
        resolve_ms=[x for d in leaders.values() for x in d["resolve_ms"]],
        register_ms=[d["register_ms"] for d in leaders.values() if "register_ms" in d],
        evaluations=sum(d.get("evaluations", 0) for d in leaders.values()))


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
