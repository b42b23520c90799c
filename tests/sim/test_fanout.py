"""The fan-out model follows gloo's binomial broadcast exactly, and its times add up."""
from __future__ import annotations

import numpy as np
import pytest

from lightning_ft.sim import fanout
from lightning_ft.sim.fanout import HopModel


def gloo_schedule(size: int) -> dict[int, list[tuple[str, int]]]:
    """gloo/broadcast.cc's loop, transliterated: per virtual rank, its sends and receives in order."""
    dim = (size - 1).bit_length()
    out = {v: [] for v in range(size)}
    for v in range(size):
        mask = (1 << dim) - 1
        for i in range(dim):
            mask ^= 1 << i
            if v & mask:
                continue
            peer = v ^ (1 << i)
            if peer >= size:
                continue
            out[v].append(("send", peer) if not v & (1 << i) else ("recv", peer))
    return out


@pytest.mark.parametrize("size", list(range(1, 70)) + [127, 128, 129, 1000])
def test_tree_matches_gloo_binomial_broadcast(size):
    sched = gloo_schedule(size)
    for v in range(size):
        recvs = [p for op, p in sched[v] if op == "recv"]
        sends = [p for op, p in sched[v] if op == "send"]
        assert recvs == ([] if v == 0 else [fanout.parent(v)])
        assert sends == fanout.children(v, size)  # same peers, same order
        assert all(fanout.send_index(c) == k for k, c in enumerate(sends))
    # every rank but the root is reached exactly once
    reached = sorted(c for v in range(size) for c in fanout.children(v, size))
    assert reached == list(range(1, size))


@pytest.mark.parametrize("size,depth", [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4), (8192, 13),
                                        (8193, 14)])
def test_depth_is_ceil_log2(size, depth):
    assert fanout.tree_depth(size) == depth


def test_bad_ranks_are_refused():
    with pytest.raises(ValueError):
        fanout.tree_depth(0)
    with pytest.raises(ValueError):
        fanout.parent(0)
    with pytest.raises(ValueError):
        HopModel(latency_ms=(), bytes_per_s=1.0)
    with pytest.raises(ValueError):
        fanout.receive_times(4, np.ones(3))


def brute_receive(size, edge, send):
    t = [0.0] * size
    for v in range(1, size):  # parents have smaller ids
        t[v] = t[fanout.parent(v)] + fanout.send_index(v) * send + edge[v]
    return t


@pytest.mark.parametrize("size", [2, 3, 7, 8, 13, 64, 100])
def test_receive_times_equal_the_recursion(size):
    rng = np.random.default_rng(size)
    edge = rng.uniform(0.1, 2.0, size)
    for send in (0.0, 0.3):
        assert fanout.receive_times(size, edge, send) == pytest.approx(brute_receive(size, edge, send))
    # a rank with constant hops and free sends is popcount(v) hops from the root
    got = fanout.receive_times(size, np.full(size, 0.5))
    assert list(got) == pytest.approx([0.5 * bin(v).count("1") for v in range(size)])


def test_rows_are_independent_broadcasts():
    edge = np.array([[0, 1, 1, 1], [0, 2, 2, 2]], dtype=float)
    assert list(fanout.tree_time(4, edge)) == [2.0, 4.0]


@pytest.mark.parametrize("size", [2, 8, 1024, 8192])
def test_constant_hops_give_overhead_plus_two_trees(size):
    model = HopModel(latency_ms=(0.2,), bytes_per_s=1e6, overhead_ms=0.5)  # 1000 bytes: 1 ms on the wire
    d = fanout.tree_depth(size)
    got = fanout.sample_fanout(size, model, 1000, 5, np.random.default_rng(0))
    # size broadcast: d hops of 0.2; data broadcast: every hop 0.2 + 1 ms, and the deepest
    # path (all first sends) is the longest because sends after the first wait 1 ms each too
    assert got == pytest.approx([0.5 + d * 0.2 + d * 1.2] * 5)
    assert list(fanout.sample_fanout(1, model, 1000, 3, np.random.default_rng(0))) == [0.0, 0.0, 0.0]


def test_fanout_grows_with_the_replica_and_with_the_tail():
    rng = np.random.default_rng(1)
    lat = rng.lognormal(np.log(0.2), 0.5, 500)
    model = HopModel(latency_ms=tuple(lat), bytes_per_s=1e9)
    p50 = [np.median(fanout.sample_fanout(w, model, 500, 300, rng)) for w in (2, 16, 256, 8192)]
    assert p50 == sorted(p50) and p50[-1] > 5 * p50[0]
    # the last of 8192 ranks waits for the slowest of many paths: above depth x median hop
    assert p50[-1] > 2 * 13 * np.median(lat)


def test_percentile_nearest_rank():
    assert fanout.percentile([3, 1, 2], 0.5) == 2
    assert fanout.percentile(range(101), 0.99) == 99
    with pytest.raises(ValueError):
        fanout.percentile([], 0.5)
