"""Run reports: `lightning-ft report RUN_DIR`.

Reads what a run leaves in its directory:
- `events.jsonl` (the launcher: start, exit, evict, restart),
- `replica_{rid}/steps.jsonl` (the strategy's rank 0: one row per optimizer step),
- `replica_{rid}/final.json` (step and state digest at the end),
- `lightning_logs/replica_{rid}/metrics.csv` when a CSV logger ran (held-out metrics),

and writes `summary.md` (downtime per failure, restarts, effective training time) and
`timeline.png` (per-replica state over time, and the job's step rate).

Definitions. A replica is *down* from its failure (exit or eviction) to its first committed
step in the next incarnation (its catch-up). The fault-free step time is the median gap
between consecutive commits while every replica contributes. Effective training time (ETT)
counts work, not steps: a step committed with c of R replicas contributing trains c/R of a
full batch, so ETT = sum over committed steps of c/R × fault-free step time ÷ training wall
time (first to last commit). A step redone after a rollback counts once (its last commit).
"""
from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Optional

STATE_COLORS = {"training": "#2ca02c", "catch-up": "#ff7f0e", "down": "#d62728", "starting": "#7f7f7f"}


@dataclass
class Failure:
    replica: int
    incarnation: int
    t: float
    reason: str
    back_t: Optional[float] = None
    back_step: Optional[int] = None
    stall_s: float = 0.0
    """Longest gap between commits of the other replicas right after the failure, minus one
    fault-free step: how long the healthy replicas waited."""

    @property
    def down_s(self) -> Optional[float]:
        return None if self.back_t is None else self.back_t - self.t


@dataclass
class RunData:
    run_dir: str
    events: list = field(default_factory=list)
    steps: dict = field(default_factory=dict)
    finals: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    spare_events: list = field(default_factory=list)
    """events.jsonl lines of no replica: the warm spares' (launch/supervisor.py)."""


def _jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    for line in open(path):
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a torn last line of a killed writer
                pass
    return out


def load(run_dir: str) -> RunData:
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"no run directory {run_dir!r}")
    events = _jsonl(os.path.join(run_dir, "events.jsonl"))
    # the warm spares' events (spare_start, spare_exit, spare_stop) belong to no replica
    data = RunData(run_dir, events=[e for e in events if "replica" in e],
                   spare_events=[e for e in events if "replica" not in e])
    for name in sorted(os.listdir(run_dir)):
        if not name.startswith("replica_"):
            continue
        rid = int(name.split("_", 1)[1])
        rows = _jsonl(os.path.join(run_dir, name, "steps.jsonl"))
        if rows:
            data.steps[rid] = sorted(rows, key=lambda r: r["t"])
        final = os.path.join(run_dir, name, "final.json")
        if os.path.exists(final):
            data.finals[rid] = json.load(open(final))
        metrics = os.path.join(run_dir, "lightning_logs", name, "metrics.csv")
        if os.path.exists(metrics):
            with open(metrics) as f:
                data.metrics[rid] = list(csv.DictReader(f))
    if not data.steps:
        raise FileNotFoundError(f"{run_dir} has no replica_*/steps.jsonl: was it trained with strategy='ft_hsdp'?")
    return data


def commit_times(data: RunData) -> list[tuple[float, int]]:
    """(time, step) of the first commit of every step, job-wide."""
    first: dict[int, float] = {}
    for rows in data.steps.values():
        for r in rows:
            if r["step"] not in first or r["t"] < first[r["step"]]:
                first[r["step"]] = r["t"]
    return sorted((t, s) for s, t in first.items())


def work_steps(data: RunData, replicas: int) -> float:
    """Full-batch steps of work committed: each step counts contributors/R, from the commit
    that stands (the last one, when a rollback or a rewind redid the step, so the steps a
    rewind discarded count as lost). Rows of sync or catch-up calls trained nothing."""
    last: dict[int, dict] = {}
    for rows in data.steps.values():
        for r in rows:
            if r.get("role", "train") != "train":
                continue
            if r["step"] not in last or r["t"] > last[r["step"]]["t"]:
                last[r["step"]] = r
    return sum(len(r.get("contributors") or range(replicas)) / replicas for r in last.values())


def fault_free_step_s(data: RunData, replicas: int) -> Optional[float]:
    gaps = []
    for rows in data.steps.values():
        for a, b in itertools.pairwise(rows):
            if (b["step"] == a["step"] + 1 and len(b["contributors"]) == replicas and len(a["contributors"]) == replicas
                    and not b["caught_up"] and a["inc"] == b["inc"]):
                gaps.append(b["t"] - a["t"])
    return statistics.median(gaps) if gaps else None


def failures(data: RunData, step_s: Optional[float]) -> list[Failure]:
    by_key: dict[tuple[int, int], Failure] = {}
    for e in data.events:
        if e["event"] not in ("evict", "exit") or (e["event"] == "exit" and e.get("code") == 0):
            continue
        key = (e["replica"], e["incarnation"])
        f = by_key.get(key)
        if f is None:
            by_key[key] = Failure(e["replica"], e["incarnation"], e["t"], e.get("reason") or f"exit {e.get('code')}")
        elif e.get("reason"):  # the eviction says why (the exit only has a code)
            f.reason = e["reason"]
    out = sorted(by_key.values(), key=lambda f: f.t)
    for f in out:
        later = [r for r in data.steps.get(f.replica, []) if r["inc"] > f.incarnation and r["t"] > f.t]
        if later:
            f.back_t, f.back_step = later[0]["t"], later[0]["step"]
        others = sorted(r["t"] for rid, rows in data.steps.items() if rid != f.replica for r in rows
                        if f.t - 5 < r["t"] < f.t + 30)
        before = [t for t in others if t <= f.t]
        after = [t for t in others if t > f.t]
        if before and after:
            gaps = [after[0] - before[-1]] + [b - a for a, b in itertools.pairwise(after)][:5]
            f.stall_s = max(0.0, max(gaps) - (step_s or 0.0))
    return out


def summarize(data: RunData) -> dict:
    replicas = max([int(e["replica"]) for e in data.events] + list(data.steps)) + 1
    commits = commit_times(data)
    step_s = fault_free_step_s(data, replicas)
    fails = failures(data, step_s)
    steps = commits[-1][1] if commits else 0
    work = work_steps(data, replicas)
    wall = (commits[-1][0] - commits[0][0]) + (step_s or 0.0) if commits else 0.0
    digests = {rid: f["digest"] for rid, f in data.finals.items()}
    losses = [r["loss"] for r in data.steps.get(min(data.steps), []) if r.get("loss") is not None]
    val = None
    for rows in data.metrics.values():
        vals = [float(r["val_bpb"]) for r in rows if r.get("val_bpb")]
        if vals:
            val = vals[-1]
            break
    return {
        "replicas": replicas, "steps": steps, "train_wall_s": round(wall, 3),
        "work_steps": round(work, 3),
        "fault_free_step_s": step_s, "ett": round(work * step_s / wall, 4) if step_s and wall else None,
        "restarts": sum(1 for e in data.events if e["event"] == "restart"),
        "standby_restarts": sum(1 for e in data.events if e["event"] == "restart" and e.get("standby")),
        "spares_started": sum(1 for e in data.spare_events if e.get("event") == "spare_start"),
        "rewinds": [{"from": e.get("from"), "to": e.get("to"), "checkpoint": e.get("checkpoint") or "",
                     "lost_steps": (e.get("from") or 0) - (e.get("to") or 0)}
                    for e in data.events if e["event"] == "rewind"],
        "failures": [{"replica": f.replica, "incarnation": f.incarnation, "reason": f.reason,
                      "down_s": None if f.down_s is None else round(f.down_s, 3), "back_at_step": f.back_step,
                      "healthy_stall_s": round(f.stall_s, 3)} for f in fails],
        "identical": len(set(map(tuple, digests.values()))) == 1 if digests else None,
        "final_step": {rid: f["step"] for rid, f in data.finals.items()},
        "loss_first": round(statistics.fmean(losses[:10]), 4) if losses else None,
        "loss_last": round(statistics.fmean(losses[-10:]), 4) if losses else None,
        "val_bpb": val,
        "stragglers": [{"replica": e.get("replica"), "step": e.get("step"), "ratio": e.get("ratio"),
                        "window": e.get("window"), "policy": e.get("policy"),
                        "benched": e.get("exclusions") if e.get("benched") else None,
                        "out_s": _out_s(data.events, e) if e.get("benched") else None,
                        "kept": f"{e['of'] - e['gives']}/{e['of']}" if e.get("of") else None}
                       for e in data.events if e["event"] == "straggler"],
        "hangs": [hang_row(e) for e in data.events if e["event"] == "hang" and e.get("diagnosis")],
    }


def _out_s(events: list[dict], e: dict) -> float | None:
    """Seconds from a straggler's bench to its readmission (None: not readmitted)."""
    back = [x["t"] for x in events if x["event"] == "readmitted" and x.get("replica") == e.get("replica")
            and x["t"] >= e["t"]]
    return round(min(back) - e["t"], 3) if back else None


def hang_row(e: dict) -> dict:
    """A hang diagnosis event (coord/hang.py) as the report shows it."""
    from lightning_ft.coord.hang import top_frame

    links = "; ".join(f"r{k['from']} -> r{k['to']} ({k['direction']}, "
                      f"{'tail' if k['outstanding'] < 0 else str(k['outstanding']) + ' B'}, seen by r{k['seen_by']})"
                      for k in e.get("links") or [])
    return {"replica": e.get("replica"), "incarnation": e.get("incarnation"), "rank": e.get("rank"),
            "state": e.get("state"), "links": links or "-", "frame": top_frame(e.get("stack") or "") or "-",
            "stack": e.get("stack") or "", "reason": e.get("reason") or ""}


def segments(data: RunData, replicas: int) -> dict[int, list[tuple[float, float, str]]]:
    """Per replica: (start, end, state) intervals in seconds since the first event."""
    t0 = min([e["t"] for e in data.events] + [rows[0]["t"] for rows in data.steps.values()])
    t_end = max([e["t"] for e in data.events] + [rows[-1]["t"] for rows in data.steps.values()])
    out: dict[int, list[tuple[float, float, str]]] = {}
    for rid in range(replicas):
        segs: list[tuple[float, float, str]] = []
        starts = [e for e in data.events if e["replica"] == rid and e["event"] in ("start", "restart")]
        downs = [e for e in data.events if e["replica"] == rid and (e["event"] == "evict" or (
            e["event"] == "exit" and e.get("code") not in (0, None)))]
        rows = data.steps.get(rid, [])
        for s in starts:
            inc = s["incarnation"]
            mine = [r for r in rows if r["inc"] == inc]
            end_evt = [d["t"] for d in downs if d["incarnation"] == inc]
            ends = [e["t"] for e in data.events if e["replica"] == rid and e["incarnation"] == inc
                    and e["event"] == "exit"]
            stop = min(end_evt) if end_evt else (max(ends) if ends else (mine[-1]["t"] if mine else t_end))
            first = mine[0]["t"] if mine else stop
            if mine and mine[0]["caught_up"]:  # a restarted replica's first row is its catch-up
                segs.append((s["t"] - t0, first - mine[0]["call_s"] - t0, "starting"))
                segs.append((first - mine[0]["call_s"] - t0, first - t0, "catch-up"))
            else:
                segs.append((s["t"] - t0, first - t0, "starting"))
            for a, b in zip(mine, mine[1:] + [None], strict=False):  # mine may be empty
                b_t = b["t"] if b else stop
                state = "catch-up" if (b and b["caught_up"]) else "training"
                segs.append((a["t"] - t0, b_t - t0, state))
            if end_evt:
                nxt = [e["t"] for e in starts if e["incarnation"] == inc + 1]
                segs.append((stop - t0, (nxt[0] if nxt else t_end) - t0, "down"))
        out[rid] = [(a, max(a, b), st) for a, b, st in segs if b > a]
    return out


def plot(data: RunData, path: str, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    replicas = summary["replicas"]
    segs = segments(data, replicas)
    commits = commit_times(data)
    t0 = min([e["t"] for e in data.events] + [rows[0]["t"] for rows in data.steps.values()])
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 2 + 0.6 * replicas + 2.5), sharex=True,
                                   gridspec_kw={"height_ratios": [max(1.0, 0.6 * replicas), 2.5]})
    for rid, ss in segs.items():  # one call per replica: a 100-fault soak has thousands of segments
        if ss:
            ax1.barh([rid] * len(ss), [b - a for a, b, _ in ss], left=[a for a, _, _ in ss], height=0.6,
                     color=[STATE_COLORS[st] for _, _, st in ss], linewidth=0)
    ax1.set_yticks(range(replicas), [f"replica {r}" for r in range(replicas)])
    ax1.invert_yaxis()
    ax1.set_title(f"{os.path.basename(os.path.abspath(data.run_dir))}: {summary['steps']} steps, "
                  f"{len(summary['failures'])} failures, ETT {summary['ett']}")
    ax1.legend(handles=[Patch(color=c, label=s) for s, c in STATE_COLORS.items()], loc="upper right",
               ncol=4, fontsize=8)
    if len(commits) > 1:
        ts = [t - t0 for t, _ in commits]
        window = max(2, len(commits) // 50)
        xs, rates = [], []
        for i in range(window, len(commits)):
            dt = commits[i][0] - commits[i - window][0]
            xs.append(ts[i])
            rates.append((commits[i][1] - commits[i - window][1]) / dt if dt > 0 else 0.0)
        ax2.plot(xs, rates, color="#1f77b4")
        if summary["fault_free_step_s"]:
            ax2.axhline(1 / summary["fault_free_step_s"], color="#555", ls="--", lw=1, label="fault-free rate")
            ax2.legend(loc="lower right", fontsize=8)
    for f in summary["failures"]:
        ft = [e["t"] for e in data.events if e["replica"] == f["replica"] and e["incarnation"] == f["incarnation"]
              and e["event"] in ("exit", "evict")]
        if ft:
            for ax in (ax1, ax2):
                ax.axvline(min(ft) - t0, color=STATE_COLORS["down"], lw=0.8, ls=":")
    ax2.set_ylabel("committed steps/s")
    ax2.set_xlabel("seconds since launch")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(summary: dict) -> str:
    lines = ["# Run summary", "",
             f"- replicas: {summary['replicas']}; committed steps: {summary['steps']}; restarts: {summary['restarts']}",
             f"- fault-free step time: {summary['fault_free_step_s']} s; "
             f"training wall time: {summary['train_wall_s']} s",
             f"- effective training time (ETT): {summary['ett']} (work of {summary['work_steps']} full-batch "
             f"steps: a step with c of {summary['replicas']} replicas contributing counts c/{summary['replicas']})",
             f"- replicas bitwise identical at the end: {summary['identical']}",
             f"- loss: {summary['loss_first']} (first 10 steps) -> {summary['loss_last']} (last 10)"
             + (f"; held-out {summary['val_bpb']:.3f} bits/byte" if summary["val_bpb"] is not None else ""), "",
             "## Failures", "", "| replica | incarnation | reason | down (s) | back at step | healthy stall (s) |",
             "|---|---|---|---|---|---|"]
    for f in summary["failures"]:
        lines.append(f"| {f['replica']} | {f['incarnation']} | {f['reason']} | {f['down_s']} | {f['back_at_step']} "
                     f"| {f['healthy_stall_s']} |")
    if not summary["failures"]:
        lines.append("| - | - | none | - | - | - |")
    lines += _table("Rewinds", ["Every replica holding the newest state was down at once; the job went back to the "
                                "best state", "that existed (steps after it were trained again and count as lost in "
                                "the ETT)."],
                    ["from step", "to step", "source", "lost steps"],
                    [[r["from"], r["to"], r["checkpoint"] or "a surviving replica or step 0", r["lost_steps"]]
                     for r in summary.get("rewinds") or []])
    lines += _table("Stragglers", ["A replica whose compute per step (mean over its last second, and `window` steps) "
                                   "was `ratio` times the", "median of the others' (coord/stragglers.py). Benched "
                                   "(its `benched`-th exclusion), it waited outside the rounds", "for `out s` seconds, "
                                   "until its pace was back; shrunk, it trained `kept` of its micro-batches and the "
                                   "others the rest."],
                    ["replica", "at step", "ratio", "window", "policy", "benched", "out s", "kept"],
                    [[e["replica"], e["step"], e["ratio"], e["window"], e["policy"],
                      "-" if e.get("benched") is None else e["benched"], "-" if e.get("out_s") is None else e["out_s"],
                      e.get("kept") or "-"]
                     for e in summary.get("stragglers") or []])
    hangs = summary.get("hangs") or []
    lines += _table("Hangs", ["A replica whose lease lapsed while its processes ran: the rank to blame (its process "
                              "state: T = stopped),", "the FTAR links that waited on it, and where its main thread was "
                              "(coord/hang.py; the stacks below, read from outside with py-spy)."],
                    ["replica", "incarnation", "rank", "state", "FTAR links waiting", "main thread in"],
                    [[h["replica"], h["incarnation"], h["rank"], h["state"], h["links"], f"`{h['frame']}`"]
                     for h in hangs])
    for h in hangs:
        lines += ["", f"Replica {h['replica']} incarnation {h['incarnation']} rank {h['rank']}: {h['reason']}", "",
                  "```", h["stack"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def _table(title: str, intro: list[str], header: list[str], rows: list[list]) -> list[str]:
    """A markdown section: the title, then `intro` and the table, or "none" without rows."""
    out = ["", f"## {title}", ""]
    if not rows:
        return out + ["none"]
    out += intro + ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]


def report(run_dir: str, png: bool = True) -> dict:
    data = load(run_dir)
    summary = summarize(data)
    with open(os.path.join(run_dir, "summary.md"), "w") as f:
        f.write(markdown(summary))
    if png:
        plot(data, os.path.join(run_dir, "timeline.png"), summary)
    return summary


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="lightning-ft report", description="timeline.png and summary.md of a run")
    p.add_argument("run_dir")
    p.add_argument("--no-png", action="store_true")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = p.parse_args(argv)
    try:
        summary = report(a.run_dir, png=not a.no_png)
    except FileNotFoundError as e:
        print(f"lightning-ft report: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary) if a.json else markdown(summary))
    if not a.no_png:
        print(f"wrote {os.path.join(a.run_dir, 'timeline.png')} and summary.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
