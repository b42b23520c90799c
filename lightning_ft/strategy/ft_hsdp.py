"""`FTHSDPStrategy`: fault-tolerant HSDP as a Lightning strategy (docs/ARCHITECTURE.md, "Lightning glue").

One Lightning "world" is one replica: W processes running FSDP2 over their own process group
(Lightning's `ModelParallelStrategy`, gloo on CPU). Across replicas the framework-free
`ReplicaManager` owns the whole step (quorum, catch-up, sync and rewind rounds, the FTAR
exchange, the two-phase commit, retries); its `StepResult` says what a step did. This class
only adapts Lightning's hooks; each hook's work is in a module of its own, functions over the
strategy: replica_start.py (config, a finished job's late replica, sharding, the replica layer),
stepping.py (`on_train_start`, `optimizer_step`, Lightning's counters), loaders.py (the
exactly-once train loader, sharded evaluation), evaluation.py (metrics and decisions across
replicas), resume.py (`fit(ckpt_path=...)`), replica_end.py (exceptions, a halt, closing in
order), self_launch.py (`python train.py` without a launcher). Every Lightning private is
reached through lightning_compat.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_ft.config import FTConfig
from lightning_ft.replica import startup
from lightning_ft.replica.plan import StepResult
from lightning_ft.strategy import evaluation, loaders, replica_end, replica_start, stepping
from lightning_ft.strategy.environment import launched_replica
from lightning_ft.strategy.errors import FTHSDPError
from lightning_ft.strategy.runlog import StepLog, metrics, write_final
from lightning_ft.strategy.sampler import FTBatchSampler
from lightning_ft.strategy.schedulers import CommittedSchedulers

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule

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
        self._renv: Any = launched_replica()  # fail at Trainer(...) with how to launch, not deep inside fit()
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
        self.cfg: Optional[FTConfig] = None
        self.mgr: Any = None
        self.last: Optional[StepResult] = None
        """What the replica layer's last `prepare`/`run_step` did: the glue reads nothing else."""
        self.sampler: Optional[Union[FTBatchSampler, StreamLoader]] = None
        self._pending: Any = None  # the overlapped round's quorum (begin_step)
        self._window: list[tuple[tuple[int, int], Any, int]] = []  # the accumulation window's batches
        self._batch: Optional[list] = None  # several optimizers: [the batch's window, still ours to step]
        self._position: Optional[tuple[int, int]] = None
        self._schedulers: Optional[CommittedSchedulers] = None
        self._ft_devices: Optional[list[torch.device]] = None
        self.committed_in_call = self.recomputes = 0
        self._job_done = self._fit_started = self.stop_agreed = False
        self._steplog: Optional[StepLog] = None
        self._phase: dict[str, float] = {}
        self._ckpt: Any = None
        self._reducer: Any = None
        self._train_data: Any = None  # (dataset, collate_fn): batch_policy "constant" builds absent slots' batches
        self._extra_losses: list[float] = []
        self._own_done: set[int] = set()  # micro-batches of our slot batch whose gradients we hold
        self._skip: set[int] = set()  # micro-batches of our slot batch we give away (a shrunk straggler)
        self._skipped = self._direct = False  # a given-away micro-batch's backward; a call outside the loop
        self._resume_point: Any = None  # fit(ckpt_path=...): where the checkpoint puts the job (resume.py)
        self._manual_clip: Any = None  # manual optimization: clip_gradients on the averaged gradients

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
        return self._position

    # -- evaluation and decisions across replicas --------------------------------------------------------
    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self.mgr is not None:
            evaluation.begin_validation(self)

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        if self.mgr is not None:
            evaluation.end_validation(self)

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """Within the replica as ModelParallelStrategy does; during evaluation (logged metrics with
        `sync_dist=True`), also across the live replicas, so that every replica logs the same value."""
        out = super().reduce(tensor, group=group, reduce_op=reduce_op)
        if self.mgr is not None and self._reducer.active and isinstance(out, torch.Tensor):
            out = self._reducer.reduce(out, evaluation.op_name(reduce_op))
        return out

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Over every rank of every live replica: EarlyStopping, ModelCheckpoint and friends
        decide the same on every replica at the same step."""
        ask = lambda: super(FTHSDPStrategy, self).reduce_boolean_decision(decision, all=all)  # noqa: E731
        return ask() if self.mgr is None else evaluation.decide(self._reducer, ask)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.mgr is not None:
            stepping.batch_start(self, batch, batch_idx)

    # -- the step -----------------------------------------------------------------------------------
    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.mgr is not None:
            stepping.on_train_start(self)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        step = lambda: super(FTHSDPStrategy, self).training_step(*args, **kwargs)  # noqa: E731
        return stepping.training_step(self, step)

    @override
    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if self._skipped:  # a micro-batch this replica gives away (stragglers policy "shrink")
            self._skipped = False
            return closure_loss
        return super().backward(closure_loss, optimizer, *args, **kwargs)

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
        if self.last is None:
            return self.mgr is None or self.rid == 0
        return self.last.writer

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        if self.is_checkpoint_writer:
            if self.last is not None and self.last.role and self.global_rank == 0:
                from lightning_ft.strategy.resume import KEY, describe

                checkpoint[KEY] = describe(self.mgr)  # the job's data position, for fit(ckpt_path=...)
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
