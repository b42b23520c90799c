"""lightning_ft/constants.py: each shared value is defined once, and every layer that takes one
accepts exactly its members (a new member without a meaning fails here, not in a job)."""
from __future__ import annotations

import math

import pytest

from lightning_ft.callbacks.lr import LRIntervention
from lightning_ft.config import ConfigError, load_config
from lightning_ft.constants import BatchPolicy, ExitCode, LRMode, Role
from lightning_ft.coord.quorum import adopt_role
from lightning_ft.coord.round_records import Quorum
from lightning_ft.replica.batch_policy import round_batches
from lightning_ft.replica.plan import lr_factor


@pytest.mark.parametrize("mode,want", [(LRMode.NONE, 1.0), (LRMode.LINEAR, 0.25), (LRMode.SQRT, 0.5)])
def test_every_lr_mode_has_a_factor_and_the_config_and_callback_accept_it(mode, want):
    assert list(LRMode) == [LRMode.NONE, LRMode.LINEAR, LRMode.SQRT]
    assert lr_factor(mode, 1, 4) == pytest.approx(want) and lr_factor(str(mode), 4, 4) == 1.0
    assert load_config(overrides=[f"lr_intervention={mode.value}"]).lr_intervention == mode
    LRIntervention(mode.value)


def test_an_unknown_lr_mode_or_batch_policy_is_refused_everywhere():
    with pytest.raises(ValueError, match="not one of"):
        lr_factor("cube", 1, 2)
    with pytest.raises(ValueError, match="not one of"):
        LRIntervention("cube")
    with pytest.raises(ConfigError, match="allowed values are 'none', 'linear', 'sqrt'"):
        load_config(overrides=["lr_intervention=cube"])
    with pytest.raises(ConfigError, match="allowed values are 'shrink', 'constant'"):
        load_config(overrides=["batch_policy=grow"])
    with pytest.raises(ValueError):
        round_batches("grow", [0, 1], {0: 3, 1: 4}, 2)


@pytest.mark.parametrize("policy", list(BatchPolicy))
def test_every_batch_policy_plans_a_round(policy):
    assert load_config(overrides=[f"batch_policy={policy.value}"]).batch_policy == policy
    rb = round_batches(policy, [0], {0: 3, 1: 4}, 2, slot_cursors=[3, 4])
    assert rb.batches[0] == 3
    assert (1 in rb.batches) == (policy == BatchPolicy.CONSTANT)  # the absent slot is trained too


def test_roles_are_their_strings_and_cover_both_round_kinds():
    common = dict(epoch=1, members=(0, 1), incarnations=(0, 0), max_step=5)
    train = Quorum(round=1, contributors=(0,), lagging=(1,), kind="train", slow=((2, 1, 1),), **common)
    sync = Quorum(round=2, contributors=(1,), lagging=(0,), kind="sync", **common)  # source: replica 1
    got = {adopt_role(train, 0), adopt_role(train, 1), adopt_role(sync, 1), adopt_role(sync, 0), adopt_role(train, 2)}
    assert got == set(Role) and all(isinstance(r, str) for r in got)
    assert adopt_role(train, 1) == "catchup" and adopt_role(sync, 0) == "adopt" and adopt_role(train, 2) == "bench"


def test_exit_codes_are_distinct_and_a_halt_is_not_a_common_program_code():
    codes = [int(c) for c in ExitCode]
    assert len(set(codes)) == len(codes)
    assert ExitCode.HALTED not in (0, 1, 2, 3, 127, 128 + 9, 128 + 15)
    assert f"{ExitCode.HALTED}" == "86" and math.isclose(ExitCode.TIMEOUT, 124)
