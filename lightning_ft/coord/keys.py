"""Every etcd key of a job, in one place (docs/ARCHITECTURE.md, "Keyspace").

A job id names `{prefix}/{job}/run`, the record of its current run (coord/runs.py), and
each run's keys live under `root = {prefix}/{job}/runs/{run}/`: a job id used again never
inherits another run's `finished`, cursors or evictions. (`root(prefix, job)` without a run
is the bare layout that unit tests of one component use.) Nothing else formats a key
string; the launcher, the coordinator, the replica manager, the ledger and the tests all
call these.

    config                         job fingerprint (create-if-absent by the first leader)
    members/{rid}                  a leader's per-round Report, bound to its lease (watched
                                   by the round's decider and the supervisor only)
    alive/{rid}                    {"incarnation": n}, bound to the same lease: written once per
                                   lease, watched by every leader for failures and joiners
    addrs/{rid}/{inc}/{block:06d}  per-rank listener addresses of an incarnation, BLOCK_RANKS
                                   ranks a key, bound to its lease (coord/addresses.py)
    evict/{rid}/{inc}              a failure, written by a supervisor or a leader
    left/{rid}/{inc}               a clean exit (so the supervisor does not call it a hang)
    quorum/{round:012d}            the decided Quorum of a round (or a halt record)
    commits/{gen:04d}/{step:012d}/{rid}   the exactly-once ledger
    cursor/{gen:04d}/{slot}        next batch of a slot in history generation gen
    rewinds/{gen:04d}              how generation gen began: {from, to, checkpoint, cursors}
    ckpt/latest, ckpt/{step:012d}  published persistent checkpoints
    finished                       the job trained to completion: {step, rid, incarnation}
    done/{rid}                     a replica ended at the final step: {step, incarnation}
                                   (a finisher serves its state until the others are done;
                                   replica/catchup/ending.py)
    halt                           the job stopped on an error every replica must obey
    launchers/{name}               a live launcher of this run, bound to its lease
    stall/{rid}                    a leader's exchange waiting past hang.report_after_s: its FTAR
                                   neighbours and link counters, bound to its lease (coord/hang.py)
    standby/{token}                a warm spare waiting to be promoted: {host, world, since},
                                   bound to its lease (coord/standby.py)
    promote/{token}                the replica a spare takes: {rid, incarnation} (create-if-absent,
                                   by whoever assigns it: the supervisor, a test)
"""
from __future__ import annotations


def root(prefix: str, job: str, run: str = "") -> str:
    """The keyspace of `run` of `job` (see the module docstring)."""
    base = f"{prefix.rstrip('/')}/{job}/"
    return f"{base}runs/{run}/" if run else base


def run_record(prefix: str, job: str) -> str:
    """The record of the job's current run: {id, tag, started, by}."""
    return f"{prefix.rstrip('/')}/{job}/run"


def launchers(root: str, name: str | None = None) -> str:
    return f"{root}launchers/" + ("" if name is None else name)


def config(root: str) -> str:
    return f"{root}config"


def members(root: str, rid: int | None = None) -> str:
    return f"{root}members/" + ("" if rid is None else str(rid))


def alive(root: str, rid: int | None = None) -> str:
    return f"{root}alive/" + ("" if rid is None else str(rid))


def addrs(root: str, rid: int | None = None, inc: int | None = None, block: int | None = None) -> str:
    """Prefix of every replica's addresses, of one replica, of one incarnation, or one block."""
    out = f"{root}addrs/"
    if rid is not None:
        out += f"{rid}/"
        if inc is not None:
            out += f"{inc}/"
            if block is not None:
                out += f"{block:06d}"
    return out


def evict(root: str, rid: int | None = None, inc: int | None = None) -> str:
    if rid is None:
        return f"{root}evict/"
    return f"{root}evict/{rid}/" + ("" if inc is None else str(inc))


def left(root: str, rid: int, inc: int) -> str:
    return f"{root}left/{rid}/{inc}"


def quorum(root: str, round: int | None = None) -> str:
    return f"{root}quorum/" + ("" if round is None else f"{round:012d}")


def round_of(key: str) -> int:
    """The round number of a `quorum/` key."""
    return int(key.rsplit("/", 1)[1])


def commits(root: str, gen: int | None = None, step: int | None = None) -> str:
    """Prefix of the ledger, of one generation, or of one step of one generation."""
    out = f"{root}commits/"
    if gen is not None:
        out += f"{gen:04d}/"
        if step is not None:
            out += f"{step:012d}/"
    return out


def commit(root: str, gen: int, step: int, rid: int) -> str:
    return f"{commits(root, gen, step)}{rid}"


def parse_commit(root: str, key: str) -> tuple[int, int, int]:
    """(gen, step, rid) of a `commits/` key."""
    gen, step, rid = key[len(commits(root)):].split("/")
    return int(gen), int(step), int(rid)


def cursor(root: str, slot: int, gen: int = 0) -> str:
    return f"{root}cursor/{gen:04d}/{slot}"


def rewinds(root: str, gen: int | None = None) -> str:
    return f"{root}rewinds/" + ("" if gen is None else f"{gen:04d}")


def ckpt_latest(root: str) -> str:
    return f"{root}ckpt/latest"


def ckpts(root: str) -> str:
    """Prefix of the published checkpoints (`ckpt/{step}`; `ckpt/latest` is not under it)."""
    return f"{root}ckpt/steps/"


def ckpt(root: str, step: int) -> str:
    return f"{ckpts(root)}{step:012d}"


def finished(root: str) -> str:
    return f"{root}finished"


def done(root: str, rid: int | None = None) -> str:
    return f"{root}done/" + ("" if rid is None else str(rid))


def halt(root: str) -> str:
    return f"{root}halt"


def stall(root: str, rid: int | None = None) -> str:
    return f"{root}stall/" + ("" if rid is None else str(rid))


def standby(root: str, token: str | None = None) -> str:
    return f"{root}standby/" + ("" if token is None else token)


def promote(root: str, token: str | None = None) -> str:
    return f"{root}promote/" + ("" if token is None else token)
