"""The start of a replica under `FTHSDPStrategy` (docs/ARCHITECTURE.md, "Lightning glue"):
`load_config` and `install` around Lightning's `setup_environment`; a process that finds its job
already finished leaves before any user hook (`exit_if_finished`, from `install`), and
`setup_model` shards the model, then `start_replica` (once the optimizers exist)
builds the replica layer: the Replica from the job config and the strategy's parts around it
(committed schedulers, the loss scaler, callbacks' state, the step glue `LightningStep`),
a `--resume` checkpoint, the cross-replica evaluation, persistent checkpoints and the run log.
A warm spare waits inside `Replica.start()` until it is promoted.

This module, not the strategy, talks to etcd at start-up; the strategy adapts Lightning's hooks.
"""
from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightning_ft.strategy import lightning_compat, replica_end
from lightning_ft.strategy.errors import FTHSDPError
from lightning_ft.strategy.runlog import StepLog
from lightning_ft.strategy.schedulers import CommittedSchedulers

if TYPE_CHECKING:
    from lightning_ft.strategy.ft_hsdp import FTHSDPStrategy


def load_config(s: FTHSDPStrategy) -> None:
    """`setup_environment`, before Lightning's: the job config, its secret, and under torchrun the
    replica's process group (Lightning then keeps it)."""
    from lightning_ft.secret import SecretError, resolve

    s.cfg = s.load_ft_config()
    try:
        s.secret = resolve(s.cfg.secret)
    except SecretError as e:
        raise FTHSDPError(f"strategy='ft_hsdp', replica {s.rid}: {e}") from None
    if s.renv.launcher == "torchrun" and not dist.is_initialized():
        from lightning_ft.launch.environment import init_torchrun_group

        init_torchrun_group(s.renv, s._get_process_group_backend(),
                            s._timeout.total_seconds() if s._timeout else 1800.0)


def install(s: FTHSDPStrategy) -> None:
    """`setup_environment`, after Lightning's: a finished job's late replica leaves; each replica
    logs into its own directory; the CLI config is written once; the metrics callback, the job's
    stop decision and the config's failure injection are installed."""
    from lightning.pytorch.trainer.states import TrainerFn

    from lightning_ft.callbacks.failure import FailureInjector
    from lightning_ft.strategy.runlog import FTMetrics

    trainer: Any = s.module.trainer  # Any: Lightning's Trainer gets .callbacks undeclared (CallbackConnector)
    if trainer.state.fn == TrainerFn.FITTING and not s.fit_started:
        s.fit_started = True
        exit_if_finished(s)
    if not s.renv.standby:  # a spare names them once promoted (`setup`)
        lightning_compat.name_unversioned_loggers(trainer, f"replica_{s.rid}")
    lightning_compat.save_cli_config_once(trainer, writer=s.rid == 0 and not s.renv.standby,
                                          overwrite=s.incarnation > 0 or bool(os.environ.get("LFT_RESUME")))
    if not any(isinstance(cb, FTMetrics) for cb in trainer.callbacks):
        trainer.callbacks.append(FTMetrics(s))
    lightning_compat.route_should_stop(trainer, s.stop_decision, s.ask_stop)
    assert s.cfg is not None  # load_config
    failures = s.cfg.failure
    scheduled = failures.events or failures.mtbf_steps > 0 or failures.signal_exception
    if scheduled and not any(isinstance(cb, FailureInjector) for cb in trainer.callbacks):
        trainer.callbacks.append(FailureInjector())  # the job config schedules failures: inject them


def setup_model(s: FTHSDPStrategy, trainer: Any) -> None:
    """`setup`: ModelParallelStrategy's, without its demand that configure_model parallelizes
    (FSDP2 is applied here when it did not), then the replica layer once the optimizers exist."""
    from lightning.pytorch.trainer.states import TrainerFn

    from lightning_ft.strategy.sharding import ShardingError, auto_shard

    assert s.accelerator is not None
    s.accelerator.setup(trainer)
    try:
        auto_shard(s.module, s.device_mesh["data_parallel"] if s.world_size > 1 else None,
                   s.world_size, s.shard_layers)
    except ShardingError as e:
        raise FTHSDPError(str(e)) from None
    assert s.model is not None
    lightning_compat.materialize_distributed_module(s.model, s.root_device)
    s.model = s.precision_plugin.convert_module(s.model)
    s.model_to_device()
    s.barrier()
    fitting = trainer.state.fn == TrainerFn.FITTING
    if fitting:
        s.setup_optimizers(trainer)
    s.setup_precision_plugin()
    if fitting:
        lightning_compat.optimizers_to_device(s.optimizers, s.root_device)
        if s.replica is None:
            start_replica(s, trainer)


def exit_if_finished(s: FTHSDPStrategy) -> None:
    """A replica (re)started after the job finished leaves before any user hook runs (no
    `setup`, no `on_train_end` on untrained weights)."""
    from lightning_ft.replica.catchup.ending import finished_record

    done = None
    if s.global_rank == 0:
        assert s.cfg is not None  # setup_environment loaded it
        env = s.renv
        done = finished_record(s.cfg.etcd, env.job, env.etcd, s.secret, env.run_id)
    if s.world_size > 1:
        box = [done]
        dist.broadcast_object_list(box, src=0)
        done = box[0]
    if done is not None:
        replica_end.leave(s, 0, f"replica {s.rid}: the job already finished ({done}); nothing to train")


def start_replica(s: FTHSDPStrategy, trainer: Any) -> None:
    """Build and start the replica layer of strategy `s` (every rank; see the module docstring)."""
    from lightning_ft.config import checkpoint_dir
    from lightning_ft.replica.group import ReplicaGroup
    from lightning_ft.replica.replica import Replica
    from lightning_ft.replica.settings import Identity, Settings
    from lightning_ft.strategy.stepping import LightningStep

    if len(s.optimizers) != 1 and (s.module.automatic_optimization or not s.optimizers):
        raise FTHSDPError(f"ft_hsdp steps one optimizer per batch under automatic optimization (several need "
                          f"manual optimization, as under DDP); configure_optimizers returned "
                          f"{len(s.optimizers)}")
    cfg = s.cfg
    assert cfg is not None  # setup_environment loaded it
    if cfg.batch_policy == "constant" and not s.module.automatic_optimization:
        raise FTHSDPError("batch_policy=constant trains absent replicas' batches with the LightningModule's "
                          "training_step, which needs automatic optimization; use batch_policy=shrink with "
                          "manual optimization")
    if s.lr_intervention is not None:  # LRIntervention(mode) sets it after setup_environment
        cfg.lr_intervention = s.lr_intervention
    s.schedulers = CommittedSchedulers(s.lr_scheduler_configs, manual=not s.module.automatic_optimization)
    world = s.world_size
    # The manager's own group: its quorum broadcast runs in a background thread while FSDP2's
    # collectives run on the default group.
    pg = dist.new_group(backend="gloo") if world > 1 else None
    from lightning_ft.replica.optimizers import OptimizerError

    try:  # several (manual optimization): every optimizer.step() is a round (quorum rule 15)
        env = s.renv
        who = Identity(env.job, s.rid, s.incarnation, s.num_replicas, s.secret, env.etcd, run_id=env.run_id,
                       standby=env.standby)
        replica = Replica(
            # the annotation says one Optimizer; the replica takes the list (replica/optimizers.py)
            s.module, list(s.optimizers), who, Settings.from_config(cfg),
            group=ReplicaGroup(s.global_rank, world, pg), scheduler=s.schedulers, run_dir=env.run_dir)
    except OptimizerError as e:
        raise FTHSDPError(f"ft_hsdp: {e}") from None
    s.replica = replica
    replica.set_scaler(getattr(s.precision_plugin, "scaler", None))  # 16-mixed: replica/scaler.py
    from lightning_ft.strategy.callback_state import CallbackState

    extras: dict[str, Any] = {}
    if not s.module.automatic_optimization:  # self.clip_gradients: on the averaged gradients
        from lightning_ft.strategy.manual_clip import DeferredClip

        s.manual_clip = DeferredClip(s.precision_plugin, lambda: s.optimizers)
        extras["clip"] = s.manual_clip
        if world > 1:
            from lightning_ft.strategy.sharding import reshard_on_toggle

            reshard_on_toggle(s.lightning_module)
    replica.callbacks = CallbackState(lambda: getattr(s.lightning_module, "_trainer", None), extras)
    resume = os.environ.get("LFT_RESUME")
    if resume:
        t0 = time.perf_counter()
        replica.load_checkpoint(resume)
        if s.global_rank == 0:
            print(f"lightning-ft: replica {s.rid} resumed from {resume} (step {replica.step}) in "
                  f"{time.perf_counter() - t0:.2f}s", file=sys.stderr, flush=True)
    from lightning_ft.coord.membership import JobFinished
    from lightning_ft.strategy.evaluation import CrossReplicaReducer

    # half the hang guard: a value that never comes must not make this replica look hung
    s.reducer = CrossReplicaReducer(replica, timeout_s=cfg.etcd.hang_timeout_s / 2)
    try:
        replica.start()  # a warm spare waits here until promoted: the replica id is known after
    except JobFinished:
        if not s.renv.standby:
            raise
        replica_end.leave(s, 0, "the job finished; this warm spare was not needed")
    s.stepper = LightningStep(s, replica)
    if s.renv.standby:
        lightning_compat.name_unversioned_loggers(trainer, f"replica_{s.rid}")
    if cfg.checkpoint.every_n_steps > 0:
        from lightning_ft.strategy.checkpoints import ReplicaCheckpoints

        s.ckpt = ReplicaCheckpoints(s.replica, checkpoint_dir(cfg), cfg.checkpoint.keep,
                                     cfg.checkpoint.every_n_steps, s.global_rank, world, s.rid)
    s.steplog = StepLog(s.rid, s.incarnation)
    if s.overlap:
        s.replica.enable_overlap(cfg.ftar.bucket_bytes)
