"""How a replica ends under `FTHSDPStrategy`: an exception is explained in one line with what
happens next (a finished job's late replica leaves with 0; a halt keeps only verified
checkpoints and exits with ExitCode.HALTED), and the replica layer closes in order. `leave` is
the strategy's one early exit: a process that must not run Lightning's remaining hooks (a late
replica of a finished job, an unneeded spare, a halt) says why, closes and exits."""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from lightning_ft.constants import ExitCode
from lightning_ft.strategy.errors import FTHSDPError

if TYPE_CHECKING:
    from lightning_ft.strategy.ft_hsdp import FTHSDPStrategy


def on_exception(s: FTHSDPStrategy, exception: BaseException) -> None:
    from lightning_ft.coord.membership import ConfigMismatch, Evicted, JobFinished, JobHalted, QuorumTimeout
    from lightning_ft.coord.store import StoreError
    from lightning_ft.ftar.transport.base import FatalError
    from lightning_ft.replica.plan import ReplicaStateLost, StaleManualStep

    if isinstance(exception, JobFinished):  # a late replica: leave before any user hook runs
        leave(s, 0, f"replica {s.rid}: {exception}")
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
            print(f"lightning-ft: replica {os.environ.get('LFT_REPLICA_ID', '?')} rank {s.global_rank}: "
                  f"{type(exception).__name__}: {exception}" + (f"\n  -> {text}" if text else ""),
                  file=sys.stderr, flush=True)
            break
    if isinstance(exception, JobHalted) and s.replica is not None:
        if s.ckpt is not None:  # a checkpoint still being written must not outlive the verdict
            s.ckpt.close()
        s.replica.on_halt()
        leave(s, ExitCode.HALTED)
    close(s)


def leave(s: FTHSDPStrategy, code: int, why: str = "") -> None:
    """Exit this process now, with `code`, after saying `why` (rank 0) and closing the replica
    layer in order: Lightning's remaining hooks must not run (no `on_train_end` of a replica
    that never trained, no checkpoint of a halted job)."""
    if why and s.global_rank == 0:
        print(f"lightning-ft: {why}", file=sys.stderr, flush=True)
    close(s)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def close(s: FTHSDPStrategy) -> None:
    if s.sampler is not None and hasattr(s.sampler, "close"):
        s.sampler.close()  # the last loader states reach their files
    if s.ckpt is not None:
        s.ckpt.close()
        s.ckpt = None
    if s.steplog is not None:
        s.steplog.close()
        s.steplog = None
    if s.replica is not None:
        try:
            s.replica.close()
        finally:
            s.replica = None
