"""Recovery stalls of the replica core: 3 replicas of the plain loop (docs/ARCHITECTURE.md,
"A step" and "Catch-up").

    python -m lightning_ft.bench.recovery [--quick] [--ttl 2]

One run, one job: steady state, then a SIGKILL of replica 1 (the supervisor's eviction is
written as soon as the process is reaped), its restart `--restart-delay` after the kill (the
supervisor's failure.restart_delay_s) and rejoin, then a SIGSTOP of replica
2 (no eviction: only its lease can expire), SIGCONT and its rejoin; then `--standby-kills`
SIGKILLs (replicas 1 and 2 in turn), each healed by a warm spare (coord/standby.py) started
beforehand and promoted as soon as the killed one is reaped; then `--zygote-kills` SIGKILLs,
each restarted cold but forked from a zygote that imported torch (launch/zygote.py, what
`lightning-ft run` does with supervisor.zygote). Printed as one JSON line:
    {"bench": "recovery", "step_s", "kill_stall_s" (the median over every kill: the cold restart's,
     each spare's and each forked restart's; "kill_stall_all_s" each, "kill_stall_first_s" the
     cold one's), "hang_stall_s", "rejoin_stall_s" (the median
     over every rejoin: the cold restart's and each heal's; "rejoin_stall_all_s" each,
     "rejoin_stall_of_step" the median over the median step),
     "rejoin_parts_ms", "steady_parts_ms" (the rejoin step's quorum/reconf/exchange/freeze against
     the median steady step's, on healthy replica 0),
     "heal_cold_s", "heal_standby_s", "heal_standby_all_s", "kill_stall_standby_s",
     "heal_cold_zygote_s", "heal_cold_zygote_all_s", "restart_breakdown_zygote",
     "restart_breakdown": {"total_s", "python", "torch", ...}, "catchup_gbps", "catchup_s", "state_mb", ...}
heal_cold_s (and each of heal_standby_all_s; heal_standby_s is their median) runs from the
SIGKILL to the first step row (catch-up or train) of the new incarnation; restart_breakdown
is the cold incarnation's start-up in parts (replica/startup.py).
A stall (`_stall`) is the longest gap between committed steps of healthy replica 0 that
overlaps the event's window, minus the median step time, and never negative: 0 when no gap
in the window is longer than a median step. The kill's window runs from the SIGKILL to the
first step committed without the killed replica (the stall shows in the step it breaks,
which may end after the kill's own gap), the hang's from the SIGSTOP to the first step
without the stopped one. Default model: ~9.4M parameters with AdamW, a ~113 MB state.
"""
from __future__ import annotations

import argparse
import itertools
import json
import signal
import statistics
import sys
import tempfile
import time

from lightning_ft.bench.localjob import Job, log_tails
from lightning_ft.coord.etcd_server import EtcdServer


def _gap_around(rows: list[dict], t0: float, t1: float) -> float:
    """Longest gap between consecutive committed steps that overlaps [t0, t1]."""
    ts = [r["t"] for r in rows]
    gaps = [b - a for a, b in itertools.pairwise(ts) if b >= t0 and a <= t1]
    return max(gaps) if gaps else 0.0


PARTS = ("quorum_ms", "reconf_ms", "exchange_ms", "freeze_ms")
"""A step row's timed parts (examples/plain_loop.py): where a rejoin step's time went."""


def _parts(*rows: dict) -> dict[str, float]:
    """The median of each timed part over `rows` (a healthy replica's step rows)."""
    return {k: round(statistics.median(r.get(k, 0.0) for r in rows), 2) for k in PARTS}


def _stall(rows: list[dict], t0: float, t1: float, step_s: float) -> float:
    """Seconds a healthy replica lost to an event in [t0, t1]: the longest gap between its
    committed steps that overlaps the window, beyond a median step. Never negative: steps
    vary, and a window whose gaps are all shorter than the median lost nothing (before this
    was clipped, a kill landing in a fast step printed -0.0067 s and -0.0161 s)."""
    return max(0.0, _gap_around(rows, t0, t1) - step_s)


def _standby_heal(job: Job, k: int, rid: int, a: argparse.Namespace) -> tuple[float, float, float]:
    """A warm spare (coord/standby.py) started and registered; SIGKILL replica `rid`, evict it
    and promote the spare as soon as it is reaped (what the supervisor does with one). Returns
    (heal: the kill to the promoted incarnation's first step row, replica 0's kill stall, its
    rejoin stall)."""
    token = f"s{k}"
    job.start_spare(token)
    job.wait_spare(token, a.timeout)
    r0 = job.replicas[0]
    step_s = statistics.median(x["dt"] for x in r0.steps()[-20:])
    t_kill = time.time()
    job.replicas[rid].signal(signal.SIGKILL)
    job.wait_exit(rid)
    job.evict(rid, "SIGKILL (bench, standby)")
    spare = job.promote(token, rid)
    first = spare.wait_for(lambda x: x.get("event") == "step", a.timeout)
    back = spare.wait_for(lambda x: x.get("event") == "step" and not x["lag"], a.timeout)
    r0.wait_for(lambda x: x.get("event") == "step" and x["t"] > back["t"] + 1, a.timeout)
    return (round(first["t"] - t_kill, 3), _kill_stall(r0, rid, t_kill, first["t"], step_s),
            _rejoin_stall(r0, rid, t_kill, step_s))


def _kill_stall(r0, rid: int, t_kill: float, t_first: float, step_s: float) -> float:
    """Healthy replica 0's stall for the kill of `rid` at `t_kill` (`_stall`): the window ends at
    its first step without `rid`, else at the new incarnation's first step row (`t_first`)."""
    gone = [x for x in r0.steps() if x["t"] > t_kill and rid not in x["members"]]
    return round(_stall(r0.steps(), t_kill, gone[0]["t"] if gone else t_first, step_s), 4)


def _rejoin_stall(r0, rid: int, t_kill: float, step_s: float) -> float:
    """Healthy replica 0's step in which `rid` rejoined (lagging) after `t_kill`, beyond a
    median step (never negative)."""
    row = next(x for x in r0.steps() if x["t"] > t_kill and rid in x.get("lagging", []))
    return round(max(0.0, row["dt"] - step_s), 4)


def _zygote_heal(job: Job, rid: int, a: argparse.Namespace) -> tuple[float, dict, float, float]:
    """SIGKILL replica `rid`, evict it, and restart it `--restart-delay` after the kill forked
    from the zygote (launch/zygote.py: torch already imported), as `lightning-ft run` restarts.
    Returns (heal: the kill to the new incarnation's first step row, its restart breakdown,
    replica 0's rejoin stall, its kill stall)."""
    inc = job.replicas[rid].inc + 1
    t_kill = time.time()
    job.replicas[rid].signal(signal.SIGKILL)
    job.wait_exit(rid)
    job.evict(rid, "SIGKILL (bench, zygote)")
    time.sleep(max(0.0, t_kill + a.restart_delay - time.time()))
    new = job.start(rid, inc=inc, forked=True)
    first = new.wait_for(lambda x: x.get("event") == "step", a.timeout)
    breakdown = new.wait_for(lambda x: x.get("event") == "restart_breakdown", a.timeout)
    back = new.wait_for(lambda x: x.get("event") == "step" and not x["lag"], a.timeout)
    r0 = job.replicas[0]
    r0.wait_for(lambda x: x.get("event") == "step" and x["t"] > back["t"] + 1, a.timeout)
    step_s = statistics.median([x["dt"] for x in r0.steps() if x["t"] < t_kill][-20:])
    return (round(first["t"] - t_kill, 3), {"total_s": breakdown["total_s"], **breakdown["parts"]},
            _rejoin_stall(r0, rid, t_kill, step_s), _kill_stall(r0, rid, t_kill, first["t"], step_s))


def run(a: argparse.Namespace) -> dict:
    if a.quick:
        model = ["--dim", "32", "--hidden", "128", "--depth", "2", "--batch", "16"]
    else:
        model = ["--dim", "512", "--hidden", "2048", "--depth", "3", "--batch", "64"]
    args = tuple(model + ["--steps", "100000", "--ttl", str(a.ttl), "--ftar-timeout", str(a.ttl * 3),
                          "--init-timeout", "60", "--step-sleep", str(a.step_sleep)])
    with EtcdServer() as etcd, tempfile.TemporaryDirectory() as tmp:
        job = Job(etcd.endpoint, tmp, R=3, args=args)
        try:
            job.start_all()
            if a.zygote_kills:
                job.open_zygote(a.timeout)  # it imports while the replicas start
            r0 = job.replicas[0]
            r0.wait_for(lambda x: x.get("event") == "step" and x["step"] >= a.warmup + 10, a.timeout)
            steady = [x["dt"] for x in r0.steps()[a.warmup:]]
            step_s = statistics.median(steady)

            # SIGKILL replica 1, evict it as the supervisor would, restart it after a delay.
            t_kill = time.time()
            job.replicas[1].signal(signal.SIGKILL)
            job.wait_exit(1)
            job.evict(1, "SIGKILL (bench)")
            n_kill = len(r0.steps())
            time.sleep(max(0.0, t_kill + a.restart_delay - time.time()))  # the supervisor's restart_delay_s
            job.start(1, inc=1)
            gone = r0.wait_for(lambda x: x.get("event") == "step" and x["t"] > t_kill and 1 not in x["members"],
                               a.timeout)
            first1 = job.replicas[1].wait_for(lambda x: x.get("event") == "step", a.timeout)
            lag1 = job.replicas[1].wait_for(lambda x: x.get("event") == "step" and x["lag"], a.timeout)
            breakdown = job.replicas[1].wait_for(lambda x: x.get("event") == "restart_breakdown", a.timeout)
            rejoin_row = r0.wait_for(lambda x: x.get("event") == "step" and 1 in x.get("lagging", []), a.timeout)
            r0.wait_for(lambda x: x.get("event") == "step" and x["t"] > lag1["t"] + 2 * step_s + 1, a.timeout)

            # SIGSTOP replica 2: no eviction, only lease expiry removes it.
            t_hang = time.time()
            job.replicas[2].signal(signal.SIGSTOP)
            out = r0.wait_for(lambda x: x.get("event") == "step" and x["t"] > t_hang and 2 not in x["members"],
                              a.timeout)
            # what healthy replica 0 did meanwhile (a stall past the TTL explains itself: CI saw 10 s once)
            hang_rows = [{k: x.get(k) for k in ("t", "step", "dt", "members", *PARTS)}
                         for x in r0.steps() if t_hang - 0.5 <= x["t"] <= out["t"]]
            if _stall(r0.steps(), t_hang, out["t"], step_s) > a.ttl + 1.0:
                print(f"hang stall past the TTL; replica 0's rows {hang_rows}\n{log_tails(job.log_dir)}",
                      file=sys.stderr, flush=True)
            time.sleep(1.0)
            job.replicas[2].signal(signal.SIGCONT)
            lag2 = job.replicas[2].wait_for(lambda x: x.get("event") == "step" and x["lag"] and x["t"] > t_hang,
                                            a.timeout)
            r0.wait_for(lambda x: x.get("event") == "step" and x["t"] > lag2["t"] + 1, a.timeout)
            rows = r0.steps()
            heals = [_standby_heal(job, k, 1 + k % 2, a) for k in range(a.standby_kills)]
            forked = [_zygote_heal(job, 1 + k % 2, a) for k in range(a.zygote_kills)]
            # one rejoin is one sample of a noisy step: the cold one's and every heal's
            rejoins = [round(max(0.0, rejoin_row["dt"] - step_s), 4)] + [h[2] for h in heals + forked]
            # and one kill one sample of the step it breaks: the cold kill's and every heal's
            kills = [round(_stall(rows, t_kill, gone["t"], step_s), 4)] + [h[1] for h in heals] + [h[3] for h in forked]
            return {
                "bench": "recovery", "replicas": 3, "ttl_s": a.ttl, "state_mb": round(lag1["state_mb"], 1),
                "step_s": round(step_s, 4),
                "kill_stall_s": round(statistics.median(kills), 4), "kill_stall_all_s": kills,
                "kill_stall_first_s": kills[0],
                "hang_stall_s": round(_stall(rows, t_hang, out["t"], step_s), 4), "hang_rows": hang_rows,
                "rejoin_stall_s": round(statistics.median(rejoins), 4),
                "rejoin_stall_all_s": rejoins, "rejoin_stall_of_step": round(statistics.median(rejoins) / step_s, 3),
                "rejoin_step_s": round(rejoin_row["dt"], 4),
                "rejoin_parts_ms": _parts(rejoin_row), "steady_parts_ms": _parts(*r0.steps()[a.warmup:n_kill]),
                "heal_cold_s": round(first1["t"] - t_kill, 3),
                "heal_standby_s": round(statistics.median(h[0] for h in heals), 3) if heals else None,
                "heal_standby_all_s": [h[0] for h in heals],
                "kill_stall_standby_s": [h[1] for h in heals],
                "heal_cold_zygote_s": round(statistics.median(h[0] for h in forked), 3) if forked else None,
                "heal_cold_zygote_all_s": [h[0] for h in forked],
                "restart_breakdown_zygote": forked[len(forked) // 2][1] if forked else None,
                "restart_delay_s": a.restart_delay,
                "restart_breakdown": {"total_s": breakdown["total_s"], **breakdown["parts"]},
                "catchup_gbps": round(lag1["catchup_gbps"], 3),
                "catchup_s": round(lag1["catchup_ms"] / 1e3, 4),
                "hang_excluded_after_s": round(out["t"] - t_hang, 3),
                "steps_before_kill": n_kill,
            }
        finally:
            job.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lightning_ft.bench.recovery")
    p.add_argument("--quick", action="store_true", help="a small model, for smoke tests")
    p.add_argument("--ttl", type=float, default=2.0, help="lease TTL (s)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--restart-delay", type=float, default=0.2,
                   help="seconds from the kill to the restart (failure.restart_delay_s's default)")
    p.add_argument("--timeout", type=float, default=180.0)
    p.add_argument("--standby-kills", type=int, default=5,
                   help="then this many SIGKILLs healed by a warm spare each (heal_standby_s: their median)")
    p.add_argument("--zygote-kills", type=int, default=3,
                   help="then this many SIGKILLs restarted cold from the zygote (torch imported; "
                        "heal_cold_zygote_s: their median)")
    a = p.parse_args(argv)
    print(json.dumps(run(a)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
