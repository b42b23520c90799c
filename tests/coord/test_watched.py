"""What the watches hand the round thread (coord/watched.py): which events make the next round
a full one, which are a member's failure, and what the round thread reads back."""
from __future__ import annotations

import json
import threading

from lightning_ft.coord import keys
from lightning_ft.coord.round_records import Quorum, Report
from lightning_ft.coord.store import Event
from lightning_ft.coord.watched import Watched

ROOT = keys.root("/lft", "j", "r1")
Q = Quorum(round=4, epoch=0, members=(0, 1, 2), incarnations=(0, 3, 0), max_step=9, contributors=(0, 1, 2),
           lagging=())


def put(key: str, value: bytes = b"") -> Event:
    return Event("put", key, value, 1)


def delete(key: str) -> Event:
    return Event("delete", key, b"", 1)


def alive(inc: int) -> bytes:
    return json.dumps({"incarnation": inc}).encode()


def test_an_eviction_of_a_member_is_a_failure_and_one_of_a_stranger_only_recorded():
    w = Watched(ROOT, rid=0)
    w.follow(Q)
    got = w.apply(put(keys.evict(ROOT, 1, 3), b"rank 0 exited with -9"))
    assert got == (True, (1, "evicted: rank 0 exited with -9"))
    assert w.apply(put(keys.evict(ROOT, 1, 2), b"old")) == (False, None)  # not the member's incarnation
    assert w.alive(Q) == [0, 2]
    assert w.reports() == ({}, {(1, 3), (1, 2)})


def test_a_lapsed_lease_is_a_failure_until_the_same_incarnation_is_back():
    w = Watched(ROOT, rid=0)
    w.follow(Q)
    assert w.apply(delete(keys.alive(ROOT, 2))) == (True, (2, "lease expired"))
    assert w.alive(Q) == [0, 1]
    assert w.apply(put(keys.alive(ROOT, 2), alive(0))) == (False, None)  # back from a lapse
    assert w.alive(Q) == [0, 1, 2]
    assert w.apply(put(keys.alive(ROOT, 2), alive(1))) == (True, None)  # a new incarnation replaces it


def test_a_joiner_changes_the_next_round_but_our_own_key_does_not():
    w = Watched(ROOT, rid=0)
    assert w.apply(put(keys.alive(ROOT, 5), alive(0))) == (False, None)  # no round yet: nothing to judge by
    w.follow(Q)
    assert w.apply(put(keys.alive(ROOT, 5), alive(0))) == (True, None)
    assert w.apply(put(keys.members(ROOT, 5), Report(5, 0, 0, 5).to_json())) == (True, None)
    assert w.apply(put(keys.members(ROOT, 1), Report(1, 3, 9, 5).to_json())) == (False, None)  # a member
    assert w.apply(put(keys.members(ROOT, 1), Report(1, 4, 9, 5).to_json())) == (True, None)  # its next incarnation
    assert sorted(w.reports()[0]) == [1, 5]
    w.apply(delete(keys.members(ROOT, 5)))
    assert sorted(w.reports()[0]) == [1]


def test_decisions_are_kept_by_round_until_forgotten():
    w = Watched(ROOT, rid=0)
    for r in (5, 7, 6):
        assert w.apply(put(keys.quorum(ROOT, r), f"q{r}".encode())) == (False, None)
    assert w.decision(6) == b"q6" and w.decision(4) is None
    assert w.decisions_after(5) == [(6, b"q6"), (7, b"q7")]
    w.forget_decisions(6)
    assert w.decisions_after(0) == [(7, b"q7")]


def test_following_a_round_prunes_the_dead_only_when_asked():
    w = Watched(ROOT, rid=0)
    w.follow(Q)
    w.apply(delete(keys.alive(ROOT, 1)))
    smaller = Quorum(round=5, epoch=0, members=(0, 2), incarnations=(0, 0), max_step=10, contributors=(0, 2),
                     lagging=())
    w.follow(smaller)  # a steady round: the dead are kept
    assert w.alive(Q) == [0, 2]
    w.follow(smaller, prune=True)  # an adopted round: the dead not in it are forgotten
    assert w.alive(Q) == [0, 1, 2]


def test_watch_threads_and_the_round_thread_share_it_without_losing_events():
    w = Watched(ROOT, rid=0)
    w.follow(Q)

    def writer(base: int) -> None:
        for i in range(500):
            w.apply(put(keys.quorum(ROOT, base + i), b"x"))

    threads = [threading.Thread(target=writer, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    seen = 0
    while any(t.is_alive() for t in threads):
        seen = max(seen, len(w.decisions_after(-1)))  # reads a consistent copy while they write
    for t in threads:
        t.join()
    assert len(w.decisions_after(-1)) == 2000 >= seen


def test_a_benched_stragglers_report_changes_the_next_round_only_once_it_is_ready():
    """Rule 14: a benched replica reports its probe now and then; the members' steady rounds go
    on until its pace over a whole span is within the threshold of the round's pace."""
    w = Watched(ROOT, rid=0, threshold=1.3)
    q = Quorum(round=40, epoch=1, members=(0, 1), incarnations=(0, 3), max_step=45, contributors=(0, 1),
               lagging=(), slow=((2, 30, 1),), pace_ms=20.0)
    w.follow(q)

    def probe(ms: float, span: float, bench: int = 30) -> Event:
        return put(keys.members(ROOT, 2), Report(2, 0, 35, 31, compute_ms=ms, probe_s=span, bench=bench,
                                                 bench_s=9.0).to_json())

    assert w.apply(probe(60.0, 1.0)) == (False, None)       # still 3x the pace
    assert w.apply(probe(-1.0, 0.5)) == (False, None)       # not a whole span yet
    assert w.apply(probe(22.0, 1.0, bench=7)) == (False, None)  # a probe of an earlier exclusion
    assert w.apply(probe(22.0, 1.0)) == (True, None)        # fast again: a full round decides
    assert w.apply(probe(-1.0, -1.0)) == (True, None)       # cannot probe: back after its span
    # a stranger that is not benched is a joiner, as before
    assert w.apply(put(keys.members(ROOT, 5), Report(5, 0, 0, 5).to_json())) == (True, None)
