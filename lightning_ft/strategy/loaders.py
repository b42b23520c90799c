"""The loaders under `FTHSDPStrategy` (docs/ARCHITECTURE.md, "Exactly once"): the train loader
becomes the exactly-once batch sampler over this replica's slot (map-style data) or a stream
loader (strategy/streaming.py); validation and test loaders are sharded over the live replicas."""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch.utils.data import DataLoader, IterableDataset

from lightning_ft.replica.ledger import SlotStream
from lightning_ft.strategy.errors import FTHSDPError
from lightning_ft.strategy.sampler import FTBatchSampler

if TYPE_CHECKING:
    from lightning_ft.strategy.ft_hsdp import FTHSDPStrategy


def train_loader(s: FTHSDPStrategy, dataloader: object) -> object:
    trainer = s.module.trainer
    if s.replica is None or s.stepper is None or not isinstance(dataloader, DataLoader):
        return dataloader
    if not trainer.training:
        return eval_loader(s, dataloader)
    if isinstance(dataloader.dataset, IterableDataset):
        return stream_loader(s, dataloader)
    bs = dataloader.batch_size
    if bs is None:
        raise FTHSDPError("the train DataLoader must set batch_size (per process); ft_hsdp builds the batches")
    replica, n = s.replica, s.stepper.micro_batches
    assert s.cfg is not None and s.schedulers is not None  # set up with the manager
    seed = s.data_seed if s.data_seed is not None else int(s.cfg.seed)
    # ignore: torch's Dataset declares no __len__; a map-style dataset has one
    stream = SlotStream(len(dataloader.dataset), bs * s.world_size * n,  # type: ignore[arg-type]
                        s.num_replicas, seed=seed)
    if stream.num_samples // stream.batch_size < s.num_replicas:
        raise FTHSDPError(f"{stream.num_samples} samples make fewer than one batch of {stream.batch_size} per "
                          f"replica for {s.num_replicas} replicas")
    s.sampler = FTBatchSampler(stream, s.rid, s.global_rank, s.world_size, n,
                                  start=lambda: replica.cursor)
    s.train_data = (dataloader.dataset, dataloader.collate_fn)
    # stragglers policy "shrink": this replica can train any of its micro-batches and others'
    replica.micro_batches = n if n >= 2 and s.module.automatic_optimization and not replica.multi else 0
    s.schedulers.steps_per_epoch = s.sampler.steps_per_epoch()
    return DataLoader(dataloader.dataset, batch_sampler=s.sampler, num_workers=dataloader.num_workers,
                      collate_fn=dataloader.collate_fn, pin_memory=dataloader.pin_memory,
                      worker_init_fn=dataloader.worker_init_fn,
                      persistent_workers=dataloader.persistent_workers and dataloader.num_workers > 0,
                      multiprocessing_context=dataloader.multiprocessing_context)


def stream_loader(s: FTHSDPStrategy, dataloader: DataLoader) -> object:
    """A train stream (stateful loaders over an IterableDataset): strategy/streaming.py."""
    from lightning_ft.config import loader_state_dir
    from lightning_ft.strategy.streaming import StreamDataError, stream_loader

    assert s.replica is not None and s.stepper is not None  # train_loader checked them
    replica = s.replica
    if s.sampler is not None and hasattr(s.sampler, "close"):
        s.sampler.close()
    try:
        s.sampler = stream_loader(dataloader, cfg=s.cfg, slot=s.rid, rank=s.global_rank,
                                     world=s.world_size, slots=s.num_replicas, micro=s.stepper.micro_batches,
                                     cursor=lambda: replica.cursor, state_root=loader_state_dir(s.cfg))
    except StreamDataError as e:
        raise FTHSDPError(str(e)) from None
    assert s.schedulers is not None  # set up with the manager
    s.schedulers.steps_per_epoch = 0
    return s.sampler


def eval_loader(s: FTHSDPStrategy, dataloader: DataLoader) -> DataLoader:
    """Validation/test loaders are sharded over the live replicas, then over ranks."""
    from lightning_ft.strategy.evaluation import ShardSampler

    if isinstance(dataloader.dataset, IterableDataset) or dataloader.batch_size is None:
        return dataloader  # not shardable by index: every replica evaluates what it is given

    reducer = s.reducer
    assert reducer is not None  # started with the replica

    def shard() -> tuple[int, int, int, int]:
        i, k = reducer.shard()
        return i, k, s.global_rank, s.world_size

    sampler = ShardSampler(len(dataloader.dataset), shard)  # type: ignore[arg-type]  # Dataset: no __len__ declared
    return DataLoader(dataloader.dataset, batch_size=dataloader.batch_size, sampler=sampler,
                      num_workers=dataloader.num_workers, collate_fn=dataloader.collate_fn,
                      pin_memory=dataloader.pin_memory, drop_last=dataloader.drop_last,
                      worker_init_fn=dataloader.worker_init_fn,
                      multiprocessing_context=dataloader.multiprocessing_context)
