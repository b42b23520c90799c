"""A benched straggler's leader (coord/benched.py, Coordinator.quorum), in process on a MemoryStore:
benched, it gets the newest decision without waiting; its slow probe asks nothing of the others;
a ready one makes the decider's next round a full one, which takes it back."""
from __future__ import annotations

import threading

from lightning_ft.coord import keys
from lightning_ft.coord.coordinator import Coordinator
from lightning_ft.coord.membership import MembershipSettings
from lightning_ft.coord.round_records import JobSpec, Report
from lightning_ft.coord.store import MemoryStore

SPEC = JobSpec(3, 1, 5.0, {"job": "j"}, straggler_threshold=1.3, straggler_policy="exclude", straggler_window=1)


def together(cs, step, ms):
    """Every leader of `cs` calls quorum() at once, reporting compute `ms[rid]` of the previous round."""
    out: dict = {}

    def go(c):
        at = c.current.round if c.current is not None else -1
        out[c.rid] = c.quorum(step, timeout_s=5, synced=True, compute_ms=ms[c.rid], compute_round=at, compute_n=1)

    ts = [threading.Thread(target=go, args=(c,)) for c in cs]
    for t in ts:
        t.start()
    for t in ts:
        t.join(6)
    return [out[c.rid] for c in cs]


def test_a_benched_leader_waits_outside_probes_quietly_and_is_taken_back_when_ready():
    s = MemoryStore()
    cs = [Coordinator(s, "j", r, 0, SPEC, MembershipSettings(lease_ttl_s=1)) for r in range(3)]
    a, b, c = cs
    root = keys.root("/lft", "j")
    try:
        for x in cs:
            x.register(0, synced=True)
        step = 0
        for _ in range(6):  # r2 computes 4x: a suspect, then a straggler, benched
            qs = together(cs if c.outside is None else cs[:2], step, {0: 10.0, 1: 11.0, 2: 40.0})
            step += 1
            if c.outside is not None:
                break
        assert c.outside is not None, qs
        q = qs[0]
        assert q.members == (0, 1) and q.slow[0][0] == 2 and qs[2] == q  # it got the decision without it
        # benched: each ask returns at once with the newest decision; a slow probe is put, quietly
        got = c.quorum(step - 1, compute_ms=41.0, compute_round=-1, compute_n=0, probe_s=1.0, probing=True)
        assert got.members == (0, 1) and c.outside is not None
        rep = Report.from_json(s.get(keys.members(root, 2)).value)
        assert rep.bench == q.slow[0][1] and rep.compute_ms == 41.0 and rep.probe_s == 1.0
        assert not a.changed  # the decider's watch saw a probe that is not ready: steady rounds go on
        together(cs[:2], step, {0: 10.0, 1: 11.0})  # a round without it
        step += 1
        assert c.quorum(step - 2, compute_ms=40.0, compute_round=-1, compute_n=0, probe_s=1.0,
                        probing=True).members == (0, 1)
        # fast again over a whole span: put at once, and the decider's next round is a full one
        c.quorum(step - 2, compute_ms=11.0, compute_round=-1, compute_n=0, probe_s=1.0, probing=True)
        assert Report.from_json(s.get(keys.members(root, 2)).value).compute_ms == 11.0
        assert a.changed
        qa, qb = together(cs[:2], step, {0: 10.0, 1: 11.0})
        assert qa == qb and qa.members == (0, 1, 2) and qa.lagging == (2,) and qa.slow == ()
        assert qa.parole[0][0] == 2
        back = c.quorum(step - 2, compute_ms=11.0, compute_round=-1, compute_n=0, probe_s=1.0, probing=True)
        assert back == qa and c.outside is None and c.current == qa  # it adopted the round that has it
    finally:
        for x in cs:
            x.close()
        s.close()
