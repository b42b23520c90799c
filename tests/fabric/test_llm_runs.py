"""Acceptance (a) and (c) of issue 41, in the LitGPT venv (`make llm-venv`; built here when missing,
skipped with the reason when it cannot be): each program unmodified but for strategy="ft_hsdp",
run fault-free and then with a SIGKILL of one process of a replica at an arbitrary moment; each
ends with identical replicas, every batch once (the ledger) and its loss in the fault-free band.

(a) LitGPT's own pretraining loop, `litgpt.pretrain.main`, with a Fabric the script builds;
(c) a Hugging Face causal LM under the Trainer: gradient checkpointing, bf16-mixed, W = 2.
"""
from __future__ import annotations

import os
import subprocess

import pytest

from tests.acceptance.faults import run_with_faults
from tests.fabric.acceptance import summary
from tests.strategy.runs import lft_run, ok

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
VENV = os.path.join(ROOT, ".venv-llm")


@pytest.fixture(scope="module")
def llm_python() -> str:
    """The LitGPT venv's python (litgpt 0.5.13 and transformers, beside this package)."""
    if not os.path.exists(os.path.join(VENV, ".installed")):
        try:
            proc = subprocess.run(["make", "llm-venv"], cwd=ROOT, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"the LitGPT venv (make llm-venv) could not be created: {e}")
        if proc.returncode != 0:
            pytest.skip(f"the LitGPT venv (make llm-venv) could not be created: {(proc.stdout + proc.stderr)[-800:]}")
    return os.path.join(VENV, "bin", "python")


def _check(s: dict, run, replicas: int, steps: int) -> None:
    assert s["identical"], ok(run)
    assert set(s["steps"].values()) == {steps}, s
    assert s["ledger"]["ok"] and s["ledger"]["steps"] == steps, s
    assert len(s["ledger"]["batches"]) == replicas, s
    assert s["in_band"], s


def test_litgpt_pretrain_main_under_a_kill_ends_identical_exactly_once_in_band(tmp_path, etcd_endpoint, llm_python):
    app, steps = os.path.join(HERE, "litgpt_pretrain_app.py"), 150
    # steps of ~0.2 s: the killed replica restarts (imports ~10 s here) while the job still trains
    args = ("--steps", str(steps), "--save-interval", "25", "--sample-delay", "0.025")
    wait = ("stragglers.policy=wait",)  # see tests/fabric/test_fabric_runs.py::WAIT
    clean = lft_run(tmp_path, etcd_endpoint, "--out", str(tmp_path / "clean"), *args, replicas=2, script=app,
                    timeout=150, python=llm_python, overrides=wait)
    assert clean.proc.returncode == 0, ok(clean)
    faulted, faults = run_with_faults(tmp_path, etcd_endpoint, app, "--out", str(tmp_path / "faulted"), *args,
                                      replicas=2, steps=steps, seed=7, timeout=200, python=llm_python,
                                      overrides=wait)
    assert faulted.proc.returncode == 0, ok(faulted)
    assert "kill" in faults, faults
    s = summary("a: litgpt.pretrain.main, R=2, kill", clean, faulted, 2, steps, faults)
    _check(s, faulted, 2, steps)
    assert any(inc > 0 for _, inc in faulted.rows), ok(faulted)  # the killed replica came back
    for name in ("final", f"step-{steps:08d}"):  # LitGPT's own checkpoints, written once
        assert os.path.exists(tmp_path / "faulted" / name / "lit_model.pth"), name
        assert os.path.exists(tmp_path / "faulted" / name / "hyperparameters.yaml"), name


def test_hf_causal_lm_trainer_bf16_checkpointing_w2_under_a_kill(tmp_path, etcd_endpoint, llm_python):
    app, steps = os.path.join(HERE, "hf_causal_app.py"), 120
    args = ("--steps", str(steps), "--step-sleep", "0.2")
    clean = lft_run(tmp_path, etcd_endpoint, *args, replicas=2, nproc=2, script=app, timeout=180,
                    python=llm_python)
    assert clean.proc.returncode == 0, ok(clean)
    faulted, faults = run_with_faults(tmp_path, etcd_endpoint, app, *args, replicas=2, nproc=2,
                                      steps=steps, seed=11, timeout=240, python=llm_python)
    assert faulted.proc.returncode == 0, ok(faulted)
    assert "kill" in faults, faults
    s = summary("c: HF LlamaForCausalLM, Trainer, bf16-mixed, gradient checkpointing, R=2 W=2, kill", clean,
                faulted, 2, steps, faults)
    _check(s, faulted, 2, steps)
    assert any(inc > 0 for _, inc in faulted.rows), ok(faulted)
