"""`lightning-ft run` end to end with tiny scripts (no torch): which arguments reach the script,
which become the FT config, the Hydra app's ft node read by the launcher, per-process Hydra
run dirs, and the refusals (multirun, misplaced keys) before anything starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import yaml

ECHO = '''
import json, os, sys
out = os.path.join(os.environ["LFT_RUN_DIR"], "echo.r%s.json" % os.environ["LFT_REPLICA_ID"])
json.dump({"argv": sys.argv[1:], "replicas": os.environ["LFT_NUM_REPLICAS"]}, open(out, "w"))
'''
HYDRA_ECHO = '''
import json, os, sys
import hydra
from hydra.core.hydra_config import HydraConfig

@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg):
    out = os.path.join(os.environ["LFT_RUN_DIR"], "echo.r%s.json" % os.environ["LFT_REPLICA_ID"])
    json.dump({"argv": sys.argv[1:], "replicas": os.environ["LFT_NUM_REPLICAS"], "lr": cfg.model.lr,
               "output_dir": HydraConfig.get().runtime.output_dir}, open(out, "w"))

if __name__ == "__main__":
    main()
'''
TRAIN_YAML = """
seed: 7
model:
  lr: 0.1
ft:
  replicas: 2
  lr_intervention: linear
  seed: ${seed}
  quorum:
    init_timeout_s: 4
"""


def lft_run(tmp_path, etcd_endpoint, *args, script: str, flags: tuple = ()) -> tuple[subprocess.CompletedProcess, str]:
    job = "args" + uuid.uuid4().hex[:8]
    run_dir = str(tmp_path / job)
    r = subprocess.run([sys.executable, "-m", "lightning_ft.launch.cli", "run", "--etcd", etcd_endpoint, "--job", job,
                        "--run-dir", run_dir, "--no-status", "--timeout", "60", *flags, script, *args],
                       capture_output=True, text=True, timeout=120)
    return r, run_dir


def echoes(run_dir: str, replicas: int) -> list[dict]:
    return [json.load(open(os.path.join(run_dir, f"echo.r{rid}.json"))) for rid in range(replicas)]


def hydra_app(tmp_path) -> str:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "train.yaml").write_text(TRAIN_YAML)
    (tmp_path / "app.py").write_text(HYDRA_ECHO)
    return str(tmp_path / "app.py")


def test_script_gets_its_arguments_verbatim_and_ft_gets_the_rest(tmp_path, etcd_endpoint):
    script = tmp_path / "echo.py"
    script.write_text(ECHO)
    r, run_dir = lft_run(tmp_path, etcd_endpoint, "ft.seed=5", "--steps", "3", "replicas=1", "lr=0.1", "--",
                         "replicas=9", "--", "ft.seed=6", script=str(script))
    assert r.returncode == 0, r.stderr
    (echo,) = echoes(run_dir, 1)
    assert echo == {"argv": ["--steps", "3", "lr=0.1", "replicas=9", "--", "ft.seed=6"], "replicas": "1"}
    cfg = yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))
    assert cfg["seed"] == 5 and cfg["replicas"] == 1


def test_a_separator_before_the_script_is_accepted(tmp_path, etcd_endpoint):
    script = tmp_path / "echo.py"
    script.write_text(ECHO)
    r, run_dir = lft_run(tmp_path, etcd_endpoint, "a", script=str(script), flags=("--replicas", "1", "--"))
    assert r.returncode == 0, r.stderr
    assert echoes(run_dir, 1)[0]["argv"] == ["a"]


def test_hydra_app_config_composes_with_the_command_line_and_output_is_per_replica(tmp_path, etcd_endpoint):
    app = hydra_app(tmp_path)
    # no --replicas: the app's ft node says 2; ft.lr_intervention beats the app's linear
    r, run_dir = lft_run(tmp_path, etcd_endpoint, "model.lr=0.5", "seed=3", "ft.lr_intervention=none", script=app)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "reading the Hydra app's config" in r.stdout and "2 replicas x 1 processes" in r.stdout
    cfg = yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))
    assert cfg["replicas"] == 2 and cfg["lr_intervention"] == "none"
    assert cfg["seed"] == 3, "the app's ft.seed interpolates the app's seed, overridden on the command line"
    assert cfg["quorum"]["init_timeout_s"] == 4.0
    for rid, echo in enumerate(echoes(run_dir, 2)):
        assert echo["lr"] == 0.5 and echo["replicas"] == "2"
        assert echo["argv"][1:] == ["model.lr=0.5", "seed=3"], "ft.* is not the app's"
        want = os.path.join(run_dir, f"replica_{rid}", "hydra", "i0.rank0")
        assert echo["output_dir"] == want
        saved = yaml.safe_load(open(os.path.join(want, ".hydra", "config.yaml")))
        assert saved["model"]["lr"] == 0.5 and saved["seed"] == 3
    assert not (tmp_path / "outputs").exists() and not os.path.exists("outputs")


def test_a_hydra_app_that_changes_directory_still_writes_under_the_run_dir(tmp_path, etcd_endpoint):
    app = hydra_app(tmp_path)
    r = subprocess.run([sys.executable, "-m", "lightning_ft.launch.cli", "run", "--etcd", etcd_endpoint, "--job",
                        "chdir" + uuid.uuid4().hex[:8], "--run-dir", "rel/run", "--no-status", "--timeout", "60",
                        app, "hydra.job.chdir=true"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = str(tmp_path / "rel" / "run")
    assert [e["output_dir"] for e in echoes(run_dir, 2)] == [
        os.path.join(run_dir, f"replica_{rid}", "hydra", "i0.rank0") for rid in (0, 1)]
    assert yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))["run_dir"] == run_dir


def test_hydra_multirun_is_refused_before_anything_starts(tmp_path, etcd_endpoint):
    app = hydra_app(tmp_path)
    r, run_dir = lft_run(tmp_path, etcd_endpoint, "-m", "model.lr=0.1,0.2", script=app)
    assert r.returncode == 2
    assert "Hydra multirun (-m) is not supported by lightning-ft run" in r.stderr
    assert "one lightning-ft run per sweep point" in r.stderr
    assert not os.path.exists(run_dir)


def test_an_ft_key_given_to_a_hydra_app_unprefixed_gets_a_hint(tmp_path, etcd_endpoint):
    app = hydra_app(tmp_path)
    r, run_dir = lft_run(tmp_path, etcd_endpoint, "lr_intervention=none", script=app)
    assert r.returncode == 2
    assert "Could not override 'lr_intervention'" in r.stderr
    assert "take the ft. prefix, e.g. ft.lr_intervention=none" in r.stderr
    assert not os.path.exists(run_dir)


def test_a_bad_key_in_the_apps_ft_node_is_refused_by_the_launcher(tmp_path, etcd_endpoint):
    app = hydra_app(tmp_path)
    r, _ = lft_run(tmp_path, etcd_endpoint, "++ft.ftar.chunk_mbb=8", script=app)
    assert r.returncode == 2
    assert "the Hydra config's node 'ft': unknown config key 'ftar.chunk_mbb'" in r.stderr
