"""Hang diagnosis tables (coord/hang.py): who, which link, which direction, the stack."""
from __future__ import annotations

import pytest

from lightning_ft.coord.hang import Link, culprit_rank, diagnose, stalled_links, top_frame

STACK = """Process 4242: python examples/plain_loop.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    wait (threading.py:327)
    exchange (lightning_ft/replica/manager.py:783)
Thread 4250 (idle): "ftar-r2-rank0"
    _recv_all (lightning_ft/ftar/transport/tcp.py:183)
"""


def stall(left, right, rx=0, tx=0, age=0.5, waited=1.2):
    return {"left": left, "right": right, "waited_s": waited, "age_s": age,
            "links": {"active": True, "rx_outstanding": rx, "tx_outstanding": tx, "rx_done": 0, "tx_done": 0}}


@pytest.mark.parametrize("states, rank", [
    ({0: "S"}, 0),                      # nothing stopped: the leader, whose lease lapsed
    ({0: "S", 1: "T"}, 1),              # the stopped rank
    ({0: "T", 1: "T"}, 0),              # several stopped: the lowest
    ({0: "S", 1: "D", 2: "T"}, 2),      # stopped beats uninterruptible I/O
    ({0: "S", 1: "D"}, 1),
    ({}, 0),
])
def test_culprit_rank_is_the_stopped_one_else_the_leader(states, rank):
    assert culprit_rank(states) == rank


# Ring 0 -> 1 -> 2 -> 0 (each receives from its left). Replica 2 stopped.
CASES = [
    # r0 waits on its left (2): link 2 -> 0 rx; r1 waits on its left (0), which is stuck too
    ({0: stall(2, 1, rx=4096), 1: stall(0, 2, rx=4096)},
     [Link(2, 0, "rx", 4096, 0, 1.2), Link(0, 1, "rx", 4096, 1, 1.2)]),
    # r1 is blocked sending to 2 (its right): link 1 -> 2 tx
    ({0: stall(2, 1, rx=4096), 1: stall(0, 2, tx=8192)},
     [Link(2, 0, "rx", 4096, 0, 1.2), Link(1, 2, "tx", 8192, 1, 1.2)]),
    # the send tail (flush) counts as outstanding
    ({1: stall(0, 2, tx=-1)}, [Link(1, 2, "tx", -1, 1, 1.2)]),
    # stale reports (older than max_age_s) and the culprit's own are ignored
    ({0: stall(2, 1, rx=4096, age=99.0), 2: stall(1, 0, rx=1)}, []),
    # nothing outstanding: no link
    ({0: stall(2, 1), 1: stall(0, 2)}, []),
]


@pytest.mark.parametrize("stalls, links", CASES)
def test_links_waiting_on_the_stopped_replica_come_first(stalls, links):
    assert stalled_links(2, stalls, max_age_s=10.0) == links


def test_diagnosis_names_replica_rank_link_direction_and_stack():
    d = diagnose(2, {0: "T"}, {0: stall(2, 1, rx=4096), 1: stall(0, 2, tx=8192)}, {0: STACK},
                 pids={0: 4242}, max_age_s=10.0)
    assert (d.replica, d.rank, d.state) == (2, 0, "T")
    assert d.reason == ("replica 2 rank 0 (pid 4242) is stopped (SIGSTOP); its lease lapsed; "
                        "r0 waits to receive 4096 bytes from r2 (link r2 -> r0, rx); "
                        "r1 is blocked sending 8192 bytes to r2 (link r1 -> r2, tx); "
                        "its stack ends in exchange (lightning_ft/replica/manager.py:783)")
    ev = d.event()
    assert ev["links"][0] == {"from": 2, "to": 0, "direction": "rx", "outstanding": 4096, "seen_by": 0,
                              "waited_s": 1.2}
    assert "ftar-r2-rank0" in ev["stack"] and ev["stacks"] == {"0": STACK}


def test_diagnosis_without_links_or_stack_says_so():
    d = diagnose(1, {0: "S"}, {}, {0: "py-spy is not installed: pip install py-spy"})
    assert d.reason == ("replica 1 rank 0 is sleeping; its lease lapsed; no member reported an FTAR link waiting "
                        "(none was in an exchange, or none stalled longer than hang.report_after_s)")
    assert d.stack.startswith("py-spy is not installed")


def test_links_not_touching_the_culprit_are_reported_as_such():
    d = diagnose(3, {0: "S"}, {0: stall(2, 1, rx=10)}, {}, max_age_s=10.0)
    assert "no link names it; r0 waits to receive 10 bytes from r2" in d.reason


@pytest.mark.parametrize("stack, frame", [
    (STACK, "exchange (lightning_ft/replica/manager.py:783)"),  # below the stdlib's waits
    ("Thread 1 (idle)\n    inner (<string>:3)\n", "inner (<string>:3)"),
    ("Thread 1 (idle)\n    wait (threading.py:331)\n", "wait (threading.py:331)"),  # nothing of ours
    ("Error: Failed to get stack traces", ""),
    ("", ""),
])
def test_top_frame(stack, frame):
    assert top_frame(stack) == frame
