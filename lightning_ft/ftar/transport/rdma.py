"""RDMA links over pyverbs (docs/GUIDE.md, "FTAR transports"):
RC queue pairs, RDMA_WRITE_WITH_IMM into registered slots.

Everything but the verbs calls is shared with shm: the slot/credit state machines
(slots.py), the waiting, deadlines, side channel and error paths (onesided.py), and the
handshake that carries the descriptors (endpoint.py). Per link and epoch:
  receiver  registers 2C fresh slots (header area + S bytes; slots.slot_of) with
            REMOTE_WRITE, creates an RC QP and its CQ, posts 2C receive WRs (a
            WRITE_WITH_IMM consumes one);
            descriptor = (qpn, psn, lid, gid, slot address, rkey);
  sender    its own RC QP, moved to RTR/RTS against the receiver's; the engine reduces
            into sendbuf slot j (2C slots, registered once, LOCAL_WRITE), and one signalled
            WRITE_WITH_IMM carries its header + payload into the receiver's slot j;
            confirmation = its (qpn, psn, lid, gid);
  credits   the receiver sends a 0-byte SEND_WITH_IMM(slot) back on the same QP pair.
The sender needs registered sources, so the engine runs its staged path (copy/reduce into
sendbuf). GPUDirect (MRs on device memory) is not used: CUDA tensors stage through host.

Error completions: remote access, retries exceeded, flushes and remote aborts are
`RecoverableError` (a peer or the fabric failed); local length/protection/QP errors are
`FatalError` (our bug or a bad argument), as the FT-HSDP paper classifies them.

Device selection: `LFT_RDMA_DEVICE` (default: the first of `ibv_devices`), `LFT_RDMA_PORT`
(default 1), `LFT_RDMA_GID_INDEX` (default 0; RoCE needs the RoCEv2 GID's index). Without
pyverbs or without a device, `ftar.transport=rdma` fails at start with the reason.
"""
from __future__ import annotations

import os
import random
import socket
import time
from typing import Any, Optional, Sequence, cast

import torch

from .base import (ChunkHeader, FatalError, LinkContext, LinkKind, RecoverableError, RxLink, SetupError, TxLink,
                   byte_view)
from .onesided import OneSidedRx, OneSidedTx
from .slots import HEADER_AREA, SlotLayout, imm_slot

_Accepted = tuple[torch.Tensor, Any, Any, Any, int]
"""`RdmaKind.accept`'s state: slots, memory region, queue pair, completion queue, PSN (the
endpoint hands it back unchanged; pyverbs has no stubs)."""

# ibv_wc_status (verbs.h); tests check these against pyverbs where it is installed.
WC_STATUS = {0: "SUCCESS", 1: "LOC_LEN_ERR", 2: "LOC_QP_OP_ERR", 3: "LOC_EEC_OP_ERR", 4: "LOC_PROT_ERR",
             5: "WR_FLUSH_ERR", 6: "MW_BIND_ERR", 7: "BAD_RESP_ERR", 8: "LOC_ACCESS_ERR", 9: "REM_INV_REQ_ERR",
             10: "REM_ACCESS_ERR", 11: "REM_OP_ERR", 12: "RETRY_EXC_ERR", 13: "RNR_RETRY_EXC_ERR",
             14: "LOC_RDD_VIOL_ERR", 15: "REM_INV_RD_REQ_ERR", 16: "REM_ABORT_ERR", 17: "INV_EECN_ERR",
             18: "INV_EEC_STATE_ERR", 19: "FATAL_ERR", 20: "RESP_TIMEOUT_ERR", 21: "GENERAL_ERR"}
RECOVERABLE = {"WR_FLUSH_ERR", "REM_INV_REQ_ERR", "REM_ACCESS_ERR", "REM_OP_ERR", "RETRY_EXC_ERR",
               "RNR_RETRY_EXC_ERR", "REM_INV_RD_REQ_ERR", "REM_ABORT_ERR", "RESP_TIMEOUT_ERR", "BAD_RESP_ERR"}
"""The peer or the fabric failed: a new quorum can recover."""

NO_PYVERBS = ("ftar.transport=rdma needs pyverbs, the Python binding of rdma-core (Debian/Ubuntu: apt-get install "
              "python3-pyverbs rdma-core ibverbs-providers); it does not import here")
NO_DEVICE = ("ftar.transport=rdma needs an RDMA (verbs) device, and `ibv_devices` lists none on this host; "
             "use ftar.transport=tcp (or auto, which falls back to tcp)")


def classify(status: int, vendor_err: int = 0, where: str = "") -> Optional[Exception]:
    """The error for a work completion's status (None on success)."""
    name = WC_STATUS.get(status, f"status {status}")
    if name == "SUCCESS":
        return None
    msg = f"RDMA work completion failed{where}: IBV_WC_{name} (vendor error {vendor_err:#x})"
    if name in RECOVERABLE:
        return RecoverableError(None, msg)
    return FatalError(msg + "; a local verbs error: check the registration, the QP state and the device")


def select_device(names: Sequence[str], wanted: str = "") -> str:
    """The device to open: `wanted` (LFT_RDMA_DEVICE) if set, else the first."""
    if not names:
        raise FatalError(NO_DEVICE)
    if wanted:
        if wanted not in names:
            raise FatalError(f"LFT_RDMA_DEVICE={wanted!r} is not an RDMA device here; ibv_devices lists "
                             f"{', '.join(names)}")
        return wanted
    return names[0]


def _verbs() -> Any:
    try:
        import pyverbs.addr
        import pyverbs.cq
        import pyverbs.device
        import pyverbs.enums
        import pyverbs.mr
        import pyverbs.pd
        import pyverbs.pyverbs_error
        import pyverbs.qp
        import pyverbs.wr
    except ImportError as e:
        raise FatalError(f"{NO_PYVERBS} ({e})") from None
    return pyverbs


def list_devices() -> list[str]:
    """Names of the verbs devices here; FatalError without pyverbs."""
    pv = _verbs()
    try:
        devs = pv.device.get_device_list()
    except pv.pyverbs_error.PyverbsError:  # no provider loaded / no device
        return []
    return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devs]


def rdma_skip_reason() -> str:
    """Why ftar.transport=rdma cannot run here ("" where it can): for logs and test skips."""
    try:
        return "" if list_devices() else NO_DEVICE
    except FatalError as e:
        return str(e)


def device_present() -> bool:
    """Whether ftar.transport=rdma (or auto's rdma) could open a device here."""
    return not rdma_skip_reason()


class _Device:
    """The opened device, protection domain and port/GID of this endpoint."""

    def __init__(self) -> None:
        pv = self.pv = _verbs()
        self.name = select_device(list_devices(), os.environ.get("LFT_RDMA_DEVICE", ""))
        self.port = int(os.environ.get("LFT_RDMA_PORT", "1"))
        self.gid_index = int(os.environ.get("LFT_RDMA_GID_INDEX", "0"))
        try:
            self.ctx = pv.device.Context(name=self.name)
            self.pd = pv.pd.PD(self.ctx)
            port = self.ctx.query_port(self.port)
            self.lid, self.mtu = port.lid, port.active_mtu
            self.gid = str(self.ctx.query_gid(self.port, self.gid_index))
        except pv.pyverbs_error.PyverbsError as e:
            raise FatalError(f"cannot open RDMA device {self.name} port {self.port} GID index {self.gid_index} "
                             f"(LFT_RDMA_DEVICE / LFT_RDMA_PORT / LFT_RDMA_GID_INDEX): {e}") from None

    def register(self, t: torch.Tensor, remote: bool) -> Any:
        e = self.pv.enums
        access = e.IBV_ACCESS_LOCAL_WRITE | (e.IBV_ACCESS_REMOTE_WRITE if remote else 0)
        try:
            return self.pv.mr.MR(self.pd, t.numel(), access, address=t.data_ptr())
        except self.pv.pyverbs_error.PyverbsError as e:
            raise FatalError(f"cannot register {t.numel()} bytes with RDMA device {self.name}: {e}") from None

    def qp(self, depth: int) -> tuple[Any, Any]:
        pv, e = self.pv, self.pv.enums
        cq = pv.cq.CQ(self.ctx, 4 * depth + 8, None, None, 0)
        cap = pv.qp.QPCap(max_send_wr=2 * depth + 4, max_recv_wr=2 * depth + 4, max_send_sge=1, max_recv_sge=1)
        init = pv.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap)
        attr = pv.qp.QPAttr(port_num=self.port)
        attr.qp_access_flags = e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_LOCAL_WRITE
        return pv.qp.QP(self.pd, init, attr), cq

    def me(self, qp: Any, psn: int) -> dict:
        return {"qpn": qp.qp_num, "psn": psn, "lid": self.lid, "gid": self.gid}

    def connect(self, qp: Any, my_psn: int, peer: dict) -> None:
        """INIT -> RTR -> RTS against the peer's (qpn, psn, lid, gid)."""
        pv = self.pv
        try:
            attr = pv.qp.QPAttr(port_num=self.port)
            attr.path_mtu = self.mtu
            attr.dest_qp_num = int(peer["qpn"])
            attr.rq_psn = int(peer["psn"])
            attr.max_dest_rd_atomic = 1
            attr.min_rnr_timer = 12
            gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(peer["gid"]), sgid_index=self.gid_index)
            attr.ah_attr = pv.addr.AHAttr(dlid=int(peer["lid"]), port_num=self.port, is_global=1, grh=gr)
            qp.to_rtr(attr)
            attr.sq_psn = my_psn
            attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.max_rd_atomic = 14, 7, 7, 1
            qp.to_rts(attr)
        except pv.pyverbs_error.PyverbsError as e:
            raise SetupError(f"RC QP connection on {self.name} failed: {e}") from None


class RdmaKind(LinkKind):
    name = "rdma"

    def __init__(self, ctx: LinkContext) -> None:
        super().__init__(ctx)
        self.dev = _Device()  # FatalError with the reason where no device can be used
        self.layout = SlotLayout(ctx.slot_bytes, 2 * ctx.num_slots)  # slots.slot_of: two sets
        self.sendbuf = torch.zeros(self.layout.nbytes, dtype=torch.uint8)  # registered once
        self.send_mr = self.dev.register(self.sendbuf, remote=False)

    def offer(self) -> dict:
        return {"device": self.dev.name}

    def accept(self, sock: socket.socket, epoch: int, peer: str, offer: dict) -> tuple[object, dict]:
        slots = torch.zeros(self.layout.nbytes, dtype=torch.uint8)  # fresh per epoch: no stale writer
        mr = self.dev.register(slots, remote=True)
        qp, cq = self.dev.qp(self.layout.num_slots)
        psn = random.getrandbits(24)
        desc = {**self.dev.me(qp, psn), "addr": slots.data_ptr(), "rkey": mr.rkey}
        return (slots, mr, qp, cq, psn), desc

    def dial(self, sock: socket.socket, epoch: int, peer: str, desc: dict) -> tuple[TxLink, dict]:
        qp, cq = self.dev.qp(self.layout.num_slots)
        psn = random.getrandbits(24)
        self.dev.connect(qp, psn, desc)
        tx = RdmaTx(sock, peer, epoch, self, qp, cq, int(desc["addr"]), int(desc["rkey"]))
        return tx, self.dev.me(qp, psn)

    def finish_accept(self, state: object, sock: socket.socket, epoch: int, peer: str, confirm: dict) -> RxLink:
        slots, mr, qp, cq, psn = cast(_Accepted, state)
        self.dev.connect(qp, psn, confirm)
        lay = self.layout
        payload = [slots[lay.payload_offset(j): lay.payload_offset(j) + lay.slot_bytes] for j in range(lay.num_slots)]
        headers = [byte_view(slots[lay.header_offset(j): lay.header_offset(j) + HEADER_AREA])
                   for j in range(lay.num_slots)]
        return RdmaRx(sock, peer, epoch, payload, headers, self.ctx.mismatch, self, (slots, mr, qp, cq))

    def discard(self, state: object) -> None:
        slots, mr, qp, cq, _ = cast(_Accepted, state)
        for r in (qp, cq, mr):
            r.close()

    def close(self) -> None:
        self.send_mr.close()
        self.dev.pd.close()
        self.dev.ctx.close()


def _poll(link: Any, cq: Any, timeout_s: float, on_wc) -> None:
    """Poll the CQ until a completion arrives or `timeout_s` passes; the side channel is
    checked in between (EOF of a dead neighbour, FATAL, abort)."""
    deadline = time.monotonic() + timeout_s
    spins = 0
    while True:
        n, wcs = cq.poll(16)
        for wc in wcs[:n]:
            err = classify(wc.status, wc.vendor_err, f" on the link with the {link.peer}")
            if err is not None:
                if isinstance(err, RecoverableError):
                    err = RecoverableError(link.peer, err.reason)
                raise err
            on_wc(wc)
        if n or time.monotonic() >= deadline:
            return
        spins += 1
        if spins > 64:  # back off to the side channel, which also sleeps
            link.side.read(min(0.0002, max(0.0, deadline - time.monotonic())))


class RdmaTx(OneSidedTx):
    kind = "rdma"

    def __init__(self, sock: socket.socket, peer: str, epoch: int, kind: RdmaKind, qp: Any, cq: Any,
                 remote_addr: int, rkey: int) -> None:
        super().__init__(sock, peer, epoch, kind.ctx.num_slots)
        self.k, self.qp, self.cq, self.remote, self.rkey = kind, qp, cq, remote_addr, rkey
        lay = kind.layout
        self._slots = [kind.sendbuf[lay.payload_offset(j): lay.payload_offset(j) + lay.slot_bytes]
                       for j in range(lay.num_slots)]
        pv = kind.dev.pv
        for j in range(lay.num_slots):  # credits arrive as SEND_WITH_IMM: one receive WR each
            qp.post_recv(pv.wr.RecvWR(wr_id=j, num_sge=0))

    def _staging(self, slot: int) -> torch.Tensor:
        return self._slots[slot]

    def _post(self, slot: int, hdr: ChunkHeader, imm: int) -> None:
        lay, pv = self.k.layout, self.k.dev.pv
        base = self.k.sendbuf.data_ptr()
        raw = hdr.pack()
        self.k.sendbuf[lay.header_offset(slot): lay.header_offset(slot) + len(raw)].copy_(
            torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        sge = pv.wr.SGE(base + lay.header_offset(slot), HEADER_AREA + hdr.nbytes, self.k.send_mr.lkey)
        e = pv.enums
        wr = pv.wr.SendWR(wr_id=slot, opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM, num_sge=1, sg=[sge],
                          imm_data=imm, send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(self.rkey, self.remote + lay.header_offset(slot))
        self.qp.post_send(wr)

    def _poll_tx(self, timeout_s: float) -> None:
        e, pv = self.k.dev.pv.enums, self.k.dev.pv

        def on_wc(wc: Any) -> None:
            if wc.opcode == e.IBV_WC_RDMA_WRITE:
                self.win.write_done(self.epoch, wc.wr_id)
            elif wc.opcode == e.IBV_WC_RECV:
                self.win.credit(self.epoch, wc.imm_data)  # a credit's immediate is its slot
                self.qp.post_recv(pv.wr.RecvWR(wr_id=wc.wr_id, num_sge=0))

        _poll(self, self.cq, timeout_s, on_wc)

    def close(self) -> None:
        super().close()
        self.qp.close()
        self.cq.close()


class RdmaRx(OneSidedRx):
    kind = "rdma"

    def __init__(self, sock: socket.socket, peer: str, epoch: int, payload: list[torch.Tensor],
                 headers: list[memoryview], mismatch, kind: RdmaKind, res: tuple) -> None:
        super().__init__(sock, peer, epoch, payload, headers, mismatch)
        self.k, self.res = kind, res
        self.qp, self.cq = res[2], res[3]
        pv = kind.dev.pv
        for j in range(len(payload)):  # each WRITE_WITH_IMM consumes one receive WR
            self.qp.post_recv(pv.wr.RecvWR(wr_id=j, num_sge=0))

    def _poll_rx(self, timeout_s: float) -> None:
        e, pv = self.k.dev.pv.enums, self.k.dev.pv

        def on_wc(wc: Any) -> None:
            if wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM:
                self.win.landed(imm_slot(wc.imm_data, self.C), wc.imm_data)
                self.qp.post_recv(pv.wr.RecvWR(wr_id=wc.wr_id, num_sge=0))

        _poll(self, self.cq, timeout_s, on_wc)

    def _credit(self, slot: int, imm: int) -> None:
        pv, e = self.k.dev.pv, self.k.dev.pv.enums
        wr = pv.wr.SendWR(wr_id=1 << 16 | slot, opcode=e.IBV_WR_SEND_WITH_IMM, num_sge=0, imm_data=slot,
                          send_flags=e.IBV_SEND_SIGNALED)  # signalled, so the send queue drains
        try:
            self.qp.post_send(wr)
        except pv.pyverbs_error.PyverbsError as err:
            raise RecoverableError(self.peer, f"cannot return a credit: {err}") from None

    def close(self) -> None:
        super().close()
        for r in (self.qp, self.cq, self.res[1]):
            r.close()
