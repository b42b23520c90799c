"""The per-round quorum decision, as a pure function (docs/ARCHITECTURE.md, "The quorum").

`compute_quorum` looks at what the replica leaders reported for a round and decides who
trains in it, and how. It does no I/O and reads no clock: the coordinator passes it the
member reports, the evictions, the previous quorum, what the job's history says (the
newest committed step, the published checkpoints) and how long it has waited. It returns
a `Decision` whose `reason` says why, in words a person can act on.

Rules, in order:
1. A report counts for round r if it was made for round >= r, its (replica, incarnation)
   is not evicted or quarantined, and its job fingerprint equals the job's. Mismatched
   fingerprints are refused with the differing fields named. A joiner's report (`joining`:
   a process that has adopted no quorum yet, and is not in the previous one) counts for
   every round: it names the round after the newest one recorded in etcd, which lags the
   survivors' steady rounds (recorded in the background), so a joiner registering at 4 ms
   steps reported for rounds the others had passed and was never taken in.
2. If some member of the previous quorum survives, the round waits until every surviving
   previous member has reported. A member is gone when its key is gone (lease expired),
   it is evicted, or a newer incarnation replaced it. Joiners who reported in time are
   taken in; the healthy replicas never wait for a joiner.
3. Otherwise (job start, or every previous member died) the round waits until all R
   replicas report, or `init_timeout_s` passes with at least `min_replicas`.
4. Fewer than `min_replicas` valid reports: no quorum, training waits, and says why.
5. Partitions: when the previous round already asked for a ring reset with the same
   members and this one asks again, naming a peer it failed with (`blame`), that is a
   strike; a reset without blame (an abort to leave the steady rounds) is not. At `STRIKES` strikes one member is
   excluded: the one the others blamed most (ties: the highest id), quarantined for
   `QUARANTINE_ROUNDS * 2**k` rounds on its k-th exclusion. An FTAR-only partition (etcd
   still reaches both sides) thus ends in a bounded number of rounds.
6. Valid state. A member's state is usable when it belongs to the job's current history
   generation (`gen`), or it is an initial state (step 0, not disowned: a disowned state
   reports generation -1 and may hold anything). M is the highest usable step.
7. Rewind. When M is below the job's newest committed step H (every replica holding it
   died), the job rewinds to T = max(M, newest usable checkpoint <= H): a new generation
   whose first round is a sync round from the replica holding T (or loading the
   checkpoint). Commits of the old generation at steps >= T are superseded. No state and
   no checkpoint at all: the rewind goes to step 0 from a fresh replica.
8. Sync. Contributors are the synced members (committed or adopted in this generation)
   at M. When there are none (the job's first round, or after `--resume`), the round is a
   *sync* round: everyone adopts the state of the lowest-id member at M, nobody trains.
   Provenance: each report names the (round, epoch) that made its state (`made`). Of the
   contributors only those made by the newest round count; older ones are *stale* (that
   round redid their step without them, e.g. after their lease lapsed) and catch up. Sync
   and rewind sources are likewise the newest-made state at M, then the lowest id.
9. Divergence guard. Contributors that report a state digest of step M are compared: a
   minority group is *diverged* and heals as lagging (catch-up from the majority); with
   no strict majority the job halts (`Decision.halt`) naming the replicas and the step.
10. Members are sorted by replica id (the ring order). Members that are not contributors
   are `lagging`: they send zeros and catch up from a contributor.
11. Stop. A member that asks to stop (`stop`) makes the round a stop round for everyone.
12. The epoch stays when the (replica, incarnation) set is unchanged and no member asks for
   a ring reset (`ring_ok=False` after a failed exchange); otherwise it goes up by one.
   FTAR reconfigures when it changes.
13. Batches. Under batch_policy "constant" a train round carries the cursor of every slot
   (`slot_cursors`): contributors' as reported, the others' from the ledger (History), so
   that contributors train the absent slots too (replica/batch_policy.py).
14. Stragglers (coord/stragglers.py): a member whose reported compute time is
   `JobSpec.straggler_threshold` times the median of the others' in two non-overlapping
   windows (`Quorum.suspects` holds the first) is a straggler (`Decision.stragglers`).
   Under policy "exclude" the slowest one is benched (`Quorum.slow`; not a member, not waited
   for), unless that would leave fewer than min_replicas members. A benched replica's report
   (`bench` >= 0) counts for every round; it is set aside before rule 5 and readmitted, as a
   member that lags, once its probe (its pace outside the rounds) is within the threshold of
   the members' over a whole span (`Decision.readmitted`; `Quorum.parole` keeps its count).
   Under policy "shrink" a straggler that can split its slot batch keeps training fewer
   micro-batches (`Quorum.shrink_next`, announced a round ahead, in effect as `Quorum.shrunk`
   in the train rounds after it, for its contributors); one that cannot is benched as under
   "exclude"; "adaptive" also benches one that a split cannot bring within the threshold.
   `Quorum.pace_ms` records the members' median measure.
15. Optimizer steps (manual optimization with several optimizers; after rule 8): every
   `optimizer.step()` is one round. A report names the optimizer its next round steps
   (`opt`; -1: not known yet, a replica before its first batch) and whether that round
   continues a batch whose first step it committed (`cont`). When a contributor continues a
   batch, the round does (`Quorum.cont`, `Quorum.opt`: the lowest-id such contributor's);
   contributors at a batch boundary (a restarted replica that caught up to the same step)
   or naming another optimizer sit it out as lagging: they apply that optimizer's step by
   catch-up. Otherwise the round starts a batch with the lowest-id contributor's known
   optimizer, else the one batches started with so far (`Quorum.first`, carried from round
   to round), else -1 (the job's first batch, before anyone stepped). One optimizer: every
   report says (0, False), no change.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Mapping, Optional

from lightning_ft.constants import Role
from lightning_ft.coord import straggler_rule, stragglers
from lightning_ft.coord.round_records import (SYNC, TRAIN, Decision, History, JobSpec, Quorum, Report)

_NO_HISTORY = History()

MAX_STEADY_STEPS = 64
"""A full round at least at every multiple of this step, even when nothing changes."""
STRIKES = 3
"""Consecutive ring-reset rounds with unchanged members before one member is excluded."""
QUARANTINE_ROUNDS = 4
"""Rounds an excluded member sits out on its first exclusion (doubling on each repeat)."""


SECRET_FIELD = "secret_tag"
"""Fingerprint field derived from the job secret: a difference is named, its values never shown."""


FIELD_HINTS = {"params": "the model's parameter names, shapes and dtypes: "}
"""Fingerprint fields whose values alone do not say what they are."""


def fingerprint_diff(job: Mapping[str, object], mine: Mapping[str, object]) -> str:
    """'' if equal, else a readable list of differences like 'replicas (4 != 3)'."""
    keys = sorted(set(job) | set(mine))
    diffs = [f"{k} ({FIELD_HINTS.get(k, '')}{mine.get(k)!r} != {job.get(k)!r})" if k != SECRET_FIELD
             else "secret (not the job's secret)" for k in keys if job.get(k) != mine.get(k)]
    return ", ".join(diffs)


def _names(rids) -> str:
    return " ".join(f"r{r}" for r in rids) or "none"


def _quarantined(round: int, previous: Optional[Quorum]) -> dict[int, int]:
    """Replicas sitting out `round` by rule 5's quarantine (rule 14's benched are set aside later)."""
    entries = previous.quarantine if previous else ()
    return {rid: until for rid, until, _ in entries if round < until}


def _valid(round: int, reports: Mapping[int, Report], evicted, job: JobSpec,
           quarantined: Mapping[int, int], previous: Optional[Quorum] = None
           ) -> tuple[dict[int, str], dict[int, Report]]:
    """Rule 1: (refused with why, valid reports) of a round."""
    members = previous.member_set() if previous is not None else frozenset()
    refused: dict[int, str] = {}
    valid: dict[int, Report] = {}
    for rid, rep in sorted(reports.items()):
        if (rid, rep.incarnation) in evicted:
            continue
        diff = fingerprint_diff(job.fingerprint, rep.fingerprint)
        if diff:
            refused[rid] = f"replica {rid} (incarnation {rep.incarnation}) refused: job config differs in {diff}"
            continue
        # a joiner, or a benched straggler (rule 14), waits outside the rounds: it counts for every one
        outside = (rep.joining or rep.bench >= 0) and (rid, rep.incarnation) not in members
        if (rep.round >= round or outside) and rid not in quarantined:
            valid[rid] = rep
    return refused, valid


def _survivors(reports: Mapping[int, Report], evicted, previous: Optional[Quorum], refused: Mapping[int, str],
               quarantined: Mapping[int, int]) -> list[int]:
    """Rule 2: members of the previous quorum still alive (key present, same incarnation, not
    evicted, refused or quarantined)."""
    survivors: list[int] = []
    for rid, inc in zip(previous.members, previous.incarnations, strict=True) if previous is not None else ():
        rep = reports.get(rid)
        if rep is None or rep.incarnation != inc or (rid, inc) in evicted or rid in refused:
            continue  # gone: expired, evicted, or replaced by a new incarnation
        if rid in quarantined:
            continue
        survivors.append(rid)
    return survivors


def _waiting(round: int, valid: Mapping[int, Report], survivors: list[int], job: JobSpec, waited_s: float) -> str:
    """Rules 2 and 3: why the round cannot be decided yet ("" once it can)."""
    missing = [r for r in survivors if r not in valid]
    if missing:
        return f"round {round}: waiting for {_names(missing)} to report (previous members; {len(valid)} reported)"
    if not survivors and len(valid) < job.replicas and waited_s < job.init_timeout_s:
        absent = [r for r in range(job.replicas) if r not in valid]
        return (f"round {round}: starting, waiting for {len(valid)} of {job.replicas} replicas: "
                f"{_names(absent)} not reported ({waited_s:.1f}s of {job.init_timeout_s:.1f}s)")
    return ""


def waiting_for(round: int, reports: Mapping[int, Report], evicted, previous: Optional[Quorum], job: JobSpec,
                waited_s: float = 0.0) -> str:
    """Why `compute_quorum` would still wait on these reports ("" when it would decide or
    refuse for another reason). The round's decider runs this on the reports its watch
    delivers, and reads etcd for the real decision only once it is "": one evaluation a
    round instead of one per report."""
    quarantined = _quarantined(round, previous)
    refused, valid = _valid(round, reports, evicted, job, quarantined, previous)
    return _waiting(round, valid, _survivors(reports, evicted, previous, refused, quarantined), job, waited_s)


def compute_quorum(
    round: int,
    reports: Mapping[int, Report],
    evicted: frozenset[tuple[int, int]] | set[tuple[int, int]],
    previous: Optional[Quorum],
    job: JobSpec,
    waited_s: float = 0.0,
    history: History = _NO_HISTORY,
) -> Decision:
    """Decide the quorum of `round`; see the module docstring for the rules."""
    quarantined = _quarantined(round, previous)
    refused, valid = _valid(round, reports, evicted, job, quarantined, previous)
    survivors = _survivors(reports, evicted, previous, refused, quarantined)
    wait = _waiting(round, valid, survivors, job, waited_s)
    if wait:
        return Decision(None, wait, refused)

    # Rule 14, first part: benched stragglers wait outside; rule 5 judges the members alone.
    benched = straggler_rule.set_aside(valid, previous)

    # Rule 5: a partition that keeps breaking the ring excludes one member.
    strikes, quarantine, excluded = _strikes(round, valid, previous)
    for rid in excluded:
        valid.pop(rid)

    # Rule 14: stragglers (coord/straggler_rule.py).
    r14 = straggler_rule.apply(round, valid, benched, reports, evicted, refused, previous, job)
    verdict, shrink_next = r14.verdict, r14.shrink_next

    # Rule 4: min_replicas.
    if len(valid) < job.min_replicas:
        return Decision(None, f"round {round}: below min_replicas: {len(valid)} of {job.min_replicas} needed "
                              f"({_names(valid)} alive); training waits for replicas to join", refused)

    members = tuple(sorted(valid))
    incs = tuple(valid[r].incarnation for r in members)
    member_set = frozenset(zip(members, incs, strict=True))
    gen = previous.gen if previous is not None else history.gen
    verified = previous.verified_step if previous is not None else -1

    # Rules 6-8: usable states, rewind, sync.
    usable = {r: valid[r].step for r in members if valid[r].gen == gen or (valid[r].step == 0 and valid[r].gen >= 0)}
    top = max(usable.values(), default=-1)
    kind, rewind, notes = TRAIN, None, []
    stale: dict[int, tuple[tuple[int, int], tuple[int, int]]] = {}
    contributors: tuple[int, ...]
    if top < history.committed_step:
        bad = {s for r in members for s in valid[r].bad_checkpoints}
        ckpts = sorted((s, p) for s, p in history.checkpoints if s <= history.committed_step and s not in bad)
        ck_step, ck_path = ckpts[-1] if ckpts else (-1, "")
        if top < 0 and ck_step < 0:
            return Decision(None, f"round {round}: rewind needed (the job reached step {history.committed_step}, "
                                  f"no replica holds a usable state) but there is no checkpoint; waiting for a "
                                  f"fresh replica", refused)
        gen += 1
        if top >= ck_step:
            max_step, source, ck_path, ck_step = top, _newest(valid, usable, top), "", -1
            src_text = f"r{source}'s state" if top > 0 else f"step 0 (no checkpoint; initial state of r{source})"
        else:
            max_step, source = ck_step, members[0]
            src_text = f"checkpoint step {ck_step}, loaded by r{source}"
        rewind = {"from": history.committed_step, "to": max_step, "checkpoint": ck_path, "checkpoint_step": ck_step}
        kind, verified = SYNC, -1
        notes.append(f"rewind from step {history.committed_step} to {max_step} ({src_text}), generation {gen}")
        contributors = (source,)
    else:
        max_step = top
        contributors = tuple(r for r in members if usable.get(r) == top and valid[r].synced and valid[r].gen == gen)
        if contributors:
            # Rule 8, provenance: states at the same step made by different rounds are not the
            # same state. The newer round redid the step without the older one's makers (their
            # lease lapsed, they were excluded): the older ones are stale, and heal by catch-up.
            newest = max(valid[r].made for r in contributors)
            stale = {r: (valid[r].made, newest) for r in contributors if valid[r].made < newest}
            if stale:
                contributors = tuple(r for r in contributors if valid[r].made == newest)
                notes.append(f"stale {_names(stale)} at step {max_step}: made by round "
                             + ", ".join(f"{valid[r].made[0]} (r{r})" for r in stale)
                             + f", which round {newest[0]} redid without them; healing by catch-up")
        else:
            kind = SYNC
            contributors = (_newest(valid, usable, top),)
            notes.append(f"sync: every replica adopts r{contributors[0]}'s state")
            if previous is not None and previous.rewind and previous.gen == gen and previous.rewind["to"] == top:
                rewind = dict(previous.rewind)  # its source failed before seeding the generation (seed 5255)

    # Rule 15: optimizer steps of one batch.
    opt, cont = 0, False
    first = previous.first if previous is not None else -1
    if kind == TRAIN and contributors:
        opt, cont, sit = phase_of({r: (valid[r].opt, valid[r].cont) for r in contributors}, first)
        if not cont and opt >= 0:
            first = opt
        if sit:
            contributors = tuple(r for r in contributors if r not in sit)
            notes.append(f"{_names(sit)} sit out optimizer {opt}'s step "
                         + ("continuing a batch (they are at a batch boundary)" if cont else "(another optimizer)"))

    # Rule 9: the divergence guard.
    diverged: dict[int, tuple[str, str]] = {}
    if kind == TRAIN:
        digests = {r: valid[r].digest for r in contributors if valid[r].digest and valid[r].digest_step == max_step}
        groups = Counter(digests.values())
        if len(groups) > 1:
            (best, n), *rest = groups.most_common()
            listing = ", ".join(f"r{r}={d}" for r, d in sorted(digests.items()))
            if 2 * n <= len(digests):
                return Decision(None, f"round {round}: replicas diverged at step {max_step} with no majority "
                                      f"({listing})", refused,
                                halt=f"replica states diverged at step {max_step} and no majority agrees: "
                                     f"{listing}. The job stops; resume it from the last verified checkpoint "
                                     f"(step <= {verified}) with `lightning-ft run --resume RUN_DIR`")
            diverged = {r: (d, best) for r, d in digests.items() if d != best}
            contributors = tuple(r for r in contributors if r not in diverged)
            notes.append(f"diverged {_names(diverged)} at step {max_step} (majority {best}); healing by catch-up")
        if digests:
            verified = max_step
    lagging = tuple(r for r in members if r not in contributors)

    # Rule 11: the epoch.
    if previous is None:
        epoch, change = 0, "first quorum"
    elif member_set == previous.member_set():
        broken = [r for r in members if not valid[r].ring_ok]
        if broken:
            epoch, change = previous.epoch + 1, f"ring reset requested by {_names(broken)}"
        else:
            epoch, change = previous.epoch, "unchanged"
    else:
        epoch = previous.epoch + 1
        before = previous.member_set()
        joined = sorted(r for r, i in member_set - before)
        left = sorted(r for r, i in before - member_set)
        parts = []
        if joined:
            parts.append(f"joined {_names(joined)}")
        if left:
            parts.append(f"left {_names(left)}")
        change = ", ".join(parts)
    if excluded:
        notes.append(f"excluded {_names(excluded)} after {STRIKES} failed ring rounds (partition)")
    notes += r14.notes(job.straggler_threshold)
    shrunk = stragglers.effective(previous.shrink_next, contributors) \
        if previous is not None and kind == TRAIN and not cont else ()
    if shrunk or shrink_next:
        notes.append("shrink " + (", ".join(f"r{r} trains {n - g} of {n} micro-batches" for r, g, n in shrunk)
                                  or "none") + (f" (next: {', '.join(f'r{r} {n - g}/{n}' for r, g, n in shrink_next)})"
                                                if shrink_next != shrunk else ""))
    reason = (f"round {round} epoch {epoch}: {len(members)}/{job.replicas} replicas [{_names(members)}] ({change}); "
              f"max_step {max_step}")
    if lagging:
        word = "adopting" if kind == SYNC else "lagging"
        reason += f"; {word} {_names(lagging)} (" + ", ".join(f"r{r} at {valid[r].step}" for r in lagging) + ")"
    for note in notes:
        reason += f"; {note}"
    if refused:
        reason += f"; refused {_names(refused)}"
    slot_cursors: tuple[int, ...] = ()
    if job.batch_policy == "constant" and kind == TRAIN:
        slot_cursors = tuple(valid[s].cursor if s in contributors else int(history.cursors.get(s, 0))
                             for s in range(job.replicas))
    q = Quorum(round=round, epoch=epoch, members=members, incarnations=incs, max_step=max_step,
               contributors=contributors, lagging=lagging, slot_cursors=slot_cursors,
               cursors=tuple(valid[r].cursor for r in members), reason=reason, gen=gen, kind=kind,
               rewind=rewind, diverged=tuple(sorted(diverged)), verified_step=verified, strikes=strikes,
               quarantine=quarantine, slow=verdict.standing.slow, parole=verdict.standing.parole,
               pace_ms=verdict.standing.pace_ms, suspects=verdict.standing.suspects,
               stop=any(valid[r].stop for r in members),
               shrunk=shrunk, shrink_next=shrink_next,
               opt=opt, cont=cont, first=first)
    return Decision(q, reason, refused, diverged=diverged, stale=stale, stragglers=verdict.stragglers,
                    excluded_straggler=verdict.excluded, readmitted=r14.readmitted)


def phase_of(phases: Mapping[int, tuple[int, bool]], first: int = -1) -> tuple[int, bool, tuple[int, ...]]:
    """Rule 15: (optimizer, continues a batch, contributors that sit out) of a train round from
    its contributors' (opt, cont). A batch in progress goes on: its lowest-id continuer names
    the optimizer, and everyone not continuing with that optimizer sits out. Else the round
    starts a batch with the lowest-id known optimizer (else `first`, the one batches started
    with so far); those naming another sit out, those that do not know theirs yet (-1) train
    whatever it is."""
    rids = sorted(phases)
    conts = [r for r in rids if phases[r][1]]
    if conts:
        opt = phases[conts[0]][0]
        return opt, True, tuple(r for r in rids if phases[r] != (opt, True))
    known = [phases[r][0] for r in rids if phases[r][0] >= 0]
    opt = known[0] if known else first
    return opt, False, tuple(r for r in rids if phases[r][0] not in (opt, -1))


def _newest(valid: Mapping[int, Report], usable: Mapping[int, int], top: int) -> int:
    """The source among the usable states at `top`: the one made by the newest round (rule 8),
    then the lowest id."""
    at_top = [r for r, s in usable.items() if s == top]
    newest = max(valid[r].made for r in at_top)
    return min(r for r in at_top if valid[r].made == newest)


def _strikes(round: int, valid: Mapping[int, Report], previous: Optional[Quorum]
             ) -> tuple[int, tuple[tuple[int, int, int], ...], list[int]]:
    """Rule 5: (strikes, quarantine list, members to exclude now)."""
    entries = {rid: (until, k) for rid, until, k in (previous.quarantine if previous else ())}
    if previous is None:
        return 0, (), []
    member_set = frozenset((r, p.incarnation) for r, p in valid.items())
    # A strike needs a failure that names a peer: a ring reset asked for without blame (a
    # member aborting the steady rounds of the others to go to a full round, or the abort of
    # such a member reaching us) is no evidence of a partition.
    broken = [r for r, p in valid.items() if not p.ring_ok and p.blame]
    same = member_set == previous.member_set()
    strikes = previous.strikes + 1 if (same and broken) else 0
    excluded: list[int] = []
    if strikes >= STRIKES:
        blamed = Counter(b for r in broken for b in valid[r].blame if b in valid and b != r)
        pool = blamed or Counter({r: 1 for r in broken})  # blamed ones have left: one of the blamers
        top = max(pool.values())
        victim = max(r for r, n in pool.items() if n == top)
        k = entries.get(victim, (0, 0))[1]
        entries[victim] = (round + QUARANTINE_ROUNDS * 2 ** k, k + 1)
        excluded, strikes = [victim], 0
    if not broken and not excluded:  # a healthy ring with them: members that are back are forgiven
        entries = {r: e for r, e in entries.items() if not (r in valid and r in previous.members)}
    quarantine = tuple(sorted((r, until, k) for r, (until, k) in entries.items()))
    return strikes, quarantine, excluded


def adopt_role(q: Quorum, rid: int) -> Role:
    """This replica's role in `q`: train or catch up (a train round, lagging); the source or
    an adopter (a sync round); benched (not a member: a straggler rule 14 benched)."""
    if rid not in q.members:
        return Role.BENCH
    if q.kind == SYNC:
        return Role.SOURCE if rid == q.source else Role.ADOPT
    return Role.TRAIN if rid in q.contributors else Role.CATCHUP


# -- steady rounds: no etcd while nothing changes ----------------------------------------------------

@dataclass(frozen=True)
class LocalView:
    """What one leader knows locally when its replica finished a round."""

    committed: bool
    """This replica committed the round (its 2PC succeeded)."""
    changed: bool
    """A watch reported a change since the round was adopted: a failure, an eviction, a
    joiner or a new incarnation, or our own lease lapsed."""
    digest_due: bool
    """Digests of state version q.max_step + 1 are compared in a full round: round q's ring found
    the members' digests disagreeing (replica/guard.py). Every member that committed q read the
    same sums, so every one of them agrees."""
    stop: bool = False
    """This replica asks to stop."""
    slow: bool = False
    """This replica's own measure is slow against the round's pace (stragglers.self_check): the
    decider should see it now, not at the next periodic full round."""
    opt: int = 0
    """The optimizer this replica's next round steps (rule 15)."""
    cont: bool = False
    """Its next round continues the batch of round q (rule 15)."""
    verified: int = -1
    """q.max_step when the members' digests of it agreed on round q's ring, else -1 (the same on
    every member that committed q)."""


def steady_next(q: Quorum, view: LocalView) -> Optional[Quorum]:
    """The next round's quorum, derived without etcd, or None when the next round must be a
    full round (report, decide, adopt).

    A steady round repeats a settled train round: every member contributed, nobody lags or
    heals, no rewind, no stop, no quarantine ends, and nothing changed. Every leader that
    committed `q` computes the same result from `q` alone; a leader that must go full while
    the others may go steady (`must_abort`) aborts the ring, so their exchange fails at once
    and they go full too. The highest-step-is-healthy rule is kept: all members of a steady
    round committed the same steps, and the 2PC is unchanged."""
    if not view.committed or view.changed or view.stop or view.slow or _full_anyway(q, view):
        return None
    if not steady_eligible(q):
        return None
    if view.opt < 0:  # a replica before its first batch: its step is not known yet
        return None
    nxt = q.round + 1
    # Every member trained one batch of its slot (under "constant" so did every absent slot),
    # unless q continued a batch (rule 15): its batch was counted at the batch's first step.
    # Every member contributed to q and runs the same program, so all name the same next step.
    d = 0 if q.cont else 1
    # A split announced in q takes effect now (every member contributes to a steady round).
    return replace(q, round=nxt, max_step=q.max_step + 1, cursors=tuple(c + d for c in q.cursors),
                   shrunk=stragglers.effective(q.shrink_next, q.contributors) if not view.cont else (),
                   slot_cursors=tuple(c + d for c in q.slot_cursors), strikes=0, steady=True,
                   opt=view.opt, cont=view.cont, first=q.first if view.cont else view.opt,
                   verified_step=max(q.verified_step, view.verified),
                   reason=f"round {nxt} epoch {q.epoch}: steady ({len(q.members)} replicas, unchanged since round "
                          f"{q.round}); max_step {q.max_step + 1}")


def steady_eligible(q: Quorum) -> bool:
    """Whether a round after `q` may be steady, judged from `q` alone (the same everywhere)."""
    if q.kind != TRAIN or q.lagging or q.diverged or q.rewind is not None or q.stop:
        return False
    return not any(until == q.round + 1 for _, until, _ in q.quarantine)


def _full_anyway(q: Quorum, view: LocalView) -> bool:
    """Reasons every member sees alike: digests that disagreed on the ring, or the periodic full round."""
    return view.digest_due or (q.max_step + 1) % MAX_STEADY_STEPS == 0


def must_abort(q: Quorum, view: LocalView) -> bool:
    """A leader going full for a reason of its own, after a round from which the others may
    go steady, must break the ring so that their steady exchange fails at once."""
    return steady_eligible(q) and not _full_anyway(q, view) and steady_next(q, view) is None
