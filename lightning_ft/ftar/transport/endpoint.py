"""One rank's FTAR endpoint: listener, authenticated handshake, per-link kind choice (DESIGN §4).

Each epoch we dial the right neighbour (our TxLink) and the left neighbour dials us (our
RxLink). Every link starts as a TCP connection with this handshake (length-prefixed
JSON), a mutual proof of the job secret, then the choice of the link's kind:
  dialer -> acceptor  hello{job, epoch, replica, rank, index, nonce_d, links, host, offer}
  acceptor -> dialer  {ok, replica, rank, nonce_a, mac = HMAC("acceptor", nonce_d, job, epoch, ...)} | {error}
  dialer -> acceptor  {mac = HMAC("dialer", nonce_a, job, epoch, replica, rank, index)}
  acceptor -> dialer  {ok, link, desc} | {error}     kind chosen, receive slots registered
  dialer -> acceptor  {ok, desc} | {error}           attached to them (mapped / QP connected)
A wrong job, secret, rank, link kind or a stale epoch is refused with the reason; accepted
links are parked by (epoch, index) until `connect` for that epoch takes them. The same
listener takes abort requests from our replica's leader (`abort_peer`).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import struct
import sys
import threading
import time
from typing import Callable, Optional

from .base import (ChunkHeader, FatalError, Identity, LinkContext, LinkKind, RecoverableError, RxLink, SetupError, TxLink,
                   allowed_kinds, choose_link, close_socket, host_id, mac)

log = logging.getLogger(__name__)

_LEN = struct.Struct("!I")
HANDSHAKE_TIMEOUT_S = 5.0


def send_msg(sock: socket.socket, obj: dict) -> None:
    raw = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionResetError("peer closed the connection")
        got += k
    return bytes(buf)


def recv_msg(sock: socket.socket) -> dict:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > 1 << 16:
        raise ConnectionError(f"handshake message too large ({n} bytes)")
    return json.loads(_recv_exact(sock, n))


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
        threading.Thread(target=self._accept_loop, name=f"ftar-accept-r{ident.replica}", daemon=True).start()

    # -- acceptor side ------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handshake, args=(conn,), daemon=True).start()

    def _refuse(self, conn: socket.socket, reason: str) -> None:
        with self._cv:
            self.refusals.append(reason)
            del self.refusals[:-16]
            self._cv.notify_all()
        log.warning("FTAR r%d/rank%d refused a connection: %s", self.ident.replica, self.ident.rank, reason)
        try:
            send_msg(conn, {"ok": False, "error": reason})
        except OSError:
            pass
        close_socket(conn)

    def _handshake(self, conn: socket.socket) -> None:
        me = self.ident
        state, kind = None, None
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            hello = recv_msg(conn)
            who = f"replica {hello.get('replica')} rank {hello.get('rank')}"
            epoch, index = int(hello["epoch"]), int(hello["index"])
            if hello.get("job") != me.job:
                return self._refuse(conn, f"{who}: job mismatch ({hello.get('job')!r} != {me.job!r})")
            # An abort may come from our replica's leader (a failure it saw), or from any member
            # of the job going to a full round while we may be in a steady one; it proves the job
            # secret like any connection, and an abort about an older epoch is ignored.
            control = hello.get("purpose") == "abort"
            if not control and int(hello.get("rank", -1)) != me.rank:
                return self._refuse(conn, f"{who}: rank mismatch (ring of rank {me.rank})")
            if not control and epoch < self._min_epoch:
                return self._refuse(conn, f"{who}: stale epoch {epoch} < {self._min_epoch}")
            nonce_a = os.urandom(16).hex()
            send_msg(conn, {"ok": True, "replica": me.replica, "rank": me.rank, "nonce": nonce_a,
                            "mac": mac(me.secret, "acceptor", hello["nonce"], me.job, epoch, me.replica, me.rank)})
            proof = recv_msg(conn)
            want = mac(me.secret, "dialer", nonce_a, me.job, epoch, hello["replica"], hello["rank"], index)
            if proof.get("mac") != want:
                return self._refuse(conn, f"{who}: authentication failed (wrong job secret)")
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
            confirm = recv_msg(conn)
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
            self._refuse(conn, f"handshake failed: {type(e).__name__}: {e}")

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
                sock.settimeout(min(HANDSHAKE_TIMEOUT_S, max(0.05, deadline - time.monotonic())))
                nonce = os.urandom(16).hex()
                hello = {"job": me.job, "epoch": epoch, "replica": me.replica, "rank": me.rank, "index": index,
                         "nonce": nonce, **(extra or {})}
                if extra is None:
                    hello.update(links=self.kinds, host=self.host, offer={k: v.offer() for k, v in self._kinds.items()})
                send_msg(sock, hello)
                reply = recv_msg(sock)
                if not reply.get("ok"):
                    raise _Refused(reply.get("error", "refused"))
                if reply.get("mac") != mac(me.secret, "acceptor", nonce, me.job, epoch, reply["replica"], reply["rank"]):
                    raise _Refused("acceptor failed authentication (wrong job secret)")
                send_msg(sock, {"mac": mac(me.secret, "dialer", reply["nonce"], me.job, epoch, me.replica, me.rank,
                                           index)})
                final = recv_msg(sock)
                if not final.get("ok"):
                    raise _Refused(final.get("error", "refused"))
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
        self.rx = self._take(epoch, (index - 1) % n, deadline)
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
