"""Stream loaders in one process (lightning_ft/strategy/streaming.py, data_shards.py): the split over
slots and ranks is a partition, and a rank's stream resumes exactly where its slot left off after a
kill, a rewind or a catch-up, with workers and prefetching on. A small simulated trainer stands in
for Lightning: it prefetches one batch, takes tags in order and commits the batch at the cursor."""
from __future__ import annotations

import pytest
from torch.utils.data import IterableDataset

from lightning_ft.config import load_config
from lightning_ft.replica.loader_state import StateFile, StateFiles
from lightning_ft.strategy.data_shards import ShardedIterable, shard
from lightning_ft.strategy.streaming import StreamDataError, StreamLoader, StreamPart, stream_loader
from tests.strategy.id_streams import IdStream, build_litdata, make_loader, reference


class Sim:
    """Lightning's use of the train stream: one batch prefetched, tags taken in order; a slot
    batch commits when its last micro-batch arrives at the cursor."""

    def __init__(self, sl: StreamLoader, box: list[int], step: int = 0) -> None:
        self.sl, self.box, self.step = sl, box, step
        self.got: dict[tuple[int, int], list[int]] = {}

    def run(self, commits: int, move: dict[int, int] | None = None) -> "Sim":
        """Commit `commits` slot batches; `move`: {after this many commits: set the cursor to}."""
        it = iter(self.sl)
        buf = [next(it)]
        done = 0
        while done < commits:
            batch = buf.pop(0)
            buf.append(next(it))
            k, j = self.sl.tags.popleft()
            if k != self.box[0]:
                continue  # stale or already trained: the strategy discards it
            self.got[(k, j)] = [int(i) for i in batch["id"]]
            if j == self.sl.micro - 1:
                self.box[0] += 1
                self.step += 1
                done += 1
                self.sl.committed(self.step, self.box[0])
                if move and done in move:
                    self.box[0] = move.pop(done)
        self.sl.writer.flush()
        return self


def loader(tmp_path, kind="torchdata", n=240, workers=2, slot=1, slots=3, micro=1, box=None, data="",
           state_every=1, ckpt_every=5, say=None):
    dl = make_loader(kind, n, workers, data)
    shard(dl, slot, 0, slots, 1, "processes")
    box = box if box is not None else [0]
    files = StateFiles(str(tmp_path / "states"), slot, 0, slots=slots, world=1)
    return StreamLoader(dl, StreamPart(slot, 0, 1, slots, micro), cursor=lambda: box[0],
                        files=files, state_every=state_every, checkpoint_every=ckpt_every,
                        say=say or (lambda m: None)), box


def expected(kind, n, workers, slot, slots, batches, data=""):
    return reference(kind, n, workers, slots, 1, data, batches=batches)(slot, 0)


def test_sharded_iterable_splits_a_stream_exactly_over_processes_for_any_shape():
    for slots in (1, 2, 3):
        for world in (1, 2):
            parts = [list(ShardedIterable(IdStream(50), s * world + r, slots * world))
                     for s in range(slots) for r in range(world)]
            ids = sorted(x["id"] for p in parts for x in p)
            assert ids == list(range(50)), (slots, world)


def test_slots_mode_splits_a_rank_aware_dataset_over_replicas_only():
    class RankAware(IterableDataset):  # splits over the replica's ranks itself, as under DDP
        def __init__(self, rank, world):
            self.rank, self.world = rank, world

        def __iter__(self):
            return iter(range(self.rank, 40, self.world))

    parts = [list(ShardedIterable(RankAware(r, 2), s, 3)) for s in range(3) for r in range(2)]
    assert sorted(i for p in parts for i in p) == list(range(40))


def test_torchdata_split_with_workers_is_a_partition_of_the_dataset():
    read = reference("torchdata", 120, 2, 3, 2, batches=6)  # 20 ids per process: 4+4+2 from each of 2 workers
    ids = sorted(i for s in range(3) for r in range(2) for b in read(s, r) for i in b)
    assert ids == list(range(120))


@pytest.fixture(scope="module")
def lit_dir(tmp_path_factory):
    return build_litdata(str(tmp_path_factory.mktemp("lit") / "ids"), 240)


def test_litdata_split_over_slots_and_ranks_is_a_partition(lit_dir):
    for slots, world in ((3, 1), (2, 2)):
        per = 240 // (slots * world) // 4
        read = reference("litdata", 240, 1, slots, world, lit_dir, batches=per)
        ids = sorted(i for s in range(slots) for r in range(world) for b in read(s, r) for i in b)
        assert ids == list(range(240)), (slots, world)


@pytest.mark.parametrize("state_every", [1, 4])
def test_torchdata_stream_resumes_at_the_next_uncommitted_batch_after_a_kill(tmp_path, state_every):
    ref = expected("torchdata", 240, 2, 1, 3, 30)
    said = []
    sl, box = loader(tmp_path, state_every=state_every)
    first = Sim(sl, box).run(13)
    sl.close()  # the process dies: only the files remain
    sl2, box2 = loader(tmp_path, box=[13], state_every=state_every, say=said.append)
    second = Sim(sl2, box2, step=13).run(10)
    got = {**first.got, **second.got}
    assert sorted(got) == [(k, 0) for k in range(23)]
    assert all(got[(k, 0)] == ref[k] for k in range(23))
    skipped = 13 - max(c for c in range(14) if c % state_every == 0)  # states at committed steps divisible
    assert f"train stream at slot batch 13: restored from the state saved at slot batch {13 - skipped}, " \
           f"skipped {skipped}" in said[0], said


def test_a_rewind_restores_the_state_pinned_at_the_checkpoint_step(tmp_path):
    ref = expected("torchdata", 240, 2, 1, 3, 30)
    said = []
    sl, box = loader(tmp_path, state_every=0, ckpt_every=5, say=said.append)
    sim = Sim(sl, box).run(18, move={12: 10})  # 12 committed, then the job rewinds to the checkpoint at 10
    assert StateFile(10, 10) in sl.files.list()
    assert any("train stream at slot batch 10: restored from the state kept in memory at slot batch 10, skipped 0"
               in m for m in said), said
    assert all(sim.got[(k, 0)] == ref[k] for k in range(16))


def test_a_catch_up_past_prefetched_batches_continues_at_the_cursor(tmp_path):
    ref = expected("torchdata", 240, 2, 1, 3, 30)
    sl, box = loader(tmp_path)
    sim = Sim(sl, box).run(12, move={5: 8})  # others committed this slot's 5..7 (a failed commit here)
    assert sorted(sim.got) == [(k, 0) for k in list(range(5)) + list(range(8, 15))]
    assert all(v == ref[k] for (k, _), v in sim.got.items())


def test_accumulation_delivers_whole_slot_batches_of_micro_batches(tmp_path):
    ref = expected("torchdata", 240, 2, 1, 3, 30)
    sl, box = loader(tmp_path, micro=2)
    first = Sim(sl, box).run(6)
    sl.close()
    sl2, box2 = loader(tmp_path, micro=2, box=[6])
    second = Sim(sl2, box2, step=6).run(4)
    got = {**first.got, **second.got}
    assert sorted(got) == [(k, j) for k in range(10) for j in range(2)]
    assert all(got[(k, j)] == ref[2 * k + j] for k in range(10) for j in range(2))


def test_passes_of_the_user_loader_are_chained_into_one_stream(tmp_path):
    # 48 ids over 3 slots: 4 batches of 4 per pass; 10 slot batches span three passes
    sl, box = loader(tmp_path, n=48, workers=0)
    sim = Sim(sl, box).run(10)
    one_pass = expected("torchdata", 48, 0, 1, 3, 4)
    assert [sim.got[(k, 0)] for k in range(10)] == (one_pass * 3)[:10]
    sl.close()
    sl2, box2 = loader(tmp_path, n=48, workers=0, box=[10])  # resumes mid-stream, two passes later
    assert Sim(sl2, box2, step=10).run(3).got[(10, 0)] == one_pass[2]


def test_litdata_stream_resumes_exactly_after_a_kill_and_a_rewind(tmp_path, lit_dir):
    ref = expected("litdata", 240, 1, 1, 3, 20, lit_dir)
    sl, box = loader(tmp_path, kind="litdata", workers=1, data=lit_dir, ckpt_every=5)
    first = Sim(sl, box).run(9)
    sl.close()
    sl2, box2 = loader(tmp_path, kind="litdata", workers=1, data=lit_dir, box=[9], ckpt_every=5)
    second = Sim(sl2, box2, step=9).run(8, move={3: 5})  # then a rewind to the checkpoint at step 5
    assert all(first.got[(k, 0)] == ref[k] for k in range(9))
    assert {k for k, _ in second.got} == set(range(5, 12))  # 9..11, then 5..9 again from the pinned state
    assert all(v == ref[k] for (k, _), v in second.got.items())
    sl2.close()


def _cfg(*overrides):
    return load_config(None, list(overrides))


def test_a_plain_iterable_is_refused_with_why_and_the_stateful_loaders(tmp_path):
    with pytest.raises(StreamDataError) as e:
        stream_loader(make_loader("plain", 40, 0), cfg=_cfg(), slot=0, rank=0, world=1, slots=2, micro=1,
                      cursor=lambda: 0, state_root=str(tmp_path))
    msg = str(e.value)
    for part in ("exactly once", "DataLoader over PlainIdStream", "state_dict()", "StatefulDataLoader",
                 "litdata.StreamingDataLoader", "data.exactly_once=false", "at-least-once"):
        assert part in msg, msg


def test_exactly_once_false_trains_a_plain_iterable_at_least_once_and_says_so(tmp_path, capsys):
    box = [0]
    sl = stream_loader(make_loader("plain", 40, 0), cfg=_cfg("data.exactly_once=false"), slot=1, rank=0, world=1,
                       slots=2, micro=1, cursor=lambda: box[0], state_root=str(tmp_path))
    assert "AT-LEAST-ONCE" in capsys.readouterr().err
    it = iter(sl)
    first = [next(it)["id"].tolist() for _ in range(2)]
    assert first == [[1, 3, 5, 7], [9, 11, 13, 15]]  # split by slot all the same
    assert [sl.tags.popleft() for _ in range(2)] == [(0, 0), (1, 0)]
    assert not (tmp_path / "slot_001").exists()  # nothing to save


def test_data_config_knobs_are_checked():
    assert _cfg().data.exactly_once is True and _cfg().data.shard == "processes"
    with pytest.raises(Exception, match="data.shard"):
        _cfg("data.shard=ranks")
    with pytest.raises(Exception, match="expects bool"):
        _cfg("data.exactly_once=3")


@pytest.mark.parametrize("bad, match", [
    (dict(slot=3, rank=0, world=1, slots=3, micro=1), "slot 3 of 3, rank 0 of 1: out of range"),
    (dict(slot=0, rank=2, world=2, slots=3, micro=1), "slot 0 of 3, rank 2 of 2: out of range"),
    (dict(slot=0, rank=0, world=1, slots=1, micro=0), "micro >= 1"),
    (dict(slot=0, rank=0, world=0, slots=1, micro=1), "world=0"),
])
def test_stream_part_refuses_a_slot_or_rank_out_of_range(bad, match):
    with pytest.raises(ValueError, match=match):
        StreamPart(**bad)
