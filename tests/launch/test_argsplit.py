"""The split of `lightning-ft run ... script.py ARGS` between lightning-ft and the script (table-driven)."""
from __future__ import annotations

import pytest

from lightning_ft.launch.argsplit import (
    HYDRA_RUN_DIR,
    SEPARATOR,
    ArgSplitError,
    protect_separator,
    split_run_args,
    unprefixed_ft_keys,
)

RUN_FLAGS = ["--replicas", "--nproc-per-replica", "--etcd", "--job", "--run-dir", "--no-status", "-h", "--help"]

# (args, hydra_app, FT overrides, script args without the injected hydra.run.dir)
CASES = [
    # prefixed FT overrides are lightning-ft's for every script; the rest keeps its order
    (["ft.ftar.chunk_bytes=1024", "model.lr=0.1"], True, ["ftar.chunk_bytes=1024"], ["model.lr=0.1"]),
    (["ft.ftar.chunk_bytes=1024", "--steps", "3"], False, ["ftar.chunk_bytes=1024"], ["--steps", "3"]),
    (["model.lr=0.1", "ft.replicas=2", "trainer.max_steps=5", "ft.seed=3"], True, ["replicas=2", "seed=3"],
     ["model.lr=0.1", "trainer.max_steps=5"]),
    # a Hydra app owns every unprefixed key=value, even one lightning-ft also has
    (["seed=42", "replicas=4"], True, [], ["seed=42", "replicas=4"]),
    # other scripts: the unprefixed FT form works as before; other keys reach the script
    (["replicas=4", "failure.events=[{replica: 1, step: 5}]"], False,
     ["replicas=4", "failure.events=[{replica: 1, step: 5}]"], []),
    (["lr=0.1", "--out=x", "a=b=c"], False, [], ["lr=0.1", "--out=x", "a=b=c"]),
    # Hydra's own syntax for the app's ft node goes to the app (the launcher reads the result)
    (["++ft.seed=3", "+ft.x=1", "~ft.checkpoint", "ft=fast"], True, [], ["++ft.seed=3", "+ft.x=1", "~ft.checkpoint",
                                                                         "ft=fast"]),
    # not overrides: file names, flags, bare words
    (["ft.txt", "ft.=3", "--ft.seed=1", "x"], False, [], ["ft.txt", "ft.=3", "--ft.seed=1", "x"]),
    # a lone -- ends lightning-ft's part; later ones are the script's
    (["ft.seed=1", SEPARATOR, "ft.seed=2", "replicas=3", SEPARATOR, "-x"], False, ["seed=1"],
     ["ft.seed=2", "replicas=3", "--", "-x"]),
    (["model.lr=0.1", SEPARATOR, "ft.seed=2"], True, [], ["model.lr=0.1", "ft.seed=2"]),
    # flags of lightning-ft run after a non-Hydra script are the script's (it may have its own)
    (["--replicas", "2"], False, [], ["--replicas", "2"]),
    # nothing but the injected run dir
    ([], True, [], []),
]


@pytest.mark.parametrize("args,hydra_app,ft,script", CASES)
def test_split_routes_each_argument_in_order(args, hydra_app, ft, script):
    out = split_run_args(args, hydra_app=hydra_app, run_flags=RUN_FLAGS)
    assert out.ft_overrides == ft
    assert out.script_args == ([HYDRA_RUN_DIR] + script if hydra_app else script)


def test_a_hydra_app_gets_a_per_process_run_dir_under_the_job_run_dir_first():
    out = split_run_args(["model.lr=1"], hydra_app=True)
    assert out.script_args == [HYDRA_RUN_DIR, "model.lr=1"]
    assert HYDRA_RUN_DIR == ("hydra.run.dir=${oc.env:LFT_RUN_DIR}/replica_${oc.env:LFT_REPLICA_ID}/hydra/"
                             "i${oc.env:LFT_INCARNATION}.rank${oc.env:RANK}")


def test_a_per_process_hydra_run_dir_of_the_user_is_kept_and_ours_not_added():
    own = "hydra.run.dir=/scratch/r${oc.env:LFT_REPLICA_ID}.${oc.env:LFT_INCARNATION}.${oc.env:RANK}"
    assert split_run_args([own, "a=1"], hydra_app=True).script_args == [own, "a=1"]


# (args, hydra_app, words the error must contain)
REFUSED = [
    (["-m", "model.lr=0.1,0.2"], True, ["multirun (-m)", "one lightning-ft run per sweep point", "--job"]),
    (["--multirun"], True, ["multirun (--multirun)"]),
    (["hydra.mode=MULTIRUN"], True, ["multirun (hydra.mode=MULTIRUN)"]),
    (["hydra.mode=multirun"], True, ["multirun"]),
    (["--cfg", "job"], True, ["--cfg prints and exits", "python SCRIPT"]),
    (["--cfg=job"], True, ["--cfg=job prints and exits"]),
    (["-c", "job"], True, ["-c prints and exits"]),
    (["--info"], True, ["prints and exits"]),
    (["--help"], True, ["prints and exits"]),
    (["--replicas", "2"], True, ["--replicas comes after the script", "go before the script"]),
    (["--run-dir=x"], True, ["--run-dir=x comes after the script"]),
    (["hydra.run.dir=out"], True, ["would be shared by several replica processes", "${oc.env:LFT_REPLICA_ID}",
                                   "${oc.env:LFT_INCARNATION}", "${oc.env:RANK}"]),
    (["hydra.run.dir=out/${oc.env:LFT_REPLICA_ID}"], True, ["${oc.env:RANK}"]),
    # near-misses of lightning-ft keys are ambiguous for scripts whose key=value lightning-ft owns
    (["replica=3"], False, ["'replica=3' is ambiguous", "ft.replicas=...", "after a lone --"]),
    (["ftarr.chunk_bytes=1"], False, ["close to 'ftar'", "ft.ftar.chunk_bytes=..."]),
]


@pytest.mark.parametrize("args,hydra_app,words", REFUSED)
def test_split_refuses_what_cannot_work_and_says_what_to_do(args, hydra_app, words):
    with pytest.raises(ArgSplitError) as e:
        split_run_args(args, hydra_app=hydra_app, run_flags=RUN_FLAGS)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("args", [["-m"], ["--cfg", "job"], ["hydra.run.dir=out"], ["-h"]])
def test_hydra_only_refusals_do_not_apply_to_other_scripts(args):
    assert split_run_args(args, hydra_app=False, run_flags=RUN_FLAGS).script_args == args


def test_refusals_apply_after_the_separator_too():
    """-m after -- still reaches Hydra in every replica."""
    with pytest.raises(ArgSplitError, match="multirun"):
        split_run_args([SEPARATOR, "-m"], hydra_app=True)


def test_protect_separator_marks_every_lone_double_dash_only():
    assert protect_separator(["run", "--replicas", "2", "s.py", "--", "a", "--b", "--"]) == [
        "run", "--replicas", "2", "s.py", SEPARATOR, "a", "--b", SEPARATOR]


def test_unprefixed_ft_keys_names_the_arguments_for_a_hint():
    assert unprefixed_ft_keys(["replicas=2", "model.lr=1", "ftar.num_chunks=2", "ft.seed=1", "--x"]) == [
        "replicas=2", "ftar.num_chunks=2"]
