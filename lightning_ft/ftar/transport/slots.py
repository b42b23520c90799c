"""Slots and credits of the one-sided ring protocol, as pure state machines (docs/GUIDE.md, "FTAR transports").

A one-sided link (shm, rdma) is one direction between two ring neighbours in one epoch.
The receiver owns 2C *slots*, each a header area and S payload bytes, registered once per
epoch; the sender writes chunk j of ring step s into slot `slot_of(s, j, C)` with an
immediate value that carries (epoch, seq, step, chunk), and the receiver learns of it from
a completion. A slot is written again only after the receiver has reduced it and returned
its *credit*.

    sender slot:   FREE --post--> POSTED --write done--> AWAITING --credit--> FREE
                                    \\--credit first--> CREDITED --write done--> FREE
    receiver slot: FREE --landed--> FULL --take--> HELD --release (credit)--> FREE

Completions may arrive in any order (a credit before the local write completion, a later
chunk before an earlier one); completions of an older epoch are counted and dropped; a
peer that breaks the rules (a write into a slot it holds no credit for, a duplicate
credit) raises `ProtocolError`; a lost peer breaks the window so that every later call
raises. Nothing here does I/O: the transports feed events in and act on the answers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

HEADER_AREA = 64
"""Bytes reserved in front of each slot's payload for the packed chunk header."""


class ProtocolError(RuntimeError):
    """The peer broke the slot/credit protocol (or a window was used after it broke)."""


def pack_imm(epoch: int, seq: int, step: int, chunk: int) -> int:
    """The 32-bit immediate of a write: the low 8 bits of epoch, seq, step and chunk."""
    return ((epoch & 0xFF) << 24) | ((seq & 0xFF) << 16) | ((step & 0xFF) << 8) | (chunk & 0xFF)


def unpack_imm(imm: int) -> tuple[int, int, int, int]:
    """(epoch, seq, step, chunk), each modulo 256."""
    return (imm >> 24) & 0xFF, (imm >> 16) & 0xFF, (imm >> 8) & 0xFF, imm & 0xFF


def imm_epoch(imm: int) -> int:
    return (imm >> 24) & 0xFF


def slot_of(step: int, chunk: int, num_chunks: int) -> int:
    """The receiver slot of chunk `chunk` of ring step `step`: two sets of C slots, by the
    parity of the step. A rank takes its next-hop slot (to reduce straight into it) while
    it still holds the chunk it reduces; with one set, every rank of the ring could wait
    for its right neighbour's credit at the same step (a cycle). With two, a write of step
    s+1 needs only the neighbour's progress at step s-1, so the waits end at step 0."""
    return (step & 1) * num_chunks + chunk


def imm_slot(imm: int, num_chunks: int) -> int:
    """The slot a write with immediate `imm` went to (see slot_of)."""
    return slot_of((imm >> 8) & 0xFF, imm & 0xFF, num_chunks)


@dataclass(frozen=True)
class SlotLayout:
    """Where slot j's header and payload lie in a registered buffer of `nbytes` bytes."""

    slot_bytes: int
    num_slots: int

    def __post_init__(self) -> None:
        if self.slot_bytes <= 0 or self.num_slots <= 0:
            raise ValueError(f"invalid slot layout: slot_bytes={self.slot_bytes} num_slots={self.num_slots}")

    @property
    def stride(self) -> int:
        return HEADER_AREA + -(-self.slot_bytes // HEADER_AREA) * HEADER_AREA

    @property
    def nbytes(self) -> int:
        return self.stride * self.num_slots

    def header_offset(self, slot: int) -> int:
        self._check(slot)
        return slot * self.stride

    def payload_offset(self, slot: int) -> int:
        return self.header_offset(slot) + HEADER_AREA

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ProtocolError(f"slot {slot} out of range for {self.num_slots} slots")


FREE, POSTED, AWAITING, CREDITED, FULL, HELD = "free", "posted", "awaiting-credit", "credited", "full", "held"


class _Window:
    def __init__(self, epoch: int, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"a window needs at least one slot, got {num_slots}")
        self.epoch = epoch
        self.state = [FREE] * num_slots
        self.stale = 0
        """Completions of an older epoch that were dropped."""
        self.broken: Optional[str] = None

    def _live(self, slot: int) -> None:
        if self.broken is not None:
            raise ProtocolError(self.broken)
        if not 0 <= slot < len(self.state):
            raise ProtocolError(f"slot {slot} out of range for {len(self.state)} slots")

    def _current(self, epoch: int) -> bool:
        if epoch != self.epoch:
            self.stale += 1
            return False
        return True

    def peer_lost(self, reason: str) -> None:
        """The peer died or the link was aborted: every later call raises `reason`."""
        if self.broken is None:
            self.broken = reason


class TxWindow(_Window):
    """The sender side: which receiver slots we hold credits for, and which of our writes
    are complete. Tickets number the writes 1, 2, ...; `done_through` is the highest ticket
    such that every write up to it has completed locally (its source memory is free)."""

    def __init__(self, epoch: int, num_slots: int) -> None:
        super().__init__(epoch, num_slots)
        self.ticket = [0] * num_slots
        self.posted = 0
        self._done: set[int] = set()
        self.done_through = 0

    def can_write(self, slot: int) -> bool:
        self._live(slot)
        return self.state[slot] == FREE

    def post(self, slot: int) -> int:
        """A write into `slot` is posted; returns its ticket."""
        if not self.can_write(slot):
            raise ProtocolError(f"slot {slot} is {self.state[slot]}: no credit to write it")
        self.posted += 1
        self.state[slot] = POSTED
        self.ticket[slot] = self.posted
        return self.posted

    def write_done(self, epoch: int, slot: int) -> bool:
        """The local completion of the write in `slot`. False if it belongs to an older epoch."""
        if not self._current(epoch):
            return False
        self._live(slot)
        st = self.state[slot]
        if st == POSTED:
            self.state[slot] = AWAITING
        elif st == CREDITED:
            self.state[slot] = FREE
        else:
            raise ProtocolError(f"write completion for slot {slot}, which is {st}")
        self._done.add(self.ticket[slot])
        while self.done_through + 1 in self._done:
            self.done_through += 1
            self._done.discard(self.done_through)
        return True

    def credit(self, epoch: int, slot: int) -> bool:
        """The receiver reduced `slot` and returned it. False if from an older epoch."""
        if not self._current(epoch):
            return False
        self._live(slot)
        st = self.state[slot]
        if st == AWAITING:
            self.state[slot] = FREE
        elif st == POSTED:
            self.state[slot] = CREDITED
        else:
            raise ProtocolError(f"credit for slot {slot}, which is {st} (a duplicate credit)")
        return True

    def sent(self, ticket: int) -> bool:
        """Whether write `ticket` and every earlier one completed locally."""
        if self.broken is not None:
            raise ProtocolError(self.broken)
        return self.done_through >= ticket

    def idle(self) -> bool:
        """Every slot is free: nothing posted, every credit back."""
        return all(s == FREE for s in self.state)


class RxWindow(_Window):
    """The receiver side: which slots hold a landed chunk (and its immediate)."""

    def __init__(self, epoch: int, num_slots: int) -> None:
        super().__init__(epoch, num_slots)
        self.imm = [0] * num_slots

    def landed(self, slot: int, imm: int) -> bool:
        """A write with immediate `imm` completed into `slot`. False (dropped) if the
        immediate is of another epoch; a write into a slot we did not credit raises."""
        if imm_epoch(imm) != self.epoch & 0xFF:
            self.stale += 1
            return False
        self._live(slot)
        if self.state[slot] != FREE:
            raise ProtocolError(f"a write landed in slot {slot}, which is {self.state[slot]}: "
                                "the sender wrote without a credit")
        self.state[slot] = FULL
        self.imm[slot] = imm
        return True

    def ready(self, slot: int) -> bool:
        self._live(slot)
        return self.state[slot] == FULL

    def take(self, slot: int, want_imm: int) -> bool:
        """Hold the chunk in `slot` for reducing. False if it has not landed yet (a later
        slot may have); `ProtocolError` if what landed is not the chunk we expect."""
        if not self.ready(slot):
            if self.state[slot] == HELD:
                raise ProtocolError(f"slot {slot} is already held")
            return False
        if self.imm[slot] != want_imm:
            got, want = unpack_imm(self.imm[slot]), unpack_imm(want_imm)
            raise ProtocolError(f"slot {slot} holds chunk (epoch, seq, step, chunk) = {got}, expected {want}")
        self.state[slot] = HELD
        return True

    def release(self, slot: int) -> None:
        """We are done with `slot`: its credit goes back to the sender."""
        self._live(slot)
        if self.state[slot] != HELD:
            raise ProtocolError(f"release of slot {slot}, which is {self.state[slot]}")
        self.state[slot] = FREE
