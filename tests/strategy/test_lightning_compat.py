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


def test_the_cli_config_is_saved_by_replica_0_once_and_restarts_overwrite_their_own(tmp_path):
    """LightningCLI's SaveConfigCallback: replica 0 writes config.yaml (refusing another run's
    file on its first start, as under DDP), a restart rewrites its own, the others never write."""
    from types import SimpleNamespace

    from lightning.pytorch.cli import SaveConfigCallback

    def trainer():
        return SimpleNamespace(callbacks=[SaveConfigCallback(parser=None, config=None), L.Callback()])

    first, other, restarted = trainer(), trainer(), trainer()
    assert lightning_compat.save_cli_config_once(first, writer=True, overwrite=False) == 1
    assert (first.callbacks[0].already_saved, first.callbacks[0].overwrite) == (False, False)
    lightning_compat.save_cli_config_once(other, writer=False, overwrite=True)
    assert other.callbacks[0].already_saved
    lightning_compat.save_cli_config_once(restarted, writer=True, overwrite=True)
    assert (restarted.callbacks[0].already_saved, restarted.callbacks[0].overwrite) == (False, True)
