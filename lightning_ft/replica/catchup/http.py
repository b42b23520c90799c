"""Non-blocking catch-up transport: a healthy rank serves its state shard, a lagging rank fetches it
(docs/ARCHITECTURE.md, "Catch-up").

Each training rank of a healthy replica runs one `StateServer` (`catchup_server.py`). At the
start of a round with lagging replicas, the training thread snapshots the shard's CPU tensors
and calls `publish(version, tensors, meta, expected)`; that costs no copy, the server keeps
*live* references. Right before the owner mutates those tensors in place (optimizer.step), the
training thread calls `freeze()`. If every expected fetcher is done, freeze only drops the
references. Otherwise it waits for the chunk sends in flight (each is at most `SEND_CHUNK` bytes)
and clones the tensors some pending fetch still needs, so later reads are served from the
copies. A lagging rank calls `fetch_state`, which writes the bytes straight into its
preallocated tensors, over `streams` parallel connections (one part of the bytes each).

Protocol (HTTP/1.0, one request per connection, nothing is ever pickled). A fetch of a state
of T tensor bytes is split into n parts (n = 1 below 2 x `PART_MIN_BYTES`, at most `STREAMS`
by default); part i is the bytes [T*i//n, T*(i+1)//n) of the tensors' bytes concatenated in
order. Each part is one request, on its own connection, with its own nonce:

    GET /state/{version}
    X-LFT-Fetcher: <fetcher id>        e.g. "r2/rank0"
    X-LFT-Nonce:   <random hex>        a nonce is accepted once
    X-LFT-Time:    <unix seconds>      refused if more than 60 s off the server's clock
    X-LFT-Part:    <fetch id>|<i>/<n>  the fetch (random hex, shared by its parts) and the part;
                                       absent: "<nonce>|0/1", the whole state
    X-LFT-Auth:    hex(HMAC-SHA256(secret, f"{version}|{fetcher}|{nonce}|{time}|{part}"))
                   (without "|{part}" when X-LFT-Part is absent)

    200  Content-Length: 8 + H + 16 + (hi - lo) + 16
         body = H as 8-byte big-endian | H bytes of UTF-8 JSON header | header MAC (16 bytes)
                | the part's raw tensor bytes [lo, hi), in order | body MAC (16 bytes)
         header = {"version": v, "publication": <random hex, new at each publish>, "meta": {...},
                   "tensors": [{"name": str, "dtype": "bfloat16", "shape": [..], "nbytes": int}, ...]}
         header MAC = Poly1305(key_h, H + header), body MAC = Poly1305(key_b, H + header + part bytes),
         one-time keys key_x = HMAC-SHA256(secret, "lft-catchup-{header|body}|{nonce}|{version}|{i}/{n}")
    then the fetcher, once every part's body MAC verified, writes ACK (one byte, 0x06) on each
    part's connection; the server counts the fetcher in `completed()` once it acknowledged
    every part of one fetch.
    400  malformed request        401  authentication failed (nothing more is said)
    404  nothing published        409  another version is published (JSON body: {"error", "version"})
    410  this version was frozen without the tensors a new fetch would need (all expected fetchers finished)

Same host: before its parts, a fetcher asks `GET /local` (header X-LFT-Nonce: <random hex>)
and gets {"name": "lft-catchup-<random hex>", "tag": hex(HMAC-SHA256(secret,
f"lft-catchup-local|{nonce}|{name}"))}: the server's second listener, an abstract Unix socket
with a random name (bound before it is told, so nobody can hold it first), with the same handler.
A fetcher that verifies the tag and reaches the socket (the same host and network namespace)
sends every part's request there; otherwise over TCP. On that socket the body MAC covers the
H + header only, not the tensor bytes: between two processes of one host nobody without root
alters bytes in flight (and root or the same user can read the trainer's memory anyway). The
requests are authenticated and the header MAC proves the server holds the secret, as over
TCP. The MACs are most of a fetch's cost on few cores (`bench.catchup`: `tcp_gbps` against
`gbps`).

Errors carry a JSON body {"error": str, "version": int | null}. Both directions are
authenticated, keyed by the job secret and bound to the fetcher's fresh nonce and the part
(so an old response cannot be replayed, nor one part's response pass as another's). The
fetcher verifies every part's header MAC, and that the parts' headers are byte-identical (one
publication), before it looks at the header or writes one tensor byte: a server without the
secret never touches the fetcher's state. It verifies every part's body MAC before it applies
any meta (param_groups, scheduler) or acknowledges any part; a body altered in flight
therefore ends the fetch as `partial` (the replica votes LOST and restarts fresh: unverified
bytes are never trained on). Only known meta keys are applied (`check_meta`). A refusal
before authentication says only "authentication failed"; the server logs why.

Throughput: Poly1305 runs near memory speed (~6.5 GB/s from memory here) but holds the GIL, and one
TCP stream's copies cost more than the MAC; with several parts, one stream's recv_into (GIL
released) overlaps another's MAC, and the kernel copies run on several cores
(`python -m lightning_ft.bench.catchup` measures 1 part against `STREAMS`).

Consistency: a fetch never observes a tensor mutated after `freeze()` returned. Sends are
chunked; each chunk is sent under a reader mark, freeze blocks new chunks, waits for the
marked ones (shutting down a socket stalled for more than `freeze_wait_s`), and clones the
tensors an active part has not sent yet (all of them while an expected fetcher has not
started, or a fetch has parts not yet admitted) before returning. `publish` and `retire` cut
off fetches of the previous publication.
"""
from __future__ import annotations

import functools
import hmac
import json
import secrets
import socket
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional, cast

import torch
from cryptography.hazmat.primitives.poly1305 import Poly1305

from lightning_ft.replica.catchup.server import StateServer
from lightning_ft.replica.catchup.transport import CatchupTransport
from lightning_ft.replica.catchup.wire import (ACK, MAC_BYTES, MAX_PARTS, RECV_CHUNK, SEND_CHUNK, _LEN,
                                               CatchupError, Part, bytes_of, check_layout, check_meta, local_tag,
                                               log, pieces, request_tag, response_macs, status_error)
from lightning_ft.threads import Thread

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["CatchupError", "HTTPTransport", "StateServer", "check_meta", "fetch_state", "SEND_CHUNK", "RECV_CHUNK",
           "STREAMS"]

STREAMS = 4
"""Parts (parallel connections) of a fetch by default; see `fetch_state`."""
PART_MIN_BYTES = 16 << 20
"""A state is split into parts of at least this many bytes (a small state: one connection)."""


# ---------------------------------------------------------------------------------------------- client


def fetch_state(address: str, version: int, into: dict[str, torch.Tensor], secret: bytes, fetcher: str,
                timeout_s: float = 30.0, param_groups: Optional[list[dict]] = None,
                streams: Optional[int] = None, local: bool = True) -> tuple[dict, dict]:
    """Fetch `version` from the StateServer at `address` straight into the preallocated CPU tensors
    `into` (same names, dtypes and shapes, in order; device tensors through host memory). Every
    socket operation is bounded by `timeout_s`. `streams`: parts fetched on parallel
    connections (None: up to `STREAMS`, one per `PART_MIN_BYTES`). Returns (meta, {"bytes",
    "seconds", "gbps", "streams"}), after every MAC verified; with `param_groups` (the local
    optimizer's), meta is `check_meta`'s, checked before any tensor byte is written. `local`:
    ask the server for its same-host listener first and fetch the parts over it when this
    process reaches it (same host and network namespace): no MAC over the tensor bytes there
    (stats "local": how many parts went that way). Raises CatchupError."""
    where = f"catch-up from {address} (version {version})"
    if not (fetcher.isascii() and fetcher.isprintable() and fetcher.strip() == fetcher and fetcher):
        raise ValueError(f"fetcher id must be printable ASCII without surrounding spaces, got {fetcher!r}")
    # Device (CUDA) tensors are fetched into host memory and copied over once every MAC
    # verified: a failed fetch leaves them as they were.
    device = {n: t for n, t in into.items() if t.device.type != "cpu"}
    staged = {n: torch.empty(t.shape, dtype=t.dtype) if n in device else t for n, t in into.items()}
    total = sum(t.numel() * t.element_size() for t in staged.values())
    n = max(1, min(STREAMS, total // PART_MIN_BYTES)) if streams is None else int(streams)
    if not 1 <= n <= MAX_PARTS:
        raise ValueError(f"streams must be between 1 and {MAX_PARTS}, got {streams}")
    fetch = _Fetch(address, version, staged, bytes(secret), fetcher, timeout_s, param_groups, n, where)
    if local:
        fetch.local_name = _local_name(address, bytes(secret), timeout_s)
    try:
        out = fetch.run()
    except CatchupError as e:
        e.partial = fetch.written and len(device) < len(into)
        raise
    for name, t in device.items():
        t.copy_(staged[name])
    return out


class HTTPTransport(CatchupTransport):
    """The job's catch-up transport: a `StateServer` for this rank's state and `fetch_state`
    for a peer's (the wire format: this module's docstring)."""

    def __init__(self, secret: bytes, bind_host: str = "127.0.0.1", name: str = "", local: bool = True) -> None:
        self._secret = bytes(secret)
        self.local = local
        """Fetch over a peer's same-host listener when it is reachable (`fetch_state`)."""
        self.server = StateServer(self._secret, bind_host=bind_host, name=name)

    @property
    def address(self) -> str:
        return self.server.address

    def publish(self, version: int, tensors: dict[str, torch.Tensor], meta: dict,
                expected: set[str] | frozenset[str] = frozenset()) -> None:
        self.server.publish(version, tensors, meta, expected)

    def freeze(self) -> float:
        return self.server.freeze()

    def retire(self) -> None:
        self.server.retire()

    def completed(self) -> set[str]:
        return self.server.completed()

    def close(self) -> None:
        self.server.close()

    def fetch(self, address: str, version: int, into: dict[str, torch.Tensor], fetcher: str,
              timeout_s: float = 30.0, param_groups: Optional[list[dict]] = None,
              streams: Optional[int] = None) -> tuple[dict, dict]:
        return fetch_state(address, version, into, self._secret, fetcher, timeout_s=timeout_s,
                           param_groups=param_groups, streams=streams, local=self.local)


class _Stream:
    """One part of a fetch: its connection and response."""

    def __init__(self, part: Part) -> None:
        self.part = part
        self.sock: Optional[socket.socket] = None
        self.body: Optional[_Body] = None
        self.header = b""
        self.mac: Optional[Poly1305] = None
        self.lo = self.hi = 0
        self.family = socket.AF_INET


class _Fetch:
    """The parts of one fetch, run on parallel connections (inline for one part): open every
    part and verify its header MAC; check the headers agree and fit `into`; read every part's
    bytes and verify its body MAC; acknowledge every part."""

    def __init__(self, address: str, version: int, into: dict[str, torch.Tensor], secret: bytes, fetcher: str,
                 timeout_s: float, param_groups: Optional[list[dict]], n: int, where: str) -> None:
        self.address, self.version, self.into, self.secret = address, int(version), into, secret
        self.fetcher, self.timeout_s, self.param_groups, self.where = fetcher, timeout_s, param_groups, where
        fetch_id = secrets.token_hex(8)
        self.streams = [_Stream(Part(fetch_id, i, n)) for i in range(n)]
        self.names = list(into)
        # cast: numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12
        self.views = [memoryview(cast("Buffer", bytes_of(t).numpy())) for t in into.values()]
        self.sizes = [len(v) for v in self.views]
        self.written = False
        """Some tensor bytes may have been written into `into`."""
        self.local_name: Optional[str] = None
        """The server's same-host listener (`_local_name`), tried first for every part."""
        self._lock = threading.Lock()
        self._error: Optional[CatchupError] = None

    def run(self) -> tuple[dict, dict]:
        t0 = time.perf_counter()
        try:
            self._each(self._open)
            head = json.loads(self.streams[0].header[_LEN.size:].decode())
            if any(s.header != self.streams[0].header for s in self.streams):
                raise CatchupError(f"{self.where} failed: its parts came from different publications (the "
                                   f"healthy rank republished during the fetch); nothing was written — retry")
            if head.get("version") != self.version:
                raise CatchupError(f"{self.where} failed: server sent version {head.get('version')}")
            check_layout(head["tensors"], self.into, self.where)
            meta = head.get("meta")
            if self.param_groups is not None:
                meta = check_meta(meta, self.param_groups)
            self._each(self._read)
            for s in self.streams:
                assert s.sock is not None  # _open connected every part
                self._guard(functools.partial(s.sock.sendall, ACK))
        finally:
            for s in self.streams:
                if s.sock is not None:
                    s.sock.close()
        seconds = time.perf_counter() - t0
        total = sum(self.sizes)
        return meta, {"bytes": total, "seconds": seconds, "gbps": total / max(seconds, 1e-9) / 1e9,
                      "streams": len(self.streams),
                      "local": sum(1 for s in self.streams if s.family == socket.AF_UNIX)}

    def _each(self, step: Callable[[_Stream], None]) -> None:
        """Run `step` on every part (in parallel threads if several); raise the first failure.
        A failure shuts every connection down, so the other parts stop at once."""
        if len(self.streams) == 1:
            return self._guard(lambda: step(self.streams[0]))
        threads = [Thread(target=self._step, args=(step, s), daemon=True, name=f"catchup-part{s.part.index}")
                   for s in self.streams]
        for t in threads:
            t.start()
        for t in threads:
            t.join()  # every socket operation of the part is bounded by timeout_s
        if self._error is not None:
            raise self._error

    def _step(self, step: Callable[[_Stream], None], s: _Stream) -> None:
        try:
            self._guard(lambda: step(s))
        except CatchupError as e:
            with self._lock:
                first = self._error is None
                if first:
                    self._error = e
            if first:
                for other in self.streams:
                    if other.sock is not None and other is not s:
                        try:
                            other.sock.shutdown(socket.SHUT_RDWR)
                        except OSError:
                            pass
        except BaseException as e:  # noqa: BLE001 - a bug: reported by run() as a failed fetch
            with self._lock:
                if self._error is None:
                    self._error = CatchupError(f"{self.where} failed: {type(e).__name__}: {e}")

    def _guard(self, fn: Callable[[], None]) -> None:
        """Run a part's socket work; socket and format errors become CatchupErrors."""
        try:
            fn()
        except CatchupError:
            raise
        except TimeoutError as e:
            raise CatchupError(f"{self.where} failed: no progress for {self.timeout_s:g} s ({e}); the healthy "
                               f"rank is stalled or gone — retry in the next round") from e
        except (OSError, ValueError, LookupError) as e:  # LookupError: a garbled status line or header
            raise CatchupError(f"{self.where} failed: {type(e).__name__}: {e}; the healthy rank may have died or "
                               f"moved on — retry in the next round") from e

    def _open(self, s: _Stream) -> None:
        """Connect (the same-host listener if there is one and it answers, else TCP), ask for the
        part, read its header and verify the header MAC."""
        s.sock = _connect_local(self.local_name, self.timeout_s) if self.local_name else None
        if s.sock is None:
            host, _, port = self.address.rpartition(":")
            s.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=self.timeout_s)
        s.family = s.sock.family
        headers = _request_headers(self.secret, self.version, self.fetcher, s.part)
        s.body = _request(s.sock, self.address, f"/state/{self.version}", headers)
        if s.body.status != 200:
            raise _status_error(self.where, s.body)
        raw = _read_header_bytes(s.body, self.where)
        want_head, s.mac = response_macs(self.secret, headers["X-LFT-Nonce"], self.version, raw, s.part)
        got = bytearray(MAC_BYTES)
        _read_exact(s.body, memoryview(got), self.where, "the header MAC")
        if not hmac.compare_digest(want_head, bytes(got)):
            raise CatchupError(f"{self.where} failed: the response is not authentic (header MAC mismatch); the "
                               f"server does not hold the job secret. Nothing was applied")
        s.header = raw

    def _read(self, s: _Stream) -> None:
        """Read the part's bytes into the tensors, then verify its body MAC."""
        assert s.body is not None and s.mac is not None  # _open set them
        s.lo, s.hi = s.part.range(sum(self.sizes))
        if s.body.remaining != s.hi - s.lo + MAC_BYTES:
            raise CatchupError(f"{self.where} failed: part {s.part.index}/{s.part.count} announces "
                               f"{s.body.remaining - MAC_BYTES} tensor bytes, the layout {s.hi - s.lo}; not a "
                               f"lightning-ft state server of this version")
        before = s.body.remaining
        # same host: the kernel carries the bytes unaltered, and the body MAC covers the header only
        mac = None if s.family == socket.AF_UNIX else s.mac
        try:
            for i, a, b in pieces(self.sizes, s.lo, s.hi):
                _read_exact(s.body, self.views[i][a:b], self.where, f"tensor {self.names[i]!r}", mac)
        finally:
            # every body byte read from here on went into the destination: a server that died
            # before the first one left it as it was (the fetch may be retried, not restarted)
            self.written |= s.body.remaining < before
        got = bytearray(MAC_BYTES)
        _read_exact(s.body, memoryview(got), self.where, "the body MAC")
        if not hmac.compare_digest(s.mac.finalize(), bytes(got)):
            raise CatchupError(f"{self.where} failed: the state bytes are not authentic (body MAC mismatch: altered "
                               f"in flight); they must not be used")


class _Body:
    """The response of one request: status, headers, and the body read into caller buffers."""

    def __init__(self, sock: socket.socket, status: int, headers: dict[str, str], rest: bytes) -> None:
        self.sock, self.status, self._rest = sock, status, rest
        self.remaining = int(headers.get("content-length", len(rest)))

    def readinto(self, buf: memoryview) -> int:
        """Up to len(buf) body bytes into buf; 0 at the end of the body or when the server closed."""
        buf = buf[:self.remaining]
        if self._rest:
            n = min(len(buf), len(self._rest))
            buf[:n] = self._rest[:n]
            self._rest = self._rest[n:]
        else:
            n = self.sock.recv_into(buf) if len(buf) else 0
        self.remaining -= n
        return n


def _local_name(address: str, secret: bytes, timeout_s: float) -> Optional[str]:
    """The same-host listener the server at `address` names (GET /local, its answer tagged with
    our nonce), or None: an older server, none there, or an answer without the secret's tag
    (then the fetch goes over TCP, where the MACs decide)."""
    nonce = secrets.token_hex(16)
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=min(timeout_s, 2.0)) as sock:
            resp = _request(sock, address, "/local", {"X-LFT-Nonce": nonce})
            raw = bytearray(min(max(resp.remaining, 0), 4096))
            _read_exact(resp, memoryview(raw), address, "the same-host answer")
        if resp.status != 200:
            return None
        answer = json.loads(raw)
        name, tag = str(answer["name"]), str(answer["tag"])
    except (OSError, ValueError, LookupError, TypeError, CatchupError):
        return None
    if not (name.startswith("lft-catchup-") and name.isascii() and name.isprintable()):
        return None
    if not hmac.compare_digest(tag.encode(), local_tag(secret, nonce, name).encode()):
        log.warning("catch-up server %s named a same-host listener without the job secret's tag; fetching over TCP",
                    address)
        return None
    return name


def _connect_local(name: str, timeout_s: float) -> Optional[socket.socket]:
    """A connection to the abstract Unix socket `name`, or None where this process does not reach
    it (another host or network namespace)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect("\0" + name)
    except OSError:
        sock.close()
        return None
    return sock


def _request(sock: socket.socket, address: str, path: str, headers: dict[str, str]) -> _Body:
    """Send the authenticated GET and read the status line and headers."""
    lines = [f"GET {path} HTTP/1.0", f"Host: {address}", *(f"{k}: {v}" for k, v in headers.items())]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    raw = b""
    while b"\r\n\r\n" not in raw:
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("connection closed before the response headers")
        raw += chunk
        if len(raw) > 1 << 20:
            raise ValueError("response headers longer than 1 MB; not a lightning-ft state server")
    head, _, rest = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    fields = [line.split(":", 1) for line in header_lines if ":" in line]
    return _Body(sock, int(status_line.split()[1]), {k.strip().lower(): v.strip() for k, v in fields}, rest)


def _request_headers(secret: bytes, version: int, fetcher: str, part: Optional[Part] = None) -> dict[str, str]:
    """The authenticated request headers, with a fresh nonce (and the part, when given)."""
    nonce, stamp = secrets.token_hex(16), str(int(time.time()))
    headers = {"X-LFT-Fetcher": fetcher, "X-LFT-Nonce": nonce, "X-LFT-Time": stamp}
    if part is not None:
        headers["X-LFT-Part"] = part.header
    headers["X-LFT-Auth"] = request_tag(bytes(secret), int(version), fetcher, nonce, stamp,
                                        part.header if part is not None else "")
    return headers


def _status_error(where: str, resp: _Body) -> CatchupError:
    raw = bytearray(min(resp.remaining, 1 << 16))
    try:
        _read_exact(resp, memoryview(raw), where, "the error body")
        body = json.loads(raw or b"{}")
    except (ValueError, OSError, CatchupError):
        body = {}
    return status_error(where, resp.status, body.get("error") or f"HTTP {resp.status}", body.get("version"))


def _read_exact(resp: _Body, buf: memoryview, where: str, what: str, mac: Optional[Poly1305] = None) -> None:
    """Fill `buf`; `mac` takes each piece while it is still in cache."""
    got = 0
    while got < len(buf):
        n = resp.readinto(buf[got:got + RECV_CHUNK])
        if not n:
            raise CatchupError(f"{where} failed: body truncated in {what} ({got} of {len(buf)} bytes); the "
                               f"healthy rank closed the connection (died, or retired the state) — retry")
        if mac is not None:
            mac.update(buf[got:got + n])
        got += n


MAX_HEADER = 64 << 20
"""Largest accepted JSON header (tensor list and meta), read before it is authenticated."""


def _read_header_bytes(resp: _Body, where: str) -> bytes:
    """The 8-byte length and the header it announces, as sent (not parsed: not yet verified)."""
    raw = bytearray(_LEN.size)
    _read_exact(resp, memoryview(raw), where, "the header length")
    (hlen,) = _LEN.unpack(raw)
    if hlen > min(MAX_HEADER, max(0, resp.remaining)):
        raise CatchupError(f"{where} failed: implausible header length {hlen}; not a lightning-ft state server")
    body = bytearray(hlen)
    _read_exact(resp, memoryview(body), where, "the header")
    return bytes(raw + body)
