"""Configuration of a lightning-ft job: omegaconf structured configs and override parsing (docs/GUIDE.md).

Every knob is a field of a small dataclass with a docstring right below it; `configs/default.yaml`
lists the same keys with their defaults. A config is built in three layers:

    cfg = load_config("configs/my_job.yaml", ["replicas=4", "ftar.num_chunks=8"])

1. the dataclass defaults (`OmegaConf.structured(FTConfig)`),
2. a YAML file, which may contain only known keys,
3. Hydra-style overrides `a.b=c`, whose values are parsed as YAML (`failure.kinds=[kill,hang]`),

and then `validate` checks enum-like strings and ranges. Every mistake raises `ConfigError`, which
names the dotted key, the value given and what is allowed, e.g.
`unknown config key 'ftar.chunk_mbb'; ftar has: transport, chunk_bytes, ... (did you mean 'chunk_bytes'?)`.

Keys and types are checked here, against the dataclass type hints, rather than left to omegaconf:
omegaconf reports keys inside lists relative to the list item, and 2.3 does not know `Literal`.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from typing import Any, Sequence, cast

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_ft.constants import BATCH_POLICIES, LR_MODES
from lightning_ft.config_schema import (CheckpointConfig, ConsistencyConfig, DataConfig, EtcdConfig, FailureConfig,
                                        FailureEvent, FTARConfig, FTConfig, HangConfig, NetworkConfig, QuorumConfig,
                                        StragglersConfig, SupervisorConfig)

__all__ = ["CheckpointConfig", "ConfigError", "ConsistencyConfig", "DataConfig", "EtcdConfig", "FailureConfig",
           "FailureEvent", "FTARConfig", "FTConfig", "HangConfig", "NetworkConfig", "QuorumConfig", "StragglersConfig",
           "SupervisorConfig", "apply_overrides", "checkpoint_dir", "fingerprint", "load_config", "loader_state_dir",
           "parse_overrides", "to_yaml", "validate"]

TRANSPORTS = ("tcp", "rdma", "shm", "auto")
"""FTAR transports (docs/ARCHITECTURE.md, "The exchange"): ring links over TCP, RDMA (pyverbs), or shared memory
between processes of one host; `auto` picks per link (shm on one host, rdma where both
ends have a verbs device, tcp otherwise)."""
FAILURE_KINDS = ("kill", "hang", "exception", "corrupt")
"""Injected failures: SIGKILL the replica, stop making progress, raise inside the training step,
or flip a bit in one parameter (silent data corruption: the divergence guard must catch it)."""
DATA_SHARDS = ("processes", "slots")
"""How a generic IterableDataset train stream is split (strategy/data_shards.py)."""

_OVERRIDE_RE = re.compile(r"^[A-Za-z_][\w.]*=")
_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or holds a value out of range.

    `key` is the dotted key of the (first) problem, or None when the problem is not about one key.
    """

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


# The schema (one dataclass per section) is lightning_ft/config_schema.py.


# --------------------------------------------------------------------------------------------
# Loading and overrides
# --------------------------------------------------------------------------------------------


def load_config(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = (), *,
                app: Any = None, app_name: str = "the app's ft config") -> FTConfig:
    """Defaults, then `app`, then the YAML file at `path` (known keys only), then `overrides`; validated.

    `app` is a mapping with the same schema (e.g. the `ft:` node of a Hydra app's config, see
    `lightning_ft.hydra`); its errors are prefixed with `app_name`.
    Returns a typed omegaconf DictConfig: assignments to it are still type-checked.
    """
    cfg = OmegaConf.structured(FTConfig)
    if app is not None:
        cfg = _merge_layer(cfg, app, app_name)
    if path is not None:
        with open(path) as f:
            try:
                raw = yaml.safe_load(f)
            except yaml.YAMLError as e:
                raise ConfigError(f"{path}: not valid YAML: {e}") from None
        cfg = _merge_layer(cfg, {} if raw is None else raw, str(path))
    apply_overrides(cfg, overrides)
    validate(cfg)
    return cast(FTConfig, cfg)


def _merge_layer(cfg: Any, raw: Any, where: str) -> Any:
    """`cfg` merged with the plain mapping `raw` (known keys and types only); errors name `where`."""
    try:
        return OmegaConf.merge(cfg, _coerce(raw, FTConfig, ""))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}", e.key) from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where}: {_first_line(e)}") from None


def parse_overrides(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split a command line into (overrides `a.b=c`, other args), each in its original order."""
    overrides: list[str] = []
    rest: list[str] = []
    for arg in args:
        (overrides if _OVERRIDE_RE.match(arg) else rest).append(arg)
    return overrides, rest


def apply_overrides(cfg: Any, overrides: Sequence[str]) -> Any:
    """Apply Hydra-style `a.b=c` overrides to `cfg` in place and return it.

    Values are parsed as YAML (`[kill,hang]`, `{replica: 1, step: 5}`, `1e-3`); string fields take
    the text as written, so `etcd.endpoint=10.0.0.1:2379` stays a string. Keys and types are checked;
    ranges are not (that is `validate`, which `load_config` runs after all overrides).
    """
    for item in overrides:
        if not _OVERRIDE_RE.match(item):
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. replicas=4)")
        key, text = item.split("=", 1)
        tp = _resolve_key(cfg, key)
        value = _coerce(_parse_value(text, tp), tp, key)
        try:
            OmegaConf.update(cfg, key, value, merge=True)
        except OmegaConfBaseException as e:
            raise ConfigError(f"cannot set {key}={text}: {_first_line(e)}", key) from None
    return cfg


def to_yaml(cfg: Any, *, redact_secret: bool = True) -> str:
    """The config as YAML, e.g. to save next to a run; a non-empty secret or etcd password is shown as "***"."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    if redact_secret and cfg.secret:
        cfg = OmegaConf.merge(cfg, {"secret": "***"})
    if redact_secret and cfg.etcd.password:
        cfg = OmegaConf.merge(cfg, {"etcd": {"password": "***"}})
    return OmegaConf.to_yaml(cfg)


def fingerprint(cfg: Any) -> dict[str, Any]:
    """The config fields every replica of a job must agree on; a joiner whose values differ is
    refused at registration, by field name. The replica manager adds what the config does not
    hold: a tag of the secret and a hash of the model's parameter names, shapes and dtypes."""
    return {
        "job": str(cfg.job),
        "replicas": int(cfg.replicas),
        "nproc_per_replica": int(cfg.nproc_per_replica),
        "min_replicas": int(cfg.min_replicas),
        "chunk_bytes": int(cfg.ftar.chunk_bytes),
        "num_chunks": int(cfg.ftar.num_chunks),
        "bucket_bytes": int(cfg.ftar.bucket_bytes),
        "seed": int(cfg.seed),
        "lr_intervention": str(cfg.lr_intervention),
        "digest_every": int(cfg.consistency.every_n_steps),
        "checkpoint_every": int(cfg.checkpoint.every_n_steps),
        "batch_policy": str(cfg.batch_policy),
        "stragglers": f"{cfg.stragglers.policy} {float(cfg.stragglers.threshold)} {int(cfg.stragglers.window)}",
    }


def checkpoint_dir(cfg: Any) -> str:
    """`checkpoint.dir`, or {run_dir}/checkpoints when it is empty."""
    return str(cfg.checkpoint.dir) or os.path.join(str(cfg.run_dir), "checkpoints")


def loader_state_dir(cfg: Any) -> str:
    """`data.state_dir`, or {checkpoint dir}/loader_state when it is empty."""
    return str(cfg.data.state_dir) or os.path.join(checkpoint_dir(cfg), "loader_state")


# --------------------------------------------------------------------------------------------
# Validation (ranges and enum-like strings)
# --------------------------------------------------------------------------------------------


def validate(cfg: Any) -> None:
    """Check enum-like strings and ranges; raise one ConfigError listing every problem."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    problems: list[tuple[str, str]] = []

    def bad(key: str, value: Any, allowed: str) -> None:
        problems.append((key, f"{key}={value!r}: {allowed}"))

    def choice(key: str, value: Any, allowed: Sequence[str]) -> None:
        if value not in allowed:
            bad(key, value, "allowed values are " + ", ".join(repr(a) for a in allowed))

    def at_least(key: str, value: Any, low: float, strict: bool = False) -> None:
        if value < low or (strict and value == low):
            bad(key, value, f"must be {'>' if strict else '>='} {low}")

    if not _JOB_RE.match(cfg.job):
        bad("job", cfg.job, "must be non-empty letters, digits, '_', '.' or '-' (it names etcd keys)")
    at_least("replicas", cfg.replicas, 1)
    at_least("nproc_per_replica", cfg.nproc_per_replica, 1)
    if not 1 <= cfg.min_replicas <= max(cfg.replicas, 1):
        bad("min_replicas", cfg.min_replicas, f"must be between 1 and replicas ({cfg.replicas})")
    choice("lr_intervention", cfg.lr_intervention, LR_MODES)
    choice("batch_policy", cfg.batch_policy, BATCH_POLICIES)
    from lightning_ft.coord.stragglers import POLICIES as STRAGGLER_POLICIES

    choice("stragglers.policy", cfg.stragglers.policy, STRAGGLER_POLICIES)
    if cfg.stragglers.threshold != 0:
        at_least("stragglers.threshold", cfg.stragglers.threshold, 1.0, strict=True)
    at_least("stragglers.window", cfg.stragglers.window, 1)
    at_least("hang.report_after_s", cfg.hang.report_after_s, 0, strict=True)
    if not cfg.run_dir:
        bad("run_dir", cfg.run_dir, "must be a directory path")
    at_least("seed", cfg.seed, 0)
    from lightning_ft.secret import MIN_LENGTH, REDACTED

    if cfg.secret and cfg.secret != REDACTED and len(cfg.secret) < MIN_LENGTH:
        problems.append(("secret", f"secret: {len(cfg.secret)} characters; a job secret needs at least {MIN_LENGTH} "
                                   f"(better: leave it empty and set LFT_SECRET_FILE)"))

    e = cfg.etcd
    problems.extend(_etcd_problems(e))
    at_least("etcd.lease_ttl_s", e.lease_ttl_s, 0, strict=True)
    at_least("etcd.hang_timeout_s", e.hang_timeout_s, 0, strict=True)
    at_least("etcd.connect_timeout_s", e.connect_timeout_s, 0, strict=True)
    if not e.prefix.startswith("/") or e.prefix.endswith("/"):
        bad("etcd.prefix", e.prefix, "must start with '/' and not end with '/' (e.g. '/lft')")

    at_least("quorum.init_timeout_s", cfg.quorum.init_timeout_s, 0)
    at_least("quorum.poll_interval_s", cfg.quorum.poll_interval_s, 0, strict=True)

    f = cfg.ftar
    choice("ftar.transport", f.transport, TRANSPORTS)
    at_least("ftar.chunk_bytes", f.chunk_bytes, 0, strict=True)
    at_least("ftar.bucket_bytes", f.bucket_bytes, 0, strict=True)
    at_least("ftar.num_chunks", f.num_chunks, 1)
    at_least("ftar.timeout_s", f.timeout_s, 0, strict=True)
    at_least("ftar.connect_timeout_s", f.connect_timeout_s, 0, strict=True)
    at_least("ftar.num_programs", f.num_programs, 1)
    if not cfg.network.bind_host:
        bad("network.bind_host", cfg.network.bind_host, 'must be a host name or address ("0.0.0.0": all)')
    at_least("consistency.every_n_steps", cfg.consistency.every_n_steps, 0)
    at_least("supervisor.crash_loop", cfg.supervisor.crash_loop, 1)
    at_least("supervisor.standby", cfg.supervisor.standby, 0)

    at_least("checkpoint.every_n_steps", cfg.checkpoint.every_n_steps, 0)
    at_least("checkpoint.keep", cfg.checkpoint.keep, 1)

    fl = cfg.failure
    for i, ev in enumerate(fl.events):
        key = f"failure.events.{i}"
        for name in ("replica", "step"):
            if OmegaConf.is_missing(ev, name):
                problems.append((f"{key}.{name}", f"{key}.{name} is required (no default)"))
        if not OmegaConf.is_missing(ev, "replica") and not 0 <= ev.replica < cfg.replicas:
            bad(f"{key}.replica", ev.replica, f"must be between 0 and replicas - 1 ({cfg.replicas - 1})")
        if not OmegaConf.is_missing(ev, "step"):
            at_least(f"{key}.step", ev.step, 0)
        choice(f"{key}.kind", ev.kind, FAILURE_KINDS)
        at_least(f"{key}.downtime_steps", ev.downtime_steps, 0)
    at_least("failure.mtbf_steps", fl.mtbf_steps, 0)
    for i, kind in enumerate(fl.kinds):
        choice(f"failure.kinds.{i}", kind, FAILURE_KINDS)
    if fl.mtbf_steps > 0 and not fl.kinds:
        bad("failure.kinds", list(fl.kinds), "must name at least one kind when failure.mtbf_steps > 0")
    at_least("failure.restart_delay_s", fl.restart_delay_s, 0)
    at_least("failure.seed", fl.seed, 0)
    choice("data.shard", cfg.data.shard, DATA_SHARDS)
    at_least("data.state_every_n_steps", cfg.data.state_every_n_steps, 0)

    if problems:
        head = "invalid config: " if len(problems) == 1 else "invalid config:\n  "
        raise ConfigError(head + "\n  ".join(msg for _, msg in problems), problems[0][0])


# --------------------------------------------------------------------------------------------
# Key and type checking against the dataclass type hints
# --------------------------------------------------------------------------------------------


def _resolve_key(cfg: Any, key: str) -> Any:
    """The declared type at dotted `key` (list items by index), or ConfigError naming the key."""
    tp: Any = FTConfig
    node: Any = cfg
    parts = key.split(".")
    for i, part in enumerate(parts):
        here = ".".join(parts[:i])
        if dataclasses.is_dataclass(tp):
            hints = typing.get_type_hints(tp)
            if part not in hints:
                raise _unknown_key(".".join(parts[: i + 1]), here, list(hints), full_key=key)
            tp = hints[part]
        elif typing.get_origin(tp) is list:
            if not part.isdigit():
                raise ConfigError(f"config key {key!r}: {here} is a list; {part!r} is not an index", key)
            if node is not None and int(part) >= len(node):
                raise ConfigError(
                    f"config key {key!r}: index {part} is out of range; {here} has {len(node)} item(s)", key
                )
            tp = typing.get_args(tp)[0]
        else:
            raise ConfigError(f"unknown config key {key!r}; {here} is a leaf ({_type_name(tp)}), not a group", key)
        node = _child(node, part)
    return tp


def _child(node: Any, part: str) -> Any:
    if isinstance(node, ListConfig):
        return node._get_node(int(part))
    if isinstance(node, DictConfig):
        return node._get_node(part)
    return None


def _unknown_key(key: str, parent: str, allowed: list[str], full_key: str | None = None) -> ConfigError:
    """`key` is the path down to the unknown field; `full_key` the whole key given, if longer."""
    leaf = key.rsplit(".", 1)[-1]
    where = parent if parent else "the top level"
    full_key = full_key or key
    msg = f"unknown config key {full_key!r}"
    if full_key != key:
        msg += f" ({where} has no {leaf!r})"
    msg += f"; {where} has: {', '.join(allowed)}"
    close = difflib.get_close_matches(leaf, allowed, n=1)
    if close:
        msg += f" (did you mean {close[0]!r}?)"
    if ":" in leaf:
        msg += " (in YAML flow mappings write 'key: value', with a space after the colon)"
    return ConfigError(msg, full_key)


def _parse_value(text: str, tp: Any) -> Any:
    if tp is str:
        # String fields keep the text as written (YAML would turn 1:30 into 90), minus quotes.
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
            return yaml.safe_load(text)
        return text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"cannot parse value {text!r} as YAML: {e}") from None


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """`value` converted to `tp` (recursively), or ConfigError naming the key and expected type."""
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _wrong_type(key, value, tp)
        hints = typing.get_type_hints(tp)
        out = {}
        for k, v in value.items():
            sub = f"{key}.{k}" if key else str(k)
            if k not in hints:
                raise _unknown_key(sub, key, list(hints))
            out[k] = _coerce(v, hints[k], sub)
        return out
    if typing.get_origin(tp) is list:
        if not isinstance(value, list):
            raise _wrong_type(key, value, tp)
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{key}.{i}") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise _wrong_type(key, value, tp)


def _wrong_type(key: str, value: Any, tp: Any) -> ConfigError:
    where = f"config key {key!r}" if key else "the top level"
    return ConfigError(f"{where} expects {_type_name(tp)}, got {value!r} ({type(value).__name__})", key or None)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if dataclasses.is_dataclass(tp):
        names = ", ".join(f.name for f in dataclasses.fields(tp))
        return f"{cast(type, tp).__name__} (a mapping with keys {names})"
    return getattr(tp, "__name__", str(tp))


def _etcd_problems(e: Any) -> list[tuple[str, str]]:
    """(key, message) for each inconsistent or malformed etcd setting."""
    from lightning_ft.coord.etcd_failover import parse_endpoints, use_tls

    out: list[tuple[str, str]] = []
    eps = []
    for key, value in (("etcd.endpoint", e.endpoint), ("etcd.endpoints", list(e.endpoints))):
        if value:
            try:
                eps = parse_endpoints(value)
            except ValueError as err:
                out.append((key, f'{key}={value!r}: must be "" (embedded etcd) or "host:port" ({err})'))
    if e.endpoint and len(e.endpoints):
        out.append(("etcd.endpoints", "etcd.endpoint and etcd.endpoints are both set: use one of them"))
    if e.members < 1:
        out.append(("etcd.members", f"etcd.members={e.members!r}: must be >= 1"))
    elif e.members > 1 and (e.endpoint or len(e.endpoints)):
        out.append(("etcd.members", f"etcd.members={e.members}: sizes the embedded etcd, which is started only "
                                    "without etcd.endpoint(s); drop one of them"))
    if not (e.endpoint or len(e.endpoints)) and (e.ca_cert or e.cert or e.key or e.user):
        out.append(("etcd.endpoints", "etcd TLS and user settings are for an external etcd: set etcd.endpoint(s) "
                                      "(or --etcd https://HOST:PORT); the embedded etcd is plaintext on loopback"))
    if bool(e.cert) != bool(e.key):
        out.append(("etcd.cert", "etcd.cert and etcd.key go together: set both (client certificate and key) "
                                 "or neither"))
    if eps:
        try:
            use_tls(eps, bool(e.ca_cert or e.cert or e.key))
        except ValueError as err:
            out.append(("etcd.endpoint" if e.endpoint else "etcd.endpoints", str(err)))
    return out


def _first_line(e: Exception) -> str:
    return str(e).split("\n", 1)[0]
