"""Cross-replica reduction of evaluation metrics (lightning_ft/strategy/evaluation.py)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from lightning_ft.coord import keys
from lightning_ft.coord.store import MemoryStore
from lightning_ft.replica.group import ReplicaGroup
from lightning_ft.strategy.evaluation import CrossReplicaReducer


def reducer_of_replica_0(others: dict[int, list[float]], contributors=(0, 1, 2), timeout_s=5.0) -> CrossReplicaReducer:
    """Replica 0's reducer in a round of members 0, 1, 2 whose other values are already stored."""
    root = keys.root("/lft", "ev")
    store = MemoryStore()
    for rid in (1, 2):
        store.put(keys.members(root, rid), json.dumps({"incarnation": 0}).encode())
    q = SimpleNamespace(members=(0, 1, 2), incarnations=(0, 0, 0), contributors=contributors)
    mgr = SimpleNamespace(rid=0, incarnation=0, gen=0, step=10, root=root, store=store, is_leader=True,
                          last_plan=SimpleNamespace(quorum=q), group=ReplicaGroup(0, 1))
    red = CrossReplicaReducer(mgr, timeout_s=timeout_s)
    red.begin("val")
    for seq, values in enumerate(zip(*others.values(), strict=True)):
        for rid, v in zip(others, values, strict=True):
            store.put(f"{red._prefix}m{seq:05d}/{rid}", json.dumps([v]).encode())
    return red


def test_decisions_count_apart_from_metric_values():
    """A replica whose callbacks ask one question fewer (a restarted ModelCheckpoint with fewer
    files than save_top_k asks none) still pairs its val_loss with the others' val_loss, and
    its next decision with their first."""
    red = reducer_of_replica_0({1: [2.0], 2: [4.0]})  # the others' val_loss, at metric 0
    for rid, vote in ((1, 1.0), (2, 0.0)):  # ... and their first decision
        red.mgr.store.put(f"{red._prefix}d00000/{rid}", json.dumps([vote]).encode())
    red.deciding = True
    decided = red.reduce(torch.tensor(1), "sum")
    red.deciding = False
    assert int(decided) == 2
    assert float(red.reduce(torch.tensor(3.0), "mean")) == pytest.approx(3.0)  # not mixed with the votes


def test_mean_of_batch_counts_is_not_truncated():
    """Lightning reduces a mean metric as mean(sum of values) / mean(batch count); with shards
    of 22, 21 and 21 samples the count's mean is 21.33, and truncating it to 21 inflated the
    metric by 1.6%."""
    red = reducer_of_replica_0({1: [21.0 * 7.0, 21.0], 2: [21.0 * 8.0, 21.0]})
    value = red.reduce(torch.tensor(22.0 * 6.0), "mean")
    count = red.reduce(torch.tensor(22), "mean")
    assert count.is_floating_point() and float(count) == pytest.approx(64 / 3)
    assert float(value / count) == pytest.approx((22 * 6 + 21 * 7 + 21 * 8) / 64)


def test_sums_of_integers_stay_integers():
    red = reducer_of_replica_0({1: [3.0], 2: [4.0]})
    out = red.reduce(torch.tensor(5), "sum")
    assert out.dtype == torch.int64 and int(out) == 12


def test_a_member_that_caught_up_in_the_last_round_is_not_waited_for():
    """Replica 2 was lagging (a catch-up) in the last round: its Lightning loop may not evaluate
    at this step (it committed it before its first batch), so the others do not wait for it
    (before: etcd.hang_timeout_s, and the hang guard then restarted them); the shards cover
    the set over the contributors."""
    import time

    red = reducer_of_replica_0({1: [3.0]}, contributors=(0, 1), timeout_s=20.0)
    assert red.shard() == (0, 2)
    t0 = time.monotonic()
    assert float(red.reduce(torch.tensor(1.0), "mean")) == pytest.approx(2.0)
    assert time.monotonic() - t0 < 5.0


def test_a_replica_outside_the_contributors_reads_their_result_and_adds_nothing():
    red = reducer_of_replica_0({1: [3.0], 2: [5.0]}, contributors=(1, 2))
    assert float(red.reduce(torch.tensor(100.0), "mean")) == pytest.approx(4.0)


def test_metric_states_gather_from_every_replica_in_id_order_exactly():
    """A torchmetrics object's states during evaluation (`sync_metrics`): the tensors of every
    rank of every evaluating replica, replica 0's first, dtypes, shapes and values exact."""
    from lightning_ft.strategy.evaluation import _tensor_json

    red = reducer_of_replica_0({})
    red.mgr.gather = lambda t: [t, t + 1]  # this replica's two ranks
    theirs = {1: [torch.tensor([[1, 2], [3, 4]], dtype=torch.int64)], 2: [torch.tensor([[9, 9], [9, 9]])]}
    for rid, ts in theirs.items():
        red.mgr.store.put(f"{red._prefix}t00000/{rid}", json.dumps([_tensor_json(t) for t in ts]).encode())
    mine = torch.tensor([[5, 6], [7, 8]])
    got = red.gather(mine)
    assert [t.tolist() for t in got] == [[[5, 6], [7, 8]], [[6, 7], [8, 9]], [[1, 2], [3, 4]], [[9, 9], [9, 9]]]
    assert {t.dtype for t in got} == {torch.int64}
    x = torch.tensor([0.1, 1 / 3], dtype=torch.float32)  # float32 through JSON's float64: exact
    red.mgr.store.put(f"{red._prefix}t00001/1", json.dumps([_tensor_json(x)]).encode())
    red.mgr.store.put(f"{red._prefix}t00001/2", json.dumps([_tensor_json(x)]).encode())
    red.mgr.gather = lambda t: [t]
    assert all(torch.equal(t, x) for t in red.gather(x))


def test_sync_metrics_points_torchmetrics_objects_at_the_replicas_during_evaluation_only():
    torchmetrics = pytest.importorskip("torchmetrics")
    from lightning_ft.strategy.evaluation import sync_metrics

    module = torch.nn.Module()
    module.acc = torchmetrics.Accuracy(task="binary")
    module.inner = torch.nn.Sequential(torchmetrics.MeanMetric())
    red = SimpleNamespace(active=True, gather=lambda t: [t, t])
    assert sync_metrics(module, red) == 2
    module.acc.update(torch.tensor([1, 0, 1]), torch.tensor([1, 1, 1]))
    assert float(module.acc.dist_sync_fn(torch.tensor(2.0))[1]) == 2.0
    # torchmetrics syncs through it at compute: two "processes" with the same counts, same accuracy
    module.acc.distributed_available_fn = lambda: True
    assert float(module.acc.compute()) == pytest.approx(2 / 3)
    # a training metric outside evaluation: torchmetrics' own gather inside the replica (which
    # needs torch.distributed, not initialized here), never the replicas'
    red.active = False
    red.gather = lambda t: pytest.fail("gathered across replicas outside an evaluation")
    with pytest.raises(ValueError, match="[Dd]efault process group"):
        module.acc.dist_sync_fn(torch.tensor(1.0))
