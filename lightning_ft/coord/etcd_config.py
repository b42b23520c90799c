"""Which etcd a job's process uses, and how: from the `etcd` config section (docs/GUIDE.md, "etcd").

`store_from_config(cfg.etcd)` is how the launcher, the replica leaders and the tools build
their `EtcdStore`: the section's endpoints (or the ones the launcher resolved, e.g. an
embedded cluster's, passed as $LFT_ETCD), its TLS files, user and password, and its
`connect_timeout_s`. A process started by `lightning-ft run` finds the section in
$LFT_CONFIG. The password never needs to be on a command line or in the saved config.yaml
(which shows "***"): it can come from $LFT_ETCD_PASSWORD, which the launcher passes on.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from .etcd_store import EtcdStore
from .store import StoreError

PASSWORD_ENV = "LFT_ETCD_PASSWORD"
"""Environment variable with the etcd password (the launcher passes it to its replicas)."""
REDACTED = "***"
"""How a saved config.yaml shows a password (see config.to_yaml)."""


def password_of(cfg: Any) -> str:
    """The etcd password: `etcd.password`, unless empty or redacted ("***" in a saved
    config.yaml), else $LFT_ETCD_PASSWORD."""
    pw = str(getattr(cfg, "password", "") or "")
    if pw and pw != REDACTED:
        return pw
    env = os.environ.get(PASSWORD_ENV, "")
    if not env and pw == REDACTED:
        raise StoreError(f"the etcd password is redacted ({REDACTED}) in this saved config: set {PASSWORD_ENV}")
    return env


def config_endpoints(cfg: Any) -> list[str]:
    """The endpoints of an `etcd` config section: `endpoints`, else `endpoint` (commas allowed)."""
    eps = [str(e) for e in (getattr(cfg, "endpoints", None) or [])]
    one = str(getattr(cfg, "endpoint", "") or "")
    return eps or [e for e in one.split(",") if e.strip()]


def store_from_config(cfg: Any = None, endpoints: str | Sequence[str] | None = None,
                      connect_timeout_s: Optional[float] = None) -> EtcdStore:
    """An EtcdStore for a job's `etcd` config section: its endpoints (or `endpoints`, e.g. the
    embedded cluster's or $LFT_ETCD), TLS files, user and password, and connect_timeout_s
    (unless given).

    `cfg` None: the `etcd` section of $LFT_CONFIG when set (what `lightning-ft run` gives every
    process), else the defaults."""
    if cfg is None:
        path = os.environ.get("LFT_CONFIG")
        if path:
            from lightning_ft.config import load_config

            cfg = load_config(path).etcd
        else:
            from lightning_ft.config import EtcdConfig

            cfg = EtcdConfig()
    eps = endpoints if endpoints else config_endpoints(cfg)
    if not eps:
        raise StoreError("no etcd endpoint: set etcd.endpoints (or --etcd HOST:PORT), or let `lightning-ft run` "
                         "start an embedded etcd")
    user = str(cfg.user or "")
    timeout = float(cfg.connect_timeout_s) if connect_timeout_s is None else connect_timeout_s
    return EtcdStore(eps, connect_timeout_s=timeout, ca_cert=str(cfg.ca_cert) or None,
                     cert=str(cfg.cert) or None, key=str(cfg.key) or None, user=user or None,
                     password=password_of(cfg) if user else None)
