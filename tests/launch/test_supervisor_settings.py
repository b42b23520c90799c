"""launch/supervisor_settings.py: a supervisor is built from where the job runs and how it is
supervised; impossible combinations are refused before anything starts."""
from __future__ import annotations

import pytest

from lightning_ft.launch.supervisor_settings import Placement, SupervisorSettings, split


def test_split_sends_each_argument_to_its_value():
    place, st = split(job="j", replicas=3, nproc_per_replica=2, etcd="e:1", secret="s", run_dir="/r", wrap="w{rid}",
                      standby=1, hang_grace_s=0.5, downtime_steps={1: 4})
    assert place == Placement("j", 3, 2, "e:1", "s", "/r", wrap="w{rid}")
    assert (st.standby, st.hang_grace_s, dict(st.downtime_steps)) == (1, 0.5, {1: 4})


def test_an_unknown_argument_is_named():
    with pytest.raises(TypeError, match="hang_grace"):
        split(job="j", replicas=1, nproc_per_replica=1, etcd="", secret="", run_dir="", hang_grace=1.0)


@pytest.mark.parametrize("kw,match", [({"restart": "node"}, "restart='node'"), ({"standby": -1}, "standby=-1"),
                                      ({"standby": 1, "restart": "world"}, "world")])
def test_settings_that_cannot_work_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        SupervisorSettings(**kw)
