"""Self-launch: `python train.py` starts the job by itself (docs/ARCHITECTURE.md, "Self-launch").

When `FTHSDPStrategy` finds no launcher variables (`launch/environment.py::launcher_variables`),
the process the user started becomes the job's launcher, as Lightning's DDP does. The first
Trainer entry point (`fit`; `validate`, `test` or `predict` if one comes first) calls
`SelfLauncher.launch`, which replaces this process (exec: same pid, same terminal) with

    python -m lightning_ft.launch.cli run --nproc-per-replica W [--config C] SCRIPT [ft.KEY=VALUE ...] -- ARGS

that is `lightning-ft run` for the same script and arguments: R replicas (config `replicas`, or
`FTHSDPStrategy(replicas=R)`), W processes each (Trainer `devices`), an embedded etcd unless the
config names one, supervision, restarts, the status lines and the run directory. The process
the user started supervises and never trains (its training code never runs: exec does not
return), so the death of a replica never takes the job with it; Ctrl-C and the exit code are
`lightning-ft run`'s. The whole program runs in every replica, so code after `trainer.fit`
(test, predict, saving) runs there, as under `lightning-ft run`.

Pure pieces (`script_argv`, `run_command`, `world_from_devices`) are unit-tested; `SelfLauncher`
only prints and execs.
"""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional, Sequence

from typing_extensions import override

from lightning_ft.launch.environment import SELF_LAUNCH_ENV
from lightning_ft.strategy.lightning_compat import Launcher

if TYPE_CHECKING:
    from lightning_ft.strategy.ft_hsdp import FTHSDPStrategy

CLI_MODULE = "lightning_ft.launch.cli"


class SelfLaunchError(RuntimeError):
    """The program cannot start its job by itself; the message says how to launch it instead."""


HOW = ("or start the job with `lightning-ft run --replicas R --nproc-per-replica W train.py` "
       "(README.md; docs/GUIDE.md, \"Launching\")")


def script_argv(argv: Sequence[str], main_module: Optional[str], cwd: str) -> list[str]:
    """[absolute script path, its arguments] that start this program again, from `sys.argv` and
    `__main__.__spec__.name` (None for a script), as Lightning's `_basic_subprocess_cmd` does.
    Raises SelfLaunchError for what `lightning-ft run` cannot start: `python -m module`,
    `python -c`, stdin, an interactive session."""
    if main_module:
        raise SelfLaunchError(
            f"strategy='ft_hsdp' self-launch: this program was started as `python -m {main_module}`, and the "
            f"launcher starts script files only. Run the module's file instead (python path/to/"
            f"{main_module.replace('.', '/')}.py ...), {HOW}")
    if not argv or argv[0] in ("", "-c", "-") or not os.path.isfile(os.path.join(cwd, argv[0])):
        what = repr(argv[0]) if argv and argv[0] not in ("", "-c", "-") else \
            "python -c, stdin or an interactive session"
        raise SelfLaunchError(
            f"strategy='ft_hsdp' self-launch starts the program's script file again in every replica, but this "
            f"program has none ({what}). Put it in a file and run `python train.py`, {HOW}")
    return [os.path.normpath(os.path.join(cwd, argv[0])), *argv[1:]]


def run_command(python: str, script: Sequence[str], *, nproc: int, config: Optional[str] = None,
                overrides: Sequence[str] = ()) -> list[str]:
    """The `lightning-ft run` command line that self-launch execs: `script` (path and arguments,
    from `script_argv`) reaches the script verbatim after a lone `--`; the strategy's overrides go
    to lightning-ft as `ft.KEY=VALUE` (launch/argsplit.py)."""
    cmd = [python, "-m", CLI_MODULE, "run", "--nproc-per-replica", str(nproc)]
    if config:
        cmd += ["--config", config]
    return [*cmd, script[0], *(f"ft.{o}" for o in overrides), "--", *script[1:]]


def world_from_devices(devices: Optional[Sequence[Any]]) -> int:
    """W, the processes of each replica: the devices Lightning resolved from `Trainer(devices=...)`
    (on CPU `devices=2` is 2, "auto" is 1; on GPUs "auto" is every visible GPU)."""
    return max(1, len(devices or ()))


def original_cwd() -> str:
    """The directory the program was started in (a Hydra app may have changed into its output dir)."""
    if "hydra" in sys.modules:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            from hydra.utils import get_original_cwd

            return get_original_cwd()
    return os.getcwd()


class SelfLauncher(Launcher):
    """Lightning's launcher hook for self-launch: `launch` execs `command` and never returns."""

    def __init__(self, command: list[str], cwd: str, banner: Callable[[], str]) -> None:
        self.command = command
        self.cwd = cwd
        self._banner = banner

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return False

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> NoReturn:
        print(self._banner(), flush=True)
        sys.stderr.flush()
        os.chdir(self.cwd)
        os.execve(self.command[0], self.command, {**os.environ, SELF_LAUNCH_ENV: "1"})

    @override
    def kill(self, signum: Any) -> None:
        pass  # this process started no children: exec hands everything to `lightning-ft run`


def launcher_for(s: FTHSDPStrategy) -> Any:
    """The launcher of a program started without launcher variables: built at Trainer(...), so that
    what cannot self-launch fails there."""
    import __main__

    from lightning_ft.config import ConfigError
    from lightning_ft.strategy.errors import FTHSDPError

    if s.num_nodes > 1:
        raise FTHSDPError(f"strategy='ft_hsdp' self-launch runs on one machine, but Trainer(num_nodes="
                          f"{s.num_nodes}): start one `lightning-ft run --etcd HOST:PORT --replica-ids ...` "
                          f"per node, or torchrun/srun with `lightning-ft env` (docs/GUIDE.md: Multi-node)")
    cwd = original_cwd()
    spec = getattr(__main__, "__spec__", None)
    try:
        script = script_argv(sys.argv, spec.name if spec is not None else None, cwd)
        cfg = s.load_ft_config()
    except (SelfLaunchError, ConfigError) as e:
        raise FTHSDPError(str(e)) from None
    nproc = world_from_devices(s.parallel_devices)
    config = s._config_path or os.environ.get("LFT_CONFIG") or None
    command = run_command(sys.executable, script, nproc=nproc,
                          config=os.path.join(cwd, config) if config else None, overrides=s._overrides)
    run_dir = os.path.join(cwd, cfg.run_dir)

    def banner() -> str:
        return (f"lightning-ft: no launcher variables, so this process launches the job: {cfg.replicas} replicas "
                f"x {nproc} processes of {os.path.basename(script[0])} under `lightning-ft run`, run dir "
                f"{run_dir}; it supervises and does not train (Ctrl-C stops the job)")

    return SelfLauncher(command, cwd, banner)
