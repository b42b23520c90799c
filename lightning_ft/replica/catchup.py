"""Non-blocking catch-up transport: a healthy rank serves its state shard, a lagging rank fetches it (DESIGN §6).

Each training rank of a healthy replica runs one `StateServer`. At the start of a round with
lagging replicas, the training thread snapshots the shard's CPU tensors and calls
`publish(version, tensors, meta, expected)`; that costs no copy, the server keeps *live*
references. Right before the owner mutates those tensors in place (optimizer.step), the
training thread calls `freeze()`. If every expected fetcher is done, freeze only drops the
references. Otherwise it waits for the chunk sends in flight (each is at most `SEND_CHUNK` bytes)
and clones the tensors some pending fetch still needs, so later reads are served from the
copies. A lagging rank calls `fetch_state`, which writes the bytes straight into its
preallocated tensors.

Protocol (HTTP/1.0, one request per connection, nothing is ever pickled):

    GET /state/{version}
    X-LFT-Fetcher: <fetcher id>        e.g. "r2/rank0"
    X-LFT-Nonce:   <random hex>        a nonce is accepted once
    X-LFT-Time:    <unix seconds>      refused if more than 60 s off the server's clock
    X-LFT-Auth:    hex(HMAC-SHA256(secret, f"{version}|{fetcher}|{nonce}|{time}"))

    200  Content-Length: 8 + H + 16 + sum(nbytes) + 16
         body = H as 8-byte big-endian | H bytes of UTF-8 JSON header | header MAC (16 bytes)
                | raw tensor bytes, in order | body MAC (16 bytes)
         header = {"version": v, "meta": {...},
                   "tensors": [{"name": str, "dtype": "bfloat16", "shape": [..], "nbytes": int}, ...]}
         header MAC = Poly1305(key_h, H + header), body MAC = Poly1305(key_b, H + header + tensor bytes),
         one-time keys key_x = HMAC-SHA256(secret, "lft-catchup-{header|body}|{nonce}|{version}")
    then the fetcher, having read and checked the whole body, writes ACK (one byte, 0x06) on the
    same connection; only then does the server count it in `completed()`.
    400  malformed request        401  authentication failed (nothing more is said)
    404  nothing published        409  another version is published (JSON body: {"error", "version"})
    410  this version was frozen without the tensors a new fetch would need (all expected fetchers finished)

Errors carry a JSON body {"error": str, "version": int | null}. Both directions are
authenticated, keyed by the job secret and bound to the fetcher's fresh nonce (so an old
response cannot be replayed). The fetcher verifies the header MAC before it looks at the
header or writes one tensor byte: a server without the secret never touches the fetcher's
state. It verifies the body MAC before it applies any meta (param_groups, scheduler) or
acknowledges; a body altered in flight therefore ends the fetch as `partial` (the replica
votes LOST and restarts fresh: unverified bytes are never trained on). Only known meta keys
are applied (`check_meta`). A refusal before authentication says only "authentication
failed"; the server logs why.

Consistency: a fetch never observes a tensor mutated after `freeze()` returned. Sends are
chunked; each chunk is sent under a reader mark, freeze blocks new chunks, waits for the
marked ones (shutting down a socket stalled for more than `freeze_wait_s`), and clones
before returning. `publish` and `retire` cut off fetches of the previous publication.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

import torch
from cryptography.hazmat.primitives.poly1305 import Poly1305
from lightning_ft.threads import Thread

SEND_CHUNK = 1 << 20
"""Bytes per send under one reader mark: bounds how long freeze() waits for sends in flight."""
RECV_CHUNK = 4 << 20
"""Bytes per recv_into on the fetcher."""
MAX_SKEW_S = 60.0
"""Largest accepted difference between the fetcher's X-LFT-Time and the server clock."""
ACK = b"\x06"
"""The byte a fetcher sends back after it read and accepted the whole body."""
MAC_BYTES = 16
META_KEYS = ("step", "param_groups", "scheduler", "scaler")
"""The meta a fetcher accepts; any other key a server sends is dropped."""
_LEN = struct.Struct(">Q")
log = logging.getLogger(__name__)


class CatchupError(RuntimeError):
    """A fetch failed. `status` is the server's HTTP status (None: no answer) and
    `server_version` the version it holds, when it said so (409)."""

    def __init__(self, message: str, status: Optional[int] = None, server_version: Optional[int] = None) -> None:
        super().__init__(message)
        self.status = status
        self.server_version = server_version
        self.partial = False
        """Some tensor bytes were already written into the destination: it is no longer
        the state it was before the fetch."""

    def not_yet_published(self, version: int) -> bool:
        """The server has nothing, or a version older than `version`: it may publish soon."""
        return self.status == 404 or (self.status == 409 and self.server_version is not None
                                      and self.server_version < version)


def _auth(secret: bytes, version: int, fetcher: str, nonce: str, stamp: str) -> str:
    return hmac.new(secret, f"{version}|{fetcher}|{nonce}|{stamp}".encode(), hashlib.sha256).hexdigest()


def _response_macs(secret: bytes, nonce: str, version: int, header: bytes) -> tuple[bytes, Poly1305]:
    """(header MAC, body MAC in progress: the header is in it, the tensor bytes follow).

    Poly1305 (several GB/s, where HMAC-SHA256 costs more than the copy) with one-time keys
    derived from the secret and the request's nonce: a server answers a nonce once, so no
    key authenticates two messages."""
    def key(what: str) -> bytes:
        return hmac.new(secret, f"lft-catchup-{what}|{nonce}|{int(version)}".encode(), hashlib.sha256).digest()

    head = Poly1305(key("header"))
    head.update(header)
    body = Poly1305(key("body"))
    body.update(header)
    return head.finalize(), body


def check_meta(meta: object, param_groups: list[dict]) -> dict:
    """The part of a (verified) response's meta a fetcher may apply: known keys only, and in
    each param group only the keys the local group has, with values of the local type.
    Raises CatchupError when the structure cannot be ours (another optimizer)."""
    if not isinstance(meta, dict):
        raise CatchupError(f"meta is {type(meta).__name__}, not a mapping")
    out = {k: meta[k] for k in META_KEYS if k in meta}
    dropped = sorted(set(meta) - set(META_KEYS))
    if dropped:
        log.warning("catch-up: ignoring unknown meta keys %s", dropped)
    groups = out.get("param_groups", [])
    if not isinstance(groups, list) or len(groups) != len(param_groups):
        raise CatchupError(f"the server's optimizer has {len(groups) if isinstance(groups, list) else '?'} param "
                           f"groups, ours {len(param_groups)}; both replicas must build the same optimizer")
    clean = []
    for i, (theirs, ours) in enumerate(zip(groups, param_groups)):
        if not isinstance(theirs, dict):
            raise CatchupError(f"param group {i} from the server is not a mapping")
        group = {}
        for key, value in theirs.items():
            if key == "params" or key not in ours:
                continue
            mine = ours[key]
            if isinstance(mine, (tuple, list)) and isinstance(value, list) and len(value) == len(mine):
                value = type(mine)(value)
            elif isinstance(mine, bool) or mine is None:
                if not (value is None or isinstance(value, bool)):
                    raise CatchupError(f"param group {i} key {key!r}: server sent {value!r}, ours is {mine!r}")
            elif isinstance(mine, (int, float)):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise CatchupError(f"param group {i} key {key!r}: server sent {value!r}, ours is {mine!r}")
            elif type(value) is not type(mine):
                raise CatchupError(f"param group {i} key {key!r}: server sent a {type(value).__name__}, ours is "
                                   f"a {type(mine).__name__}")
            group[key] = value
        clean.append(group)
    out["param_groups"] = clean
    if "step" in out and (isinstance(out["step"], bool) or not isinstance(out["step"], int)):
        raise CatchupError(f"meta step {out['step']!r} is not an integer")
    if out.get("scaler") is not None:
        from lightning_ft.replica.scaler import ScalerStateError, check_state

        try:
            out["scaler"] = check_state(out["scaler"])
        except ScalerStateError as e:
            raise CatchupError(f"the server's loss scale cannot be applied: {e}") from None
    return out


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The flat uint8 view of a contiguous CPU tensor (0-dim and bf16 included); never a copy."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"catch-up tensors must be contiguous CPU tensors, got device={t.device} "
                         f"contiguous={t.is_contiguous()}")
    return t.detach().view(-1).view(torch.uint8)  # (nbytes,)


def _spec(name: str, t: torch.Tensor) -> dict:
    return {"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "nbytes": t.numel() * t.element_size()}


# ---------------------------------------------------------------------------------------------- server


@dataclass(eq=False)
class _Publication:
    version: int
    specs: list[dict]
    header: bytes
    """8-byte length + JSON header, encoded at publish time (so meta is a snapshot)."""
    buffers: list[Optional[memoryview]]
    """Byte view of each tensor: live at first, a frozen copy after freeze, None when dropped."""
    expected: frozenset[str]
    completed: set[str] = field(default_factory=set)
    frozen: bool = False

    @property
    def released(self) -> bool:
        """Some tensor a new fetch would need was dropped by freeze."""
        return any(b is None for b in self.buffers)


@dataclass(eq=False)
class _Send:
    """One fetch being served."""

    pub: _Publication
    fetcher: str
    sock: socket.socket
    index: int = 0
    """The tensor being sent; those before it reached this fetcher's socket in full."""
    busy: bool = False
    """A chunk send reading the tensor memory is in flight."""


class StateServer:
    """Serves the current publication of one rank's state shard over HTTP (see module docstring)."""

    freeze_wait_s: float = 2.0
    """How long freeze/retire wait for a chunk send before shutting its stalled socket down."""
    request_timeout_s: float = 30.0
    """Socket timeout of a served connection."""

    def __init__(self, secret: bytes, bind_host: str = "127.0.0.1", name: str = "") -> None:
        self.name = name or "state server"
        self._secret = bytes(secret)
        self._cond = threading.Condition()
        self._pub: Optional[_Publication] = None
        self._sends: set[_Send] = set()
        self._freezing = False
        self._nonces: dict[str, float] = {}
        self.frozen_bytes = 0
        """Bytes cloned by the last freeze()."""
        self._httpd = ThreadingHTTPServer((bind_host, 0), _make_handler(self))
        self._httpd.daemon_threads = True
        host, port = self._httpd.server_address[:2]
        self.address = f"{host}:{port}"
        self._thread = Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True,
                                        name=f"catchup-{self.address}")
        self._thread.start()

    # -- owner side (training thread) ------------------------------------------------------------

    def publish(self, version: int, tensors: dict[str, torch.Tensor], meta: dict,
                expected: set[str] = frozenset()) -> None:
        """Serve `tensors` (live references, not copied) and `meta` (encoded now) as `version`.
        Device (CUDA) tensors are copied to host memory now: the bytes served are this version's."""
        tensors = {n: t.detach().to("cpu") if t.device.type != "cpu" else t for n, t in tensors.items()}
        specs = [_spec(n, t) for n, t in tensors.items()]
        buffers = [memoryview(_bytes_of(t).numpy()) if s["nbytes"] else memoryview(b"")
                   for s, t in zip(specs, tensors.values())]
        body = json.dumps({"version": int(version), "meta": meta, "tensors": specs}).encode()
        pub = _Publication(int(version), specs, _LEN.pack(len(body)) + body, buffers, frozenset(expected))
        with self._cond:
            self._pub = pub  # chunk sends of the previous publication stop at their next chunk ...
            self._quiesce()  # ... and those in flight finish before we return
            self.frozen_bytes = 0

    def freeze(self) -> float:
        """Stop reading the live tensors before the owner mutates them; returns the seconds spent."""
        t0 = time.perf_counter()
        with self._cond:
            pub = self._pub
            if pub is None or pub.frozen:
                return time.perf_counter() - t0
            self._freezing = True
            try:
                self._quiesce()
                keep = self._still_needed(pub)
                cloned = 0
                for i, buf in enumerate(pub.buffers):
                    if i in keep and len(buf):
                        # torch's copy releases the GIL and uses the intra-op threads; the array keeps the clone alive
                        pub.buffers[i] = memoryview(torch.frombuffer(buf, dtype=torch.uint8).clone().numpy())
                        cloned += len(buf)
                    elif len(buf):
                        pub.buffers[i] = None
                pub.frozen = True
                self.frozen_bytes = cloned
            finally:
                self._freezing = False
                self._cond.notify_all()
        return time.perf_counter() - t0

    def retire(self) -> None:
        """Drop the publication; fetches in flight are cut off and later ones get 404."""
        with self._cond:
            self._pub = None
            self._quiesce()

    def completed(self) -> set[str]:
        """Fetcher ids that completed a fetch of the current version."""
        with self._cond:
            return set(self._pub.completed) if self._pub else set()

    def close(self) -> None:
        self.retire()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    # -- internals ---------------------------------------------------------------------------------

    def _still_needed(self, pub: _Publication) -> set[int]:
        """Indices of the tensors some pending fetch has not received yet (lock held, nothing busy)."""
        active = [s for s in self._sends if s.pub is pub]
        if pub.expected - pub.completed - {s.fetcher for s in active}:
            return set(range(len(pub.buffers)))  # an expected fetcher has not started (or will retry)
        return {i for s in active for i in range(s.index, len(pub.buffers))}

    def _quiesce(self) -> None:
        """Wait (lock held) until no chunk send is reading tensor memory; after `freeze_wait_s`,
        shut the stalled sockets down so their sends fail at once."""
        deadline = time.monotonic() + self.freeze_wait_s
        while busy := [s for s in self._sends if s.busy]:
            left = deadline - time.monotonic()
            if left <= 0:
                for s in busy:
                    try:
                        s.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                left = 0.05
            self._cond.wait(left)

    def _admit(self, version: int, fetcher: str, sock: socket.socket) -> tuple[int, dict, Optional[_Send]]:
        """Decide the answer to an authenticated request: (status, error body, send to serve)."""
        with self._cond:
            pub = self._pub
            if pub is None:
                return 404, {"error": f"{self.name} has nothing published", "version": None}, None
            if pub.version != version:
                return 409, {"error": f"{self.name} has version {pub.version}, not {version}",
                             "version": pub.version}, None
            if pub.released:
                return 410, {"error": f"{self.name} froze version {version} after all expected fetchers "
                                     f"finished and no longer holds its tensors", "version": pub.version}, None
            send = _Send(pub, fetcher, sock)
            self._sends.add(send)
            return 200, {}, send

    def _send_chunk(self, send: _Send, i: int, lo: int, hi: int, mac: Poly1305) -> None:
        with self._cond:
            while self._freezing:
                self._cond.wait()
            if self._pub is not send.pub:
                raise ConnectionAbortedError("publication replaced or retired during the fetch")
            buf = send.pub.buffers[i]
            if buf is None:  # cannot happen: freeze keeps tensors from each active send's index on
                raise ConnectionAbortedError(f"tensor {i} was dropped during the fetch")
            send.busy = True
        try:
            piece = buf[lo:hi]
            mac.update(piece)  # releases the GIL, like the send
            send.sock.sendall(piece)
        finally:
            with self._cond:
                send.busy = False
                self._cond.notify_all()

    def _serve(self, send: _Send, nonce: str, start: Callable[[bytes], None], write: Callable[[bytes], None],
               read_ack: Callable[[], bytes]) -> None:
        """Start the response (header and its MAC), send every tensor's bytes in SEND_CHUNK
        pieces, then the body MAC; the fetcher is complete once it acknowledges."""
        try:
            head_mac, body_mac = _response_macs(self._secret, nonce, send.pub.version, send.pub.header)
            start(head_mac)
            for i, spec in enumerate(send.pub.specs):
                for lo in range(0, spec["nbytes"], SEND_CHUNK):
                    self._send_chunk(send, i, lo, min(lo + SEND_CHUNK, spec["nbytes"]), body_mac)
                with self._cond:
                    send.index = i + 1
            write(body_mac.finalize())
            if read_ack() != ACK:
                return  # the fetcher refused the state (layout mismatch) or died
            with self._cond:
                if self._pub is send.pub:
                    send.pub.completed.add(send.fetcher)
        finally:
            with self._cond:
                self._sends.discard(send)
                self._cond.notify_all()

    def _check_auth(self, version: int, headers) -> tuple[Optional[str], str]:
        """(fetcher id, "") if the request is authentic, else (None, reason)."""
        fetcher, nonce = headers.get("X-LFT-Fetcher", ""), headers.get("X-LFT-Nonce", "")
        stamp, tag = headers.get("X-LFT-Time", ""), headers.get("X-LFT-Auth", "")
        if not (fetcher and nonce and stamp and tag):
            return None, "missing X-LFT-Fetcher/Nonce/Time/Auth headers"
        want = _auth(self._secret, version, fetcher, nonce, stamp).encode()
        if not hmac.compare_digest(want, tag.encode("utf-8", "surrogateescape")):
            return None, "bad HMAC (wrong job secret)"
        try:
            skew = abs(time.time() - float(stamp))
        except ValueError:
            return None, f"bad X-LFT-Time {stamp!r}"
        if skew > MAX_SKEW_S:
            return None, f"timestamp {skew:.0f} s off the server clock (limit {MAX_SKEW_S:.0f} s)"
        with self._cond:
            now = time.monotonic()
            self._nonces = {n: t for n, t in self._nonces.items() if now - t < 2 * MAX_SKEW_S}
            if nonce in self._nonces:
                return None, "replayed nonce"
            self._nonces[nonce] = now
        return fetcher, ""


def _make_handler(server: StateServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = server.request_timeout_s
        wbufsize = 0  # wfile writes go straight to the socket

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - quiet server
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server naming
            try:
                self._get()
            except OSError:  # fetcher went away, timed out, or freeze/retire cut us off
                self.close_connection = True

        def _get(self) -> None:
            parts = self.path.split("/")
            if len(parts) != 3 or parts[1] != "state" or not parts[2].lstrip("-").isdigit():
                return self._error(400, "bad request")
            version = int(parts[2])
            fetcher, why = server._check_auth(version, self.headers)
            if fetcher is None:  # the requester learns nothing; the owner's log says why
                log.warning("%s refused a catch-up request from %s: %s", server.name, self.client_address[0], why)
                return self._error(401, "authentication failed")
            status, err, send = server._admit(version, fetcher, self.connection)
            if send is None:
                return self._error(status, err["error"], err["version"])
            server._serve(send, self.headers["X-LFT-Nonce"], lambda head_mac: self._start(send.pub, head_mac),
                          self.wfile.write, lambda: self.rfile.read(1))

        def _start(self, pub: _Publication, head_mac: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            size = len(pub.header) + MAC_BYTES + sum(s["nbytes"] for s in pub.specs) + MAC_BYTES
            self.send_header("Content-Length", str(size))
            self.end_headers()
            self.wfile.write(pub.header + head_mac)

        def _error(self, status: int, message: str, version: Optional[int] = None) -> None:
            body = json.dumps({"error": message, "version": version}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


# ---------------------------------------------------------------------------------------------- client


def fetch_state(address: str, version: int, into: dict[str, torch.Tensor], secret: bytes, fetcher: str,
                timeout_s: float = 30.0, param_groups: Optional[list[dict]] = None) -> tuple[dict, dict]:
    """Fetch `version` from the StateServer at `address` straight into the preallocated CPU tensors
    `into` (same names, dtypes and shapes, in order; device tensors through host memory). Every socket operation is bounded by
    `timeout_s`. Returns (meta, {"bytes", "seconds", "gbps"}), after both MACs verified;
    with `param_groups` (the local optimizer's), meta is `check_meta`'s, checked before any
    tensor byte is written. Raises CatchupError."""
    where = f"catch-up from {address} (version {version})"
    if not (fetcher.isascii() and fetcher.isprintable() and fetcher.strip() == fetcher and fetcher):
        raise ValueError(f"fetcher id must be printable ASCII without surrounding spaces, got {fetcher!r}")
    host, _, port = address.rpartition(":")
    # Device (CUDA) tensors are fetched into host memory and copied over once both MACs
    # verified: a failed fetch leaves them as they were.
    device = {n: t for n, t in into.items() if t.device.type != "cpu"}
    staged = {n: torch.empty(t.shape, dtype=t.dtype) if n in device else t for n, t in into.items()}
    views = {n: _bytes_of(t) for n, t in staged.items()}
    t0 = time.perf_counter()
    written = [0]
    try:
        out = _fetch(address, version, staged, secret, fetcher, timeout_s, where, host, port, views, t0, written,
                     param_groups)
    except CatchupError as e:
        e.partial = written[0] > 0 and len(device) < len(into)
        raise
    for n, t in device.items():
        t.copy_(staged[n])
    return out


def _fetch(address: str, version: int, into: dict, secret: bytes, fetcher: str, timeout_s: float, where: str,
           host: str, port: str, views: dict, t0: float, written: list,
           param_groups: Optional[list[dict]]) -> tuple[dict, dict]:
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock:
            headers = _request_headers(secret, version, fetcher)
            body = _request(sock, address, version, headers)
            if body.status != 200:
                raise _status_error(where, body)
            raw = _read_header_bytes(body, where)
            want_head, body_mac = _response_macs(bytes(secret), headers["X-LFT-Nonce"], version, raw)
            got = bytearray(MAC_BYTES)
            _read_exact(body, memoryview(got), where, "the header MAC")
            if not hmac.compare_digest(want_head, bytes(got)):
                raise CatchupError(f"{where} failed: the response is not authentic (header MAC mismatch); the "
                                   f"server does not hold the job secret. Nothing was applied")
            head = json.loads(raw[_LEN.size:].decode())
            if head.get("version") != version:
                raise CatchupError(f"{where} failed: server sent version {head.get('version')}")
            _check_layout(head, into, where)
            meta = check_meta(head.get("meta"), param_groups) if param_groups is not None else head.get("meta")
            nbytes = _read_tensors(body, head["tensors"], views, where, written, body_mac)
            if body.remaining != MAC_BYTES:
                raise CatchupError(f"{where} failed: {body.remaining - MAC_BYTES} bytes past the last tensor; "
                                   f"not a lightning-ft state server of this version")
            _read_exact(body, memoryview(got), where, "the body MAC")
            if not hmac.compare_digest(body_mac.finalize(), bytes(got)):
                raise CatchupError(f"{where} failed: the state bytes are not authentic (body MAC mismatch: altered "
                                   f"in flight); they must not be used")
            sock.sendall(ACK)
    except CatchupError:
        raise
    except TimeoutError as e:
        raise CatchupError(f"{where} failed: no progress for {timeout_s:g} s ({e}); the healthy rank is "
                           f"stalled or gone — retry in the next round") from e
    except (OSError, ValueError, LookupError) as e:  # LookupError: a garbled status line or header
        raise CatchupError(f"{where} failed: {type(e).__name__}: {e}; the healthy rank may have died or "
                           f"moved on — retry in the next round") from e
    seconds = time.perf_counter() - t0
    return meta, {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / max(seconds, 1e-9) / 1e9}


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


def _request(sock: socket.socket, address: str, version: int, headers: dict[str, str]) -> _Body:
    """Send the authenticated GET and read the status line and headers."""
    lines = [f"GET /state/{int(version)} HTTP/1.0", f"Host: {address}", *(f"{k}: {v}" for k, v in headers.items())]
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


def _request_headers(secret: bytes, version: int, fetcher: str) -> dict[str, str]:
    nonce, stamp = secrets.token_hex(16), str(int(time.time()))
    return {"X-LFT-Fetcher": fetcher, "X-LFT-Nonce": nonce, "X-LFT-Time": stamp,
            "X-LFT-Auth": _auth(bytes(secret), int(version), fetcher, nonce, stamp)}


def _status_error(where: str, resp: _Body) -> CatchupError:
    raw = bytearray(min(resp.remaining, 1 << 16))
    try:
        _read_exact(resp, memoryview(raw), where, "the error body")
        body = json.loads(raw or b"{}")
    except (ValueError, OSError, CatchupError):
        body = {}
    reason = body.get("error") or f"HTTP {resp.status}"
    if resp.status == 401:
        return CatchupError(f"{where} failed: authentication refused ({reason}); check that both replicas "
                            f"use the same job secret and their clocks agree within {MAX_SKEW_S:.0f} s")
    if resp.status == 409:
        have = body.get("version")
        return CatchupError(f"{where} failed: server has version {have}; the healthy replica moved on or has "
                            f"not published this version yet — retry", 409, have if isinstance(have, int) else None)
    if resp.status in (404, 410):
        return CatchupError(f"{where} failed: {reason} (HTTP {resp.status}); the healthy replica is not "
                            f"serving this version — retry in the next round", resp.status)
    return CatchupError(f"{where} failed: HTTP {resp.status}: {reason}", resp.status)


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


def _check_layout(head: dict, into: dict[str, torch.Tensor], where: str) -> None:
    """The server's tensor list must equal `into` (names, dtypes, shapes, in order)."""
    theirs, ours = head["tensors"], [_spec(n, t) for n, t in into.items()]
    for i, (a, b) in enumerate(zip(theirs, ours)):
        for key in ("name", "dtype", "shape"):
            if a[key] != b[key]:
                raise CatchupError(f"{where} failed: tensor #{i} {b['name']!r}: server has {key} {a[key]} but "
                                   f"the local state has {b[key]}; both replicas must build the same model "
                                   f"and sharding")
    if len(theirs) != len(ours):
        extra = (theirs if len(theirs) > len(ours) else ours)[min(len(theirs), len(ours))]["name"]
        raise CatchupError(f"{where} failed: server has {len(theirs)} tensors, the local state {len(ours)} "
                           f"(first unmatched: {extra!r}); both replicas must build the same model and sharding")


def _read_tensors(resp: _Body, specs: list[dict], views: dict[str, torch.Tensor], where: str,
                  written: list, mac: Poly1305) -> int:
    total = 0
    for spec in specs:
        if spec["nbytes"]:
            written[0] = total + 1  # from here on the destination is being overwritten
            _read_exact(resp, memoryview(views[spec["name"]].numpy()), where, f"tensor {spec['name']!r}", mac)
            total += spec["nbytes"]
    return total
