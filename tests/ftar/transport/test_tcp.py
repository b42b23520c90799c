"""The tcp link's read-ahead (transport/tcp.py): a receive link told the all-reduce's chunks
(`expect`) takes them off the socket while the control thread is elsewhere, adds reduce-scatter
chunks into the user's buffer and writes all-gather chunks there; errors reach the control
thread at its next wait, as they did when it read itself."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from lightning_ft.ftar.engine import FTAR
from lightning_ft.ftar.transport.base import KIND_DATA, ChunkHeader, FatalError, RecoverableError, byte_view
from lightning_ft.ftar.transport.tcp import TcpRx, TcpTx

S = 1 << 20


def _hdr(seq: int, step: int, chunk: int, nbytes: int, total: int, dtype: int = 1) -> ChunkHeader:
    return ChunkHeader(KIND_DATA, 7, 1, seq, 0, step, chunk, dtype, nbytes, total)


def _mismatch(got: ChunkHeader, want: ChunkHeader) -> None:
    FTAR._mismatch(None, got, want)  # type: ignore[arg-type]  # the engine's messages, no state needed


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A loopback TCP connection (a socketpair is a Unix socket: its shutdowns reach the peer)."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    return a, b


@pytest.fixture
def link():
    a, b = _tcp_pair()
    tx = TcpTx(a, "right neighbour", lambda: [torch.empty(S, dtype=torch.uint8)])
    rx = TcpRx(b, "left neighbour", [torch.empty(S, dtype=torch.uint8) for _ in range(2)], _mismatch)
    yield tx, rx
    tx.close()
    rx.close()


def _plan(user: torch.Tensor, n: int):
    """n chunks of S bytes: the first half reduce-scatter (added), the rest all-gather (written)."""
    per = S // 4
    out = []
    for k in range(n):
        dest = user[k * per:(k + 1) * per]
        out.append((_hdr(1, k, 0, S, user.numel()), dest, byte_view(dest), k < n // 2))
    return out


def test_the_reader_empties_the_socket_while_the_control_thread_does_nothing(link):
    tx, rx = link
    n = 32  # 32 MiB: far more than the socket buffers hold
    user = torch.ones(n * S // 4)
    plan = _plan(user, n)
    rx.expect(plan)
    data = [torch.full((S // 4,), float(k)) for k in range(n)]
    tickets = [tx.send(h, d, 5.0) for (h, _, _, _), d in zip(plan, data, strict=True)]
    tx.wait_sent(tickets[-1], 10.0)  # every byte left the sender with no receive call made
    for k, (h, dest, _, reduce) in enumerate(plan):
        (rx.recv_reduce if reduce else rx.recv_into)(h, dest, 5.0)
        want = 1.0 + k if reduce else float(k)
        assert torch.equal(dest, torch.full_like(dest, want)), k


def test_a_chunk_not_expected_is_a_fatal_mismatch_at_the_next_wait(link):
    tx, rx = link
    user = torch.zeros(S // 2)
    plan = _plan(user, 2)
    rx.expect(plan)
    wrong = _hdr(1, 5, 0, S, user.numel())  # another step than the reader expects
    tx.send(wrong, torch.zeros(S // 4), 5.0)
    with pytest.raises(FatalError, match="out of step.*expected all-reduce #1 partition 0 step 0"):
        rx.recv_reduce(plan[0][0], plan[0][1], 5.0)


def test_a_fatal_record_reaches_the_control_thread(link):
    tx, rx = link
    user = torch.zeros(S // 2)
    plan = _plan(user, 2)
    rx.expect(plan)
    tx.send_fatal(plan[0][0], "ranks disagree on the tensor size")
    with pytest.raises(FatalError, match="ranks disagree on the tensor size"):
        rx.recv_reduce(plan[0][0], plan[0][1], 5.0)


def test_silence_times_out_and_an_abort_interrupts_the_wait(link):
    tx, rx = link
    user = torch.zeros(S // 2)
    plan = _plan(user, 2)
    rx.expect(plan)
    t0 = time.monotonic()
    with pytest.raises(RecoverableError, match="timed out after 0.2s waiting for a chunk"):
        rx.recv_reduce(plan[0][0], plan[0][1], 0.2)
    assert time.monotonic() - t0 < 1.0
    threading.Timer(0.1, rx.abort, args=("the quorum changed",)).start()
    t0 = time.monotonic()
    with pytest.raises(RecoverableError, match="aborted: the quorum changed"):
        rx.recv_reduce(plan[0][0], plan[0][1], 5.0)  # the same chunk, still awaited
    assert time.monotonic() - t0 < 1.0


def test_the_neighbour_closing_is_a_lost_connection(link):
    tx, rx = link
    user = torch.zeros(S // 2)
    plan = _plan(user, 2)
    rx.expect(plan)
    tx.send(plan[0][0], torch.ones(S // 4), 5.0)
    tx.wait_sent(1, 5.0)
    tx.close()
    rx.recv_reduce(plan[0][0], plan[0][1], 5.0)  # what landed before the close is good
    assert torch.equal(plan[0][1], torch.ones(S // 4))
    with pytest.raises(RecoverableError, match="connection lost"):
        rx.recv_into(plan[1][0], plan[1][1], 5.0)


def test_without_a_plan_the_caller_reads_itself(link):
    tx, rx = link
    h = _hdr(1, 0, 1, S, S // 4)
    tx.send(h, torch.full((S // 4,), 3.0), 5.0)
    got = rx.recv(h, 5.0)  # the private slot of chunk 1
    assert torch.equal(got.view(torch.float32), torch.full((S // 4,), 3.0))
    dest = torch.zeros(S // 4)
    h2 = _hdr(1, 1, 0, S, S // 4)
    tx.send(h2, torch.full((S // 4,), 2.0), 5.0)
    rx.recv_reduce(h2, dest, 5.0)
    assert torch.equal(dest, torch.full((S // 4,), 2.0))


def test_after_quiesce_nothing_more_lands_in_the_users_memory(link):
    tx, rx = link
    user = torch.zeros(S // 2)
    plan = _plan(user, 2)
    rx.expect([(h, d, b, False) for h, d, b, _ in plan])  # two all-gather chunks, straight into `user`
    payload = byte_view(torch.ones(S // 4))
    tx.sock.sendall(plan[0][0].pack() + bytes(payload[:S // 2]))  # half of the first chunk
    time.sleep(0.2)  # the reader is inside its receive, writing `user` as bytes come
    rx.quiesce(5.0)  # a failed all-reduce: the engine returns the Work only after this
    before = user.clone()
    assert before[:S // 8].eq(1).all() and before[S // 8:].eq(0).all()  # what came before stays
    tx.sock.sendall(bytes(payload[S // 2:]) + plan[1][0].pack() + bytes(payload))
    time.sleep(0.2)
    assert torch.equal(user, before)
    with pytest.raises(RecoverableError, match="connection lost"):
        rx.recv_into(plan[0][0], plan[0][1], 1.0)
