"""The catch-up state server: serves the current publication of one rank's state shard, whole
or as parts (byte ranges) on parallel connections. Wire format and consistency rules: the
docstring of `lightning_ft/replica/catchup.py`."""
from __future__ import annotations

import hmac
import json
import secrets
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Callable, Optional, cast

import torch
from cryptography.hazmat.primitives.poly1305 import Poly1305

from lightning_ft.replica.catchup.wire import (ACK, MAC_BYTES, MAX_SKEW_S, SEND_CHUNK, _LEN, Part, bytes_of,
                                               local_tag, log, pieces, request_tag, response_macs, spec_of)
from lightning_ft.threads import Thread

if TYPE_CHECKING:
    from typing_extensions import Buffer


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
    admitted: dict[tuple[str, str, int], set[int]] = field(default_factory=dict)
    """(fetcher, fetch id, part count) -> the parts of that fetch admitted so far."""
    acked: dict[tuple[str, str, int], set[int]] = field(default_factory=dict)
    """Same keys -> the parts the fetcher acknowledged; all of them: the fetcher completed."""

    @property
    def released(self) -> bool:
        """Some tensor a new fetch would need was dropped by freeze."""
        return any(b is None for b in self.buffers)

    @property
    def total(self) -> int:
        return sum(s["nbytes"] for s in self.specs)


@dataclass(eq=False)
class _Send:
    """One part of a fetch being served: the bytes [lo, hi) of the concatenated tensors."""

    pub: _Publication
    fetcher: str
    sock: socket.socket
    part: Part
    lo: int
    hi: int
    pos: int = 0
    """Bytes before `pos` reached this fetcher's socket."""
    busy: bool = False
    """A chunk send reading the tensor memory is in flight."""

    @property
    def group(self) -> tuple[str, str, int]:
        return self.fetcher, self.part.fetch, self.part.count


class StateServer:
    """Serves the current publication of one rank's state shard over HTTP (see the module
    docstring of `lightning_ft.replica.catchup.http`)."""

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
        assert isinstance(host, str)  # getsockname() of an AF_INET socket
        self.address = f"{host}:{port}"
        self._thread = Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True,
                              name=f"catchup-{self.address}")
        self._thread.start()
        self.local_name: Optional[str] = None
        """The same-host listener's abstract Unix socket name (without its leading NUL; random, so
        it cannot be taken before it is bound), or None where there is none (not Linux)."""
        self._local: Optional[_LocalHTTPServer] = None
        try:
            name = f"lft-catchup-{secrets.token_hex(12)}"
            self._local = _LocalHTTPServer("\0" + name, _make_handler(self))
            self.local_name = name
        except (OSError, AttributeError):  # no abstract Unix sockets here: TCP only
            self._local = None
        if self._local is not None:
            self._local_thread = Thread(target=self._local.serve_forever, args=(0.05,), daemon=True,
                                        name=f"catchup-local-{self.address}")
            self._local_thread.start()

    # -- owner side (training thread) ------------------------------------------------------------

    def publish(self, version: int, tensors: dict[str, torch.Tensor], meta: dict,
                expected: set[str] | frozenset[str] = frozenset()) -> None:
        """Serve `tensors` (live references, not copied) and `meta` (encoded now) as `version`.
        Device (CUDA) tensors are copied to host memory now: the bytes served are this version's."""
        tensors = {n: t.detach().to("cpu") if t.device.type != "cpu" else t for n, t in tensors.items()}
        specs = [spec_of(n, t) for n, t in tensors.items()]
        # cast: numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12
        buffers: list[Optional[memoryview]] = [
            memoryview(cast("Buffer", bytes_of(t).numpy())) if s["nbytes"] else memoryview(b"")
            for s, t in zip(specs, tensors.values(), strict=True)]
        # "publication" tells the parts of one fetch apart from those of a republished version
        body = json.dumps({"version": int(version), "publication": secrets.token_hex(8), "meta": meta,
                           "tensors": specs}).encode()
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
                    assert buf is not None  # only freeze drops buffers, once per publication (pub.frozen)
                    if i in keep and len(buf):
                        # torch's copy releases the GIL and uses the intra-op threads; the array keeps the clone alive
                        clone = torch.frombuffer(buf, dtype=torch.uint8).clone().numpy()
                        pub.buffers[i] = memoryview(cast("Buffer", clone))
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
        """Fetcher ids that completed a fetch of the current version (every part acknowledged)."""
        with self._cond:
            return set(self._pub.completed) if self._pub else set()

    def close(self) -> None:
        self.retire()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)
        if self._local is not None:
            self._local.shutdown()
            self._local.server_close()
            self._local_thread.join(5)

    # -- internals ---------------------------------------------------------------------------------

    def _still_needed(self, pub: _Publication) -> set[int]:
        """Indices of the tensors some pending fetch has not received yet (lock held, nothing busy)."""
        active = [s for s in self._sends if s.pub is pub]
        everything = set(range(len(pub.buffers)))
        if pub.expected - pub.completed - {s.fetcher for s in active}:
            return everything  # an expected fetcher has not started (or will retry)
        if any(len(pub.admitted[s.group]) < s.part.count for s in active):
            return everything  # a fetch whose other parts have not arrived yet
        sizes = [s["nbytes"] for s in pub.specs]
        return {i for s in active for i, _, _ in pieces(sizes, s.pos, s.hi)}

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

    def _admit(self, version: int, fetcher: str, part: Part,
               sock: socket.socket) -> tuple[int, dict, Optional[_Send]]:
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
            lo, hi = part.range(pub.total)
            send = _Send(pub, fetcher, sock, part, lo, hi, lo)
            pub.admitted.setdefault(send.group, set()).add(part.index)
            self._sends.add(send)
            return 200, {}, send

    def _send_chunk(self, send: _Send, i: int, lo: int, hi: int, mac: Poly1305) -> None:
        with self._cond:
            while self._freezing:
                self._cond.wait()
            if self._pub is not send.pub:
                raise ConnectionAbortedError("publication replaced or retired during the fetch")
            buf = send.pub.buffers[i]
            if buf is None:  # cannot happen: freeze keeps the tensors each active send has not sent
                raise ConnectionAbortedError(f"tensor {i} was dropped during the fetch")
            send.busy = True
        try:
            piece = buf[lo:hi]
            if send.sock.family != socket.AF_UNIX:  # same host: the kernel carries the bytes unaltered
                mac.update(piece)  # holds the GIL (~6.5 GB/s from memory); the send releases it
            send.sock.sendall(piece)
        finally:
            with self._cond:
                send.busy = False
                send.pos += hi - lo
                self._cond.notify_all()

    def _serve(self, send: _Send, nonce: str, start: Callable[[bytes, int], None], write: Callable[[bytes], object],
               read_ack: Callable[[], bytes]) -> None:
        """Start the response (header and its MAC), send the part's tensor bytes in SEND_CHUNK
        pieces, then the body MAC; the part counts once the fetcher acknowledges it, and the
        fetcher is complete once it acknowledged every part of one fetch."""
        try:
            head_mac, body_mac = response_macs(self._secret, nonce, send.pub.version, send.pub.header, send.part)
            start(head_mac, send.hi - send.lo)
            sizes = [s["nbytes"] for s in send.pub.specs]
            for i, a, b in pieces(sizes, send.lo, send.hi):
                for lo in range(a, b, SEND_CHUNK):
                    self._send_chunk(send, i, lo, min(lo + SEND_CHUNK, b), body_mac)
            write(body_mac.finalize())
            if read_ack() != ACK:
                return  # the fetcher refused the state (layout mismatch, another part failed) or died
            with self._cond:
                pub = send.pub
                if self._pub is pub:
                    acked = pub.acked.setdefault(send.group, set())
                    acked.add(send.part.index)
                    if len(acked) == send.part.count:
                        pub.completed.add(send.fetcher)
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
        want = request_tag(self._secret, version, fetcher, nonce, stamp, headers.get("X-LFT-Part", "")).encode()
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


class _LocalHTTPServer(socketserver.ThreadingUnixStreamServer):
    """The same-host listener (an abstract Unix socket): the same handler as over TCP; a part
    sent on it carries no MAC over its tensor bytes (the body MAC covers the header only), as
    nobody without root can alter bytes between two processes of one host. The requests are
    authenticated, and the header MAC proves the server holds the secret, as over TCP."""

    daemon_threads = True


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
            if self.path == "/local":
                return self._local_name()
            parts = self.path.split("/")
            if len(parts) != 3 or parts[1] != "state" or not parts[2].lstrip("-").isdigit():
                return self._error(400, "bad request")
            version = int(parts[2])
            fetcher, why = server._check_auth(version, self.headers)
            if fetcher is None:  # the requester learns nothing; the owner's log says why
                log.warning("%s refused a catch-up request from %s: %s", server.name,
                            self.client_address[0] if self.client_address else "a local peer", why)
                return self._error(401, "authentication failed")
            nonce = self.headers["X-LFT-Nonce"]
            part = Part.parse(self.headers.get("X-LFT-Part", ""), nonce)
            if part is None:
                return self._error(400, "bad X-LFT-Part (want '<fetch id>|<index>/<count>')")
            status, err, send = server._admit(version, fetcher, part, self.connection)
            if send is None:
                return self._error(status, err["error"], err["version"])
            server._serve(send, nonce, lambda head_mac, n: self._start(send.pub, head_mac, n),
                          self.wfile.write, lambda: self.rfile.read(1))

        def _local_name(self) -> None:
            """The same-host listener's name, tagged with the asker's nonce (not secret: any local
            process can list it; the tag tells the fetcher that a holder of the secret named it)."""
            nonce = self.headers.get("X-LFT-Nonce", "")
            if server.local_name is None or not 16 <= len(nonce) <= 128:
                return self._error(404, "no same-host listener" if nonce else "missing X-LFT-Nonce")
            body = json.dumps({"name": server.local_name,
                               "tag": local_tag(server._secret, nonce, server.local_name)}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _start(self, pub: _Publication, head_mac: bytes, nbytes: int) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(pub.header) + MAC_BYTES + nbytes + MAC_BYTES))
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
