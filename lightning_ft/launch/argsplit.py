"""Who owns each argument after the script in `lightning-ft run ... script.py ARGS` (docs/GUIDE.md, "Launching").

A pure function of the arguments and of whether the script is a Hydra app (`@hydra.main`):

| argument                       | Hydra app            | other script                         |
|--------------------------------|----------------------|--------------------------------------|
| `ft.KEY=VALUE`                 | lightning-ft: KEY=VALUE | lightning-ft: KEY=VALUE           |
| `KEY=VALUE`, KEY an FT key     | the app              | lightning-ft (`replicas=4`, as before)|
| `KEY=VALUE`, other KEY         | the app              | the script, unless KEY is a near-miss of an FT key (error) |
| anything else                  | the app              | the script                           |
| everything after a lone `--`   | the app, verbatim    | the script, verbatim                 |

"FT key" means the first dotted part is a top-level field of `FTConfig` (`replicas`, `ftar`, ...).
A Hydra app owns every `key=value` because that is its own syntax (`seed=1` is the app's seed);
lightning-ft's keys then take the `ft.` prefix. Script arguments keep their order.

For a Hydra app some arguments are refused because they cannot work under a supervisor of
R x W processes: multirun (`-m`, `--multirun`, `hydra.mode=MULTIRUN`) would run a whole sweep
inside every replica, the print-and-exit flags (`--cfg`, `--info`, `--help`, ...) would print
R x W times and train nothing, and a `hydra.run.dir` that is not per process would make the
processes write over each other's output. lightning-ft sets the run dir itself (`HYDRA_RUN_DIR`).
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from typing import Sequence

from lightning_ft.config import FTConfig

SEPARATOR = "\0--"
"""A lone `--` after the script, protected from argparse (which drops it) by `protect_separator`."""

FT_PREFIX = "ft."
FT_KEYS = tuple(f.name for f in dataclasses.fields(FTConfig))
"""Top-level keys of the FT config: the first dotted part of an unprefixed FT override."""

HYDRA_RUN_DIR = ("hydra.run.dir=${oc.env:LFT_RUN_DIR}/replica_${oc.env:LFT_REPLICA_ID}/hydra/"
                 "i${oc.env:LFT_INCARNATION}.rank${oc.env:RANK}")
"""Where each process of a Hydra app writes its output: RUN_DIR/replica_{rid}/hydra/i{incarnation}.rank{rank},
resolved by Hydra in each process from the variables the supervisor sets."""
PER_PROCESS_VARS = ("LFT_REPLICA_ID", "LFT_INCARNATION", "RANK")
"""A user's own hydra.run.dir must name all of these, or two processes would share it."""

_OVERRIDE_RE = re.compile(r"^([A-Za-z_][\w.]*)=")
_MULTIRUN_FLAGS = ("-m", "--multirun")
_PRINT_FLAGS = ("-c", "--cfg", "-i", "--info", "-h", "--help", "--hydra-help", "--version", "-sc",
                "--shell-completion", "--experimental-rerun")


class ArgSplitError(ValueError):
    """An argument after the script cannot be routed, or cannot work under `lightning-ft run`."""


@dataclass
class RunArgs:
    """The arguments after the script, split between lightning-ft and the script."""

    ft_overrides: list[str] = field(default_factory=list)
    """FT config overrides `KEY=VALUE` (the `ft.` prefix removed), in order."""
    script_args: list[str] = field(default_factory=list)
    """The script's arguments, verbatim and in order (for a Hydra app: plus `HYDRA_RUN_DIR` first)."""


def protect_separator(argv: Sequence[str]) -> list[str]:
    """`argv` with every lone `--` replaced by `SEPARATOR`, so that argparse passes it through."""
    return [SEPARATOR if a == "--" else a for a in argv]


def split_run_args(args: Sequence[str], *, hydra_app: bool, run_flags: Sequence[str] = ()) -> RunArgs:
    """Route each argument after the script (see the module docstring); raise ArgSplitError.

    `run_flags` are lightning-ft run's own options (`--replicas`, ...): given after a Hydra app's
    name they are a mistake (Hydra would refuse them), so the error says to move them.
    """
    out = RunArgs()
    verbatim = False
    for arg in args:
        if verbatim:
            out.script_args.append("--" if arg == SEPARATOR else arg)
            continue
        if arg == SEPARATOR:
            verbatim = True
            continue
        m = _OVERRIDE_RE.match(arg)
        key = m.group(1) if m else None
        if key is not None and key.startswith(FT_PREFIX) and len(key) > len(FT_PREFIX):
            out.ft_overrides.append(arg[len(FT_PREFIX):])
        elif key is not None and not hydra_app and key.split(".", 1)[0] in FT_KEYS:
            out.ft_overrides.append(arg)
        elif key is not None and not hydra_app and _near_ft_key(key):
            head = key.split(".", 1)[0]
            raise ArgSplitError(
                f"{arg!r} is ambiguous: {head!r} is not a lightning-ft config key, but close to "
                f"{_near_ft_key(key)!r}. Write ft.{_near_ft_key(key)}{key[len(head):]}=... for lightning-ft, "
                f"or put it after a lone -- to pass it to the script unchanged")
        else:
            out.script_args.append(arg)
    if hydra_app:
        out.script_args = _check_hydra(out.script_args, run_flags)
    return out


def unprefixed_ft_keys(script_args: Sequence[str]) -> list[str]:
    """The `KEY=VALUE` script arguments whose KEY looks like lightning-ft's (for a hint after an error)."""
    return [a for a in script_args if (m := _OVERRIDE_RE.match(a)) and m.group(1).split(".", 1)[0] in FT_KEYS]


def _near_ft_key(key: str) -> str | None:
    close = difflib.get_close_matches(key.split(".", 1)[0], FT_KEYS, n=1, cutoff=0.8)
    return close[0] if close else None


def _check_hydra(script_args: list[str], run_flags: Sequence[str]) -> list[str]:
    """Refuse what cannot run under the supervisor; put the per-process run dir first."""
    own_run_dir = None
    for arg in script_args:
        name = arg.split("=", 1)[0]
        if name in _MULTIRUN_FLAGS or re.fullmatch(r"\+{0,2}hydra\.mode=(?i:multirun)", arg):
            raise ArgSplitError(
                f"Hydra multirun ({arg}) is not supported by lightning-ft run: every replica would run the "
                "whole sweep, one job after another, each needing its own quorum and run directory. Start one "
                "lightning-ft run per sweep point instead, with its own --job and --run-dir, e.g.\n"
                "  for lr in 0.01 0.1; do lightning-ft run --job lr$lr --run-dir runs/lr$lr ... "
                "train.py model.lr=$lr; done")
        if name in _PRINT_FLAGS:
            raise ArgSplitError(
                f"Hydra's {arg} prints and exits: under lightning-ft run every process would do that and none "
                f"would train. Run the app directly to see it: python SCRIPT ... {arg}")
        if name in run_flags:
            raise ArgSplitError(
                f"{arg} comes after the script, so it is the Hydra app's argument, and Hydra has no such flag. "
                f"lightning-ft run's own flags go before the script: lightning-ft run {arg} ... SCRIPT ...")
        if re.fullmatch(r"\+{0,2}hydra\.run\.dir", name):
            own_run_dir = arg
    if own_run_dir is None:
        return [HYDRA_RUN_DIR, *script_args]
    missing = [v for v in PER_PROCESS_VARS if v not in own_run_dir]
    if missing:
        raise ArgSplitError(
            f"{own_run_dir!r} would be shared by several replica processes, which would write over each other's "
            f"Hydra output. Leave hydra.run.dir to lightning-ft (RUN_DIR/replica_<rid>/hydra/i<incarnation>."
            f"rank<rank>), or make it per process with {', '.join('${oc.env:%s}' % v for v in missing)}")
    return script_args
