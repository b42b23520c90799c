"""The etcd client's pure decisions: endpoint parsing, TLS choice, what an error means, waits."""
from __future__ import annotations

import itertools

import pytest

from lightning_ft.coord.etcd_failover import (Action, Endpoint, attempt_timeout, backoff, classify,
                                              format_endpoints, hint, parse_endpoint, parse_endpoints, use_tls)


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:2379", Endpoint("127.0.0.1", 2379, "")),
    ("localhost:1", Endpoint("localhost", 1, "")),
    ("http://etcd-0:2379", Endpoint("etcd-0", 2379, "http")),
    ("https://etcd-0.example.com:2379/", Endpoint("etcd-0.example.com", 2379, "https")),
    ("[::1]:2379", Endpoint("::1", 2379, "")),
    ("https://[fe80::1]:65535", Endpoint("fe80::1", 65535, "https")),
    ("  10.0.0.1:2379 ", Endpoint("10.0.0.1", 2379, "")),
])
def test_parse_endpoint_reads_host_port_and_scheme(text, expected):
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize("text, why", [
    ("localhost", "is not host:port"),
    (":2379", "is not host:port"),
    ("host:0", "is not host:port"),
    ("host:65536", "is not host:port"),
    ("host:port", "is not host:port"),
    ("http://host/path:2379", "is not host:port"),
    ("grpc://host:2379", "scheme must be http:// or https://"),
])
def test_parse_endpoint_names_what_is_wrong(text, why):
    with pytest.raises(ValueError, match=why):
        parse_endpoint(text)


def test_parse_endpoints_takes_commas_and_lists_and_refuses_duplicates_and_nothing():
    eps = parse_endpoints("a:1, https://b:2,,c:3")
    assert [str(e) for e in eps] == ["a:1", "https://b:2", "c:3"]
    assert parse_endpoints(["a:1,b:2", "c:3"]) == parse_endpoints("a:1,b:2,c:3")
    assert format_endpoints(parse_endpoints("https://a:1,https://[::1]:2")) == "https://a:1,https://[::1]:2"
    assert parse_endpoints(format_endpoints(eps)) == eps
    with pytest.raises(ValueError, match="a:1 is listed twice"):
        parse_endpoints("a:1,http://a:1")
    for nothing in ("", " , ", []):
        with pytest.raises(ValueError, match="no etcd endpoint"):
            parse_endpoints(nothing)


def test_endpoint_target_brackets_ipv6():
    assert Endpoint("::1", 2379).target == "[::1]:2379"
    assert Endpoint("h", 1, "https").target == "h:1"


@pytest.mark.parametrize("spec, tls_files, expected", [
    ("a:1", False, False),
    ("a:1", True, True),            # TLS files without a scheme: TLS
    ("https://a:1", False, True),   # https:// without files: TLS with the system CAs, never plaintext
    ("https://a:1,https://b:2", True, True),
    ("http://a:1", False, False),
])
def test_use_tls_follows_the_scheme_then_the_files(spec, tls_files, expected):
    assert use_tls(parse_endpoints(spec), tls_files) is expected


def test_use_tls_refuses_contradictions():
    with pytest.raises(ValueError, match="mix http:// and https://"):
        use_tls(parse_endpoints("http://a:1,https://b:2"), False)
    with pytest.raises(ValueError, match="http:// .plaintext. but etcd.ca_cert/cert/key are set"):
        use_tls(parse_endpoints("http://a:1"), True)


@pytest.mark.parametrize("code, details, action", [
    # a member that is down, restarting, without a leader, or slow: try the next one
    ("UNAVAILABLE", "failed to connect to all addresses; last error: Connection refused", Action.RETRY),
    ("UNAVAILABLE", "etcdserver: no leader", Action.RETRY),
    ("UNAVAILABLE", "etcdserver: leader changed", Action.RETRY),
    ("UNAVAILABLE", "etcdserver: request timed out", Action.RETRY),
    ("DEADLINE_EXCEEDED", "Deadline Exceeded", Action.RETRY),
    ("RESOURCE_EXHAUSTED", "etcdserver: too many requests", Action.RETRY),
    ("UNKNOWN", "etcdserver: request timed out, possibly due to connection lost", Action.RETRY),
    ("UNKNOWN", "etcdserver: server stopped", Action.RETRY),
    ("UNKNOWN", "context deadline exceeded", Action.RETRY),  # a keepalive forwarded to a lost leader
    ("CANCELLED", "Channel closed", Action.RETRY),
    ("INTERNAL", "stream terminated by RST_STREAM", Action.RETRY),
    # the token is gone (etcd restarted) or stale: authenticate again
    ("UNAUTHENTICATED", "etcdserver: invalid auth token", Action.REAUTH),
    ("INVALID_ARGUMENT", "etcdserver: revision of auth store is old", Action.REAUTH),
    # the lease is gone
    ("NOT_FOUND", "etcdserver: requested lease not found", Action.LEASE),
    # retrying cannot help
    ("PERMISSION_DENIED", "etcdserver: permission denied", Action.FATAL),
    ("INVALID_ARGUMENT", "etcdserver: user name is empty", Action.FATAL),
    ("INVALID_ARGUMENT", "etcdserver: authentication failed, invalid user ID or password", Action.FATAL),
    ("INVALID_ARGUMENT", "etcdserver: request is too large", Action.FATAL),
    ("OUT_OF_RANGE", "etcdserver: mvcc: required revision has been compacted", Action.FATAL),
    ("RESOURCE_EXHAUSTED", "Received message larger than max (300000000 vs. 268435456)", Action.FATAL),
    ("FAILED_PRECONDITION", "etcdserver: authentication is not enabled", Action.FATAL),
    ("UNKNOWN", "something else entirely", Action.FATAL),
])
def test_classify_every_etcd_error(code, details, action):
    assert classify(code, details) is action


@pytest.mark.parametrize("code, details, tls, user, says", [
    ("UNAVAILABLE", "Tls handshake failed (TSI_PROTOCOL_FAILURE): CERTIFICATE_VERIFY_FAILED", True, "",
     "TLS handshake failed: check etcd.ca_cert"),
    ("UNAVAILABLE", "failed to connect; last error: Socket closed", False, "", "use https:// endpoints"),
    ("INVALID_ARGUMENT", "etcdserver: user name is empty", False, "", "authentication enabled: set etcd.user"),
    ("INVALID_ARGUMENT", "etcdserver: authentication failed, invalid user ID or password", False, "job",
     "etcd refused user 'job'"),
    ("PERMISSION_DENIED", "etcdserver: permission denied", False, "job", "user 'job' may not do this"),
    ("PERMISSION_DENIED", "etcdserver: permission denied", True, "", "its CN"),
    ("UNAVAILABLE", "Connection refused", False, "", "raise etcd.connect_timeout_s"),
    ("OUT_OF_RANGE", "compacted", False, "", ""),
])
def test_hint_says_what_to_do(code, details, tls, user, says):
    text = hint(code, details, tls, user)
    assert (says in text) if says else text == ""


def test_backoff_doubles_up_to_its_cap():
    assert list(itertools.islice(backoff(), 6)) == pytest.approx([0.02, 0.04, 0.08, 0.16, 0.25, 0.25])


@pytest.mark.parametrize("rpc, left, ttl, expected", [
    (2.0, 10.0, None, 2.0),   # the RPC timeout
    (2.0, 0.5, None, 0.5),    # no later than the outage deadline
    (2.0, 0.01, None, 0.2),   # ... but a last attempt gets a little time
    (2.0, 10.0, 3.0, 1.5),    # a keepalive: half the TTL
    (2.0, 10.0, 1.0, 0.5),
    (2.0, 10.0, 0.4, 0.5),    # ... but never less than half a second
    (0.5, 10.0, 30.0, 0.5),
    (2.0, 0.3, 3.0, 0.3),
])
def test_attempt_timeout(rpc, left, ttl, expected):
    assert attempt_timeout(rpc, left, lease_ttl_s=ttl) == pytest.approx(expected)
