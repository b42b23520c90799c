"""The FTAR handshake under hostile input (issue 10 §3): what an unauthenticated peer learns,
message size caps, the total handshake deadline and the connection limit. Raw sockets
against a real FTAR endpoint's listener on loopback."""
from __future__ import annotations

import json
import socket
import struct
import threading
import time

import pytest

from lightning_ft.ftar.engine import FTAR, FTARSettings
from lightning_ft.ftar.transport import endpoint as tcp
from lightning_ft.ftar.transport.base import mac

SECRET = "handshake-test-secret-0123"


def _ftar(rid: int) -> FTAR:
    return FTAR("job", rid, 0, SECRET, FTARSettings(chunk_bytes=1 << 12, num_chunks=2, transport="tcp",
                                                connect_timeout_s=5.0))


@pytest.fixture
def listener():
    f = _ftar(0)
    yield f.transport
    f.close()


def _dial(t) -> socket.socket:
    host, port = t.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def _send(s: socket.socket, obj) -> None:
    raw = json.dumps(obj).encode()
    s.sendall(struct.pack("!I", len(raw)) + raw)


def _recv(s: socket.socket) -> dict:
    head = b""
    while len(head) < 4:
        chunk = s.recv(4 - len(head))
        if not chunk:
            raise ConnectionResetError("closed")
        head += chunk
    (n,) = struct.unpack("!I", head)
    body = b""
    while len(body) < n:
        chunk = s.recv(n - len(body))
        if not chunk:
            raise ConnectionResetError("closed")
        body += chunk
    return json.loads(body)


def _closed(s: socket.socket, within_s: float) -> bool:
    s.settimeout(within_s)
    try:
        while True:
            data = s.recv(1 << 16)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def test_a_peer_without_the_secret_learns_nothing(listener):
    s = _dial(listener)
    _send(s, {"job": "another-job", "epoch": 5, "replica": 3, "rank": 1, "index": 0, "nonce": "n"})
    challenge = _recv(s)
    assert set(challenge) == {"ok", "replica", "rank", "nonce", "mac"}  # the same for everyone
    _send(s, {"mac": "0" * 64})
    assert _recv(s) == {"ok": False, "error": "authentication failed"}
    assert any("job mismatch: we are 'job'" in r and "authentication failed" in r for r in listener.refusals)
    s.close()
    # a wrong rank or a stale epoch is explained only to a peer that proved the secret
    s = _dial(listener)
    _send(s, {"job": "job", "epoch": 5, "replica": 3, "rank": 1, "index": 0, "nonce": "n"})
    challenge = _recv(s)
    _send(s, {"mac": mac(listener.ident.secret, "dialer", challenge["nonce"], "job", 5, 3, 1, 0)})
    assert _recv(s) == {"ok": False, "error": "replica 3 rank 1 of job 'job': rank mismatch (ring of rank 0)"}
    s.close()


@pytest.mark.parametrize("payload", [b"\xff" * 4 + b"x", struct.pack("!I", tcp.HANDSHAKE_MAX_BYTES + 1) + b"{}",
                                     struct.pack("!I", 2) + b"[]", struct.pack("!I", 3) + b"{{{"])
def test_oversized_or_malformed_hello_is_refused_without_detail(listener, payload):
    s = _dial(listener)
    s.sendall(payload)
    assert _recv(s) == {"ok": False, "error": "authentication failed"}
    assert _closed(s, 5)


def test_a_trickling_handshake_is_cut_at_the_total_deadline(listener):
    s = _dial(listener)
    raw = json.dumps({"job": "job", "epoch": 0, "replica": 1, "rank": 0, "index": 0, "nonce": "n"}).encode()
    msg = struct.pack("!I", len(raw)) + raw
    t0 = time.monotonic()
    cut = False
    for b in msg:  # one byte every 0.5 s: each recv is quick, the whole is too slow
        try:
            s.sendall(bytes([b]))
        except OSError:
            cut = True
            break
        if _closed(s, 0.5):
            cut = True
            break
    elapsed = time.monotonic() - t0
    assert cut, "the listener kept a trickling handshake open"
    assert tcp.HANDSHAKE_TIMEOUT_S - 0.5 <= elapsed <= tcp.HANDSHAKE_TIMEOUT_S + 5, elapsed
    assert any("handshake failed" in r and "not complete within" in r for r in listener.refusals)


def test_connections_beyond_the_limit_are_closed_and_service_continues(listener):
    idle = [_dial(listener) for _ in range(tcp.MAX_HANDSHAKES)]
    time.sleep(0.3)  # every one holds a handshake slot
    extra = _dial(listener)
    assert _closed(extra, 3), "a connection beyond the limit must be closed at once"
    assert any(f"more than {tcp.MAX_HANDSHAKES} handshakes" in r for r in listener.refusals)
    for s in idle:
        s.close()
    deadline = time.monotonic() + 10
    while True:  # the slots come back: a real peer gets through
        s = _dial(listener)
        _send(s, {"job": "job", "epoch": 0, "replica": 1, "rank": 0, "index": 0, "nonce": "n"})
        try:
            challenge = _recv(s)
            break
        except (ConnectionResetError, OSError):
            s.close()
            assert time.monotonic() < deadline
            time.sleep(0.1)
    _send(s, {"mac": mac(listener.ident.secret, "dialer", challenge["nonce"], "job", 0, 1, 0, 0)})
    assert _recv(s) == {"ok": False, "error": "replica 1 rank 0 of job 'job': the left neighbour offered no link kind"}
    s.close()


def test_a_fatal_message_is_capped_at_the_receiver():
    from lightning_ft.ftar.transport.base import KIND_FATAL, ChunkHeader, FatalError, job_hash

    fs = [_ftar(0), _ftar(1)]
    try:
        errors = {}

        def connect(i):
            try:
                fs[i].reconfigure(1, [f.address for f in fs], i)
            except Exception as e:  # noqa: BLE001 - asserted below
                errors[i] = e

        th = [threading.Thread(target=connect, args=(i,)) for i in range(2)]
        for x in th:
            x.start()
        for x in th:
            x.join(15)
        assert not errors
        claimed = 1 << 40  # a header may claim anything; the receiver reads at most the cap
        hdr = ChunkHeader(KIND_FATAL, job_hash("job"), 1, 0, 0, 0, 0, 1, claimed, 0)
        fs[0].transport.tx.sock.sendall(hdr.pack() + b"x" * (tcp.FATAL_MAX_BYTES + 100))
        fs[0].transport.tx.sock.shutdown(socket.SHUT_WR)
        want = ChunkHeader(1, job_hash("job"), 1, 0, 0, 0, 0, 1, 16, 0)
        with pytest.raises(FatalError) as e:
            fs[1].transport.rx.recv(want, timeout_s=5)
        assert str(e.value).startswith("x" * tcp.FATAL_MAX_BYTES)
        assert f"[{claimed - tcp.FATAL_MAX_BYTES} more bytes not read]" in str(e.value)
    finally:
        for f in fs:
            f.close()
