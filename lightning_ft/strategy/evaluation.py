"""Validation and test across replicas (docs/ARCHITECTURE.md, "Lightning semantics").

DDP shards evaluation over its ranks and `sync_dist=True` reduces logged metrics over all
of them. Under ft_hsdp a replica's ranks are one DDP-like world, and the replicas are many:

- `ShardSampler` gives every live replica (the contributors of the last round) its share of
  the evaluation set, and every rank of the replica its share of that (padded within the
  replica, as DistributedSampler pads, so that FSDP2's collectives see equal batch counts);
- `CrossReplicaReducer` reduces a metric over the replicas through etcd: each leader
  writes its replica's value under a key named by (stage, generation, committed step, run,
  call number), waits for every contributor (or its failure), and the first leader with a
  complete view creates the result with a create-if-absent transaction. Everyone uses the
  stored result, so every replica logs the same value even when one dies midway.

Contributors, not members: a replica that caught up in the last round (lagging) committed its
step in a catch-up, maybe before its first batch (on_train_start), and its Lightning loop then
does not evaluate at that step. Waiting for it cost the others `timeout_s` (CI: a replica
restarted into step 25 of the typical program; the others waited 30 s, the hang guard let
their leases lapse, and the launcher restarted them). A replica outside the evaluating set
that evaluates anyway adds no value: it reads the others' result.

The calls line up because every replica evaluates at the same committed steps (Lightning's
counters follow the job, see strategy/stepping.py::set_lightning_step) and logs the same metrics
in the same order.
"""
from __future__ import annotations

import json
import math
import time
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import Sampler

from lightning_ft.coord import keys


class ShardSampler(Sampler):
    """Indices of this rank's share of an evaluation set of `n` samples."""

    def __init__(self, n: int, shard: Callable[[], tuple[int, int, int, int]]) -> None:
        """`shard()` -> (replica index, number of replicas, rank, ranks per replica), asked at
        every pass (membership changes between evaluations)."""
        self.n = n
        self._shard = shard

    def _indices(self) -> list[int]:
        i, k, rank, world = self._shard()
        mine = list(range(i, self.n, k))  # this replica's share: every k-th sample
        if world > 1 and mine:
            per = math.ceil(len(mine) / world)
            mine = (mine * world)[:per * world]  # pad within the replica (equal batch counts for FSDP2)
            return mine[rank::world]
        return mine

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices())

    def __len__(self) -> int:
        return len(self._indices())


class CrossReplicaReducer:
    """Reduces evaluation metrics over the live replicas (see the module docstring)."""

    poll_s = 0.005

    def __init__(self, mgr: Any, timeout_s: float) -> None:
        self.mgr = mgr
        self.timeout_s = timeout_s
        self._runs: dict[tuple, int] = {}
        self._prefix = ""
        self._seq = {"m": 0, "d": 0, "t": 0}
        self.deciding = False
        """Set by the strategy around `reduce_boolean_decision`: callbacks' decisions count
        apart from metric values, so that a replica whose callbacks ask a different number of
        questions (a ModelCheckpoint with fewer files than its top-k asks none) never pairs
        its val_loss with another's decision."""
        self._members: tuple[tuple[int, int], ...] = ()

    def _live(self) -> tuple[tuple[int, int], ...]:
        """(replica, incarnation) of the contributors of the last round (its members if none)."""
        mgr = self.mgr
        q = mgr.last_plan.quorum if mgr.last_plan is not None else None
        if q is None:
            return ((mgr.rid, mgr.incarnation),)
        incs = dict(zip(q.members, q.incarnations, strict=True))
        live = tuple((r, incs[r]) for r in q.contributors if r in incs)
        return live or tuple(incs.items())

    def begin(self, stage: str) -> None:
        """An evaluation run starts (same order on every replica)."""
        mgr = self.mgr
        self._members = self._live()
        ident = (stage, mgr.gen, mgr.step)
        self._runs[ident] = self._runs.get(ident, 0) + 1
        self._prefix = f"{mgr.root}eval/{stage}/{mgr.gen:04d}/{mgr.step:012d}/{self._runs[ident]}/"
        self._seq = {"m": 0, "d": 0, "t": 0}

    def shard(self) -> tuple[int, int]:
        """(this replica's index, number of replicas) for the evaluation being started. From the
        last round, not from `begin`: Lightning sizes the loader before the start hook runs."""
        rids = [r for r, _ in self._live()]
        return (rids.index(self.mgr.rid) if self.mgr.rid in rids else 0), max(1, len(rids))

    @property
    def active(self) -> bool:
        return bool(self._prefix)

    def end(self) -> None:
        self._prefix = ""

    def reduce(self, value: torch.Tensor, op: str) -> torch.Tensor:
        """`value` (this replica's, already reduced over its ranks) reduced over the replicas
        with op in sum | mean | max | min. Every rank calls it; the leader talks to etcd."""
        mgr = self.mgr
        kind = "d" if self.deciding else "m"
        key = f"{self._prefix}{kind}{self._seq[kind]:05d}/"
        self._seq[kind] += 1
        mine = value.detach().to("cpu", torch.float64).reshape(-1).tolist()
        out = mgr.group.leader_result(lambda: self._leader_reduce(key, mine, op))  # its exception on every rank
        # The mean of integers (Lightning's batch-size counts) is not an integer: as DDP's reduce,
        # return it as a float instead of truncating it.
        dtype = value.dtype if value.is_floating_point() or op != "mean" else torch.get_default_dtype()
        return torch.tensor(out, dtype=dtype, device=value.device).reshape(value.shape)

    def gather(self, value: torch.Tensor) -> list[torch.Tensor]:
        """`value` from every rank of every replica that evaluates, replica by replica in id
        order, ranks in order: the `dist_sync_fn` of a torchmetrics object during evaluation
        (`sync_metrics`), which then reduces the states as over one DDP world. Every rank calls
        it; the leader talks to etcd."""
        mgr = self.mgr
        key = f"{self._prefix}t{self._seq['t']:05d}/"
        self._seq["t"] += 1
        ranks = [_tensor_json(t) for t in mgr.gather(value.detach().to("cpu"))]
        out = mgr.group.leader_result(
            lambda: self._leader_agree(key, ranks, lambda got: [t for r in sorted(got) for t in got[r]]))
        return [_tensor_of(t, value.device) for t in out]

    def _leader_reduce(self, key: str, mine: list[float], op: str) -> list[float]:
        return self._leader_agree(key, mine, lambda got: _combine([got[r] for r in sorted(got)], op))

    def _leader_agree(self, key: str, mine: Any, combine: Callable[[dict[int, Any]], Any]) -> Any:
        """Post this replica's `mine` under `key` (if it is counted), wait for every counted
        replica's (or its failure), and agree on `combine({rid: theirs})`: the first leader with a
        complete view creates the result; everyone returns the stored one."""
        store = self.mgr.store
        counted = {r for r, _ in self._members}
        if self.mgr.rid in counted:
            store.put(f"{key}{self.mgr.rid}", json.dumps(mine).encode())
        result_key = f"{key}result"
        deadline = time.monotonic() + self.timeout_s
        while True:
            kv = store.get(result_key)
            if kv is not None:
                return json.loads(kv.value)["value"]
            kvs, _ = store.get_prefix(key)
            got = {int(k.key.rsplit("/", 1)[1]): json.loads(k.value) for k in kvs
                   if k.key.rsplit("/", 1)[1].isdigit() and int(k.key.rsplit("/", 1)[1]) in counted}
            waiting = [r for r, inc in self._members if r not in got and self._alive(r, inc)]
            if not waiting or time.monotonic() > deadline:
                if not got:  # we are not counted and no counted replica answered: our own value
                    got = {self.mgr.rid: mine}
                store.create(result_key, json.dumps({"value": combine(got), "from": sorted(got)}).encode())
                continue  # read back what won the create
            time.sleep(self.poll_s)

    def _alive(self, rid: int, inc: int) -> bool:
        store, root = self.mgr.store, self.mgr.root
        if store.get(keys.evict(root, rid, inc)) is not None:
            return False
        kv = store.get(keys.members(root, rid))
        return kv is not None and json.loads(kv.value).get("incarnation") == inc


def _tensor_json(t: torch.Tensor) -> dict[str, Any]:
    """A metric state as JSON, exactly (a float32's value is a float64's)."""
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": t.reshape(-1).tolist()}


def _tensor_of(d: dict[str, Any], device: Any) -> torch.Tensor:
    return torch.tensor(d["data"], dtype=getattr(torch, d["dtype"]), device=device).reshape(d["shape"])


def sync_metrics(module: Any, reducer: CrossReplicaReducer) -> int:
    """Point every torchmetrics object of `module` at the replicas: during an evaluation its
    states are gathered from every rank of every evaluating replica (`reducer.gather`), so
    `compute()` sees the whole evaluation set, as under DDP; outside one (training metrics)
    they sync inside the replica only, as before. Returns how many metrics it set (none
    without torchmetrics imported)."""
    import sys

    tm = sys.modules.get("torchmetrics")
    if tm is None:
        return 0
    from torchmetrics.utilities.distributed import gather_all_tensors

    def sync_fn(value: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
        return reducer.gather(value) if reducer.active else gather_all_tensors(value, group)

    metrics = [m for m in module.modules() if isinstance(m, tm.Metric)]
    for m in metrics:
        m.dist_sync_fn = sync_fn
    return len(metrics)


def _combine(vals: list[list[float]], op: str) -> list[float]:
    cols = list(zip(*vals, strict=False))  # as before the lint pass: a shorter list truncates
    if op == "sum":
        return [sum(c) for c in cols]
    if op == "mean":
        return [sum(c) / len(c) for c in cols]
    if op == "max":
        return [max(c) for c in cols]
    if op == "min":
        return [min(c) for c in cols]
    raise ValueError(f"cannot reduce metrics across replicas with op {op!r}; use sum, mean, max or min")


def op_name(reduce_op: Optional[Any]) -> str:
    """Lightning's reduce_op (None, a string, or a torch ReduceOp) as sum | mean | max | min."""
    if reduce_op is None:
        return "sum"
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
        return {"avg": "mean", "average": "mean"}.get(name, name)
    from torch.distributed import ReduceOp

    return {ReduceOp.SUM: "sum", ReduceOp.MAX: "max", ReduceOp.MIN: "min"}.get(reduce_op, "mean")


def begin_validation(s: Any) -> None:
    """`on_validation_start` of strategy `s`: metrics logged from here on are reduced across the
    replicas, and torchmetrics objects sync over the whole set."""
    s.reducer.begin("sanity" if s.module.trainer.sanity_checking else "val")
    sync_metrics(s.module, s.reducer)


def end_validation(s: Any) -> None:
    """`on_validation_end`: the shards follow the live replicas, but Lightning keeps the loader
    (and its batch count) of the first validation: with fewer replicas it would stop each shard
    early and evaluate part of the set. Rebuild it at the next validation."""
    from lightning_ft.strategy import lightning_compat

    s.reducer.end()
    lightning_compat.rebuild_val_loader(s.module.trainer)


def decide(reducer: CrossReplicaReducer, ask: Callable[[], bool]) -> bool:
    """`reduce_boolean_decision` over every rank of every live replica: `ask()` is the replica's
    own (Lightning's, within the replica); its answer counts as a decision, apart from metrics."""
    active = reducer.active
    if not active:
        reducer.begin("decide")
    reducer.deciding = True
    try:
        return ask()
    finally:
        reducer.deciding = False
        if not active:
            reducer.end()
