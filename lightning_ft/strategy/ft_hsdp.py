"""`FTHSDPStrategy`: fault-tolerant HSDP as a Lightning strategy (DESIGN §1, §5-§7, §11).

One Lightning "world" is one replica: W processes running FSDP2 over their own process
group (Lightning's `ModelParallelStrategy`, gloo on CPU). Across replicas nothing is a
torch.distributed collective: the `ReplicaManager` runs the per-step quorum, the FTAR
gradient exchange, catch-up and the two-phase commit.

Mapping onto Lightning's loop. Every call of `optimizer_step` (automatic or manual
optimization) ends with the replica's committed step count equal to Lightning's
`global_step`:

    loop:
        plan = start_step()                          # quorum round
        lagging  -> zeros + catch-up, commit        # the state jumps to the healthy one
        contrib. -> closure() (forward/backward), exchange, commit; failed -> restore grads, retry

A round can commit a step that did not train this replica's batch (a catch-up); the batch
is then trained in the next round of the same call, recomputed on the caught-up weights
(automatic optimization replays the accumulated micro-batches). Lightning's step counters
are set from the committed count, and step-interval LR schedulers are stepped exactly once
per committed step (a catch-up loads the healthy replica's scheduler state).

The train loader is replaced by an exactly-once one (`FTBatchSampler`): the replica trains
its slot's batches from the slot cursor in etcd, so every batch is trained once by the job.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, IterableDataset

from lightning_ft.config import FTConfig, fingerprint, load_config
from lightning_ft.replica.data import SlotStream
from lightning_ft.strategy.sampler import FTBatchSampler

log = logging.getLogger(__name__)


class FTHSDPError(RuntimeError):
    """A misuse or an unrecoverable state, with what to do about it."""


def _env(name: str, default: Optional[str] = None) -> str:
    v = os.environ.get(name, default)
    if v is None:
        raise FTHSDPError(
            f"strategy='ft_hsdp' needs the launcher's environment ({name} is not set). Start the script with "
            "`lightning-ft run --replicas R --nproc-per-replica W script.py`, or set LFT_JOB, LFT_REPLICA_ID, "
            "LFT_NUM_REPLICAS, LFT_ETCD, LFT_SECRET, RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT per process "
            "(README, multi-node)")
    return v


class _Schedulers:
    """Step-interval LR schedulers stepped once per *committed* step; state for catch-up.

    Lightning steps each scheduler once after every `optimizer_step` call. A call may commit
    zero steps (a batch already trained) or several (a catch-up, then our own step), so each
    scheduler's `step` is wrapped: it applies the steps owed since the last call."""

    def __init__(self, configs: Sequence[Any]) -> None:
        self.configs = list(configs)
        self._owed: dict[int, int] = {}
        self._orig: dict[int, Callable] = {}
        for c in self.configs:
            sch = c.scheduler
            if c.interval != "step" or c.reduce_on_plateau:
                continue
            self._owed[id(sch)] = 0
            self._orig[id(sch)] = type(sch).step.__get__(sch)
            sch.__class__ = self._synced_class(type(sch))

    def _synced_class(self, cls: type) -> type:
        """A subclass whose `step` pays the steps owed (keeps state_dict() free of wrappers)."""
        sync = self

        def step(sch: Any, *args: Any, **kwargs: Any) -> None:
            sync._pay(id(sch))

        return type(cls.__name__, (cls,), {"step": step, "__module__": cls.__module__})

    def _pay(self, sid: int) -> None:
        while self._owed[sid] > 0:
            self._orig[sid]()
            self._owed[sid] -= 1

    def committed(self) -> None:
        for sid in self._owed:
            self._owed[sid] += 1

    def flush(self) -> None:
        for sid in self._owed:
            self._pay(sid)

    def state_dict(self) -> list:
        return [c.scheduler.state_dict() for c in self.configs]

    def load_state_dict(self, states: list) -> None:
        for c, s in zip(self.configs, states):
            c.scheduler.load_state_dict(s)
        for sid in self._owed:  # the healthy replica's state already includes its steps
            self._owed[sid] = 0


class _FTMetrics(Callback):
    """Per-step FT metrics through the Lightning logger (DESIGN §11)."""

    def __init__(self, strategy: "FTHSDPStrategy") -> None:
        self.strategy = strategy

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not trainer._logger_connector.should_update_logs:
            return  # logging every step costs milliseconds; loggers only write every n steps
        m = self.strategy.metrics()
        if m:
            pl_module.log_dict(m, on_step=True, on_epoch=False, batch_size=1, sync_dist=False)


class FTHSDPStrategy(ModelParallelStrategy):
    """Fault-tolerant HSDP: FSDP2 inside a replica, FTAR and a per-step quorum across replicas.

    Args:
        config: YAML config path (default: `$LFT_CONFIG`, written by `lightning-ft run`).
        overrides: Hydra-style `key=value` overrides applied on top (e.g. `lr_intervention=linear`).
        shard_layers: module classes (or class names) to `fully_shard` when the LightningModule's
            `configure_model` did not; default: the members of every `nn.ModuleList`, then each
            top-level child module that has parameters.
        lr_intervention: none | linear | sqrt (overrides the config; `LRIntervention` sets it too).
        data_seed: seed of the exactly-once data order (default: config `seed`).
        overlap: run each step's quorum during forward/backward and all-reduce gradient buckets
            from post-accumulate-grad hooks as backward produces them (default True).
    """

    strategy_name = "ft_hsdp"

    def __init__(self, config: Optional[str] = None, overrides: Sequence[str] = (),
                 shard_layers: Optional[Sequence[Union[type, str]]] = None, lr_intervention: Optional[str] = None,
                 data_seed: Optional[int] = None, overlap: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for name in ("LFT_JOB", "LFT_REPLICA_ID", "LFT_NUM_REPLICAS", "LFT_ETCD", "LFT_SECRET"):
            _env(name)  # fail at Trainer(...) with how to launch, not deep inside fit()
        self._config_path = config
        self._overrides = list(overrides)
        self.shard_layers = list(shard_layers) if shard_layers is not None else None
        self.lr_intervention = lr_intervention
        self._data_seed = data_seed
        self.overlap = overlap
        self._pending: Any = None
        self.cfg: Optional[FTConfig] = None
        self.mgr: Any = None
        self.sampler: Optional[FTBatchSampler] = None
        self._window: list[tuple[tuple[int, int], Any, int]] = []
        self._schedulers: Optional[_Schedulers] = None
        self._ft_devices: Optional[list[torch.device]] = None
        self.committed_in_call = 0
        self.recomputes = 0
        self._job_done = False
        self._steps_file: Any = None
        self._phase: dict[str, float] = {}
        self._ckpt: Any = None

    # -- environment: one Lightning world per replica ---------------------------------------------------
    @property
    def rid(self) -> int:
        return int(_env("LFT_REPLICA_ID"))

    @property
    def num_replicas(self) -> int:
        return int(_env("LFT_NUM_REPLICAS"))

    @property
    def incarnation(self) -> int:
        return int(os.environ.get("LFT_INCARNATION", "0"))

    @property
    def parallel_devices(self) -> Optional[list[torch.device]]:  # type: ignore[override]
        return self._ft_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: Optional[list[torch.device]]) -> None:
        # The replica's size comes from the launcher (WORLD_SIZE), not from Trainer(devices=...).
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if devices and devices[0].type == "cuda":
            self._ft_devices = [torch.device("cuda", i % max(1, torch.cuda.device_count())) for i in range(world)]
        else:
            self._ft_devices = [torch.device("cpu")] * world

    def load_ft_config(self) -> FTConfig:
        path = self._config_path or os.environ.get("LFT_CONFIG") or None
        cfg = load_config(path, self._overrides)
        if self.lr_intervention is not None:
            cfg.lr_intervention = self.lr_intervention
        return cfg

    def setup_environment(self) -> None:
        world = len(self.parallel_devices or [None])
        self._data_parallel_size, self._tensor_parallel_size = world, 1
        self.cfg = self.load_ft_config()
        _env("LFT_REPLICA_ID")
        super().setup_environment()
        trainer = self.lightning_module.trainer
        for lg in trainer.loggers:  # each replica logs to its own directory
            if hasattr(lg, "_version") and lg._version is None:
                lg._version = f"replica_{self.rid}"
        if not any(isinstance(cb, _FTMetrics) for cb in trainer.callbacks):
            trainer.callbacks.append(_FTMetrics(self))
        from lightning_ft.callbacks.failure import FailureInjector

        failures = self.cfg.failure
        if (failures.events or failures.mtbf_steps > 0) and not any(isinstance(cb, FailureInjector)
                                                                     for cb in trainer.callbacks):
            trainer.callbacks.append(FailureInjector())  # the job config schedules failures: inject them

    # -- model: FSDP2 inside the replica ----------------------------------------------------------
    def _auto_shard(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        module = self.lightning_module
        params = list(module.parameters())
        if any(isinstance(p, DTensor) for p in params):
            return  # the user's configure_model parallelized it
        if self.world_size == 1:
            return  # one shard is the whole model: FSDP2 would only add overhead
        mesh = self.device_mesh["data_parallel"]
        if self.shard_layers is not None:
            names = {c if isinstance(c, str) else c.__name__ for c in self.shard_layers}
            layers = [m for m in module.modules() if type(m).__name__ in names and m is not module]
        else:
            layers = [m for ml in module.modules() if isinstance(ml, torch.nn.ModuleList) for m in ml]
        for m in layers:
            fully_shard(m, mesh=mesh)
        for _, child in module.named_children():
            if any(True for _ in child.parameters()):
                fully_shard(child, mesh=mesh)
        loose = [n for n, p in module.named_parameters() if not isinstance(p, DTensor)]
        if loose:
            raise FTHSDPError(f"parameters {loose[:5]} live directly on the LightningModule, so the strategy cannot "
                              "fully_shard them; put them in a submodule, or apply fully_shard in configure_model()")

    def setup(self, trainer: Any) -> None:
        # ModelParallelStrategy.setup, without its demand that configure_model parallelizes.
        from lightning.pytorch.strategies.model_parallel import _materialize_distributed_module
        from lightning.fabric.utilities.optimizer import _optimizers_to_device

        self.accelerator.setup(trainer)
        self._auto_shard()
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            self._start_replica(trainer)

    def _start_replica(self, trainer: Any) -> None:
        from lightning_ft.replica.manager import ReplicaManager

        if len(self.optimizers) != 1:
            raise FTHSDPError(f"ft_hsdp exchanges the gradients of one optimizer; configure_optimizers returned "
                              f"{len(self.optimizers)}")
        cfg = self.cfg
        self._schedulers = _Schedulers(self.lr_scheduler_configs)
        world = self.world_size
        # The manager's own group: its quorum broadcast runs in a background thread while FSDP2's
        # collectives run on the default group.
        pg = dist.new_group(backend="gloo") if world > 1 else None
        self.mgr = ReplicaManager(
            self.lightning_module, self.optimizers[0], job=_env("LFT_JOB"), rid=self.rid,
            incarnation=self.incarnation, num_replicas=self.num_replicas, secret=_env("LFT_SECRET"),
            etcd=_env("LFT_ETCD"), rank=self.global_rank, world=world, pg=pg,
            min_replicas=cfg.min_replicas, prefix=cfg.etcd.prefix, lease_ttl_s=cfg.etcd.lease_ttl_s,
            hang_timeout_s=cfg.etcd.hang_timeout_s, init_timeout_s=cfg.quorum.init_timeout_s,
            lr_intervention=cfg.lr_intervention, chunk_bytes=cfg.ftar.chunk_bytes, num_chunks=cfg.ftar.num_chunks,
            ftar_timeout_s=cfg.ftar.timeout_s, bind_host=cfg.ftar.bind_host, transport=cfg.ftar.transport,
            fingerprint=fingerprint(cfg),
            scheduler=self._schedulers)
        self.mgr.on_commit = self._on_commit
        resume = os.environ.get("LFT_RESUME")
        if resume:
            self._resume(resume)
        if cfg.checkpoint.every_n_steps > 0:
            from lightning_ft.config import checkpoint_dir
            from lightning_ft.replica.checkpoint import CheckpointWriter

            ckpt_pg = dist.new_group(backend="gloo") if world > 1 else None
            self._ckpt = CheckpointWriter(checkpoint_dir(cfg), cfg.checkpoint.keep, self.global_rank, ckpt_pg,
                                          on_done=self._checkpoint_done)
            self._ckpt_pg = ckpt_pg
        self.mgr.start()
        if self.overlap:
            self.mgr.enable_overlap(cfg.ftar.bucket_bytes)

    # -- persistent checkpoints (DESIGN §8) ---------------------------------------------------------
    def _resume(self, path: str) -> None:
        """Whole-job restart: every replica loads the same checkpoint before registering."""
        from lightning_ft.replica.checkpoint import load

        t0 = time.perf_counter()
        self.mgr._materialize_optimizer_state()
        got = load(path, self.lightning_module, self.optimizers[0],
                   pg=None if self.world_size == 1 else dist.group.WORLD)
        extra = got["extra"]
        for g, saved in zip(self.optimizers[0].param_groups, extra["param_groups"]):
            g.update(saved)
        self._schedulers.load_state_dict(extra["schedulers"])
        self.mgr.step = int(got["meta"]["step"])
        if self.global_rank == 0:
            print(f"lightning-ft: replica {self.rid} resumed from {path} (step {self.mgr.step}) in "
                  f"{time.perf_counter() - t0:.2f}s", file=sys.stderr, flush=True)

    def _maybe_checkpoint(self) -> None:
        n = self.cfg.checkpoint.every_n_steps
        plan = self.mgr.last_plan
        if self._ckpt is None or plan is None or self.mgr.step % n or self.committed_in_call == 0:
            return
        if self.rid != min(plan.quorum.contributors):
            return
        from lightning_ft.replica import data as ledger

        self._schedulers.flush()  # the state after this step, scheduler included
        q = plan.quorum
        cursors = {}
        if self.global_rank == 0:
            for slot in range(self.num_replicas):
                if slot in q.contributors:
                    cursors[slot] = q.cursor_of(slot) + 1
                else:
                    cursors[slot] = ledger.read_cursor(self.mgr._store, self.mgr.root, slot)
        meta = {"step": self.mgr.step, "job": os.environ.get("LFT_JOB"), "replicas": self.num_replicas,
                "writer": self.rid, "cursors": {str(k): v for k, v in cursors.items()},
                "quorum": {"round": q.round, "epoch": q.epoch, "members": list(q.members),
                           "contributors": list(q.contributors)}}
        extra = {"step": self.mgr.step, "schedulers": self._schedulers.state_dict(),
                 "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                  for g in self.optimizers[0].param_groups]}
        stats = self._ckpt.save(self.mgr.step, self.lightning_module, self.optimizers[0], extra, meta)
        self._phase["ckpt_stage_ms"] = stats.stage_s * 1e3

    def _checkpoint_done(self, step: int, path: str, stats: Any) -> None:
        """Writer rank 0, background thread: publish and record the complete checkpoint."""
        try:
            self.mgr._store.put(f"{self.mgr.root}ckpt/latest",
                                json.dumps({"step": step, "path": os.path.abspath(path)}).encode())
        except Exception as e:
            log.warning("could not publish checkpoint %s in etcd: %s", path, e)
        d = os.path.join(os.environ.get("LFT_RUN_DIR", "."), f"replica_{self.rid}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "checkpoints.jsonl"), "a") as f:
            f.write(json.dumps({"t": time.time(), "step": step, "path": path, "stage_s": round(stats.stage_s, 4),
                                "write_s": round(stats.write_s, 4), "bytes": stats.bytes}) + "\n")

    def _on_commit(self, plan: Any) -> None:
        self.committed_in_call += 1
        if self._schedulers is not None:
            self._schedulers.committed()

    # -- data: exactly-once batches -----------------------------------------------------------------
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if self.mgr is None or not trainer.training or not isinstance(dataloader, DataLoader):
            return dataloader
        if isinstance(dataloader.dataset, IterableDataset):
            raise FTHSDPError("ft_hsdp trains every batch exactly once by sample index, so the train dataset must be "
                              "map-style (__getitem__ and __len__), not an IterableDataset")
        bs = dataloader.batch_size
        if bs is None:
            raise FTHSDPError("the train DataLoader must set batch_size (per process); ft_hsdp builds the batches")
        n = trainer.accumulate_grad_batches if self.lightning_module.automatic_optimization else 1
        seed = self._data_seed if self._data_seed is not None else int(self.cfg.seed)
        stream = SlotStream(len(dataloader.dataset), bs * self.world_size * n, self.num_replicas, seed=seed)
        if stream.num_samples // stream.batch_size < self.num_replicas:
            raise FTHSDPError(f"{stream.num_samples} samples make fewer than one batch of {stream.batch_size} per "
                              f"replica for {self.num_replicas} replicas")
        self.sampler = FTBatchSampler(stream, self.rid, self.global_rank, self.world_size, n,
                                      start=lambda: self.mgr.cursor)
        return DataLoader(dataloader.dataset, batch_sampler=self.sampler, num_workers=dataloader.num_workers,
                          collate_fn=dataloader.collate_fn, pin_memory=dataloader.pin_memory,
                          worker_init_fn=dataloader.worker_init_fn,
                          persistent_workers=dataloader.persistent_workers and dataloader.num_workers > 0,
                          multiprocessing_context=dataloader.multiprocessing_context)

    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.mgr is None:
            return
        if self.sampler is None or not self.sampler.tags:
            raise FTHSDPError("ft_hsdp could not tell which batch of the exactly-once stream this is: the train "
                              "loader must be the one the strategy installs (no custom data fetching)")
        self._window.append((self.sampler.tags.popleft(), batch, batch_idx))
        trainer = self.lightning_module.trainer
        n = trainer.accumulate_grad_batches if self.lightning_module.automatic_optimization else 1
        if self.overlap and self._pending is None and len(self._window) == n:
            # This batch's backward completes the step: run the quorum meanwhile and let the
            # gradient hooks start the exchange.
            self._pending = self.mgr.begin_step()

    # -- the step -----------------------------------------------------------------------------------
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.mgr is None:
            return
        done = self.mgr.finished_step()
        if done is not None:
            print(f"lightning-ft: replica {self.rid}: the job already finished at step {done}; nothing to train",
                  file=sys.stderr, flush=True)
            self._job_done = True
            self.lightning_module.trainer.should_stop = True
            return
        # A restarted or late replica catches up before it touches a batch (no wasted compute,
        # and accumulation or manual optimization never trains on stale weights).
        t0 = time.perf_counter()
        caught_up = False
        while self.mgr.behind():
            plan = self.mgr.start_step()
            if not plan.lagging:
                raise FTHSDPError(f"replica {self.rid} expected to catch up but the quorum made it a contributor "
                                  "(the healthy replicas may all have failed); restart the job from a checkpoint")
            if self.mgr.commit(self.mgr.exchange(plan)):
                self._schedulers.flush()
                caught_up = True
        self._set_lightning_step(self.mgr.step)
        if caught_up:
            self._log_step(None, True, time.perf_counter() - t0)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self.mgr is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        lm = self.lightning_module
        auto = lm.automatic_optimization
        window, self._window = self._window, []
        if not window:
            raise FTHSDPError("optimizer_step without a training batch: ft_hsdp supports one optimizer step per "
                              "batch (or per accumulation window)")
        k = window[-1][0][0]
        if any(tag[0] != k for tag, _, _ in window):
            raise FTHSDPError(f"an accumulation window spans slot batches {[t for t, _, _ in window]}")
        self.committed_in_call = 0
        self._phase = {}
        t0 = time.perf_counter()
        caught_up = False
        loss = None
        closure_done = False
        fresh = True  # gradients accumulated so far were computed on the current weights
        mgr = self.mgr
        first = None
        if self._pending is not None:
            pending, self._pending = self._pending, None
            if auto:  # forward/backward overlap the quorum; hooks send buckets once it is in
                loss = closure()
                closure_done = True
            t1 = time.perf_counter()
            self._phase["closure_ms"] = (t1 - t0) * 1e3
            first = pending.result()
            self._phase["quorum_wait_ms"] = (time.perf_counter() - t1) * 1e3
        while first is not None or mgr.cursor <= k:
            if self.committed_in_call:
                self._schedulers.flush()
            plan, first = (first, None) if first is not None else (mgr.start_step(), None)
            if plan.lagging:
                if mgr.commit(mgr.exchange(plan)):
                    fresh, caught_up = False, True
                continue
            if plan.batch_index != k:
                raise FTHSDPError(f"replica {self.rid}: the quorum assigns slot batch {plan.batch_index} but the "
                                  f"loader delivered batch {k}")
            if not fresh:
                if not auto:
                    raise FTHSDPError(f"replica {self.rid} fell behind with a half-trained manual-optimization step; "
                                      "exiting so that the launcher restarts it and it catches up first")
                mgr.disarm()
                loss = self._recompute(window, closure, optimizer)
                closure_done = fresh = True
            elif not closure_done:
                loss = closure()
                closure_done = True
            vote = mgr.exchange(plan, save_grads=True)
            if vote:
                self.precision_plugin._after_closure(lm, optimizer)  # hooks and clipping on the averaged grads
            t2 = time.perf_counter()
            ok = mgr.commit(vote)
            self._phase["commit_ms"] = (time.perf_counter() - t2) * 1e3
            if ok:
                break
            mgr.restore_grads()
        if auto and not closure_done:  # batch already trained by the job: Lightning still wants a result
            closure()
            optimizer.zero_grad(set_to_none=True)
        self._set_lightning_step(mgr.step - 1)  # Lightning adds the one it thinks it made
        self._maybe_checkpoint()
        self._log_step(loss, caught_up, time.perf_counter() - t0)
        return None

    def _log_step(self, loss: Any, caught_up: bool, seconds: float) -> None:
        """run_dir/replica_{rid}/steps.jsonl (rank 0): one row per optimizer step, for reports."""
        if self.global_rank != 0 or self.mgr.last_plan is None:
            return
        if self._steps_file is None:
            d = os.path.join(os.environ.get("LFT_RUN_DIR", "."), f"replica_{self.rid}")
            os.makedirs(d, exist_ok=True)
            self._steps_file = open(os.path.join(d, "steps.jsonl"), "a", buffering=1)
        plan, st = self.mgr.last_plan, self.mgr.stats
        row = {"t": time.time(), "rid": self.rid, "inc": self.incarnation, "step": self.mgr.step,
               "loss": float(loss) if torch.is_tensor(loss) or isinstance(loss, float) else None,
               "contributors": list(plan.quorum.contributors), "epoch": plan.quorum.epoch,
               "lr_factor": plan.lr_factor, "caught_up": caught_up, "call_s": round(seconds, 6),
               "quorum_ms": round(st.quorum_s * 1e3, 3), "reconf_ms": round(st.reconfigure_s * 1e3, 3),
               "exchange_ms": round(st.exchange_s * 1e3, 3), "freeze_ms": round(st.freeze_s * 1e3, 3), "catchup_ms": round(st.catchup_s * 1e3, 3),
               "retries": st.retries, **{k: round(v, 3) for k, v in self._phase.items()}}
        self._steps_file.write(json.dumps(row) + "\n")

    def _recompute(self, window: list, closure: Callable[[], Any], optimizer: Any) -> None:
        """Redo the window's forward/backward on the caught-up weights (automatic optimization)."""
        self.recomputes += 1
        optimizer.zero_grad(set_to_none=True)
        n = len(window)
        for _, batch, batch_idx in window[:-1]:
            out = self.training_step(batch, batch_idx)
            loss = out["loss"] if isinstance(out, dict) else out
            self.backward(loss / n, optimizer)
        return closure()

    def _set_lightning_step(self, n: int) -> None:
        loop = self.lightning_module.trainer.fit_loop.epoch_loop
        if self.lightning_module.automatic_optimization:
            t = loop.automatic_optimization.optim_progress.optimizer.step.total
        else:
            t = loop.manual_optimization.optim_step_progress.total
        t.ready = max(t.ready - t.completed + n, n)
        t.completed = n
        loop._batches_that_stepped = n

    def metrics(self) -> dict[str, float]:
        plan = self.mgr.last_plan if self.mgr is not None else None
        if plan is None:
            return {}
        st = self.mgr.stats
        gb = (self.mgr._flat.numel() * self.mgr._flat.element_size() / 1e9) if self.mgr._flat is not None else 0.0
        return {"ft/healthy": float(len(plan.quorum.contributors)), "ft/total": float(self.num_replicas),
                "ft/epoch": float(plan.quorum.epoch), "ft/lr_factor": plan.lr_factor,
                "ft/ftar_gbps": gb / st.exchange_s if st.exchange_s > 0 else 0.0,
                "ft/retries": float(st.retries), "ft/catchup_ms": st.catchup_s * 1e3}

    # -- side effects: one writer, clear failures, clean exit ------------------------------------------
    @property
    def is_checkpoint_writer(self) -> bool:
        """The lowest-id contributor of the last round writes (and prunes) checkpoints."""
        plan = self.mgr.last_plan if self.mgr is not None else None
        if plan is None:
            return self.mgr is None or self.rid == 0
        return self.rid == min(plan.quorum.contributors)

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        if self.is_checkpoint_writer:
            super().save_checkpoint(checkpoint, filepath, storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_checkpoint_writer:
            super().remove_checkpoint(filepath)

    def on_exception(self, exception: BaseException) -> None:
        from lightning_ft.coord.coordinator import ConfigMismatch, Evicted, QuorumTimeout
        from lightning_ft.coord.store import StoreError
        from lightning_ft.ftar.transport.base import FatalError

        hint = {
            Evicted: "this replica was evicted (declared failed by the others); the launcher restarts it",
            QuorumTimeout: "no quorum formed in time: too few healthy replicas (min_replicas) or etcd is slow",
            ConfigMismatch: "this replica's config differs from the running job's; launch it with the same config",
            StoreError: "etcd is unreachable: check `--etcd` / LFT_ETCD and that the server runs",
            FatalError: "an unrecoverable FTAR error (bad secret, wrong job or mismatched buffers)",
            FTHSDPError: "",
        }
        for cls, text in hint.items():
            if isinstance(exception, cls):
                print(f"lightning-ft: replica {os.environ.get('LFT_REPLICA_ID', '?')} rank {self.global_rank}: "
                      f"{type(exception).__name__}: {exception}" + (f"\n  -> {text}" if text else ""),
                      file=sys.stderr, flush=True)
                break
        self._close()

    def on_train_end(self) -> None:
        super().on_train_end()
        if self.mgr is not None and not self._job_done:
            self.mgr.mark_finished()
            self._write_final()

    def _write_final(self) -> None:
        """run_dir/replica_{rid}/final.json: committed steps and a digest of every rank's state."""
        from lightning_ft.replica.digest import state_digest

        digests = self.mgr._gather(state_digest(self.lightning_module, self.optimizers[0]))
        if self.global_rank == 0:
            d = os.path.join(os.environ.get("LFT_RUN_DIR", "."), f"replica_{self.rid}")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "final.json"), "w") as f:
                json.dump({"rid": self.rid, "incarnation": self.incarnation, "step": self.mgr.step,
                           "cursor": self.mgr.cursor, "digest": digests, "recomputes": self.recomputes}, f)

    def _close(self) -> None:
        if self._ckpt is not None:
            self._ckpt.wait(120)  # let the last checkpoint finish writing
            self._ckpt = None
        if self._steps_file is not None:
            self._steps_file.close()
            self._steps_file = None
        if self.mgr is not None:
            try:
                self.mgr.close()
            finally:
                self.mgr = None

    def teardown(self) -> None:
        self._close()
        super().teardown()


def register(registry: Any = None) -> None:
    if registry is None:
        from lightning.pytorch.strategies import StrategyRegistry as registry
    if FTHSDPStrategy.strategy_name not in registry:
        registry.register(FTHSDPStrategy.strategy_name, FTHSDPStrategy,
                          description="fault-tolerant HSDP: FSDP2 per replica, FTAR + per-step quorum across replicas")


register()
