"""What every FTAR transport shares (docs/GUIDE.md, "FTAR transports"): errors, chunk headers, the link interface.

A ring neighbour pair is joined by two *links*, one per direction, set up per epoch by
the endpoint's handshake (endpoint.py). The engine writes chunk j of a ring step with
`TxLink.send` and takes the left neighbour's chunk j with `RxLink.recv` (into the link's
slot j, then `release(j)`) or `RxLink.recv_into` (into the user's memory). A link is of
one *kind*, negotiated per link in the handshake:
  tcp   a stream with a header per chunk (tcp.py);
  shm   one-sided writes into the neighbour's mapped slots, doorbells and credits on the
        handshake socket (shm.py over onesided.py);
  rdma  one-sided RDMA_WRITE_WITH_IMM into registered slots (rdma.py over onesided.py).
The ring code in engine.py is the same for all three.

Errors: `RecoverableError` (peer closed or reset, timeout, abort, stale epoch) and
`FatalError` (size/dtype mismatch, bad arguments, local device error).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from lightning_ft.config import TRANSPORTS


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


class SetupError(RuntimeError):
    """A link could not be set up (mapping, registration, QP transition): its handshake fails."""


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
    # numpy declares ndarray.__buffer__ for Python 3.12+ only; every supported numpy has the buffer protocol.
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")  # type: ignore[arg-type]




def shutdown(sock: Optional[socket.socket]) -> None:
    """Wake every thread blocked on `sock` now (the peer sees EOF); closing is separate."""
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def close_socket(sock: Optional[socket.socket]) -> None:
    if sock is not None:
        shutdown(sock)
        sock.close()


# -- links --------------------------------------------------------------------------------------

Mismatch = Callable[[ChunkHeader, ChunkHeader], None]
"""Raises the right error for a chunk header that differs from the expected one."""


class TxLink(ABC):
    """Our direction to the right neighbour, for one epoch. Two ways to send a chunk:
    direct (`send` from any memory, then `wait_sent`) where `direct` is set (tcp), and
    staged (`reserve` the chunk's staging memory, fill it, `post` it, `flush` at the end),
    which every link supports: shm stages in the neighbour's own slot (reduce writes there
    at once), rdma in its registered send buffer."""

    kind: str
    direct: bool = False

    @abstractmethod
    def send(self, hdr: ChunkHeader, src: torch.Tensor, timeout_s: float) -> int:
        """Start writing `src` (hdr.nbytes bytes) as chunk hdr; returns a ticket. `src` must
        stay unchanged until `wait_sent(ticket)`. May wait up to `timeout_s` for a credit."""

    @abstractmethod
    def wait_sent(self, ticket: int, timeout_s: float) -> None:
        """Block until write `ticket` and every earlier one no longer need their memory."""

    @abstractmethod
    def reserve(self, hdr: ChunkHeader, timeout_s: float) -> torch.Tensor:
        """The S-byte uint8 staging memory for chunk `hdr` (waits for it to be free)."""

    @abstractmethod
    def post(self, hdr: ChunkHeader, timeout_s: float) -> None:
        """Send chunk `hdr` from the memory `reserve` returned."""

    @abstractmethod
    def flush(self, timeout_s: float) -> None:
        """Block until every posted write no longer needs its memory."""

    @abstractmethod
    def send_fatal(self, hdr: ChunkHeader, message: str) -> None:
        """Best effort: tell the right neighbour the collective failed fatally."""

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Interrupt blocked calls now (any thread); later calls raise."""

    @abstractmethod
    def close(self) -> None: ...


class RxLink(ABC):
    """The left neighbour's direction to us, for one epoch."""

    kind: str

    @abstractmethod
    def recv(self, want: ChunkHeader, timeout_s: float) -> torch.Tensor:
        """Wait for chunk `want` (header checked with the mismatch handler); returns the
        uint8 memory that holds its bytes until `release(want)`."""

    @abstractmethod
    def release(self, want: ChunkHeader) -> None:
        """Done with chunk `want`'s memory: the sender may write it again."""

    @abstractmethod
    def recv_into(self, want: ChunkHeader, dest: torch.Tensor, timeout_s: float) -> None:
        """Wait for chunk `want` and leave its bytes in `dest` (released at once)."""

    def quiesce(self, timeout_s: float) -> None:  # noqa: B027 - optional: only a link that reads ahead writes late
        """After a failed all-reduce: return once nothing of the link writes the user's memory."""

    @abstractmethod
    def abort(self, reason: str) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


@dataclass
class LinkContext:
    """What a link kind needs from its endpoint."""

    ident: Identity
    slot_bytes: int
    num_slots: int
    mismatch: Mismatch


class LinkKind(ABC):
    """Sets up one kind of link during the handshake. The acceptor (receiver) side runs
    `accept` and then `finish_accept`; the dialer (sender) runs `dial` in between."""

    name: str

    def __init__(self, ctx: LinkContext) -> None:
        self.ctx = ctx

    def offer(self) -> dict:
        """What the dialer tells the acceptor about itself in its hello."""
        return {}

    @abstractmethod
    def accept(self, sock: socket.socket, epoch: int, peer: str, offer: dict) -> tuple[object, dict]:
        """Receiver side: create this epoch's receive resources; returns (state, descriptor
        for the dialer)."""

    @abstractmethod
    def dial(self, sock: socket.socket, epoch: int, peer: str, desc: dict) -> tuple[TxLink, dict]:
        """Sender side: attach to the receiver's descriptor; returns (link, confirmation)."""

    @abstractmethod
    def finish_accept(self, state: object, sock: socket.socket, epoch: int, peer: str, confirm: dict) -> RxLink:
        """Receiver side, after the dialer confirmed."""

    def discard(self, state: object) -> None:  # noqa: B027 - optional: the default holds nothing to free
        """Free the receive resources of a handshake that did not complete."""

    def close(self) -> None:  # noqa: B027 - optional: the default holds nothing to release
        """Release what the kind holds for the endpoint's lifetime (device, registrations)."""


def allowed_kinds(transport: str, rdma_device: bool) -> list[str]:
    """Link kinds a rank accepts, in order of preference, for `ftar.transport`."""
    if transport == "auto":
        return ["shm"] + (["rdma"] if rdma_device else []) + ["tcp"]
    if transport in TRANSPORTS:
        return [transport]
    raise FatalError(f"unknown FTAR transport {transport!r}; use one of {', '.join(TRANSPORTS)}")


def choose_link(offered: Sequence[str], mine: Sequence[str], same_host: bool) -> tuple[Optional[str], str]:
    """The acceptor's choice for a link: the dialer's first offered kind that we accept
    (shm only between processes of one host). Returns (kind, why) or (None, the refusal)."""
    for kind in offered:
        if kind in mine and (kind != "shm" or same_host):
            return kind, f"{kind}: first kind both ends accept" + (" (same host)" if kind == "shm" else "")
    if not offered:
        return None, "the left neighbour offered no link kind"
    if set(offered) & set(mine) == {"shm"} and not same_host:
        return None, ("ftar.transport=shm needs ring neighbours on one host, and the left neighbour is on "
                      "another host; use ftar.transport=auto or tcp")
    return None, (f"no common link kind: the left neighbour offers {list(offered)}, this rank accepts "
                  f"{list(mine)}; every replica of a job must use the same ftar.transport")


def host_id() -> str:
    """Same value for processes that can map each other's memory (one boot, one pid
    namespace): the test for shm links."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return f"unknown:{socket.gethostname()}:{os.getpid()}"  # never equal: no shm
