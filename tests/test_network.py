"""Which address listeners advertise (lightning_ft/network.py): the routable one by default,
and never loopback or an unspecified address when etcd is not on loopback (issue 10 §1)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lightning_ft.bench.localjob import LOOP, TEST_SECRET
from lightning_ft.coord.etcd_server import EtcdServer
from lightning_ft.network import AddressError, advertised, route_to


def routable() -> str:
    """This machine's address on its default route, or "" when it has none."""
    try:
        host = route_to("192.0.2.123", 9)  # TEST-NET-1: only the routing table is consulted
    except OSError:
        return ""
    return "" if host.startswith("127.") else host


def test_etcd_on_loopback_allows_loopback_and_defaults_to_it():
    assert advertised("", "", "127.0.0.1:2379") == "127.0.0.1"
    assert advertised("127.0.0.1", "", "localhost:2379") == "127.0.0.1"
    assert advertised("0.0.0.0", "10.0.0.7", "http://127.0.0.1:2379") == "10.0.0.7"


@pytest.mark.skipif(not routable(), reason="this machine has no route off loopback")
def test_defaults_advertise_the_address_that_routes_to_etcd():
    me = routable()
    assert advertised("", "", f"{me}:2379") == me
    assert advertised("0.0.0.0", "", f"https://{me}:2379,https://127.0.0.1:2") == me
    assert advertised(me, "", "192.0.2.123:2379") == me  # a bind host naming one interface is advertised


@pytest.mark.parametrize("bind, adv, shown", [("", "127.0.0.1", "'127.0.0.1'"), ("", "localhost", "'localhost'"),
                                              ("127.0.0.1", "", "'127.0.0.1'"), ("", "0.0.0.0", "'0.0.0.0'"),
                                              ("", "::", "'::'")])
def test_loopback_or_unspecified_is_refused_when_etcd_is_not_on_loopback(bind, adv, shown):
    with pytest.raises(AddressError) as e:
        advertised(bind, adv, "192.0.2.123:2379")
    msg = str(e.value)
    assert f"this replica would advertise {shown} to the others, but etcd (192.0.2.123) is not on loopback" in msg
    assert "set network.advertise_host (and network.bind_host)" in msg


@pytest.mark.skipif(not routable(), reason="this machine has no route off loopback")
@pytest.mark.timeout(120)
def test_a_replica_advertising_loopback_to_a_routable_etcd_exits_with_the_reason(tmp_path):
    me = routable()
    srv = EtcdServer(host=me).start()
    try:
        cfg = tmp_path / "config.yaml"
        cfg.write_text("network:\n  advertise_host: 127.0.0.1\n")
        env = {**os.environ, "LFT_JOB": "adv", "LFT_REPLICA_ID": "0", "LFT_NUM_REPLICAS": "1", "LFT_ETCD": srv.endpoint,
               "LFT_SECRET": TEST_SECRET, "LFT_CONFIG": str(cfg), "RANK": "0", "WORLD_SIZE": "1",
               "OMP_NUM_THREADS": "1"}
        r = subprocess.run([sys.executable, LOOP, "--steps", "2", "--dim", "8", "--hidden", "8"], env=env,
                           capture_output=True, text=True, timeout=100)
        assert r.returncode != 0
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("lightning_ft.network.AddressError: this replica would advertise '127.0.0.1' to "
                               f"the others, but etcd ({me}) is not on loopback"), r.stderr[-2000:]
        assert srv.proc.poll() is None
    finally:
        srv.cleanup()
