"""Lightning's view of one replica: a `ClusterEnvironment` over `launch/environment.py`
(docs/ARCHITECTURE.md, "Launchers").

One Lightning world is one replica of W processes. Whatever started them (`lightning-ft
run`, torchrun, srun), this environment reports the replica's ranks and its own process
group address, so Lightning never mistakes the job for one world: under srun with one job
step per replica, Lightning's SLURMEnvironment would take the whole allocation's first node
and a port shared by every replica.
"""
from __future__ import annotations

import os
from typing import Optional

from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from typing_extensions import override

from lightning_ft.launch.environment import LaunchEnvError, ReplicaEnv, launcher_variables, replica_env
from lightning_ft.strategy.errors import FTHSDPError


class ReplicaEnvironment(ClusterEnvironment):
    def __init__(self, env: Optional[ReplicaEnv] = None) -> None:
        self.env = env if env is not None else replica_env(os.environ)

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        return self.env.master_addr

    @property
    @override
    def main_port(self) -> int:
        return self.env.master_port

    @staticmethod
    @override
    def detect() -> bool:
        return bool(os.environ.get("LFT_REPLICA_ID"))

    @override
    def world_size(self) -> int:
        return self.env.world_size

    @override
    def set_world_size(self, size: int) -> None:
        pass  # the launcher decides W

    @override
    def global_rank(self) -> int:
        return self.env.rank

    @override
    def set_global_rank(self, rank: int) -> None:
        pass

    @override
    def local_rank(self) -> int:
        return self.env.local_rank

    @override
    def node_rank(self) -> int:
        return 0  # a replica's ranks are addressed by rank; its node count is the launcher's business

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        pass  # W comes from the launcher, not from Trainer(devices=..., num_nodes=...)


def launched_replica() -> Optional[ReplicaEnv]:
    """Who this process is; None when no launcher started it (the program self-launches,
    strategy/self_launch.py); else FTHSDPError saying how to launch."""
    try:
        return replica_env(os.environ)
    except LaunchEnvError as e:
        seen = launcher_variables(os.environ)
        if not seen:
            return None
        raise FTHSDPError(f"strategy='ft_hsdp': {e} (a launcher started this process: {', '.join(seen)} "
                          f"set, so it does not launch the job itself)") from None
