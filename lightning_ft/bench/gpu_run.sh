#!/usr/bin/env bash
# The GPU path in one call on a lent GPU machine (docs/ARCHITECTURE.md, "The GPU path"):
#   run(command="bash lightning_ft/bench/gpu_run.sh", carry=["gpu-bundle"], timeout_s=560)
# after `make gpu-bundle` here. Installs the bundle with --no-index, runs every GPU check
# (lightning_ft/bench/gpu_run.py), and writes every JSON line and the log into $OUT.
# PYTHON picks the interpreter (default: python3); --dry-run or GPU_DRY_RUN=1: the same on the CPU.
cd "$(dirname "$0")/../.." || exit 1
PY=${PYTHON:-$(command -v python3 || command -v python)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m lightning_ft.bench.gpu_run "$@"
