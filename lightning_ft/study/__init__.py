"""The MoE accuracy study with injected failures (the paper's §7.2 at CPU scale; docs/study/).

    lightning-ft study configs/study.yaml          # or: python -m lightning_ft.study configs/study.yaml

settings.py names settings and derives their failure schedules, sim.py is the in-process
simulator, real.py runs and reads `lightning-ft run` jobs, runner.py runs a study (real
runs, then simulations, cached per run), analysis.py computes bands, deviations and
conclusions, summary.py and plots.py write summary.md and the figures.
"""
