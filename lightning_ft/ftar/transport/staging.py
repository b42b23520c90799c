"""Device staging for FTAR's device data path (docs/ARCHITECTURE.md, "The device data plane").

One `DeviceStaging` per FTAR endpoint and device, allocated on the first all-reduce of a
tensor on that device and reused by every later one, in every epoch and over every link:

  dev_rx, dev_tx    C slots of S bytes each on the device: what the kernels read and write
                    (a received chunk; the next hop's chunk: packed by the copy kernel or
                    written by the reduce kernel);
  host_rx, host_tx  C slots of S bytes each in PINNED host memory: the bridge to a host link
                    (tcp: received into and sent from directly; shm and rdma: copied from the
                    link's slot after `recv`, into the link's slot after `reserve`);
  stream            the control thread's CUDA stream: H2D/D2H copies (cudaMemcpyAsync, via
                    `copy_(non_blocking=True)`) and kernels run on it, after the work the
                    caller queued on its own stream before `allreduce` (an event each).

Ordering: a chunk is sent only after a stream sync following its D2H copy; host_rx slot j
is received into again only after the H2D copy that read it has completed (an event per
slot); host_tx slot j is written again only after its last direct send left (the link's
ticket). At the end of an all-reduce (and on a failure) the stream is synchronized, so a
finished Work's tensors are final for any stream.

`DeviceStaging("cpu", ...)` runs the same logic on CPU tensors (plain copies, no stream,
unpinned host slots): FTARSettings(device_staging=True) forces it, to test the device path on a
machine without a GPU, with the Triton kernels under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch

from lightning_ft import ops

from .base import ChunkHeader, RxLink, TxLink


class DeviceStaging:
    def __init__(self, device: torch.device | str, slot_bytes: int, num_slots: int) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.S, self.C = slot_bytes, num_slots
        self.kernels = ops.DeviceKernels(self.device)
        self.calls = self.kernels.calls
        """Counts of kernel calls ("copy", "reduce", "scale") and host copies ("h2d", "d2h")."""
        nbytes = slot_bytes * num_slots
        self.pinned = self.cuda
        self._dev_rx = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._dev_tx = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._host_rx = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        self._host_tx = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        self.dev_rx, self.dev_tx = self._slots(self._dev_rx), self._slots(self._dev_tx)
        self.host_rx, self.host_tx = self._slots(self._host_rx), self._slots(self._host_tx)
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._rx_busy: list[Optional[torch.cuda.Event]] = [None] * num_slots
        """host_rx slot j is still read by an H2D copy until this event."""
        self._tickets: dict[int, int] = {}
        """host_tx slot j: the ticket of its last direct send on `_link`."""
        self._link: Optional[TxLink] = None

    def _slots(self, buf: torch.Tensor) -> list[torch.Tensor]:
        return [buf[j * self.S:(j + 1) * self.S] for j in range(self.C)]

    @property
    def nbytes(self) -> dict[str, int]:
        return {"device": 2 * self._dev_rx.numel(), "host": 2 * self._host_rx.numel()}

    def buffers(self) -> list[torch.Tensor]:
        """The four staging buffers (tests check that they are reused)."""
        return [self._dev_rx, self._dev_tx, self._host_rx, self._host_tx]

    # -- an all-reduce ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def active(self, tx: Optional[TxLink], ready: Sequence[torch.cuda.Event] = ()) -> Iterator[None]:
        """One all-reduce over link `tx` (None: no link): on the staging stream, after the `ready` events
        (the caller's stream when it called `allreduce`); synchronized at the end, also
        when it fails, so that nothing of ours still writes the tensor afterwards."""
        if tx is not self._link:  # a new epoch's link: its tickets start again
            self._link, self._tickets = tx, {}
        if not self.cuda:
            yield
            return
        stream = self.stream
        assert stream is not None  # made when self.cuda
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            for ev in ready:
                stream.wait_event(ev)
            try:
                yield
            finally:
                self.sync()

    def sync(self) -> None:
        if self.cuda:
            assert self.stream is not None  # made when self.cuda
            self.stream.synchronize()
            self._rx_busy = [None] * self.C

    # -- receiving ----------------------------------------------------------------------------------
    def recv(self, rx: RxLink, want: ChunkHeader, timeout_s: float, staged: bool) -> torch.Tensor:
        """Chunk `want` in host_rx slot `want.chunk` (its bytes)."""
        j = want.chunk
        ev = self._rx_busy[j]
        if ev is not None:  # the previous H2D from this slot must have read it
            ev.synchronize()
            self._rx_busy[j] = None
        host = self.host_rx[j][:want.nbytes]
        if staged:  # the link's own slot (shm: mapped; rdma: registered): copy it out, release
            mem = rx.recv(want, timeout_s)
            host.copy_(mem[:want.nbytes])
            rx.release(want)
        else:  # tcp: straight into pinned memory
            rx.recv_into(want, host, timeout_s)
        return host

    def to_device(self, j: int, host: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """H2D of a received chunk into dev_rx slot j; its first `numel` elements of `dtype`."""
        dev = self.dev_rx[j][:host.numel()]
        dev.copy_(host, non_blocking=True)
        self.calls["h2d"] += 1
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(self.stream)
            self._rx_busy[j] = ev
        return dev.view(dtype)[:numel]

    # -- sending ------------------------------------------------------------------------------------
    def tx_slot(self, j: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """dev_tx slot j as `numel` elements of `dtype`: the next hop's chunk, filled by a kernel."""
        return self.dev_tx[j].view(dtype)[:numel]

    def _free_host_tx(self, tx: TxLink, j: int, staged: bool, timeout_s: float) -> torch.Tensor:
        if not staged and j in self._tickets:  # its last direct send must have left
            tx.wait_sent(self._tickets.pop(j), timeout_s)
        return self.host_tx[j]

    def _send(self, tx: TxLink, hdr: ChunkHeader, host: torch.Tensor, staged: bool, timeout_s: float) -> None:
        if staged:
            tx.reserve(hdr, timeout_s)[:hdr.nbytes].copy_(host)
            tx.post(hdr, timeout_s)
        else:
            self._tickets[hdr.chunk] = tx.send(hdr, host, timeout_s)

    def send_device(self, tx: TxLink, hdr: ChunkHeader, staged: bool, timeout_s: float) -> None:
        """Send dev_tx slot hdr.chunk: D2H into pinned host_tx, stream sync, then the link."""
        host = self._free_host_tx(tx, hdr.chunk, staged, timeout_s)[:hdr.nbytes]
        host.copy_(self.dev_tx[hdr.chunk][:hdr.nbytes], non_blocking=True)
        self.calls["d2h"] += 1
        self.sync()
        self._send(tx, hdr, host, staged, timeout_s)

    def send_host(self, tx: TxLink, hdr: ChunkHeader, src: torch.Tensor, staged: bool, timeout_s: float) -> None:
        """Forward bytes already in host memory (an all-gather chunk just received)."""
        host = self._free_host_tx(tx, hdr.chunk, staged, timeout_s)[:hdr.nbytes]
        host.copy_(src)
        self._send(tx, hdr, host, staged, timeout_s)
