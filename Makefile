# lightning-ft: the two README commands are `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test test-slow soak demo demo-quorum bench clean

venv: $(STAMP)

# torch first, pinned: it is the CPU build on local disk here; a looser spec could pull a
# multi-GB CUDA build. Then the package with its extras.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,triton]'
	touch $(STAMP)

test: venv
	$(BIN)/python -m pytest -q

test-slow: venv
	$(BIN)/python -m pytest -q -m slow

# 100+ mixed faults (kill, hang, exception, whole-job kill + --resume, etcd leader kill), >= 10%
# overlapping, against 3 replicas of examples/train_lm.py; prints one {"bench": "soak", ...} line
soak: venv
	$(BIN)/python -m lightning_ft.bench.soak --faults 100

# 3 replicas of examples/train_lm.py; one is killed mid-run and rejoins (about 1.5 min here)
demo: venv
	$(BIN)/python -m lightning_ft.demo

demo-quorum: venv
	$(BIN)/python -m lightning_ft.coord.demo show

bench: venv
	$(BIN)/python -m lightning_ft.bench.quorum

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
