"""Hang diagnosis end to end (coord/hang.py, launch/stacks.py): three replicas of the plain loop
under the real Supervisor; replica 1's leader is SIGSTOPped a few ms into a step's exchange (inside
its FTAR all-reduce). Within TTL + 2 s the supervisor's `hang` event names replica 1 rank 0, the
FTAR link waiting on it with its direction (from the others' stall reports), and carries the
stopped process's Python stack, read from outside while it is stopped (bench.straggler's hang
figure runs the same)."""
from __future__ import annotations

import json

import pytest

from lightning_ft.bench.straggler import stop_in_exchange

TTL_S = 2.0


@pytest.mark.timeout(180)
def test_a_rank_stopped_inside_ftar_is_named_with_link_and_stack_within_ttl_plus_2s(etcd_endpoint, tmp_path):
    fig = stop_in_exchange(etcd_endpoint, str(tmp_path), ttl_s=TTL_S, report_after_s=0.5, timeout_s=120)
    d, st = fig.pop("event"), fig.pop("stopping")
    print(json.dumps(fig))
    assert st is not None, "replica 1 never reached the step's exchange"
    assert d is not None, "no hang diagnosis within the run's bound"
    assert (d["replica"], d["rank"], d["incarnation"], d["state"]) == (1, 0, 0, "T"), d
    assert fig["detect_s"] <= TTL_S + 2.0, fig
    # the link: a survivor waits to receive from r1, or is blocked sending to it
    assert fig["link_ok"], d["links"]
    assert "replica 1 rank 0" in d["reason"] and "stopped" in d["reason"] and "(link r" in d["reason"], d["reason"]
    # the stack of the stopped process, read while it was stopped: its own frames and its FTAR thread
    assert f"Process {st['pid']}" in d["stack"] and "plain_loop.py" in d["stack"], d["stack"]
    assert "ftar-r1-rank0" in d["stack"], d["stack"]
    assert fig["culprit_ok"] and fig["stack_ok"] and fig["within_target"]
