"""TCP links for FTAR (docs/GUIDE.md, "FTAR transports"): a stream per direction, a header per chunk.

We dial the right neighbour and send on that socket; the left neighbour dials us and we
receive on its socket (the handshake is endpoint.py's). Each chunk is a fixed header followed
by its bytes, written straight from the source memory and read straight into the destination
(the user's tensor or a private slot): no copies besides the kernel's.

Three threads move an all-reduce's bytes, so that no copy waits for another: a sender thread
owns the outgoing socket (the control thread offers a chunk to the kernel itself only while
the sender is idle); a reader thread owns the incoming socket and reads ahead; the control
thread forwards. The engine tells the receive link every chunk of the all-reduce in stream
order and where it goes (`TcpRx.expect`, the Direct path): the reader adds a reduce-scatter
chunk into the user's buffer (received into a private slot, then summed) and writes an
all-gather chunk straight into it. Nothing else touches those regions by then: a region's
incoming chunk exists only after the neighbour received our own sends of it, and we forward it
only once the reader is done. So the left neighbour's chunks leave its socket while we forward
the one before, instead of filling the kernel's buffers and stalling its sender until our
control thread is scheduled again (under CPU contention, several ranks per core, that wait was
most of an all-reduce). Errors the reader meets (a lost peer, a mismatch, a FATAL record)
reach the control thread at its next wait, which alone bounds the time (`timeout_s`); an abort
wakes both. Without a plan (the staged and device paths) the caller reads itself, as before.
"""
from __future__ import annotations

import queue
import socket
import threading
import time
from typing import Optional, Sequence

import torch

from lightning_ft import ops
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
    reduces = True
    """`expect` and `recv_reduce`: the link reads ahead and reduces as chunks arrive (the Direct path)."""

    def __init__(self, sock: socket.socket, peer: str, payload: list[torch.Tensor], mismatch) -> None:
        self.sock, self.peer, self.payload = sock, peer, payload
        self._views = [byte_view(p) for p in payload]
        self._mismatch = mismatch
        self._timeout = -1.0
        self._aborted: Optional[str] = None
        self._head = bytearray(HEADER_SIZE)
        # read-ahead (`expect`): the plan, what the reader landed, what the control thread took
        self._cv = threading.Condition()
        self._plan: list[tuple[ChunkHeader, torch.Tensor, memoryview, bool]] = []
        """(header, destination, its bytes, reduce into it) of every expected chunk, in stream order."""
        self._landed = 0
        self._taken = 0
        self._error: Optional[BaseException] = None
        self._closing = False
        self._busy = False
        """The reader is between taking an expected chunk and landing it (writing the user's memory)."""
        self._reader: Optional[threading.Thread] = None

    # -- read-ahead ---------------------------------------------------------------------------------
    def expect(self, chunks: Sequence[tuple[ChunkHeader, torch.Tensor, memoryview, bool]]) -> None:
        """The next chunks of the stream, in order: each with its destination in the user's
        tensor (and that region's bytes), and whether to add the chunk into it (a reduce-scatter
        chunk: `recv_reduce`) or to write it there (an all-gather chunk: `recv_into`). The
        reader thread does both as the chunks come."""
        with self._cv:
            self._plan.extend(chunks)
            if self._reader is None:
                self._reader = Thread(target=self._read_ahead, name="ftar-recv", daemon=True)
                self._reader.start()
            self._cv.notify_all()

    def _read_ahead(self) -> None:
        i = 0
        try:
            while True:
                with self._cv:
                    while not self._closing and i >= len(self._plan):
                        self._cv.wait()
                    if self._closing:
                        return
                    hdr, dest, dest_bytes, reduce = self._plan[i]
                    self._busy = True
                try:
                    if reduce:
                        self._read_reduce(hdr, dest)
                    else:
                        self._read(hdr, dest_bytes, 0.0)
                except BaseException as e:  # the control thread raises it at its next wait
                    with self._cv:
                        self._error = e
                    return
                i += 1
                with self._cv:
                    self._busy = False
                    self._landed = i
                    self._cv.notify_all()
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def quiesce(self, timeout_s: float) -> None:
        """After a failed all-reduce: stop reading and return once the reader writes no more of
        the user's memory, so that a failed Work's tensors are final, as on the other paths.
        Shuts down only our receiving side: the left neighbour sees no error (a FATAL must still
        travel the ring), its later chunks are never read."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RD)  # a blocked receive returns now
        except OSError:
            pass
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FatalError(f"FTAR: the reader of the {self.peer} link did not stop within {timeout_s:.1f}s "
                                     "after a failed all-reduce")
                self._cv.wait(left)

    def _take(self, want: ChunkHeader, timeout_s: float) -> None:
        """Wait for the next expected chunk (it must be `want`) to have landed."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            planned = self._plan[self._taken][0]
            if planned is not want and planned != want:
                raise FatalError(f"FTAR internal error: the {self.peer} link expected chunk {planned}, the engine "
                                 f"asked for {want}")
            while self._landed <= self._taken:
                if self._aborted is not None:
                    raise RecoverableError(self.peer, f"aborted: {self._aborted}")
                if self._error is not None:
                    raise self._error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RecoverableError(self.peer, f"timed out after {timeout_s:.1f}s waiting for a chunk")
                self._cv.wait(left)
            self._taken += 1

    def _planned(self) -> bool:
        return self._taken < len(self._plan)

    # -- reading --------------------------------------------------------------------------------
    def _read(self, want: ChunkHeader, dest: memoryview, timeout_s: float) -> None:
        """Read chunk `want` into `dest`, waiting at most `timeout_s` (0: no limit, for the reader,
        whose waits the control thread bounds)."""
        if self._aborted is not None:
            raise RecoverableError(self.peer, f"aborted: {self._aborted}")
        sock = self.sock
        try:
            if timeout_s != self._timeout:
                set_kernel_timeout(sock, socket.SO_RCVTIMEO, timeout_s)
                self._timeout = timeout_s
            deadline = time.monotonic() + timeout_s if timeout_s else float("inf")
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

    def _read_reduce(self, want: ChunkHeader, user: torch.Tensor, timeout_s: float = 0.0) -> None:
        """Receive chunk `want` into the private slot 0 and add it into `user`."""
        self._read(want, self._views[0], timeout_s)
        recv = self.payload[0][:want.nbytes].view(user.dtype)
        if user.dtype == torch.float32:  # ops.reduce_'s sum without its checks (fp32 needs no rounding)
            torch.add(recv, user, out=user)
        else:
            ops.reduce_(user, recv, user)

    def recv(self, want: ChunkHeader, timeout_s: float) -> torch.Tensor:
        self._read(want, self._views[want.chunk], timeout_s)
        return self.payload[want.chunk]

    def release(self, want: ChunkHeader) -> None:
        """Private memory: nothing to give back."""

    def recv_into(self, want: ChunkHeader, dest: torch.Tensor, timeout_s: float) -> None:
        if self._planned():
            self._take(want, timeout_s)  # the reader wrote it where `expect` said: `dest`
        else:
            self._read(want, byte_view(dest), timeout_s)

    def recv_reduce(self, want: ChunkHeader, dest: torch.Tensor, timeout_s: float) -> None:
        """Add chunk `want` into `dest` (`dest` += the chunk, ops.reduce_)."""
        if self._planned():
            self._take(want, timeout_s)  # the reader added it into `dest`, as `expect` said
        else:
            self._read_reduce(want, dest, timeout_s)

    def abort(self, reason: str) -> None:
        self._aborted = reason
        shutdown(self.sock)
        with self._cv:
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        close_socket(self.sock)
        if self._reader is not None:
            self._reader.join(2.0)
