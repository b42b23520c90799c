"""LinkState: the counters a hang diagnosis reads from a blocked FTAR endpoint (ftar/linkstate.py)."""
from __future__ import annotations

import time

import pytest
import torch

from lightning_ft.ftar.transport.base import RecoverableError
from tests.ftar.test_engine import close_all, connect_all, make_ring


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_rank_whose_left_neighbour_never_joins_waits_on_its_receive(transport):
    fs = make_ring(3, timeout_s=30, transport=transport)
    try:
        assert connect_all(fs) == {}
        assert fs[0].links.snapshot()["active"] is False
        # ranks 0 and 1 start an all-reduce; rank 2 (left of 0, right of 1) never does
        works = [fs[i].allreduce([torch.ones(50000)]) for i in (0, 1)]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (fs[0].links.rx_wait and fs[1].links.rx_wait):
            time.sleep(0.02)
        s0, s1 = fs[0].links.snapshot(), fs[1].links.snapshot()
        # rank 0's left is rank 2: it waits to receive its first chunk, nothing received yet
        assert s0["active"] and s0["rx_outstanding"] > 0 and s0["rx_done"] == 0
        # rank 1's left is rank 0: it got rank 0's first chunks; rank 1 then waits on its left (0)
        # too, which forwards nothing until rank 2 sends: the stall is on link 2 -> 0
        assert s1["active"] and s1["rx_done"] > 0
        assert s0["tx_done"] > 0 and s0["running_s"] > 0
        for f in fs:
            f.abort("test over")
        for w in works:
            with pytest.raises(RecoverableError):
                w.wait(5)
        assert fs[0].links.snapshot()["rx_outstanding"] == 0
    finally:
        close_all(fs)


def test_idle_endpoint_counts_the_last_all_reduce_and_waits_on_nothing():
    fs = make_ring(2)
    try:
        assert connect_all(fs) == {}
        works = [f.allreduce([torch.ones(3000)]) for f in fs]
        for w in works:
            w.wait(10)
        s = fs[0].links.snapshot()
        assert not s["active"] and s["rx_outstanding"] == 0 and s["tx_outstanding"] == 0
        assert s["rx_done"] == s["tx_done"] == 3000 * 4 // 2 * 2  # rs + ag: half the tensor each way
    finally:
        close_all(fs)
