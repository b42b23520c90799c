"""What a `ReplicaManager` is built from besides its model and optimizer: who the replica is
(`Identity`) and the job's knobs it uses (`Settings`, from the job config's sections).

    mgr = ReplicaManager(model, optimizer, Identity(job, rid, incarnation, R, secret, etcd),
                         Settings.from_config(cfg), group=ReplicaGroup(rank, world, pg))

The values are plain and frozen: the manager reads them, never writes them (a promoted spare's
replica id and incarnation live on the manager, which learns them in `start`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Optional

from lightning_ft.constants import LR_MODES
from lightning_ft.coord.round_records import JobSpec
from lightning_ft.replica.batch_policy import POLICIES


@dataclass(frozen=True)
class Identity:
    """Which replica this process belongs to, in which job, and how it reaches etcd."""

    job: str
    rid: int
    """The replica id; a warm spare's is the one it waits beside (it learns its own when promoted)."""
    incarnation: int
    num_replicas: int
    """R: the job's replicas (the LR factor's total, the slots of the data)."""
    secret: str
    etcd: str = ""
    """etcd endpoints ("" with a store handed in)."""
    run_id: str = ""
    """The job's run (coord/runs.py): "" = join or start the run recorded in etcd."""
    standby: str = ""
    """A warm spare's token (coord/standby.py): `start` waits to be promoted; "" for a replica."""


@dataclass(frozen=True)
class Settings:
    """The knobs of the per-step protocol (defaults: the plain loop's; `from_config` reads a job
    config's sections: docs/ARCHITECTURE.md, "Configuration")."""

    min_replicas: int = 1
    prefix: str = "/lft"
    lease_ttl_s: float = 3.0
    hang_timeout_s: float = 30.0
    init_timeout_s: float = 10.0
    poll_interval_s: float = 0.05
    quorum_timeout_s: Optional[float] = None
    """How long a full round waits for its decision (None: the coordinator's default)."""
    sync_timeout_s: float = 120.0
    """How long adopting a sync round's state may take."""
    lr_intervention: str = "sqrt"
    batch_policy: str = "shrink"
    chunk_bytes: int = 4 << 20
    num_chunks: int = 4
    ftar_timeout_s: float = 5.0
    ftar_connect_timeout_s: float = 5.0
    transport: str = "tcp"
    num_programs: int = 2
    bind_host: str = "127.0.0.1"
    advertise_host: str = ""
    fingerprint: Optional[dict] = None
    """The config fields every replica must agree on (config.fingerprint); None: job, replicas
    and ranks only. The manager adds the secret's tag and the parameters' layout."""
    digest_every: int = 1
    checkpoint_every: int = 0
    checkpoint_root: str = ""
    etcd_config: Any = None
    """The job's `etcd` section (TLS, auth, connect timeout); None: $LFT_CONFIG's or defaults."""
    stragglers: Any = None
    """The job's `stragglers` section (policy, threshold, window); None: detection off."""
    hang_report_after_s: float = 1.0

    def __post_init__(self) -> None:
        if self.lr_intervention not in LR_MODES:
            raise ValueError(f"lr_intervention {self.lr_intervention!r} is not one of {LR_MODES}")
        if self.batch_policy not in POLICIES:
            raise ValueError(f"batch_policy {self.batch_policy!r} is not one of {POLICIES}")

    @classmethod
    def from_config(cls, cfg: Any, **overrides: Any) -> "Settings":
        """A job's FTConfig (lightning_ft.config): its sections, then `overrides` by field name."""
        from lightning_ft.config import checkpoint_dir, fingerprint

        s = cls(min_replicas=cfg.min_replicas, prefix=cfg.etcd.prefix, lease_ttl_s=cfg.etcd.lease_ttl_s,
                hang_timeout_s=cfg.etcd.hang_timeout_s, init_timeout_s=cfg.quorum.init_timeout_s,
                poll_interval_s=cfg.quorum.poll_interval_s, lr_intervention=cfg.lr_intervention,
                chunk_bytes=cfg.ftar.chunk_bytes, num_chunks=cfg.ftar.num_chunks, ftar_timeout_s=cfg.ftar.timeout_s,
                ftar_connect_timeout_s=cfg.ftar.connect_timeout_s, transport=cfg.ftar.transport,
                bind_host=cfg.network.bind_host, advertise_host=cfg.network.advertise_host,
                fingerprint=fingerprint(cfg), digest_every=cfg.consistency.every_n_steps,
                checkpoint_every=cfg.checkpoint.every_n_steps, checkpoint_root=checkpoint_dir(cfg),
                etcd_config=cfg.etcd, num_programs=cfg.ftar.num_programs, batch_policy=cfg.batch_policy,
                stragglers=cfg.stragglers, hang_report_after_s=cfg.hang.report_after_s)
        return s.but(**overrides)

    def but(self, **changes: Any) -> "Settings":
        """These settings with `changes` (field names; an unknown one is an error that lists them)."""
        known = {f.name for f in fields(self)}
        bad = sorted(set(changes) - known)
        if bad:
            raise TypeError(f"unknown replica setting(s) {bad}; the settings are {sorted(known)}")
        return replace(self, **changes) if changes else self


def job_spec(st: Settings, who: Identity, world: int, named_params: list[tuple[str, Any]]) -> JobSpec:
    """The job as this process runs it (what every report is checked against): the config's
    fingerprint plus what this process really uses, whatever the config said, and what no config
    holds (the secret's tag, the parameters' layout); the stragglers section (quorum rule 14) or
    detection off."""
    from lightning_ft.replica.state import param_layout
    from lightning_ft.secret import tag

    R = who.num_replicas
    fp = dict(st.fingerprint or {"job": who.job, "replicas": R, "nproc_per_replica": world})
    fp.update(job=who.job, replicas=R, nproc_per_replica=world, chunk_bytes=st.chunk_bytes,
              num_chunks=st.num_chunks, lr_intervention=st.lr_intervention,
              secret_tag=tag(who.secret, who.job), params=param_layout(named_params))
    sg = st.stragglers
    return JobSpec(R, st.min_replicas, st.init_timeout_s, fp, batch_policy=st.batch_policy,
                   straggler_threshold=float(sg.threshold) if sg is not None else 0.0,
                   straggler_policy=str(sg.policy) if sg is not None else "wait",
                   straggler_window=int(sg.window) if sg is not None else 10)
