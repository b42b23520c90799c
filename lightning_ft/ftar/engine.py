"""FTAR engine: one fault-tolerant ring all-reduce endpoint per rank (docs/ARCHITECTURE.md, "The exchange").

The training thread calls `allreduce(tensors)` and gets a `Work`; one CPU control thread
runs the ring schedule (ring.py) over this epoch's two links (transport/: tcp, shm, rdma;
`ftar.transport`), calls the data-plane ops (ops/), and completes the Work. Links with a
`direct` path (tcp) send from and receive into the user's tensor; the others stage each
chunk in their registered slots (shm: the neighbour's own slot, so reduce writes there).
Slots are allocated by the link kinds: once (tcp), or per epoch and link (shm, rdma).

Device tensors (CUDA) take the device path (`_allreduce_device`; docs/ARCHITECTURE.md, "The
device data plane"): the data stays on the device, the Triton kernels (ops.DeviceKernels,
`ftar.num_programs` programs) pack, reduce, scale and unpack each chunk in device staging
slots, and host links are bridged through pinned host slots (transport/staging.py). The
control thread stays the CPU's: it waits for chunks, orders copies and kernels on its own
stream, and sends. CPU tensors take the CPU path, unchanged, unless `device_staging` forces
the device path on them (tests run its logic on CPU, under TRITON_INTERPRET=1).

Errors. A `RecoverableError` (peer lost, timeout, `abort`, stale epoch) fails the running
Work and every queued one ("skipped"), and the engine refuses new work until the next
`reconfigure`; it also closes the links at once, so the neighbours fail now rather than at
their timeouts. A `FatalError` (ranks disagree on size or dtype, bad arguments) is sent
around the ring so that every rank raises it, and no rank hangs. Every wait has a deadline.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence, cast

import torch

from lightning_ft import ops
from .paths import Device, Direct, Path, Staged
from .ring import RingStep, chunks, neighbours, partitions, schedule, segments
from .transport.base import (DTYPE_CODES, KIND_DATA, ChunkHeader, FatalError, FTARError, Identity, LinkContext,
                             RecoverableError, job_hash)
from .transport.base import RxLink, TxLink
from .transport.endpoint import Endpoint
from .transport.staging import DeviceStaging
from .linkstate import CountedRx, CountedTx, LinkState
from lightning_ft.threads import Thread
from .work import Work

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ring:
    """This rank's place in one epoch's ring: its index of n, and the listener addresses of
    the two neighbours it connects to (all a rank needs of the others)."""

    epoch: int
    n: int
    index: int
    left: str
    """The rank we receive from."""
    right: str
    """The rank we send to."""


@dataclass(frozen=True)
class FTARSettings:
    """How an FTAR endpoint moves data and how long it waits (the job config's `ftar` section;
    `network.bind_host`). Every replica of a job must use the same chunk geometry."""

    chunk_bytes: int = 4 << 20
    """S: the bytes of one chunk (a multiple of 8)."""
    num_chunks: int = 4
    """C: the chunks in flight per link."""
    timeout_s: float = 5.0
    """Longest silence of a peer in the middle of an all-reduce."""
    connect_timeout_s: float = 5.0
    """Longest wait for the ring's links in `reconfigure` / `join`."""
    start_timeout_s: float = 300.0
    """Longest wait for the first chunk of an all-reduce (at least `timeout_s`)."""
    transport: str = "tcp"
    """`ftar.transport`: tcp, shm, rdma or auto (transport/)."""
    bind_host: str = "127.0.0.1"
    """Where the listener binds."""
    staged: bool = False
    """Force the staged (registered-slot) data path even on a zero-copy transport."""
    device_staging: bool = False
    """Force the device path on CPU tensors too (tests; docs/ARCHITECTURE.md, "The device data plane")."""

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0 or self.num_chunks <= 0:
            raise FatalError(f"invalid FTAR geometry: chunk_bytes={self.chunk_bytes} num_chunks={self.num_chunks}")
        if self.chunk_bytes % 8:
            raise FatalError(f"invalid FTAR geometry: chunk_bytes={self.chunk_bytes} must be a multiple of 8")
        for name in ("timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise FatalError(f"invalid FTAR setting: {name}={getattr(self, name)} must be > 0")
        if self.start_timeout_s < 0:
            raise FatalError(f"invalid FTAR setting: start_timeout_s={self.start_timeout_s} must be >= 0")


class FTAR:
    """One rank's endpoint of the cross-replica ring for its local rank.

    Args:
        job: the job's name (its hash goes into every handshake and chunk header).
        replica: this rank's replica id.
        rank: its local rank in the replica (the ring is the replicas' ranks of this local rank).
        secret: the job secret the handshakes authenticate with.
        settings: chunk geometry, timeouts, transport and data-path choices (default: `FTARSettings()`).
    """

    def __init__(self, job: str, replica: int, rank: int, secret: bytes | str,
                 settings: Optional[FTARSettings] = None) -> None:
        self.settings = st = settings or FTARSettings()
        secret_b = secret.encode() if isinstance(secret, str) else bytes(secret)
        self.ident = Identity(job, replica, rank, secret_b)
        self._job = job_hash(job)
        self.S, self.C = st.chunk_bytes, st.num_chunks
        self.timeout_s = st.timeout_s
        """Longest silence of a peer in the middle of an all-reduce."""
        self.start_timeout_s = max(st.start_timeout_s, st.timeout_s)
        """Longest wait for the first chunk of an all-reduce: peers may still be computing (a
        lagging replica calls in at once, contributors after their backward). Dead peers are
        caught sooner by closed connections and by the eviction watch's abort."""
        self.connect_timeout_s = st.connect_timeout_s
        self.staged = st.staged
        """Force the staged (registered-slot) data path even on a zero-copy transport."""
        self.device_staging = st.device_staging
        """Force the device path (device staging slots, kernels, host bridge) for CPU tensors too:
        its logic testable without a GPU (tests; slower than the CPU path)."""
        self._staging: dict[torch.device, DeviceStaging] = {}
        """The device path's staging, per device: allocated once, reused (transport/staging.py)."""
        self.paths: dict[str, int] = {}
        self.links = LinkState()
        """Bytes through the two ring links in the running all-reduce (linkstate.py): what a hang
        diagnosis reads from another thread (`links.snapshot()`)."""
        self._counted_links: Optional[tuple] = None
        """All-reduced tensors per data path ("cpu", "device"), for tests and reports."""
        # Send and receive slots (C or 2C of S bytes) are allocated and registered once by
        # each link kind, or per epoch where a stale writer must not reach them (shm, rdma).
        ctx = LinkContext(self.ident, self.S, self.C, self._mismatch)
        self.transport = Endpoint(self.ident, st.bind_host, st.transport, ctx)
        """Listener, handshakes and the current epoch's links (`ftar.transport`)."""
        self.transport.on_abort = self._remote_abort
        self._ring: Optional[Ring] = None
        self._seq = 0
        self._ticket = 0
        """The last direct send's ticket (waited for at the end of an all-reduce)."""
        self._broken: Optional[FTARError] = None
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._closed = False
        self._thread = Thread(target=self._run, name=f"ftar-r{replica}-rank{rank}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return self.transport.address

    @property
    def ring(self) -> Optional[Ring]:
        return self._ring

    # -- control ------------------------------------------------------------------------------------
    def reconfigure(self, epoch: int, ring_addrs: Sequence[str], index: int) -> float:
        """Connect to this epoch's ring, given every member's address in ring order (fails
        queued work first). Returns the seconds it took."""
        n = len(ring_addrs)
        if not 0 <= index < n:
            raise FatalError(f"ring index {index} out of range for {n} addresses")
        left, right = neighbours(n, index)
        return self.join(epoch, n, index, ring_addrs[left], ring_addrs[right])

    def join(self, epoch: int, n: int, index: int, left: str, right: str) -> float:
        """Connect to this epoch's ring as member `index` of `n`, knowing only the two
        neighbours' addresses (`reconfigure` without the others'). Returns the seconds it took."""
        t0 = time.perf_counter()
        if not 0 <= index < n:
            raise FatalError(f"ring index {index} out of range for a ring of {n}")
        if self._ring is not None and epoch < self._ring.epoch:
            raise RecoverableError(None, f"stale epoch {epoch} < current {self._ring.epoch}")
        if not self._idle.is_set():
            self.abort(f"reconfigure to epoch {epoch}")
            if not self._idle.wait(self.timeout_s + 1):
                raise FatalError("FTAR control thread did not stop for reconfigure")
        ring = Ring(epoch, n, index, left, right)
        with self._lock:
            self._ring = None
            self._seq = 0
        self.transport.connect(epoch, index, n, left, right, self.connect_timeout_s)
        with self._lock:
            self._ring = ring
            self._broken = None
        return time.perf_counter() - t0

    def allreduce(self, tensors: Sequence[torch.Tensor], op: str = "sum", divisor: Optional[float] = None) -> Work:
        """Sum `tensors` in place across the ring (then divide by `divisor`, if given)."""
        if op != "sum":
            raise FatalError(f"FTAR supports op='sum' only, got {op!r}")
        tensors = list(tensors)
        for t in tensors:
            if t.dtype not in DTYPE_CODES or not t.is_contiguous():
                raise FatalError(f"FTAR needs contiguous tensors of {sorted(str(d) for d in DTYPE_CODES)}; "
                                 f"got {t.dtype}, contiguous={t.is_contiguous()}")
        work = Work(tensors)
        for t in tensors:  # the device path starts after what the caller queued so far
            if t.is_cuda:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(t.device))
                work.ready.append(ev)
        with self._lock:
            if self._closed:
                raise FatalError("FTAR is closed")
            if self._ring is None:
                work._finish(RecoverableError(None, "not connected: call reconfigure(epoch, ring, index) first"),
                             skipped=True)
                return work
            if self._broken is not None:
                work._finish(RecoverableError(None, f"skipped: an earlier allreduce failed: {self._broken}"),
                             skipped=True)
                return work
            self._idle.clear()
            self._queue.put((work, self._ring, divisor))
        return work

    def abort(self, reason: str) -> None:
        """Interrupt the running all-reduce and fail queued ones. Any thread; returns at once."""
        with self._lock:
            if self._broken is None:
                self._broken = RecoverableError(None, f"aborted: {reason}")
        self.transport.abort(reason)

    def _remote_abort(self, reason: str, epoch: int) -> None:
        """An abort from our replica's leader or a job member, about the ring of `epoch`; older
        ones are stale."""
        ring = self._ring
        if ring is not None and epoch < ring.epoch:
            log.info("ignoring a stale abort for epoch %d (ring is at %d): %s", epoch, ring.epoch, reason)
            return
        self.abort(reason)

    def abort_peer(self, address: str, reason: str, epoch: int, timeout_s: float = 1.0) -> None:
        """Abort the FTAR at `address` (another rank of this replica, or a rank of another member
        of the job) if its ring is at `epoch`; an endpoint already at a newer epoch ignores it."""
        self.transport.abort_peer(address, reason, epoch, timeout_s)

    @property
    def broken(self) -> bool:
        """A failure or abort happened since the last reconfigure: the next all-reduce is skipped."""
        return self._broken is not None

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.abort("closed")
        self._queue.put(None)
        self._thread.join(self.timeout_s + 2)
        self.transport.close()

    # -- the control thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, ring, divisor = item
            with self._lock:
                broken = self._broken
            if broken is not None:
                work._finish(RecoverableError(getattr(broken, "peer", None), f"skipped: {broken}"), skipped=True)
            else:
                t0 = time.perf_counter()
                try:
                    for t in work.tensors:
                        self._allreduce_one(t, ring, divisor, work.ready)
                    work.seconds = time.perf_counter() - t0
                    work._finish()
                except FatalError as e:
                    # Pass it on around the ring so that every rank raises it (once each).
                    # (The links stay open: the message must travel on around the ring.)
                    self.transport.send_fatal(self._header(ring, torch.empty(0), 0, 0, 0, 0), str(e))
                    with self._lock:
                        self._broken = e
                    self._finish_failed(work, e)
                except RecoverableError as e:
                    with self._lock:
                        aborted = self._broken
                        self._broken = self._broken or e
                    if aborted is not None and aborted is not e:  # say why we were interrupted
                        # during an all-reduce only abort() sets _broken: a RecoverableError
                        e = RecoverableError(e.peer, f"{cast(RecoverableError, aborted).reason}; {e.reason}")
                    # Close our links now, so that the neighbours fail at once instead of at
                    # their timeouts; the next reconfigure builds new ones.
                    self.transport.abort(f"the all-reduce failed: {e}")
                    self._finish_failed(work, e)
                except Exception as e:  # a local device error or a bug: fatal, but never a hang
                    err = FatalError(f"FTAR control thread failed: {type(e).__name__}: {e}")
                    with self._lock:
                        self._broken = err
                    self._finish_failed(work, err)
            with self._lock:
                if self._queue.empty():
                    self._idle.set()

    def _finish_failed(self, work: Work, error: BaseException) -> None:
        """Fail `work` once nothing of ours writes its tensors any more (a tcp link's reader)."""
        try:
            self.transport.quiesce(self.timeout_s)
        except FatalError as e:
            log.error("%s", e)
            error = e
        work._finish(error)

    def _header(self, ring: Ring, t: torch.Tensor, part: int, step: int, chunk: int, nbytes: int) -> ChunkHeader:
        return ChunkHeader(KIND_DATA, self._job, ring.epoch, self._seq, part, step, chunk,
                           DTYPE_CODES.get(t.dtype, 0), nbytes, t.numel())

    def _allreduce_one(self, t: torch.Tensor, ring: Ring, divisor: Optional[float], ready: Sequence = ()) -> None:
        if t.is_cuda or self.device_staging:
            self._allreduce_device(t, ring, divisor, ready)
            return
        self._count("cpu", t)
        self._seq += 1
        flat = t.view(-1)
        if ring.n == 1 or flat.numel() == 0:
            if divisor is not None and flat.numel():
                ops.scale_(flat, divisor)
            return
        plan = schedule(ring.n, ring.index)
        tx, rx = self.transport.tx, self.transport.rx
        if tx is None or rx is None:
            raise RecoverableError(None, "the ring's links are closed (aborted); reconfigure first")
        tx, rx = self._counted(tx, rx)
        self.links.begin(self._seq)
        try:
            self._ring_cpu(flat, ring, plan, tx, rx, divisor)
        finally:
            self.links.end()

    def _counted(self, tx: TxLink, rx: RxLink) -> tuple[TxLink, RxLink]:
        """The epoch's links wrapped in the LinkState counters, once per pair of links (the
        device staging keys its tickets on the link object)."""
        c = self._counted_links
        if c is None or c[0] is not tx or c[1] is not rx:
            c = self._counted_links = (tx, rx, CountedTx(tx, self.links), CountedRx(rx, self.links))
        return c[2], c[3]

    def _ring_cpu(self, flat: torch.Tensor, ring: Ring, plan, tx: TxLink, rx: RxLink, divisor: Optional[float]) -> None:
        path: Path = Staged(tx, rx, divisor, self.timeout_s) if self.staged or not tx.direct else \
            Direct(tx, rx, divisor, self.timeout_s)
        self._run_ring(flat, ring, plan, path)
        if isinstance(path, Direct):
            self._ticket = path.ticket or self._ticket
            tx.wait_sent(self._ticket, self.timeout_s)
        else:
            tx.flush(self.timeout_s)

    def _run_ring(self, flat: torch.Tensor, ring: Ring, plan: list[RingStep], path: Path) -> None:
        """The ring all-reduce of `flat`, written once for every data path (ftar/paths.py): each
        partition's reduce-scatter and all-gather steps, chunk by chunk."""
        es = flat.element_size()
        parts = [segments(part, ring.n) for part in partitions(flat.numel(), es, ring.n, self.S, self.C)]
        # what arrives from the left neighbour, in stream order: [partition][step] -> (span, header)
        recvs = [[[(c, self._header(ring, flat, p, s, j, c.numel * es))
                   for j, c in enumerate(chunks(segs[step.recv_seg], es, self.S))] for s, step in enumerate(plan)]
                 for p, segs in enumerate(parts)]
        path.expect([(step, want, c) for steps in recvs for step, got in zip(plan, steps, strict=True)
                     for c, want in got], flat)

        def first(p: int) -> None:
            for j, c in enumerate(chunks(parts[p][plan[0].send_seg], es, self.S)):
                path.first(j, flat[c.start:c.end], self._header(ring, flat, p, 0, j, c.numel * es), self._timeout(p, 0))

        first(0)
        for p, steps in enumerate(recvs):
            for s, step in enumerate(plan):
                forward = s + 1 < len(plan)
                if not forward and p + 1 < len(parts):
                    # The next partition's first sends go out before this one's last step, whose
                    # receives forward nothing: the link would idle there (the partition bubble).
                    # Every rank does the same, so each stream keeps the order its reader expects.
                    first(p + 1)
                timeout = self._timeout(p, s)
                for j, (c, want) in enumerate(steps[s]):
                    nxt = self._header(ring, flat, p, s + 1, j, c.numel * es) if forward else None
                    path.chunk(step, j, flat[c.start:c.end], want, nxt, timeout)

    def _timeout(self, p: int, s: int) -> float:
        """The first step of an all-reduce may wait for peers still computing (start timeout)."""
        return self.start_timeout_s if p == 0 and s == 0 else self.timeout_s

    # -- the device path ----------------------------------------------------------------------------
    def staging(self, device: torch.device | str) -> DeviceStaging:
        """The device path's staging for `device` (allocated on first use, then reused)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        st = self._staging.get(device)
        if st is None:
            st = self._staging[device] = DeviceStaging(device, self.S, self.C)
            log.info("FTAR r%d rank %d: device path on %s: %s kernels, %s host staging %d MiB, device %d MiB",
                     self.ident.replica, self.ident.rank, device, st.kernels.name,
                     "pinned" if st.pinned else "unpinned", st.nbytes["host"] >> 20, st.nbytes["device"] >> 20)
        return st

    def _count(self, path: str, t: torch.Tensor) -> None:
        n = self.paths.get(path, 0)
        self.paths[path] = n + 1
        report = os.environ.get("LFT_FTAR_PATHS") if n == 0 else None
        if report:  # one line per process and path (bench.gpu_check reads them)
            st = self._staging.get(t.device) if path == "device" else None
            row = {"pid": os.getpid(), "replica": self.ident.replica, "rank": self.ident.rank, "path": path,
                   "device": str(t.device), "dtype": str(t.dtype).removeprefix("torch."),
                   "kernels": st.kernels.name if st else "torch", "pinned": bool(st and st.pinned)}
            try:
                with open(report, "a") as f:
                    f.write(json.dumps(row) + "\n")
            except OSError as e:
                log.warning("cannot write LFT_FTAR_PATHS=%s: %s", report, e)

    def _allreduce_device(self, t: torch.Tensor, ring: Ring, divisor: Optional[float], ready: Sequence) -> None:
        """The CPU-GPU split: the data stays on the device; per chunk, this thread receives into
        pinned host memory, the H2D copy and the kernels run on the staging stream, and a chunk
        for the next hop goes D2H, then out on the link (transport/staging.py)."""
        if t.dtype not in ops.SUPPORTED_DTYPES:
            raise FatalError(f"FTAR's device path supports {[str(d) for d in ops.SUPPORTED_DTYPES]}, got {t.dtype}")
        self._seq += 1
        flat = t.view(-1)
        st = self.staging(t.device)
        self._count("device", t)
        tx, rx = self.transport.tx, self.transport.rx
        if ring.n == 1 or flat.numel() == 0:
            if divisor is not None and flat.numel():
                with st.active(tx, ready):
                    st.kernels.scale_(flat, divisor)
            return
        if tx is None or rx is None:
            raise RecoverableError(None, "the ring's links are closed (aborted); reconfigure first")
        tx, rx = self._counted(tx, rx)
        self.links.begin(self._seq)
        try:
            self._ring_device(flat, ring, tx, rx, divisor, ready, st)
        finally:
            self.links.end()

    def _ring_device(self, flat: torch.Tensor, ring: Ring, tx: TxLink, rx: RxLink, divisor: Optional[float],
                     ready: Sequence, st: DeviceStaging) -> None:
        path = Device(tx, rx, divisor, self.timeout_s, st, self.staged or not tx.direct)
        with st.active(tx, ready):
            self._run_ring(flat, ring, schedule(ring.n, ring.index), path)
            tx.flush(self.timeout_s)

    def _mismatch(self, got: ChunkHeader, want: ChunkHeader) -> None:
        if got.job != want.job:
            raise FatalError(f"chunk from another job (hash {got.job:#x} != {want.job:#x})")
        if got.epoch != want.epoch:
            raise RecoverableError(None, f"stale epoch in chunk: {got.epoch} != {want.epoch}")
        if got.dtype != want.dtype or got.total_numel != want.total_numel:
            msg = (f"FTAR size/dtype mismatch in all-reduce #{want.seq} of epoch {want.epoch}: this rank has "
                   f"{want.total_numel} elements of dtype code {want.dtype}, the left neighbour sent "
                   f"{got.total_numel} of dtype code {got.dtype}")
        else:
            msg = (f"FTAR ranks out of step in epoch {want.epoch}: expected all-reduce #{want.seq} partition "
                   f"{want.partition} step {want.step} chunk {want.chunk} ({want.nbytes} B), got #{got.seq} "
                   f"partition {got.partition} step {got.step} chunk {got.chunk} ({got.nbytes} B)")
        raise FatalError(msg)
