"""Self-launch's pure pieces (lightning_ft/strategy/self_launch.py): the program's command
line, the `lightning-ft run` command it execs and how `run` splits it back, W from devices;
and the launcher a Trainer builds without launcher variables (no job started)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lightning_ft.launch.argsplit import protect_separator, split_run_args
from lightning_ft.launch.cli import build_parser
from lightning_ft.strategy.self_launch import (CLI_MODULE, SelfLaunchError, run_command, script_argv,
                                               world_from_devices)


def test_script_argv_is_the_script_made_absolute_and_its_arguments_verbatim(tmp_path):
    (tmp_path / "train.py").write_text("")
    assert script_argv(["train.py", "--lr", "0.1", "--", "x=1"], None, str(tmp_path)) == [
        str(tmp_path / "train.py"), "--lr", "0.1", "--", "x=1"]
    assert script_argv([str(tmp_path / "train.py")], None, "/elsewhere") == [str(tmp_path / "train.py")]


@pytest.mark.parametrize("argv,module,words", [
    (["/x/train.py"], "pkg.train", ["`python -m pkg.train`", "python path/to/pkg/train.py", "lightning-ft run"]),
    (["-c"], None, ["(python -c, stdin or an interactive session)", "lightning-ft run --replicas R"]),
    ([""], None, ["(python -c, stdin or an interactive session)"]),
    (["gone.py"], None, ["has none ('gone.py')"]),
])
def test_what_cannot_be_started_again_says_how_to_launch(tmp_path, argv, module, words):
    with pytest.raises(SelfLaunchError) as e:
        script_argv(argv, module, str(tmp_path))
    for w in words:
        assert w in str(e.value)


def test_run_command_passes_the_script_arguments_verbatim_and_the_overrides_to_lightning_ft():
    script = ["/w/train.py", "--steps", "5", "--", "lr=0.1", "replicas=9"]
    cmd = run_command("/py", script, nproc=2, config="/w/job.yaml",
                      overrides=["job=a", "failure.events=[{replica: 1}]"])
    assert cmd == ["/py", "-m", CLI_MODULE, "run", "--nproc-per-replica", "2", "--config", "/w/job.yaml",
                   "/w/train.py", "ft.job=a", "ft.failure.events=[{replica: 1}]", "--",
                   "--steps", "5", "--", "lr=0.1", "replicas=9"]
    # what `lightning-ft run` makes of it (cli.main: protect_separator, argparse, split_run_args)
    a = build_parser().parse_args(protect_separator(cmd[3:]))
    assert (a.nproc_per_replica, a.config, a.script, a.replicas) == (2, "/w/job.yaml", "/w/train.py", None)
    split = split_run_args(a.args, hydra_app=False)
    assert split.ft_overrides == ["job=a", "failure.events=[{replica: 1}]"]
    assert split.script_args == script[1:]  # `replicas=9` is the script's: it came after the lone --


def test_run_command_without_config_or_overrides():
    assert run_command("/py", ["/t.py"], nproc=1) == ["/py", "-m", CLI_MODULE, "run", "--nproc-per-replica", "1",
                                                       "/t.py", "--"]


def test_w_is_the_number_of_devices_lightning_resolved():
    assert world_from_devices(None) == 1
    assert world_from_devices([]) == 1
    assert world_from_devices([torch.device("cpu")] * 3) == 3


PROGRAM = """
import json, os, sys
import lightning_ft, lightning.pytorch as L
from lightning_ft.strategy.ft_hsdp import FTHSDPStrategy

out = []
s = FTHSDPStrategy(replicas=3, overrides=["job=abc", "run_dir=runs/x"])
t = L.Trainer(strategy=s, accelerator="cpu", devices=3, logger=False)
out.append([t.strategy.self_launching, t.strategy.launcher.command, t.strategy.launcher.cwd])
os.environ["LFT_CONFIG"] = "job.yaml"
t = L.Trainer(strategy="ft_hsdp", accelerator="cpu", logger=False)
out.append([t.strategy.self_launching, t.strategy.launcher.command, t.strategy.launcher._banner()])
print(json.dumps(out))
"""


def test_a_trainer_without_launcher_variables_builds_the_self_launch_command(tmp_path):
    (tmp_path / "prog.py").write_text(PROGRAM)
    (tmp_path / "job.yaml").write_text("replicas: 4\nrun_dir: runs/y\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LFT_")}
    r = subprocess.run([sys.executable, "prog.py", "--a", "--", "b=1"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    (on1, cmd1, cwd1), (on2, cmd2, banner2) = json.loads(r.stdout.strip().splitlines()[-1])
    prog, cli = str(tmp_path / "prog.py"), [sys.executable, "-m", CLI_MODULE, "run"]
    assert on1 and cwd1 == str(tmp_path)
    assert cmd1 == [*cli, "--nproc-per-replica", "3", prog, "ft.job=abc", "ft.run_dir=runs/x", "ft.replicas=3",
                    "--", "--a", "--", "b=1"]
    assert on2 and cmd2 == [*cli, "--nproc-per-replica", "1", "--config", str(tmp_path / "job.yaml"), prog,
                            "--", "--a", "--", "b=1"]
    assert ("4 replicas x 1 processes of prog.py under `lightning-ft run`, run dir " + str(tmp_path / "runs/y")
            ) in banner2


def test_replicas_must_be_a_positive_integer():
    from lightning_ft.strategy.ft_hsdp import FTHSDPError, FTHSDPStrategy

    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("LFT_")}
    try:
        with pytest.raises(FTHSDPError, match=r"replicas=0\): R must be an integer >= 1"):
            FTHSDPStrategy(replicas=0)
    finally:
        os.environ.update(saved)
