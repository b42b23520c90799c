# lightning-ft: the two README commands are `make demo` and `make test`; `make check` is the inner loop.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv llm-venv lint check test test-slow soak sim demo demo-quorum bench study study-smoke clean gpu-bundle gpu-check gpu-emulate

venv: $(STAMP)

# torch first, pinned: it is the CPU build on local disk here; a looser spec could pull a
# multi-GB CUDA build. Then the package with its extras. litdata goes in without its
# dependencies: it requires torchvision, which pip would bring as a CUDA build for a newer torch
# (and a torchvision that does not match torch breaks `import lightning`); `data-core` holds the
# rest of what it needs. The last line proves it: the pinned torch, no torchvision, imports work.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,triton,data-core]'
	$(BIN)/pip install -q --no-deps litdata==0.2.76
	$(BIN)/python -c "import importlib.util as u, torch, lightning, litdata, torchdata; \
	assert torch.__version__.startswith('2.13.0'), torch.__version__; \
	assert u.find_spec('torchvision') is None, 'torchvision was installed'; \
	print('venv: torch', torch.__version__, 'litdata', litdata.__version__, 'torchdata', torchdata.__version__, 'no torchvision')"
	touch $(STAMP)

# The acceptance programs of tests/fabric that run LitGPT and Hugging Face transformers get a venv of their
# own: litgpt 0.5.13 pins jsonargparse<=4.41 and huggingface-hub<1.4, which clash with the dev pins. It holds
# this package with its runtime dependencies, litgpt, transformers (litgpt's range) and torchmetrics (litgpt's
# pretraining imports it); tests/fabric builds it when missing and skips, saying why, when it cannot.
LLM_VENV ?= .venv-llm
llm-venv: $(LLM_VENV)/.installed

$(LLM_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(LLM_VENV)
	$(LLM_VENV)/bin/pip install -q --upgrade pip
	$(LLM_VENV)/bin/pip install -q torch==2.13.0
	$(LLM_VENV)/bin/pip install -q -e . 'litgpt==0.5.13' 'transformers>=4.51.3,<4.57' 'torchmetrics==1.9.0'
	$(LLM_VENV)/bin/python -c "import importlib.util as u, torch, litgpt, transformers, lightning_ft; \
	assert torch.__version__.startswith('2.13.0'), torch.__version__; \
	assert u.find_spec('torchvision') is None, 'torchvision was installed'; \
	print('llm venv: torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $@

# ruff and mypy, configured in pyproject.toml; zero findings is the bar, and `make test` runs both
# first (about 30 s), so a finding fails CI like a failing test.
lint: venv
	$(BIN)/ruff check
	$(BIN)/mypy

# The inner loop (3 minutes or less): pure and unit tests, no real etcd or processes
# (tests/conftest.py marks those `integration`).
check: venv
	$(BIN)/python -m pytest -q -m 'not slow and not integration' --durations=10

# mypy (about 12 s of one core) runs beside pytest instead of before it; a finding fails the
# target like a failing test, and its summary line is printed after pytest's.
test: venv
	$(BIN)/ruff check
	@rm -f $(VENV)/mypy.rc; ( $(BIN)/mypy > $(VENV)/mypy.log 2>&1; echo $$? > $(VENV)/mypy.rc ) & \
	$(BIN)/python -m pytest -q --durations=30; rc=$$?; wait; \
	echo "mypy: $$(tail -n 1 $(VENV)/mypy.log)"; \
	if [ "$$(cat $(VENV)/mypy.rc)" != 0 ]; then cat $(VENV)/mypy.log; exit 1; fi; exit $$rc

test-slow: venv
	$(BIN)/python -m pytest -q -m slow

# 100+ mixed faults (kill, hang, exception, link cut, whole-job kill + --resume, etcd leader kill), >= 10%
# overlapping, against 3 replicas of examples/train_lm.py; prints one {"bench": "soak", ...} line
# SOAK_ARGS="--standby 1": the same soak without and with a warm spare, ETTs side by side
soak: venv
	$(BIN)/python -m lightning_ft.bench.soak --faults 100 $(SOAK_ARGS)

# 3 replicas of examples/train_lm.py; one is killed mid-run and rejoins (about 1.5 min here)
demo: venv
	$(BIN)/python -m lightning_ft.demo

# The whole job simulated in one process on a virtual clock (lightning_ft/sim/job.py): SEEDS seeded
# schedules of 200 steps and 10 faults each, every promise checked; a failure prints its seed, a
# shrunk schedule and the command that replays it.
SEEDS ?= 1000
sim: venv
	$(BIN)/python -m lightning_ft.sim.job --seeds 0:$(SEEDS) --jobs 2

demo-quorum: venv
	$(BIN)/python -m lightning_ft.coord.demo show

bench: venv
	$(BIN)/python -m lightning_ft.bench.quorum

# The MoE accuracy study with injected failures (configs/study.yaml; about 30 min here): 3 real runs
# through `lightning-ft run` with SIGKILLs, the simulated grid and baseline seeds; writes docs/study/
# (summary.md, loss.png, eval.png, zoom.png, wallclock.png, results/). Finished runs are reused from
# docs/study/results/ unless STUDY_ARGS=--fresh.
study: venv
	$(BIN)/python -m lightning_ft.study configs/study.yaml $(STUDY_ARGS)

# A 2-setting grid with one real run checked against the simulator (<= 10 min here), into STUDY_OUT
STUDY_OUT ?= runs/study-smoke
study-smoke: venv
	$(BIN)/python -m lightning_ft.study configs/study_smoke.yaml --out $(STUDY_OUT) --fresh

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache

# The GPU path (docs/ARCHITECTURE.md, "The GPU path"). gpu-bundle: the wheels a lent GPU machine lacks
# (Python 3.12, manylinux x86-64) into gpu-bundle/ (ignored: the device call carries it), the tree and
# the wheels checked against the 64 MiB a call carries, and the proof: the wheels installed with
# --no-index into a clean Python 3.12 venv (build/gpu-bundle-venv) where torch, triton and lightning
# are metadata only, then etcd, gRPC, omegaconf, ... used for real. PY312=/path/to/python3.12 if needed.
gpu-bundle:
	$(PY) -m lightning_ft.bench.gpu_bundle build $(if $(PY312),--python312 $(PY312))

# On the lent GPU machine (no network), after gpu-bundle here: install the bundle, then every GPU
# check within 8 minutes, each step with its own timeout; JSON lines and logs into $$OUT.
# GPU_ARGS=--dry-run: the same steps on this CPU with tiny sizes.
gpu-check:
	bash lightning_ft/bench/gpu_run.sh $(GPU_ARGS)

# The lent image emulated on this CPU (build/gpu-image, about 5 GB, kept): Python 3.12, torch 2.11,
# Triton 3.6, Lightning 2.6.6; the bundle installed into it with --no-index, then the dry run there.
gpu-emulate: gpu-bundle
	$(PY) -m lightning_ft.bench.gpu_bundle emulate $(if $(PY312),--python312 $(PY312))
