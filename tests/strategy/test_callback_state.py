"""Lightning callbacks' state travels with a catch-up (strategy/callback_state.py)."""
from __future__ import annotations

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from lightning_ft.replica.catchup.wire import check_meta
from lightning_ft.strategy.callback_state import CallbackState


def _trainer(tmp_path, ckpt: ModelCheckpoint, stop: EarlyStopping) -> L.Trainer:
    return L.Trainer(accelerator="cpu", callbacks=[ckpt, stop], logger=False, enable_progress_bar=False,
                     default_root_dir=str(tmp_path))


def test_a_caught_up_replica_knows_the_top_k_and_the_patience_of_its_source(tmp_path):
    src_ckpt = ModelCheckpoint(dirpath=str(tmp_path), monitor="val_loss", save_top_k=2)
    src_stop = EarlyStopping(monitor="val_loss", patience=5)
    src = _trainer(tmp_path, src_ckpt, src_stop)
    src_ckpt.best_k_models = {str(tmp_path / "a.ckpt"): torch.tensor(0.5), str(tmp_path / "b.ckpt"): torch.tensor(0.4)}
    src_ckpt.kth_best_model_path, src_ckpt.kth_value = str(tmp_path / "a.ckpt"), torch.tensor(0.5)
    src_ckpt.best_model_path, src_ckpt.best_model_score = str(tmp_path / "b.ckpt"), torch.tensor(0.4)
    src_stop.wait_count, src_stop.best_score = 3, torch.tensor(0.4)
    encoded = CallbackState(lambda: src).state_dict()
    assert isinstance(encoded, str)
    meta = check_meta({"param_groups": [], "callbacks": encoded}, [])  # what a fetcher accepts

    ckpt = ModelCheckpoint(dirpath=str(tmp_path), monitor="val_loss", save_top_k=2)
    stop = EarlyStopping(monitor="val_loss", patience=5)
    CallbackState(lambda: _trainer(tmp_path, ckpt, stop)).load_state_dict(meta["callbacks"])
    assert set(ckpt.best_k_models) == set(src_ckpt.best_k_models)
    assert ckpt.kth_best_model_path == src_ckpt.kth_best_model_path and float(ckpt.kth_value) == 0.5
    assert ckpt.best_model_path == src_ckpt.best_model_path
    assert stop.wait_count == 3 and torch.equal(stop.best_score, src_stop.best_score)


def test_no_callbacks_no_state_and_a_refused_state_is_skipped(tmp_path):
    bare = L.Trainer(accelerator="cpu", callbacks=[], logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    assert CallbackState(lambda: bare).state_dict() is None
    assert CallbackState(lambda: None).state_dict() is None
    stop = EarlyStopping(monitor="val_loss", patience=5)
    stop.wait_count = 2
    CallbackState(lambda: _trainer(tmp_path, ModelCheckpoint(dirpath=str(tmp_path)), stop)).load_state_dict(
        "bm90IGEgdG9yY2ggZmlsZQ==")  # not a torch file: warned, nothing changes
    assert stop.wait_count == 2
