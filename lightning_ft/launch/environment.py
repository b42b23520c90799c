"""Who this process is in the job, from whatever started it (docs/ARCHITECTURE.md,
"Launchers"): `lightning-ft run`, torchrun, srun, or any launcher that sets our variables.

Pure: `replica_env(environ)` maps an environment to a `ReplicaEnv`; `replica_variables`
is the inverse, what `lightning-ft env` prints for one replica. One I/O function,
`init_torchrun_group`, works around how torchrun restarts a replica's process group. The Lightning strategy
(through `strategy/environment.py`), `examples/plain_loop.py` and the launcher all use it,
so nothing else reads launcher variables.

| ours           | lightning-ft run | torchrun (per replica) | srun (one step per replica) |
|----------------|------------------|------------------------|-----------------------------|
| job, replica id, R, etcd, run dir | LFT_JOB, LFT_REPLICA_ID, LFT_NUM_REPLICAS, LFT_ETCD, LFT_RUN_DIR (all launchers) |
| incarnation | LFT_INCARNATION | LFT_INCARNATION + TORCHELASTIC_RESTART_COUNT | LFT_INCARNATION + SLURM_RESTART_COUNT |
| rank           | RANK             | RANK                   | SLURM_PROCID                |
| local rank     | LOCAL_RANK       | LOCAL_RANK             | SLURM_LOCALID               |
| world (W)      | WORLD_SIZE       | WORLD_SIZE             | SLURM_STEP_NUM_TASKS, SLURM_NTASKS |
| master address | MASTER_ADDR      | MASTER_ADDR            | MASTER_ADDR, else the first host of SLURM_STEP_NODELIST |
| master port    | MASTER_PORT      | MASTER_PORT            | MASTER_PORT, else one from SLURM_JOB_ID (below) |
| run id         | LFT_RUN_ID       | LFT_RUN_ID             | LFT_RUN_ID, else SLURM_JOB_ID |
| warm spare     | LFT_STANDBY=<token> instead of LFT_REPLICA_ID (all launchers; coord/standby.py) |

torchrun is recognized by TORCHELASTIC_RUN_ID, srun by SLURM_PROCID without RANK. The
master address and port are the replica's own process group (one per replica), never
shared between replicas; srun's default port is 20000 + (SLURM_JOB_ID mod 4000) * 10 + rid mod 10.
The secret is not in this table: see lightning_ft/secret.py.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Mapping

REQUIRED = ("LFT_JOB", "LFT_REPLICA_ID", "LFT_NUM_REPLICAS", "LFT_ETCD")
SELF_LAUNCH_ENV = "LFT_SELF_LAUNCH"
"""Set by a self-launching program (strategy/self_launch.py) for `lightning-ft run` and its
replicas: a process that sees it is never the one the user started."""
LAUNCHER_VARIABLES = (*REQUIRED, "LFT_INCARNATION", "LFT_RUN_DIR", SELF_LAUNCH_ENV, "TORCHELASTIC_RUN_ID",
                      "SLURM_PROCID", "RANK", "LOCAL_RANK", "WORLD_SIZE")
"""Variables some launcher sets (ours, torchrun, srun, Lightning's own launchers). A process
with none of them was started by the user (`python train.py`) and may launch the job itself."""


class LaunchEnvError(RuntimeError):
    """The environment does not say who this process is; the message says how to launch."""


@dataclass(frozen=True)
class ReplicaEnv:
    job: str
    replica_id: int
    num_replicas: int
    etcd: str
    incarnation: int
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    run_dir: str = ""
    run_id: str = ""
    """The job's run (a fresh keyspace per run, coord/runs.py); "" = the run in etcd."""
    config: str = ""
    """Path of the job's config YAML (LFT_CONFIG), or ""."""
    launcher: str = "env"
    """"torchrun", "slurm" or "env" (variables set directly, e.g. by `lightning-ft run`)."""
    standby: str = ""
    """A warm spare's token (LFT_STANDBY, coord/standby.py): replica_id is -1 until promoted."""


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise LaunchEnvError(f"{name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchEnvError(f"{name}={raw!r} is not an integer") from None


def replica_env(env: Mapping[str, str]) -> ReplicaEnv:
    """This process's place in the job, from `env` (see the module table)."""
    standby = env.get("LFT_STANDBY", "")
    missing = [n for n in REQUIRED if not env.get(n) and not (standby and n == "LFT_REPLICA_ID")]
    if missing:
        raise LaunchEnvError(
            f"this process does not know its replica: {', '.join(missing)} not set. Start it with `lightning-ft run "
            f"--replicas R --nproc-per-replica W script.py`, or under torchrun/srun with the variables "
            f"`lightning-ft env --replica-id R ...` prints (docs/GUIDE.md: Multi-node)")
    rid, R = _int(env, "LFT_REPLICA_ID", -1 if standby else None), _int(env, "LFT_NUM_REPLICAS")
    if standby and rid != -1:
        raise LaunchEnvError(f"LFT_STANDBY={standby!r} is a spare, which takes its replica id when promoted; "
                             f"unset LFT_REPLICA_ID (it is {rid})")
    if not standby and not 0 <= rid < R:
        raise LaunchEnvError(f"LFT_REPLICA_ID={rid} is not a replica of this job: it must be between 0 and "
                             f"LFT_NUM_REPLICAS - 1 ({R - 1})")
    base_inc = _int(env, "LFT_INCARNATION", 0)
    run_id = env.get("LFT_RUN_ID", "")
    if env.get("TORCHELASTIC_RUN_ID"):
        launcher = "torchrun"
        inc = base_inc + _int(env, "TORCHELASTIC_RESTART_COUNT", 0)
        rank, local, world = _int(env, "RANK"), _int(env, "LOCAL_RANK"), _int(env, "WORLD_SIZE")
        addr, port = env.get("MASTER_ADDR", "127.0.0.1"), _int(env, "MASTER_PORT")
    elif env.get("SLURM_PROCID") and not env.get("RANK"):
        launcher = "slurm"
        inc = base_inc + _int(env, "SLURM_RESTART_COUNT", 0)
        rank, local = _int(env, "SLURM_PROCID"), _int(env, "SLURM_LOCALID", 0)
        world = _int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS", 1))
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or ""
        addr = env.get("MASTER_ADDR") or (expand_hostlist(nodes)[0] if nodes else "127.0.0.1")
        port = _int(env, "MASTER_PORT", slurm_port(_int(env, "SLURM_JOB_ID", 0), rid))
        run_id = run_id or env.get("SLURM_JOB_ID", "")
    else:
        launcher = "env"
        inc = base_inc
        rank, local = _int(env, "RANK", 0), _int(env, "LOCAL_RANK", _int(env, "RANK", 0))
        world = _int(env, "WORLD_SIZE", 1)
        addr, port = env.get("MASTER_ADDR", "127.0.0.1"), _int(env, "MASTER_PORT", 29500)
    if not 0 <= rank < world:
        raise LaunchEnvError(f"rank {rank} is not below the replica's world size {world} (launcher: {launcher})")
    return ReplicaEnv(job=env["LFT_JOB"], replica_id=rid, num_replicas=R, etcd=env["LFT_ETCD"], incarnation=inc,
                      rank=rank, local_rank=local, world_size=world, master_addr=addr, master_port=port,
                      run_dir=env.get("LFT_RUN_DIR", ""), run_id=run_id, config=env.get("LFT_CONFIG", ""),
                      launcher=launcher, standby=standby)


def launcher_variables(env: Mapping[str, str]) -> list[str]:
    """The LAUNCHER_VARIABLES set in `env`, in that order; [] means nothing launched this
    process: `python train.py` run by the user, which self-launches the job."""
    return [name for name in LAUNCHER_VARIABLES if env.get(name)]


def init_torchrun_group(env: ReplicaEnv, backend: str, timeout_s: float = 1800.0) -> None:
    """The replica's default process group under torchrun (the one I/O function here).

    torchrun's agent keeps one store across the restarts it makes, and a restarted rank can
    read what its peer published in the previous attempt (measured with torch 2.13: a rank 1
    that started before rank 0 dialed rank 0's old gloo address and failed, so every restart
    failed). Each incarnation therefore rendezvous under its own prefix of the agent's store."""
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"/lightning-ft/incarnation_{env.incarnation}", store),
                            rank=env.rank, world_size=env.world_size, timeout=timeout)


def slurm_port(job_id: int, rid: int) -> int:
    """Default MASTER_PORT of replica `rid`'s process group under srun: distinct per replica
    of a job (replicas 10 apart may share one only if they share their first node)."""
    return 20000 + (job_id % 4000) * 10 + rid % 10


_RANGE = re.compile(r"^(\d+)-(\d+)$")


def expand_hostlist(nodelist: str) -> list[str]:
    """SLURM's compressed host list ("node[01-03,07],gpu5") as host names, in order."""
    hosts: list[str] = []
    for item in _split_top(nodelist):
        if "[" not in item:
            hosts.append(item)
            continue
        head, _, rest = item.partition("[")
        body, _, tail = rest.partition("]")
        for part in body.split(","):
            m = _RANGE.match(part)
            if m:
                lo, hi = m.group(1), m.group(2)
                width = len(lo)
                hosts += [f"{head}{i:0{width}d}{tail}" for i in range(int(lo), int(hi) + 1)]
            else:
                hosts.append(f"{head}{part}{tail}")
    return hosts


def _split_top(nodelist: str) -> list[str]:
    """Split at commas outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in nodelist:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        out.append(cur)
    return [h.strip() for h in out if h.strip()]


def replica_variables(*, job: str, replica_id: int, num_replicas: int, etcd: str, run_dir: str = "",
                      config: str = "", secret_file: str = "", incarnation: int = 0,
                      run_id: str = "") -> dict[str, str]:
    """The variables one replica's processes need (what `lightning-ft env` prints). torchrun
    and srun provide RANK/WORLD_SIZE/MASTER_* themselves."""
    out = {"LFT_JOB": job, "LFT_REPLICA_ID": str(replica_id), "LFT_NUM_REPLICAS": str(num_replicas),
           "LFT_ETCD": etcd}
    for name, value in (("LFT_RUN_DIR", run_dir), ("LFT_CONFIG", config), ("LFT_SECRET_FILE", secret_file),
                        ("LFT_RUN_ID", run_id)):
        if value:
            out[name] = value
    if incarnation:
        out["LFT_INCARNATION"] = str(incarnation)
    return out


def format_variables(variables: Mapping[str, str], fmt: str = "sh") -> str:
    """`export K=V` lines (sh), `K=V` lines (env files, `env $(...)`), or one JSON object."""
    if fmt == "json":
        import json

        return json.dumps(dict(variables), indent=1)
    if fmt == "env":
        return "\n".join(f"{k}={v}" for k, v in variables.items())
    if fmt == "sh":
        return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in variables.items())
    raise ValueError(f"format {fmt!r}: allowed are 'sh', 'env', 'json'")
