"""Shared-memory links for ranks on one host (docs/GUIDE.md, "FTAR transports").

The same one-sided protocol as rdma (onesided.py, slots.py), with memory instead of a NIC:
  registration  the receiver creates a memfd of C slots per epoch and link (fresh memory,
                so a stale writer of an older epoch can never touch this epoch's slots);
  descriptor    (pid, fd, size, nonce): the sender opens /proc/pid/fd/fd, maps it and checks
                the nonce written at its start (a different pid namespace cannot pass);
  write         the engine reduces (or copies) the chunk straight into the mapped slot of
                the receiver, then the header and a doorbell record (slot, imm) go out
                on the link's socket;
  completion    the doorbell (receiver) and the credit record (sender), read from the
                socket with a deadline; EOF means the neighbour is gone.
A memfd vanishes with the last process that maps it: nothing leaks on SIGKILL.
"""
from __future__ import annotations

import mmap
import os
import socket
import struct
from typing import cast

import torch

from .base import HEADER_SIZE, ChunkHeader, LinkContext, LinkKind, RxLink, SetupError, TxLink
from .onesided import DOORBELL, OneSidedRx, OneSidedTx
from .slots import SlotLayout

_Accepted = tuple[int, mmap.mmap]
"""`ShmKind.accept`'s state: the segment's fd and mapping (the endpoint hands it back unchanged)."""

_MAGIC = b"LFTSHM01"
_PAGE = 4096
_INFO = struct.Struct("<8s16sQQQ")  # magic, nonce, epoch, slot_bytes, num_slots


class _Segment:
    """One mapped memfd: an info page, then the slots of `layout`."""

    def __init__(self, mm: mmap.mmap, layout: SlotLayout) -> None:
        self.mm, self.layout = mm, layout
        whole = torch.frombuffer(mm, dtype=torch.uint8)
        S = layout.slot_bytes
        self.payload = [whole[_PAGE + layout.payload_offset(j): _PAGE + layout.payload_offset(j) + S]
                        for j in range(layout.num_slots)]
        self._view = memoryview(mm)
        self.headers = [self._view[_PAGE + layout.header_offset(j): _PAGE + layout.header_offset(j) + HEADER_SIZE]
                        for j in range(layout.num_slots)]

    def close(self) -> None:
        for h in self.headers:
            h.release()
        self._view.release()
        self.payload = []
        self.headers = []
        try:
            self.mm.close()
        except BufferError:  # a tensor view is still referenced; the mapping goes with it
            pass


class ShmKind(LinkKind):
    name = "shm"

    def __init__(self, ctx: LinkContext) -> None:
        super().__init__(ctx)
        self.layout = SlotLayout(ctx.slot_bytes, 2 * ctx.num_slots)  # slots.slot_of: two sets

    def accept(self, sock: socket.socket, epoch: int, peer: str, offer: dict) -> tuple[object, dict]:
        size = _PAGE + self.layout.nbytes
        fd = os.memfd_create(f"lft-ftar-e{epoch}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            raise
        nonce = os.urandom(16)
        mm[:_INFO.size] = _INFO.pack(_MAGIC, nonce, epoch, self.layout.slot_bytes, self.layout.num_slots)
        return (fd, mm), {"pid": os.getpid(), "fd": fd, "size": size, "nonce": nonce.hex(), "epoch": epoch}

    def dial(self, sock: socket.socket, epoch: int, peer: str, desc: dict) -> tuple[TxLink, dict]:
        path = f"/proc/{int(desc['pid'])}/fd/{int(desc['fd'])}"
        size = int(desc["size"])
        if size != _PAGE + self.layout.nbytes:
            raise SetupError(f"the {peer}'s shm slots are {size} bytes, ours {_PAGE + self.layout.nbytes}: "
                             "every replica must use the same ftar.chunk_bytes and ftar.num_chunks")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise SetupError(f"cannot open the {peer}'s shm slots at {path}: {e}") from None
        try:
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, nonce, seg_epoch, _, _ = _INFO.unpack(mm[:_INFO.size])
        if magic != _MAGIC or nonce.hex() != desc["nonce"] or seg_epoch != epoch:
            mm.close()
            raise SetupError(f"{path} is not the {peer}'s shm segment for epoch {epoch} (another process or "
                             "pid namespace?)")
        return ShmTx(sock, peer, epoch, _Segment(mm, self.layout), self.ctx.num_slots), {}

    def finish_accept(self, state: object, sock: socket.socket, epoch: int, peer: str, confirm: dict) -> RxLink:
        fd, mm = cast(_Accepted, state)
        os.close(fd)  # the sender has mapped it: the mapping keeps the memory
        seg = _Segment(mm, self.layout)
        return ShmRx(sock, peer, epoch, seg, self.ctx.mismatch)

    def discard(self, state: object) -> None:
        fd, mm = cast(_Accepted, state)
        os.close(fd)
        mm.close()


class ShmTx(OneSidedTx):
    """Stages in the receiver's own slot: the engine reduces straight into it, so a
    write costs no copy of its own; `_post` writes the header and rings the doorbell."""

    kind = "shm"

    def __init__(self, sock: socket.socket, peer: str, epoch: int, seg: _Segment, num_chunks: int) -> None:
        super().__init__(sock, peer, epoch, num_chunks)
        self.seg = seg

    def _staging(self, slot: int) -> torch.Tensor:
        return self.seg.payload[slot]

    def _post(self, slot: int, hdr: ChunkHeader, imm: int) -> None:
        self.seg.headers[slot][:] = hdr.pack()
        self.side.send(DOORBELL, slot, imm, hdr.nbytes)
        self.win.write_done(self.epoch, slot)  # the bytes are in place already

    def close(self) -> None:
        super().close()
        self.seg.close()


class ShmRx(OneSidedRx):
    kind = "shm"

    def __init__(self, sock: socket.socket, peer: str, epoch: int, seg: _Segment, mismatch) -> None:
        super().__init__(sock, peer, epoch, seg.payload, seg.headers, mismatch)
        self.seg = seg

    def close(self) -> None:
        super().close()
        self.payload = []
        self.seg.close()
