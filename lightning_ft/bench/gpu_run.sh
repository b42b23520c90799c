#!/usr/bin/env bash
# The GPU path in one call on a lent GPU machine (docs/ARCHITECTURE.md, "The GPU path"):
#   run(command="bash lightning_ft/bench/gpu_run.sh", carry=["gpu-bundle"], timeout_s=560)
# after `make gpu-bundle` here. Installs the bundle with --no-index, runs every GPU check
# (lightning_ft/bench/gpu_run.py), and writes every JSON line and the log into $OUT.
# The interpreter: $PYTHON, else the first of python3 and python that imports torch.
# --dry-run (or GPU_DRY_RUN=1): the same steps on the CPU; --only job,overhead: those steps alone.
cd "$(dirname "$0")/../.." || exit 1
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3 python; do
    if command -v "$cand" >/dev/null && "$cand" -c "import torch" 2>/dev/null; then PY=$cand; break; fi
  done
fi
if [ -z "$PY" ]; then
  echo '{"bench": "gpu_run", "summary": "all", "ok": false, "failed": ["python"], "why": "neither python3 nor python imports torch; set PYTHON=/path/to/the/image/python"}'
  exit 1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m lightning_ft.bench.gpu_run "$@"
