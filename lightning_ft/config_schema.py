"""The job config's schema: one dataclass per section, with the defaults and what each key means
(lightning_ft/config.py loads, overrides and validates it; docs/ARCHITECTURE.md, "Module map")."""
from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING


@dataclass
class EtcdConfig:
    """Coordination store (docs/ARCHITECTURE.md, "The quorum")."""

    endpoint: str = ""
    """etcd address "host:port" (or "https://host:port"; several members separated by commas);
    "" = the launcher starts an embedded etcd on loopback."""
    lease_ttl_s: float = 3.0
    """TTL of each replica leader's lease; a replica that stops keeping it alive is dropped after this."""
    hang_timeout_s: float = 30.0
    """A training loop that makes no progress for this long stops the lease keepalive, so it expires."""
    connect_timeout_s: float = 10.0
    """Every etcd request rides out an outage this long (retrying, failing over between members);
    after it, the request fails with an error naming the endpoints. Keep it above the longest etcd
    restart you want training to pause through rather than stop."""
    prefix: str = "/lft"
    """Root of the keyspace; a job's keys live under {prefix}/{job}/."""
    endpoints: list[str] = field(default_factory=list)
    """The members of an etcd cluster, e.g. [https://etcd-0:2379, https://etcd-1:2379]; the client
    fails over between them. Use this or `endpoint`, not both."""
    members: int = 1
    """Members of the embedded etcd cluster the launcher starts when no endpoint is given; 3
    survives the loss of one (`lightning-ft run --etcd-members 3`)."""
    ca_cert: str = ""
    """PEM file of the CA that signed etcd's server certificate; setting it (or cert/key) means TLS."""
    cert: str = ""
    """PEM client certificate for etcd servers that require one (with `key`)."""
    key: str = ""
    """PEM private key of `cert`."""
    user: str = ""
    """etcd user for authentication; "" = none."""
    password: str = ""
    """Password of `user`; "" = env LFT_ETCD_PASSWORD (better: it stays off the command line and
    out of the saved config.yaml, which shows "***")."""


@dataclass
class QuorumConfig:
    """Quorum formation (docs/ARCHITECTURE.md, "The quorum")."""

    init_timeout_s: float = 10.0
    """The first round waits this long for all R replicas, then starts with >= min_replicas."""
    poll_interval_s: float = 0.05
    """How often a waiting leader re-checks the member reports when no watch event arrives."""


@dataclass
class FTARConfig:
    """Fault-tolerant ring all-reduce across replicas (docs/ARCHITECTURE.md, "The exchange")."""

    transport: str = "tcp"
    """Links between ring neighbours: "tcp"; "shm" (one-sided writes into the neighbour's
    shared-memory slots, same host only); "rdma" (pyverbs RC queue pairs, fails at start
    without a verbs device); "auto" (per link: shm on one host, else rdma if both ends have
    a device, else tcp; each choice is logged). Every replica must use the same value."""
    chunk_bytes: int = 4 * 1024 * 1024
    """S: bytes per chunk; S * C bytes of sendbuf/recvbuf are allocated once at init."""
    num_chunks: int = 4
    """C: chunks pipelined per ring step; at most S * C bytes are in flight per peer."""
    bucket_bytes: int = 4 * 1024 * 1024
    """Gradient bucket size: buckets are all-reduced as backward produces them (overlap);
    every replica of a job must use the same value."""
    timeout_s: float = 5.0
    """A peer silent this long during an all-reduce is declared failed (RecoverableError)."""
    connect_timeout_s: float = 5.0
    """Deadline for connecting and handshaking with a new ring neighbour after a reconfigure."""
    num_programs: int = 2
    """Triton grid size (persistent programs) of the reduce/copy kernels on GPU."""


@dataclass
class NetworkConfig:
    """Addresses of every listener of a replica: FTAR and the catch-up state server."""

    bind_host: str = "0.0.0.0"
    """Address the listeners bind to; "0.0.0.0" = all interfaces."""
    advertise_host: str = ""
    """Address published to the other replicas; "" = the bind host if it names one interface,
    else the address of the interface that routes to etcd. Loopback is refused when etcd is
    on another host."""


@dataclass
class ConsistencyConfig:
    """The divergence guard: replicas compare state digests (docs/ARCHITECTURE.md)."""

    every_n_steps: int = 10
    """Digest parameters and optimizer state every this many committed steps (and at every
    checkpoint step); 0 = never. A digest reads the state once (about 10 GB/s on one core):
    10 keeps it under 1% of a step for models whose step time is dominated by compute
    (lightning_ft.bench.digest measures it)."""


@dataclass
class StragglersConfig:
    """Slow replicas (docs/ARCHITECTURE.md, "Stragglers"; coord/stragglers.py). Every replica of
    a job must use the same values (the round's decider applies its own)."""

    policy: str = "exclude"
    """"exclude" (the default): a straggler is benched: the others train without it while it
    computes its batch again and again, committing nothing, to measure its pace; it rejoins by
    catch-up once that pace has been within `threshold` of the others' for a second (doubling
    on each exclusion, at most 4 s); its slot's batches follow `batch_policy` (under "shrink"
    they wait for it). "shrink": it keeps training, but gives some of its slot batch's
    micro-batches (gradient accumulation) to the others, so the global batch stays the same;
    one that cannot split its batch (no accumulation, manual optimization, a stream loader) is
    benched instead. "adaptive": shrink one that a split evens out, bench one slower than that.
    "wait": the job runs at the straggler's pace (the `straggler` event says so)."""
    threshold: float = 1.3
    """A replica whose compute time (data, forward, backward: up to ready-to-exchange) is this
    many times the median of the others' is a straggler; 0 = no detection."""
    window: int = 10
    """Compute time is the mean over a replica's newest cleanly trained steps covering a second
    and at least this many; a replica is judged only once it has that many since it (re)joined."""


@dataclass
class HangConfig:
    """Hang diagnosis (docs/ARCHITECTURE.md, "Hang diagnosis"; coord/hang.py)."""

    report_after_s: float = 1.0
    """A leader whose exchange has waited this long publishes its FTAR links' counters (which
    neighbour it waits on, how many bytes, which direction: `stall/{rid}` in etcd), so that the
    supervisor that finds a replica hung (its lease lapsed while it runs) names the link. The
    supervisor then reads the hung ranks' Python stacks from outside (`py-spy dump`) and writes a
    `hang` event. Keep it below etcd.lease_ttl_s."""


@dataclass
class SupervisorConfig:
    """What `lightning-ft run` does with failed replicas."""

    crash_loop: int = 3
    """A replica that fails this many times in a row before committing any step, with the same
    exit code, is not restarted again (its log tail is printed)."""
    start_timeout_s: float = 600.0
    """A replica whose leader has not registered with etcd this long after its start is hung in
    initialization: it is killed and restarted (0 = wait forever)."""
    exit_timeout_s: float = 120.0
    """A replica on its way out (it left the job, or one of its ranks exited 0) whose processes still
    run this long after is hung on exit (deadlocked in teardown): it is killed and restarted, so the
    launcher does not wait for it forever (0 = wait forever). A rank seen stopped (SIGSTOP) on its
    way out is hung after the hang grace instead."""
    standby: int = 0
    """Warm spare replicas to keep (docs/ARCHITECTURE.md, "Warm standby"): each runs the program
    up to the strategy's setup and waits; a failed replica's restart takes one (healing in a
    fraction of a second instead of a cold start) and a new spare is started in its place."""
    zygote: bool = True
    """Start, restart and keep warm spares by forking a process that imported torch (and
    Lightning) once (launch/zygote.py), instead of starting Python afresh: the job imports once,
    and a cold restart has no seconds of imports. Only for `python script.py` commands outside a
    per-replica wrap."""


@dataclass
class CheckpointConfig:
    """Persistent sharded checkpoints for whole-job restarts (docs/ARCHITECTURE.md, "Checkpoints")."""

    every_n_steps: int = 100
    """Write a checkpoint every this many committed steps; 0 = never."""
    dir: str = ""
    """Checkpoint directory; "" = {run_dir}/checkpoints (see `checkpoint_dir`)."""
    keep: int = 3
    """K: keep this many newest checkpoints and prune older ones."""


@dataclass
class DataConfig:
    """The train data stream (docs/ARCHITECTURE.md, "Exactly once: streams")."""

    exactly_once: bool = True
    """Refuse a train stream whose position cannot be saved (an IterableDataset loader without
    state_dict()); false: train it at-least-once, and say so at start."""
    shard: str = "processes"
    """How an IterableDataset other than litdata's is split: "processes" (lightning-ft splits its
    stream over all R*W processes; the dataset must not split by rank itself) or "slots" (over the R
    replicas only; the dataset splits over the replica's ranks itself, as under DDP)."""
    state_every_n_steps: int = 1
    """Save each rank's loader state every N committed steps (and at checkpoint steps); a restart
    restores the newest and reads forward the rest. 0 = at checkpoint steps only."""
    state_dir: str = ""
    """Loader-state files; "" = {checkpoint dir}/loader_state. Every replica must reach it."""


@dataclass
class FailureEvent:
    """One scheduled failure injection."""

    replica: int = MISSING
    """Replica id (0 <= replica < R) to fail; required."""
    step: int = MISSING
    """Fail when this replica reaches this step; required."""
    kind: str = "kill"
    """How it fails: "kill" (SIGKILL), "hang" (stops making progress) or "exception" (raises)."""
    downtime_steps: int = 0
    """Keep the replica down until the others advance this many steps; 0 = restart after restart_delay_s."""


@dataclass
class FailureConfig:
    """Failure-injection schedule, for tests and demos (docs/ARCHITECTURE.md, "Launch and supervision")."""

    events: list[FailureEvent] = field(default_factory=list)
    """Scheduled failures, e.g. [{replica: 1, step: 50, kind: kill}]."""
    mtbf_steps: float = 0.0
    """Random failures across the job with this mean time between failures, in steps; 0 = off."""
    kinds: list[str] = field(default_factory=lambda: ["kill"])
    """Kinds the random failures are drawn from (kill, hang, exception)."""
    restart_delay_s: float = 0.2
    """The launcher waits this long before restarting a failed replica (it was 1 s: a sixth of
    a cold heal; crash loops are bounded by `max_restarts`, not by this delay)."""
    seed: int = 0
    """Seed of the random failure schedule (which replica, when, which kind)."""
    signal_exception: bool = False
    """Raise an injected exception at the next batch after the process gets SIGUSR1 (an
    exception at a moment chosen from outside, e.g. by `bench.soak`)."""


@dataclass
class FTConfig:
    """A fault-tolerant HSDP job: R replicas of W ranks each (docs/ARCHITECTURE.md, "Module map")."""

    job: str = "lft"
    """Job id; names the etcd keyspace and is checked in every FTAR handshake."""
    replicas: int = 3
    """R: number of replicas, each a full copy of model and optimizer state."""
    nproc_per_replica: int = 1
    """W: ranks per replica; FSDP2 shards the model over them."""
    min_replicas: int = 1
    """Training waits (and says why) while fewer replicas than this are healthy."""
    secret: str = ""
    """Job secret for FTAR and catch-up authentication, at least 16 characters; "" = from
    $LFT_SECRET_FILE or $LFT_SECRET, or generated by a single-host launcher (lightning_ft/secret.py).
    Prefer the file: a value here ends up in shell history."""
    lr_intervention: str = "sqrt"
    """LR factor f(x), x = contributors / R: "none" (1), "linear" (x) or "sqrt" (sqrt(x))."""
    batch_policy: str = "shrink"
    """While replicas are down: "shrink" (the global batch shrinks to the contributors' slots;
    the others' batches wait for them) or "constant" (contributors also train the absent
    slots' batches, so every step trains R slot batches; x = 1). replica/batch_policy.py."""
    run_dir: str = "runs/latest"
    """Directory for events.jsonl, cursors, logs and (by default) checkpoints."""
    seed: int = 0
    """Seed of the training run (model init, data order)."""
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    """Coordination store."""
    quorum: QuorumConfig = field(default_factory=QuorumConfig)
    """Quorum formation."""
    ftar: FTARConfig = field(default_factory=FTARConfig)
    """Cross-replica fault-tolerant all-reduce."""
    network: NetworkConfig = field(default_factory=NetworkConfig)
    """Listener addresses (FTAR, catch-up)."""
    consistency: ConsistencyConfig = field(default_factory=ConsistencyConfig)
    """The divergence guard."""
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    """Restart policy of the launcher."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Persistent checkpoints."""
    failure: FailureConfig = field(default_factory=FailureConfig)
    """Failure injection."""
    data: DataConfig = field(default_factory=DataConfig)
    """The train data stream."""
    stragglers: StragglersConfig = field(default_factory=StragglersConfig)
    """Slow replicas: detection and policy."""
    hang: HangConfig = field(default_factory=HangConfig)
    """Hang diagnosis: who is missing, which FTAR link, the stack."""
