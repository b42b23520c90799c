"""One rank's FTAR endpoint: listener, authenticated handshake, per-link kind choice (docs/ARCHITECTURE.md, "Security").

Each epoch we dial the right neighbour (our TxLink) and the left neighbour dials us (our
RxLink). Every link starts as a TCP connection with this handshake (length-prefixed
JSON), a mutual proof of the job secret, then the choice of the link's kind:
  dialer -> acceptor  hello{job, epoch, replica, rank, index, nonce_d, links, host, offer}
  acceptor -> dialer  {ok, replica, rank, nonce_a, mac = HMAC("acceptor", nonce_d, job, epoch, ...)} | {error}
  dialer -> acceptor  {mac = HMAC("dialer", nonce_a, job, epoch, replica, rank, index)}
  acceptor -> dialer  {ok, link, desc} | {error}     kind chosen, receive slots registered
  dialer -> acceptor  {ok, desc} | {error}           attached to them (mapped / QP connected)
A peer that fails to prove the secret (which also covers another job: the MACs name the
job) is told only "authentication failed"; we log why. A wrong rank, link kind or a stale
epoch is refused with the reason once the peer has authenticated. Accepted links are parked by
(epoch, index) until `connect` for that epoch takes them. The same listener takes abort
requests from our replica's leader and the job's members (`abort_peer`).

Caps against hostile or broken peers: handshake messages of at most HANDSHAKE_MAX_BYTES, a
whole handshake within HANDSHAKE_TIMEOUT_S, at most MAX_HANDSHAKES handshakes at once (more
connections are closed unread), FATAL messages read up to FATAL_MAX_BYTES (tcp.py). MACs
compare in constant time.
"""
from __future__ import annotations

import hmac
import json
import logging
import os
import socket
import struct
import sys
import threading
import time
from typing import Callable, Optional

from lightning_ft.threads import Thread

from .base import (ChunkHeader, FatalError, Identity, LinkContext, LinkKind, RecoverableError, RxLink, SetupError,
                   TxLink, allowed_kinds, choose_link, close_socket, host_id, mac)

log = logging.getLogger(__name__)

_LEN = struct.Struct("!I")
HANDSHAKE_TIMEOUT_S = 5.0
"""A whole handshake (every message of it) must complete within this."""
HANDSHAKE_MAX_BYTES = 4096
MAX_HANDSHAKES = 32
"""Handshakes in progress at once on one listener; further connections are closed unread."""
FATAL_MAX_BYTES = 4096


def send_msg(sock: socket.socket, obj: dict) -> None:
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


def recv_msg(sock: socket.socket, deadline: Optional[float] = None) -> dict:
    """One handshake message: at most HANDSHAKE_MAX_BYTES, a JSON object, by `deadline`."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline))
    if n > HANDSHAKE_MAX_BYTES:
        raise ConnectionError(f"handshake message too large ({n} bytes, limit {HANDSHAKE_MAX_BYTES})")
    msg = json.loads(_recv_exact(sock, n, deadline))
    if not isinstance(msg, dict):
        raise ValueError("handshake message is not a JSON object")
    return msg


def _same_mac(want: str, got: object) -> bool:
    return hmac.compare_digest(want.encode(), str(got).encode())


def set_kernel_timeout(sock: socket.socket, opt: int, seconds: float) -> None:
    """Kernel-side timeout (SO_RCVTIMEO/SO_SNDTIMEO) on a blocking socket, so that one
    recv(MSG_WAITALL) can take a whole chunk in a single syscall and still time out."""
    sec = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, opt, struct.pack("ll", sec, int((seconds - sec) * 1e6)))


def _tune(sock: socket.socket, timeout_s: float = 600.0) -> None:
    """Blocking socket with generous kernel timeouts: the links bound their own waits."""
    sock.settimeout(None)
    set_kernel_timeout(sock, socket.SO_RCVTIMEO, timeout_s)
    set_kernel_timeout(sock, socket.SO_SNDTIMEO, timeout_s)
    # Leave SO_SNDBUF/SO_RCVBUF alone: setting them turns off the kernel's autotuning, which
    # grows loopback buffers well past any fixed size we could pick (measured: 0.97 -> 1.16 GB/s).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Refused(Exception):
    pass


class Endpoint:
    """Listener, handshakes and this epoch's two links. `transport` is ftar.transport."""

    def __init__(self, ident: Identity, bind_host: str, transport: str, ctx: LinkContext) -> None:
        from .rdma import device_present

        self.ident = ident
        self.transport = transport
        self.ctx = ctx
        self.kinds = allowed_kinds(transport, rdma_device=device_present() if transport == "auto" else False)
        self._kinds: dict[str, LinkKind] = {k: _make_kind(k, ctx) for k in self.kinds}
        self.host = host_id()
        self.tx: Optional[TxLink] = None
        self.rx: Optional[RxLink] = None
        self.choices: list[str] = []
        """How the links of the current epoch were chosen (also logged)."""
        self.refusals: list[str] = []
        """Why recent connections were refused, newest last (for errors and tests)."""
        self.on_abort: Optional[Callable[[str, int], None]] = None
        """Called with (reason, ring epoch) when our replica's leader asks us to abort."""
        self._aborted = threading.Event()
        self._abort_reason = ""
        self._min_epoch = 0
        self._parked: dict[tuple[int, int], RxLink] = {}
        self._cv = threading.Condition()
        self._closed = False
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((bind_host, 0))
        self._sock.listen(64)
        self.address = f"{bind_host}:{self._sock.getsockname()[1]}"
        self._slots = threading.BoundedSemaphore(MAX_HANDSHAKES)
        Thread(target=self._accept_loop, name=f"ftar-accept-r{ident.replica}", daemon=True).start()

    # -- acceptor side ------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):  # a connection flood: keep serving the ones we have
                self._note(f"{peer[0]}: more than {MAX_HANDSHAKES} handshakes at once; connection closed")
                close_socket(conn)
                continue
            Thread(target=self._handshake_slot, args=(conn,), name="ftar-handshake", daemon=True).start()

    def _handshake_slot(self, conn: socket.socket) -> None:
        try:
            self._handshake(conn)
        finally:
            self._slots.release()

    def _note(self, reason: str) -> None:
        with self._cv:
            self.refusals.append(reason)
            del self.refusals[:-16]
            self._cv.notify_all()
        log.warning("FTAR r%d/rank%d refused a connection: %s", self.ident.replica, self.ident.rank, reason)

    def _refuse(self, conn: socket.socket, reason: str, told: str = "") -> None:
        """Refuse with `reason` in our log; the peer is told `told` (default: the reason, for a
        peer that proved the secret)."""
        self._note(reason)
        try:
            send_msg(conn, {"ok": False, "error": told or reason})
        except OSError:
            pass
        close_socket(conn)

    def _handshake(self, conn: socket.socket) -> None:
        me = self.ident
        state, kind = None, None
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        who = "a peer"
        authenticated = False
        try:
            hello = recv_msg(conn, deadline)
            who = f"replica {hello.get('replica')!r} rank {hello.get('rank')!r} of job {str(hello.get('job'))[:64]!r}"
            if hello.get("job") != me.job:
                who += f" (job mismatch: we are {me.job!r})"
            epoch, index = int(hello["epoch"]), int(hello["index"])
            replica, rank, nonce_d = int(hello["replica"]), int(hello["rank"]), str(hello["nonce"])
            # Everyone gets the same challenge: nothing about us is revealed before the peer
            # proves the job secret (another job fails the proof too: the MACs name the job).
            nonce_a = os.urandom(16).hex()
            send_msg(conn, {"ok": True, "replica": me.replica, "rank": me.rank, "nonce": nonce_a,
                            "mac": mac(me.secret, "acceptor", nonce_d, me.job, epoch, me.replica, me.rank)})
            proof = recv_msg(conn, deadline)
            want = mac(me.secret, "dialer", nonce_a, me.job, epoch, replica, rank, index)
            if not _same_mac(want, proof.get("mac", "")):
                why = "" if hello.get("job") != me.job else " (wrong job secret)"
                return self._refuse(conn, f"{who}: authentication failed{why}", told="authentication failed")
            authenticated = True
            conn.settimeout(HANDSHAKE_TIMEOUT_S)  # the link kind's own setup steps
            # An abort may come from our replica's leader (a failure it saw), or from any member
            # of the job going to a full round while we may be in a steady one; an abort about
            # an older epoch is ignored.
            control = hello.get("purpose") == "abort"
            if not control and rank != me.rank:
                return self._refuse(conn, f"{who}: rank mismatch (ring of rank {me.rank})")
            if not control and epoch < self._min_epoch:
                return self._refuse(conn, f"{who}: stale epoch {epoch} < {self._min_epoch}")
            if control:
                send_msg(conn, {"ok": True})
                close_socket(conn)
                if self.on_abort is not None:
                    self.on_abort(str(hello.get("reason", "aborted by the replica leader")), int(hello.get("ring", -1)))
                return
            kind, why = choose_link(list(hello.get("links", [])), self.kinds, hello.get("host") == self.host)
            if kind is None:
                return self._refuse(conn, f"{who}: {why}")
            peer = f"replica {hello['replica']} (left neighbour)"
            state, desc = self._kinds[kind].accept(conn, epoch, peer, hello.get("offer", {}).get(kind, {}))
            send_msg(conn, {"ok": True, "link": kind, "desc": desc})
            confirm = recv_msg(conn, time.monotonic() + HANDSHAKE_TIMEOUT_S)  # slots registered: a new deadline
            if not confirm.get("ok"):
                raise ConnectionError(f"the left neighbour could not attach: {confirm.get('error')}")
            _tune(conn)
            rx = self._kinds[kind].finish_accept(state, conn, epoch, peer, confirm.get("desc", {}))
            state = None
            with self._cv:
                if epoch < self._min_epoch or self._closed:
                    rx.close()
                    return
                old = self._parked.pop((epoch, index), None)
                if old is not None:
                    old.close()
                self._parked[(epoch, index)] = rx
                self.choices = [c for c in self.choices if not c.startswith(f"epoch {epoch} from")]
                self.choices.append(f"epoch {epoch} from the left neighbour replica {hello['replica']}: {why}")
                self._cv.notify_all()
        except (OSError, ValueError, KeyError, TypeError, SetupError) as e:
            if state is not None and kind is not None:
                self._kinds[kind].discard(state)
            # before authentication, say nothing
            self._refuse(conn, f"{who}: handshake failed: {type(e).__name__}: {e}",
                         told="" if authenticated else "authentication failed")

    def _take(self, epoch: int, index: int, deadline: float) -> RxLink:
        with self._cv:
            while (epoch, index) not in self._parked:
                left = deadline - time.monotonic()
                if left <= 0 or self._aborted.is_set():
                    why = "aborted" if self._aborted.is_set() else "timed out"
                    last = f"; last refusal: {self.refusals[-1]}" if self.refusals else ""
                    raise RecoverableError(f"ring index {index}", f"{why} waiting for the left neighbour to "
                                                                  f"connect for epoch {epoch}{last}")
                self._cv.wait(min(left, 0.05))
            return self._parked.pop((epoch, index))

    # -- dialer side --------------------------------------------------------------------------------
    def _dial(self, addr: str, epoch: int, index: int, deadline: float, extra: Optional[dict] = None,
              abortable: bool = True) -> tuple[socket.socket, dict]:
        host, port = addr.rsplit(":", 1)
        me = self.ident
        delay = 0.005
        while True:
            if abortable and self._aborted.is_set():
                raise RecoverableError(addr, f"aborted: {self._abort_reason}")
            sock = None
            try:
                sock = socket.create_connection((host, int(port)), timeout=max(0.05, deadline - time.monotonic()))
                hs_deadline = min(deadline, time.monotonic() + HANDSHAKE_TIMEOUT_S)
                nonce = os.urandom(16).hex()
                hello = {"job": me.job, "epoch": epoch, "replica": me.replica, "rank": me.rank, "index": index,
                         "nonce": nonce, **(extra or {})}
                if extra is None:
                    hello.update(links=self.kinds, host=self.host, offer={k: v.offer() for k, v in self._kinds.items()})
                send_msg(sock, hello)
                reply = recv_msg(sock, hs_deadline)
                if not reply.get("ok"):
                    raise _Refused(str(reply.get("error", "refused"))[:512])
                if not _same_mac(mac(me.secret, "acceptor", nonce, me.job, epoch, reply["replica"], reply["rank"]),
                                 reply.get("mac", "")):
                    raise _Refused("the acceptor failed authentication (another job, or a wrong job secret)")
                send_msg(sock, {"mac": mac(me.secret, "dialer", reply["nonce"], me.job, epoch, me.replica, me.rank,
                                           index)})
                final = recv_msg(sock, time.monotonic() + HANDSHAKE_TIMEOUT_S)  # the acceptor sets up its slots
                if not final.get("ok"):
                    raise _Refused(str(final.get("error", "refused"))[:512])
                sock.settimeout(None)
                _tune(sock)
                return sock, final
            except _Refused as e:
                close_socket(sock)
                raise RecoverableError(addr, f"connection refused by the right neighbour: {e}") from None
            except (OSError, ValueError, KeyError) as e:
                close_socket(sock)
                if time.monotonic() + delay > deadline:
                    raise RecoverableError(addr, f"cannot connect to the right neighbour: {type(e).__name__}: {e}") \
                        from None
                time.sleep(delay)
                delay = min(delay * 2, 0.1)

    def _dial_link(self, addr: str, epoch: int, index: int, deadline: float) -> TxLink:
        sock, final = self._dial(addr, epoch, index, deadline)
        kind = final.get("link")
        try:
            if kind not in self._kinds:
                raise SetupError(f"the right neighbour chose link kind {kind!r}, which we did not offer")
            tx, confirm = self._kinds[kind].dial(sock, epoch, f"right neighbour {addr}", final.get("desc", {}))
        except (OSError, ValueError, KeyError, SetupError) as e:
            try:
                send_msg(sock, {"ok": False, "error": f"{type(e).__name__}: {e}"})
            except OSError:
                pass
            close_socket(sock)
            raise RecoverableError(addr, f"cannot attach a {kind} link to the right neighbour: {e}") from None
        send_msg(sock, {"ok": True, "desc": confirm})
        return tx

    # -- per epoch ------------------------------------------------------------------------------------
    def connect(self, epoch: int, index: int, n: int, left: str, right: str, timeout_s: float) -> None:
        """Drop the links of older epochs and connect this epoch's two links."""
        self._teardown()
        self._aborted.clear()
        self._abort_reason = ""
        with self._cv:
            self._min_epoch = max(self._min_epoch, epoch)
            for key in [k for k in self._parked if k[0] < self._min_epoch]:
                self._parked.pop(key).close()
        if n == 1:
            return
        deadline = time.monotonic() + timeout_s
        self.tx = self._dial_link(right, epoch, index, deadline)
        try:
            self.rx = self._take(epoch, (index - 1) % n, deadline)
        except RecoverableError as e:  # name the neighbour that did not come, so that the quorum can blame it
            # and close the link we did open: the right neighbour must not wait for chunks
            # from a ring that will never run (it fails at once and goes to the next round)
            self._teardown()
            raise RecoverableError(left, e.reason) from None
        line = f"epoch {epoch} to the right neighbour {right}: {self.tx.kind}"
        self.choices = [c for c in self.choices if c.startswith(f"epoch {epoch} from")] + [line]
        msg = (f"FTAR r{self.ident.replica}/rank{self.ident.rank} links (ftar.transport={self.transport}): "
               + "; ".join(self.choices))
        if self.transport != "auto":
            log.debug(msg)
        elif log.isEnabledFor(logging.INFO):
            log.info(msg)
        else:  # the run log is the process's stderr: auto's choice must be in it
            print(msg, file=sys.stderr, flush=True)

    def abort(self, reason: str) -> None:
        """Interrupt every blocked call now (any thread). Calls fail until `connect`."""
        self._abort_reason = reason
        self._aborted.set()
        for link in (self.tx, self.rx):
            if link is not None:
                link.abort(reason)

    def quiesce(self, timeout_s: float) -> None:
        """After a failed all-reduce: return once our receive link writes no more of the user's memory."""
        if self.rx is not None:
            self.rx.quiesce(timeout_s)

    def abort_peer(self, addr: str, reason: str, epoch: int, timeout_s: float = 1.0) -> None:
        """Ask another rank of our replica (its FTAR listener at `addr`) to abort its
        all-reduce of ring `epoch` now: the leader's eviction watch reaches every rank this way."""
        # Independent of our own abort state: the leader forwards right after aborting itself.
        sock, _ = self._dial(addr, -1, -1, time.monotonic() + timeout_s,
                             {"purpose": "abort", "reason": reason, "ring": epoch}, abortable=False)
        close_socket(sock)

    def send_fatal(self, hdr: ChunkHeader, message: str) -> None:
        if self.tx is not None:
            self.tx.send_fatal(hdr, message)

    def _teardown(self) -> None:
        for link in (self.tx, self.rx):
            if link is not None:
                link.close()
        self.tx = self.rx = None

    def close(self) -> None:
        self.abort("closed")
        self._teardown()
        with self._cv:
            self._closed = True
            for rx in self._parked.values():
                rx.close()
            self._parked.clear()
            self._cv.notify_all()
        close_socket(self._sock)
        for kind in self._kinds.values():
            kind.close()


def _make_kind(name: str, ctx: LinkContext) -> LinkKind:
    if name == "tcp":
        from .tcp import TcpKind

        return TcpKind(ctx)
    if name == "shm":
        from .shm import ShmKind

        return ShmKind(ctx)
    if name == "rdma":
        from .rdma import RdmaKind

        return RdmaKind(ctx)  # raises FatalError with the reason where no device can be used
    raise FatalError(f"unknown FTAR link kind {name!r}")
