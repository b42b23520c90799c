"""docs/study/summary.md and the figures, from the results of a study (`Study.results`).

The table has one row per setting and run kind (real, simulated) plus the baseline rows;
the validation table compares each real run with the simulator's replay of its ledger; the
conclusions are sentences computed from the table (analysis.conclusions), not written by
hand. Definitions are in lightning_ft/study/analysis.py and repeated in the summary.
"""
from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass, field
from typing import Optional

from lightning_ft.study import plots
from lightning_ft.study.analysis import SPREAD, Band, Row, analyze, band, conclusions, smooth, spread
from lightning_ft.study.runner import Study
from lightning_ft.study.sim import load_script


@dataclass
class Check:
    name: str
    train_diff: float
    eval_diff: float
    ok: bool


@dataclass
class Outcome:
    rows: list[Row]
    checks: list[Check]
    conclusions: list[str]
    figures: list[str] = field(default_factory=list)


def evaluate(study: Study) -> tuple[Outcome, dict]:
    """Rows, validation checks and conclusions; plus what the figures need."""
    cfg, res, k = study.cfg, study.results, study.cfg.smooth_steps
    fps = sorted({s.fp for s in study.settings.values()})
    bands: dict[str, Band] = {}
    eval_bands: dict[str, dict[int, tuple[float, float]]] = {}
    for fp in fps:
        seeds = [res[f"baseline_{fp}.sim.s{seed}"] for seed in range(cfg.seeds)]
        bands[fp] = band([smooth(r["train_loss"], k) for r in seeds], [r["eval"][max(r["eval"])] for r in seeds])
        eval_bands[fp] = {s: spread([r["eval"][s] for r in seeds]) for s in seeds[0]["eval"]}
    rows, runs, fp_of = [], {}, {}
    for key, run in sorted(res.items(), key=lambda kv: (kv[1]["source"] != "real", kv[0])):
        name, source, seed = run["name"], run["source"], run["seed"]
        s = study.settings[name]
        if source == "replay" or (s.baseline and seed != 0):
            continue
        base_key = f"baseline_{s.fp}.real.s0" if source == "real" and f"baseline_{s.fp}.real.s0" in res \
            else f"baseline_{s.fp}.sim.s0"
        base = smooth(res[base_key]["train_loss"], k)
        events = len(cfg.schedule.event_steps(s))
        rows.append(analyze(name, source, run, base, bands[s.fp], k, cfg.replicas, events, s.con))
        if not s.baseline:
            runs[key] = run
            fp_of[key] = s.fp
    checks = []
    for name in cfg.real.settings:
        real, rep = res[f"{name}.real.s0"], res[f"{name}.replay.s0"]
        dt = max(abs(a - b) for a, b in zip(smooth(real["train_loss"], k), smooth(rep["train_loss"], k),
                                                 strict=False))
        de = max(abs(real["eval"][s] - rep["eval"][s]) for s in real["eval"] if s in rep["eval"])
        checks.append(Check(name, dt, de, dt <= cfg.validation.tolerance_nats and de <= cfg.validation.tolerance_bpb))
    text = conclusions(rows, study.settings)
    if checks:
        worst_t = max(checks, key=lambda c: c.train_diff)
        worst_e = max(checks, key=lambda c: c.eval_diff)
        text.insert(0, f"Simulator vs real runs (replaying each real run's ledger): {sum(c.ok for c in checks)} of "
                       f"{len(checks)} within tolerance; largest train-loss difference {worst_t.train_diff:.2e} nats "
                       f"({worst_t.name}), largest held-out difference {worst_e.eval_diff:.2e} bpb ({worst_e.name}).")
    extra = {"bands": bands, "eval_bands": eval_bands, "runs": runs, "fp_of": fp_of,
             "base": {fp: res[f"baseline_{fp}.sim.s0"] for fp in fps},
             "real": {key: r for key, r in res.items() if r["source"] == "real"}}
    return Outcome(rows, checks, text), extra


def _reused(study: Study) -> str:
    """How much of the study this invocation took from results/, and what those runs cost."""
    if not study.reused:
        return ""
    real = sum(study.results[k]["seconds"] for k in study.reused if study.results[k]["source"] == "real")
    sim = sum(study.results[k]["seconds"] for k in study.reused if study.results[k]["source"] != "real")
    return (f", reusing {len(study.reused)} of {len(study.results)} runs from `results/` (they took "
            f"{real / 60:.1f} min of real runs and {sim / 60:.1f} min of simulator processes when they ran)")


def _f(x: Optional[float], fmt: str = ".3f") -> str:
    return "—" if x is None else format(x, fmt)


def _recover(r: Row, baseline: bool) -> str:
    if baseline:
        return "—"
    if r.down_at_end:
        return "down at the end"
    return "not recovered" if r.recover_steps is None else str(r.recover_steps)


def table(rows: list[Row], bands: dict[str, Band], settings: dict) -> str:
    head = ("| setting | run | steps down per failure | final train loss (nats) | final held-out (bpb) | "
            "max deviation in failure windows (nats) | steps to recover | train in band | held-out in band | "
            "wall s | s/step failures / healthy |\n|" + "---|" * 11)
    lines = [head]
    for r in rows:
        s = settings[r.name]
        if s.baseline:
            b = bands[s.fp]
            tr = f"{r.final_train:.3f} (band {b.final_train[0]:.3f}–{b.final_train[1]:.3f})"
            ev = f"{r.final_eval:.3f} (band {b.final_eval[0]:.3f}–{b.final_eval[1]:.3f})"
        else:
            tr, ev = f"{r.final_train:.3f}", f"{r.final_eval:.3f}"
        speed = "—" if r.healthy_step_s is None else (
            f"{_f(r.degraded_step_s)} / {r.healthy_step_s:.3f}" if r.degraded_step_s
            else f"— / {r.healthy_step_s:.3f}")
        down = _f(r.down_steps, '.0f') if not s.baseline else '—'
        lines.append(f"| `{r.name}` | {r.source} | {down} | {tr} | {ev} | "
                     f"{_f(r.max_dev, '+.3f')} | {_recover(r, s.baseline)} | "
                     f"{'yes' if r.train_in_band else 'no'} | {'yes' if r.eval_in_band else 'no'} | "
                     f"{_f(r.seconds, '.0f')} | {speed} |")
    return "\n".join(lines)


def write(study: Study, outcome: Outcome, meta: dict) -> str:
    cfg, a = study.cfg, meta["args"]
    ev = outcome.checks
    bands = meta["bands"]
    lines = [
        "# MoE accuracy under injected failures (FT-HSDP §7.2 at CPU scale)",
        "",
        f"Generated by `lightning-ft study {meta['config']}` on "
        f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(meta['started']))}"
        f" in {meta['seconds'] / 60:.1f} min{_reused(study)}; {platform.machine()} with {os.cpu_count()} CPUs, "
        "shared with other work: "
        f"`/proc/loadavg` {meta['load_start']} at the start, {meta['load_end']} at the end. Everything below is "
        "computed from `results/` (one JSON per run).",
        "",
        "## Setup",
        f"- Model: `{cfg.script}` (decoder-only MoE, {a.layers} layers, d={a.d}, {a.experts} experts, top-2, "
        f"balance loss weight 0.01), byte-level on the Python stdlib source, context {a.context}, {a.batch} sequences "
        f"per replica and step ({a.batch * a.context} tokens), AdamW lr {a.lr}, warmup and cosine decay over "
        f"{cfg.steps} steps.",
        f"- {cfg.replicas} replicas (W=1). Failures from step {cfg.start_step} on; `d{{n}}x` = n failure events per "
        f"{cfg.window_steps} steps; each event SIGKILLs `con` replicas at once (the highest ids) and keeps them down "
        "`len` steps (`failure.events[].downtime_steps`).",
        "- Train loss = cross entropy + 0.01 x balance loss, per step the mean over the slot batches trained, then a "
        f"trailing mean of {cfg.smooth_steps} steps. Held-out: bits per byte on {a.val_windows} held-out windows "
        f"every {a.val_every} steps.",
        f"- Noise band: {cfg.seeds} baseline seeds per precision (seed = model initialization and data order), "
        f"mean +- {SPREAD:g} sample standard deviations per step, simulated; real rows are compared with the real "
        "baseline of seed 0 when it ran, and with the simulated band.",
        "- Real runs: `lightning-ft run` with real SIGKILLs; a restarted replica also needs its start-up "
        "(Python, torch, Lightning: tens of seconds on this loaded machine) before it catches up, so it misses more "
        "than `len` steps "
        "(column 'steps down per failure'). Simulated runs follow the nominal schedule: exactly `len` steps.",
        "- bf16 is `bf16-emulated` (examples/train_moe.py): matmul and attention operands and results rounded to bf16, "
        "fp32 accumulation; this CPU has no bf16 matmul (Lightning's `bf16-mixed` is about 20x slower here).",
        "",
        "## Simulator check",
        "The simulator (lightning_ft/study/sim.py) replays each real run's ledger: the same slot batches, "
        "contributors and LR factor per step. Tolerance: "
        f"{cfg.validation.tolerance_nats} nats (smoothed train loss, every step), {cfg.validation.tolerance_bpb} bpb "
        "(held-out, every evaluation).",
        "",
        "| real run | max train-loss difference (nats) | max held-out difference (bpb) | within tolerance |",
        "|---|---|---|---|",
        *[f"| `{c.name}` | {c.train_diff:.2e} | {c.eval_diff:.2e} | {'yes' if c.ok else 'NO'} |" for c in ev],
        "",
        "## Results",
        table(outcome.rows, bands, study.settings),
        "",
        "## Conclusions (computed from the table)",
        *[f"- {t}" for t in outcome.conclusions],
        "",
        "## Figures",
        "- `loss.png`: smoothed train loss against tokens seen, every setting over the baseline band (Figure 8).",
        "- `eval.png`: held-out bits per byte against tokens seen, over the baseline band.",
        "- `zoom.png`: deviation from the same-seed baseline from the first failure on, failure windows shaded "
        "(Figure 9).",
        "- `wallclock.png`: the real runs against wall time: loss, and committed steps (failure windows shaded).",
        "",
        "## Definitions",
        "- Max deviation: the smoothed train loss minus the same-seed baseline's, largest magnitude over the steps in "
        "which some replica did not train.",
        "- Steps to recover: from the end of the last failure window to the first step from which the smoothed loss "
        f"stays inside the band for {cfg.smooth_steps} steps ('not recovered': never by the end of the run; "
        "'down at the end': a replica was still down at the last step).",
        f"- In band: the final value lies within mean +- {SPREAD:g} sd of the baseline seeds' final values.",
        "",
    ]
    path = os.path.join(cfg.out, "summary.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def render(study: Study, meta: dict) -> Outcome:
    """Evaluate the results and write summary.md and the figures into the study's `out`."""
    outcome, extra = evaluate(study)
    cfg = study.cfg
    a = load_script(cfg.script).parser().parse_args(list(cfg.script_args))
    os.makedirs(cfg.out, exist_ok=True)
    k = cfg.smooth_steps
    outcome.figures += plots.loss_and_eval(cfg.out, extra["runs"], extra["bands"], extra["base"], extra["fp_of"], k,
                                           a.batch * a.context, extra["eval_bands"])
    outcome.figures.append(plots.zoom(cfg.out, extra["runs"], extra["bands"], extra["base"], extra["fp_of"], k,
                                      cfg.replicas, cfg.start_step))
    if extra["real"]:
        outcome.figures.append(plots.wallclock(cfg.out, extra["real"], k, cfg.replicas))
    meta = {**meta, "bands": extra["bands"], "args": a}
    outcome.figures.insert(0, write(study, outcome, meta))
    return outcome
