"""`Fabric(strategy="ft_hsdp")`: fault-tolerant HSDP for Fabric loops (docs/ARCHITECTURE.md, "Fabric").

One Fabric world is one replica of W processes (FSDP2 over its own process group, as
ModelParallelStrategy); across replicas the replica layer runs every `optimizer.step()`
(fabric/replica.py, the one place that calls it). What each Fabric call does here:

- `fabric.launch()`: started without launcher variables, the program launches its job, as
  `python train.py` does for the Trainer (`lightning-ft run`; strategy/self_launch.py);
- `setup_module` / `setup`: FSDP2 inside the replica (strategy/sharding.py); `setup_optimizers`
  builds and starts the replica layer;
- `setup_dataloaders`: the first loader is the train loader, exactly once over the slots
  (fabric/loader.py); the others are evaluation loaders, split over the replica's ranks;
- the first train batch, or `fabric.load`, brings the replica to the job's state (`prepare`);
- `fabric.backward`, `no_backward_sync`: as ModelParallelStrategy; `clip_gradients`: recorded,
  applied to the averaged gradients (fabric/clip.py);
- `optimizer.step()`: one step of the protocol (quorum, exchange, two-phase commit, retry);
- `all_reduce`, `all_gather`: over every rank of every live replica; `barrier`, `broadcast`:
  within the replica (a dead replica must never hold the others);
- `fabric.save`: the writer replica writes; `fabric.load`: a restarted or late replica takes
  the live job's model, optimizer and loop state (fabric/loop_state.py);
- the end of the main thread ends the replica: the job is finished if the loop returned.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.strategy import Strategy
from typing_extensions import override

from lightning_ft.fabric import checkpoints, compat
from lightning_ft.fabric.clip import DeferredClip, local_norm
from lightning_ft.fabric.join import FTFabricError, Join
from lightning_ft.fabric.loader import TrainLoader
from lightning_ft.fabric.loop_state import LoopState
from lightning_ft.replica import startup
from lightning_ft.strategy.environment import ReplicaEnvironment, launched_replica

class FTHSDPStrategy(ModelParallelStrategy):
    """Fault-tolerant HSDP for Fabric: FSDP2 inside a replica, FTAR and a per-step quorum across replicas.

    Args:
        config: YAML config path (default: `$LFT_CONFIG`, written by `lightning-ft run`).
        overrides: Hydra-style `key=value` overrides of the job config.
        shard_layers: module classes (or names) to `fully_shard` (default: the members of every
            `nn.ModuleList`, then each top-level child with parameters).
        data_seed: seed of the exactly-once data order (default: config `seed`).
        replicas: R (overrides config `replicas`).

    `fabric.world_size` is the job's R·W and `fabric.global_rank` is replica·W + rank, so that a
    loop dividing a token budget by the world size trains the job's budget.
    """

    strategy_name = "ft_hsdp"

    def __init__(self, config: Optional[str] = None, overrides: Sequence[str] = (),
                 shard_layers: Optional[Sequence[Union[type, str]]] = None, data_seed: Optional[int] = None,
                 replicas: Optional[int] = None, **kwargs: Any) -> None:
        if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
            raise FTFabricError(f"FTHSDPStrategy(replicas={replicas!r}): R must be an integer >= 1")
        self._renv: Any = launched_replica()
        if self._renv is not None and self._renv.standby:
            raise FTFabricError("warm spares (lightning-ft run --standby) do not run Fabric programs yet; start the "
                                "job without --standby")
        kwargs.setdefault("parallelize_fn", self._shard)
        super().__init__(**kwargs)
        if self._renv is not None:
            self.cluster_environment = ReplicaEnvironment(self._renv)
        self._config_path = config
        self._overrides = list(overrides) + ([f"replicas={replicas}"] if replicas is not None else [])
        self.shard_layers = list(shard_layers) if shard_layers is not None else None
        self._data_seed = data_seed
        self._ft_devices: Optional[list[torch.device]] = None
        self.cfg: Any = None
        self._secret = ""
        self._group: Any = None
        self._model: Optional[torch.nn.Module] = None
        self._optimizer: Any = None
        self.replica: Any = None
        """The replica layer (fabric/replica.py::FabricReplica), from `setup_optimizers` on."""
        self.train_loader: Optional[TrainLoader] = None
        self._loop: Optional[LoopState] = None
        self._clip = DeferredClip(lambda: self.precision.main_params(self._optimizer))
        self._window: list[int] = []  # micro-batches delivered since the last step
        self._micro: Optional[int] = None  # micro-batches per step
        self._next: Optional[int] = None  # the next micro-batch of the slot stream
        self._loss: Any = None
        self._prepared = self._trained = self._ended = False
        self._failed = False  # an exception left the replica layer: the loop did not end
        self._steplog: Any = None
        self._dir = ""
        """Where the job's Fabric files live: loop states, micro.json, saved.json (checkpoints.py)."""

    # -- who and where: one Fabric world per replica, the job's size outside ------------------------
    @property
    def replica_world(self) -> int:
        """W, the processes of this replica."""
        return self.cluster_environment.world_size() if self.cluster_environment is not None else 1

    @property
    def replica_rank(self) -> int:
        return self.cluster_environment.global_rank() if self.cluster_environment is not None else 0

    @property
    def num_replicas(self) -> int:
        return int(self.cfg.replicas) if self.cfg is not None else (self._renv.num_replicas if self._renv else 1)

    @property
    @override
    def world_size(self) -> int:
        if self._renv is None:
            return super().world_size
        return self._renv.num_replicas * self.replica_world

    @property
    @override
    def global_rank(self) -> int:
        if self._renv is None:
            return super().global_rank
        return self._renv.replica_id * self.replica_world + self.replica_rank

    @property
    def parallel_devices(self) -> Optional[list[torch.device]]:
        return self._ft_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: Optional[list[torch.device]]) -> None:
        if self._renv is None:  # self-launch: W comes from Fabric(devices=...)
            self._ft_devices = list(devices) if devices else None
            return
        world = self._renv.world_size
        if devices and devices[0].type == "cuda":
            self._ft_devices = [torch.device("cuda", i % max(1, torch.cuda.device_count())) for i in range(world)]
        else:
            self._ft_devices = [torch.device("cpu")] * world

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Evaluation loaders are split over the replica's ranks (each replica evaluates the whole set)."""
        return {"num_replicas": self.replica_world, "rank": self.replica_rank}

    @override
    def _configure_launcher(self) -> None:
        if self._renv is None:
            from lightning_ft.strategy.self_launch import launcher_for

            self._launcher = launcher_for(self)  # type: ignore[arg-type]  # it reads what both strategies have

    def load_ft_config(self) -> Any:
        from lightning_ft.hydra import strategy_config

        return strategy_config(self._config_path, self._overrides)

    # -- the replica's start ------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        from lightning_ft.fabric.join import directory
        from lightning_ft.secret import SecretError, resolve

        startup.mark("script")
        self.cfg = self.load_ft_config()
        try:
            self._secret = resolve(self.cfg.secret)
        except SecretError as e:
            raise FTFabricError(f"strategy='ft_hsdp', replica {self._renv.replica_id}: {e}") from None
        if self.cfg.batch_policy == "constant":
            raise FTFabricError("batch_policy=constant trains absent replicas' batches, which a Fabric loop cannot "
                                "be asked to do; use batch_policy=shrink (the default)")
        if self._renv.launcher == "torchrun" and not dist.is_initialized():
            from lightning_ft.launch.environment import init_torchrun_group

            init_torchrun_group(self._renv, self._get_process_group_backend(),
                                self._timeout.total_seconds() if self._timeout else 1800.0)
        Strategy.setup_environment(self)  # the device; ModelParallelStrategy's mesh is the job's size
        self._setup_distributed()
        if self.replica_world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            self._device_mesh = init_device_mesh(self.root_device.type, (self.replica_world,),
                                                 mesh_dim_names=("data_parallel",))
            self._group = dist.new_group(backend="gloo")  # the replica layer's, apart from FSDP2's
        self._dir = directory(self.cfg)
        self._exit_if_finished()
        compat.at_main_exit(self._at_exit)

    def _exit_if_finished(self) -> None:
        """A replica (re)started after the job finished leaves before the loop runs."""
        from lightning_ft.replica.catchup.ending import finished_record

        done = None
        if self.replica_rank == 0:
            env = self._renv
            done = finished_record(self.cfg.etcd, env.job, env.etcd, self._secret, env.run_id)
        done = self._in_replica(done)
        if done is not None:
            if self.replica_rank == 0:
                print(f"lightning-ft: replica {self._renv.replica_id}: the job already finished ({done}); nothing to "
                      "train", file=sys.stderr, flush=True)
            raise SystemExit(0)

    def _in_replica(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank of this replica."""
        if self.replica_world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _shard(self, module: torch.nn.Module, mesh: Any) -> torch.nn.Module:
        from lightning_ft.strategy.sharding import ShardingError, auto_shard

        try:
            auto_shard(module, mesh, self.replica_world, self.shard_layers)
        except ShardingError as e:
            why = str(e).replace("LightningModule", "model").replace("configure_model()", "your code before setup")
            raise FTFabricError(why) from None
        return module

    @override
    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self._model is not None and module is not self._model:
            raise FTFabricError("ft_hsdp trains one model per program: fabric.setup was called for a second one")
        if self.replica_world > 1:
            module = super().setup_module(module)  # parallelize_fn (FSDP2), then materialize
        else:
            compat.materialize(module, self.root_device)
        self._model = module
        return module

    @override
    def setup_module_and_optimizers(self, module: torch.nn.Module, optimizers: list, scheduler: Any = None) -> Any:
        if self.replica_world > 1:
            raise FTFabricError("with W > 1 processes per replica, set up the model before creating its optimizer "
                                "(FSDP2 replaces the parameters): model = fabric.setup_module(model); optimizer = "
                                "fabric.setup_optimizers(make_optimizer(model.parameters()))")
        return super().setup_module_and_optimizers(module, optimizers, scheduler)

    @override
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        from lightning_ft.coord.membership import JobFinished
        from lightning_ft.fabric.replica import FabricReplica
        from lightning_ft.strategy.runlog import StepLog

        if self._renv is None:
            return optimizer
        if self.replica is not None:
            raise FTFabricError("ft_hsdp steps one optimizer per program: fabric.setup_optimizers was given a second")
        if self._model is None:
            raise FTFabricError("set up the model (fabric.setup or fabric.setup_module) before its optimizer")
        self._optimizer = optimizer
        self.replica = FabricReplica(self._model, optimizer, self._renv, self.cfg, self._secret, self.replica_rank,
                                     self.replica_world, self._group)
        self._loop = LoopState(os.path.join(self._dir, "loop_state"), self._renv.replica_id,
                               writes=self.replica_rank == 0)
        try:
            self.replica.start(self._clip, lambda: self._clip.apply(last=True))
        except JobFinished as e:
            print(f"lightning-ft: replica {self._renv.replica_id}: {e}", file=sys.stderr, flush=True)
            raise SystemExit(0) from None
        self._steplog = StepLog(self.replica.rid, self.replica.incarnation)
        return optimizer

    # -- data ---------------------------------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        from torch.utils.data import DataLoader, IterableDataset, RandomSampler

        if self._renv is None or self.train_loader is not None or not isinstance(dataloader, DataLoader):
            return dataloader  # an evaluation loader: Fabric split it over the replica's ranks
        if isinstance(dataloader.dataset, IterableDataset):
            raise FTFabricError("the train loader (the first one given to fabric.setup_dataloaders) reads an "
                                "IterableDataset; under Fabric ft_hsdp trains map-style data sets exactly once "
                                "(streams: use the Trainer, docs/GUIDE.md 'Streaming data')")
        sampler = dataloader.sampler
        shuffle = bool(getattr(sampler, "shuffle", isinstance(sampler, RandomSampler)))
        seed = self._data_seed if self._data_seed is not None else int(self.cfg.seed)
        try:
            self.train_loader = TrainLoader(dataloader, self._renv.replica_id, self.replica_rank, self.replica_world,
                                            self.num_replicas, seed, shuffle, self._start_micro, self._delivered)
        except ValueError as e:
            raise FTFabricError(f"ft_hsdp: {e}") from None
        return self.train_loader

    def _start_micro(self) -> int:
        """Where the train loader starts (the top of the loop): the job's state first."""
        if self.replica is None:
            raise FTFabricError("the train loader is iterated before fabric.setup_optimizers (or after this replica "
                                "left the job): ft_hsdp starts the replica with the model and its optimizer")
        self._ensure_prepared()
        if self._next is None:
            cursor = self.replica.cursor
            n = self._micro or checkpoints.read_json(self._dir, "micro.json").get("micro")
            if cursor and n is None:
                raise FTFabricError(f"replica {self.replica.rid}: the job is at slot batch {cursor}, but the number "
                                    f"of loader batches per optimizer step is not recorded in {self._dir}")
            self._next = cursor * (n or 1)
        return self._next

    def _delivered(self, m: int) -> None:
        if not self._window and self._loop is not None:  # a step's first batch: the top of the loop
            self._loop.snapshot(self.replica.step_count, self._optimizer)
        self._window.append(m)
        self._next = m + 1

    # -- the job's state before the first batch ------------------------------------------------------
    def _ensure_prepared(self, loaded: bool = False, loop_step: int = 0, into: Optional[dict] = None) -> None:
        """Sync, catch-up and rewind rounds, then the loop's own state (fabric/join.py)."""
        if self._prepared or self.replica is None:
            return
        self._prepared = self._failed = True
        assert self._loop is not None
        joined = Join(self.replica, self._loop, self._steplog, self.cfg, self._renv, self._secret, self._dir,
                      self.replica_rank, self._in_replica)
        self._ended = joined.run(self._optimizer, loaded, loop_step, into)
        self._failed = False
        if joined.left:
            self.replica = None

    # -- the step -----------------------------------------------------------------------------------
    @override
    def backward(self, tensor: torch.Tensor, module: Any, *args: Any, **kwargs: Any) -> None:
        if self.replica is not None:
            if not self._window:
                raise FTFabricError("fabric.backward without a batch from the train loader (the first loader given "
                                    "to fabric.setup_dataloaders) since the last optimizer.step(): ft_hsdp trains "
                                    "every batch of that loader exactly once, and only those")
            loss = tensor.detach().float()
            self._loss = loss if self._loss is None else self._loss + loss
        super().backward(tensor, module, *args, **kwargs)

    @override
    def clip_gradients_norm(self, module: Any, optimizer: Any, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        if self.replica is None:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        self._clip.record("norm", max_norm, norm_type, error_if_nonfinite)
        return local_norm(self.precision.main_params(optimizer), float(norm_type))

    @override
    def clip_gradients_value(self, module: Any, optimizer: Any, clip_val: Union[float, int]) -> None:
        if self.replica is None:
            return super().clip_gradients_value(module, optimizer, clip_val)
        self._clip.record("value", clip_val)
        return None

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self.replica is None:
            if self._renv is not None and self._prepared:
                raise FTFabricError("this replica left the job; it cannot step")
            return super().optimizer_step(optimizer, **kwargs)
        if kwargs.get("closure") is not None:
            raise FTFabricError("optimizer.step(closure) is not supported under ft_hsdp: run forward and "
                                "fabric.backward before optimizer.step()")
        window, self._window = self._window, []
        loss, self._loss = self._loss, None
        if not window:
            raise FTFabricError("optimizer.step() without a batch from the train loader since the last step: "
                                "ft_hsdp steps once per accumulation window of that loader's batches")
        n = len(window)
        if self._micro is None:
            self._micro = n
            if self.replica_rank == 0:
                checkpoints.write_json(self._dir, "micro.json", {"micro": n})
        if n != self._micro or window != list(range(window[0], window[0] + n)) or window[0] % n:
            raise FTFabricError(f"this step trains loader batches {window[0]}..{window[-1]} ({n}), but every step "
                                f"must train the same number of consecutive batches ({self._micro} so far)")
        if self._ended:
            optimizer.zero_grad(set_to_none=True)  # the job finished: this loop's extra step trains nothing
            return None
        t0 = time.perf_counter()
        self._failed = True  # until the step returns: an exception through it ends the replica unfinished
        res = self.replica.step(window[0] // n, self._clip.apply)
        self._failed = False
        if res.stale or res.synced:
            raise FTFabricError(f"replica {self.replica.rid}: the job rewound to step {res.step} (no replica held "
                                "the newest state); this loop's counters are past it, so the replica exits to be "
                                "restarted and to rejoin through fabric.load")
        self._trained = True
        if res.stop or (res.caught_up and not res.trained):
            self._ended = True  # the job stopped, or finished and this replica adopted its final state
        compat.set_rank_zero(res.writer and self.replica_rank == 0, self.global_rank)
        self.replica.step_log(self._steplog, loss, time.perf_counter() - t0)
        return None

    # -- collectives: values over the live replicas, synchronization within one ----------------------
    @override
    def all_reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        from lightning_ft.strategy.evaluation import op_name

        out = super().all_reduce(tensor, group=group, reduce_op=reduce_op)
        if self.replica is None or group is not None or not isinstance(out, torch.Tensor):
            return out
        reducer = self.replica.reducer
        reducer.begin("fabric")
        try:
            return reducer.reduce(out, op_name(reduce_op))
        finally:
            reducer.end()

    @override
    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        if self.replica is None or group is not None or sync_grads:
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        reducer = self.replica.reducer
        reducer.begin("fabric")
        try:
            return torch.stack(reducer.gather(tensor))
        finally:
            reducer.end()

    # -- checkpoints: one writer; a late replica loads the live job ----------------------------------
    def _sharded(self) -> bool:
        return self._model is not None and any(hasattr(p, "to_local") for p in self._model.parameters())

    @override
    def save_checkpoint(self, path: Any, state: dict, storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        if self.replica is None:
            if self._renv is not None and self._prepared:
                return  # it left the job (sat out): the others save
            return super().save_checkpoint(path, state, storage_options, filter)
        assert self._loop is not None
        self._loop.register(compat.caller_state("save"), self._optimizer)
        if not self.replica.writer:
            return
        entry = self.replica.broadcast(self.replica.describe() if self.replica.is_leader else None)
        state = {**state, checkpoints.KEY: entry} if entry is not None else dict(state)
        path = Path(self._in_replica(path))
        if self._sharded():
            compat.save_sharded(path=path, state=state, full_state_dict=not self._save_distributed_checkpoint,
                                rank=self.replica_rank, filter=filter)
        elif self.replica_rank == 0:
            torch.save(checkpoints.plain_state(state, filter), path)
        if self.replica_rank == 0:
            checkpoints.write_json(self._dir, "saved.json", {"step": self.replica.step_count, "path": str(path)})

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        if self.replica is None or not isinstance(state, dict) or not state:
            if self._sharded() or not isinstance(state, (dict, torch.nn.Module)):
                return super().load_checkpoint(path, state, strict, weights_only)
            return checkpoints.load_plain(Path(path), state, strict, weights_only)
        if self._trained or self._prepared:
            raise FTFabricError("fabric.load(path, state) after this replica began training: under ft_hsdp the loop "
                                "loads its state before its first batch (a restarted replica takes the live job's "
                                "there)")
        assert self._loop is not None
        self._loop.register(compat.caller_state("load") or state, self._optimizer)
        path = Path(self._in_replica(path))
        if self._sharded():
            remainder = compat.load_sharded(path=path, state=state, strict=strict, weights_only=weights_only)
        else:
            remainder = checkpoints.load_plain(path, state, strict, weights_only)
        point = checkpoints.point_of(remainder.pop(checkpoints.KEY, None), self.num_replicas)
        step = point[0] if point is not None else 0
        if point is not None:
            self.replica.resume_at(*point)
        self._ensure_prepared(loaded=True, loop_step=step, into=state)
        return remainder

    # -- the end ------------------------------------------------------------------------------------
    def _at_exit(self) -> None:
        """The main thread ended: if the loop returned, the job is finished for this program."""
        replica, self.replica = self.replica, None
        if replica is None:
            return
        try:
            if self._trained and not self._failed and not compat.exited_by_exception():
                replica.finish(self._model, self._optimizer, self.replica_rank)
        finally:
            if self._steplog is not None:
                self._steplog.close()
            replica.close()

