"""The rdma transport without a device: the error where no device (or no pyverbs) exists,
device selection, and the classification of work-completion errors. The data path itself
runs in tests/ftar/test_engine.py's matrix (its rdma cases skip here with the reason)."""
from __future__ import annotations

import pytest

from lightning_ft.ftar.engine import FTAR, FTARSettings
from lightning_ft.ftar.transport import rdma
from lightning_ft.ftar.transport.base import FatalError, RecoverableError


def test_rdma_without_a_device_fails_at_start_with_the_reason():
    if not rdma.rdma_skip_reason():
        pytest.skip("this host has an RDMA device: ftar.transport=rdma works here")
    with pytest.raises(FatalError) as e:
        FTAR("j", 0, 0, "s", FTARSettings(transport="rdma"))
    assert str(e.value) == rdma.rdma_skip_reason()
    assert "ftar.transport=rdma needs" in str(e.value)
    assert not rdma.device_present()


@pytest.mark.parametrize("status,kind", [
    (0, None), (12, RecoverableError), (13, RecoverableError), (10, RecoverableError), (5, RecoverableError),
    (16, RecoverableError), (20, RecoverableError), (1, FatalError), (2, FatalError), (4, FatalError),
    (8, FatalError), (19, FatalError), (21, FatalError), (99, FatalError),
])
def test_work_completion_errors_are_recoverable_for_peers_and_fatal_for_local_faults(status, kind):
    err = rdma.classify(status, vendor_err=0x12, where=" on the link with the right neighbour")
    if kind is None:
        assert err is None
    else:
        assert type(err) is kind
        assert "right neighbour" in str(err) and "0x12" in str(err)


def test_every_status_is_classified_and_names_match_pyverbs_where_installed():
    assert set(rdma.WC_STATUS) == set(range(22))
    assert rdma.RECOVERABLE <= set(rdma.WC_STATUS.values())
    try:
        import pyverbs.enums as e
    except ImportError:
        pytest.skip(rdma.NO_PYVERBS)
    for code, name in rdma.WC_STATUS.items():
        assert int(getattr(e, f"IBV_WC_{name}")) == code


def test_device_selection_takes_the_named_device_or_the_first():
    assert rdma.select_device(["mlx5_0", "mlx5_1"]) == "mlx5_0"
    assert rdma.select_device(["mlx5_0", "mlx5_1"], "mlx5_1") == "mlx5_1"
    with pytest.raises(FatalError, match="LFT_RDMA_DEVICE='mlx5_9' is not an RDMA device here; ibv_devices lists "
                                         "mlx5_0, mlx5_1"):
        rdma.select_device(["mlx5_0", "mlx5_1"], "mlx5_9")
    with pytest.raises(FatalError, match="ibv_devices` lists none"):
        rdma.select_device([])
