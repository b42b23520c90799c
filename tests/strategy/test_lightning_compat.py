"""The Lightning privates lightning_ft uses (strategy/lightning_compat.py) exist in the installed
Lightning: an upgrade that moves one fails here, naming it, instead of inside a training job."""
from __future__ import annotations

import lightning
import lightning.pytorch as L
from lightning.pytorch.loggers import CSVLogger

from lightning_ft.strategy import lightning_compat


def test_every_private_we_use_exists(tmp_path):
    trainer = L.Trainer(accelerator="cpu", logger=CSVLogger(str(tmp_path)), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    gone = lightning_compat.missing(trainer)
    assert not gone, (f"Lightning {lightning.__version__} moved {gone}: update strategy/lightning_compat.py "
                      f"(what each is for: {lightning_compat.PRIVATES})")


def test_progress_counters_follow_the_job(tmp_path):
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path))
    lightning_compat.set_progress(trainer, automatic=True, steps=7, batches=(14, 4, 0), epoch=2)
    assert trainer.global_step == 7
    loop = trainer.fit_loop.epoch_loop
    assert loop.batch_progress.total.completed == 14 and loop.batch_progress.current.ready == 4
    assert trainer.current_epoch == 2
    lightning_compat.set_progress(trainer, automatic=False, steps=3)
    assert loop.manual_optimization.optim_step_progress.total.completed == 3


def test_a_checkpoint_written_by_lightning_has_the_batch_count_where_we_read_it(tmp_path):
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path))
    lightning_compat.set_progress(trainer, automatic=True, steps=5, batches=(10, 2, 0), epoch=1)
    state = {"loops": {"fit_loop": trainer.fit_loop.state_dict()}}
    assert lightning_compat.checkpoint_batches(state) == 10
    assert lightning_compat.checkpoint_batches({}) == -1
