"""The end of the job (docs/ARCHITECTURE.md, "The end of the job"): the final state, served and fetched.

Each replica commits a step on its own evidence (its ring completed), so the last step can
commit on some replicas while the others abort it. In mid-job that is healed by the next
round: the replicas behind catch up from the one ahead. At the last step nobody trains a next
round: CI saw replica 2 commit step 1200 and finish while replicas 0 and 1 retried 1200,
found the job `finished`, and left at 1199 without the final state.

So a replica that trained to the end (`finish`, every rank):
1. serves its final state (a publication of its state server, as for a catch-up);
2. records `finished` {step, rid, incarnation} (the first finisher's stays) and its own
   `done/{rid}`;
3. lingers while another member of its last quorum, or a replica sitting out a probation or
   quarantine of it, is not done at that step and still alive (`pending`), for at most
   `linger_s`. In the usual end every replica finishes within milliseconds of the others and
   nobody waits;
4. compares its final state's digest with the other done replicas' (`end_verdict`): the steady
   rounds compare digests only every `consistency.every_n_steps`, so a state corrupted after the
   last of them would end the job unseen. A replica in a strict minority fetches the final state
   of one of the majority (which lingers, serving, until it has: at most `linger_s`); with no
   strict majority the replicas end as they are, and an `end_diverged` event names them.

A replica behind the finished step that meets `finished` in its next round (`adopt_final`)
fetches a done replica's final state instead of leaving: it ends at the final step with the
same state, and is done in turn. One that never trained (a restart after the end) still
leaves at once (JobFinished), as does one that finds no done replica alive to fetch from.
"""
from __future__ import annotations

import collections
import json
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from lightning_ft.coord import keys
from lightning_ft.replica.plan import LOST, OK, ReplicaStateLost

if TYPE_CHECKING:
    from lightning_ft.replica.replica import Replica

log = logging.getLogger("lightning_ft.replica")


def pending(step: int, others: Sequence[tuple[int, Optional[int]]], done: Mapping[int, int],
            alive: Mapping[int, int]) -> list[int]:
    """The replicas a finisher at `step` still waits for: of `others` ((rid, incarnation), None
    for any incarnation), those not done at `step` (`done`: rid -> its done step) whose
    incarnation is still alive (`alive`: rid -> the live incarnation, without the evicted)."""
    out = []
    for rid, inc in others:
        if done.get(rid, -1) >= step or rid not in alive:
            continue
        if inc is None or alive[rid] == inc:
            out.append(rid)
    return out


def _others(mgr: Replica) -> list[tuple[int, Optional[int]]]:
    """The members of our last quorum but us, and the replicas sitting out a probation or a
    quarantine of it (any incarnation: they were members before)."""
    plan = mgr.last_plan
    if plan is None:
        return []
    q = plan.quorum
    out: list[tuple[int, Optional[int]]] = [(r, i) for r, i in zip(q.members, q.incarnations, strict=True)
                                            if r != mgr.rid]
    seen = {r for r, _ in out} | {mgr.rid}
    for rid, _, _ in tuple(q.quarantine) + tuple(q.slow):
        if rid not in seen:
            out.append((rid, None))
            seen.add(rid)
    return out


def read_finished(store: Any, root: str) -> Optional[dict]:
    """The `finished` record ({step, rid, incarnation}; older ones lack the last two), or None."""
    kv = store.get(keys.finished(root))
    return json.loads(kv.value) if kv is not None else None


def _by_rid(kvs: Any, field: str) -> dict[int, int]:
    """rid -> int(value[field]) of keys `.../{rid}` holding JSON."""
    out = {}
    for kv in kvs:
        tail = kv.key.rsplit("/", 1)[1]
        if tail.isdigit():
            out[int(tail)] = int(json.loads(kv.value)[field])
    return out


def _read(store: Any, root: str) -> tuple[dict[int, int], dict[int, int]]:
    """(done: rid -> step, alive: rid -> live incarnation, evicted ones left out)."""
    done = _by_rid(store.get_prefix(keys.done(root))[0], "step")
    alive = _by_rid(store.get_prefix(keys.alive(root))[0], "incarnation")
    evicts, _ = store.get_prefix(keys.evict(root))
    evicted = {tuple(int(p) for p in kv.key[len(keys.evict(root)):].split("/")) for kv in evicts}
    return done, {rid: inc for rid, inc in alive.items() if (rid, inc) not in evicted}


AGREE, WAIT, HEAL, SPLIT = "agree", "wait", "heal", "split"


def end_verdict(me: int, step: int, mine: str, records: Mapping[int, dict]) -> tuple[str, Optional[int]]:
    """Pure: what a replica done at `step` with final digest `mine` does, given the done records
    ({rid: {"step", "digest"?}}; a record of another step, or without a digest, is not compared):
    AGREE (every digest is ours), WAIT (a record at `step` has no digest yet, or we are in a strict
    majority and another differs: it heals from us), HEAL with the lowest rid of a strict majority
    holding another digest (fetch its state), or SPLIT (no strict majority)."""
    at = {rid: r.get("digest") for rid, r in records.items() if rid != me and int(r.get("step", -1)) == step}
    if any(not d for d in at.values()):
        return WAIT, None
    at[me] = mine
    counts = collections.Counter(at.values())
    top, n = counts.most_common(1)[0]
    if len(counts) == 1:
        return AGREE, None
    if 2 * n <= len(at):
        return SPLIT, None
    return (WAIT, None) if top == mine else (HEAL, min(r for r, d in at.items() if d == top))


def done_records(store: Any, root: str) -> dict[int, dict]:
    """rid -> its `done/` record."""
    return {int(kv.key.rsplit("/", 1)[1]): json.loads(kv.value) for kv in store.get_prefix(keys.done(root))[0]
            if kv.key.rsplit("/", 1)[1].isdigit()}


def _agree(mgr: Replica, digest: str, record: dict, linger_s: float) -> Optional[tuple[int, list[str], int]]:
    """Leader: publish our final digest and wait for the verdict; the source to heal from, or None."""
    store, root = mgr.store, mgr.root
    store.put(keys.done(root, mgr.rid), json.dumps({**record, "digest": digest}).encode())
    t0 = time.monotonic()
    verdict, src = WAIT, None
    while time.monotonic() - t0 <= linger_s:
        records = done_records(store, root)
        verdict, src = end_verdict(mgr.rid, mgr.step, digest, records)
        if verdict != WAIT:
            break
        _, alive = _read(store, root)
        if all(rid not in alive for rid, r in records.items() if rid != mgr.rid and r.get("digest") != digest):
            break  # whoever differs (or has not compared yet) is gone
        time.sleep(0.02)
    if verdict == SPLIT or verdict == WAIT and src is None and time.monotonic() - t0 > linger_s:
        log.error("replica %d: the job ended at step %d with replica states that differ (digests %s); no strict "
                  "majority, or a replica did not heal in time", mgr.rid, mgr.step,
                  {r: d.get("digest") for r, d in done_records(store, root).items()})
        mgr.event("end_diverged", replica=mgr.rid, step=mgr.step, verdict=verdict)
    if verdict != HEAL or src is None:
        return None
    addrs = mgr.coord.addresses(src, int(records[src].get("incarnation", 0)))
    if addrs is None or len(addrs[1]) != mgr.world:
        return None
    return src, list(addrs[1]), int(records[src].get("gen", mgr.state.gen))


def finish(mgr: Replica, linger_s: float) -> None:
    """This replica trained to the end (every rank calls it): serve the final state, record
    `finished` and `done`, and linger while a member that is behind may still fetch it."""
    others = _others(mgr)
    done_rec = {"step": mgr.step, "incarnation": mgr.incarnation, "gen": mgr.state.gen}
    if others and mgr.started:
        mgr.transfer.publish(mgr.step, mgr.batches, {f"{r}/{k}" for r, _ in others for k in range(mgr.world)},
                             mgr.state.gen)
    if mgr.is_leader:
        store, root = mgr.store, mgr.root
        mgr.flush_ledger()
        record = json.dumps({"step": mgr.step, "rid": mgr.rid, "incarnation": mgr.incarnation}).encode()
        if not store.create(keys.finished(root), record):
            first = read_finished(store, root)  # a replica that finished first: its record stays
            if first is not None and int(first["step"]) < mgr.step:
                store.put(keys.finished(root), record)
        store.put(keys.done(root, mgr.rid), json.dumps(done_rec).encode())
        t0 = time.monotonic()
        late: list[int] = []
        while others:
            done, alive = _read(store, root)
            late = pending(mgr.step, others, done, alive)
            if not late or time.monotonic() - t0 > linger_s:
                break
            time.sleep(0.02)
        waited = time.monotonic() - t0
        if late:
            log.warning("replica %d: finished at step %d; replicas %s neither fetched the final state nor ended "
                        "within %.0f s", mgr.rid, mgr.step, late, linger_s)
        if waited > 0.5 or late:
            mgr.event("finish", replica=mgr.rid, step=mgr.step, waited_s=round(waited, 3), late=late)
    digest = mgr.final_digest() if mgr.started else ""  # every rank; the leader's is the replica's
    heal = None
    if mgr.is_leader and digest:
        try:
            heal = _agree(mgr, digest, done_rec, linger_s)
        except Exception as e:  # etcd trouble at the very end: end as we are
            log.warning("replica %d: could not compare the final state: %s", mgr.rid, e)
    heal = mgr.broadcast(heal)  # every rank serves until the leader stops waiting
    if heal is not None:
        _heal(mgr, heal, done_rec, linger_s)


def _heal(mgr: Replica, heal: tuple[int, list[str], int], record: dict, linger_s: float) -> None:
    """Every rank: our final state is a minority's: take the majority's, and say so."""
    src, addrs, gen = heal
    t0 = time.perf_counter()
    vote = mgr.group.vote(mgr.fetch_from(addrs[mgr.rank], mgr.step, src, deadline_s=linger_s, gen=gen))
    if vote == LOST:
        raise ReplicaStateLost(f"replica {mgr.rid}: fetching replica {src}'s final state failed midway")
    digest = mgr.final_digest()
    if vote != OK or not mgr.is_leader:
        return
    mgr.store.put(keys.done(mgr.root, mgr.rid), json.dumps({**record, "digest": digest}).encode())
    log.warning("replica %d: its final state at step %d differed from the majority's; it took replica %d's "
                "(%.3f s)", mgr.rid, mgr.step, src, time.perf_counter() - t0)
    mgr.event("diverged", replica=mgr.rid, step=mgr.step, source=src, at="end")


def _final_source(mgr: Replica) -> Optional[tuple[int, int, list[str], int]]:
    """Leader: (the final step, a done replica at it, its ranks' state-server addresses, the
    generation it ended in) when this replica is behind a finished job it trained in, else None."""
    store, root = mgr.store, mgr.root
    rec = read_finished(store, root)
    if rec is None or not mgr.synced:
        return None
    step = int(rec["step"])
    if step <= mgr.step:
        return None
    done, alive = _read(store, root)
    for rid in sorted(r for r, s in done.items() if s == step and r in alive and r != mgr.rid):
        addrs = mgr.coord.addresses(rid, alive[rid])
        if addrs is not None and len(addrs[1]) == mgr.world:
            kv = store.get(keys.done(root, rid))
            gen = int(json.loads(kv.value).get("gen", 0)) if kv is not None else 0
            return step, rid, list(addrs[1]), gen
    return None


def adopt_final(mgr: Replica, linger_s: float) -> bool:
    """Every rank, on JobFinished in a round: fetch a done replica's final state if this
    replica is behind it. Returns whether it now holds the final state (False: it leaves as a
    late replica does)."""
    src = None
    if mgr.is_leader:
        try:
            src = _final_source(mgr)
        except Exception as e:  # etcd trouble: leave as before
            log.warning("replica %d: could not look for the final state: %s", mgr.rid, e)
    src = mgr.broadcast(src)
    if src is None:
        return False
    step, rid, addrs, gen = src
    t0 = time.perf_counter()
    vote = mgr.group.vote(mgr.fetch_from(addrs[mgr.rank], step, rid, deadline_s=linger_s, gen=gen))
    if vote == LOST:
        raise ReplicaStateLost(f"replica {mgr.rid}: fetching replica {rid}'s final state failed midway; the state "
                               "is partly overwritten")
    if vote != OK:
        return False
    mgr.state = replace(mgr.state, step=step)
    mgr.disarm()
    if mgr.is_leader:
        seconds = time.perf_counter() - t0
        print(f"lightning-ft: replica {mgr.rid} ended behind the job: fetched replica {rid}'s final state at step "
              f"{step} in {seconds:.3f} s", flush=True)
        mgr.event("final_adopted", replica=mgr.rid, source=rid, step=step, seconds=round(seconds, 4))
    return True


def finished_record(etcd_cfg: Any, job: str, endpoints: str, secret: str, run_id: str = "") -> Optional[str]:
    """At start-up: the `finished` record of the job's current run (as text), None while it runs
    (or has no run yet). One etcd connection, closed before returning."""
    from lightning_ft.coord.runs import current_run
    from lightning_ft.coord.etcd_config import store_from_config
    from lightning_ft.secret import tag

    store = store_from_config(etcd_cfg, endpoints)
    try:
        run = current_run(store, etcd_cfg.prefix, job, tag(secret, job), run_id)
        kv = store.get(keys.finished(keys.root(etcd_cfg.prefix, job, run))) if run else None
        return kv.value.decode() if kv else None
    finally:
        store.close()
