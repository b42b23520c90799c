"""`FTHSDPStrategy`: fault-tolerant HSDP as a Lightning strategy (docs/ARCHITECTURE.md, "Lightning glue").

One Lightning "world" is one replica: W processes running FSDP2 over their own process
group (Lightning's `ModelParallelStrategy`, gloo on CPU). Across replicas nothing is a
torch.distributed collective: the framework-free `ReplicaManager` owns the whole step
(quorum, catch-up, sync and rewind rounds, the FTAR exchange, the two-phase commit,
retries). This class only adapts Lightning's hooks to it:

- `on_train_start`: `mgr.prepare()` (sync / catch-up / rewind before the first batch);
- `on_train_batch_start`: the exactly-once loader's tag of the batch, and `begin_step`
  (the round's quorum overlaps forward/backward; backward hooks send gradient buckets);
- `optimizer_step`: `mgr.run_step(closure, ...)`, then Lightning's counters from the
  committed step count, the checkpoint, the run log.

Start-up lives in replica_start.py (a finished job's late replica leaves; the replica layer is
built and started). Side jobs live in their own modules: schedulers.py (schedulers stepped once per committed
step), sharding.py (auto `fully_shard`), checkpoints.py (persistent checkpoints),
runlog.py (steps.jsonl, final.json, metrics), sampler.py (the exactly-once batch sampler),
streaming.py (stream loaders over an IterableDataset: split, loader states, resume).
"""
from __future__ import annotations

import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lightning_ft.config import FTConfig
from lightning_ft.constants import ExitCode
from lightning_ft.replica import startup
from lightning_ft.replica.data import SlotStream
from lightning_ft.strategy import lightning_compat, replica_start
from lightning_ft.strategy.errors import FTHSDPError
from lightning_ft.strategy.runlog import FTMetrics, StepLog, metrics, write_final
from lightning_ft.strategy.sampler import FTBatchSampler
from lightning_ft.strategy.schedulers import CommittedSchedulers

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule

    from lightning_ft.strategy.streaming import StreamLoader

log = logging.getLogger(__name__)



def _replica_env() -> Any:
    """Who this process is (launch/environment.py); None when no launcher started it (the
    program self-launches, strategy/self_launch.py); else FTHSDPError saying how to launch."""
    from lightning_ft.launch.environment import LaunchEnvError, launcher_variables, replica_env

    try:
        return replica_env(os.environ)
    except LaunchEnvError as e:
        seen = launcher_variables(os.environ)
        if not seen:
            return None
        raise FTHSDPError(f"strategy='ft_hsdp': {e} (a launcher started this process: {', '.join(seen)} "
                          f"set, so it does not launch the job itself)") from None


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
        replicas: R (overrides config `replicas`).

    Started without launcher variables (`python train.py`), the program launches its job by
    itself: R replicas of W = `Trainer(devices=...)` processes under `lightning-ft run`, which
    this process becomes (strategy/self_launch.py).
    """

    strategy_name = "ft_hsdp"

    def __init__(self, config: Optional[str] = None, overrides: Sequence[str] = (),
                 shard_layers: Optional[Sequence[Union[type, str]]] = None, lr_intervention: Optional[str] = None,
                 data_seed: Optional[int] = None, overlap: bool = True, replicas: Optional[int] = None,
                 **kwargs: Any) -> None:
        from lightning_ft.strategy.environment import ReplicaEnvironment

        if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
            raise FTHSDPError(f"FTHSDPStrategy(replicas={replicas!r}): R must be an integer >= 1")
        self._renv = _replica_env()  # fail at Trainer(...) with how to launch, not deep inside fit()
        super().__init__(**kwargs)
        if self._renv is not None:
            self.cluster_environment = ReplicaEnvironment(self._renv)
        self._secret = ""
        self._config_path = config
        self._overrides = list(overrides)
        if replicas is not None:
            self._overrides.append(f"replicas={replicas}")  # last: it wins over the config, here and in replicas
        self.shard_layers = list(shard_layers) if shard_layers is not None else None
        self.lr_intervention = lr_intervention
        self._data_seed = data_seed
        self.overlap = overlap
        self._pending: Any = None
        self.cfg: Optional[FTConfig] = None
        self.mgr: Any = None
        self.sampler: Optional[Union[FTBatchSampler, StreamLoader]] = None
        self._window: list[tuple[tuple[int, int], Any, int]] = []
        self._batch: Optional[list] = None
        """Several optimizers: [the batch's window, still ours to step]."""
        self._position: Optional[tuple[int, int]] = None
        self._schedulers: Optional[CommittedSchedulers] = None
        self._ft_devices: Optional[list[torch.device]] = None
        self.committed_in_call = 0
        self.recomputes = 0
        self._job_done = False
        self._steplog: Optional[StepLog] = None
        self._phase: dict[str, float] = {}
        self._ckpt: Any = None
        self._fit_started = False
        self._reducer: Any = None
        self.stop_agreed = False
        self._train_data: Any = None
        """(dataset, collate_fn) of the train loader: batch_policy "constant" builds absent slots'
        batches from it by sample index."""
        self._extra_losses: list[float] = []
        self._resume_point: Any = None
        self._manual_clip: Any = None
        """Manual optimization: `self.clip_gradients` deferred to the averaged gradients
        (strategy/manual_clip.py)."""
        """trainer.fit(ckpt_path=...): where the checkpoint puts the job (strategy/resume.py)."""

    # -- environment: one Lightning world per replica ---------------------------------------------------
    @property
    def rid(self) -> int:
        """This replica's id (a warm spare's: -1 until promoted in `setup`; coord/standby.py)."""
        return self.mgr.rid if self.mgr is not None else self._renv.replica_id

    @property
    def num_replicas(self) -> int:
        return self._renv.num_replicas

    @property
    def incarnation(self) -> int:
        return self.mgr.incarnation if self.mgr is not None else self._renv.incarnation

    @property
    def _module(self) -> LightningModule:
        """The LightningModule (Lightning attaches it before any hook that reads it)."""
        module = self.lightning_module
        if module is None:
            raise RuntimeError("ft_hsdp: no LightningModule is attached to the strategy")
        return module

    @property
    def parallel_devices(self) -> Optional[list[torch.device]]:
        return self._ft_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: Optional[list[torch.device]]) -> None:
        if self._renv is None:  # self-launch: W comes from Trainer(devices=...)
            self._ft_devices = list(devices) if devices else None
            return
        # The replica's size comes from the launcher (WORLD_SIZE), not from Trainer(devices=...).
        world = self._renv.world_size
        if devices and devices[0].type == "cuda":
            self._ft_devices = [torch.device("cuda", i % max(1, torch.cuda.device_count())) for i in range(world)]
        else:
            self._ft_devices = [torch.device("cpu")] * world

    @property
    def self_launching(self) -> bool:
        """No launcher started this process: the first Trainer entry point launches the job."""
        return self._renv is None

    @override
    def _configure_launcher(self) -> None:
        if self._renv is None:
            self._launcher = self._self_launcher()
        else:
            super()._configure_launcher()

    def _self_launcher(self) -> Any:
        """strategy/self_launch.py; built at Trainer(...) so that what cannot self-launch fails there."""
        import __main__

        from lightning_ft.config import ConfigError
        from lightning_ft.strategy.self_launch import (SelfLauncher, SelfLaunchError, original_cwd, run_command,
                                                       script_argv, world_from_devices)

        if self.num_nodes > 1:
            raise FTHSDPError(f"strategy='ft_hsdp' self-launch runs on one machine, but Trainer(num_nodes="
                              f"{self.num_nodes}): start one `lightning-ft run --etcd HOST:PORT --replica-ids ...` "
                              f"per node, or torchrun/srun with `lightning-ft env` (README: Multi-node)")
        cwd = original_cwd()
        spec = getattr(__main__, "__spec__", None)
        try:
            script = script_argv(sys.argv, spec.name if spec is not None else None, cwd)
            cfg = self.load_ft_config()
        except (SelfLaunchError, ConfigError) as e:
            raise FTHSDPError(str(e)) from None
        nproc = world_from_devices(self.parallel_devices)
        config = self._config_path or os.environ.get("LFT_CONFIG") or None
        command = run_command(sys.executable, script, nproc=nproc,
                              config=os.path.join(cwd, config) if config else None, overrides=self._overrides)
        run_dir = os.path.join(cwd, cfg.run_dir)

        def banner() -> str:
            return (f"lightning-ft: no launcher variables, so this process launches the job: {cfg.replicas} replicas "
                    f"x {nproc} processes of {os.path.basename(script[0])} under `lightning-ft run`, run dir "
                    f"{run_dir}; it supervises and does not train (Ctrl-C stops the job)")

        return SelfLauncher(command, cwd, banner)

    def load_ft_config(self) -> FTConfig:
        from lightning_ft.hydra import strategy_config  # LFT_CONFIG, a Hydra app's `ft:` node, overrides

        cfg = strategy_config(self._config_path, self._overrides)
        if self.lr_intervention is not None:
            cfg.lr_intervention = self.lr_intervention
        return cfg

    @override
    def setup_environment(self) -> None:
        startup.mark("script")
        world = len(self.parallel_devices or [None])
        self._data_parallel_size, self._tensor_parallel_size = world, 1
        self.cfg = self.load_ft_config()
        from lightning_ft.secret import SecretError, resolve

        try:
            self._secret = resolve(self.cfg.secret)
        except SecretError as e:
            raise FTHSDPError(f"strategy='ft_hsdp', replica {self.rid}: {e}") from None
        if self._renv.launcher == "torchrun" and not dist.is_initialized():  # Lightning then keeps this group
            from lightning_ft.launch.environment import init_torchrun_group

            init_torchrun_group(self._renv, self._get_process_group_backend(),
                                self._timeout.total_seconds() if self._timeout else 1800.0)
        super().setup_environment()
        if self._module.trainer.state.fn == TrainerFn.FITTING and not self._fit_started:
            self._fit_started = True
            replica_start.exit_if_finished(self)
        trainer: Any = self._module.trainer  # Any: Lightning's Trainer gets .callbacks undeclared (CallbackConnector)
        if not self._renv.standby:  # a spare names them once promoted (`setup`)
            lightning_compat.name_unversioned_loggers(trainer, f"replica_{self.rid}")  # each replica: its own directory
        lightning_compat.save_cli_config_once(trainer, writer=self.rid == 0 and not self._renv.standby,
                                              overwrite=self.incarnation > 0 or bool(os.environ.get("LFT_RESUME")))
        if not any(isinstance(cb, FTMetrics) for cb in trainer.callbacks):
            trainer.callbacks.append(FTMetrics(self))
        self._route_should_stop(trainer)
        from lightning_ft.callbacks.failure import FailureInjector

        failures = self.cfg.failure
        scheduled = failures.events or failures.mtbf_steps > 0 or failures.signal_exception
        if scheduled and not any(isinstance(cb, FailureInjector) for cb in trainer.callbacks):
            trainer.callbacks.append(FailureInjector())  # the job config schedules failures: inject them

    def _route_should_stop(self, trainer: Any) -> None:
        """`trainer.should_stop` becomes a job decision: a replica that sets it (user code, a
        callback, EarlyStopping) asks the job to stop (`stop` in its next report), and it reads
        True on every replica once a round carrying the request committed, so that all stop
        after the same step. Lightning itself is unchanged; the attribute is a property on a
        per-trainer subclass."""
        cls = type(trainer)
        if getattr(cls, "_ft_routes_should_stop", False):
            return
        strategy = self

        def get(tr: Any) -> bool:
            if strategy.mgr is None:
                return bool(tr.__dict__.get("_ft_should_stop", False))
            return strategy.stop_agreed

        def put(tr: Any, value: bool) -> None:
            tr.__dict__["_ft_should_stop"] = bool(value)
            if value and strategy.mgr is not None and not strategy.stop_agreed:
                strategy.mgr.request_stop = True

        trainer.__class__ = type(cls.__name__, (cls,), {"should_stop": property(get, put),
                                                          "_ft_routes_should_stop": True,
                                                          "__module__": cls.__module__})

    # -- model: FSDP2 inside the replica ----------------------------------------------------------
    @override
    def setup(self, trainer: Any) -> None:
        # ModelParallelStrategy.setup, without its demand that configure_model parallelizes.
        from lightning_ft.strategy.sharding import ShardingError, auto_shard

        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        try:
            auto_shard(self._module, self.device_mesh["data_parallel"] if self.world_size > 1 else None,
                       self.world_size, self.shard_layers)
        except ShardingError as e:
            raise FTHSDPError(str(e)) from None
        assert self.model is not None
        lightning_compat.materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            lightning_compat.optimizers_to_device(self.optimizers, self.root_device)
            if self.mgr is None:
                replica_start.start_replica(self, trainer)

    def _on_commit(self, plan: Any) -> None:
        self.committed_in_call += 1
        if self._schedulers is not None:
            mgr = self.mgr
            if mgr.multi:  # a step scheduler follows its own optimizer; epochs count batches
                self._schedulers.committed(mgr.batches, optimizer=mgr.stepped_optimizer(plan), new_batch=not plan.cont)
            else:
                self._schedulers.committed(mgr.step)
        if self.sampler is not None and hasattr(self.sampler, "committed"):
            # a stream loader records its state at the new cursor
            self.sampler.committed(self.mgr.step, self.mgr.cursor)

    # -- data: exactly-once batches -----------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self._module.trainer
        if self.mgr is None or not isinstance(dataloader, DataLoader):
            return dataloader
        if not trainer.training:
            return self._eval_loader(dataloader)
        if isinstance(dataloader.dataset, IterableDataset):
            return self._stream_loader(dataloader)
        bs = dataloader.batch_size
        if bs is None:
            raise FTHSDPError("the train DataLoader must set batch_size (per process); ft_hsdp builds the batches")
        n = self._micro_batches()
        assert self.cfg is not None and self._schedulers is not None  # set up with the manager
        seed = self._data_seed if self._data_seed is not None else int(self.cfg.seed)
        # ignore: torch's Dataset declares no __len__; a map-style dataset has one
        stream = SlotStream(len(dataloader.dataset), bs * self.world_size * n,  # type: ignore[arg-type]
                            self.num_replicas, seed=seed)
        if stream.num_samples // stream.batch_size < self.num_replicas:
            raise FTHSDPError(f"{stream.num_samples} samples make fewer than one batch of {stream.batch_size} per "
                              f"replica for {self.num_replicas} replicas")
        self.sampler = FTBatchSampler(stream, self.rid, self.global_rank, self.world_size, n,
                                      start=lambda: self.mgr.cursor)
        self._train_data = (dataloader.dataset, dataloader.collate_fn)
        self._schedulers.steps_per_epoch = self.sampler.steps_per_epoch()
        return DataLoader(dataloader.dataset, batch_sampler=self.sampler, num_workers=dataloader.num_workers,
                          collate_fn=dataloader.collate_fn, pin_memory=dataloader.pin_memory,
                          worker_init_fn=dataloader.worker_init_fn,
                          persistent_workers=dataloader.persistent_workers and dataloader.num_workers > 0,
                          multiprocessing_context=dataloader.multiprocessing_context)

    def _stream_loader(self, dataloader: DataLoader) -> object:
        """A train stream (stateful loaders over an IterableDataset): strategy/streaming.py."""
        from lightning_ft.config import loader_state_dir
        from lightning_ft.strategy.streaming import StreamDataError, stream_loader

        if self.sampler is not None and hasattr(self.sampler, "close"):
            self.sampler.close()
        try:
            self.sampler = stream_loader(dataloader, cfg=self.cfg, slot=self.rid, rank=self.global_rank,
                                         world=self.world_size, slots=self.num_replicas, micro=self._micro_batches(),
                                         cursor=lambda: self.mgr.cursor, state_root=loader_state_dir(self.cfg))
        except StreamDataError as e:
            raise FTHSDPError(str(e)) from None
        assert self._schedulers is not None  # set up with the manager
        self._schedulers.steps_per_epoch = 0
        return self.sampler

    @property
    def batch_position(self) -> Optional[tuple[int, int]]:
        """(slot batch k, micro-batch j) of the batch in training: which part of this replica's
        exactly-once stream it is (None before the first batch)."""
        return self._position

    def _eval_loader(self, dataloader: DataLoader) -> DataLoader:
        """Validation/test loaders are sharded over the live replicas, then over ranks."""
        from lightning_ft.strategy.evaluation import ShardSampler

        if isinstance(dataloader.dataset, IterableDataset) or dataloader.batch_size is None:
            return dataloader  # not shardable by index: every replica evaluates what it is given

        def shard() -> tuple[int, int, int, int]:
            i, k = self._reducer.shard()
            return i, k, self.global_rank, self.world_size

        sampler = ShardSampler(len(dataloader.dataset), shard)  # type: ignore[arg-type]  # Dataset: no __len__ declared
        return DataLoader(dataloader.dataset, batch_size=dataloader.batch_size, sampler=sampler,
                          num_workers=dataloader.num_workers, collate_fn=dataloader.collate_fn,
                          pin_memory=dataloader.pin_memory, drop_last=dataloader.drop_last,
                          worker_init_fn=dataloader.worker_init_fn,
                          multiprocessing_context=dataloader.multiprocessing_context)

    # -- evaluation and decisions across replicas --------------------------------------------------------
    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self.mgr is not None:
            from lightning_ft.strategy.evaluation import sync_metrics

            self._reducer.begin("sanity" if self._module.trainer.sanity_checking else "val")
            sync_metrics(self._module, self._reducer)  # torchmetrics objects: over the whole set

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        if self.mgr is not None:
            self._reducer.end()
            # The shards follow the live replicas, but Lightning keeps the loader (and its batch
            # count) of the first validation: with fewer replicas it would stop each shard early
            # and evaluate part of the set. Rebuild it at the next validation.
            lightning_compat.rebuild_val_loader(self._module.trainer)

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """Within the replica as ModelParallelStrategy does; during evaluation (logged metrics with
        `sync_dist=True`), also across the live replicas, so that every replica logs the same value."""
        from lightning_ft.strategy.evaluation import op_name

        out = super().reduce(tensor, group=group, reduce_op=reduce_op)
        if self.mgr is not None and self._reducer.active and isinstance(out, torch.Tensor):
            out = self._reducer.reduce(out, op_name(reduce_op))
        return out

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Over every rank of every live replica: EarlyStopping, ModelCheckpoint and friends
        decide the same on every replica at the same step."""
        if self.mgr is None:
            return super().reduce_boolean_decision(decision, all=all)
        active = self._reducer.active
        if not active:
            self._reducer.begin("decide")
        self._reducer.deciding = True
        try:
            return super().reduce_boolean_decision(decision, all=all)
        finally:
            self._reducer.deciding = False
            if not active:
                self._reducer.end()

    def _micro_batches(self) -> int:
        trainer = self._module.trainer
        return trainer.accumulate_grad_batches if self._module.automatic_optimization else 1

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.mgr is None:
            return
        if self.sampler is None or not self.sampler.tags:
            raise FTHSDPError("ft_hsdp could not tell which batch of the exactly-once stream this is: the train "
                              "loader must be the one the strategy installs (no custom data fetching)")
        self._window.append((self.sampler.tags.popleft(), batch, batch_idx))
        self._position = self._window[-1][0][:2]
        if (self.overlap and self._pending is None and len(self._window) == self._micro_batches()
                and not self.mgr.multi):  # several optimizers: which one steps first is known at its step
            # This batch's backward completes the step: run the quorum meanwhile and let the
            # gradient hooks start the exchange.
            self._pending = self.mgr.begin_step()

    # -- the step -----------------------------------------------------------------------------------
    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.mgr is None:
            return
        # Sync, catch-up and rewind rounds before any batch (no wasted compute, and accumulation
        # or manual optimization never trains on stale weights).
        if self._resume_point is not None:  # the job continues at the checkpoint's step, from one state
            from lightning_ft.strategy.resume import ResumeError, begin

            try:
                begin(self.mgr, self._resume_point, self.mgr.broadcast)
            except ResumeError as e:
                raise FTHSDPError(str(e)) from None
            self._resume_point = None
        t0 = time.perf_counter()
        res = self.mgr.prepare()
        self._set_lightning_step(self.mgr.step, in_batch=False)
        if res.committed or res.synced:
            self._log_step(None, True, time.perf_counter() - t0)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self.mgr is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        auto = self._module.automatic_optimization
        cont, index = False, 0
        if self.mgr.multi:
            index = next(i for i, o in enumerate(self.optimizers) if o is optimizer)
            window, cont = self._batch_window()
            if window is None:  # the rest of a batch the job trained without us: nothing to step
                self._set_lightning_step(self.mgr.step - 1)
                return None
        else:
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
        pending, self._pending = self._pending, None
        loss, computed = None, not auto  # manual optimization: the user's backward already ran
        if pending is not None and auto:  # forward/backward overlap the quorum; hooks send buckets
            loss, computed = closure(), True
            self._phase["closure_ms"] = (time.perf_counter() - t0) * 1e3
        t1 = time.perf_counter()

        def after_exchange() -> None:  # hooks and clipping on the averaged gradients, identically everywhere
            if self._manual_clip is not None:  # where the training_step asked, as under DDP: before the hooks
                self._manual_clip.apply(index, optimizer)
            lightning_compat.after_closure(self.precision_plugin, self.lightning_module, optimizer)

        self._extra_losses = []
        res = self.mgr.run_step(lambda plan: closure(), batch=None if cont else k, pending=pending, computed=computed,
                                loss=loss,
                                recompute=(lambda plan: self._recompute(window, closure, optimizer)) if auto else None,
                                after_exchange=after_exchange,
                                extra=((lambda plan: self._train_extra(plan, optimizer, window[-1][2])) if auto
                                       else None),
                                phase=(index, cont) if self.mgr.multi else None)
        if self.mgr.multi and not res.trained:
            assert self._batch is not None  # _batch_window set it (no window otherwise)
            self._batch[1] = False  # others trained this batch, or its rest: skip its remaining steps
        if self._manual_clip is not None:
            self._manual_clip.stepped(index, res.trained)
        self._phase["step_ms"] = (time.perf_counter() - t1) * 1e3
        if res.trained and self._extra_losses and res.loss is not None:  # the mean over the slots we trained
            res.loss = (float(res.loss) + sum(self._extra_losses)) / (1 + len(self._extra_losses))
        if res.stale:  # a rewind moved the slot's cursor back: restart the loader there
            assert self.sampler is not None  # on_train_batch_start checked it
            self.sampler.restart()
        plan = self.mgr.last_plan
        if plan is not None and plan.quorum.stop and res.committed:
            self.stop_agreed = True  # the job decided to stop at this step: every replica stops now
            self._module.trainer.should_stop = True
        if auto and not res.trained and not computed:  # Lightning still wants the closure's result
            closure()
            optimizer.zero_grad(set_to_none=True)
        self._set_lightning_step(self.mgr.step - 1)  # Lightning adds the one it thinks it made
        if self._ckpt is not None:
            self._ckpt.maybe_save(self.lightning_module, self.mgr.optimizer, self._schedulers,
                                  self.committed_in_call, self.global_rank)
            self._phase["ckpt_stage_ms"] = self._ckpt.stage_ms
        self._log_step(res.loss, res.caught_up or res.synced, time.perf_counter() - t0)
        return None

    def _batch_window(self) -> tuple[Optional[list], bool]:
        """Several optimizers: (the batch's window, whether this step continues the batch); the
        window is None once the job trained the batch (or its rest) without us."""
        if self._window:  # the batch's first optimizer step
            self._batch = [self._window, True]
            self._window = []
            return self._batch[0], False
        if self._batch is None:
            return [], False
        window, live = self._batch
        return (window, True) if live else (None, True)

    def _log_step(self, loss: Any, caught_up: bool, seconds: float) -> None:
        if self.global_rank == 0 and self._steplog is not None:
            self._steplog.write(self.mgr, loss, caught_up, seconds, self._phase)

    def _clip_catchup(self) -> None:
        """A catch-up's optimizer step: clip the averaged gradients as the contributors did in
        `_after_closure` (Lightning's clipping and the module's configure_gradient_clipping),
        but run none of the on_before_optimizer_step hooks: a late replica runs no user hook.
        Manual optimization: the clip the contributors' training_step asked for that optimizer
        at its last committed step (strategy/manual_clip.py)."""
        if self._manual_clip is not None:
            opt = self.mgr.stepped_optimizer()
            self._manual_clip.catch_up(self._manual_clip.index(opt), opt)
            return
        module = self._module
        trainer = module.trainer
        lightning_compat.clip_as_configured(self.precision_plugin, module, self.mgr.stepped_optimizer(),
                                            trainer.gradient_clip_val, trainer.gradient_clip_algorithm)

    def _recompute(self, window: list, closure: Callable[[], Any], optimizer: Any) -> Any:
        """Redo the window's forward/backward on the caught-up weights (automatic optimization)."""
        self.recomputes += 1
        optimizer.zero_grad(set_to_none=True)
        n = len(window)
        for _, batch, batch_idx in window[:-1]:
            out: Any = self.training_step(batch, batch_idx)  # under automatic optimization: the loss, or a dict with it
            loss = out["loss"] if isinstance(out, dict) else out
            self.backward(loss / n, optimizer)
        return closure()

    def _train_extra(self, plan: Any, optimizer: Any, batch_idx: int) -> None:
        """batch_policy "constant": forward and backward of the absent slots' batches assigned to
        this replica (`plan.extra`), built from the train dataset by sample index in this rank's
        micro-batches; their gradients add to those of our own batch."""
        dataset, collate = self._train_data
        n = self._micro_batches()
        self._extra_losses = []
        assert isinstance(self.sampler, FTBatchSampler)  # _train_data is set with it (map-style data)
        for slot, k in plan.extra:
            total = 0.0
            for ids in self.sampler.micro_batches(slot, k):
                batch = self.batch_to_device(collate([dataset[i] for i in ids]))
                out: Any = self.training_step(batch, batch_idx)  # the loss, or a dict with it
                loss = out["loss"] if isinstance(out, dict) else out
                self.backward(loss / n, optimizer)
                total += float(loss.detach())
            self._extra_losses.append(total / n)

    def _set_lightning_step(self, n: int, in_batch: bool = True) -> None:
        """Lightning's counters from the job: `n` optimizer steps (Lightning adds the one it
        thinks it made), and batch and epoch progress from the committed count, so that every
        replica, restarted ones included, is at the same epoch and batch position and runs
        validation, epoch ends and `max_epochs` at the same committed steps. An epoch is one
        pass of the slot streams (`steps_per_epoch` committed steps) for the whole job."""
        module = self._module
        spe = self.sampler.steps_per_epoch() if self.sampler is not None else 0
        if not spe:
            lightning_compat.set_progress(module.trainer, module.automatic_optimization, n)
            return
        done = self.mgr.batches if self.mgr.multi else self.mgr.step  # committed batches
        micro = self._micro_batches()
        pos = done % spe if done % spe or done == 0 else spe  # position within the job's epoch
        lag = 1 if in_batch else 0  # inside a batch, Lightning increments processed/completed after us
        lightning_compat.set_progress(module.trainer, module.automatic_optimization, n,
                                      batches=(done * micro, pos * micro, lag), epoch=(done - 1) // spe if done else 0)

    def metrics(self) -> dict[str, float]:
        return metrics(self.mgr, self.num_replicas)

    # -- side effects: one writer, clear failures, clean exit ------------------------------------------
    @property
    def is_checkpoint_writer(self) -> bool:
        """The lowest-id contributor of the last round writes (and prunes) checkpoints."""
        plan = self.mgr.last_plan if self.mgr is not None else None
        if plan is None:
            return self.mgr is None or self.rid == 0
        return self.rid == min(plan.quorum.contributors)

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        if self.is_checkpoint_writer:
            if self.mgr is not None and self.mgr.last_plan is not None and self.global_rank == 0:
                from lightning_ft.strategy.resume import KEY, describe

                checkpoint[KEY] = describe(self.mgr)  # the job's data position, for fit(ckpt_path=...)
            super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict:
        """A `.ckpt` file (any strategy's, DDP's included) or a distributed checkpoint directory;
        under fit, the job then continues at its step (strategy/resume.py)."""
        from lightning_ft.strategy.resume import ResumeError, load, point_of

        try:
            checkpoint = load(self, checkpoint_path, weights_only,
                              lambda: super(FTHSDPStrategy, self).load_checkpoint(checkpoint_path, weights_only))
            if self.mgr is not None and self._module.trainer.state.fn == TrainerFn.FITTING:
                self._resume_point = point_of(checkpoint, self.num_replicas, str(checkpoint_path))
        except ResumeError as e:
            raise FTHSDPError(str(e)) from None
        return checkpoint

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_checkpoint_writer:
            super().remove_checkpoint(filepath)

    @override
    def on_exception(self, exception: BaseException) -> None:
        from lightning_ft.coord.coordinator import ConfigMismatch, Evicted, JobFinished, JobHalted, QuorumTimeout
        from lightning_ft.coord.store import StoreError
        from lightning_ft.ftar.transport.base import FatalError
        from lightning_ft.replica.manager import ReplicaStateLost, StaleManualStep

        if isinstance(exception, JobFinished):  # a late replica: leave before any user hook runs
            print(f"lightning-ft: replica {self.rid}: {exception}", file=sys.stderr, flush=True)
            self._close()
            sys.stdout.flush()
            os._exit(0)
        hint = {
            JobHalted: "the job stopped: every replica exits; the launcher does not restart them",
            Evicted: "this replica was evicted (declared failed by the others); the launcher restarts it",
            ReplicaStateLost: "the launcher restarts this replica, which then catches up from a healthy one",
            StaleManualStep: "the launcher restarts this replica, which then catches up before its first batch",
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
        if isinstance(exception, JobHalted) and self.mgr is not None:
            if self._ckpt is not None:  # a checkpoint still being written must not outlive the verdict
                self._ckpt.close()
            self.mgr.on_halt()
            self._close()
            sys.stderr.flush()
            os._exit(ExitCode.HALTED)
        self._close()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self.mgr is not None and not self._job_done:
            self.mgr.mark_finished()
            write_final(self.mgr, self._module, self.mgr.optimizer, self.global_rank, self.recomputes)

    def _close(self) -> None:
        if self.sampler is not None and hasattr(self.sampler, "close"):
            self.sampler.close()  # the last loader states reach their files
        if self._ckpt is not None:
            self._ckpt.close()
            self._ckpt = None
        if self._steplog is not None:
            self._steplog.close()
            self._steplog = None
        if self.mgr is not None:
            try:
                self.mgr.close()
            finally:
                self.mgr = None

    @override
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
startup.mark("lightning")  # with Lightning: this module imports it
