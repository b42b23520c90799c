"""The ranks of one replica as a group (docs/ARCHITECTURE.md, "A step"): the collectives the
replica layer runs inside a replica, over its own process group (gloo or NCCL, never FTAR).

Every rank of the replica calls each of them, in the same order. The leader (rank 0) is the
only rank that talks to etcd; `leader_result` hands what it got (or the exception it raised)
to the others, so every rank decides the same and none is left waiting in a collective while
the leader raises. With one rank and no process group they are local.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist


class ReplicaGroup:
    """Rank `rank` of the `world` ranks of one replica, over process group `pg` (None: the
    default group, or no collective at all when world is 1)."""

    def __init__(self, rank: int, world: int, pg: Any = None) -> None:
        self.rank, self.world, self.pg = rank, world, pg

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def _local(self) -> bool:
        return self.pg is None and self.world == 1

    def reduce(self, value: int, op: Any) -> int:
        """`value` reduced with `op` over the ranks."""
        if self._local:
            return int(value)
        t = torch.tensor([int(value)], dtype=torch.int32)
        dist.all_reduce(t, op=op, group=self.pg)
        return int(t.item())

    def any(self, flag: bool) -> bool:
        """OR of `flag` over the ranks."""
        return bool(self.reduce(int(bool(flag)), dist.ReduceOp.MAX))

    def vote(self, vote: int) -> int:
        """The replica's vote: the MIN over its ranks (OK only if every rank voted OK)."""
        return self.reduce(vote, dist.ReduceOp.MIN)

    def gather(self, obj: Any) -> list:
        """`obj` from every rank, in rank order."""
        if self._local:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast(self, obj: Any) -> Any:
        """The leader's `obj` on every rank."""
        if self._local:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def scatter(self, objs: Optional[list]) -> Any:
        """Rank r's item of the leader's `objs` (the others pass None)."""
        if self._local:
            assert objs is not None  # one rank: the leader's
            return objs[0]
        out = [None]
        dist.scatter_object_list(out, objs if self.is_leader else None, src=0, group=self.pg)
        return out[0]

    def leader_result(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on the leader, its result (or its exception, raised) on every rank."""
        got: Any = None
        if self.is_leader:
            try:
                got = fn()
            except Exception as e:  # every rank must raise it, not wait in the broadcast
                got = e
        got = self.broadcast(got)
        if isinstance(got, Exception):
            raise got
        return got
