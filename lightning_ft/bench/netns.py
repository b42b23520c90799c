"""Network namespaces as hosts, for multi-host and network-fault tests and the soak (issue 10 §2, 18 §4, 18 §6).

    with Net() as net:                       # a bridge; skip_reason() says why it cannot be made
        etcd, a, b = net.host("e"), net.host("a"), net.host("b")   # one namespace + veth each
        p = a.popen([sys.executable, "train.py"], env=...)          # runs inside namespace a
        net.cut(a)            # a's link goes down: everything a sends or receives is dropped
        net.restore(a)
        net.cut_path(a, b)    # only a <-> b (blackhole routes both ways); etcd still reaches both
        net.restore_path(a, b)

What each cut looks like to a program (measured here):
- `cut(host)` takes the bridge side of the host's veth down. Packets are dropped silently:
  established TCP connections stall (timeouts, no reset) and recover by retransmission
  when the link returns; new connections time out.
- `cut_path(a, b)` adds a blackhole route to the other's address in each namespace
  (there is no iptables/nft and no tc classifier here). Established connections stall
  silently as above; a new `connect()` fails at once with EINVAL.

Cleanup, also when a test fails: every process in the namespaces (`ip netns pids`, which
includes the children of launchers such as torchrun) is SIGCONTed and SIGKILLed by PID,
then the namespaces, the veths and the bridge are deleted. Names carry a random tag, so
parallel test runs do not collide; `leftovers()` lists what a crashed run left behind.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

TAG_PREFIX = "lftn"
"""Every namespace, veth and bridge these tests create starts with this (IFNAMSIZ is 15)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise NetError(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")
    return r


class NetError(RuntimeError):
    pass


_REASON: Optional[str] = None


def skip_reason() -> Optional[str]:
    """Why namespaces cannot be used here (None when they can). Probes once."""
    global _REASON
    if _REASON is not None:
        return _REASON or None
    if os.geteuid() != 0:
        _REASON = "network namespaces need root (run the tests as root, or in a container with CAP_NET_ADMIN)"
    elif shutil.which("ip") is None:
        _REASON = "network namespaces need the `ip` command (iproute2)"
    else:
        probe = f"{TAG_PREFIX}probe{os.getpid() % 10000}"
        r = _ip("netns", "add", probe, check=False)
        if r.returncode != 0:
            _REASON = f"cannot create a network namespace: {r.stderr.strip()}"
        else:
            r = _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1", check=False)
            _ip("netns", "del", probe, check=False)
            _REASON = "" if r.returncode == 0 else f"cannot create a veth pair in a namespace: {r.stderr.strip()}"
    return _REASON or None


@dataclass
class Host:
    """One namespace on the bridge: `ip` is its address."""

    name: str
    ns: str
    ip: str
    veth: str
    """The bridge side of its link (in the root namespace)."""
    procs: list = field(default_factory=list)

    def cmd(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def popen(self, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start `argv` inside the namespace (`ip netns exec` execs it: the PID is the program's)."""
        p = subprocess.Popen(self.cmd(argv), **kw)
        self.procs.append(p)
        return p

    def run(self, argv: Sequence[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.cmd(argv), timeout=timeout, **kw)

    def pids(self) -> list[int]:
        """Every process inside the namespace."""
        r = _ip("netns", "pids", self.ns, check=False)
        return [int(x) for x in r.stdout.split()] if r.returncode == 0 else []


class Net:
    """A bridge with hosts on one /24; see the module docstring."""

    def __init__(self) -> None:
        reason = skip_reason()
        if reason:
            raise NetError(reason)
        self.tag = f"{TAG_PREFIX}{random.randrange(16 ** 4):04x}"
        self.subnet = f"10.{random.randrange(200, 250)}.{random.randrange(256)}"
        self.bridge = f"{self.tag}br"
        self.hosts: list[Host] = []
        self._blackholes: set[tuple[str, str]] = set()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def __enter__(self) -> "Net":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def host(self, name: str) -> Host:
        """A new namespace linked to the bridge, with loopback up and address .{2 + n}."""
        n = len(self.hosts)
        ns, veth, peer = f"{self.tag}{name}", f"{self.tag}v{n}", f"{self.tag}p{n}"
        ip = f"{self.subnet}.{2 + n}"
        _ip("netns", "add", ns)
        h = Host(name, ns, ip, veth)
        self.hosts.append(h)
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", ns)
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        _ip("-n", ns, "link", "set", peer, "name", "eth0")
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        return h

    # -- faults ---------------------------------------------------------------------------------
    def cut(self, h: Host) -> None:
        """Drop everything `h` sends or receives (its link goes down at the bridge)."""
        _ip("link", "set", h.veth, "down")

    def restore(self, h: Host) -> None:
        _ip("link", "set", h.veth, "up")

    def cut_path(self, a: Host, b: Host) -> None:
        """Drop only the traffic between `a` and `b`; both still reach every other host."""
        for x, y in ((a, b), (b, a)):
            _ip("-n", x.ns, "route", "add", "blackhole", f"{y.ip}/32")
            self._blackholes.add((x.ns, y.ip))

    def restore_path(self, a: Host, b: Host) -> None:
        for x, y in ((a, b), (b, a)):
            _ip("-n", x.ns, "route", "del", "blackhole", f"{y.ip}/32", check=False)
            self._blackholes.discard((x.ns, y.ip))

    # -- cleanup --------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process in our namespaces by PID, then delete namespaces, veths, bridge."""
        for h in self.hosts:
            for link in (h.veth,):
                _ip("link", "set", link, "up", check=False)  # a cut link must not outlive the test
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pids = {p for h in self.hosts for p in h.pids()}
            pids |= {p.pid for h in self.hosts for p in h.procs if p.poll() is None}
            if not pids:
                break
            for pid in pids:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            time.sleep(0.1)
        for h in self.hosts:
            for p in h.procs:
                try:
                    p.wait(2)
                except subprocess.TimeoutExpired:
                    pass
            _ip("netns", "del", h.ns, check=False)
            _ip("link", "del", h.veth, check=False)
        _ip("link", "del", self.bridge, check=False)
        self.hosts.clear()


def leftovers() -> list[str]:
    """Namespaces and links of ours that still exist (a crashed test run)."""
    ns = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines()
          if line.startswith(TAG_PREFIX)]
    links = [line.split(":")[1].strip().split("@")[0] for line in _ip("-o", "link", check=False).stdout.splitlines()
             if line.split(":")[1].strip().startswith(TAG_PREFIX)]
    return ns + links
