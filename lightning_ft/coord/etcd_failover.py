"""What the etcd client does when a request fails: pure decisions, no I/O (docs/GUIDE.md, "etcd").

`EtcdStore` (etcd_store.py) talks to the members of one etcd cluster. This module decides, for
it and for the config checks:

- `parse_endpoints`: "host:port", "http://host:port", "https://host:port", several separated
  by commas, into `Endpoint`s; `use_tls` whether the channel is TLS (the scheme, or TLS files).
  An https:// endpoint is never downgraded to plaintext.
- `classify(code, details)`: what one failed RPC means. RETRY: this member is down, has no
  leader or timed out; try the next member, then wait and go round again until the outage
  deadline (`etcd.connect_timeout_s`). REAUTH: the auth token is gone (an etcd restart drops
  simple tokens); authenticate again and retry. LEASE: the lease is gone. FATAL: retrying
  cannot help (permission denied, a bad request); fail now, with a hint.
- `backoff`: the waits between rounds over all members.
- `hint`: what to tell the user about the last error after the deadline.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence


class Action(enum.Enum):
    RETRY = "retry"
    REAUTH = "reauth"
    LEASE = "lease"
    FATAL = "fatal"


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    scheme: str = ""
    """"http", "https", or "" when the address was given without one."""

    @property
    def target(self) -> str:
        """host:port as gRPC wants it (IPv6 in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return f"{self.scheme}://{self.target}" if self.scheme else self.target


def parse_endpoint(text: str) -> Endpoint:
    """One "[http[s]://]host:port"; ValueError says what is wrong."""
    raw = text.strip()
    scheme, sep, rest = raw.partition("://")
    if not sep:
        scheme, rest = "", raw
    elif scheme not in ("http", "https"):
        raise ValueError(f"etcd endpoint {text!r}: scheme must be http:// or https://, not {scheme}://")
    rest = rest.rstrip("/")
    host, sep, port = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host:
        raise ValueError(f"etcd endpoint {text!r} is not host:port (e.g. 10.0.0.1:2379 or https://etcd-0:2379)")
    return Endpoint(host, int(port), scheme)


def parse_endpoints(spec: str | Sequence[str]) -> list[Endpoint]:
    """Endpoints from "a:1,b:2" or a list of such strings; at least one, no duplicates."""
    items = spec.split(",") if isinstance(spec, str) else [p for s in spec for p in str(s).split(",")]
    eps = [parse_endpoint(s) for s in items if s.strip()]
    if not eps:
        raise ValueError("no etcd endpoint given (expected host:port, several separated by commas)")
    targets = [e.target for e in eps]
    dup = sorted({t for t in targets if targets.count(t) > 1})
    if dup:
        raise ValueError(f"etcd endpoint {dup[0]} is listed twice")
    return eps


def format_endpoints(eps: Sequence[Endpoint]) -> str:
    """The comma-separated form that `parse_endpoints` reads back (and LFT_ETCD carries)."""
    return ",".join(str(e) for e in eps)


def use_tls(eps: Sequence[Endpoint], tls_files: bool) -> bool:
    """Whether to connect with TLS: https:// says yes, http:// says no, no scheme follows
    whether a CA or client certificate is configured. Contradictions are a ValueError."""
    schemes = {e.scheme for e in eps if e.scheme}
    if len(schemes) > 1:
        raise ValueError("etcd endpoints mix http:// and https://; one cluster speaks one of them")
    if "http" in schemes and tls_files:
        raise ValueError("etcd endpoints are http:// (plaintext) but etcd.ca_cert/cert/key are set: "
                         "use https:// endpoints, or drop the TLS files")
    return "https" in schemes or (not schemes and tls_files)


# Messages of etcd's gRPC errors (etcd/api/v3rpc/rpctypes) that mean "this member cannot serve
# now": a leader election, a member that lost its leader, a slow or stopping server.
_TRANSIENT_TEXT = ("no leader", "leader changed", "not leader", "request timed out", "timed out",
                   "deadline exceeded", "context canceled", "server stopped", "too many requests",
                   "not capable", "unhealthy cluster", "raft: stopped", "connection", "transport")
_RETRY_CODES = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "INTERNAL", "CANCELLED"}


def classify(code: str, details: str) -> Action:
    """What a failed RPC with gRPC status `code` (its name, e.g. "UNAVAILABLE") means."""
    text = (details or "").lower()
    if "lease not found" in text:
        return Action.LEASE
    if code == "UNAUTHENTICATED" or "invalid auth token" in text or "revision of auth store is old" in text:
        return Action.REAUTH
    if code == "RESOURCE_EXHAUSTED" and "larger than max" in text:
        return Action.FATAL  # a response over the client's message limit: it will not shrink
    if code in _RETRY_CODES:
        return Action.RETRY
    if code == "UNKNOWN" and any(t in text for t in _TRANSIENT_TEXT):
        return Action.RETRY
    return Action.FATAL


def hint(code: str, details: str, tls: bool, user: str = "") -> str:
    """One sentence on what to do about the error `code`/`details`; "" when there is nothing to add."""
    text = (details or "").lower()
    if "handshake" in text or "certificate" in text or "ssl" in text:
        return ("the TLS handshake failed: check etcd.ca_cert (it must have signed the server's certificate, "
                "whose names must include the endpoint's host) and etcd.cert/etcd.key (a client certificate "
                "the server trusts)")
    if not tls and "socket closed" in text:
        return "the server closed the connection: if it serves TLS, use https:// endpoints or set etcd.ca_cert"
    if "user name is empty" in text:
        return "this etcd has authentication enabled: set etcd.user and the password (LFT_ETCD_PASSWORD)"
    if "invalid user id or password" in text or "authentication failed" in text:
        return f"etcd refused user {user!r}: check etcd.user and the password (LFT_ETCD_PASSWORD or etcd.password)"
    if code == "PERMISSION_DENIED":
        who = f"user {user!r}" if user else "this client (no etcd.user; with client certificates, its CN)"
        return f"{who} may not do this: grant it readwrite on the job prefix (e.g. /lft/)"
    if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
        return "check that etcd runs and is reachable, or raise etcd.connect_timeout_s to ride out longer outages"
    return ""


def backoff(first_s: float = 0.02, cap_s: float = 0.25, factor: float = 2.0) -> Iterator[float]:
    """Waits after each full round over the members: 20 ms, 40 ms, ... up to 250 ms."""
    delay = first_s
    while True:
        yield delay
        delay = min(delay * factor, cap_s)


def attempt_timeout(rpc_timeout_s: float, left_s: float, floor_s: float = 0.2,
                    lease_ttl_s: Optional[float] = None, keepalive_floor_s: float = 0.5) -> float:
    """The deadline of one attempt: the RPC timeout, but no later than the outage deadline
    (`left_s`, at least `floor_s`), and for a lease keepalive half the TTL (at least
    `keepalive_floor_s`: a loaded machine answers slowly, and a keepalive cut short refreshes
    nothing), so that a stalled member leaves time to try the next one before the lease lapses."""
    t = min(rpc_timeout_s, max(left_s, floor_s))
    if lease_ttl_s is not None:
        t = min(t, max(lease_ttl_s / 2.0, keepalive_floor_s))
    return t
