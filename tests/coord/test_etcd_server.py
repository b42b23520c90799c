"""Embedded etcd: fsync flags, data dirs, cluster ports, leadership, and restarting a dead
member so it rejoins (but not one that was stopped, and not one in a crash loop)."""
from __future__ import annotations

import json
import os
import signal

import pytest

from lightning_ft.coord.etcd_members import etcdctl
from lightning_ft.coord.etcd_server import EtcdCluster, EtcdServer, EtcdServerOptions, make_data_dir
from lightning_ft.coord.etcd_store import EtcdStore


def test_fsync_is_skipped_only_when_asked(tmp_path):
    fast = EtcdServer(data_dir=str(tmp_path / "a"))
    durable = EtcdServer(data_dir=str(tmp_path / "b"), options=EtcdServerOptions(unsafe_no_fsync=False))
    assert "--unsafe-no-fsync" in fast._cmd()
    assert "--unsafe-no-fsync" not in durable._cmd()


def test_data_dir_is_created_when_missing_and_a_file_is_refused(tmp_path):
    d = tmp_path / "new" / "etcd"
    assert make_data_dir(str(d)) is True and d.is_dir()
    assert make_data_dir(str(d)) is False
    (tmp_path / "f").write_text("x")
    with pytest.raises(RuntimeError, match="exists and is not a directory"):
        make_data_dir(str(tmp_path / "f"))
    srv = EtcdServer(data_dir=str(tmp_path / "fresh" / "dir"))
    assert srv.created_data_dir and os.path.isdir(srv.data_dir)


def test_cluster_ports_follow_the_base_port(tmp_path):
    c = EtcdCluster(3, port=30000, data_dir=str(tmp_path))
    assert c.endpoints == ["127.0.0.1:30000", "127.0.0.1:30002", "127.0.0.1:30004"]
    assert [s.peer_port for s in c.servers] == [30001, 30003, 30005]
    assert c.servers[1].initial_cluster == ("m0=http://127.0.0.1:30001,m1=http://127.0.0.1:30003,"
                                            "m2=http://127.0.0.1:30005")
    assert [s.data_dir for s in c.servers] == [str(tmp_path / f"m{i}") for i in range(3)]
    one = EtcdCluster(1, data_dir=str(tmp_path / "one"))
    assert one.servers[0].data_dir == str(tmp_path / "one")  # the single-member layout of `lightning-ft etcd`
    with pytest.raises(ValueError, match="at least 1 member"):
        EtcdCluster(0)


def _kill(c: EtcdCluster, i: int) -> None:
    """SIGKILL member i of `c` and reap it."""
    proc = c.servers[i].proc
    assert proc is not None
    proc.kill()
    proc.wait(5)


def test_a_dead_member_is_restarted_and_rejoins_but_a_stopped_one_is_not():
    with EtcdCluster(3) as c:
        leaders = [i for i, s in enumerate(c.servers) if s.is_leader()]
        assert len(leaders) == 1 and c.leader() == leaders[0]
        s = EtcdStore(c.endpoint)
        try:
            victim = (leaders[0] + 1) % 3
            _kill(c, victim)
            s.put("/m/while-down", b"1")
            assert c.restart_dead() == [(victim, -signal.SIGKILL)]
            c.servers[victim].wait_healthy()
            back = EtcdStore(c.servers[victim].endpoint)
            try:
                assert back.get("/m/while-down").value == b"1"
            finally:
                back.close()
            c.servers[2 if victim != 2 else 1].stop()
            assert c.restart_dead() == []
            c.CRASH_LOOP = (1, 60.0)
            _kill(c, victim)
            with pytest.raises(RuntimeError, match=f"member m{victim} exited 2 times within 60s; not restarting"):
                c.restart_dead()
        finally:
            s.close()


def test_a_killed_leader_is_replaced_by_an_empty_member_that_receives_the_data_under_writes():
    """replace_dead: the member killed (the leader, while a writer keeps writing) is removed,
    added back empty and started; it gets the data from the new leader, every member answers
    the same revision for the same key, and the cluster keeps three members. Restarting on its
    data instead can diverge with etcd 3.5.1 (etcd-io/etcd#13766; the soak, seed 47)."""
    import threading

    with EtcdCluster(3) as c:
        s = EtcdStore(c.endpoint)
        stop = threading.Event()
        wrote: list[int] = []

        def writer() -> None:
            while not stop.is_set():
                try:
                    s.put(f"/w/{len(wrote):06d}", b"x")
                    wrote.append(1)
                except Exception:  # noqa: BLE001 - an election: the next put retries
                    pass

        t = threading.Thread(target=writer, daemon=True)
        t.start()
        try:
            victim = c.leader()
            assert victim is not None
            _kill(c, victim)
            assert c.replace_dead() == [(victim, -signal.SIGKILL)]
            assert c.servers[victim].options.initial_cluster_state == "existing"
            assert "--initial-cluster-state" in c.servers[victim]._cmd()
            c.servers[victim].wait_healthy(30)
            s.put("/m/after", b"1")
            stop.set()
            t.join(10)
            views = []
            for srv in c.servers:
                one = EtcdStore(srv.endpoint)
                try:
                    kv = one.get("/m/after")
                    views.append((kv.value, kv.create_revision, len(one.get_prefix("/w/")[0])))
                finally:
                    one.close()
            assert len(set(views)) == 1 and views[0][0] == b"1" and views[0][2] == len(wrote) > 0, views
            assert c.replace_dead() == []  # nothing dead
            members = json.loads(etcdctl(c, "-", 10.0, "member", "list", "-w", "json"))["members"]
            assert sorted(m["name"] for m in members) == ["m0", "m1", "m2"]
        finally:
            stop.set()
            s.close()


def test_a_member_killed_seconds_after_another_was_replaced_is_replaced_too():
    """The soak (seed 48): the leader died seconds after a member had been replaced, and etcd
    refused to remove it ("not enough started members") while the new member was starting.
    That refusal passes: it is retried (etcd_members.RECONFIG_TRANSIENT)."""
    with EtcdCluster(3) as c:
        s = EtcdStore(c.endpoint)
        try:
            first = c.leader()
            assert first is not None
            _kill(c, first)
            assert c.replace_dead() == [(first, -signal.SIGKILL)]
            second = next(i for i in range(3) if i != first)  # not waiting for the new one to start
            _kill(c, second)
            assert c.replace_dead() == [(second, -signal.SIGKILL)]
            for srv in c.servers:
                srv.wait_healthy(30)
            s.put("/m/after-two", b"2")
            assert s.get("/m/after-two").value == b"2"
        finally:
            s.close()


@pytest.mark.parametrize("which", ["port", "peer_port"])
def test_a_port_taken_before_etcd_binds_it_is_replaced_by_a_fresh_one(tmp_path, which):
    """free_port() only says a port is free now; another process may bind it before etcd does
    (CI saw 'bind: address already in use' at a test module's fixture). A member whose ports we
    picked starts on fresh ones; one given its port by the caller fails with etcd's reason."""
    import socket

    srv = EtcdServer(data_dir=str(tmp_path / "picked"))
    thief = socket.socket()
    thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    taken = getattr(srv, which)
    thief.bind(("127.0.0.1", taken))
    thief.listen()
    try:
        with srv:
            assert getattr(srv, which) != taken
            store = EtcdStore([srv.endpoint])
            store.put("k", b"v")
            assert store.get("k").value == b"v"
            store.close()
        given = EtcdServer(data_dir=str(tmp_path / "given"), port=taken if which == "port" else 0,
                           peer_port=taken if which == "peer_port" else 0)
        with pytest.raises(RuntimeError, match="address already in use"):
            given.start(timeout_s=5.0)
        given.cleanup()
    finally:
        thief.close()


@pytest.mark.parametrize("bad, match", [
    (dict(name=""), "needs a name"),
    (dict(heartbeat_ms=0), "heartbeat_ms=0 must be > 0"),
    (dict(heartbeat_ms=100, election_ms=400), "at least 5 heartbeats"),
    (dict(election_ms=60_000), "at most 50000"),
])
def test_server_options_refuse_what_etcd_would_refuse_at_start(bad, match):
    with pytest.raises(ValueError, match=match):
        EtcdServerOptions(**bad)
