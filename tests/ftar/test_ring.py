"""The pure ring schedule: geometry and a full simulation of N virtual ranks."""
from __future__ import annotations

import numpy as np
import pytest

from lightning_ft.ftar.ring import Span, chunks, neighbours, partition_numel, partitions, schedule, segments


def simulate(bufs: list[np.ndarray], S: int, C: int) -> list[np.ndarray]:
    """Run the schedule on N in-memory ranks; returns what every rank ends with."""
    n = len(bufs)
    out = [b.copy() for b in bufs]
    es = bufs[0].itemsize
    for part in partitions(len(bufs[0]), es, n, S, C):
        segs = segments(part, n)
        plans = [schedule(n, i) for i in range(n)]
        # Sum in the ring order the schedule implies, step by step, all ranks in lockstep.
        acc = [{} for _ in range(n)]  # per rank: seg -> running partial sum (what it would send)
        for s in range(2 * (n - 1)):
            sent = {}
            for i in range(n):
                st = plans[i][s]
                seg = segs[st.send_seg]
                if st.phase == "rs":
                    data = acc[i].get(st.send_seg, out[i][seg.start:seg.end].copy())
                else:
                    data = out[i][seg.start:seg.end].copy()
                assert len(data) == seg.numel
                assert sum(c.numel for c in chunks(seg, es, S)) == seg.numel
                assert all(c.numel * es <= max(S, es) for c in chunks(seg, es, S))
                assert len(chunks(seg, es, S)) <= C
                sent[neighbours(n, i)[1]] = (st.send_seg, st.phase, data)
            for i in range(n):
                st = plans[i][s]
                seg_id, phase, data = sent[i]
                assert (seg_id, phase) == (st.recv_seg, st.phase), "sender and receiver disagree"
                seg = segs[seg_id]
                if st.phase == "rs":
                    acc[i][seg_id] = data + out[i][seg.start:seg.end]
                    if st.last_rs:
                        out[i][seg.start:seg.end] = acc[i][seg_id]
                        assert seg_id == (i + 1) % n
                else:
                    out[i][seg.start:seg.end] = data
    return out


@pytest.mark.parametrize("n", range(1, 17))
@pytest.mark.parametrize("numel", [0, 1, 7, 97, 1000, 4099])
def test_schedule_sums_and_all_ranks_end_identical(n, numel):
    rng = np.random.default_rng(n * 10007 + numel)
    bufs = [rng.integers(-1000, 1000, numel).astype(np.int64) for _ in range(n)]
    S, C = 24, 3  # 3 int64 per chunk: partitions of 9*n elements, many of them
    res = simulate(bufs, S, C)
    want = np.sum(bufs, axis=0) if numel else np.zeros(0, np.int64)
    for r in res:
        assert np.array_equal(r, want)


@pytest.mark.parametrize("n", range(1, 17))
def test_each_rank_sends_and_receives_each_foreign_segment_once_per_phase(n):
    for i in range(n):
        plan = schedule(n, i)
        assert len(plan) == 2 * (n - 1)
        rs = [s for s in plan if s.phase == "rs"]
        ag = [s for s in plan if s.phase == "ag"]
        assert sorted(s.recv_seg for s in rs) == sorted(set(range(n)) - {i})
        assert sorted(s.recv_seg for s in ag) == sorted(set(range(n)) - {(i + 1) % n})
        assert [s.last_rs for s in rs] == [False] * (n - 2) + [True] if n > 1 else True
        if n > 1:
            assert ag[0].send_seg == rs[-1].recv_seg == (i + 1) % n  # forward what it just finished


def test_partitions_respect_the_byte_cap_and_cover_everything():
    for numel in [0, 1, 5, 4096, 4097, 123457]:
        for n in [1, 2, 3, 7]:
            parts = partitions(numel, 4, n, 1024, 4)
            assert sum(p.numel for p in parts) == numel
            assert all(p.numel * 4 <= 1024 * 4 * n for p in parts)
            assert [p.start for p in parts] == [sum(q.numel for q in parts[:j]) for j in range(len(parts))]
    assert partition_numel(4, 3, 1024, 4) == 3072


def test_segments_are_balanced_and_contiguous():
    segs = segments(Span(10, 11), 4)
    assert [s.numel for s in segs] == [3, 3, 3, 2]
    assert [s.start for s in segs] == [10, 13, 16, 19]
    assert [s.numel for s in segments(Span(0, 2), 5)] == [1, 1, 0, 0, 0]


def test_chunks_of_tiny_chunk_bytes_still_hold_one_element():
    assert chunks(Span(0, 3), 4, 1) == [Span(0, 1), Span(1, 1), Span(2, 1)]
    assert chunks(Span(5, 0), 4, 16) == []


def test_bad_geometry_is_rejected():
    with pytest.raises(ValueError, match="invalid ring geometry"):
        partitions(10, 4, 0, 16, 1)
    with pytest.raises(ValueError, match="out of range"):
        schedule(3, 3)
