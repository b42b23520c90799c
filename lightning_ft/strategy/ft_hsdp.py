"""`FTHSDPStrategy`: fault-tolerant HSDP as a Lightning strategy (docs/ARCHITECTURE.md, "Lightning glue").

One Lightning "world" is one replica: W processes running FSDP2 over their own process group
(Lightning's `ModelParallelStrategy`, gloo on CPU). Across replicas the framework-free `Replica`
(replica/replica.py) runs each optimizer step with its caller: `LightningStep` (stepping.py, the
step in progress as one typed object) answers what the replica asks (compute, recompute, extra
micro-batches, clip, the books of a commit) and reads its `StepResult`. This class adapts
Lightning's hooks and holds the Lightning-side parts the step uses (the exactly-once loader, the
committed schedulers, checkpoints, the run log, the cross-replica reducer); the other modules
build or serve them: replica_start.py (config, a finished job's late replica, sharding, the
replica), loaders.py (the exactly-once train loader, sharded evaluation), evaluation.py (metrics
and decisions across replicas), resume.py (`fit(ckpt_path=...)`), replica_end.py (exceptions, a
halt, closing in order, the one exit), self_launch.py (`python train.py` without a launcher).
Every Lightning private, run-time class swaps included, is reached through lightning_compat.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_ft.config import FTConfig
from lightning_ft.replica import startup
from lightning_ft.strategy import evaluation, loaders, replica_end, replica_start
from lightning_ft.strategy.environment import launched_replica
from lightning_ft.strategy.errors import FTHSDPError
from lightning_ft.strategy.runlog import StepLog, metrics, write_final
from lightning_ft.strategy.sampler import FTBatchSampler
from lightning_ft.strategy.schedulers import CommittedSchedulers

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule

    from lightning_ft.replica.replica import Replica
    from lightning_ft.strategy.checkpoints import ReplicaCheckpoints
    from lightning_ft.strategy.evaluation import CrossReplicaReducer
    from lightning_ft.strategy.manual_clip import DeferredClip
    from lightning_ft.strategy.stepping import LightningStep
    from lightning_ft.strategy.streaming import StreamLoader


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
        self.renv: Any = launched_replica()  # fail at Trainer(...) with how to launch, not deep inside fit()
        super().__init__(**kwargs)
        if self.renv is not None:
            self.cluster_environment = ReplicaEnvironment(self.renv)
        self.secret = ""
        self._config_path = config
        self._overrides = list(overrides)
        if replicas is not None:
            self._overrides.append(f"replicas={replicas}")  # last: it wins over the config, here and in replicas
        self.shard_layers = list(shard_layers) if shard_layers is not None else None
        self.lr_intervention = lr_intervention
        self.data_seed = data_seed
        self.overlap = overlap
        self.cfg: Optional[FTConfig] = None
        self.replica: Optional[Replica] = None
        """This rank's replica (replica/replica.py), once `setup` started it."""
        self.stepper: Optional[LightningStep] = None
        """The optimizer step in progress and its talk with the replica (stepping.py)."""
        self.sampler: Optional[Union[FTBatchSampler, StreamLoader]] = None
        """The exactly-once train loader (loaders.py)."""
        self.schedulers: Optional[CommittedSchedulers] = None
        """LR schedulers stepped by committed steps (schedulers.py)."""
        self.ckpt: Optional[ReplicaCheckpoints] = None
        """Persistent checkpoints every `checkpoint.every_n_steps` (checkpoints.py)."""
        self.steplog: Optional[StepLog] = None
        self.reducer: Optional[CrossReplicaReducer] = None
        """Evaluation metrics and decisions across the live replicas (evaluation.py)."""
        self.manual_clip: Optional[DeferredClip] = None
        """Manual optimization: `clip_gradients` on the averaged gradients (manual_clip.py)."""
        self.train_data: Any = None
        """(dataset, collate_fn): batch_policy "constant" and shrink build other slots' batches."""
        self.resume_point: Any = None
        """fit(ckpt_path=...): where the checkpoint puts the job (resume.py), begun at train start."""
        self._ft_devices: Optional[list[torch.device]] = None
        self.job_done = self.fit_started = False

    # -- environment: one Lightning world per replica ---------------------------------------------------
    @property
    def rid(self) -> int:
        """This replica's id (a warm spare's: -1 until promoted in `setup`; coord/standby.py)."""
        return self.replica.rid if self.replica is not None else self.renv.replica_id

    @property
    def num_replicas(self) -> int:
        return self.renv.num_replicas

    @property
    def incarnation(self) -> int:
        return self.replica.incarnation if self.replica is not None else self.renv.incarnation

    @property
    def module(self) -> LightningModule:
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
        if self.renv is None:  # self-launch: W comes from Trainer(devices=...)
            self._ft_devices = list(devices) if devices else None
            return
        # The replica's size comes from the launcher (WORLD_SIZE), not from Trainer(devices=...).
        world = self.renv.world_size
        if devices and devices[0].type == "cuda":
            self._ft_devices = [torch.device("cuda", i % max(1, torch.cuda.device_count())) for i in range(world)]
        else:
            self._ft_devices = [torch.device("cpu")] * world

    @property
    def self_launching(self) -> bool:
        """No launcher started this process: the first Trainer entry point launches the job."""
        return self.renv is None

    @override
    def _configure_launcher(self) -> None:
        if self.renv is None:
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
        self._data_parallel_size, self._tensor_parallel_size = len(self.parallel_devices or [None]), 1
        replica_start.load_config(self)
        super().setup_environment()
        replica_start.install(self)

    @override
    def setup(self, trainer: Any) -> None:
        replica_start.setup_model(self, trainer)  # FSDP2 inside the replica, then the replica layer

    # -- data: exactly-once batches -----------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        return loaders.train_loader(self, dataloader)

    @property
    def batch_position(self) -> Optional[tuple[int, int]]:
        """(slot batch k, micro-batch j) of the batch in training: which part of this replica's
        exactly-once stream it is (None before the first batch)."""
        return self.stepper.st.position if self.stepper is not None else None

    # -- evaluation and decisions across replicas --------------------------------------------------------
    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self.replica is not None:
            evaluation.begin_validation(self)

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        if self.replica is not None:
            evaluation.end_validation(self)

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """Within the replica as ModelParallelStrategy does; during evaluation (logged metrics with
        `sync_dist=True`), also across the live replicas, so that every replica logs the same value."""
        out = super().reduce(tensor, group=group, reduce_op=reduce_op)
        if self.reducer is not None and self.reducer.active and isinstance(out, torch.Tensor):
            out = self.reducer.reduce(out, evaluation.op_name(reduce_op))
        return out

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Over every rank of every live replica: EarlyStopping, ModelCheckpoint and friends
        decide the same on every replica at the same step."""
        ask = lambda: super(FTHSDPStrategy, self).reduce_boolean_decision(decision, all=all)  # noqa: E731
        return ask() if self.reducer is None else evaluation.decide(self.reducer, ask)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.stepper is not None:
            self.stepper.batch_start(batch, batch_idx)

    # -- the step -----------------------------------------------------------------------------------
    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.stepper is not None:
            self.stepper.on_train_start()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        step = lambda: super(FTHSDPStrategy, self).training_step(*args, **kwargs)  # noqa: E731
        return step() if self.stepper is None else self.stepper.training_step(step)

    @override
    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if self.stepper is not None and self.stepper.skip_backward():  # a micro-batch we give away ("shrink")
            return closure_loss
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self.stepper is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        return self.stepper.optimizer_step(optimizer, closure)

    def stop_decision(self, trainer: Any) -> Optional[bool]:
        """`trainer.should_stop` under ft_hsdp: True once the job agreed to stop at a step this
        replica committed, on every replica at the same step (None before the replica exists)."""
        return self.stepper.stop_agreed if self.stepper is not None else None

    def ask_stop(self) -> None:
        """A replica that sets `trainer.should_stop` (user code, a callback, EarlyStopping) asks the
        job to stop: `stop` in its next report, until a round carries it."""
        if self.replica is not None and self.stepper is not None and not self.stepper.stop_agreed:
            self.replica.request_stop = True

    def metrics(self) -> dict[str, float]:
        return metrics(self.replica, self.num_replicas)

    # -- side effects: one writer, clear failures, clean exit ------------------------------------------
    @property
    def is_checkpoint_writer(self) -> bool:
        """The lowest-id contributor of the last round writes (and prunes) checkpoints."""
        last = self.stepper.last if self.stepper is not None else None
        if last is None:
            return self.replica is None or self.rid == 0
        return last.writer

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        if self.is_checkpoint_writer:
            last = self.stepper.last if self.stepper is not None else None
            if self.replica is not None and last is not None and last.role and self.global_rank == 0:
                from lightning_ft.strategy.resume import KEY, describe

                checkpoint[KEY] = describe(self.replica)  # the job's data position, for fit(ckpt_path=...)
            super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict:
        """A `.ckpt` file (any strategy's, DDP's included) or a distributed checkpoint directory;
        under fit, the job then continues at its step (strategy/resume.py)."""
        from lightning_ft.strategy.resume import load_into

        return load_into(self, checkpoint_path, weights_only,
                         lambda: super(FTHSDPStrategy, self).load_checkpoint(checkpoint_path, weights_only))

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
        if self.replica is not None and self.stepper is not None and not self.job_done:
            self.replica.mark_finished()
            write_final(self.replica, self.module, self.replica.optimizer, self.global_rank, self.stepper.recomputes)

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
