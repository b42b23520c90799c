"""One contract, two stores: every test runs against MemoryStore, a real etcd, and a real
3-member etcd cluster reached through all its endpoints."""
from __future__ import annotations

import threading
import time

import pytest

from lightning_ft.coord.etcd_store import EtcdStore
from lightning_ft.coord.store import LeaseExpired, MemoryStore, StoreError


@pytest.fixture(scope="module")
def etcd_cluster():
    from lightning_ft.coord.etcd_server import EtcdCluster

    c = EtcdCluster(3).start()
    yield c
    c.cleanup()


@pytest.fixture(params=["memory", "etcd", "etcd-cluster"])
def store(request):
    if request.param == "memory":
        s = MemoryStore()
    else:
        s = EtcdStore(request.getfixturevalue("etcd_endpoint") if request.param == "etcd"
                      else request.getfixturevalue("etcd_cluster").endpoint)
        s.delete_prefix("/t/")
    yield s
    s.close()


class Recorder:
    def __init__(self):
        self.events = []
        self.cv = threading.Condition()

    def __call__(self, ev):
        with self.cv:
            self.events.append(ev)
            self.cv.notify_all()

    def wait_for(self, pred, timeout=5.0):
        deadline = time.monotonic() + timeout
        with self.cv:
            while not pred(self.events):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"watch events never matched; got {self.events}")
                self.cv.wait(left)
        return self.events


def test_put_get_delete(store):
    assert store.get("/t/a") is None
    r1 = store.put("/t/a", b"1")
    kv = store.get("/t/a")
    assert kv.value == b"1" and kv.mod_revision == r1 and kv.create_revision == r1
    r2 = store.put("/t/a", b"2")
    assert r2 > r1
    kv = store.get("/t/a")
    assert kv.value == b"2" and kv.create_revision == r1 and kv.mod_revision == r2
    assert store.delete("/t/a") is True
    assert store.delete("/t/a") is False
    assert store.get("/t/a") is None


def test_prefix_sorted_and_delete_prefix(store):
    for k in ["c", "a", "b"]:
        store.put(f"/t/p/{k}", k.encode())
    store.put("/t/q", b"x")
    kvs, rev = store.get_prefix("/t/p/")
    assert [kv.key for kv in kvs] == ["/t/p/a", "/t/p/b", "/t/p/c"]
    assert rev >= max(kv.mod_revision for kv in kvs)
    assert store.delete_prefix("/t/p/") == 3
    assert store.get_prefix("/t/p/")[0] == []
    assert store.get("/t/q").value == b"x"


def test_cas_and_create_if_absent(store):
    assert store.create("/t/c", b"first") is True
    assert store.create("/t/c", b"second") is False
    assert store.get("/t/c").value == b"first"
    kv = store.get("/t/c")
    assert store.cas("/t/c", kv.mod_revision, b"third") is True
    assert store.cas("/t/c", kv.mod_revision, b"stale") is False
    assert store.get("/t/c").value == b"third"


def test_racing_creates_have_one_winner(store):
    wins = []
    barrier = threading.Barrier(8)

    def go(i):
        barrier.wait()
        if store.create("/t/race", str(i).encode()):
            wins.append(i)

    ts = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    [t.start() for t in ts]
    [t.join(10) for t in ts]
    assert len(wins) == 1
    assert store.get("/t/race").value == str(wins[0]).encode()


def test_read_at_revision(store):
    r1 = store.put("/t/r/a", b"1")
    store.put("/t/r/b", b"2")
    store.put("/t/r/a", b"3")
    kvs, rev = store.get_prefix("/t/r/", revision=r1)
    assert rev == r1
    assert [(kv.key, kv.value) for kv in kvs] == [("/t/r/a", b"1")]
    kvs, _ = store.get_prefix("/t/r/")
    assert [(kv.key, kv.value) for kv in kvs] == [("/t/r/a", b"3"), ("/t/r/b", b"2")]


def test_lease_keepalive_keeps_key_and_expiry_deletes_it(store):
    lease = store.lease_grant(1)
    store.put("/t/l/k", b"v", lease=lease)
    assert store.get("/t/l/k").lease == lease
    t_end = time.monotonic() + 1.8
    while time.monotonic() < t_end:  # keep alive past the TTL
        store.lease_keepalive(lease)
        time.sleep(0.3)
    assert store.get("/t/l/k") is not None
    deadline = time.monotonic() + 4.0
    while store.get("/t/l/k") is not None:
        assert time.monotonic() < deadline, "key bound to an unrefreshed lease never expired"
        time.sleep(0.05)
    with pytest.raises(LeaseExpired):
        store.lease_keepalive(lease)
    with pytest.raises(LeaseExpired):
        store.put("/t/l/k2", b"v", lease=lease)


def test_lease_revoke_deletes_keys_now(store):
    lease = store.lease_grant(5)
    store.put("/t/rv/a", b"1", lease=lease)
    store.put("/t/rv/b", b"2", lease=lease)
    store.lease_revoke(lease)
    assert store.get_prefix("/t/rv/")[0] == []
    store.lease_revoke(lease)  # idempotent


def test_watch_sees_put_delete_and_lease_expiry(store):
    rec = Recorder()
    cancel = store.watch_prefix("/t/w/", rec)
    try:
        lease = store.lease_grant(1)
        store.put("/t/w/a", b"1")
        store.put("/t/w/lease", b"L", lease=lease)
        store.put("/t/other", b"ignored")
        store.delete("/t/w/a")
        evs = rec.wait_for(lambda es: len(es) >= 4, timeout=5.0)
        assert [(e.kind, e.key) for e in evs[:3]] == [("put", "/t/w/a"), ("put", "/t/w/lease"), ("delete", "/t/w/a")]
        assert evs[3].kind == "delete" and evs[3].key == "/t/w/lease"  # lease expiry
        revs = [e.revision for e in evs]
        assert revs == sorted(revs)
    finally:
        cancel()
    store.put("/t/w/after", b"x")
    time.sleep(0.2)
    assert all(e.key != "/t/w/after" for e in rec.events)


def test_watch_from_start_revision_replays_history(store):
    r1 = store.put("/t/h/a", b"1")
    store.put("/t/h/b", b"2")
    rec = Recorder()
    cancel = store.watch_prefix("/t/h/", rec, start_revision=r1)
    try:
        evs = rec.wait_for(lambda es: len(es) >= 2)
        assert [(e.key, e.value) for e in evs[:2]] == [("/t/h/a", b"1"), ("/t/h/b", b"2")]
    finally:
        cancel()


def test_etcd_unreachable_is_a_clear_error_not_a_hang():
    from lightning_ft.coord.etcd_server import free_port

    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=f"127.0.0.1:{port} is unreachable"):
        EtcdStore(f"127.0.0.1:{port}", connect_timeout_s=0.5, rpc_timeout_s=0.2)
    assert time.monotonic() - t0 < 3.0


def test_etcd_restart_keeps_data_and_watches(etcd_server):
    s = EtcdStore(etcd_server.endpoint)
    try:
        s.delete_prefix("/t/er/")
        rec = Recorder()
        s.watch_prefix("/t/er/", rec)
        s.put("/t/er/before", b"1")
        rec.wait_for(lambda es: len(es) >= 1)
        etcd_server.restart()
        s.put("/t/er/after", b"2")  # retried across the restart
        assert s.get("/t/er/before").value == b"1"
        evs = rec.wait_for(lambda es: any(e.key == "/t/er/after" for e in es), timeout=10.0)
        assert [e.key for e in evs].count("/t/er/before") == 1
    finally:
        s.close()


# -- put_if / put_many_if: the fence of ledger writes ---------------------------------------------

def test_put_if_writes_only_while_every_create_revision_matches(store):
    rev = store.put("/t/members/1", b"me")
    created = store.get("/t/members/1").create_revision
    assert created == rev
    assert store.put_if("/t/rec/a", b"1", {"/t/members/1": created, "/t/evict/1/0": 0})
    assert store.get("/t/rec/a").value == b"1"
    store.put("/t/evict/1/0", b"dead")
    assert not store.put_if("/t/rec/b", b"2", {"/t/members/1": created, "/t/evict/1/0": 0})
    assert store.get("/t/rec/b") is None


def test_put_if_fails_once_the_key_was_recreated(store):
    store.put("/t/members/2", b"old")
    created = store.get("/t/members/2").create_revision
    store.delete("/t/members/2")
    assert not store.put_if("/t/rec/c", b"x", {"/t/members/2": created})
    store.put("/t/members/2", b"new")  # a re-registration: a new create revision
    assert not store.put_if("/t/rec/c", b"x", {"/t/members/2": created})
    assert store.put_if("/t/rec/c", b"x", {"/t/members/2": store.get("/t/members/2").create_revision})


def test_put_many_if_writes_all_or_nothing(store):
    store.put("/t/members/3", b"me")
    fence = {"/t/members/3": store.get("/t/members/3").create_revision}
    assert store.put_many_if([("/t/r/1", b"a"), ("/t/r/2", b"b")], fence)
    assert [kv.value for kv in store.get_prefix("/t/r/")[0]] == [b"a", b"b"]
    store.put("/t/members/3", b"me again")  # same key: create revision unchanged
    assert store.put_many_if([("/t/r/3", b"c")], fence)
    store.delete("/t/members/3")
    assert not store.put_many_if([("/t/r/4", b"d"), ("/t/r/5", b"e")], fence)
    assert store.get("/t/r/4") is None and store.get("/t/r/5") is None
