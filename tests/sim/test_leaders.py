"""Shadow leaders run the real coordinator against a real etcd: every leader adopts the same
quorum each round, the steps advance, and the commit ledger they write verifies."""
from __future__ import annotations

import pickle

from lightning_ft.coord.round_records import Quorum
from lightning_ft.coord.etcd_store import EtcdStore
from lightning_ft.coord.store import MemoryStore
from lightning_ft.replica.ledger import verify_ledger
from lightning_ft.sim.leaders import PREFIX, CountingStore, rank_addresses, run_leaders


def test_shadow_leaders_agree_and_write_a_valid_ledger(etcd_server):
    run = run_leaders(etcd_server.endpoint, 3, rounds=6, warmup=2, step_s=0.02, ledger=True, processes=2,
                      etcd_pid=etcd_server.proc.pid, timeout_s=120)
    assert run.agreed()
    assert sorted(run.decisions) == [0, 1, 2]
    for ds in run.decisions.values():
        assert [d[3] for d in ds] == list(range(8))  # max_step advances by one every round
        assert all(d[2] == [0, 1, 2] for d in ds)
        rounds = [d[0] for d in ds]
        assert rounds == sorted(rounds) and len(set(rounds)) == 8
    assert len(run.latency_ms) == 3 * 6 and min(run.latency_ms) > 0
    assert len(run.ledger_ms) == 3 * 6 and min(run.ledger_ms) > 0
    assert run.rpc["put"][0] >= 3 * 8 and run.rpc["cas"][0] > 0 and run.events > 0
    assert run.leader_cpu_s > 0 and run.etcd_cpu_s is not None and run.etcd_cpu_s >= 0
    q, cursor, scatter = run.message
    assert isinstance(q, Quorum) and q.members == (0, 1, 2) and cursor == 0 and scatter is False
    store = EtcdStore(etcd_server.endpoint)
    try:
        led = verify_ledger(store, f"{PREFIX}/{run.job}/")
    finally:
        store.close()
    assert led.ok and led.steps == 7 and led.trained == {s: list(range(7)) for s in range(3)}


def test_every_rank_address_is_registered_but_no_round_carries_them(etcd_server):
    """3 leaders of 1000 ranks: each publishes 1000 real addresses (4 blocks) and reads its
    neighbours' at the first epoch; the quorum and the broadcast to the ranks stay O(R)."""
    run = run_leaders(etcd_server.endpoint, 3, rounds=3, warmup=1, step_s=0.01, addr_ranks=1000, ledger=False,
                      processes=1, timeout_s=120)
    assert run.agreed() and run.ledger_ms == []
    assert len(run.resolve_ms) == 3 and len(run.register_ms) == 3  # one epoch: one read per leader
    assert run.quorum_json_bytes < 2000 and len(pickle.dumps(run.message)) < 2000
    # the largest etcd message is one block of 256 ranks' two addresses
    assert 256 * 2 * 15 < run.max_message_bytes < 256 * 2 * 40
    store = EtcdStore(etcd_server.endpoint)
    try:
        kvs, _ = store.get_prefix(f"{PREFIX}/{run.job}/addrs/")
    finally:
        store.close()
    assert kvs == []  # gone with the leases the leaders revoked at their clean exits


def test_rank_addresses_are_distinct_host_port_pairs():
    a = rank_addresses(8192)
    assert len(set(a)) == 8192 and a[0] == "10.0.0.1:29500" and a[8] == "10.0.0.2:29500"


def test_counting_store_counts_rpcs_and_watch_events():
    inner = MemoryStore()
    s = CountingStore(inner)
    seen = []
    cancel = s.watch_prefix("/a/", seen.append)
    s.put("/a/x", b"1")
    s.put("/a/y", b"2")
    assert s.get("/a/x").value == b"1"
    s.get_prefix("/a/")
    cancel()
    assert s.calls["put"][0] == 2 and s.calls["get"][0] == 1 and s.calls["get_prefix"][0] == 1
    assert s.calls["put"][1] >= 0 and s.events == len(seen) == 2
    assert s.revision() == inner.revision()  # everything else passes through
