"""The gloo probe's hop model fit, on latencies known exactly. (The probe itself, on real
gloo processes, runs in the bench.scale smoke test.)"""
from __future__ import annotations

import pytest

from lightning_ft.sim import gloo_probe
from lightning_ft.sim.fanout import HopModel, sample_fanout
from lightning_ft.sim.gloo_probe import ProbeResult


def known(world=2, hop=0.2, bw=1e9, overhead=0.3, message=1000, bulk=1 << 20):
    wire = lambda n: n / bw * 1e3  # noqa: E731
    rows = lambda x: [[x] * (world - 1)] * 20  # noqa: E731
    return ProbeResult(world, message, bulk, {"hop": rows(hop), "bulk": rows(hop + wire(bulk)),
                                              "object": rows(overhead + 2 * hop + wire(message))})


def test_fit_recovers_latency_bandwidth_and_overhead():
    m = gloo_probe.fit(known())
    assert isinstance(m, HopModel) and set(m.latency_ms) == {0.2}
    assert m.bytes_per_s == pytest.approx(1e9, rel=1e-6) and m.overhead_ms == pytest.approx(0.3)
    # and the model then reproduces the probe it was fitted on
    import numpy as np

    assert sample_fanout(2, m, 1000, 3, np.random.default_rng(0)) == pytest.approx([0.2 * 2 + 0.3 + 1e-3] * 3)


def test_fit_wants_a_two_process_probe():
    with pytest.raises(ValueError, match="2-process probe"):
        gloo_probe.fit(known(world=3))


def test_last_rank_and_one_hop_views():
    r = ProbeResult(3, 10, 10, {"hop": [[0.1, 0.3], [0.2, 0.1]], "bulk": [], "object": []})
    assert r.last_rank_ms("hop") == [0.3, 0.2] and r.one_hop_ms("hop") == [0.1, 0.2]


def test_probe_needs_two_processes():
    with pytest.raises(ValueError, match="at least 2"):
        gloo_probe.probe(1, b"x")
