"""Fast tests of the Fabric strategy's parts (lightning_ft/fabric): no etcd, no processes."""
from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_ft  # noqa: F401  (registers ft_hsdp)
from lightning_ft.fabric import checkpoints, compat
from lightning_ft.fabric.clip import DeferredClip, local_norm
from lightning_ft.fabric.loader import TrainLoader
from lightning_ft.fabric.loop_state import LoopState, fill, payload_of


@pytest.fixture
def replica_env(monkeypatch):
    """This process as rank 1 of W = 2 in replica 2 of R = 3 (launcher variables, no etcd touched)."""
    for k, v in {"LFT_JOB": "unit", "LFT_REPLICA_ID": "2", "LFT_NUM_REPLICAS": "3", "LFT_ETCD": "127.0.0.1:1",
                 "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)


def test_fabric_privates_exist():
    assert compat.missing() == []


def test_ft_hsdp_is_a_fabric_strategy_name_and_an_instance(replica_env):
    import lightning as L
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    from lightning_ft.fabric.strategy import FTHSDPStrategy

    assert "ft_hsdp" in STRATEGY_REGISTRY
    by_name = L.Fabric(strategy="ft_hsdp", accelerator="cpu", devices=1)
    by_instance = L.Fabric(strategy=FTHSDPStrategy(), accelerator="cpu")
    for fabric in (by_name, by_instance):
        assert isinstance(fabric.strategy, FTHSDPStrategy)
        # the job's world: R x W processes; this one is replica 2's rank 1
        assert (fabric.world_size, fabric.global_rank, fabric.local_rank) == (6, 5, 1)
        assert fabric.strategy.replica_world == 2 and fabric.strategy.replica_rank == 1
        assert fabric.strategy.launcher is None  # the launcher started the processes


def test_ft_hsdp_refuses_a_bad_replica_count(replica_env):
    from lightning_ft.fabric.join import FTFabricError
    from lightning_ft.fabric.strategy import FTHSDPStrategy

    with pytest.raises(FTFabricError, match="R must be an integer >= 1"):
        FTHSDPStrategy(replicas=0)


def test_caller_state_is_the_loops_own_dict_not_fabrics_copy(tmp_path):
    """Fabric hands strategies a copy of the state with its wrappers removed; the loop's counters
    change in its own dict, which `caller_state` finds."""
    import lightning as L
    from lightning.fabric.strategies import SingleDeviceStrategy

    seen = {}

    class Recording(SingleDeviceStrategy):
        def save_checkpoint(self, path, state, storage_options=None, filter=None):
            seen["save"], seen["save_arg"] = compat.caller_state("save"), state

        def load_checkpoint(self, path, state=None, strict=True, weights_only=None):
            seen["load"] = compat.caller_state("load")
            return {}

    fabric = L.Fabric(strategy=Recording(device=torch.device("cpu")), accelerator="cpu")
    model = fabric.setup(torch.nn.Linear(2, 2))
    state = {"model": model, "iter_num": 3}
    fabric.save(tmp_path / "x.pt", state)
    fabric.load(tmp_path / "x.pt", state)
    assert seen["save"] is state and seen["load"] is state and seen["save_arg"] is not state
    assert compat.caller_state("save") is None  # not called from Fabric.save


def _opt_and_sched():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return p, opt, sched


def test_loop_state_carries_counters_schedulers_and_learning_rate_to_a_late_replica(tmp_path):
    model = torch.nn.Linear(2, 2)
    p, opt, sched = _opt_and_sched()
    loader = DataLoader(TensorDataset(torch.zeros(4, 2)), batch_size=2)
    state = {"model": model, "optimizer": opt, "train_dataloader": loader, "iter_num": 0, "step_count": 0,
             "sched": sched, "name": "run"}
    live = LoopState(str(tmp_path), rid=0, writes=True)
    live.register(state, opt)
    for step in range(5):  # the top of the loop at committed step `step`
        live.snapshot(step, opt)
        state["iter_num"] += 4
        opt.step()
        sched.step()
        state["step_count"] += 1
    p2, opt2, sched2 = _opt_and_sched()
    late = {"model": model, "optimizer": opt2, "train_dataloader": loader, "iter_num": 0, "step_count": 0,
            "sched": sched2, "name": "run"}
    reader = LoopState(str(tmp_path), rid=1, writes=True)
    got = reader.wait(3, timeout_s=1.0, abandon=lambda: None)
    assert set(got["plain"]) == {"iter_num", "step_count", "name"}  # model, optimizer, loader: the replica layer's
    keys = fill(late, got, opt2)
    assert sorted(keys) == ["iter_num", "name", "sched", "step_count"]
    assert (late["iter_num"], late["step_count"]) == (12, 3)
    assert sched2.last_epoch == 3 and opt2.param_groups[0]["lr"] == pytest.approx(0.05)
    with pytest.raises(TimeoutError, match="the job finished"):
        reader.wait(99, timeout_s=5.0, abandon=lambda: "the job finished")


def test_loop_state_names_what_cannot_travel_and_warns_when_no_counter_moves(tmp_path, caplog):
    p, opt, _ = _opt_and_sched()

    class Opaque:
        pass

    state = {"optimizer": opt, "obj": Opaque(), "lr": 0.1}
    live = LoopState(str(tmp_path), rid=0, writes=True)
    with caplog.at_level("WARNING", logger="lightning_ft.fabric"):
        live.register(state, opt)
        for step in range(3):
            live.snapshot(step, opt)  # counters kept outside the dict: nothing in it moves
    text = caplog.text
    assert "['obj'] cannot be carried" in text
    assert "nothing in the state dict" in text and "outside that dict" in text
    assert "obj" not in payload_of(state, opt, {"obj"})["plain"]


def _loader(start, delivered, slot, rank, world=2, slots=3, n=48, bs=2):
    data = DataLoader(TensorDataset(torch.arange(n)), batch_size=bs, shuffle=True)
    return TrainLoader(data, slot, rank, world, slots, seed=5, shuffle=True, start=start, delivered=delivered)


def test_train_loader_splits_every_sample_once_over_slots_and_ranks():
    seen: list[int] = []
    for slot in range(3):
        for rank in range(2):
            got: list[int] = []
            loader = _loader(lambda: 0, got.append, slot, rank)
            assert len(loader) == 48 // 4 // 3  # micro-batches of B x W samples in the slot's share
            for (batch,) in loader:
                seen += batch.tolist()
            assert got == list(range(len(loader)))  # every delivered micro-batch, in order
    assert sorted(seen) == list(range(48))


def test_train_loader_starts_where_the_strategy_says_and_its_state_does_not_move_it():
    got: list[int] = []
    loader = _loader(lambda: 7, got.append, slot=1, rank=0)
    first = next(iter(loader))[0].tolist()
    assert got == [7] and first == loader.indices(7)
    loader.load_state_dict({"next": 0})
    assert loader.next == 8 and loader.state_dict()["next"] == 8 and loader.loaded == {"next": 0}


def test_deferred_clip_clips_when_applied_and_travels_with_a_catch_up():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 3.0)  # norm 6
    clip = DeferredClip(lambda: [p])
    clip.apply()
    assert torch.equal(p.grad, torch.full((4,), 3.0))  # the loop did not clip
    clip.record("norm", 1.0)
    assert float(local_norm([p], 2.0)) == pytest.approx(6.0)
    clip.apply()
    assert float(p.grad.norm()) == pytest.approx(1.0, rel=1e-5)
    p.grad = torch.full((4,), 3.0)
    clip.apply()  # applied already: a step without a clip call does not clip
    assert float(p.grad.norm()) == pytest.approx(6.0)
    late = DeferredClip(lambda: [p])
    late.load_state_dict(clip.state_dict())
    late.apply(last=True)  # a catch-up repeats the contributors' last clip
    assert float(p.grad.norm()) == pytest.approx(1.0, rel=1e-5)


def test_checkpoint_entry_points_and_plain_files(tmp_path):
    entry = {"step": 50, "replicas": 3, "cursors": {"0": 50, "1": 48, "2": 50}}
    assert checkpoints.point_of(entry, 3) == (50, {0: 50, 1: 48, 2: 50}, "ft_hsdp")
    assert checkpoints.point_of(entry, 2) == (50, {}, "foreign")
    assert checkpoints.point_of(None, 3) is None
    model = torch.nn.Linear(2, 2)
    _, opt, sched = _opt_and_sched()
    state = {"model": model, "optimizer": opt, "sched": sched, "iter_num": 8}
    path = tmp_path / "c.pth"
    torch.save(checkpoints.plain_state({**state, checkpoints.KEY: entry}, None), path)
    fresh = {"model": torch.nn.Linear(2, 2), "optimizer": _opt_and_sched()[1], "sched": sched, "iter_num": 0}
    rest = checkpoints.load_plain(path, fresh, strict=True, weights_only=None)
    assert fresh["iter_num"] == 8 and rest == {checkpoints.KEY: entry}
    assert torch.equal(fresh["model"].weight, model.weight)
    with pytest.raises(KeyError, match="'extra' is in the state"):
        checkpoints.load_plain(path, {"extra": 1}, strict=True, weights_only=None)
    checkpoints.write_json(str(tmp_path), "micro.json", {"micro": 4})
    assert checkpoints.read_json(str(tmp_path), "micro.json")["micro"] == 4
    assert checkpoints.read_json(str(tmp_path), "none.json") == {}
    assert not any(n.endswith(f".tmp{os.getpid()}") for n in os.listdir(tmp_path))
