"""The goodput model: effective training time (ETT) of ft_hsdp and of restart-the-world
for a job's size and failure rate, and a replica-count recommendation (docs/GUIDE.md, "Planning a
job: `lightning-ft plan`").
Pure functions; `lightning-ft plan` (sim/plan.py) gathers the inputs and prints the result.

ETT counts work, not steps: the fraction of the fault-free training rate a job achieves,
where a step trained by c of R replicas is c/R of a full step. Failures arrive on average
every `mtbf_job_s`; each costs, in lost full-job time:
- restart-the-world: detection + restart of every process + the work redone since the last
  checkpoint (`rollback_steps` x step time, by default half a checkpoint interval);
- ft_hsdp: a full stall of the healthy replicas (`stall_s`, by default detection + one
  step, the step that is retried), then, until the failed replica is back (detection +
  restart + catch-up after the failure), the job trains at (R-1)/R: 1/R of that time is lost
  (at (R-1)/R x step_s / degraded_step_s where the survivors' step time changes).
So ETT = (1 - lost per failure / MTBF) x the checkpoint factor I / (I + K), where every
I = ckpt_every x step time of training pays K seconds of checkpoint cost; ft_hsdp's is then
divided by 1 + `overhead`, its steady-state cost per step (a fault-free ft_hsdp step takes
(1 + overhead) x the DDP step). This is the
paper's accounting: a failure every 18 min with a 10 min synchronous restart leaves
8/18 = 44%; with 12 replicas and a 3 min full stall, (8 + 7 x 11/12)/18 = 80%. Failures
are assumed rarer than recoveries take (ETT is clamped at 0 where they are not).

`crossover` is the job size below which restart-the-world has the higher ETT: small jobs
fail rarely, so a per-step tax costs ft_hsdp more than its cheaper failures save. With a
per-GPU MTBF m, losses per failure Lf (ft_hsdp) and Lr (restart) and no clamping, ft_hsdp
wins from G = X m / ((1 + X) Lr - Lf) GPUs on (X the overhead): the outside torchft
benchmark (930 against 818 minutes) is a job below its crossover.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence


@dataclass(frozen=True)
class Inputs:
    """Everything the model needs; times in seconds."""

    gpus: int
    replicas: int
    mtbf_job_s: float
    """Mean time between failures of the whole job (per-GPU MTBF / GPUs)."""
    detect_s: float
    """From a failure until the job knows (eviction, lease expiry or a hang timeout)."""
    restart_s: float
    """From detection until a restarted replica's processes are initialized and registered."""
    catchup_s: float
    """Fetching the healthy state and rejoining (ft_hsdp only)."""
    step_s: float
    """Fault-free step time."""
    ckpt_every: int = 0
    """Steps between persistent checkpoints; 0 leaves checkpoints out of the model."""
    ckpt_cost_s: float = 0.0
    """Training time a checkpoint costs (the blocking part)."""
    stall_s: Optional[float] = None
    """ft_hsdp: full stall of the healthy replicas per failure (default detect_s + step_s)."""
    rollback_steps: Optional[float] = None
    """Restart-the-world: steps redone per failure (default half a checkpoint interval)."""
    world_restart_s: Optional[float] = None
    """Restart-the-world: restart of the whole job (default restart_s)."""
    degraded_step_s: Optional[float] = None
    """ft_hsdp: step time while a replica is away (default step_s). On a cluster every
    replica has its own machines; on a shared box the survivors may step slower while the
    failed replica starts up beside them, or faster with no one to exchange with."""
    overhead: float = 0.0
    """ft_hsdp's steady-state cost: its fault-free step takes (1 + overhead) x step_s, step_s
    being the same job's step under DDP (bench.overhead's ratio - 1; `plan --overhead`)."""

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.replicas < 1:
            raise ValueError(f"need at least one GPU and one replica, got gpus={self.gpus} replicas={self.replicas}")
        if self.replicas > self.gpus:
            raise ValueError(f"{self.replicas} replicas need at least as many GPUs, got {self.gpus}")
        if self.mtbf_job_s <= 0:
            raise ValueError(f"MTBF must be positive, got {self.mtbf_job_s} s")
        for name in ("detect_s", "restart_s", "catchup_s", "step_s", "ckpt_cost_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.overhead > -1:
            raise ValueError(f"overhead must be > -1 (a step of (1 + overhead) x the DDP step), got {self.overhead}")

    @property
    def ranks_per_replica(self) -> float:
        return self.gpus / self.replicas

    @property
    def stall(self) -> float:
        return self.detect_s + self.step_s if self.stall_s is None else self.stall_s

    @property
    def rollback(self) -> float:
        return self.ckpt_every / 2 if self.rollback_steps is None else self.rollback_steps

    @property
    def down_s(self) -> float:
        """ft_hsdp: from a failure until the failed replica trains again."""
        return self.detect_s + self.restart_s + self.catchup_s


@dataclass(frozen=True)
class Goodput:
    restart_ett: float
    ft_ett: float
    restart_lost_s: float
    """Full-job seconds lost per failure, restart-the-world."""
    ft_lost_s: float
    """Full-job seconds lost per failure, ft_hsdp: stall + degraded / R."""
    ft_stall_s: float
    ft_degraded_s: float
    """Seconds per failure with R-1 of R replicas training."""
    ckpt_factor: float
    overhead_factor: float = 1.0
    """1 / (1 + overhead): ft_hsdp's work rate while healthy, against DDP's."""


def checkpoint_factor(inp: Inputs) -> float:
    """Fraction of training time left after checkpoint costs."""
    if inp.ckpt_every <= 0:
        return 1.0
    interval = inp.ckpt_every * inp.step_s
    return interval / (interval + inp.ckpt_cost_s) if interval + inp.ckpt_cost_s > 0 else 1.0


def goodput(inp: Inputs) -> Goodput:
    """ETT of both modes; see the module docstring for the accounting."""
    ck = checkpoint_factor(inp)
    world = inp.restart_s if inp.world_restart_s is None else inp.world_restart_s
    restart_lost = inp.detect_s + world + inp.rollback * inp.step_s
    restart_ett = max(0.0, 1.0 - restart_lost / inp.mtbf_job_s) * ck
    of = 1.0 / (1.0 + inp.overhead)
    if inp.replicas == 1:  # nobody to keep training: a failure stops the job like a world restart
        return Goodput(restart_ett, restart_ett * of, restart_lost, restart_lost, restart_lost, 0.0, ck, of)
    stall = inp.stall
    degraded = max(0.0, inp.down_s - stall)
    rate = 1.0 if not inp.degraded_step_s or not inp.step_s else inp.step_s / inp.degraded_step_s
    ft_lost = stall + degraded * max(0.0, 1.0 - (inp.replicas - 1) / inp.replicas * rate)
    ft_ett = max(0.0, 1.0 - ft_lost / inp.mtbf_job_s) * ck * of
    return Goodput(restart_ett, ft_ett, restart_lost, ft_lost, stall, degraded, ck, of)


PAPER = Inputs(gpus=98304, replicas=12, mtbf_job_s=18 * 60, detect_s=60.0, restart_s=540.0, catchup_s=0.0,
               step_s=0.0, stall_s=180.0, rollback_steps=0.0)
"""FT-HSDP (Meta, 2026): ~98K H100s as 12 replicas, a failure every 18 min, a 10 min
synchronous restart (60 s detection + 9 min, rollback included), 3 min full stall."""


def at_scale(inp: Inputs, gpus: int) -> Inputs:
    """The same job at another size: per-GPU failure rate and replica count kept (at most
    one replica per GPU), so the job MTBF scales as 1/GPUs."""
    return replace(inp, gpus=gpus, replicas=min(inp.replicas, gpus), mtbf_job_s=inp.mtbf_job_s * inp.gpus / gpus)


def with_replicas(inp: Inputs, replicas: int) -> Inputs:
    return replace(inp, replicas=replicas)


@dataclass(frozen=True)
class Crossover:
    """Where restart-the-world stops winning, as the job grows (`crossover`)."""

    gpus: Optional[int]
    """The smallest job (GPUs) at which ft_hsdp's ETT is at least restart-the-world's; None
    when that never happens up to the largest size searched."""
    reason: str


CROSSOVER_MAX_GPUS = 1 << 30
"""The largest job `crossover` looks at (about a billion GPUs)."""


def crossover(inp: Inputs, max_gpus: int = CROSSOVER_MAX_GPUS) -> Crossover:
    """The job size below which restart-the-world wins: the smallest GPU count from
    `inp.replicas` up, the per-GPU failure rate and everything else of `inp` held (`at_scale`),
    at which ft_hsdp's ETT is above restart-the-world's. ETT falls with size for both (the job
    fails more often), and faster for the mode that loses more per failure, so the sizes where
    ft_hsdp wins are one range from the crossover up (until both reach 0)."""
    per_gpu = inp.mtbf_job_s * inp.gpus

    def wins(g: int) -> bool:
        r = goodput(at_scale(inp, g))
        return r.ft_ett > r.restart_ett

    lo = inp.replicas
    if wins(lo):
        return Crossover(lo, f"ft_hsdp wins at every size from {lo} GPUs: its steady-state overhead "
                             f"({inp.overhead:.3g}) costs less than its cheaper failures save even at one "
                             f"failure every {per_gpu / lo:.4g} s")
    hi = lo
    while not wins(hi):
        if hi >= max_gpus or goodput(at_scale(inp, hi)).restart_ett == 0:
            g = goodput(inp)
            why = (f"a failure costs ft_hsdp {g.ft_lost_s:.4g} s, restart-the-world {g.restart_lost_s:.4g} s"
                   if g.ft_lost_s >= g.restart_lost_s else
                   f"the steady-state overhead ({inp.overhead:.3g}) outweighs the {g.restart_lost_s - g.ft_lost_s:.4g}"
                   " s ft_hsdp saves per failure at these sizes")
            return Crossover(None, f"restart-the-world wins at every size up to {hi} GPUs: {why}")
        lo, hi = hi, min(2 * hi, max_gpus)
    while hi - lo > 1:  # wins(hi) and not wins(lo)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if wins(mid) else (mid, hi)
    at = goodput(at_scale(inp, hi))
    return Crossover(hi, f"restart-the-world wins below {hi} GPUs (there ft_hsdp's ETT is {at.ft_ett:.4f}, "
                         f"restart-the-world's {at.restart_ett:.4f}; steady-state overhead {inp.overhead:.3g}, "
                         f"one GPU failing every {per_gpu:.4g} s)")


@dataclass(frozen=True)
class Memory:
    """What limits the replica count from below the GPU count: every replica holds the
    whole model and optimizer state, sharded over its GPUs."""

    state_bytes: float
    """Parameters x bytes per parameter (bf16 weights + fp32 master and Adam moments: 16)."""
    gpu_bytes: float
    budget_frac: float = 0.5
    """Share of a GPU's memory the sharded state may take (the rest: activations, buffers)."""

    def per_gpu(self, gpus: int, replicas: int) -> float:
        return self.state_bytes * replicas / gpus

    def fits(self, gpus: int, replicas: int) -> bool:
        return self.per_gpu(gpus, replicas) <= self.budget_frac * self.gpu_bytes


@dataclass(frozen=True)
class Candidate:
    replicas: int
    ranks_per_replica: int
    ft_ett: float
    state_gb_per_gpu: Optional[float]
    fits: bool


@dataclass(frozen=True)
class Recommendation:
    replicas: Optional[int]
    reason: str
    candidates: tuple[Candidate, ...]


def candidate_counts(gpus: int, max_replicas: int = 64, gpus_per_node: int = 8) -> list[int]:
    """Replica counts that split the GPUs evenly, each replica a whole number of nodes."""
    node = gpus_per_node if gpus % gpus_per_node == 0 else 1
    return [r for r in range(2, min(max_replicas, gpus) + 1) if gpus % r == 0 and (gpus // r) % node == 0]


def recommend(inp: Inputs, counts: Sequence[int], memory: Optional[Memory] = None,
              tolerance: float = 0.01) -> Recommendation:
    """The fewest replicas whose ft_hsdp ETT is within `tolerance` of the best that fits in
    memory. More replicas lose less per failure (1/R of the down time), but each holds the
    whole state on fewer GPUs, adds a member to every quorum and a hop to every ring, and
    gets a smaller share of the global batch: take only what the failure rate pays for."""
    cands = []
    for r in counts:
        ett = goodput(with_replicas(inp, r)).ft_ett
        per = memory.per_gpu(inp.gpus, r) / 1e9 if memory else None
        cands.append(Candidate(r, inp.gpus // r, ett, per, memory.fits(inp.gpus, r) if memory else True))
    ok = [c for c in cands if c.fits]
    if not ok:
        need = f"{memory.per_gpu(inp.gpus, min(counts)) / 1e9:.1f} GB" if memory and counts else "?"
        return Recommendation(None, f"no replica count fits: even {min(counts) if counts else '-'} replicas need "
                                    f"{need} of state per GPU, over the budget; use more GPUs or shard further",
                              tuple(cands))
    best = max(ok, key=lambda c: c.ft_ett)
    pick = next(c for c in ok if c.ft_ett >= best.ft_ett - tolerance)
    mem = (f"; {pick.state_gb_per_gpu:.1f} GB of model and optimizer state per GPU "
           f"(budget {memory.budget_frac * memory.gpu_bytes / 1e9:.0f} GB)") if memory else ""
    limit = ""
    if memory and any(not c.fits for c in cands):
        limit = f"; more than {max(c.replicas for c in ok)} replicas do not fit in memory"
    reason = (f"{pick.replicas} replicas of {pick.ranks_per_replica} GPUs: ft_hsdp ETT {pick.ft_ett:.3f}, within "
              f"{tolerance} of the best ({best.ft_ett:.3f} at {best.replicas}){mem}{limit}")
    return Recommendation(pick.replicas, reason, tuple(cands))
