"""TCP links for FTAR (DESIGN §4): a stream per direction, a header per chunk.

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
from .endpoint import set_kernel_timeout


class TcpKind(LinkKind):
    name = "tcp"

    def __init__(self, ctx: LinkContext) -> None:
        super().__init__(ctx)
        self._scratch = torch.empty(ctx.slot_bytes * ctx.num_slots, dtype=torch.uint8)
        """Private receive slots, shared by every epoch's receive link (one at a time)."""

    def accept(self, sock: socket.socket, epoch: int, peer: str, offer: dict) -> tuple[object, dict]:
        return None, {}

    def dial(self, sock: socket.socket, epoch: int, peer: str, desc: dict) -> tuple[TxLink, dict]:
        return TcpTx(sock, peer), {}

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
    any_source = True

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer = sock, peer
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._error: Optional[BaseException] = None
        self._aborted: Optional[str] = None
        self._posted = 0
        self._done = 0
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="ftar-send", daemon=True)
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
        self._queue.put((hdr.pack(), byte_view(src)))
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

    def send_fatal(self, hdr: ChunkHeader, message: str) -> None:
        if not self._thread.is_alive():
            return
        raw = message.encode()[:4096]
        fatal = ChunkHeader(KIND_FATAL, hdr.job, hdr.epoch, hdr.seq, hdr.partition, hdr.step, hdr.chunk, hdr.dtype,
                            len(raw), hdr.total_numel)
        self._queue.put((fatal.pack(), memoryview(raw)))
        self._queue.put(None)
        self._thread.join(1.0)

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
            _recv_all(sock, memoryview(self._head), deadline)
            hdr = ChunkHeader.unpack(bytes(self._head))
            if hdr.kind == KIND_FATAL:
                msg = bytearray(hdr.nbytes)
                _recv_all(sock, memoryview(msg), deadline)
                raise FatalError(msg.decode(errors="replace"))
            if hdr.kind != KIND_DATA:
                raise FatalError(f"bad chunk kind {hdr.kind} from the {self.peer}")
            if hdr != want:
                self._mismatch(hdr, want)
            _recv_all(sock, dest[:hdr.nbytes], deadline)
        except (socket.timeout, BlockingIOError):
            if self._aborted is not None:
                raise RecoverableError(self.peer, f"aborted: {self._aborted}") from None
            raise RecoverableError(self.peer, f"timed out after {timeout_s:.1f}s waiting for a chunk") from None
        except OSError as e:
            if self._aborted is not None:
                raise RecoverableError(self.peer, f"aborted: {self._aborted}") from None
            raise RecoverableError(self.peer, f"connection lost: {type(e).__name__}: {e}") from None

    def recv(self, want: ChunkHeader, timeout_s: float) -> None:
        self._read(want, self._views[want.chunk], timeout_s)

    def release(self, slot: int) -> None:
        """Private memory: nothing to give back."""

    def recv_into(self, want: ChunkHeader, dest: torch.Tensor, timeout_s: float) -> None:
        self._read(want, byte_view(dest), timeout_s)

    def abort(self, reason: str) -> None:
        self._aborted = reason
        shutdown(self.sock)

    def close(self) -> None:
        close_socket(self.sock)
