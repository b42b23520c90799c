"""`FTHSDPStrategy`: fault-tolerant HSDP as a Lightning strategy (docs/ARCHITECTURE.md, "Lightning glue").

One Lightning "world" is one replica: W processes running FSDP2 over their own process
group (Lightning's `ModelParallelStrategy`, gloo on CPU). Across replicas nothing is a
torch.distributed collective: the framework-free `ReplicaManager` owns the whole step
(quorum, catch-up, sync and rewind rounds, the FTAR exchange, the two-phase commit,
retries). This class only adapts Lightning's hooks to it; each hook's work is in a module of
its own, functions over the strategy:

- replica_start.py: a finished job's late replica leaves; the replica layer is built and started;
- stepping.py: `on_train_start` (`mgr.prepare()`: sync / catch-up / rewind before the first
  batch), `optimizer_step` (`mgr.run_step(closure, ...)`, then Lightning's counters from the
  committed step count, the checkpoint, the run log), the stop decision;
- loaders.py: the exactly-once train loader, sharded evaluation loaders;
- replica_end.py: exceptions explained, a halt's exit, closing in order;
- self_launch.py: `python train.py` without a launcher.

`on_train_batch_start` stays here: the exactly-once loader's tag of the batch, and `begin_step`
(the round's quorum overlaps forward/backward; backward hooks send gradient buckets). Side jobs:
schedulers.py (schedulers stepped once per committed step), sharding.py (auto `fully_shard`),
checkpoints.py (persistent checkpoints), runlog.py (steps.jsonl, final.json, metrics),
sampler.py (the exactly-once batch sampler), streaming.py (stream loaders over an
IterableDataset: split, loader states, resume).
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_ft.config import FTConfig
from lightning_ft.replica import startup
from lightning_ft.strategy import lightning_compat, loaders, replica_end, replica_start, stepping
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
            from lightning_ft.strategy.self_launch import launcher_for

            self._launcher = launcher_for(self)
        else:
            super()._configure_launcher()

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
        stepping.route_should_stop(self, trainer)
        from lightning_ft.callbacks.failure import FailureInjector

        failures = self.cfg.failure
        scheduled = failures.events or failures.mtbf_steps > 0 or failures.signal_exception
        if scheduled and not any(isinstance(cb, FailureInjector) for cb in trainer.callbacks):
            trainer.callbacks.append(FailureInjector())  # the job config schedules failures: inject them

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

    # -- data: exactly-once batches -----------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        return loaders.train_loader(self, dataloader)

    @property
    def batch_position(self) -> Optional[tuple[int, int]]:
        """(slot batch k, micro-batch j) of the batch in training: which part of this replica's
        exactly-once stream it is (None before the first batch)."""
        return self._position

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
        if (self.overlap and self._pending is None and len(self._window) == stepping.micro_batches(self)
                and not self.mgr.multi):  # several optimizers: which one steps first is known at its step
            # This batch's backward completes the step: run the quorum meanwhile and let the
            # gradient hooks start the exchange.
            self._pending = self.mgr.begin_step()

    # -- the step -----------------------------------------------------------------------------------
    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.mgr is not None:
            stepping.on_train_start(self)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self.mgr is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        return stepping.optimizer_step(self, optimizer, closure)

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
        replica_end.on_exception(self, exception)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self.mgr is not None and not self._job_done:
            self.mgr.mark_finished()
            write_final(self.mgr, self._module, self.mgr.optimizer, self.global_rank, self.recomputes)

    @override
    def teardown(self) -> None:
        replica_end.close(self)
        super().teardown()


def register(registry: Any = None) -> None:
    if registry is None:
        from lightning.pytorch.strategies import StrategyRegistry as registry
    if FTHSDPStrategy.strategy_name not in registry:
        registry.register(FTHSDPStrategy.strategy_name, FTHSDPStrategy,
                          description="fault-tolerant HSDP: FSDP2 per replica, FTAR + per-step quorum across replicas")


register()
startup.mark("lightning")  # with Lightning: this module imports it
