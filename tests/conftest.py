"""Shared fixtures: a real etcd server per test module, and process cleanup by PID."""
from __future__ import annotations

import os
import signal

import pytest

from lightning_ft.coord.etcd_server import EtcdServer


@pytest.fixture(scope="module")
def etcd_server():
    srv = EtcdServer().start()
    yield srv
    srv.cleanup()


@pytest.fixture
def etcd_endpoint(etcd_server) -> str:
    return etcd_server.endpoint


@pytest.fixture
def procs():
    """A list to append subprocess.Popen objects to; every one is SIGKILLed (and SIGCONTed
    first, in case a test stopped it) at teardown."""
    started: list = []
    yield started
    for p in started:
        if p.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass
            try:
                p.wait(5)
            except Exception:
                pass


# -- `make check`: the inner loop ---------------------------------------------------------------
# `make check` runs the pure and unit tests (-m "not slow and not integration", 3 minutes or
# less); `make test` runs everything but `slow`. A test is an integration test when it starts a
# real etcd or real processes: it uses a fixture of INTEGRATION_FIXTURES (ours above and the
# modules' own: etcd clusters, FTAR worker processes, coordinator leader processes), one of its
# parameters names etcd (tests/coord/test_store.py runs each test on memory, etcd and a cluster),
# or its module or itself is in INTEGRATION_TESTS (it starts them through its own helpers: localjob,
# runs.py, the CLI, a Python subprocess...). A new test that starts processes another way goes into
# the list; `make check` prints its slowest tests.
INTEGRATION_FIXTURES = frozenset({"etcd_server", "etcd_endpoint", "etcd_cluster", "own_etcd", "cluster", "secure",
                                  "procs", "workers", "leaders"})
INTEGRATION_TESTS = frozenset({
    "acceptance",  # a directory: every module under it; FILE::TEST names one test
    "bench/test_bench_smoke.py",
    "bench/test_goodput_e2e.py::test_end_to_end_bench_trains_n_steps_of_work_in_all_three_jobs",
    "bench/test_recovery_stall.py",
    "bench/test_soak.py",
    "coord/test_etcd_server.py",
    "examples",
    "ftar/test_device_path.py",
    "launch/test_cli.py",
    "launch/test_multihost.py",
    "launch/test_partitions.py",
    "launch/test_run.py",
    "ops/test_ops.py::test_importing_ops_does_not_import_the_triton_kernels",
    "ops/test_triton_interpret.py",
    "replica/test_catchup.py::test_throughput_100mb",  # a throughput floor: meaningless on a loaded host
    "replica/test_group.py::test_three_ranks_agree_and_every_rank_raises_the_leaders_exception",
    "replica/test_replica.py",
    "replica/test_supervised.py",
    "replica/test_wide_replicas.py",
    "sim/test_gloo_probe.py",
    "strategy/test_evaluation.py",
    "strategy/test_rewind.py",
    "strategy/test_self_launch_units.py::test_a_trainer_without_launcher_variables_builds_the_self_launch_command",
    "strategy/test_strategy_units.py::test_a_partial_launcher_environment_is_an_error_not_a_self_launch",
    "strategy/test_strategy_units.py::test_import_registers_ft_hsdp_without_importing_lightning",
    "strategy/test_strategy_units.py::test_without_launcher_variables_a_program_that_is_no_script_file_is_told_how_to_launch",
    "study/test_study_runner.py",
    "test_network.py::test_a_replica_advertising_loopback_to_a_routable_etcd_exits_with_the_reason",
})

_TESTS = os.path.dirname(os.path.abspath(__file__))


def _integration(item: pytest.Item) -> bool:
    if INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    callspec = getattr(item, "callspec", None)
    if callspec is not None and any("etcd" in str(v) for v in callspec.params.values()):
        return True
    rel = os.path.relpath(str(item.path), _TESTS).replace(os.sep, "/")
    name = f"{rel}::{getattr(item, 'originalname', item.name)}"
    return any(rel == m or rel.startswith(m + "/") or name == m for m in INTEGRATION_TESTS)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _integration(item):
            item.add_marker(pytest.mark.integration)
