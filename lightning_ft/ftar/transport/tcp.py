"""TCP links for FTAR (README.md, "FTAR transports"): a stream per direction, a header per chunk.

We dial the right neighbour and send on that socket; the left neighbour dials us and we
receive on its socket (the handshake is endpoint.py's). A sender thread owns the outgoing
socket, so the control thread can receive and reduce while chunks are on the wire. Each
chunk is a fixed header followed by its bytes, written straight from the source memory
and read straight into the destination (the user's tensor or a private slot): no copies
besides the kernel's.
"""
from __future__ import annotations

import queue
import socket
import threading
import time
from typing import Optional

import torch

from .base import (HEADER_SIZE, KIND_DATA, KIND_FATAL, ChunkHeader, FatalError, LinkContext, LinkKind,
                   RecoverableError, RxLink, TxLink, byte_view, close_socket, shutdown)
from .endpoint import FATAL_MAX_BYTES, set_kernel_timeout
from lightning_ft.threads import Thread


class TcpKind(LinkKind):
    name = "tcp"

    def __init__(self, ctx: LinkContext) -> None:
        super().__init__(ctx)
        S, C = ctx.slot_bytes, ctx.num_slots
        self._scratch = torch.empty(S * C, dtype=torch.uint8)
        """Private receive slots, shared by every epoch's receive link (one at a time)."""
        self._staging: Optional[list[torch.Tensor]] = None
        """Send slots for the staged path (allocated on first use; shared like _scratch)."""

    def staging(self) -> list[torch.Tensor]:
        if self._staging is None:
            S = self.ctx.slot_bytes
            buf = torch.empty(S * self.ctx.num_slots, dtype=torch.uint8)
            self._staging = [buf[j * S:(j + 1) * S] for j in range(self.ctx.num_slots)]
        return self._staging

    def accept(self, sock: socket.socket, epoch: int, peer: str, offer: dict) -> tuple[object, dict]:
        return None, {}

    def dial(self, sock: socket.socket, epoch: int, peer: str, desc: dict) -> tuple[TxLink, dict]:
        return TcpTx(sock, peer, self.staging), {}

    def finish_accept(self, state: object, sock: socket.socket, epoch: int, peer: str, confirm: dict) -> RxLink:
        S = self.ctx.slot_bytes
        return TcpRx(sock, peer, [self._scratch[j * S:(j + 1) * S] for j in range(self.ctx.num_slots)],
                     self.ctx.mismatch)


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


class TcpTx(TxLink):
    kind = "tcp"
    direct = True

    def __init__(self, sock: socket.socket, peer: str, staging) -> None:
        self.sock, self.peer = sock, peer
        self._staging_fn = staging
        self._slot_ticket: dict[int, int] = {}
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._error: Optional[BaseException] = None
        self._aborted: Optional[str] = None
        self._posted = 0
        self._done = 0
        self._cv = threading.Condition()
        self._thread = Thread(target=self._loop, name="ftar-send", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            head, payload = item
            try:
                _sendall_vec(self.sock, head, payload)
            except (OSError, ValueError) as e:
                with self._cv:
                    self._error = e
                    self._cv.notify_all()
                return
            with self._cv:
                self._done += 1
                self._cv.notify_all()

    def _check(self) -> None:
        if self._aborted is not None:
            raise RecoverableError(self.peer, f"aborted: {self._aborted}")
        if self._error is not None:
            raise RecoverableError(self.peer, f"send failed: {self._error}")

    def send(self, hdr: ChunkHeader, src: torch.Tensor, timeout_s: float) -> int:
        self._check()
        self._posted += 1
        head, payload = hdr.pack(), byte_view(src)
        if self._done == self._posted - 1:
            # The sender thread is idle: offer the chunk to the kernel right here, without
            # blocking; only what the socket buffer cannot take yet goes to the thread (no
            # wakeup, no GIL hand-off per chunk while the buffer keeps up).
            try:
                sent = self.sock.sendmsg([head, payload], [], socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            except OSError as e:
                self._error = e
                self._check()
            if sent == len(head) + len(payload):
                with self._cv:
                    self._done += 1
                return self._posted
            head, payload = (head[sent:], payload) if sent < len(head) else (b"", payload[sent - len(head):])
        self._queue.put((head, payload))
        return self._posted

    def wait_sent(self, ticket: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._done < ticket:
                self._check()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RecoverableError(self.peer, f"timed out after {timeout_s:.1f}s sending a chunk "
                                                      "(the right neighbour stopped reading)")
                self._cv.wait(min(left, 0.05))

    def reserve(self, hdr: ChunkHeader, timeout_s: float) -> torch.Tensor:
        self.wait_sent(self._slot_ticket.get(hdr.chunk, 0), timeout_s)  # its last send is out
        return self._staging_fn()[hdr.chunk]

    def post(self, hdr: ChunkHeader, timeout_s: float) -> None:
        self._slot_ticket[hdr.chunk] = self.send(hdr, self._staging_fn()[hdr.chunk][:hdr.nbytes], timeout_s)

    def flush(self, timeout_s: float) -> None:
        self.wait_sent(self._posted, timeout_s)

    def send_fatal(self, hdr: ChunkHeader, message: str) -> None:
        if not self._thread.is_alive():
            return
        raw = message.encode()[:FATAL_MAX_BYTES]
        fatal = ChunkHeader(KIND_FATAL, hdr.job, hdr.epoch, hdr.seq, hdr.partition, hdr.step, hdr.chunk, hdr.dtype,
                            len(raw), hdr.total_numel)
        self._queue.put((fatal.pack(), memoryview(raw)))
        self._queue.put(None)
        self._thread.join(1.0)
        try:
            self.sock.shutdown(socket.SHUT_WR)  # the reader waits for a whole chunk: end it
        except OSError:
            pass

    def abort(self, reason: str) -> None:
        self._aborted = reason
        shutdown(self.sock)
        with self._cv:
            self._cv.notify_all()

    def close(self) -> None:
        self._queue.put(None)
        close_socket(self.sock)
        self._thread.join(2.0)


def _recv_all(sock: socket.socket, view: memoryview, deadline: float) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise ConnectionResetError("peer closed the connection")
        got += k
        if got < n and time.monotonic() > deadline:
            raise socket.timeout()


def _drain(sock: socket.socket, n: int) -> bytes:
    """Up to `n` more bytes of a FATAL message (its sender shut the stream down after it)."""
    out = b""
    try:
        while len(out) < n:
            more = sock.recv(n - len(out))
            if not more:
                break
            out += more
    except OSError:
        pass
    return out


class TcpRx(RxLink):
    kind = "tcp"

    def __init__(self, sock: socket.socket, peer: str, payload: list[torch.Tensor], mismatch) -> None:
        self.sock, self.peer, self.payload = sock, peer, payload
        self._views = [byte_view(p) for p in payload]
        self._mismatch = mismatch
        self._timeout = -1.0
        self._aborted: Optional[str] = None
        self._head = bytearray(HEADER_SIZE)

    def _read(self, want: ChunkHeader, dest: memoryview, timeout_s: float) -> None:
        if self._aborted is not None:
            raise RecoverableError(self.peer, f"aborted: {self._aborted}")
        sock = self.sock
        try:
            if timeout_s != self._timeout:
                set_kernel_timeout(sock, socket.SO_RCVTIMEO, timeout_s)
                self._timeout = timeout_s
            deadline = time.monotonic() + timeout_s
            # Header and payload in one syscall, straight into `dest`: the expected header
            # says how long the payload is; any other header is an error anyway (fatal, or
            # a FATAL record, whose sender shuts the stream down after it).
            body = dest[:want.nbytes]
            got = sock.recvmsg_into([self._head, body], 0, socket.MSG_WAITALL)[0]
            if got == 0:
                raise ConnectionResetError("peer closed the connection")
            if got < HEADER_SIZE:
                _recv_all(sock, memoryview(self._head)[got:], deadline)
                got = HEADER_SIZE
            hdr = ChunkHeader.unpack(bytes(self._head))
            if hdr.kind == KIND_FATAL:
                # never read (or allocate) beyond the cap, whatever the header claims
                want_n = min(hdr.nbytes, FATAL_MAX_BYTES)
                msg = bytes(body[:min(got - HEADER_SIZE, want_n)])
                msg += _drain(sock, want_n - len(msg))
                cut = f" [{hdr.nbytes - len(msg)} more bytes not read]" if hdr.nbytes > len(msg) else ""
                raise FatalError(msg.decode(errors="replace") + cut)
            if hdr.kind != KIND_DATA:
                raise FatalError(f"bad chunk kind {hdr.kind} from the {self.peer}")
            if hdr != want:
                self._mismatch(hdr, want)
            if got < HEADER_SIZE + want.nbytes:
                _recv_all(sock, body[got - HEADER_SIZE:], deadline)
        except (socket.timeout, BlockingIOError):
            if self._aborted is not None:
                raise RecoverableError(self.peer, f"aborted: {self._aborted}") from None
            raise RecoverableError(self.peer, f"timed out after {timeout_s:.1f}s waiting for a chunk") from None
        except OSError as e:
            if self._aborted is not None:
                raise RecoverableError(self.peer, f"aborted: {self._aborted}") from None
            raise RecoverableError(self.peer, f"connection lost: {type(e).__name__}: {e}") from None

    def recv(self, want: ChunkHeader, timeout_s: float) -> torch.Tensor:
        self._read(want, self._views[want.chunk], timeout_s)
        return self.payload[want.chunk]

    def release(self, want: ChunkHeader) -> None:
        """Private memory: nothing to give back."""

    def recv_into(self, want: ChunkHeader, dest: torch.Tensor, timeout_s: float) -> None:
        self._read(want, byte_view(dest), timeout_s)

    def abort(self, reason: str) -> None:
        self._aborted = reason
        shutdown(self.sock)

    def close(self) -> None:
        close_socket(self.sock)
