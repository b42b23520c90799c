"""The one-sided ring protocol shared by the shm and rdma links (docs/ARCHITECTURE.md, "The exchange").

A sender writes chunk j of a ring step into the receiver's slot j (header area + payload)
with an immediate (epoch, seq, step, chunk), once it holds slot j's credit; the receiver
takes the chunk when its completion arrives, reduces it, and returns the credit. The
slot/credit bookkeeping is slots.py's pure state machines; this module adds the waiting
(every wait has a deadline), the error mapping, and the link's side channel: the
handshake's TCP socket stays open for the life of the link, so a dead neighbour is seen
at once (EOF), a fatal error reaches the next rank, and an abort wakes blocked calls.

Subclasses provide the transport's verbs:
  tx: `_staging(slot)` (where chunk bytes are written), `_post(slot, hdr, imm)` (start the
      write) and `_poll_tx(timeout)` (feed write completions and credits into `self.win`);
  rx: `_poll_rx(timeout)` (feed landings into `self.win`) and `_credit(slot, imm)`.
"""
from __future__ import annotations

import socket
import struct
import time
from abc import abstractmethod
from typing import Optional

import torch

from .base import (HEADER_SIZE, ChunkHeader, FatalError, Mismatch, RecoverableError, RxLink, TxLink, close_socket,
                   shutdown)
from .endpoint import set_kernel_timeout
from .slots import ProtocolError, RxWindow, TxWindow, pack_imm, slot_of

REC = struct.Struct("<IIII")
"""A side-channel record: (type, slot, imm, nbytes)."""
DOORBELL, CREDIT, FATAL = 1, 2, 3


def imm_of(hdr: ChunkHeader) -> int:
    return pack_imm(hdr.epoch, hdr.seq, hdr.step, hdr.chunk)


class SideChannel:
    """Records over the link's handshake socket; reads drain everything that has arrived."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer = sock, peer
        self._buf = bytearray(1 << 16)
        self._view = memoryview(self._buf)
        self._have = 0
        self._timeout = -1.0
        self.aborted: Optional[str] = None

    def send(self, kind: int, slot: int, imm: int, nbytes: int = 0, extra: bytes = b"") -> None:
        try:
            self.sock.sendall(REC.pack(kind, slot, imm, nbytes) + extra)
        except OSError as e:
            raise self.lost(f"connection lost: {type(e).__name__}: {e}") from None

    def lost(self, reason: str) -> RecoverableError:
        if self.aborted is not None:
            return RecoverableError(self.peer, f"aborted: {self.aborted}")
        return RecoverableError(self.peer, reason)

    def read(self, timeout_s: float) -> list[tuple[int, int, int, int]]:
        """At least one record (waiting up to `timeout_s`, or []), and every other record
        that has already arrived. A FATAL record raises FatalError with its message."""
        if self.aborted is not None:
            raise self.lost("")
        timeout_s = max(timeout_s, 0.001)
        if abs(timeout_s - self._timeout) > 0.01:
            set_kernel_timeout(self.sock, socket.SO_RCVTIMEO, timeout_s)
            self._timeout = timeout_s
        try:
            k = self.sock.recv_into(self._view[self._have:])
        except (socket.timeout, BlockingIOError):
            if self.aborted is not None:
                raise self.lost("") from None
            return []
        except OSError as e:
            raise self.lost(f"connection lost: {type(e).__name__}: {e}") from None
        if k == 0:
            raise self.lost("the neighbour closed the connection")
        self._have += k
        out, pos = [], 0
        while self._have - pos >= REC.size:
            rec = REC.unpack_from(self._buf, pos)
            if rec[0] == FATAL:
                self._fatal(rec[3], pos + REC.size)
            out.append(rec)
            pos += REC.size
        self._buf[:self._have - pos] = self._buf[pos:self._have]
        self._have -= pos
        return out

    def _fatal(self, nbytes: int, pos: int) -> None:
        msg = bytes(self._buf[pos:self._have])
        deadline = time.monotonic() + 1.0
        while len(msg) < nbytes and time.monotonic() < deadline:
            try:
                more = self.sock.recv(nbytes - len(msg))
            except OSError:
                break
            if not more:
                break
            msg += more
        raise FatalError(msg[:nbytes].decode(errors="replace"))

    def abort(self, reason: str) -> None:
        self.aborted = reason
        shutdown(self.sock)

    def close(self) -> None:
        close_socket(self.sock)


def _protocol(peer: str, e: ProtocolError) -> RecoverableError:
    return RecoverableError(peer, f"one-sided link broken: {e}")


class OneSidedTx(TxLink):
    """Sender half: waits for credits, posts writes, tracks completions by ticket. The
    receiver has 2C slots (slots.slot_of); `_staging(slot)` is where chunk bytes go before
    `_post` (shm: the receiver's slot itself; rdma: our registered send buffer)."""

    def __init__(self, sock: socket.socket, peer: str, epoch: int, num_chunks: int) -> None:
        self.side = SideChannel(sock, peer)
        self.peer, self.epoch, self.C = peer, epoch, num_chunks
        self.win = TxWindow(epoch, 2 * num_chunks)

    @abstractmethod
    def _staging(self, slot: int) -> torch.Tensor:
        """The S-byte memory that chunk bytes for `slot` are written into."""

    @abstractmethod
    def _post(self, slot: int, hdr: ChunkHeader, imm: int) -> None:
        """Start writing slot `slot`'s staged bytes and header to the receiver with `imm`."""

    def _poll_tx(self, timeout_s: float) -> None:
        """Default: credits arrive on the side channel; writes complete when posted."""
        for kind, slot, _imm, _n in self.side.read(timeout_s):
            if kind == CREDIT:
                self.win.credit(self.epoch, slot)

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RecoverableError(self.peer, f"timed out after {timeout_s:.1f}s waiting for {what}")
                self._poll_tx(left)
        except ProtocolError as e:
            raise _protocol(self.peer, e) from None
        except RecoverableError as e:
            self.win.peer_lost(str(e))
            raise

    def reserve(self, hdr: ChunkHeader, timeout_s: float) -> torch.Tensor:
        slot = slot_of(hdr.step, hdr.chunk, self.C)
        self._wait(lambda: self.win.can_write(slot), timeout_s,
                   f"the credit of slot {slot} (the right neighbour stopped taking chunks)")
        return self._staging(slot)

    def post(self, hdr: ChunkHeader, timeout_s: float) -> None:
        slot = slot_of(hdr.step, hdr.chunk, self.C)
        try:
            self.win.post(slot)
        except ProtocolError as e:
            raise _protocol(self.peer, e) from None
        self._post(slot, hdr, imm_of(hdr))

    def send(self, hdr: ChunkHeader, src: torch.Tensor, timeout_s: float) -> int:
        self.reserve(hdr, timeout_s)[:hdr.nbytes].copy_(src.view(torch.uint8))
        self.post(hdr, timeout_s)
        return self.win.posted

    def wait_sent(self, ticket: int, timeout_s: float) -> None:
        self._wait(lambda: self.win.sent(ticket), timeout_s, "a write to complete")

    def flush(self, timeout_s: float) -> None:
        self.wait_sent(self.win.posted, timeout_s)

    def send_fatal(self, hdr: ChunkHeader, message: str) -> None:
        raw = message.encode()[:4096]
        try:
            self.side.send(FATAL, 0, 0, len(raw), raw)
        except RecoverableError:
            pass

    def abort(self, reason: str) -> None:
        self.win.peer_lost(f"aborted: {reason}")
        self.side.abort(reason)

    def close(self) -> None:
        self.side.close()


class OneSidedRx(RxLink):
    """Receiver half: takes landed chunks in the order the ring expects, returns credits.
    `payload` and `headers` describe the 2C slots (slots.slot_of)."""

    def __init__(self, sock: socket.socket, peer: str, epoch: int, payload: list[torch.Tensor],
                 headers: list[memoryview], mismatch: Mismatch) -> None:
        self.side = SideChannel(sock, peer)
        self.peer, self.epoch, self.C = peer, epoch, len(payload) // 2
        self.payload, self._headers, self._mismatch = payload, headers, mismatch
        self.win = RxWindow(epoch, len(payload))
        self._credits_lost: Optional[str] = None

    def _poll_rx(self, timeout_s: float) -> None:
        """Default: doorbells arrive on the side channel."""
        for kind, slot, imm, _n in self.side.read(timeout_s):
            if kind == DOORBELL:
                self.win.landed(slot, imm)

    def _credit(self, slot: int, imm: int) -> None:
        self.side.send(CREDIT, slot, imm)

    def recv(self, want: ChunkHeader, timeout_s: float) -> torch.Tensor:
        slot = slot_of(want.step, want.chunk, self.C)
        deadline = time.monotonic() + timeout_s
        try:
            while not self.win.take(slot, imm_of(want)):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RecoverableError(self.peer, f"timed out after {timeout_s:.1f}s waiting for a chunk")
                self._poll_rx(left)
        except ProtocolError as e:
            if self.win.broken is None and 0 <= slot < len(self._headers):  # out of step: say how
                self._mismatch(ChunkHeader.unpack(bytes(self._headers[slot][:HEADER_SIZE])), want)
            raise _protocol(self.peer, e) from None
        except RecoverableError as e:
            self.win.peer_lost(str(e))
            raise
        got = ChunkHeader.unpack(bytes(self._headers[slot][:HEADER_SIZE]))
        if got != want:
            self._mismatch(got, want)
        return self.payload[slot]

    def release(self, want: ChunkHeader) -> None:
        slot = slot_of(want.step, want.chunk, self.C)
        imm = self.win.imm[slot]
        try:
            self.win.release(slot)
        except ProtocolError as e:
            raise _protocol(self.peer, e) from None
        if self._credits_lost is not None:
            return
        try:
            self._credit(slot, imm)
        except RecoverableError as e:
            # The chunk is ours already. A sender that has posted its last chunk of an
            # all-reduce is done and may close before we return the credits of the chunks
            # it wrote (up to a window's worth still waiting in our slots). Those chunks are
            # good: later receives take them, and a chunk that never lands meets the closed
            # side channel in `_poll_rx` (EOF) and fails there. So neither this chunk nor
            # the window fails here; we only stop returning credits.
            self._credits_lost = str(e)

    def recv_into(self, want: ChunkHeader, dest: torch.Tensor, timeout_s: float) -> None:
        dest.view(torch.uint8).copy_(self.recv(want, timeout_s)[:want.nbytes])
        self.release(want)

    def abort(self, reason: str) -> None:
        self.win.peer_lost(f"aborted: {reason}")
        self.side.abort(reason)

    def close(self) -> None:
        self.side.close()
