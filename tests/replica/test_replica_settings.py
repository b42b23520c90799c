"""replica/settings.py: the manager's knobs come from the job config's sections, an override
names a real field, and a bad mode is refused before anything starts."""
from __future__ import annotations

import pytest
import torch

from lightning_ft.config import load_config
from lightning_ft.replica.replica import Replica
from lightning_ft.replica.settings import Identity, Settings


def test_from_config_reads_each_section():
    cfg = load_config(None, ["etcd.lease_ttl_s=7", "ftar.num_chunks=8", "quorum.init_timeout_s=3",
                             "consistency.every_n_steps=5", "checkpoint.every_n_steps=50", "batch_policy=constant",
                             "lr_intervention=linear", "stragglers.policy=exclude", "hang.report_after_s=0.5"])
    s = Settings.from_config(cfg)
    assert (s.lease_ttl_s, s.num_chunks, s.init_timeout_s) == (7.0, 8, 3.0)
    assert (s.digest_every, s.checkpoint_every, s.batch_policy, s.lr_intervention) == (5, 50, "constant", "linear")
    assert s.stragglers.policy == "exclude" and s.hang_report_after_s == 0.5
    assert s.fingerprint is not None and s.fingerprint["num_chunks"] == 8


def test_an_override_must_name_a_setting():
    cfg = load_config(None, [])
    assert Settings.from_config(cfg, sync_timeout_s=5.0).sync_timeout_s == 5.0
    with pytest.raises(TypeError, match="unknown replica setting.*lease_ttl"):
        Settings.from_config(cfg, lease_ttl=1.0)


@pytest.mark.parametrize("field,value", [("lr_intervention", "cubic"), ("batch_policy", "elastic")])
def test_a_mode_that_does_not_exist_is_refused(field, value):
    with pytest.raises(ValueError, match=value):
        Settings(**{field: value})


def test_the_replica_reads_its_identity_and_settings():
    model = torch.nn.Linear(3, 2)
    m = Replica(model, torch.optim.SGD(model.parameters(), lr=0.1), Identity("j", 2, 1, 4, "s" * 16),
                Settings(min_replicas=2, lr_intervention="none"))
    assert (m.job, m.rid, m.incarnation, m.R, m.rank, m.world) == ("j", 2, 1, 4, 0, 1)
    assert m.spec.min_replicas == 2 and m.spec.fingerprint["lr_intervention"] == "none"
    assert not m.started
