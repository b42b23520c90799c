"""`python -m lightning_ft.study CONFIG.yaml [--out DIR] [--fresh] [key=value ...]`."""
from __future__ import annotations

import argparse
import sys
import time

DESCRIPTION = ("MoE accuracy study with injected failures: real and simulated runs, summary.md and plots "
               "(docs/study/)")


def _load() -> str:
    """The 1, 5 and 15 minute load averages (the machine may be shared)."""
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "n/a"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="study YAML (see configs/study.yaml)")
    p.add_argument("--out", default=None, help="output directory (default: the config's `out`)")
    p.add_argument("--fresh", action="store_true", help="recompute every run instead of reusing results/")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the study config, e.g. steps=100 jobs=1")


def run(a: argparse.Namespace) -> int:
    """Run the study of `a.config`; 0 when every simulator check passed, 3 when one did not,
    2 for a bad config."""
    from lightning_ft.study.config import StudyConfigError, load
    from lightning_ft.study.runner import Study
    from lightning_ft.study.summary import render

    try:
        cfg = load(a.config, a.overrides + ([f"out={a.out}"] if a.out else []))
    except (StudyConfigError, OSError) as e:
        print(f"lightning-ft study: {e}", file=sys.stderr)
        return 2
    meta = {"config": a.config, "started": time.time(), "load_start": _load()}
    study = Study(cfg, fresh=a.fresh, log=lambda m: print(m, flush=True))
    study.run()
    meta.update(seconds=time.time() - meta["started"], load_end=_load())
    outcome = render(study, meta)
    for path in outcome.figures:
        print(f"lightning-ft study: wrote {path}")
    bad = [c.name for c in outcome.checks if not c.ok]
    for line in outcome.conclusions:
        print(f"  {line}")
    if bad:
        print(f"lightning-ft study: the simulator check failed for {', '.join(bad)} (see summary.md)", file=sys.stderr)
        return 3
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lightning_ft.study", description=DESCRIPTION)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
