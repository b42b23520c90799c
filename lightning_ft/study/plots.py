"""The study's figures (docs/study/): loss.png and eval.png against tokens seen over the
baseline band (the paper's Figure 8), zoom.png with the deviations in the failure windows
(Figure 9), and wallclock.png, the real runs against wall time."""
from __future__ import annotations

import os
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lightning_ft.study.analysis import Band, smooth  # noqa: E402
from lightning_ft.study.settings import failure_windows  # noqa: E402


def tokens(run: Mapping, per_slot_batch: int) -> list[float]:
    """Millions of tokens seen after each step (slot batches trained x tokens per slot batch)."""
    out, total = [], 0
    for b in run["batches"]:
        total += len(b) * per_slot_batch
        out.append(total / 1e6)
    return out


def _style(name: str, source: str) -> dict:
    ls = "-" if source == "sim" else "--"
    if "batch_constant" in name:
        return {"color": "#9467bd", "ls": ls}
    for key, color in (("lr_sqrt", "#2ca02c"), ("lr_linear", "#ff7f0e"), ("lr_none", "#d62728")):
        if key in name:
            return {"color": color, "ls": ls}
    return {"color": "black", "ls": ls}


def _panels(fps: Sequence[str]):
    fig, axes = plt.subplots(1, len(fps), figsize=(6.5 * len(fps), 4.6), squeeze=False)
    return fig, dict(zip(fps, axes[0], strict=True))


def loss_and_eval(out: str, runs: Mapping[str, Mapping], bands: Mapping[str, Band], base: Mapping[str, Mapping],
                  fp_of: Mapping[str, str], k: int, per_slot_batch: int, eval_bands: Mapping[str, dict]) -> list[str]:
    """loss.png and eval.png; `runs`: key -> result (not baselines), `base`: fp -> baseline s0."""
    paths = []
    fps = sorted(bands)
    for what in ("loss", "eval"):
        fig, ax = _panels(fps)
        for fp in fps:
            a = ax[fp]
            x = tokens(base[fp], per_slot_batch)
            if what == "loss":
                a.fill_between(x, bands[fp].lo, bands[fp].hi, color="#bbbbbb", alpha=0.6, label="baseline band")
            else:
                steps = sorted(eval_bands[fp])
                xs = [x[s - 1] for s in steps]
                a.fill_between(xs, [eval_bands[fp][s][0] for s in steps], [eval_bands[fp][s][1] for s in steps],
                               color="#bbbbbb", alpha=0.6, label="baseline band")
            for key, run in sorted(runs.items()):
                if fp_of[key] != fp:
                    continue
                xr = tokens(run, per_slot_batch)
                name, source = key.split(".")[0], key.split(".")[1]
                if what == "loss":
                    a.plot(xr, smooth(run["train_loss"], k), lw=1.0, label=f"{name} ({source})", **_style(name, source))
                else:
                    st = sorted(run["eval"])
                    a.plot([xr[s - 1] for s in st], [run["eval"][s] for s in st], marker=".", lw=1.0,
                           label=f"{name} ({source})", **_style(name, source))
            a.set_title(f"{fp}: {'train loss (trailing mean of %d steps)' % k if what == 'loss' else 'held-out'}")
            a.set_xlabel("tokens seen (millions)")
            a.set_ylabel("nats" if what == "loss" else "bits per byte")
            if what == "loss":
                lo = min(bands[fp].lo[len(bands[fp].lo) // 4:])
                a.set_ylim(lo - 0.05, lo + 0.8)
            a.legend(fontsize=6)
            a.grid(alpha=0.3)
        fig.tight_layout()
        path = os.path.join(out, f"{what}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def zoom(out: str, runs: Mapping[str, Mapping], bands: Mapping[str, Band], base: Mapping[str, Mapping],
         fp_of: Mapping[str, str], k: int, replicas: int, start: int) -> str:
    """zoom.png: deviation from the same-seed baseline from `start` on, failure windows shaded."""
    fps = sorted(bands)
    fig, ax = _panels(fps)
    for fp in fps:
        a = ax[fp]
        b = smooth(base[fp]["train_loss"], k)
        n = len(b)
        xs = list(range(start - k, n))
        a.fill_between(xs, [bands[fp].lo[i] - b[i] for i in xs], [bands[fp].hi[i] - b[i] for i in xs],
                       color="#bbbbbb", alpha=0.6, label="baseline band")
        shaded = set()
        for key, run in sorted(runs.items()):
            if fp_of[key] != fp:
                continue
            name, source = key.split(".")[0], key.split(".")[1]
            s = smooth(run["train_loss"], k)
            a.plot(xs, [s[i] - b[i] for i in xs], lw=1.0, label=f"{name} ({source})", **_style(name, source))
            if source == "sim":
                for lo, hi in failure_windows([tuple(c) for c in run["contributors"]], replicas):
                    if (lo, hi) not in shaded:
                        shaded.add((lo, hi))
                        a.axvspan(lo, hi, color="#1f77b4", alpha=0.05)
        a.axhline(0, color="black", lw=0.6)
        a.set_title(f"{fp}: deviation from the baseline (same seed); failure windows shaded")
        a.set_xlabel("step")
        a.set_ylabel("nats")
        a.legend(fontsize=6)
        a.grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(out, "zoom.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def wallclock(out: str, real: Mapping[str, Mapping], k: int, replicas: int) -> str:
    """wallclock.png: the real runs' loss and committed steps against wall time."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.6))
    for key, run in sorted(real.items()):
        name = key.split(".")[0]
        st = _style(name, "sim")
        a.plot(run["wall"], smooth(run["train_loss"], k), lw=1.0, label=name, color=st["color"])
        b.plot(run["wall"], range(1, len(run["wall"]) + 1), lw=1.0, label=name, color=st["color"])
        for lo, hi in failure_windows([tuple(c) for c in run["contributors"]], replicas):
            b.axvspan(run["wall"][lo], run["wall"][min(hi, len(run["wall"]) - 1)], color=st["color"], alpha=0.06)
    a.set_title(f"real runs: train loss (trailing mean of {k} steps) against wall time")
    a.set_xlabel("seconds since the first commit")
    a.set_ylabel("nats")
    b.set_title("real runs: committed steps against wall time (failure windows shaded)")
    b.set_xlabel("seconds since the first commit")
    b.set_ylabel("step")
    for x in (a, b):
        x.legend(fontsize=7)
        x.grid(alpha=0.3)
    if real:
        floor = min(min(smooth(r["train_loss"], k)[len(r["train_loss"]) // 4:]) for r in real.values())
        a.set_ylim(floor - 0.05, floor + 0.8)
    fig.tight_layout()
    path = os.path.join(out, "wallclock.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
