"""The FT config of a Hydra app: an `ft:` node in the app's own config (docs/GUIDE.md, "Hydra apps").

A Hydra app (`@hydra.main`) may carry lightning-ft's config as a node `ft:` of its config, with
the schema of `configs/default.yaml`, validated by the same dataclasses (`FTConfig`). Precedence,
lowest first:

1. the `FTConfig` defaults,
2. the app's `ft:` node, as Hydra composes it (config groups, the app's own overrides such as
   `++ft.seed=3`, interpolations),
3. `lightning-ft run --config FILE` (on `--resume`: the run's recorded config.yaml),
4. lightning-ft run's flags (`--replicas`, ...) and `ft.KEY=VALUE` arguments,
5. `FTHSDPStrategy(config=..., overrides=[...], lr_intervention=...)` arguments in code.

Under `lightning-ft run`, layers 1-4 are composed once, before any replica starts: the launcher
reads the app's composed config with Hydra's own `--cfg job` (`read_app_config`), so the keys the
launcher needs (replicas, job, run_dir, ...) may come from the app's node too, and the result is
RUN_DIR/config.yaml (`LFT_CONFIG`). A process started without the launcher (torchrun/srun with
the LFT_* variables) composes layers 1-2 in process (`running_app_ft`). `strategy_config` is what
`FTHSDPStrategy.load_ft_config` calls.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_ft.config import ConfigError, FTConfig, load_config

FT_NODE = "ft"
LAUNCHER_READ_ENV = "LFT_HYDRA_APP"
"""Set to 1 by `lightning-ft run` when it has read the app's `ft:` node into LFT_CONFIG."""

_MAIN_RE = re.compile(r"\bhydra\.main\s*\(|^\s*from\s+hydra\s+import\s+[^\n]*\bmain\b", re.M)


@dataclass
class AppConfig:
    """What the launcher learns from a Hydra app's composed config."""

    keys: list[str]
    """Top-level keys of the app's config."""
    ft: Optional[dict]
    """Its `ft:` node with interpolations resolved, or None when it has none."""


def is_hydra_app(script: str) -> bool:
    """Whether `script` is a Hydra app: its source calls `hydra.main` (or imports `main` from hydra)."""
    try:
        with open(script, encoding="utf-8", errors="replace") as f:
            return bool(_MAIN_RE.search(f.read()))
    except OSError:
        return False


def parse_app_config(text: str, where: str) -> AppConfig:
    """The top-level keys and the resolved `ft:` node of a job config printed by `--cfg job`."""
    try:
        cfg = OmegaConf.create(text)
    except (OmegaConfBaseException, ValueError) as e:  # yaml errors are ValueErrors here
        raise ConfigError(f"{where}: the printed config is not a YAML mapping: {str(e).splitlines()[0]}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{where}: the printed config is not a YAML mapping")
    keys = [str(k) for k in cfg.keys()]
    if FT_NODE not in cfg:
        return AppConfig(keys, None)
    try:
        ft = OmegaConf.to_container(cfg[FT_NODE], resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(
            f"{where}: node {FT_NODE!r} cannot be resolved before the replicas start: {str(e).splitlines()[0]}. "
            "Interpolations into Hydra's runtime (${hydra:...}) are only known inside each process; "
            f"give those {FT_NODE}.* values literally or on the command line") from None
    if ft is not None and not isinstance(ft, dict):
        raise ConfigError(f"{where}: node {FT_NODE!r} is not a mapping of config keys: {ft!r}")
    return AppConfig(keys, ft)


def read_app_config(cmd: Sequence[str], timeout_s: float = 180.0) -> AppConfig:
    """Run the Hydra app command `cmd` (interpreter, script, its arguments) with `--cfg job`.

    Hydra composes the config and prints it without running the task, so this sees exactly the
    config every replica will get. Raises ConfigError with Hydra's message (or the app's
    traceback) when that fails.
    """
    where = f"the Hydra app {os.path.basename(cmd[1])}"
    p = subprocess.Popen([*cmd, "--cfg", "job"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise ConfigError(f"{where} did not print its config within {timeout_s:.0f} s ({' '.join(cmd)} --cfg job); "
                          "does it do slow work at import time?") from None
    if p.returncode != 0:
        tail = "\n".join(err.strip().splitlines()[-12:])
        raise ConfigError(f"{where} could not compose its config from these arguments ({' '.join(cmd[1:])} "
                          f"--cfg job exited {p.returncode}):\n{tail}")
    return parse_app_config(out, where)


def running_app_ft() -> Optional[dict]:
    """The `ft:` node of the Hydra app running in this process, resolved; None outside one or without it.

    Re-composes the app's config with Hydra's compose API from the job's config name and task
    overrides (the task function's `cfg` is not reachable from here).
    """
    if "hydra" not in sys.modules:
        return None  # not a Hydra app: nothing imported hydra
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized() or not GlobalHydra.instance().is_initialized():
        return None
    hc = HydraConfig.get()
    cfg = compose(config_name=hc.job.config_name, overrides=list(hc.overrides.task))
    if FT_NODE not in cfg:
        return None
    try:
        return OmegaConf.to_container(cfg[FT_NODE], resolve=True)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        raise ConfigError(f"the Hydra app's config: node {FT_NODE!r}: {str(e).splitlines()[0]}") from None


def strategy_config(path: Optional[str], overrides: Sequence[str]) -> FTConfig:
    """The strategy's FT config: `path` (else LFT_CONFIG), the running app's `ft:` node, `overrides`.

    LFT_CONFIG already holds the app's node when the launcher read it (LFT_HYDRA_APP=1); an app
    node the launcher did not read is an error rather than silently ignored.
    """
    launcher = os.environ.get("LFT_CONFIG") or None
    read_by_launcher = os.environ.get(LAUNCHER_READ_ENV) == "1"
    if path is None and launcher is not None and read_by_launcher:
        return load_config(launcher, overrides)
    app = running_app_ft()
    if path is None and launcher is not None:
        if app is not None:
            raise ConfigError(
                f"the Hydra app's config has an {FT_NODE!r} node, but lightning-ft run did not read it (it found no "
                f"@hydra.main in the script it started), so replicas and launcher could disagree. Start the file "
                f"that has @hydra.main, or move the {FT_NODE!r} settings to the lightning-ft command line "
                "(ft.KEY=VALUE)")
        return load_config(launcher, overrides)
    return load_config(path, overrides, app=app, app_name=f"the Hydra app's config, node {FT_NODE!r}")
