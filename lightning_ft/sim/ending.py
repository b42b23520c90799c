"""The end of a simulated replica's job: replica/catchup/ending.py's `finish` (with the comparison
of final digests) and `adopt_final`, in simulated time, on a SimReplica (sim/replica.py)."""
from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Generator, Optional

from lightning_ft.coord import keys
from lightning_ft.replica.catchup.ending import (HEAL, SPLIT, WAIT, _read as read_done, done_records, end_verdict,
                                               pending, read_finished)
from lightning_ft.replica.catchup.transfer import wire_version
from lightning_ft.replica.plan import LOST, OK, ReplicaStateLost

if TYPE_CHECKING:
    from lightning_ft.sim.replica import SimReplica


def finish(self: "SimReplica") -> Generator[Any, Any, None]:
    """catchup/ending.py's `finish`: serve the final state, record `finished` and `done`,
    linger while a member behind may still fetch it."""
    assert self.coord is not None and self.writer is not None
    yield from self._etcd()
    root, step = self.coord.root, self.state.step
    self.net.publish(self.rid, self.inc, wire_version(self.state.gen, step), self.model)
    if self.writer.flush() is not None:
        self.state = self.state.disown()
    record = json.dumps({"step": step, "rid": self.rid, "incarnation": self.inc}).encode()
    if not self.store.create(keys.finished(root), record):
        first = read_finished(self.store, root)
        if first is not None and int(first["step"]) < step:
            self.store.put(keys.finished(root), record)
    self.store.put(keys.done(root, self.rid), json.dumps({"step": step, "incarnation": self.inc,
                                                              "gen": self.state.gen}).encode())
    plan = self.last_plan
    others: list[tuple[int, Optional[int]]] = []
    if plan is not None:
        others = [(r, i) for r, i in zip(plan.quorum.members, plan.quorum.incarnations, strict=True)
                  if r != self.rid] + [(r, None) for r, _, _ in plan.quorum.quarantine + plan.quorum.slow]
    t0 = self.world.now
    while others and self.world.now - t0 < self.cfg.linger_s:
        yield from self._etcd()
        done, alive = read_done(self.store, root)
        if not pending(step, others, done, alive):
            break
        yield 0.02
    yield from agree_at_end(self, root, step)
    self.done = True
    self.job.finished(self)
    self.coord.close(revoke=True)

def agree_at_end(self: "SimReplica", root: str, step: int) -> Generator[Any, Any, None]:
    """catchup/ending.py's `_agree` and `_heal`: compare final digests; a strict minority
    takes a majority replica's final state."""
    rec = {"step": step, "incarnation": self.inc, "gen": self.state.gen}
    digest = str(self.model.digest)
    yield from self._etcd()
    self.store.put(keys.done(root, self.rid), json.dumps({**rec, "digest": digest}).encode())
    t1, verdict, src, records = self.world.now, WAIT, None, {}
    while self.world.now - t1 <= self.cfg.linger_s:
        yield from self._etcd()
        records = done_records(self.store, root)
        verdict, src = end_verdict(self.rid, step, digest, records)
        if verdict != WAIT:
            break
        _, alive = read_done(self.store, root)
        if all(rid not in alive for rid, r in records.items() if rid != self.rid and r.get("digest") != digest):
            break
        yield 0.02
    if verdict == SPLIT:  # no strict majority: reported (end_diverged), the replicas end as they are
        self.job.split_at_end = True
        self.job.note(self, "final states differ with no majority")
    if verdict != HEAL or src is None:
        return
    other = records[src]
    vote, got = yield from self.net.fetch((src, int(other["incarnation"])),
                                          wire_version(int(other.get("gen", self.state.gen)), step),
                                          self.cfg.linger_s)
    if vote == OK:
        assert got is not None
        self.model = got
        self.job.note(self, f"took r{src}'s final state at the end")
        yield from self._etcd()
        self.store.put(keys.done(root, self.rid), json.dumps({**rec, "digest": str(got.digest)}).encode())

def adopt_final(self: "SimReplica") -> Generator[Any, Any, bool]:
    """catchup/ending.py's `adopt_final`: behind a finished job it trained in, fetch a done
    replica's final state."""
    yield from self._etcd()
    assert self.coord is not None
    root = self.coord.root
    rec = read_finished(self.store, root)
    if rec is None or not self.state.synced or int(rec["step"]) <= self.state.step:
        return False
    step = int(rec["step"])
    done, alive = read_done(self.store, root)
    for rid in sorted(r for r, s in done.items() if s == step and r in alive and r != self.rid):
        kv = self.store.get(keys.done(root, rid))
        gen = int(json.loads(kv.value).get("gen", 0)) if kv is not None else 0
        vote, got = yield from self.net.fetch((rid, alive[rid]), wire_version(gen, step), self.cfg.linger_s)
        if vote == LOST:
            raise ReplicaStateLost(f"replica {self.rid}: fetching the final state failed midway")
        if vote == OK:
            assert got is not None
            self.model = got
            self.state = replace(self.state, step=step, batches=got.batches)
            return True
    return False
