"""Tests for lightning_ft/config.py: defaults, YAML, overrides and the error messages (docs/GUIDE.md)."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from pathlib import Path

import pytest
import yaml
from omegaconf import DictConfig, OmegaConf

from lightning_ft import config_schema as config_module
from lightning_ft.config import (
    ConfigError,
    FTConfig,
    apply_overrides,
    checkpoint_dir,
    fingerprint,
    load_config,
    parse_overrides,
    to_yaml,
    validate,
)

DEFAULT_YAML = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"


def write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(text))
    return path


# ----------------------------------------------------------------------------- defaults


def test_defaults_match_the_design():
    cfg = load_config()
    assert isinstance(cfg, DictConfig)
    assert (cfg.job, cfg.replicas, cfg.nproc_per_replica, cfg.min_replicas) == ("lft", 3, 1, 1)
    assert (cfg.secret, cfg.lr_intervention, cfg.run_dir, cfg.seed) == ("", "sqrt", "runs/latest", 0)
    assert (cfg.etcd.endpoint, cfg.etcd.lease_ttl_s, cfg.etcd.hang_timeout_s) == ("", 3.0, 30.0)
    assert (cfg.etcd.connect_timeout_s, cfg.etcd.prefix) == (10.0, "/lft")
    assert (cfg.quorum.init_timeout_s, cfg.quorum.poll_interval_s) == (10.0, 0.05)
    assert cfg.ftar.transport == "tcp"
    assert cfg.ftar.chunk_bytes == 4 * 1024 * 1024
    assert (cfg.ftar.num_chunks, cfg.ftar.timeout_s, cfg.ftar.connect_timeout_s) == (4, 5.0, 5.0)
    assert cfg.ftar.num_programs == 2
    assert (cfg.network.bind_host, cfg.network.advertise_host) == ("0.0.0.0", "")
    assert cfg.consistency.every_n_steps >= 1 and cfg.supervisor.crash_loop == 3
    assert (cfg.checkpoint.every_n_steps, cfg.checkpoint.dir, cfg.checkpoint.keep) == (100, "", 3)
    assert list(cfg.failure.events) == []
    assert (cfg.failure.mtbf_steps, list(cfg.failure.kinds)) == (0.0, ["kill"])
    assert (cfg.failure.restart_delay_s, cfg.failure.seed) == (0.2, 0)


def test_default_yaml_lists_every_key_with_the_dataclass_default():
    raw = yaml.safe_load(DEFAULT_YAML.read_text())
    assert raw == OmegaConf.to_container(OmegaConf.structured(FTConfig))
    assert load_config(DEFAULT_YAML) == OmegaConf.structured(FTConfig)


def test_every_config_field_has_a_docstring_right_below_it():
    tree = ast.parse(inspect.getsource(config_module))
    classes = [n for n in tree.body
               if isinstance(n, ast.ClassDef) and dataclasses.is_dataclass(getattr(config_module, n.name))]
    undocumented = []
    for cls in classes:
        for i, stmt in enumerate(cls.body):
            if isinstance(stmt, ast.AnnAssign):
                nxt = cls.body[i + 1] if i + 1 < len(cls.body) else None
                if not (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                        and isinstance(nxt.value.value, str)):
                    undocumented.append(f"{cls.name}.{stmt.target.id}")
    assert sorted(c.name for c in classes) == ["CheckpointConfig", "ConsistencyConfig", "DataConfig", "EtcdConfig",
                                               "FTARConfig", "FTConfig", "FailureConfig", "FailureEvent", "HangConfig",
                                               "NetworkConfig", "QuorumConfig", "StragglersConfig", "SupervisorConfig"]
    assert undocumented == []


def test_to_yaml_round_trips_and_redacts_the_secret(tmp_path):
    cfg = load_config(overrides=["replicas=5", "failure.events=[{replica: 4, step: 9}]"])
    path = tmp_path / "dump.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg

    with_secret = load_config(overrides=["secret=hunter2-hunter2-hunter2"])
    dumped = to_yaml(with_secret)
    assert "hunter2" not in dumped and "secret: '***'" in dumped
    assert with_secret.secret == "hunter2-hunter2-hunter2"  # the config itself is untouched
    assert "hunter2" in to_yaml(with_secret, redact_secret=False)
    # the saved config loads again; its "***" is a placeholder, never taken for a secret
    path.write_text(dumped)
    assert load_config(path).secret == "***"


def test_a_short_secret_is_refused_without_showing_it():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["secret=hunter2"])
    assert e.value.key == "secret" and "7 characters" in str(e.value) and "at least 16" in str(e.value)
    assert "hunter2" not in str(e.value)


def test_fingerprint_holds_the_fields_every_replica_must_agree_on():
    cfg = load_config(overrides=["job=exp7", "replicas=4", "nproc_per_replica=2", "min_replicas=2"])
    assert fingerprint(cfg) == {"job": "exp7", "replicas": 4, "nproc_per_replica": 2, "min_replicas": 2,
                                "chunk_bytes": 4 << 20, "num_chunks": 4, "bucket_bytes": 4 << 20, "seed": 0,
                                "lr_intervention": "sqrt", "digest_every": cfg.consistency.every_n_steps,
                                "checkpoint_every": 100,
                                "batch_policy": "shrink", "stragglers": "exclude 1.3 10"}
    other = load_config(overrides=["job=exp7", "replicas=4", "nproc_per_replica=2", "min_replicas=2",
                                   "run_dir=/tmp/x", "ftar.timeout_s=9", "etcd.lease_ttl_s=2"])
    assert fingerprint(other) == fingerprint(cfg)  # local knobs may differ
    for key, value in (("seed", 3), ("ftar.num_chunks", 8), ("ftar.chunk_bytes", 1 << 20),
                       ("ftar.bucket_bytes", 1 << 20), ("lr_intervention", "linear"), ("min_replicas", 1),
                       ("stragglers.policy", "wait"), ("stragglers.threshold", 2.0), ("stragglers.window", 3)):
        changed = load_config(overrides=["job=exp7", "replicas=4", "nproc_per_replica=2", "min_replicas=2",
                                         f"{key}={value}"])
        assert fingerprint(changed) != fingerprint(cfg), key


def test_checkpoint_dir_defaults_under_run_dir():
    assert checkpoint_dir(load_config(overrides=["run_dir=runs/a"])) == "runs/a/checkpoints"
    assert checkpoint_dir(load_config(overrides=["checkpoint.dir=/ckpt"])) == "/ckpt"


# ----------------------------------------------------------------------------- YAML files


def test_yaml_file_overrides_defaults_and_keeps_the_rest(tmp_path):
    path = write_yaml(tmp_path, """
        job: exp1
        replicas: 4
        ftar:
          transport: rdma
          timeout_s: 2          # an int is fine for a float field
        failure:
          events:
            - {replica: 2, step: 50, kind: hang, downtime_steps: 10}
          kinds: [kill, exception]
    """)
    cfg = load_config(path)
    assert (cfg.job, cfg.replicas, cfg.ftar.transport) == ("exp1", 4, "rdma")
    assert cfg.ftar.timeout_s == 2.0 and isinstance(cfg.ftar.timeout_s, float)
    assert cfg.ftar.num_chunks == 4  # untouched default
    ev = cfg.failure.events[0]
    assert (ev.replica, ev.step, ev.kind, ev.downtime_steps) == (2, 50, "hang", 10)
    assert list(cfg.failure.kinds) == ["kill", "exception"]


def test_overrides_apply_after_the_yaml_file(tmp_path):
    path = write_yaml(tmp_path, "replicas: 4\nmin_replicas: 2\n")
    cfg = load_config(path, ["replicas=6"])
    assert (cfg.replicas, cfg.min_replicas) == (6, 2)


def test_empty_yaml_file_gives_defaults(tmp_path):
    assert load_config(write_yaml(tmp_path, "# nothing\n")) == OmegaConf.structured(FTConfig)


def test_unknown_key_in_yaml_names_file_key_and_allowed_fields(tmp_path):
    path = write_yaml(tmp_path, "etcd:\n  lease_ttl: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert str(path) in msg
    assert "unknown config key 'etcd.lease_ttl'" in msg
    assert "etcd has: endpoint, lease_ttl_s, hang_timeout_s, connect_timeout_s, prefix" in msg
    assert "did you mean 'lease_ttl_s'?" in msg
    assert e.value.key == "etcd.lease_ttl"


def test_unknown_key_inside_a_yaml_list_item_names_the_index(tmp_path):
    path = write_yaml(tmp_path, "failure:\n  events:\n    - {replica: 0, step: 3, when: 5}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "unknown config key 'failure.events.0.when'" in str(e.value)
    assert "failure.events.0 has: replica, step, kind, downtime_steps" in str(e.value)


def test_yaml_file_that_is_not_a_mapping_or_not_yaml_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="the top level expects FTConfig"):
        load_config(write_yaml(tmp_path, "- replicas\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write_yaml(tmp_path, "replicas: [4\n"))


def test_wrong_type_in_yaml_names_key_value_and_type(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write_yaml(tmp_path, "quorum:\n  poll_interval_s: fast\n"))
    assert "config key 'quorum.poll_interval_s' expects float, got 'fast' (str)" in str(e.value)


# ----------------------------------------------------------------------------- overrides


def test_override_nested_int_float_list_and_enum_keys():
    cfg = load_config(overrides=[
        "replicas=4",
        "ftar.chunk_bytes=1048576",
        "ftar.num_chunks=8",
        "etcd.lease_ttl_s=1.5",
        "quorum.poll_interval_s=1e-3",  # YAML 1.1 reads this as a string; still a float
        "failure.kinds=[kill,hang]",
        "lr_intervention=linear",
        "ftar.transport=rdma",
    ])
    assert cfg.replicas == 4
    assert (cfg.ftar.chunk_bytes, cfg.ftar.num_chunks) == (1048576, 8)
    assert cfg.etcd.lease_ttl_s == 1.5
    assert cfg.quorum.poll_interval_s == pytest.approx(1e-3)
    assert list(cfg.failure.kinds) == ["kill", "hang"]
    assert (cfg.lr_intervention, cfg.ftar.transport) == ("linear", "rdma")


def test_int_override_of_a_float_field_becomes_a_float():
    cfg = load_config(overrides=["etcd.hang_timeout_s=60"])
    assert cfg.etcd.hang_timeout_s == 60.0 and isinstance(cfg.etcd.hang_timeout_s, float)


def test_string_fields_keep_the_text_as_written():
    cfg = load_config(overrides=["job=123", "etcd.endpoint=10.0.0.1:2379", "run_dir='runs/a b'",
                                 "network.advertise_host=1:30"])
    assert cfg.job == "123"
    assert cfg.etcd.endpoint == "10.0.0.1:2379"
    assert cfg.run_dir == "runs/a b"
    assert cfg.network.advertise_host == "1:30"  # YAML would have read sexagesimal 90


def test_override_list_of_failure_events_and_one_item_field():
    cfg = load_config(overrides=["failure.events=[{replica: 1, step: 5}, {replica: 2, step: 9, kind: hang}]",
                                 "failure.events.0.downtime_steps=3"])
    assert [(e.replica, e.step, e.kind, e.downtime_steps) for e in cfg.failure.events] == [
        (1, 5, "kill", 3), (2, 9, "hang", 0)]
    apply_overrides(cfg, ["failure.events=[]"])
    assert list(cfg.failure.events) == []


def test_override_a_group_with_a_mapping_merges_into_it():
    cfg = load_config(overrides=["ftar={transport: rdma, num_chunks: 2}"])
    assert (cfg.ftar.transport, cfg.ftar.num_chunks, cfg.ftar.chunk_bytes) == ("rdma", 2, 4194304)


def test_apply_overrides_mutates_and_returns_the_config():
    cfg = OmegaConf.structured(FTConfig)
    assert apply_overrides(cfg, ["seed=7"]) is cfg
    assert cfg.seed == 7


def test_unknown_top_level_key_lists_the_top_level_fields():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["replica=4"])
    msg = str(e.value)
    assert "unknown config key 'replica'" in msg
    assert "the top level has: job, replicas, nproc_per_replica, min_replicas, secret" in msg
    assert "etcd, quorum, ftar, network, consistency, supervisor, checkpoint, failure" in msg
    assert "did you mean 'replicas'?" in msg
    assert e.value.key == "replica"


def test_unknown_nested_key_names_the_full_key_and_the_group_fields():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["ftar.chunk_mbb=8"])
    msg = str(e.value)
    assert msg.startswith("unknown config key 'ftar.chunk_mbb'; ftar has: transport, chunk_bytes, num_chunks, "
                          "bucket_bytes, timeout_s, connect_timeout_s, num_programs")
    assert "did you mean 'chunk_bytes'?" in msg


def test_unknown_group_names_the_full_key_and_which_part_is_unknown():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["ftarr.num_chunks=8"])
    msg = str(e.value)
    assert "unknown config key 'ftarr.num_chunks' (the top level has no 'ftarr')" in msg
    assert "did you mean 'ftar'?" in msg
    assert e.value.key == "ftarr.num_chunks"


def test_key_below_a_leaf_is_rejected():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["replicas.count=2"])
    assert "unknown config key 'replicas.count'; replicas is a leaf (int), not a group" in str(e.value)


def test_list_index_out_of_range_names_the_length():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["failure.events.0.step=3"])
    assert "index 0 is out of range; failure.events has 0 item(s)" in str(e.value)


def test_flow_mapping_without_space_gets_a_hint():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["failure.events=[{replica:1,step:5}]"])
    assert "unknown config key 'failure.events.0.replica:1'" in str(e.value)
    assert "with a space after the colon" in str(e.value)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("replicas=abc", "config key 'replicas' expects int, got 'abc' (str)"),
        ("replicas=2.5", "config key 'replicas' expects int, got 2.5 (float)"),
        ("replicas=true", "config key 'replicas' expects int, got True (bool)"),
        ("etcd.lease_ttl_s=soon", "config key 'etcd.lease_ttl_s' expects float, got 'soon' (str)"),
        ("failure.kinds=kill", "config key 'failure.kinds' expects list[str], got 'kill' (str)"),
        ("failure.events=[3]", "config key 'failure.events.0' expects FailureEvent (a mapping with keys "
                               "replica, step, kind, downtime_steps), got 3 (int)"),
        ("ftar=4", "config key 'ftar' expects FTARConfig"),
    ],
)
def test_wrong_type_names_key_value_and_expected_type(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    assert expected in str(e.value)
    assert e.value.key == expected.split("'")[1]


def test_malformed_override_is_rejected():
    with pytest.raises(ConfigError, match="'--replicas' is not of the form key=value"):
        apply_overrides(OmegaConf.structured(FTConfig), ["--replicas"])


# ----------------------------------------------------------------------------- validation


def test_invalid_enum_names_the_allowed_values():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["lr_intervention=cube"])
    assert "lr_intervention='cube': allowed values are 'none', 'linear', 'sqrt'" in str(e.value)
    assert e.value.key == "lr_intervention"
    with pytest.raises(ConfigError, match="ftar.transport='ib': allowed values are 'tcp', 'rdma', 'shm', 'auto'"):
        load_config(overrides=["ftar.transport=ib"])
    with pytest.raises(ConfigError, match="failure.kinds.1='segv': allowed values are 'kill', 'hang', 'exception'"):
        load_config(overrides=["failure.kinds=[kill,segv]"])


def test_min_replicas_above_replicas_is_rejected():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["replicas=2", "min_replicas=3"])
    assert "min_replicas=3: must be between 1 and replicas (2)" in str(e.value)
    with pytest.raises(ConfigError, match="min_replicas=0"):
        load_config(overrides=["min_replicas=0"])
    assert load_config(overrides=["replicas=2", "min_replicas=2"]).min_replicas == 2


@pytest.mark.parametrize(
    "override, expected",
    [
        ("replicas=0", "replicas=0: must be >= 1"),
        ("nproc_per_replica=0", "nproc_per_replica=0: must be >= 1"),
        ("ftar.chunk_bytes=0", "ftar.chunk_bytes=0: must be > 0"),
        ("ftar.num_chunks=0", "ftar.num_chunks=0: must be >= 1"),
        ("ftar.num_programs=0", "ftar.num_programs=0: must be >= 1"),
        ("ftar.timeout_s=0", "ftar.timeout_s=0.0: must be > 0"),
        ("etcd.lease_ttl_s=-1", "etcd.lease_ttl_s=-1.0: must be > 0"),
        ("etcd.endpoint=localhost", "etcd.endpoint='localhost': must be \"\" (embedded etcd) or \"host:port\""),
        ("etcd.prefix=lft/", "etcd.prefix='lft/': must start with '/'"),
        ("quorum.poll_interval_s=0", "quorum.poll_interval_s=0.0: must be > 0"),
        ("checkpoint.keep=0", "checkpoint.keep=0: must be >= 1"),
        ("failure.mtbf_steps=-5", "failure.mtbf_steps=-5.0: must be >= 0"),
        ("job=a/b", "job='a/b': must be non-empty letters"),
        ("failure.events=[{replica: 3, step: 1}]",
         "failure.events.0.replica=3: must be between 0 and replicas - 1 (2)"),
        ("failure.events=[{replica: 0, step: 1, kind: boom}]", "failure.events.0.kind='boom': allowed values"),
        ("failure.events=[{replica: 0}]", "failure.events.0.step is required"),
    ],
)
def test_out_of_range_values_name_key_value_and_rule(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    assert expected in str(e.value)


def test_validate_reports_every_problem_at_once():
    cfg = OmegaConf.structured(FTConfig)
    apply_overrides(cfg, ["replicas=0", "ftar.transport=ib"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    lines = str(e.value).splitlines()
    assert lines[0] == "invalid config:"
    assert any("replicas=0: must be >= 1" in line for line in lines)
    assert any("ftar.transport='ib'" in line for line in lines)
    assert e.value.key == "replicas"


def test_validate_accepts_a_plain_dataclass_and_endpoints():
    validate(FTConfig())
    for endpoint in ("localhost:2379", "10.0.0.1:2379", "[::1]:2379"):
        assert load_config(overrides=[f"etcd.endpoint={endpoint}"]).etcd.endpoint == endpoint


def test_etcd_endpoints_tls_and_auth_keys():
    cfg = load_config(overrides=["etcd.endpoints=[https://e0:2379, https://e1:2379]", "etcd.ca_cert=/ca.pem",
                                 "etcd.user=job"])
    assert list(cfg.etcd.endpoints) == ["https://e0:2379", "https://e1:2379"] and cfg.etcd.members == 1
    assert load_config(overrides=["etcd.endpoint=a:1,https://b:2"]).etcd.endpoint == "a:1,https://b:2"
    assert load_config(overrides=["etcd.members=3"]).etcd.members == 3


@pytest.mark.parametrize("overrides, expected", [
    (["etcd.endpoints=[a:1, b]"], "etcd.endpoints=['a:1', 'b']: must be \"\" (embedded etcd) or \"host:port\""),
    (["etcd.endpoint=a:1", "etcd.endpoints=[b:2]"], "etcd.endpoint and etcd.endpoints are both set"),
    (["etcd.endpoint=a:1,a:1"], "a:1 is listed twice"),
    (["etcd.members=0"], "etcd.members=0: must be >= 1"),
    (["etcd.members=3", "etcd.endpoint=a:1"], "etcd.members=3: sizes the embedded etcd"),
    (["etcd.endpoint=https://a:1", "etcd.cert=/c.pem"], "etcd.cert and etcd.key go together"),
    (["etcd.endpoint=http://a:1", "etcd.ca_cert=/ca.pem"], "http:// (plaintext) but etcd.ca_cert/cert/key are set"),
    (["etcd.endpoint=http://a:1,https://b:1"], "mix http:// and https://"),
    (["etcd.ca_cert=/ca.pem"], "etcd TLS and user settings are for an external etcd"),
    (["etcd.user=job"], "etcd TLS and user settings are for an external etcd"),
])
def test_inconsistent_etcd_settings_are_refused_by_key(overrides, expected):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert expected in str(e.value)
    assert e.value.key.startswith("etcd.")


def test_saved_config_hides_the_etcd_password():
    cfg = load_config(overrides=["etcd.endpoint=a:1", "etcd.user=job", "etcd.password=hunter2"])
    text = to_yaml(cfg)
    assert "hunter2" not in text and "password: '***'" in text
    assert cfg.etcd.password == "hunter2"


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# ----------------------------------------------------------------------------- parse_overrides


def test_parse_overrides_splits_overrides_from_script_args_in_order():
    args = ["train.py", "replicas=4", "--lr", "0.1", "ftar.num_chunks=8", "--out=x", "a=b=c", "=x", "1a=2",
            "failure.events.0.step=5", "_x=1"]
    overrides, rest = parse_overrides(args)
    assert overrides == ["replicas=4", "ftar.num_chunks=8", "a=b=c", "failure.events.0.step=5", "_x=1"]
    assert rest == ["train.py", "--lr", "0.1", "--out=x", "=x", "1a=2"]


def test_parse_overrides_of_nothing():
    assert parse_overrides([]) == ([], [])


def test_every_config_key_is_read_by_the_code():
    """A key that configs/default.yaml documents but no module reads would silently do nothing
    (issue: ftar.num_programs, quorum.poll_interval_s, ... were never read)."""
    import dataclasses
    import pathlib
    import re
    import typing

    from lightning_ft.config import FTConfig

    def leaves(tp, prefix=""):
        for f in dataclasses.fields(tp):
            hint = typing.get_type_hints(tp)[f.name]
            if dataclasses.is_dataclass(hint):
                yield from leaves(hint, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}"

    root = pathlib.Path(__file__).resolve().parents[1] / "lightning_ft"
    code = "\n".join(p.read_text() for p in root.rglob("*.py"))
    # modules that read the one section they are given, as `cfg`
    readers = {"failure": ["launch/failure.py", "callbacks/failure.py"],
               "etcd": ["coord/etcd_config.py", "launch/etcd_keeper.py"]}

    def read(key: str) -> bool:
        if re.search(r"\.%s\b" % re.escape(key), code):  # an attribute, e.g. cfg.ftar.num_programs
            return True
        section, _, name = key.rpartition(".")
        text = "".join((root / f).read_text() for f in readers.get(section, []))
        return re.search(r"\bcfg\.%s\b|getattr\(cfg, \"%s\"" % (name, name), text) is not None

    unread = [k for k in leaves(FTConfig) if "." in k and not read(k)]
    assert not unread, f"config keys no module reads: {unread}"
