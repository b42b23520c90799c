"""Per-link byte counters of one FTAR endpoint, for hang diagnosis (docs/ARCHITECTURE.md,
"Hang diagnosis").

The control thread wraps the epoch's two links in `CountedTx` / `CountedRx` for each
all-reduce. Per chunk they do two plain integer stores around the blocking call: no lock, no
clock (the overhead benchmark must not move). Any thread may read a `LinkState` at any time:
`snapshot()` says how many bytes this rank has been waiting for, from which side, and since
when (the monotonic time of the all-reduce's start; the reader does the clock).
"""
from __future__ import annotations

import time
from typing import Any

import torch

from .transport.base import ChunkHeader, RxLink, TxLink


class LinkState:
    """Bytes through this rank's two ring links in the current all-reduce. Written by the control
    thread only; read (racy but consistent enough: ints) by anyone."""

    __slots__ = ("rx_done", "rx_wait", "tx_done", "tx_wait", "started", "seq", "active")

    def __init__(self) -> None:
        self.rx_done = 0
        """Bytes received from the left neighbour in this all-reduce."""
        self.rx_wait = 0
        """Bytes of the receive in progress (0 when not waiting to receive)."""
        self.tx_done = 0
        """Bytes handed to the right neighbour's link (sent or buffered) in this all-reduce."""
        self.tx_wait = 0
        """Bytes of the send in progress: waiting for a credit, a slot, or the flush."""
        self.started = 0.0
        """time.monotonic() at the start of the all-reduce."""
        self.seq = 0
        """Which all-reduce (the engine's sequence number)."""
        self.active = False

    def begin(self, seq: int) -> None:
        self.rx_done = self.rx_wait = self.tx_done = self.tx_wait = 0
        self.seq, self.started, self.active = seq, time.monotonic(), True

    def end(self) -> None:
        self.active = False
        self.rx_wait = self.tx_wait = 0

    def snapshot(self) -> dict[str, Any]:
        """What a diagnosis needs: `rx` / `tx` outstanding (the blocking call's bytes), done
        counts, and seconds since the all-reduce started (0 when idle)."""
        active = self.active
        return {"active": active, "seq": self.seq,
                "rx_done": self.rx_done, "rx_outstanding": self.rx_wait if active else 0,
                "tx_done": self.tx_done, "tx_outstanding": self.tx_wait if active else 0,
                "running_s": round(time.monotonic() - self.started, 3) if active else 0.0}


class CountedTx:
    """A TxLink whose blocking calls are counted in a LinkState (everything else passes through)."""

    def __init__(self, link: TxLink, state: LinkState) -> None:
        self._link, self._st = link, state
        self.direct = link.direct

    def send(self, hdr: ChunkHeader, src: torch.Tensor, timeout_s: float) -> int:
        st = self._st
        st.tx_wait = hdr.nbytes
        ticket = self._link.send(hdr, src, timeout_s)
        st.tx_done += hdr.nbytes
        st.tx_wait = 0
        return ticket

    def reserve(self, hdr: ChunkHeader, timeout_s: float) -> torch.Tensor:
        st = self._st
        st.tx_wait = hdr.nbytes
        out = self._link.reserve(hdr, timeout_s)
        st.tx_wait = 0
        return out

    def post(self, hdr: ChunkHeader, timeout_s: float) -> None:
        st = self._st
        st.tx_wait = hdr.nbytes
        self._link.post(hdr, timeout_s)
        st.tx_done += hdr.nbytes
        st.tx_wait = 0

    def wait_sent(self, ticket: int, timeout_s: float) -> None:
        st = self._st
        st.tx_wait = -1  # the tail: bytes already handed over, not yet out
        self._link.wait_sent(ticket, timeout_s)
        st.tx_wait = 0

    def flush(self, timeout_s: float) -> None:
        st = self._st
        st.tx_wait = -1
        self._link.flush(timeout_s)
        st.tx_wait = 0

    def __getattr__(self, name: str) -> Any:  # send_fatal, abort, close, link-specific extras
        return getattr(self._link, name)


class CountedRx:
    """An RxLink whose blocking calls are counted in a LinkState."""

    def __init__(self, link: RxLink, state: LinkState) -> None:
        self._link, self._st = link, state
        self.reduces = getattr(link, "reduces", False)

    def recv(self, want: ChunkHeader, timeout_s: float) -> torch.Tensor:
        st = self._st
        st.rx_wait = want.nbytes
        out = self._link.recv(want, timeout_s)
        st.rx_done += want.nbytes
        st.rx_wait = 0
        return out

    def recv_into(self, want: ChunkHeader, dest: torch.Tensor, timeout_s: float) -> None:
        st = self._st
        st.rx_wait = want.nbytes
        self._link.recv_into(want, dest, timeout_s)
        st.rx_done += want.nbytes
        st.rx_wait = 0

    def recv_reduce(self, want: ChunkHeader, dest: torch.Tensor, timeout_s: float) -> None:
        st = self._st
        st.rx_wait = want.nbytes
        self._link.recv_reduce(want, dest, timeout_s)  # type: ignore[attr-defined]  # tcp links only
        st.rx_done += want.nbytes
        st.rx_wait = 0

    def release(self, want: ChunkHeader) -> None:
        self._link.release(want)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._link, name)
