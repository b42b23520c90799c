"""A Hydra app's `ft:` node as lightning-ft's config: reading it, validating it, and its precedence
(defaults < the app's ft node < --config FILE < overrides), at launch and in process. The apps
here are tiny Hydra apps without torch, so each runs in well under a second."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from lightning_ft.config import ConfigError, load_config
from lightning_ft.hydra import is_hydra_app, parse_app_config, read_app_config

APP = '''
import json, os
import hydra
from omegaconf import OmegaConf

@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg):
    from lightning_ft.hydra import strategy_config
    try:
        ft = strategy_config(os.environ.get("APP_FT_FILE"), json.loads(os.environ.get("APP_FT_OVERRIDES", "[]")))
        print(json.dumps({"lr_intervention": ft.lr_intervention, "seed": ft.seed, "chunk": ft.ftar.chunk_bytes,
                          "replicas": ft.replicas, "model_lr": cfg.model.lr}))
    except Exception as e:
        print(json.dumps({"error": str(e)}))

if __name__ == "__main__":
    main()
'''
TRAIN_YAML = """
defaults:
  - _self_
  - ft: small
seed: 7
model:
  lr: 0.1
  steps: 10
"""
FT_SMALL = """
lr_intervention: linear
seed: ${seed}
ftar:
  chunk_bytes: 4096
"""


@pytest.fixture
def app(tmp_path):
    (tmp_path / "conf" / "ft").mkdir(parents=True)
    (tmp_path / "conf" / "train.yaml").write_text(TRAIN_YAML)
    (tmp_path / "conf" / "ft" / "small.yaml").write_text(FT_SMALL)
    (tmp_path / "app.py").write_text(APP)
    return tmp_path / "app.py"


def run_app(app, *args: str, env: dict | None = None) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("LFT_CONFIG", "LFT_HYDRA_APP")}
    r = subprocess.run([sys.executable, str(app), f"hydra.run.dir={app.parent}/out", *args], capture_output=True,
                       text=True, timeout=60, env={**base, **(env or {})}, cwd=app.parent)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- at launch (--cfg job)


def test_read_app_config_sees_groups_overrides_and_interpolations(app):
    cfg = read_app_config([sys.executable, str(app), "seed=9", "model.lr=0.5", "++ft.quorum.init_timeout_s=2"])
    assert cfg.keys == ["seed", "model", "ft"]
    assert cfg.ft == {"lr_intervention": "linear", "seed": 9, "ftar": {"chunk_bytes": 4096},
                      "quorum": {"init_timeout_s": 2}}
    assert not (app.parent / "outputs").exists(), "--cfg job runs no job and makes no output dir"


def test_read_app_config_reports_hydras_refusal(app):
    with pytest.raises(ConfigError) as e:
        read_app_config([sys.executable, str(app), "replicas=2"])
    assert "could not compose its config from these arguments" in str(e.value)
    assert "Could not override 'replicas'" in str(e.value)


def test_an_app_without_ft_node_has_none(app):
    cfg = read_app_config([sys.executable, str(app), "~ft"])
    assert cfg.keys == ["seed", "model"] and cfg.ft is None


def test_an_ft_node_that_needs_hydras_runtime_is_refused_with_why():
    text = "ft:\n  run_dir: ${hydra:runtime.output_dir}\n"
    with pytest.raises(ConfigError, match=r"cannot be resolved before the replicas start.*\$\{hydra:\.\.\.\}"):
        parse_app_config(text, "the app")


def test_printed_config_that_is_not_a_mapping_is_refused():
    with pytest.raises(ConfigError, match="not a YAML mapping"):
        parse_app_config("- a\n- b\n", "the app")


def test_is_hydra_app_looks_for_hydra_main(tmp_path, app):
    plain = tmp_path / "plain.py"
    plain.write_text("import argparse\n# mentions hydra but has no main\n")
    other = tmp_path / "other.py"
    other.write_text("from hydra import main, utils\n\n@main(config_path=None)\ndef f(cfg): ...\n")
    assert is_hydra_app(str(app)) and is_hydra_app(str(other))
    assert not is_hydra_app(str(plain)) and not is_hydra_app(str(tmp_path / "missing.py"))


# ----------------------------------------------------------------------------- precedence


def test_precedence_app_node_then_file_then_overrides(tmp_path):
    app_ft = {"lr_intervention": "linear", "seed": 3, "ftar": {"chunk_bytes": 4096, "num_chunks": 2}}
    f = tmp_path / "ft.yaml"
    f.write_text("seed: 4\nftar:\n  num_chunks: 8\n")
    cfg = load_config(str(f), ["ftar.num_chunks=16"], app=app_ft)
    assert cfg.lr_intervention == "linear"          # only the app sets it
    assert cfg.seed == 4                            # the file beats the app
    assert cfg.ftar.chunk_bytes == 4096             # only the app sets it
    assert cfg.ftar.num_chunks == 16                # the command line beats both
    assert cfg.replicas == 3                        # nobody sets it: the default


def test_the_app_node_is_validated_by_the_same_schema():
    with pytest.raises(ConfigError) as e:
        load_config(None, [], app={"ftar": {"chunk_mbb": 8}}, app_name="train.py: node 'ft'")
    assert str(e.value).startswith("train.py: node 'ft': unknown config key 'ftar.chunk_mbb'")
    assert "did you mean 'chunk_bytes'" in str(e.value)
    with pytest.raises(ConfigError, match="lr_intervention='fast': allowed values"):
        load_config(None, [], app={"lr_intervention": "fast"})


# ----------------------------------------------------------------------------- in process


def test_in_process_the_strategy_picks_up_the_running_apps_ft_node(app):
    """No launcher (torchrun/srun): defaults < the app's ft node (with the app's own overrides)."""
    out = run_app(app, "seed=11", "++ft.ftar.chunk_bytes=8192", "model.lr=0.3")
    assert out == {"lr_intervention": "linear", "seed": 11, "chunk": 8192, "replicas": 3, "model_lr": 0.3}


def test_in_process_a_file_and_overrides_beat_the_app_node(app, tmp_path):
    f = tmp_path / "code.yaml"
    f.write_text("lr_intervention: none\n")
    out = run_app(app, "seed=11", env={"APP_FT_FILE": str(f), "APP_FT_OVERRIDES": '["ftar.chunk_bytes=1024"]'})
    assert out["lr_intervention"] == "none" and out["chunk"] == 1024 and out["seed"] == 11


def test_under_the_launcher_lft_config_is_the_whole_truth(app, tmp_path):
    """The launcher already composed the app node into LFT_CONFIG: the in-process node is not re-applied."""
    f = tmp_path / "config.yaml"
    f.write_text("lr_intervention: sqrt\nreplicas: 2\n")
    out = run_app(app, env={"LFT_CONFIG": str(f), "LFT_HYDRA_APP": "1"})
    assert out["lr_intervention"] == "sqrt" and out["replicas"] == 2 and out["chunk"] == 4 * 1024 * 1024


def test_an_app_node_the_launcher_did_not_read_is_an_error_not_ignored(app, tmp_path):
    f = tmp_path / "config.yaml"
    f.write_text("replicas: 2\n")
    out = run_app(app, env={"LFT_CONFIG": str(f)})
    assert "lightning-ft run did not read it" in out["error"]
    # without an ft node there is nothing to lose: LFT_CONFIG is used
    assert run_app(app, "~ft", env={"LFT_CONFIG": str(f)})["replicas"] == 2


def test_outside_a_hydra_app_nothing_changes(tmp_path):
    f = tmp_path / "config.yaml"
    f.write_text("seed: 5\n")
    code = textwrap.dedent("""
        import json, sys
        from lightning_ft.hydra import strategy_config
        c = strategy_config(None, ["replicas=4"])
        print(json.dumps([c.seed, c.replicas, "hydra" in sys.modules]))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "LFT_CONFIG": str(f)})
    assert json.loads(r.stdout) == [5, 4, False], r.stderr
