"""The FTAR transport interface and what every transport shares (DESIGN §4).

The interface is RDMA-shaped: a transport owns two *registered* buffers of C slots of S
bytes. `send(hdr, slot)` writes sendbuf[slot] into the right neighbour's recvbuf[slot]
(one-sided, in order); `recv(slot)` waits until the left neighbour's write into our
recvbuf[slot] has landed and returns its header. A slot's credit goes back to the sender
when the receiver next calls `recv` on it. The ring code is the same for TCP and RDMA.

Errors: `RecoverableError` (peer closed or reset, timeout, abort, stale epoch) and
`FatalError` (size/dtype mismatch, bad arguments, local device error).
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional

import torch


class FTARError(RuntimeError):
    pass


class RecoverableError(FTARError):
    """The all-reduce failed in a way a new quorum can recover from."""

    def __init__(self, peer: Optional[str], reason: str) -> None:
        self.peer = peer
        self.reason = reason
        super().__init__(f"{reason} (peer {peer})" if peer else reason)


class FatalError(FTARError):
    """Programming or configuration error; retrying cannot help. The process should exit."""


MAGIC = 0x4C465431  # "LFT1"
KIND_DATA = 1
KIND_FATAL = 2

# magic, kind, job hash, epoch, seq, partition, step, chunk, dtype, nbytes, total numel
_HDR = struct.Struct("!IIQQIIIIIQQ")
HEADER_SIZE = _HDR.size

DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


def job_hash(job: str) -> int:
    return int.from_bytes(hashlib.sha256(job.encode()).digest()[:8], "big")


@dataclass(frozen=True)
class ChunkHeader:
    kind: int
    job: int
    epoch: int
    seq: int
    """The all-reduce call number in this epoch (each tensor of a call gets its own)."""
    partition: int
    step: int
    chunk: int
    dtype: int
    nbytes: int
    total_numel: int
    """Numel of the whole tensor being reduced: a mismatch means the ranks disagree."""

    def pack(self) -> bytes:
        return _HDR.pack(MAGIC, self.kind, self.job, self.epoch, self.seq, self.partition, self.step, self.chunk,
                         self.dtype, self.nbytes, self.total_numel)

    @classmethod
    def unpack(cls, raw: bytes) -> "ChunkHeader":
        magic, *fields = _HDR.unpack(raw)
        if magic != MAGIC:
            raise FatalError(f"bad FTAR chunk header magic {magic:#x}: not an FTAR peer or a corrupted stream")
        return cls(*fields)


def mac(secret: bytes, *parts: object) -> str:
    """HMAC-SHA256 over the parts, hex."""
    msg = "|".join(str(p) for p in parts).encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Identity:
    """Who we are in the handshake."""

    job: str
    replica: int
    rank: int
    secret: bytes


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


class Transport(ABC):
    """One rank's endpoint in one ring. Created once; `connect` is called per epoch.

    Sends are asynchronous and complete in order; `send` returns a ticket for `wait_sent`.
    A `zero_copy` transport (TCP) can send from and receive into any host memory, so the
    engine skips the staging copies; otherwise (RDMA) every chunk goes through the
    registered slots."""

    address: str
    """Where left neighbours connect to: published in the member report."""
    zero_copy: bool = False

    @abstractmethod
    def register(self, sendbuf: torch.Tensor, recvbuf: torch.Tensor, slot_bytes: int) -> None:
        """Register the engine's send and receive buffers (C slots of S bytes each)."""

    @abstractmethod
    def connect(self, epoch: int, index: int, n: int, left: str, right: str, timeout_s: float) -> None:
        """Drop connections of older epochs and connect to this epoch's ring neighbours."""

    @abstractmethod
    def send(self, hdr: ChunkHeader, src: memoryview) -> int:
        """Start writing `src` (hdr.nbytes bytes) to the right neighbour; returns a ticket.
        `src` must stay unchanged until `wait_sent(ticket)`."""

    @abstractmethod
    def wait_sent(self, ticket: int, timeout_s: float) -> None:
        """Block until send `ticket` (and every earlier one) no longer needs its memory."""

    @abstractmethod
    def recv(self, dest: Callable[[ChunkHeader], memoryview], timeout_s: float) -> ChunkHeader:
        """Receive the next chunk from the left neighbour. `dest(header)` validates the
        header (raising on a mismatch) and returns where its payload goes."""

    @abstractmethod
    def send_fatal(self, hdr: ChunkHeader, message: str) -> None:
        """Best effort: tell the right neighbour the collective failed fatally."""

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Interrupt every blocked call now (any thread). Calls fail until `connect`."""

    @abstractmethod
    def abort_peer(self, addr: str, reason: str, epoch: int, timeout_s: float) -> None:
        """Ask the transport listening at `addr` (another rank of our replica) to abort its
        ring of `epoch`."""

    @abstractmethod
    def set_abort_handler(self, fn: Callable[[str, int], None]) -> None:
        """`fn(reason, epoch)` is called when our replica's leader sends us an abort."""

    @abstractmethod
    def close(self) -> None:
        """Release sockets, threads and registrations."""
