"""TCP transport for FTAR (DESIGN §4).

One connection per direction to each ring neighbour: we dial the right neighbour and send
on that socket; the left neighbour dials us and we receive on its socket. A sender thread
owns the outgoing socket, so the control thread can receive and reduce while chunks are on
the wire. Each chunk is a fixed header followed by its bytes, written straight from the
registered send buffer and read straight into the registered receive buffer (no copies).

Handshake (length-prefixed JSON), mutual proof of the job secret:
  dialer -> acceptor  hello{job, epoch, replica, rank, index, nonce_d}
  acceptor -> dialer  {ok, replica, rank, nonce_a, mac = HMAC("acceptor", nonce_d, job, epoch, ...)} | {error}
  dialer -> acceptor  {mac = HMAC("dialer", nonce_a, job, epoch, replica, rank, index)}
  acceptor -> dialer  {ok} | {error}
A peer that fails to prove the secret (which also covers another job: the MACs name the
job) is told only "authentication failed"; the acceptor logs why. A wrong rank or a stale
epoch is refused with the reason once the peer has authenticated. Accepted sockets are
parked by (epoch, index) until `connect` for that epoch takes them.

Caps: handshake messages of at most HANDSHAKE_MAX_BYTES, a whole handshake within
HANDSHAKE_TIMEOUT_S, at most MAX_HANDSHAKES handshakes at once (more connections are
closed at once), FATAL messages of at most FATAL_MAX_BYTES. MACs compare in constant time.
"""
from __future__ import annotations

import hmac
import json
import logging
import os
import queue
import socket
import struct
import threading
import time
from typing import Callable, Optional

import torch

from .base import (HEADER_SIZE, KIND_DATA, KIND_FATAL, ChunkHeader, FatalError, Identity, RecoverableError,
                   Transport, mac)

log = logging.getLogger(__name__)

_LEN = struct.Struct("!I")
HANDSHAKE_TIMEOUT_S = 5.0
"""A whole handshake (every message of it) must complete within this."""
HANDSHAKE_MAX_BYTES = 4096
MAX_HANDSHAKES = 32
"""Handshakes in progress at once on one listener; further connections are closed unread."""
FATAL_MAX_BYTES = 4096


def _send_msg(sock: socket.socket, obj: dict) -> None:
    raw = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw)


def _recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(f"handshake not complete within {HANDSHAKE_TIMEOUT_S:g} s")
            sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:], n - got)
        except socket.timeout:
            if deadline is None:
                raise
            raise socket.timeout(f"handshake not complete within {HANDSHAKE_TIMEOUT_S:g} s") from None
        if k == 0:
            raise ConnectionResetError("peer closed the connection")
        got += k
    return bytes(buf)


def _recv_msg(sock: socket.socket, deadline: Optional[float] = None) -> dict:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline))
    if n > HANDSHAKE_MAX_BYTES:
        raise ConnectionError(f"handshake message too large ({n} bytes, limit {HANDSHAKE_MAX_BYTES})")
    msg = json.loads(_recv_exact(sock, n, deadline))
    if not isinstance(msg, dict):
        raise ValueError("handshake message is not a JSON object")
    return msg


def _set_timeout(sock: socket.socket, opt: int, seconds: float) -> None:
    """Kernel-side timeout (SO_RCVTIMEO/SO_SNDTIMEO) on a blocking socket, so that one
    recv(MSG_WAITALL) can take a whole chunk in a single syscall and still time out."""
    sec = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, opt, struct.pack("ll", sec, int((seconds - sec) * 1e6)))


def _recv_all(sock: socket.socket, view: memoryview, deadline: float) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise ConnectionResetError("peer closed the connection")
        got += k
        if got < n and time.monotonic() > deadline:
            raise socket.timeout()


def _tune(sock: socket.socket, timeout_s: float = 600.0) -> None:
    """Blocking socket with generous kernel timeouts: the engine bounds its own waits."""
    sock.settimeout(None)
    _set_timeout(sock, socket.SO_RCVTIMEO, timeout_s)
    _set_timeout(sock, socket.SO_SNDTIMEO, timeout_s)
    # Leave SO_SNDBUF/SO_RCVBUF alone: setting them turns off the kernel's autotuning, which
    # grows loopback buffers well past any fixed size we could pick (measured: 0.97 -> 1.16 GB/s).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _close(sock: Optional[socket.socket]) -> None:
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class _Listener:
    """Accepts left neighbours, runs the acceptor side of the handshake, parks sockets."""

    def __init__(self, ident: Identity, bind_host: str) -> None:
        self.ident = ident
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((bind_host, 0))
        self.sock.listen(64)
        self.address = f"{bind_host}:{self.sock.getsockname()[1]}"
        self.min_epoch = 0
        self.parked: dict[tuple[int, int], socket.socket] = {}
        self.refusals: list[str] = []
        """Why recent connections were refused, newest last (for errors and tests)."""
        self.cv = threading.Condition()
        self.closed = False
        self.on_abort: Optional[Callable[[str, int], None]] = None
        """Called with (reason, ring epoch) when our replica's leader asks us to abort (abort_peer)."""
        self._slots = threading.BoundedSemaphore(MAX_HANDSHAKES)
        threading.Thread(target=self._accept_loop, name=f"ftar-accept-r{ident.replica}", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):  # a connection flood: keep serving the ones we have
                self._note(f"{peer[0]}: more than {MAX_HANDSHAKES} handshakes at once; connection closed")
                _close(conn)
                continue
            threading.Thread(target=self._handshake_slot, args=(conn,), daemon=True).start()

    def _handshake_slot(self, conn: socket.socket) -> None:
        try:
            self._handshake(conn)
        finally:
            self._slots.release()

    def _note(self, reason: str) -> None:
        with self.cv:
            self.refusals.append(reason)
            del self.refusals[:-16]
            self.cv.notify_all()
        log.warning("FTAR r%d/rank%d refused a connection: %s", self.ident.replica, self.ident.rank, reason)

    def _refuse(self, conn: socket.socket, reason: str, told: str = "") -> None:
        """Refuse with `reason` in our log; the peer is told `told` (default: the reason, for
        an authenticated peer)."""
        self._note(reason)
        try:
            _send_msg(conn, {"ok": False, "error": told or reason})
        except OSError:
            pass
        _close(conn)

    def _handshake(self, conn: socket.socket) -> None:
        me = self.ident
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        who = "a peer"
        try:
            hello = _recv_msg(conn, deadline)
            who = f"replica {hello.get('replica')!r} rank {hello.get('rank')!r} of job {str(hello.get('job'))[:64]!r}"
            if hello.get("job") != me.job:
                who += f" (job mismatch: we are {me.job!r})"
            epoch, index = int(hello["epoch"]), int(hello["index"])
            replica, rank, nonce_d = int(hello["replica"]), int(hello["rank"]), str(hello["nonce"])
            control = hello.get("purpose") == "abort"
            nonce_a = os.urandom(16).hex()
            _send_msg(conn, {"ok": True, "replica": me.replica, "rank": me.rank, "nonce": nonce_a,
                             "mac": mac(me.secret, "acceptor", nonce_d, me.job, epoch, me.replica, me.rank)})
            proof = _recv_msg(conn, deadline)
            want = mac(me.secret, "dialer", nonce_a, me.job, epoch, replica, rank, index)
            if not hmac.compare_digest(want.encode(), str(proof.get("mac", "")).encode()):
                why = "" if hello.get("job") != me.job else " (wrong job secret)"
                return self._refuse(conn, f"{who}: authentication failed{why}", told="authentication failed")
            # authenticated: from here on the peer may learn why we refuse it
            if control and replica != me.replica:
                return self._refuse(conn, f"{who}: only our own replica's leader may abort us")
            if not control and rank != me.rank:
                return self._refuse(conn, f"{who}: rank mismatch (ring of rank {me.rank})")
            if not control and epoch < self.min_epoch:
                return self._refuse(conn, f"{who}: stale epoch {epoch} < {self.min_epoch}")
            _send_msg(conn, {"ok": True})
            if control:
                _close(conn)
                if self.on_abort is not None:
                    self.on_abort(str(hello.get("reason", "aborted by the replica leader")), int(hello.get("ring", -1)))
                return
            conn.settimeout(None)
            _tune(conn)
            with self.cv:
                if epoch < self.min_epoch or self.closed:
                    _close(conn)
                    return
                _close(self.parked.pop((epoch, index), None))
                self.parked[(epoch, index)] = conn
                self.cv.notify_all()
        except (OSError, ValueError, KeyError, TypeError) as e:  # before authentication: say nothing
            self._refuse(conn, f"{who}: handshake failed: {type(e).__name__}: {e}", told="authentication failed")

    def advance(self, epoch: int) -> None:
        """Refuse and drop everything older than `epoch`."""
        with self.cv:
            self.min_epoch = max(self.min_epoch, epoch)
            for key in [k for k in self.parked if k[0] < self.min_epoch]:
                _close(self.parked.pop(key))

    def take(self, epoch: int, index: int, deadline: float, aborted: threading.Event) -> socket.socket:
        with self.cv:
            while (epoch, index) not in self.parked:
                left = deadline - time.monotonic()
                if left <= 0 or aborted.is_set():
                    why = "aborted" if aborted.is_set() else "timed out"
                    last = f"; last refusal: {self.refusals[-1]}" if self.refusals else ""
                    raise RecoverableError(f"ring index {index}", f"{why} waiting for the left neighbour to "
                                                                  f"connect for epoch {epoch}{last}")
                self.cv.wait(min(left, 0.05))
            return self.parked.pop((epoch, index))

    def close(self) -> None:
        with self.cv:
            self.closed = True
            for s in self.parked.values():
                _close(s)
            self.parked.clear()
            self.cv.notify_all()
        _close(self.sock)


class TcpTransport(Transport):
    zero_copy = True

    def __init__(self, ident: Identity, bind_host: str = "127.0.0.1") -> None:
        self.ident = ident
        self._listener = _Listener(ident, bind_host)
        self.address = self._listener.address
        self._recv_timeout = -1.0
        self._left: Optional[socket.socket] = None
        self._right: Optional[socket.socket] = None
        self._left_name = self._right_name = ""
        self._aborted = threading.Event()
        self._abort_reason = ""
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._sender: Optional[threading.Thread] = None
        self._send_error: Optional[BaseException] = None
        self._posted = 0
        self._done = 0
        self._send_cv = threading.Condition()

    @property
    def refusals(self) -> list[str]:
        return list(self._listener.refusals)

    # -- setup ------------------------------------------------------------------------------------
    def register(self, sendbuf: torch.Tensor, recvbuf: torch.Tensor, slot_bytes: int) -> None:
        """TCP needs no registration: it reads and writes any host memory (zero_copy)."""

    def connect(self, epoch: int, index: int, n: int, left: str, right: str, timeout_s: float) -> None:
        self._teardown()
        self._aborted.clear()
        self._abort_reason = ""
        self._listener.advance(epoch)
        if n == 1:
            return
        deadline = time.monotonic() + timeout_s
        self._right = self._dial(right, epoch, index, deadline)
        self._right_name = right
        try:
            self._left = self._listener.take(epoch, (index - 1) % n, deadline, self._aborted)
        except RecoverableError as e:  # name the neighbour that did not come, so that the quorum can blame it
            raise RecoverableError(left, e.reason) from None
        self._left_name = left
        self._recv_timeout = -1.0
        self._send_error = None
        self._queue = queue.Queue()
        self._posted = self._done = 0
        self._sender = threading.Thread(target=self._send_loop, args=(self._right, self._queue),
                                        name=f"ftar-send-r{self.ident.replica}", daemon=True)
        self._sender.start()

    def abort_peer(self, addr: str, reason: str, epoch: int, timeout_s: float = 1.0) -> None:
        """Ask another rank of our replica (its FTAR listener at `addr`) to abort its
        all-reduce of ring `epoch` now: the leader's eviction watch reaches every rank this way."""
        # Independent of our own abort state: the leader forwards right after aborting itself.
        _close(self._dial(addr, -1, -1, time.monotonic() + timeout_s,
                          {"purpose": "abort", "reason": reason, "ring": epoch}, abortable=False))

    def set_abort_handler(self, fn: Callable[[str, int], None]) -> None:
        self._listener.on_abort = fn

    def _dial(self, addr: str, epoch: int, index: int, deadline: float,
              extra: Optional[dict] = None, abortable: bool = True) -> socket.socket:
        host, port = addr.rsplit(":", 1)
        me = self.ident
        delay = 0.005
        while True:
            if abortable and self._aborted.is_set():
                raise RecoverableError(addr, f"aborted: {self._abort_reason}")
            sock = None
            try:
                sock = socket.create_connection((host, int(port)), timeout=max(0.05, deadline - time.monotonic()))
                sock.settimeout(min(HANDSHAKE_TIMEOUT_S, max(0.05, deadline - time.monotonic())))
                nonce = os.urandom(16).hex()
                _send_msg(sock, {"job": me.job, "epoch": epoch, "replica": me.replica, "rank": me.rank,
                                 "index": index, "nonce": nonce, **(extra or {})})
                hs_deadline = min(deadline, time.monotonic() + HANDSHAKE_TIMEOUT_S)
                reply = _recv_msg(sock, hs_deadline)
                if not reply.get("ok"):
                    raise _Refused(str(reply.get("error", "refused"))[:512])
                want = mac(me.secret, "acceptor", nonce, me.job, epoch, reply["replica"], reply["rank"])
                if not hmac.compare_digest(want.encode(), str(reply.get("mac", "")).encode()):
                    raise _Refused("the acceptor failed authentication (another job, or a wrong job secret)")
                _send_msg(sock, {"mac": mac(me.secret, "dialer", reply["nonce"], me.job, epoch, me.replica, me.rank,
                                            index)})
                final = _recv_msg(sock, hs_deadline)
                if not final.get("ok"):
                    raise _Refused(final.get("error", "refused"))
                sock.settimeout(None)
                _tune(sock)
                return sock
            except _Refused as e:
                _close(sock)
                raise RecoverableError(addr, f"connection refused by the right neighbour: {e}") from None
            except (OSError, ValueError, KeyError) as e:
                _close(sock)
                if time.monotonic() + delay > deadline:
                    raise RecoverableError(addr, f"cannot connect to the right neighbour: {type(e).__name__}: {e}") \
                        from None
                time.sleep(delay)
                delay = min(delay * 2, 0.1)

    # -- data -------------------------------------------------------------------------------------
    def _send_loop(self, sock: socket.socket, q: "queue.Queue") -> None:
        while True:
            item = q.get()
            if item is None:
                return
            hdr, payload = item
            try:
                _sendall_vec(sock, hdr.pack(), payload)
            except (OSError, ValueError) as e:
                with self._send_cv:
                    self._send_error = e
                    self._send_cv.notify_all()
                return
            with self._send_cv:
                self._done += 1
                self._send_cv.notify_all()

    def _check(self, peer: str) -> None:
        if self._aborted.is_set():
            raise RecoverableError(peer, f"aborted: {self._abort_reason}")

    def send(self, hdr: ChunkHeader, src: memoryview) -> int:
        self._check(self._right_name)
        with self._send_cv:
            if self._send_error is not None:
                raise RecoverableError(self._right_name, f"send failed: {self._send_error}")
            self._posted += 1
            ticket = self._posted
        self._queue.put((hdr, src))
        return ticket

    def wait_sent(self, ticket: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._send_cv:
            while self._done < ticket:
                self._check(self._right_name)
                if self._send_error is not None:
                    raise RecoverableError(self._right_name, f"send failed: {self._send_error}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RecoverableError(self._right_name, f"timed out after {timeout_s:.1f}s sending a chunk "
                                                             "(the right neighbour stopped reading)")
                self._send_cv.wait(min(left, 0.05))

    def recv(self, dest: Callable[[ChunkHeader], memoryview], timeout_s: float) -> ChunkHeader:
        self._check(self._left_name)
        sock = self._left
        try:
            if timeout_s != self._recv_timeout:
                _set_timeout(sock, socket.SO_RCVTIMEO, timeout_s)
                self._recv_timeout = timeout_s
            deadline = time.monotonic() + timeout_s
            head = bytearray(HEADER_SIZE)
            _recv_all(sock, memoryview(head), deadline)
            hdr = ChunkHeader.unpack(bytes(head))
            if hdr.kind == KIND_FATAL:  # never allocate what a header claims beyond the cap
                msg = bytearray(min(hdr.nbytes, FATAL_MAX_BYTES))
                _recv_all(sock, memoryview(msg), deadline)
                cut = f" [{hdr.nbytes - len(msg)} more bytes not read]" if hdr.nbytes > len(msg) else ""
                raise FatalError(msg.decode(errors="replace") + cut)
            if hdr.kind != KIND_DATA:
                raise FatalError(f"bad chunk kind {hdr.kind} from the left neighbour {self._left_name}")
            _recv_all(sock, dest(hdr)[:hdr.nbytes], deadline)
            return hdr
        except (socket.timeout, BlockingIOError):
            self._check(self._left_name)
            raise RecoverableError(self._left_name, f"timed out after {timeout_s:.1f}s waiting for a chunk") from None
        except (OSError, AttributeError) as e:
            self._check(self._left_name)
            raise RecoverableError(self._left_name, f"connection lost: {type(e).__name__}: {e}") from None

    def send_fatal(self, hdr: ChunkHeader, message: str) -> None:
        if self._right is None or self._sender is None or not self._sender.is_alive():
            return
        raw = message.encode()[:FATAL_MAX_BYTES]
        fatal = ChunkHeader(KIND_FATAL, hdr.job, hdr.epoch, hdr.seq, hdr.partition, hdr.step, hdr.chunk, hdr.dtype,
                            len(raw), hdr.total_numel)
        self._queue.put((fatal, memoryview(raw)))
        self._queue.put(None)
        self._sender.join(1.0)

    # -- teardown ---------------------------------------------------------------------------------
    def abort(self, reason: str) -> None:
        self._abort_reason = reason
        self._aborted.set()
        for s in (self._left, self._right):
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        with self._send_cv:
            self._send_cv.notify_all()

    def _teardown(self) -> None:
        if self._sender is not None:
            self._queue.put(None)
            _close(self._right)
            self._sender.join(2.0)
            self._sender = None
        _close(self._left)
        _close(self._right)
        self._left = self._right = None

    def close(self) -> None:
        self.abort("closed")
        self._teardown()
        self._listener.close()


class _Refused(Exception):
    pass


def _sendall_vec(sock: socket.socket, head: bytes, payload: memoryview) -> None:
    """sendall of head + payload with one syscall when the kernel takes it all."""
    total = len(head) + len(payload)
    sent = sock.sendmsg([head, payload])
    while sent < total:
        if sent < len(head):
            sent += sock.sendmsg([head[sent:], payload])
        else:
            sock.sendall(payload[sent - len(head):])
            return
