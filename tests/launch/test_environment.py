"""How launcher variables (lightning-ft run, torchrun, srun) map to one replica's identity
(lightning_ft/launch/environment.py), and what `lightning-ft env` prints."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lightning_ft.launch.environment import (LaunchEnvError, ReplicaEnv, expand_hostlist, format_variables,
                                             replica_env, replica_variables, slurm_port)

OURS = {"LFT_JOB": "gpt", "LFT_REPLICA_ID": "2", "LFT_NUM_REPLICAS": "4", "LFT_ETCD": "10.0.0.1:2379"}


def test_variables_set_directly_as_lightning_ft_run_sets_them():
    env = replica_env({**OURS, "LFT_INCARNATION": "3", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4242", "LFT_RUN_DIR": "/runs/a",
                       "LFT_RUN_ID": "r7", "LFT_CONFIG": "/runs/a/config.yaml"})
    assert env == ReplicaEnv(job="gpt", replica_id=2, num_replicas=4, etcd="10.0.0.1:2379", incarnation=3, rank=1,
                             local_rank=1, world_size=2, master_addr="127.0.0.1", master_port=4242,
                             run_dir="/runs/a", run_id="r7", config="/runs/a/config.yaml", launcher="env")


def test_one_process_without_rank_variables_is_a_replica_of_one_rank():
    env = replica_env(OURS)
    assert (env.rank, env.local_rank, env.world_size, env.incarnation, env.launcher) == (0, 0, 1, 0, "env")


@pytest.mark.parametrize("base,restarts,expected", [("", "0", 0), ("", "2", 2), ("5", "1", 6)])
def test_torchrun_incarnation_counts_its_restarts(base, restarts, expected):
    env = {**OURS, "TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": restarts, "RANK": "1",
           "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29400",
           "GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    if base:
        env["LFT_INCARNATION"] = base
    got = replica_env(env)
    assert (got.launcher, got.incarnation, got.rank, got.world_size, got.master_addr, got.master_port) == \
        ("torchrun", expected, 1, 2, "localhost", 29400)
    assert got.run_id == ""  # torchrun's own run id is per agent, not per job


def test_srun_step_maps_slurm_variables_to_the_replicas_own_process_group():
    slurm = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "4",
             "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NODELIST": "gpu[01-08]", "SLURM_JOB_ID": "123456"}
    got = replica_env({**OURS, **slurm})
    assert (got.launcher, got.rank, got.local_rank, got.world_size) == ("slurm", 3, 1, 4)
    assert got.master_addr == "gpu07", "the step's first node, not the allocation's"
    assert got.master_port == slurm_port(123456, 2) == 20000 + (123456 % 4000) * 10 + 2
    assert got.run_id == "123456", "each allocation is a run of the job"
    assert got.incarnation == 0


def test_srun_without_step_variables_and_with_overrides():
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n1,n2", "SLURM_JOB_ID": "9",
             "SLURM_RESTART_COUNT": "2", "MASTER_ADDR": "n2", "MASTER_PORT": "5000", "LFT_RUN_ID": "mine",
             "LFT_INCARNATION": "10"}
    got = replica_env({**OURS, **slurm})
    assert (got.world_size, got.master_addr, got.master_port, got.run_id, got.incarnation, got.local_rank) == \
        (2, "n2", 5000, "mine", 12, 0)


def test_torchrun_inside_a_slurm_step_is_torchrun():
    env = {**OURS, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "77", "TORCHELASTIC_RUN_ID": "x",
           "TORCHELASTIC_RESTART_COUNT": "1", "RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "4",
           "MASTER_PORT": "1234"}
    got = replica_env(env)
    assert (got.launcher, got.rank, got.world_size, got.incarnation) == ("torchrun", 3, 4, 1)


def test_replica_ports_differ_under_one_allocation():
    assert len({slurm_port(4242, r) for r in range(10)}) == 10


@pytest.mark.parametrize("nodelist,hosts", [
    ("node1", ["node1"]),
    ("node[01-03]", ["node01", "node02", "node03"]),
    ("gpu[7,9-10],cpu5", ["gpu7", "gpu9", "gpu10", "cpu5"]),
    ("a[1-2]-ib,b", ["a1-ib", "a2-ib", "b"]),
    ("rack[001-002]", ["rack001", "rack002"]),
])
def test_expand_slurm_host_lists(nodelist, hosts):
    assert expand_hostlist(nodelist) == hosts


@pytest.mark.parametrize("env,words", [
    ({}, ["LFT_JOB", "LFT_REPLICA_ID", "LFT_NUM_REPLICAS", "LFT_ETCD", "lightning-ft env"]),
    ({**OURS, "LFT_REPLICA_ID": "4"}, ["LFT_REPLICA_ID=4", "between 0 and", "(3)"]),
    ({**OURS, "LFT_REPLICA_ID": "x"}, ["LFT_REPLICA_ID='x' is not an integer"]),
    ({**OURS, "RANK": "2", "WORLD_SIZE": "2"}, ["rank 2 is not below", "world size 2"]),
    ({**OURS, "TORCHELASTIC_RUN_ID": "a", "RANK": "0", "LOCAL_RANK": "0"}, ["WORLD_SIZE is not set"]),
])
def test_bad_environments_say_what_is_missing(env, words):
    with pytest.raises(LaunchEnvError) as e:
        replica_env(env)
    for w in words:
        assert w in str(e.value)


def test_replica_variables_round_trip_through_the_mapping():
    v = replica_variables(job="gpt", replica_id=1, num_replicas=3, etcd="h:2379", run_dir="/r", config="/r/c.yaml",
                          secret_file="/r/secret")
    assert v == {"LFT_JOB": "gpt", "LFT_REPLICA_ID": "1", "LFT_NUM_REPLICAS": "3", "LFT_ETCD": "h:2379",
                 "LFT_RUN_DIR": "/r", "LFT_CONFIG": "/r/c.yaml", "LFT_SECRET_FILE": "/r/secret"}
    got = replica_env({**v, "TORCHELASTIC_RUN_ID": "t", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                       "MASTER_PORT": "1"})
    assert (got.job, got.replica_id, got.num_replicas, got.etcd, got.run_dir, got.config) == \
        ("gpt", 1, 3, "h:2379", "/r", "/r/c.yaml")


def test_formats_are_shell_safe():
    v = {"LFT_RUN_DIR": "/tmp/my runs/$x", "LFT_JOB": "j"}
    assert format_variables(v) == "export LFT_RUN_DIR='/tmp/my runs/$x'\nexport LFT_JOB=j"
    assert format_variables(v, "env") == "LFT_RUN_DIR=/tmp/my runs/$x\nLFT_JOB=j"
    assert json.loads(format_variables(v, "json")) == v
    out = subprocess.run(["bash", "-c", format_variables(v) + '\nprintf "%s" "$LFT_RUN_DIR"'],
                         capture_output=True, text=True).stdout
    assert out == "/tmp/my runs/$x"
    with pytest.raises(ValueError):
        format_variables(v, "xml")


def _env_cmd(tmp_path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("LFT_")}
    return subprocess.run([sys.executable, "-m", "lightning_ft.launch.cli", "env", *args], capture_output=True,
                          text=True, timeout=60, env={**base, **(env or {})}, cwd=tmp_path)


def test_lightning_ft_env_prints_what_torchrun_needs_and_a_secret_file(tmp_path):
    run_dir = tmp_path / "run"
    r = _env_cmd(tmp_path, "--replica-id", "1", "--replicas", "2", "--etcd", "10.0.0.1:2379", "--job", "gpt",
                 "--run-dir", str(run_dir), "--format", "json", "ftar.timeout_s=9")
    assert r.returncode == 0, r.stderr
    v = json.loads(r.stdout)
    assert {k: v[k] for k in ("LFT_JOB", "LFT_REPLICA_ID", "LFT_NUM_REPLICAS", "LFT_ETCD")} == \
        {"LFT_JOB": "gpt", "LFT_REPLICA_ID": "1", "LFT_NUM_REPLICAS": "2", "LFT_ETCD": "10.0.0.1:2379"}
    assert "LFT_SECRET" not in v, "never the secret itself"
    secret_file = v["LFT_SECRET_FILE"]
    assert oct(os.stat(secret_file).st_mode & 0o777) == "0o600"
    assert len(open(secret_file).read().strip()) == 32
    from lightning_ft.config import load_config

    cfg = load_config(v["LFT_CONFIG"])
    assert (cfg.ftar.timeout_s, cfg.replicas, cfg.job, cfg.etcd.endpoint, cfg.secret) == \
        (9.0, 2, "gpt", "10.0.0.1:2379", "")
    # the second replica's command reuses the same secret file and config
    r2 = _env_cmd(tmp_path, "--replica-id", "0", "--replicas", "2", "--etcd", "10.0.0.1:2379", "--job", "gpt",
                  "--run-dir", str(run_dir), "--format", "json", "ftar.timeout_s=9")
    assert json.loads(r2.stdout)["LFT_SECRET_FILE"] == secret_file, r2.stderr
    assert "torchrun" in r.stderr  # how to use it


def test_lightning_ft_env_refuses_bad_input(tmp_path):
    r = _env_cmd(tmp_path, "--replica-id", "2", "--replicas", "2", "--etcd", "h:1")
    assert r.returncode == 2 and "--replica-id 2" in r.stderr and "between 0 and replicas - 1 (1)" in r.stderr
    short = tmp_path / "short"
    short.write_text("tooshort\n")
    r = _env_cmd(tmp_path, "--replica-id", "0", "--replicas", "2", "--etcd", "h:1",
                 env={"LFT_SECRET_FILE": str(short)})
    assert r.returncode == 2 and "8 characters" in r.stderr and "tooshort" not in r.stderr
    r = _env_cmd(tmp_path, "--replica-id", "0", "--replicas", "2", "--etcd", "h:1", "ftar.chunk_mbb=1")
    assert r.returncode == 2 and "ftar.chunk_mbb" in r.stderr


@pytest.mark.parametrize("env,seen", [
    ({}, []),
    ({"LFT_CONFIG": "job.yaml", "LFT_SECRET_FILE": "/s", "MASTER_PORT": "1"}, []),  # user settings, no launcher
    ({"RANK": "0", "WORLD_SIZE": "2"}, ["RANK", "WORLD_SIZE"]),
    ({**OURS}, ["LFT_JOB", "LFT_REPLICA_ID", "LFT_NUM_REPLICAS", "LFT_ETCD"]),
    ({"TORCHELASTIC_RUN_ID": "x"}, ["TORCHELASTIC_RUN_ID"]),
    ({"SLURM_PROCID": "0"}, ["SLURM_PROCID"]),
    ({"LFT_SELF_LAUNCH": "1"}, ["LFT_SELF_LAUNCH"]),  # a self-launched job's process never launches again
])
def test_launcher_variables_tell_a_user_started_process_from_a_launched_one(env, seen):
    from lightning_ft.launch.environment import launcher_variables

    assert launcher_variables(env) == seen


def test_a_spare_has_a_token_and_no_replica_id_until_promoted():
    env = {"LFT_JOB": "j", "LFT_NUM_REPLICAS": "3", "LFT_ETCD": "h:1", "LFT_STANDBY": "s0", "RANK": "1",
           "WORLD_SIZE": "2"}
    e = replica_env(env)
    assert (e.standby, e.replica_id, e.rank, e.world_size) == ("s0", -1, 1, 2)
    with pytest.raises(LaunchEnvError, match="spare"):
        replica_env({**env, "LFT_REPLICA_ID": "1"})
    with pytest.raises(LaunchEnvError, match="LFT_REPLICA_ID"):  # without the token it is a replica again
        replica_env({k: v for k, v in env.items() if k != "LFT_STANDBY"})
