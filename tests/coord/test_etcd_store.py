"""EtcdStore against real etcd: outages shorter and longer than connect_timeout_s, leases across
a restart, a 3-member cluster losing its leader (writes, watches and leases fail over, the
member rejoins), TLS with client certificates, and user/password authentication."""
from __future__ import annotations

import threading
import time

import grpc
import pytest
from pyetcd import etcdrpc

from lightning_ft.config import EtcdConfig, load_config, to_yaml
from lightning_ft.coord.etcd_server import EtcdCluster, EtcdServer, ServerTLS, free_port
from lightning_ft.coord.etcd_config import store_from_config
from lightning_ft.coord.etcd_store import EtcdStore
from lightning_ft.coord.store import StoreError
from tests.coord.certs import CA
from tests.coord.test_store import Recorder


@pytest.fixture
def own_etcd():
    """A single member of this test's own, which it may kill and restart."""
    srv = EtcdServer().start()
    yield srv
    srv.cleanup()


def test_a_request_during_a_short_outage_waits_for_etcd_and_succeeds(own_etcd):
    s = EtcdStore(own_etcd.endpoint, connect_timeout_s=8.0)
    try:
        s.put("/o/before", b"1")
        own_etcd.kill()
        done = {}

        def put():
            t0 = time.monotonic()
            try:
                s.put("/o/during", b"2")  # issued while etcd is down
                done["waited"] = time.monotonic() - t0
            except StoreError as e:
                done["error"] = e

        t = threading.Thread(target=put)
        t.start()
        time.sleep(1.5)
        # From this thread: etcd dies with the thread that started it (PR_SET_PDEATHSIG).
        own_etcd.start()
        t.join(10)
        assert "error" not in done and 1.2 < done["waited"] < 6.0, done
        assert s.get("/o/before").value == b"1" and s.get("/o/during").value == b"2"
    finally:
        s.close()


def test_an_outage_longer_than_connect_timeout_is_a_clear_error(own_etcd):
    s = EtcdStore(own_etcd.endpoint, connect_timeout_s=1.0)
    try:
        own_etcd.kill()
        t0 = time.monotonic()
        with pytest.raises(StoreError) as e:
            s.put("/lft/job/commits/000000000007/0", b"x")
        assert 1.0 <= time.monotonic() - t0 < 3.0
        msg = str(e.value)
        assert "etcd put /lft/job/commits/000000000007/0: no etcd member answered for 1.0s" in msg
        assert "etcd.connect_timeout_s=1" in msg and own_etcd.endpoint in msg
        assert e.value.unreachable
    finally:
        s.close()


def test_after_one_request_timed_out_the_next_ones_fail_fast_until_etcd_answers(own_etcd):
    s = EtcdStore(own_etcd.endpoint, connect_timeout_s=2.5)
    try:
        own_etcd.kill()
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="no etcd member answered for 2.5s"):
            s.put("/o/a", b"1")
        assert time.monotonic() - t0 >= 2.5
        t0 = time.monotonic()
        with pytest.raises(StoreError, match=r"no etcd member answered for 1.0s \(etcd.connect_timeout_s=2.5\)"):
            s.lease_revoke(1234)  # e.g. a replica leaving after the outage
        assert time.monotonic() - t0 < 2.0
        own_etcd.start()
        s.put("/o/a", b"1")  # one success: the full deadline again
        own_etcd.kill()
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="no etcd member answered for 2.5s"):
            s.get("/o/a")
        assert time.monotonic() - t0 >= 2.5
    finally:
        s.close()


def test_a_lease_survives_an_etcd_restart_longer_than_its_ttl(own_etcd):
    """etcd gives every lease a fresh TTL when a leader takes over (after a restart too), so a
    healthy replica whose keepalive resumes within the TTL is never evicted by an outage."""
    s = EtcdStore(own_etcd.endpoint, connect_timeout_s=8.0)
    try:
        lease = s.lease_grant(1)
        s.put("/o/member", b"alive", lease=lease)
        own_etcd.kill()
        time.sleep(2.5)  # down for more than twice the TTL
        own_etcd.start()
        s.lease_keepalive(lease)
        for _ in range(6):  # 1.8 s of keepalives: past the TTL again
            time.sleep(0.3)
            s.lease_keepalive(lease)
        assert s.get("/o/member").value == b"alive"
    finally:
        s.close()


def test_a_watch_resumes_after_an_outage_without_losing_or_repeating_events(own_etcd):
    s = EtcdStore(own_etcd.endpoint, connect_timeout_s=8.0)
    try:
        rec = Recorder()
        s.watch_prefix("/o/w/", rec)
        s.put("/o/w/before", b"0")
        rec.wait_for(lambda es: len(es) == 1)
        own_etcd.kill()
        time.sleep(1.0)
        own_etcd.start()
        writer = EtcdStore(own_etcd.endpoint)  # writes at once, while the watch is still reconnecting
        keys = [f"/o/w/k{k:02d}" for k in range(20)]
        try:
            for k in keys:
                writer.put(k, b"1")
        finally:
            writer.close()
        rec.wait_for(lambda es: len(es) >= 21, timeout=10.0)
        time.sleep(0.3)
        assert [e.key for e in rec.events] == ["/o/w/before"] + keys
    finally:
        s.close()


def test_first_member_down_is_skipped_at_connect():
    with EtcdServer() as srv:
        s = EtcdStore(f"127.0.0.1:{free_port()},{srv.endpoint}", connect_timeout_s=5.0)
        try:
            s._current = 0  # start on the dead member
            s.put("/o/x", b"1")
            assert s.get("/o/x").value == b"1"
        finally:
            s.close()


@pytest.fixture(scope="module")
def cluster():
    c = EtcdCluster(3).start()
    yield c
    c.cleanup()


def test_cluster_losing_its_leader_loses_no_write_watch_event_or_lease(cluster):
    s = EtcdStore(cluster.endpoint, connect_timeout_s=10.0)
    try:
        s.delete_prefix("/c/")
        leader = cluster.leader()
        assert leader is not None
        s._current = leader  # the watch stream and the first requests go to the member we kill
        rec = Recorder()
        s.watch_prefix("/c/", rec)
        lease = s.lease_grant(2)
        s.put("/c/lease", b"L", lease=lease)
        stop = threading.Event()
        keepalive_errors = []

        def keepalive():
            while not stop.wait(0.3):
                try:
                    s.lease_keepalive(lease)
                except StoreError as e:
                    keepalive_errors.append(e)

        ka = threading.Thread(target=keepalive, daemon=True)
        ka.start()
        writer = EtcdStore(cluster.endpoint, connect_timeout_s=10.0)
        writer._current = (leader + 1) % 3  # keeps writing while the watch's member is gone
        written = []
        try:
            for k in range(60):
                if k == 10:
                    cluster.servers[leader].kill()
                (s if k % 2 else writer).put(f"/c/k{k:02d}", str(k).encode())
                written.append(f"/c/k{k:02d}")
        finally:
            writer.close()
        assert cluster.leader() not in (None, leader)
        cluster.servers[leader].start()  # rejoins on its data
        back = EtcdStore(cluster.servers[leader].endpoint, connect_timeout_s=10.0)
        try:  # a linearizable read served by the restarted member: it has caught up
            assert back.get(written[-1]).value == b"59"
        finally:
            back.close()
        evs = rec.wait_for(lambda es: sum(e.key.startswith("/c/k") for e in es) >= 60, timeout=10.0)
        time.sleep(0.3)
        keys = [e.key for e in rec.events if e.key.startswith("/c/k")]
        assert keys == written  # every event once, in order, across the failover
        revs = [e.revision for e in evs]
        assert revs == sorted(revs)
        stop.set()
        ka.join(5)
        assert not keepalive_errors
        assert s.get("/c/lease").value == b"L"
        assert [kv.key for kv in s.get_prefix("/c/k")[0]] == written
    finally:
        s.close()


# -- TLS and authentication ---------------------------------------------------------------------


def enable_auth(endpoint: str, creds: grpc.ChannelCredentials) -> None:
    """etcd's usual setup: a root user, and user `job` (password `jobpw`) with readwrite on /lft/."""
    ch = grpc.secure_channel(endpoint.split("://")[-1], creds)
    a = etcdrpc.AuthStub(ch)
    a.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password="rootpw"))
    a.RoleAdd(etcdrpc.AuthRoleAddRequest(name="root"))
    a.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"))
    a.UserAdd(etcdrpc.AuthUserAddRequest(name="job", password="jobpw"))
    a.RoleAdd(etcdrpc.AuthRoleAddRequest(name="lft"))
    perm = etcdrpc.Permission(permType=etcdrpc.Permission.READWRITE, key=b"/lft/", range_end=b"/lft0")
    a.RoleGrantPermission(etcdrpc.AuthRoleGrantPermissionRequest(name="lft", perm=perm))
    a.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="job", role="lft"))
    a.AuthEnable(etcdrpc.AuthEnableRequest())
    ch.close()


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    """An etcd that serves only TLS, requires client certificates from its CA, and has auth on."""
    d = str(tmp_path_factory.mktemp("tls"))
    ca = CA(d)
    server = ca.issue("etcd-server", server=True)
    client = ca.issue("client", server=False)
    srv = EtcdServer(tls=ServerTLS(server.cert, server.key, client_ca=ca.path)).start()
    enable_auth(srv.endpoint, grpc.ssl_channel_credentials(open(ca.path, "rb").read(), open(client.key, "rb").read(),
                                                           open(client.cert, "rb").read()))
    srv.ca, srv.client, srv.folder = ca, client, d
    yield srv
    srv.cleanup()


def tls_kw(srv) -> dict:
    return {"ca_cert": srv.ca.path, "cert": srv.client.cert, "key": srv.client.key}


def test_tls_and_auth_serve_the_store_contract(secure):
    assert secure.endpoint.startswith("https://127.0.0.1:")
    s = EtcdStore(secure.endpoint, connect_timeout_s=5.0, user="job", password="jobpw", **tls_kw(secure))
    try:
        assert s.tls
        rec = Recorder()
        cancel = s.watch_prefix("/lft/t/", rec)
        lease = s.lease_grant(5)
        s.put("/lft/t/a", b"1", lease=lease)
        assert s.create("/lft/t/b", b"2") and not s.create("/lft/t/b", b"3")
        s.lease_keepalive(lease)
        assert [kv.key for kv in s.get_prefix("/lft/t/")[0]] == ["/lft/t/a", "/lft/t/b"]
        rec.wait_for(lambda es: [e.key for e in es] == ["/lft/t/a", "/lft/t/b"])
        cancel()
        s.lease_revoke(lease)
        assert s.get("/lft/t/a") is None
        assert s.revision() > 0
    finally:
        s.close()


def test_auth_token_lost_in_an_etcd_restart_is_renewed(secure):
    s = EtcdStore(secure.endpoint, connect_timeout_s=8.0, user="job", password="jobpw", **tls_kw(secure))
    try:
        rec = Recorder()
        s.watch_prefix("/lft/rt/", rec)
        s.put("/lft/rt/before", b"1")
        old = s._token
        secure.restart()  # etcd forgets its simple tokens
        s.put("/lft/rt/after", b"2")
        assert s._token and s._token != old
        rec.wait_for(lambda es: [e.key for e in es] == ["/lft/rt/before", "/lft/rt/after"], timeout=10.0)
    finally:
        s.close()


def test_wrong_password_missing_user_and_foreign_keys_are_refused_by_name(secure):
    with pytest.raises(StoreError, match="etcd refused user 'job': check etcd.user and the password"):
        EtcdStore(secure.endpoint, connect_timeout_s=2.0, user="job", password="nope", **tls_kw(secure))
    with pytest.raises(StoreError, match="etcd.user is 'job' but no password is set: set LFT_ETCD_PASSWORD"):
        EtcdStore(secure.endpoint, user="job", **tls_kw(secure))
    s = EtcdStore(secure.endpoint, connect_timeout_s=2.0, user="job", password="jobpw", **tls_kw(secure))
    try:
        with pytest.raises(StoreError, match=r"etcd put /other/x failed .*permission denied.*user 'job' may not"):
            s.put("/other/x", b"1")
        with pytest.raises(StoreError, match=r"etcd watch on /other/ failed .*permission denied.*user 'job' may"):
            s.watch_prefix("/other/", lambda ev: None, start_revision=1)
    finally:
        s.close()
    anonymous = EtcdStore(secure.endpoint, connect_timeout_s=2.0, **tls_kw(secure))  # status needs no auth
    try:  # with a client certificate and no token, etcd takes the certificate's CN as the user
        with pytest.raises(StoreError, match="permission denied.*its CN"):
            anonymous.put("/lft/x", b"1")
    finally:
        anonymous.close()


def test_tls_server_refuses_plaintext_and_clients_without_its_certificates(secure):
    hostport = secure.endpoint.split("://")[1]
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="if it serves TLS, use https:// endpoints"):
        EtcdStore(hostport, connect_timeout_s=1.0)
    assert time.monotonic() - t0 < 4.0
    with pytest.raises(StoreError, match="TLS handshake failed"):  # no client certificate
        EtcdStore(secure.endpoint, connect_timeout_s=1.0, ca_cert=secure.ca.path)
    stranger = CA(secure.folder, "other-ca").issue("intruder", server=False)
    with pytest.raises(StoreError, match="TLS handshake failed"):  # a certificate from another CA
        EtcdStore(secure.endpoint, connect_timeout_s=1.0, ca_cert=secure.ca.path, cert=stranger.cert,
                  key=stranger.key)


def test_https_endpoint_is_never_downgraded_to_plaintext(etcd_server):
    plain = etcd_server.endpoint
    assert EtcdStore(plain, connect_timeout_s=2.0).tls is False
    with pytest.raises(StoreError, match="TLS handshake failed"):
        EtcdStore("https://" + plain, connect_timeout_s=1.0)
    with pytest.raises(StoreError, match="http:// .plaintext. but etcd.ca_cert/cert/key are set"):
        EtcdStore("http://" + plain, ca_cert="/nonexistent.pem")
    with pytest.raises(StoreError, match="etcd.cert and etcd.key go together"):
        EtcdStore("https://" + plain, cert="/c.pem")
    with pytest.raises(StoreError, match="cannot read etcd.ca_cert '/nonexistent.pem'"):
        EtcdStore("https://" + plain, ca_cert="/nonexistent.pem")


# -- from the job config ------------------------------------------------------------------------


def test_store_from_config_wires_endpoints_tls_auth_and_connect_timeout(secure, tmp_path, monkeypatch):
    monkeypatch.delenv("LFT_ETCD_PASSWORD", raising=False)
    monkeypatch.delenv("LFT_CONFIG", raising=False)
    cfg = load_config(overrides=[f"etcd.endpoints=[{secure.endpoint}]", f"etcd.ca_cert={secure.ca.path}",
                                 f"etcd.cert={secure.client.cert}", f"etcd.key={secure.client.key}",
                                 "etcd.user=job", "etcd.password=jobpw", "etcd.connect_timeout_s=4.5"])
    s = store_from_config(cfg.etcd)
    try:
        assert (s.endpoint, s.tls, s.user, s.connect_timeout_s) == (secure.endpoint, True, "job", 4.5)
        s.put("/lft/cfg", b"1")
    finally:
        s.close()
    # The saved config.yaml shows "***"; a process reading it takes the password from the environment.
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(cfg))
    assert "jobpw" not in saved.read_text()
    monkeypatch.setenv("LFT_CONFIG", str(saved))
    with pytest.raises(StoreError, match=r"password is redacted \(\*\*\*\) in this saved config: set LFT_ETCD_PASS"):
        store_from_config()
    monkeypatch.setenv("LFT_ETCD_PASSWORD", "jobpw")
    s = store_from_config(None, secure.endpoint)  # $LFT_CONFIG's etcd section, at these endpoints
    try:
        assert s.get("/lft/cfg").value == b"1" and s.connect_timeout_s == 4.5
    finally:
        s.close()


def test_store_from_config_without_an_endpoint_says_how_to_get_one(monkeypatch):
    monkeypatch.delenv("LFT_CONFIG", raising=False)
    with pytest.raises(StoreError, match="no etcd endpoint: set etcd.endpoints"):
        store_from_config(EtcdConfig())


FORK_UNDER_WATCH = """
import subprocess, sys, threading
from lightning_ft.coord.etcd_server import _die_with_parent
from lightning_ft.coord.etcd_store import EtcdStore
s = EtcdStore(sys.argv[1])
s.watch_prefix("/lft/fork/", lambda ev: None)
stop = threading.Event()
def busy():
    while not stop.is_set():
        s.put("/lft/fork/k", b"1")
threading.Thread(target=busy, daemon=True).start()
codes = [subprocess.Popen(["true"], preexec_fn=_die_with_parent, start_new_session=True).wait() for _ in range(30)]
stop.set()
print(codes.count(0))
"""


def test_forking_under_a_live_watch_leaves_grpc_fork_handlers_out(etcd_server):
    # the way the launcher (re)starts etcd while its store watches: gRPC's fork handlers stay
    # out of the child, which once crashed one (an embedded etcd restart exited with -11)
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", FORK_UNDER_WATCH, etcd_server.endpoint], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "30", r.stderr[-2000:]
    assert "fork_posix" not in r.stderr, r.stderr[-2000:]
