"""A plain torch training loop on the framework-free replica core (docs/ARCHITECTURE.md, "A step" to "Exactly once").

Launched once per rank, by `lightning-ft run`, torchrun, srun or a test, with the
environment of docs/ARCHITECTURE.md, "Launchers" (see lightning_ft/launch/environment.py; the secret from
LFT_SECRET_FILE or LFT_SECRET). Addresses come from the config's `network.*` (LFT_CONFIG).
With WORLD_SIZE > 1 the replica runs FSDP2 (`fully_shard`) over gloo, and FTAR exchanges each rank's gradient shard.

The model is an MLP regressing a fixed random teacher on deterministic synthetic data; the
batches come from the exactly-once slot stream. The leader prints one JSON line per
committed step. `--reference` instead runs one process over the same global batches, to
compare loss trajectories.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

from lightning_ft.replica import startup  # the restart breakdown's "python" and "torch" parts

startup.mark("python")
import torch  # noqa: E402

startup.mark("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from lightning_ft.replica.digest import state_digest  # noqa: E402
from lightning_ft.replica.ledger import SlotStream  # noqa: E402


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--batch", type=int, default=16, help="per replica (split over its ranks)")
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--opt", choices=["adam", "sgd"], default="adam")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr-mode", default="sqrt")
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds of 'compute' per step")
    p.add_argument("--stop-file", default="", metavar="PATH",
                   help="once PATH exists, the job stops at a step every replica agrees on (before --steps)")
    p.add_argument("--micro", type=int, default=1,
                   help="micro-batches per step (gradient accumulation); with >= 2 a straggler can be shrunk")
    p.add_argument("--slow-file", default="", metavar="PATH",
                   help="while PATH (with {rid} replaced by the replica id) exists, this replica's compute "
                        "sleeps its number times --step-sleep: a throttled accelerator (bench.straggler)")
    p.add_argument("--digest-every", type=int, default=0, help="print a state digest every N steps")
    p.add_argument("--kill-at", type=int, default=-1, help="SIGKILL self before this step (incarnation 0)")
    p.add_argument("--kill-in-exchange-at", type=int, default=-1,
                   help="SIGKILL self a few ms into this step's exchange (incarnation 0)")
    p.add_argument("--hang-at", type=int, default=-1, help="SIGSTOP self before this step (incarnation 0)")
    p.add_argument("--stop-in-exchange", default="", metavar="REPLICA@STEP",
                   help="SIGSTOP that replica's leader a few ms into this step's exchange (incarnation 0; "
                        "prints a 'stopping' line with the time first: hang diagnosis tests and bench.straggler)")
    p.add_argument("--fail-commit-at", type=int, default=-1,
                   help="vote 'failed' after exchanging this step (incarnation 0): a partial completion")
    p.add_argument("--fail-replicas", default="", metavar="R,R",
                   help="only these replicas vote 'failed' at --fail-commit-at (default: every replica)")
    p.add_argument("--clip", type=float, default=0.0,
                   help="clip the averaged gradients' norm to this (0: no clipping), in catch-ups too")
    p.add_argument("--failures", default="", help="injections 'REPLICA@STEP:KIND,...' (kill, hang, exception, corrupt)")
    p.add_argument("--ttl", type=float, default=3.0)
    p.add_argument("--ftar-timeout", type=float, default=5.0)
    p.add_argument("--init-timeout", type=float, default=10.0)
    p.add_argument("--chunk-bytes", type=int, default=1 << 20, help="FTAR chunk size (every replica: the same)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a job config override (repeatable), e.g. --set stragglers.policy=exclude")
    p.add_argument("--reference", action="store_true")
    p.add_argument("--replicas", type=int, default=0, help="reference mode: number of slots")
    p.add_argument("--world", type=int, default=1, help="reference mode: ranks per replica")
    return p.parse_args(argv)


def parse_failures(spec: str, replicas: int):
    """A FailureSchedule from 'REPLICA@STEP:KIND,...'."""
    from lightning_ft.launch.failure import FailureSchedule, Injection

    events = []
    for item in filter(None, spec.split(",")):
        where, _, kind = item.partition(":")
        rid, _, step = where.partition("@")
        events.append(Injection(int(rid), int(step), kind or "kill"))
    return FailureSchedule(events, replicas=replicas)


def inject(kind: str, rid: int, step: int, model: nn.Module) -> None:
    """Fail this process as the schedule says; the supervisor sees it and restarts the replica."""
    emit(event="inject", kind=kind, rid=rid, step=step)
    if kind == "corrupt":  # silent data corruption: training goes on; the divergence guard must catch it
        from lightning_ft.replica.state import flip_bit

        flip_bit(model)
    elif kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)  # no progress, no keepalive: the lease lapses
    else:
        raise RuntimeError(f"injected exception in replica {rid} before step {step}")


def build_model(a: argparse.Namespace) -> nn.Module:
    torch.manual_seed(a.seed)
    layers: list[nn.Module] = []
    d = a.dim
    for _ in range(a.depth):
        layers += [nn.Linear(d, a.hidden), nn.ReLU()]
        d = a.hidden
    layers.append(nn.Linear(d, 1))
    return nn.Sequential(*layers)


def build_optimizer(a: argparse.Namespace, model: nn.Module) -> torch.optim.Optimizer:
    if a.opt == "adam":
        return torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    return torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)


class Data:
    """Deterministic samples: x ~ N(0, 1) from a fixed generator, y = teacher(x)."""

    def __init__(self, a: argparse.Namespace) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(a.samples, a.dim, generator=g)
        w = torch.randn(a.dim, 1, generator=g) / a.dim ** 0.5
        self.y = torch.tanh(self.x @ w) + 0.1 * torch.sin(3 * self.x[:, :1])

    def get(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(ids, dtype=torch.long)
        return self.x[idx], self.y[idx]


_EMIT = threading.Lock()


def emit(**kw) -> None:
    """One JSON line, written whole: the 'stopping' line comes from a timer thread, and print()
    writes the text and its newline apart, so two threads could glue two rows on one line."""
    line = json.dumps({"t": time.time(), **kw}) + "\n"
    with _EMIT:
        sys.stdout.write(line)
        sys.stdout.flush()


def reference(a: argparse.Namespace) -> int:
    """One process, the same global batches: every slot's batch k at step k, R*W shards."""
    model = build_model(a)
    opt = build_optimizer(a, model)
    data = Data(a)
    stream = SlotStream(a.samples, a.batch, a.replicas, seed=a.seed)
    for step in range(a.steps):
        ids = [i for s in range(a.replicas) for i in stream.batch(s, step)]
        x, y = data.get(ids)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        emit(event="step", step=step, loss=loss.item())
    return 0


def main(argv: list[str]) -> int:
    a = parse(argv)
    import logging

    logging.basicConfig(level=os.environ.get("LFT_LOG_LEVEL", "WARNING"), format="%(name)s: %(message)s")
    if a.reference:
        return reference(a)
    from lightning_ft.coord.membership import JobFinished
    from lightning_ft.replica.group import ReplicaGroup
    from lightning_ft.replica.batch_policy import own_todo
    from lightning_ft.replica.core import Do
    from lightning_ft.replica.replica import Replica
    from lightning_ft.replica.settings import Identity, Settings

    from lightning_ft import secret
    from lightning_ft.config import load_config
    from lightning_ft.launch.environment import replica_env

    env = os.environ
    renv = replica_env(env)  # lightning-ft run, torchrun or srun (launch/environment.py)
    cfg = load_config(renv.config or None, a.set)
    rid, R, inc, rank, world = renv.replica_id, renv.num_replicas, renv.incarnation, renv.rank, renv.world_size
    torch.set_num_threads(1)
    # Slow init first (docs/ARCHITECTURE.md, "Catch-up"): model, data, process group; register only afterwards.
    pg = None
    model = build_model(a)
    if world > 1:
        if renv.launcher == "torchrun":
            from lightning_ft.launch.environment import init_torchrun_group

            init_torchrun_group(renv, "gloo")
        else:  # env://, at the replica's own address (srun: the one renv derived)
            os.environ.setdefault("MASTER_ADDR", renv.master_addr)
            os.environ.setdefault("MASTER_PORT", str(renv.master_port))
            dist.init_process_group("gloo", rank=rank, world_size=world)
        pg = dist.group.WORLD
        from torch.distributed.fsdp import fully_shard

        for m in model:
            if isinstance(m, nn.Linear):
                fully_shard(m)
        fully_shard(model)
    opt = build_optimizer(a, model)
    data = Data(a)
    stream = SlotStream(a.samples, a.batch, R, seed=a.seed)
    who = Identity(renv.job, rid, inc, R, secret.resolve(cfg.secret), renv.etcd, run_id=renv.run_id,
                   standby=renv.standby)
    settings = Settings(lease_ttl_s=a.ttl, ftar_timeout_s=a.ftar_timeout, init_timeout_s=a.init_timeout,
                        ftar_connect_timeout_s=cfg.ftar.connect_timeout_s, lr_intervention=a.lr_mode,
                        chunk_bytes=a.chunk_bytes, num_chunks=4, digest_every=a.digest_every,
                        bind_host=cfg.network.bind_host, advertise_host=cfg.network.advertise_host,
                        stragglers=cfg.stragglers, hang_report_after_s=cfg.hang.report_after_s,
                        hang_timeout_s=cfg.etcd.hang_timeout_s)
    mgr = Replica(model, opt, who, settings, group=ReplicaGroup(rank, world, pg), run_dir=renv.run_dir)
    mgr.micro_batches = a.micro if a.micro > 1 else 0  # it trains any micro-batch of any slot (extra below)
    if renv.standby and rank == 0:
        emit(event="standby", token=renv.standby)
    try:
        mgr.start()
    except JobFinished as e:  # a spare never needed
        if not renv.standby:
            raise
        if rank == 0:
            emit(event="finished_already", rid=-1, inc=-1, reason=str(e))
        return 0
    rid, inc = mgr.rid, mgr.incarnation  # a warm spare learns them when promoted
    schedule = parse_failures(a.failures, R)
    if renv.config:  # launched by `lightning-ft run`: failures come from the job config
        from lightning_ft.launch.failure import FailureSchedule

        cfg_sched = FailureSchedule.from_config(cfg.failure, R)
        schedule = FailureSchedule(schedule.events() + cfg_sched.events(), replicas=R)
    leader = rank == 0
    if leader:
        emit(event="started", rid=rid, inc=inc, cursor=mgr.cursor)
    box: dict = {"last_t": time.perf_counter(), "loss": None, "own": set()}

    def row(event: str, plan) -> None:
        """One JSON line per round that committed (or failed to), printed by the leader."""
        if not leader:
            return
        now = time.perf_counter()
        q, st = plan.quorum, mgr.stats
        out = dict(event=event, rid=rid, inc=inc, step=plan.step, loss=box["loss"] if plan.contribute else None,
                   epoch=q.epoch, round=q.round, members=list(q.members), contributors=list(q.contributors),
                   lagging=list(q.lagging), lr_factor=plan.lr_factor, batch=plan.batch_index, lag=plan.lagging,
                   role=plan.role, dt=now - box["last_t"], quorum_ms=st.quorum_s * 1e3,
                   reconf_ms=st.reconfigure_s * 1e3, exchange_ms=st.exchange_s * 1e3, catchup_ms=st.catchup_s * 1e3,
                   catchup_gbps=st.catchup_gbps, state_mb=st.catchup_mb, freeze_ms=st.freeze_s * 1e3)
        if q.shrunk:  # stragglers.policy=shrink: who gave what away, and what we trained of it
            out.update(shrunk=[list(e) for e in q.shrunk], skip=list(plan.skip), took=[list(m) for m in plan.micro])
        if a.digest_every and event == "step" and mgr.step % a.digest_every == 0:
            out["digest"] = state_digest(model, opt)
        emit(**out)
        box["last_t"] = now
        if mgr.restart_breakdown is not None and not box.get("breakdown"):  # a restart's first commit
            box["breakdown"] = True
            emit(event="restart_breakdown", rid=rid, inc=inc, **mgr.restart_breakdown)

    def check(plan) -> bool:  # on the averaged gradients, the same on every replica
        if a.clip:
            nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        chosen = not a.fail_replicas or str(rid) in a.fail_replicas.split(",")
        if inc == 0 and plan.step == a.fail_commit_at and chosen:
            a.fail_commit_at = -1  # --fail-commit-at: a partial completion, this replica votes "failed"
            return False
        return True

    def books(ask) -> None:
        """A catch-up's clip (as the contributors clipped) and one row per commit or retry."""
        if ask.do is Do.CLIP and a.clip:
            nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        elif ask.do is Do.COMMITTED:
            row("step", ask.plan)
        elif ask.do is Do.RETRIED:
            row("retry", ask.plan)

    slow_file = a.slow_file.replace("{rid}", str(rid))

    def slow() -> float:
        try:
            with open(slow_file) as f:
                return float(f.read().strip() or 1.0)
        except (OSError, ValueError):
            return 1.0

    def train_micro(slot: int, k: int, j: int) -> float:
        """Forward and backward of micro-batch j of slot batch k (this rank's share), loss / N."""
        ids = stream.batch(slot, k)[rank::world]
        m = len(ids) // a.micro
        x, y = data.get(ids[j * m:(j + 1) * m] if a.micro > 1 else ids)
        loss_t = nn.functional.mse_loss(model(x), y)
        (loss_t / a.micro if a.micro > 1 else loss_t).backward()
        if a.step_sleep:
            time.sleep(a.step_sleep / a.micro * (slow() if slow_file else 1.0))
        return loss_t.item()

    def extra(plan) -> None:
        """What a shrunk straggler gives away (plan.micro; stragglers.policy=shrink), and our own
        micro-batches as the round decided (plan.skip)."""
        restart, todo = own_todo(box["own"], a.micro, plan.skip)
        if restart:
            opt.zero_grad(set_to_none=True)
        for j in todo:
            train_micro(rid, plan.batch_index, j)
        box["own"] = set(range(a.micro)) - set(plan.skip)
        for slot, k, j in plan.micro:
            train_micro(slot, k, j)

    def compute(plan) -> None:
        own = [j for j in range(a.micro) if j not in plan.skip]
        box["loss"] = sum(train_micro(rid, plan.batch_index, j) for j in own) / len(own)
        box["own"] = set(own)
        if inc == 0 and plan.step == a.kill_in_exchange_at:
            threading.Timer(0.002, os.kill, (os.getpid(), signal.SIGKILL)).start()
        if inc == 0 and rank == 0 and a.stop_in_exchange == f"{rid}@{plan.step}":
            def stop() -> None:
                emit(event="stopping", rid=rid, inc=inc, step=plan.step, pid=os.getpid(), t=time.time())
                os.kill(os.getpid(), signal.SIGSTOP)

            threading.Timer(0.002, stop).start()

    try:
        done = mgr.finished_step()
        if done is not None:  # restarted after the job finished: nothing to train
            if leader:
                emit(event="finished_already", rid=rid, inc=inc, step=done)
            return 0
        try:
            for ask in mgr.prepare():
                books(ask)
        except JobFinished as e:  # it finished while this replica was starting
            if leader:
                emit(event="finished_already", rid=rid, inc=inc, reason=str(e))
            return 0
        while mgr.step < a.steps:
            due = schedule.due(rid, mgr.step, inc)
            if due is not None:
                inject(due.kind, rid, mgr.step, model)
            if inc == 0 and mgr.step == a.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if inc == 0 and mgr.step == a.hang_at and leader:
                a.hang_at = -1  # after SIGCONT, carry on
                os.kill(os.getpid(), signal.SIGSTOP)
            if a.stop_file and os.path.exists(a.stop_file):
                mgr.request_stop = True  # the job stops after the step every replica agrees on
            step = mgr.begin(extras=a.micro > 1)
            for ask in step:  # the step: what the replica asks of this loop, in order
                if ask.do is Do.COMPUTE:
                    compute(ask.plan)
                    step.share = (len(box["own"]), a.micro)
                elif ask.do is Do.RECOMPUTE:
                    opt.zero_grad(set_to_none=True)
                    compute(ask.plan)
                elif ask.do is Do.EXTRA:
                    extra(ask.plan)
                elif ask.do is Do.CHECK:
                    step.veto = not check(ask.plan)
                else:
                    books(ask)
            res = step.result
            if res.stop or (res.caught_up and mgr.finished_step() is not None):
                break  # the job agreed to stop here, or finished (we adopted its final state)
        mgr.mark_finished()  # a replica restarted from now on finds nothing to train (no lone rewind)
        digests = mgr.gather(state_digest(model, opt))
        if leader:
            emit(event="final", rid=rid, inc=inc, step=mgr.step, digest=digests)
    finally:
        mgr.close()
        if world > 1:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
