"""A checkpoint never holds a step the ledger does not know (strategy/checkpoints.py): when the
ledger refuses the writer's records (evicted, or its lease lapsed: `disowned`), no checkpoint
is written. Otherwise a rewind (the quorum rewinds to the newest checkpoint when only disowned
states are left) restores a state, and cursors, past batches the ledger never recorded, and
the final history misses them. Found reading the code after a 100-fault soak under
`stragglers.policy=exclude` reported lost batches, with 62 refused records among its events."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import lightning.pytorch  # noqa: F401  (first: importing it registers ft_hsdp, which imports runlog)
from lightning_ft.strategy.checkpoints import ReplicaCheckpoints


class FakeWriter:
    def __init__(self):
        self.saved, self.protect = [], None

    def save(self, step, model, optimizer, extra, meta):
        self.saved.append((step, meta))
        return SimpleNamespace(stage_s=0.0)


class FakeMgr:
    """The manager as the checkpoint hook sees it: the writer replica 0, alone in its round."""

    def __init__(self, recorded: bool):
        self.recorded = recorded
        self.flushes = 0
        self.step, self.R, self.rid, self.job, self.gen, self.batches = 100, 1, 0, "j", 0, 100
        q = SimpleNamespace(contributors=(0,), members=(0,), round=7, epoch=1, verified_step=75, cont=False,
                            cursor_of=lambda slot: 99)
        self.last_plan = SimpleNamespace(quorum=q)
        self.scaler = None

    def flush_ledger(self) -> bool:
        self.flushes += 1
        return self.recorded

    def broadcast(self, obj):
        return obj


def checkpoints(mgr) -> ReplicaCheckpoints:
    c = ReplicaCheckpoints.__new__(ReplicaCheckpoints)
    c.mgr, c.root, c.every, c.rid, c.writer, c.stage_ms = mgr, "/nonexistent", 100, 0, FakeWriter(), 0.0
    return c


class Opt:
    param_groups = [{"lr": 0.1, "params": []}]


class Sched:
    def state_dict(self):
        return {}


@pytest.mark.parametrize("recorded", [True, False])
def test_the_writer_saves_only_what_the_ledger_recorded(recorded):
    mgr = FakeMgr(recorded)
    c = checkpoints(mgr)
    c.maybe_save(model=None, optimizer=Opt(), schedulers=Sched(), committed=100, rank=0)
    assert mgr.flushes == 1
    if recorded:
        assert [s for s, _ in c.writer.saved] == [100]
        assert c.writer.saved[0][1]["cursors"] == {"0": 100}
    else:
        assert c.writer.saved == []
