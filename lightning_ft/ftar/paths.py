"""What one chunk of the ring does on each data path (docs/ARCHITECTURE.md, "The exchange"; "The
device data plane"). The engine's ring loop (`FTAR._run_ring`) is written once: it walks the
partitions, the reduce-scatter and all-gather steps of ring.py's schedule and each step's chunks,
and sends the next partition's first chunks before a partition's last step (the partition bubble).
A path says what happens to one chunk:

- `Direct` (tcp): send from and receive into the user's tensor: reduce-scatter chunks are added
  into the user's buffer as they arrive (`recv_reduce`; the partial sums stay in place there and
  all-gather overwrites them), all-gather chunks land where they belong and are forwarded from there.
- `Staged` (shm, rdma): every chunk goes through the link's staging memory (shm: the neighbour's
  slot; rdma: the registered sendbuf): `copy` packs into it, `reduce` writes the next hop's
  staging and, on the last reduce-scatter step, the user's buffer too (fused).
- `Device` (CUDA, or forced on CPU by `device_staging`): as `Staged`, with the staging on the
  device: reduce-scatter chunks are reduced into the device tx slot (fused into the user's buffer
  on the last step) and sent D2H; all-gather chunks are unpacked into the user's buffer by the
  copy kernel and forwarded from host memory (their bytes are there already).

`expect` hands the receive link the whole all-reduce's chunks in stream order first (Direct: a
tcp link reads ahead, transport/tcp.py); `first` sends a partition's first chunk (step 0);
`chunk` receives one chunk of a step, reduces or copies it, and forwards it when `nxt` (the
next step's header) is given.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from lightning_ft import ops
from .ring import RingStep, Span
from .transport.base import ChunkHeader, RxLink, TxLink, byte_view
from .transport.staging import DeviceStaging


def _reduce(k: Any, out: torch.Tensor, recv: torch.Tensor, user: torch.Tensor, last_rs: bool,
            divisor: Optional[float]) -> None:
    """A staged reduce-scatter chunk with the ops `k` (ops, or the device kernels): the next hop's
    staging `out` = recv + user; on the last step the user's buffer gets the sum too, fused into
    the reduce, or copied after the scale when there is a divisor."""
    if last_rs and divisor is not None:
        k.reduce_(out, recv, user)
        k.scale_(out, divisor)
        k.copy_(user, out)
    else:
        k.reduce_(out, recv, user, out2=user if last_rs else None)


class Path:
    """One all-reduce's per-chunk work on one data path (see the module docstring)."""

    def __init__(self, tx: TxLink, rx: RxLink, divisor: Optional[float], timeout_s: float) -> None:
        self.tx, self.rx, self.divisor, self.timeout_s = tx, rx, divisor, timeout_s

    def expect(self, recvs: list[tuple[RingStep, ChunkHeader, Span]], flat: torch.Tensor) -> None:
        """Every chunk this all-reduce of `flat` will receive, in stream order, with its step and
        its span of `flat` (default: nothing to prepare)."""

    def first(self, j: int, user: torch.Tensor, hdr: ChunkHeader, timeout: float) -> None:
        raise NotImplementedError

    def chunk(self, step: RingStep, j: int, user: torch.Tensor, want: ChunkHeader, nxt: Optional[ChunkHeader],
              timeout: float) -> None:
        raise NotImplementedError


class Direct(Path):
    ticket = 0
    """The last send's ticket (`TxLink.wait_sent` waits for it at the end)."""

    def expect(self, recvs: list[tuple[RingStep, ChunkHeader, Span]], flat: torch.Tensor) -> None:
        """A link that reads ahead (tcp) learns where each chunk goes: reduce-scatter chunks are
        added into the user's buffer, all-gather chunks written there."""
        if getattr(self.rx, "reduces", False):
            es, fb = flat.element_size(), byte_view(flat)
            self.rx.expect([(want, flat[c.start:c.end], fb[c.start * es:c.end * es], step.phase == "rs")  # type: ignore[attr-defined]
                            for step, want, c in recvs])

    def first(self, j: int, user: torch.Tensor, hdr: ChunkHeader, timeout: float) -> None:
        self.ticket = self.tx.send(hdr, user, timeout)

    def chunk(self, step: RingStep, j: int, user: torch.Tensor, want: ChunkHeader, nxt: Optional[ChunkHeader],
              timeout: float) -> None:
        if step.phase == "rs":
            if getattr(self.rx, "reduces", False):  # tcp: the link adds the chunk into the user's buffer
                self.rx.recv_reduce(want, user, timeout)  # type: ignore[attr-defined]
            else:
                recv = self.rx.recv(want, timeout).view(user.dtype)[:user.numel()]
                ops.reduce_(user, recv, user)
                self.rx.release(want)
            if step.last_rs and self.divisor is not None:
                ops.scale_(user, self.divisor)
        else:
            self.rx.recv_into(want, user, timeout)
        if nxt is not None:
            self.ticket = self.tx.send(nxt, user, self.timeout_s)


class Staged(Path):
    def first(self, j: int, user: torch.Tensor, hdr: ChunkHeader, timeout: float) -> None:
        ops.copy_(self.tx.reserve(hdr, timeout).view(user.dtype)[:user.numel()], user)
        self.tx.post(hdr, self.timeout_s)

    def chunk(self, step: RingStep, j: int, user: torch.Tensor, want: ChunkHeader, nxt: Optional[ChunkHeader],
              timeout: float) -> None:
        dt, n = user.dtype, user.numel()
        recv = self.rx.recv(want, timeout).view(dt)[:n]
        out = self.tx.reserve(nxt, timeout).view(dt)[:n] if nxt is not None else None
        if step.phase == "rs":  # always forwards (all-gather follows)
            assert out is not None
            _reduce(ops, out, recv, user, step.last_rs, self.divisor)
        else:
            ops.copy_(user, recv)
            if out is not None:  # forward
                ops.copy_(out, recv)
        self.rx.release(want)
        if nxt is not None:  # forward
            self.tx.post(nxt, self.timeout_s)


class Device(Path):
    def __init__(self, tx: TxLink, rx: RxLink, divisor: Optional[float], timeout_s: float, st: DeviceStaging,
                 staged: bool) -> None:
        super().__init__(tx, rx, divisor, timeout_s)
        self.st, self.staged = st, staged
        self.k: Any = st.kernels

    def first(self, j: int, user: torch.Tensor, hdr: ChunkHeader, timeout: float) -> None:
        self.k.copy_(self.st.tx_slot(j, user.dtype, user.numel()), user)  # pack
        self.st.send_device(self.tx, hdr, self.staged, timeout)

    def chunk(self, step: RingStep, j: int, user: torch.Tensor, want: ChunkHeader, nxt: Optional[ChunkHeader],
              timeout: float) -> None:
        st, k, dt, n = self.st, self.k, user.dtype, user.numel()
        host = st.recv(self.rx, want, timeout, self.staged)
        recv = st.to_device(j, host, dt, n)
        if step.phase == "rs":  # always forwards (all-gather follows)
            out = st.tx_slot(j, dt, n)
            _reduce(k, out, recv, user, step.last_rs, self.divisor)
            assert nxt is not None
            st.send_device(self.tx, nxt, self.staged, self.timeout_s)
        else:
            k.copy_(user, recv)  # unpack
            if nxt is not None:  # forward
                st.send_host(self.tx, nxt, host, self.staged, self.timeout_s)
