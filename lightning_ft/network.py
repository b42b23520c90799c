"""Which address a replica's listeners advertise to the others (docs/ARCHITECTURE.md, "Addresses").

Every listener (FTAR, the catch-up state server) binds `network.bind_host` (default: all
interfaces) and publishes `network.advertise_host`. When that is empty, the advertised host
is the bind host if it names one interface, else the local address of the interface that
routes to etcd: the one the other hosts reach us through. Nothing advertises loopback or
an unspecified address to another host.
"""
from __future__ import annotations

import ipaddress
import socket

from lightning_ft.coord.etcd_failover import parse_endpoint


class AddressError(ValueError):
    """The advertised address cannot be reached by the other replicas."""


WILDCARDS = ("", "0.0.0.0", "::", "*")


def _is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def route_to(host: str, port: int) -> str:
    """The local address of the interface that routes to host:port (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host.strip("[]"), port))
        return s.getsockname()[0]


def etcd_host(etcd: str) -> tuple[str, int]:
    """Host and port of the first etcd endpoint of `etcd` ("h:p", "http(s)://h:p", or a comma list)."""
    ep = parse_endpoint(etcd.split(",")[0])
    return ep.host, ep.port


def advertised(bind_host: str, advertise_host: str, etcd: str) -> str:
    """The host our listeners publish in `members/{rid}` (see the module docstring).
    Raises AddressError for a loopback or unspecified address when etcd is on another host."""
    remote_etcd = False
    eh, ep = ("127.0.0.1", 2379)
    if etcd:
        eh, ep = etcd_host(etcd)
        remote_etcd = not _is_loopback(eh)
    if advertise_host:
        host = advertise_host
    elif bind_host not in WILDCARDS:
        host = bind_host
    else:
        try:
            host = route_to(eh, ep)
        except OSError as e:
            raise AddressError(f"cannot tell which local address routes to etcd at {eh}:{ep} ({e}); set "
                               "network.advertise_host to this host's address the other replicas can reach") from e
    if remote_etcd and (host in WILDCARDS or _is_loopback(host)):
        raise AddressError(
            f"this replica would advertise {host!r} to the others, but etcd ({eh}) is not on loopback, so "
            f"replicas on other hosts could not reach it; set network.advertise_host (and network.bind_host) "
            f"to an address of this host that the other hosts can reach")
    return host
