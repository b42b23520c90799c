"""Tests for the catch-up transport (lightning_ft/replica/catchup.py, docs/ARCHITECTURE.md "Catch-up")."""
from __future__ import annotations

import hashlib
import hmac
import http.client
import socket
import threading
import time

import pytest
import torch

from lightning_ft.replica.catchup.http import CatchupError, StateServer, _request_headers, fetch_state

SECRET = b"job-secret"


@pytest.fixture
def server():
    srv = StateServer(SECRET, name="r0/rank0")
    yield srv
    srv.close()


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w32": torch.randn(64, 33, generator=g),
        "wbf16": torch.randn(17, 5, generator=g).to(torch.bfloat16),
        "wfp16": torch.randn(3, 7, 2, generator=g).to(torch.float16),
        "idx64": torch.randint(-(2**40), 2**40, (11,), generator=g, dtype=torch.int64),
        "step": torch.tensor(41, dtype=torch.int64),  # 0-dim
        "lr0": torch.tensor(3e-4, dtype=torch.float32),  # 0-dim
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
    }


def _like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Preallocated destinations filled with junk, so an unwritten byte shows."""
    return {n: torch.full_like(t, 7) if t.dtype != torch.bool else torch.zeros_like(t) for n, t in state.items()}


def _bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(
        a[n].shape == b[n].shape and a[n].dtype == b[n].dtype
        and torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8)) for n in a)


def _wait_completed(server: StateServer, want: set[str], timeout_s: float = 5.0) -> set[str]:
    """The server counts a fetcher once its ACK arrives, just after fetch_state returns."""
    deadline = time.monotonic() + timeout_s
    while server.completed() != want and time.monotonic() < deadline:
        time.sleep(0.001)
    return server.completed()


META = {"step": 41, "scheduler": {"last_epoch": 41, "_last_lr": [0.0003]}, "rng": [1, 2, 3, 2**63 - 1],
        "groups": [{"lr": 3e-4, "betas": [0.9, 0.95]}]}


def test_roundtrip_all_dtypes_bitwise_with_meta(server):
    state = _state()
    state["wbf16"][0, 0] = float("nan")  # bit patterns survive, not just values
    server.publish(41, state, META, expected={"r1/rank0"})
    into = _like(state)
    meta, stats = fetch_state(server.address, 41, into, SECRET, "r1/rank0")
    assert _bitwise_equal(into, state)
    assert meta == META
    assert stats["bytes"] == sum(t.numel() * t.element_size() for t in state.values())
    assert stats["seconds"] > 0 and stats["gbps"] > 0
    assert _wait_completed(server, {"r1/rank0"}) == {"r1/rank0"}


def test_wrong_secret_is_refused_as_authentication(server):
    server.publish(3, _state(), {})
    with pytest.raises(CatchupError, match="authentication") as e:
        fetch_state(server.address, 3, _like(_state()), b"other-secret", "r1/rank0")
    assert "same job secret" in str(e.value)
    assert server.completed() == set()


def test_stale_timestamp_and_replayed_nonce_are_refused(server):
    server.publish(3, _state(), {})

    def get(nonce: str, stamp: str) -> int:
        tag = hmac.new(SECRET, f"3|f|{nonce}|{stamp}".encode(), hashlib.sha256).hexdigest()
        host, port = server.address.split(":")
        c = http.client.HTTPConnection(host, int(port), timeout=5)
        c.request("GET", "/state/3", headers={"X-LFT-Fetcher": "f", "X-LFT-Nonce": nonce,
                                              "X-LFT-Time": stamp, "X-LFT-Auth": tag})
        r = c.getresponse()
        r.read()
        c.close()
        return r.status

    assert get("aa", str(int(time.time()) - 120)) == 401
    assert get("bb", str(int(time.time()))) == 200
    assert get("bb", str(int(time.time()))) == 401  # same nonce again


def test_wrong_version_names_the_servers_version(server):
    server.publish(13, _state(), {})
    with pytest.raises(CatchupError, match=r"\(version 12\) failed: server has version 13; .*moved on"):
        fetch_state(server.address, 12, _like(_state()), SECRET, "r1/rank0")


def test_nothing_published_or_retired_fails(server):
    with pytest.raises(CatchupError, match="nothing published"):
        fetch_state(server.address, 1, _like(_state()), SECRET, "r1/rank0")
    server.publish(1, _state(), {})
    server.retire()
    with pytest.raises(CatchupError, match="nothing published"):
        fetch_state(server.address, 1, _like(_state()), SECRET, "r1/rank0")
    assert server.completed() == set()


@pytest.mark.parametrize("change, needle", [
    (lambda s: s.__setitem__("wbf16", torch.zeros(17, 5, dtype=torch.float16)), r"'wbf16': server has dtype bfloat16"),
    (lambda s: s.__setitem__("w32", torch.zeros(64, 34)), r"'w32': server has shape \[64, 33\]"),
    (lambda s: s.__setitem__("renamed", s.pop("mask")), r"#7 'renamed': server has name mask"),
    (lambda s: s.pop("mask"), r"server has 8 tensors, the local state 7 \(first unmatched: 'mask'\)"),
], ids=["dtype", "shape", "name", "count"])
def test_layout_mismatch_names_the_tensor(server, change, needle):
    state = _state()
    server.publish(5, state, {})
    into = _like(state)
    change(into)
    with pytest.raises(CatchupError, match=needle):
        fetch_state(server.address, 5, into, SECRET, "r1/rank0")
    assert server.completed() == set()


def test_closed_server_fails_fast_not_hangs():
    srv = StateServer(SECRET)
    srv.publish(1, _state(), {})
    address = srv.address
    srv.close()
    t0 = time.monotonic()
    with pytest.raises(CatchupError, match=f"catch-up from {address} \\(version 1\\) failed"):
        fetch_state(address, 1, _like(_state()), SECRET, "r1/rank0", timeout_s=2.0)
    assert time.monotonic() - t0 < 2.5


def test_silent_server_times_out_within_timeout():
    lst = socket.create_server(("127.0.0.1", 0))  # accepts (backlog) but never answers
    try:
        address = f"127.0.0.1:{lst.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(CatchupError, match="no progress for 0.5 s"):
            fetch_state(address, 1, _like(_state()), SECRET, "r1/rank0", timeout_s=0.5)
        assert time.monotonic() - t0 < 1.5
    finally:
        lst.close()


def test_publish_does_not_copy_fetch_sees_live_mutation(server):
    state = _state()
    server.publish(2, state, {}, expected={"r1/rank0"})
    state["w32"].mul_(2)  # before any fetch and before freeze: the publication is live
    into = _like(state)
    fetch_state(server.address, 2, into, SECRET, "r1/rank0")
    assert torch.equal(into["w32"], state["w32"])


def test_freeze_with_pending_fetcher_serves_pre_freeze_values(server):
    state = _state()
    snapshot = {n: t.clone() for n, t in state.items()}
    server.publish(2, state, META, expected={"r1/rank0", "r2/rank0"})
    fetch_state(server.address, 2, _like(state), SECRET, "r1/rank0")
    _wait_completed(server, {"r1/rank0"})
    assert server.freeze() >= 0
    assert server.frozen_bytes == sum(t.numel() * t.element_size() for t in state.values())
    for t in state.values():  # the owner's optimizer step
        t.copy_(torch.ones_like(t))
    into = _like(state)
    meta, _ = fetch_state(server.address, 2, into, SECRET, "r2/rank0")
    assert _bitwise_equal(into, snapshot)
    assert not _bitwise_equal(into, state)
    assert meta == META
    assert _wait_completed(server, {"r1/rank0", "r2/rank0"}) == {"r1/rank0", "r2/rank0"}


def test_freeze_after_all_expected_fetchers_is_free_and_drops_the_state(server):
    state = {f"w{i}": torch.randn(1 << 20) for i in range(4)}  # 16 MB
    server.publish(9, state, {}, expected={"r1/rank0"})
    fetch_state(server.address, 9, {n: torch.empty_like(t) for n, t in state.items()}, SECRET, "r1/rank0")
    assert _wait_completed(server, {"r1/rank0"}) == {"r1/rank0"}
    seconds = server.freeze()
    assert seconds < 5e-3
    assert server.frozen_bytes == 0
    assert server.freeze() < 5e-3  # idempotent
    with pytest.raises(CatchupError, match="no longer holds its tensors"):
        fetch_state(server.address, 9, {n: torch.empty_like(t) for n, t in state.items()}, SECRET, "late")


def test_freeze_cuts_off_a_stalled_fetcher_instead_of_blocking_training(server):
    server.freeze_wait_s = 0.2
    state = {"w": torch.randn(8 << 20)}  # 32 MB: more than the loopback socket buffers hold
    snapshot = state["w"].clone()
    server.publish(1, state, {}, expected={"stalled", "r2"})
    host, port = server.address.split(":")
    with socket.create_connection((host, int(port)), timeout=5) as stalled:  # asks, then never reads
        headers = "".join(f"{k}: {v}\r\n" for k, v in _request_headers(SECRET, 1, "stalled").items())
        stalled.sendall(f"GET /state/1 HTTP/1.0\r\n{headers}\r\n".encode())
        time.sleep(0.3)  # the server fills the socket buffers and blocks in a chunk send
        t0 = time.monotonic()
        server.freeze()
        waited = time.monotonic() - t0
        state["w"].add_(1.0)
    assert 0.15 < waited < 1.5  # it waited freeze_wait_s for the stalled send, then shut it down
    into = {"w": torch.empty_like(snapshot)}
    fetch_state(server.address, 1, into, SECRET, "r2")
    assert torch.equal(into["w"], snapshot)
    assert _wait_completed(server, {"r2"}) == {"r2"}


def test_freeze_without_publication_is_a_noop(server):
    assert server.freeze() < 5e-3
    assert server.frozen_bytes == 0


def test_concurrent_fetchers_all_get_correct_data(server):
    state = {f"w{i}": torch.randn(1 << 19) for i in range(4)}  # 8 MB
    server.publish(4, state, {"step": 4}, expected={f"r{i}" for i in range(4)})
    intos = [{n: torch.empty_like(t) for n, t in state.items()} for _ in range(4)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            fetch_state(server.address, 4, intos[i], SECRET, f"r{i}")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert errors == []
    assert all(_bitwise_equal(into, state) for into in intos)
    assert _wait_completed(server, {f"r{i}" for i in range(4)}) == {f"r{i}" for i in range(4)}


def test_fetch_racing_freeze_and_mutation_is_never_torn(server):
    state = {f"w{i}": torch.randn(1 << 19) for i in range(6)}  # 12 MB: the fetch spans the freeze
    into = {n: torch.empty_like(t) for n, t in state.items()}
    cloned_mb = []  # 12: froze before the fetch began, 0: after it ended, between: during it
    for round_ in range(20):
        snapshot = {n: t.clone() for n, t in state.items()}
        server.publish(round_, state, {"round": round_}, expected={"lagger"})
        result: dict = {}
        fetcher = threading.Thread(target=lambda result=result, round_=round_: result.update(
            out=fetch_state(server.address, round_, into, SECRET, "lagger")))
        fetcher.start()
        time.sleep(0.0005 * round_)  # freeze before, during and after the fetch
        server.freeze()
        cloned_mb.append(server.frozen_bytes >> 20)
        for t in state.values():
            t.add_(1.0)
        fetcher.join(20)
        assert result["out"][0] == {"round": round_}
        assert _bitwise_equal(into, snapshot), f"torn or mutated read in round {round_}"
    print(f"MB cloned by freeze per round: {cloned_mb}")


def test_throughput_100mb(server):
    state = {f"w{i}": torch.randn(25 << 18) for i in range(4)}  # 4 x 25 MB = 100 MiB fp32
    into = {n: torch.empty_like(t) for n, t in state.items()}
    server.publish(1, state, {}, expected={"a", "b"})
    fetch_state(server.address, 1, into, SECRET, "a")  # warm the destination pages
    _, stats = fetch_state(server.address, 1, into, SECRET, "b")
    print(f"catch-up loopback: {stats['bytes'] / 1e6:.0f} MB in {stats['seconds'] * 1e3:.0f} ms "
          f"= {stats['gbps']:.2f} GB/s")
    assert stats["bytes"] == 100 << 20
    assert _bitwise_equal(into, state)
    assert stats["gbps"] >= 0.5


def test_errors_say_whether_the_version_may_still_be_published():
    server = StateServer(b"k")
    try:
        t = {"a": torch.zeros(4)}
        with pytest.raises(CatchupError) as nothing:
            fetch_state(server.address, 3, t, b"k", "f", timeout_s=5)
        assert nothing.value.status == 404 and nothing.value.not_yet_published(3)
        server.publish(2, {"a": torch.ones(4)}, {})
        with pytest.raises(CatchupError) as older:
            fetch_state(server.address, 3, t, b"k", "f", timeout_s=5)
        assert older.value.server_version == 2 and older.value.not_yet_published(3)
        with pytest.raises(CatchupError) as newer:
            fetch_state(server.address, 1, t, b"k", "f", timeout_s=5)
        assert newer.value.server_version == 2 and not newer.value.not_yet_published(1)
    finally:
        server.close()


# -- authenticated responses (issue 10 §3) ----------------------------------------------------------


def test_refusal_before_authentication_says_nothing_more(server):
    server.publish(3, _state(), {})
    host, port = server.address.split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=5)
    c.request("GET", "/state/3", headers={"X-LFT-Fetcher": "f", "X-LFT-Nonce": "n", "X-LFT-Time": "1",
                                          "X-LFT-Auth": "00"})
    r = c.getresponse()
    assert r.status == 401 and r.read() == b'{"error": "authentication failed", "version": null}'
    c.close()  # HTTP/1.0: one request per connection
    c = http.client.HTTPConnection(host, int(port), timeout=5)
    c.request("GET", "/etc/passwd")
    r = c.getresponse()
    assert r.status == 400 and r.read() == b'{"error": "bad request", "version": null}'


def test_a_server_without_the_secret_never_writes_into_the_fetcher(monkeypatch):
    """An impostor that answers any request (it skips request authentication) but does not
    hold the secret: the header MAC fails before one tensor byte is written."""
    impostor = StateServer(b"not-the-job-secret", name="impostor")
    monkeypatch.setattr(impostor, "_check_auth", lambda version, headers: ("anyone", ""))
    try:
        state = _state()
        impostor.publish(3, state, {"step": 3})
        into = _like(state)
        before = {n: t.clone() for n, t in into.items()}
        with pytest.raises(CatchupError, match="not authentic \\(header MAC mismatch\\)") as e:
            fetch_state(impostor.address, 3, into, SECRET, "r1/rank0")
        assert not e.value.partial and _bitwise_equal(into, before)
        assert impostor.completed() == set(), "no ACK"
    finally:
        impostor.close()


class _Tamper:
    """A TCP proxy that flips one byte of the server's response at `offset` (counted from the
    first byte of the body, after the HTTP headers). It stands for a network between two
    hosts, so the fetches through it pass local=False: on one host a fetch asks the server for
    its same-host listener and goes around any proxy."""

    def __init__(self, upstream: str, offset: int, conns: int = 1, tamper: int = 0) -> None:
        """`conns` connections are forwarded; the `tamper`-th accepted one is altered."""
        self.upstream, self.offset = upstream, offset
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        for k in range(conns):
            threading.Thread(target=self._run, args=(k == tamper,), daemon=True).start()

    def _run(self, tamper: bool) -> None:
        try:
            self._forward(tamper)
        except OSError:  # the fetcher hung up after refusing the response
            pass

    def _forward(self, tamper: bool) -> None:
        client, _ = self.sock.accept()
        host, port = self.upstream.split(":")
        up = socket.create_connection((host, int(port)))
        threading.Thread(target=self._pipe, args=(client, up), daemon=True).start()
        seen, buf = -1, b""
        while True:
            data = up.recv(1 << 16)
            if not data:
                break
            if seen < 0:
                buf += data
                if b"\r\n\r\n" not in buf:
                    continue
                head, _, data = buf.partition(b"\r\n\r\n")
                client.sendall(head + b"\r\n\r\n")
                seen = 0
            data = bytearray(data)
            if tamper and seen <= self.offset < seen + len(data):
                data[self.offset - seen] ^= 0x01
            seen += len(data)
            client.sendall(data)
        client.close()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass


@pytest.mark.parametrize("where", ["header", "tensor"])
def test_a_response_altered_in_flight_is_refused(server, where):
    state = _state()
    server.publish(3, state, {"step": 3})
    header_len = len(server._pub.header)
    offset = 20 if where == "header" else header_len + 16 + 100  # inside the header / inside tensor w32
    proxy = _Tamper(server.address, offset)
    into = _like(state)
    with pytest.raises(CatchupError) as e:
        fetch_state(proxy.address, 3, into, SECRET, "r1/rank0", local=False)
    if where == "header":
        assert "header MAC mismatch" in str(e.value) and not e.value.partial
    else:  # the tensor bytes were written, but never acknowledged nor to be used: the replica restarts
        assert "body MAC mismatch" in str(e.value) and e.value.partial
    assert server.completed() == set()


def test_only_known_meta_keys_are_applied(server):
    from lightning_ft.replica.catchup.http import check_meta

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    theirs = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    theirs[0].update(lr=5e-4, betas=[0.8, 0.9], evil="rm -rf /", params=[99])
    meta = {"step": 7, "param_groups": theirs, "scheduler": None, "exec": "code"}
    state = _state()
    server.publish(7, state, meta)
    got, _ = fetch_state(server.address, 7, _like(state), SECRET, "r1/rank0", param_groups=opt.param_groups)
    assert set(got) == {"step", "param_groups", "scheduler"}
    assert got["param_groups"][0]["lr"] == 5e-4 and got["param_groups"][0]["betas"] == (0.8, 0.9)
    assert "evil" not in got["param_groups"][0] and "params" not in got["param_groups"][0]
    for bad, needle in (({"param_groups": []}, "has 0 param groups, ours 1"),
                        ({"param_groups": [{"lr": "fast"}]}, "key 'lr': server sent 'fast'"),
                        ({"param_groups": [{"betas": 0.9}]}, "key 'betas'"),
                        ({"param_groups": theirs, "step": "7"}, "not an integer"),
                        ({"param_groups": theirs, "callbacks": {"x": 1}}, "callbacks is a dict"),
                        ([1, 2], "not a mapping")):
        with pytest.raises(CatchupError, match=needle):
            check_meta(bad, opt.param_groups)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here); not run")
def test_cuda_state_is_served_and_fetched_through_host_memory(server):
    state = {"w": torch.randn(1000, device="cuda"), "b": torch.randn(7, dtype=torch.bfloat16, device="cuda")}
    server.publish(3, state, {})
    want = {n: t.cpu() for n, t in state.items()}
    state["w"].zero_()  # the publication is this version's bytes, copied at publish
    into = {n: torch.zeros_like(t) for n, t in state.items()}
    fetch_state(server.address, 3, into, SECRET, "a")
    assert all(t.is_cuda for t in into.values())
    assert _bitwise_equal({n: t.cpu() for n, t in into.items()}, want)


# -- parallel parts (issue 25 §3) -------------------------------------------------------------------


def test_parts_on_parallel_connections_roundtrip_bitwise_and_complete_once_all_acked(server):
    state = _state()
    server.publish(41, state, META, expected={"r1/rank0"})
    total = sum(t.numel() * t.element_size() for t in state.values())
    for streams in (2, 3, 7):  # 7: parts that split tensors at odd offsets
        into = _like(state)
        meta, stats = fetch_state(server.address, 41, into, SECRET, "r1/rank0", streams=streams)
        assert _bitwise_equal(into, state) and meta == META
        assert stats["bytes"] == total and stats["streams"] == streams
    assert _wait_completed(server, {"r1/rank0"}) == {"r1/rank0"}


def test_a_fetch_whose_parts_did_not_all_arrive_is_not_completed_and_freeze_keeps_everything(server):
    from lightning_ft.replica.catchup.wire import Part

    state = {f"w{i}": torch.randn(1 << 16) for i in range(4)}  # 1 MB
    server.publish(2, state, {}, expected={"r1"})
    a, b = socket.socketpair()
    try:
        status, _, send = server._admit(2, "r1", Part("00c0ffee", 0, 2), a)  # part 1 of 2 is still connecting
        assert status == 200
        send.pos = send.hi  # part 0 sent everything
        server.freeze()
        assert server.frozen_bytes == 4 << 18, "part 1 of 2 has not been admitted: its tensors are kept"
    finally:
        server._sends.discard(send)
        a.close()
        b.close()
    assert server.completed() == set()


def test_a_fetcher_completes_only_once_every_part_is_acknowledged(server):
    """A fetch of 3 parts whose first two parts were acknowledged is not complete (the healthy
    rank may not drop the state a third part still needs); the third ACK completes it."""
    from lightning_ft.replica.catchup.wire import ACK, Part

    state = {f"w{i}": torch.randn(1 << 10) for i in range(3)}  # 12 KB: fits the unread socket buffers
    server.publish(4, state, {}, expected={"r1"})
    socks = [socket.socketpair() for _ in range(3)]
    try:
        sends = [server._admit(4, "r1", Part("0badf00d", i, 3), a)[2] for i, (a, _) in enumerate(socks)]
        for i, send in enumerate(sends):
            server._serve(send, "0badf00d", lambda mac, n: None, lambda raw: None, lambda: ACK)
            want = {"r1"} if i == 2 else set()
            assert server.completed() == want, f"after {i + 1} of 3 acknowledged parts"
        # a part that is refused (no ACK) never counts
        server.publish(4, state, {}, expected={"r1"})
        sends = [server._admit(4, "r1", Part("0badf00e", i, 2), a)[2] for i, (a, _) in enumerate(socks[:2])]
        server._serve(sends[0], "0badf00e", lambda mac, n: None, lambda raw: None, lambda: ACK)
        server._serve(sends[1], "0badf00e", lambda mac, n: None, lambda raw: None, lambda: b"")
        assert server.completed() == set()
    finally:
        for a, b in socks:
            a.close()
            b.close()


@pytest.mark.parametrize("tamper", [0, 2])
def test_one_altered_part_ends_the_parallel_fetch_partial_and_nothing_is_acked(server, tamper):
    state = {f"w{i}": torch.randn(1 << 18) for i in range(3)}  # 3 MB in 3 parts of 1 MB
    server.publish(3, state, {"step": 3}, expected={"r1/rank0"})
    offset = len(server._pub.header) + 16 + 4096  # inside the part's tensor bytes
    proxy = _Tamper(server.address, offset, conns=3, tamper=tamper)
    into = {n: torch.zeros_like(t) for n, t in state.items()}
    with pytest.raises(CatchupError, match="body MAC mismatch") as e:
        fetch_state(proxy.address, 3, into, SECRET, "r1/rank0", streams=3, timeout_s=5, local=False)
    assert e.value.partial, "bytes were written: the replica must vote LOST"
    time.sleep(0.2)  # an ACK would have arrived by now
    assert server.completed() == set() and not server._pub.acked, "no part was acknowledged"


def test_a_server_without_the_secret_writes_nothing_into_a_parallel_fetch(monkeypatch):
    impostor = StateServer(b"not-the-job-secret", name="impostor")
    monkeypatch.setattr(impostor, "_check_auth", lambda version, headers: ("anyone", ""))
    try:
        state = {f"w{i}": torch.randn(1 << 18) for i in range(3)}
        impostor.publish(3, state, {"step": 3})
        into = {n: torch.full_like(t, 7.0) for n, t in state.items()}
        with pytest.raises(CatchupError, match="not authentic \\(header MAC mismatch\\)") as e:
            fetch_state(impostor.address, 3, into, SECRET, "r1/rank0", streams=4, timeout_s=5)
        assert not e.value.partial
        assert all(torch.equal(t, torch.full_like(t, 7.0)) for t in into.values()), "not one byte written"
        time.sleep(0.2)
        assert impostor.completed() == set() and not impostor._pub.acked
    finally:
        impostor.close()


def test_parts_of_two_publications_are_never_mixed(server, monkeypatch):
    """The version is republished between the parts' requests: the headers differ (another
    publication id), so the fetch fails before any tensor byte is written."""
    import lightning_ft.replica.catchup.http as client

    state = {f"w{i}": torch.randn(1 << 16) for i in range(2)}
    server.publish(5, state, {})
    opened = []
    real_open = client._Fetch._open

    def open_then_republish(self, s):
        real_open(self, s)
        opened.append(s.part.index)
        if len(opened) == 1:
            server.publish(5, {n: t + 1 for n, t in state.items()}, {})

    monkeypatch.setattr(client._Fetch, "_open", open_then_republish)
    monkeypatch.setattr(client, "Thread", lambda target, args, **kw: _Inline(target, args))
    into = {n: torch.zeros_like(t) for n, t in state.items()}
    with pytest.raises(CatchupError, match="different publications") as e:
        fetch_state(server.address, 5, into, SECRET, "r1", streams=2, timeout_s=5)
    assert not e.value.partial and all(not t.any() for t in into.values())


class _Inline:
    """A Thread stand-in that runs its target at start(): the parts open one after the other."""

    def __init__(self, target, args) -> None:
        self.target, self.args = target, args

    def start(self) -> None:
        self.target(*self.args)

    def join(self, timeout=None) -> None:
        pass


def _truncating_proxy(upstream: str, tensor_bytes: int) -> tuple[str, threading.Thread]:
    """A proxy for one request that passes the response through the header MAC and then only
    `tensor_bytes` bytes of the body before it closes: a healthy rank that died while serving."""
    from lightning_ft.replica.catchup.wire import MAC_BYTES

    lsock = socket.create_server(("127.0.0.1", 0))
    host, port = upstream.split(":")

    def serve() -> None:
        client, _ = lsock.accept()
        with client, socket.create_connection((host, int(port)), timeout=5) as up:
            request = b""
            while b"\r\n\r\n" not in request:
                request += client.recv(1 << 16)
            up.sendall(request)
            raw, cut = b"", None
            while cut is None or len(raw) < cut:
                chunk = up.recv(1 << 16)
                assert chunk, "the server closed first"
                raw += chunk
                head = raw.find(b"\r\n\r\n")
                if cut is None and head >= 0 and len(raw) >= head + 4 + 8:
                    hlen = int.from_bytes(raw[head + 4:head + 12], "big")
                    cut = head + 4 + 8 + hlen + MAC_BYTES + tensor_bytes
            client.sendall(raw[:cut])
        lsock.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return f"127.0.0.1:{lsock.getsockname()[1]}", t


@pytest.mark.parametrize("tensor_bytes", [0, 100])
def test_a_source_that_dies_before_the_first_tensor_byte_leaves_the_fetch_retryable(server, tensor_bytes):
    """The connection closes after the authenticated header: with no tensor byte received the
    destination is untouched and the fetch is not `partial` (the replica may retry it); one
    received byte makes it partial (the replica must restart fresh)."""
    state = {"w": torch.randn(1 << 12)}
    server.publish(4, state, {"step": 4})
    address, t = _truncating_proxy(server.address, tensor_bytes)
    into = {"w": torch.full((1 << 12,), 7.0)}
    with pytest.raises(CatchupError, match="body truncated in tensor 'w'") as e:
        fetch_state(address, 4, into, SECRET, "r1/rank0", streams=1, timeout_s=5, local=False)
    t.join(5)
    assert e.value.partial == (tensor_bytes > 0)
    untouched = torch.equal(into["w"], torch.full((1 << 12,), 7.0))
    assert untouched == (tensor_bytes == 0)


# -- the same-host listener ------------------------------------------------------------------------

@pytest.mark.parametrize("streams", [1, 3])
def test_a_same_host_fetch_goes_over_the_local_listener_bitwise_and_completes(server, streams):
    state = _state(5)
    server.publish(6, state, META, expected={"r1/rank0"})
    assert server.local_name is not None and server.local_name.startswith("lft-catchup-")
    into = _like(state)
    meta, stats = fetch_state(server.address, 6, into, SECRET, "r1/rank0", streams=streams)
    assert stats["local"] == streams and stats["streams"] == streams
    assert _bitwise_equal(into, state) and meta == META
    assert _wait_completed(server, {"r1/rank0"}) == {"r1/rank0"}
    # the same fetch over TCP (local=False): no part goes the local way
    into = _like(state)
    _, stats = fetch_state(server.address, 6, into, SECRET, "r2/rank0", streams=streams, local=False)
    assert stats["local"] == 0 and _bitwise_equal(into, state)


def test_the_local_answer_is_trusted_only_with_the_secrets_tag(server):
    from lightning_ft.replica.catchup.http import _local_name

    assert _local_name(server.address, SECRET, 2.0) == server.local_name
    assert _local_name(server.address, b"another-secret", 2.0) is None  # the tag does not verify
    impostor = StateServer(b"another-secret")
    try:
        impostor.publish(1, _state(), {})
        # an impostor's listener is never used (and it refuses our request over TCP)
        assert _local_name(impostor.address, SECRET, 2.0) is None
        with pytest.raises(CatchupError, match="authentication refused"):
            fetch_state(impostor.address, 1, _like(_state()), SECRET, "r1/rank0")
    finally:
        impostor.close()


def test_a_local_listener_that_does_not_answer_falls_back_to_tcp(server, monkeypatch):
    """Another host or network namespace does not reach the server's abstract socket: the parts
    go over TCP, with the MACs over every byte."""
    import lightning_ft.replica.catchup.http as catchup

    state = _state(2)
    server.publish(2, state, {})
    monkeypatch.setattr(catchup, "_local_name", lambda *a: "lft-catchup-nobody-listens-here")
    into = _like(state)
    _, stats = fetch_state(server.address, 2, into, SECRET, "r1/rank0", streams=2)
    assert stats["local"] == 0 and _bitwise_equal(into, state)


def test_the_local_listener_refuses_what_tcp_refuses(server):
    """The same handler: unauthenticated and wrong-version requests over the local listener get
    the same answers."""
    server.publish(3, _state(), {})
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect("\0" + server.local_name)
    with sock:
        sock.sendall(b"GET /state/3 HTTP/1.0\r\nX-LFT-Fetcher: r1/rank0\r\n\r\n")
        assert sock.recv(64).startswith(b"HTTP/1.0 401")
    from lightning_ft.replica.catchup.http import _connect_local, _request

    sock = _connect_local(server.local_name, 5.0)
    assert sock is not None
    with sock:
        resp = _request(sock, server.address, "/state/4", _request_headers(SECRET, 4, "r1/rank0"))
        assert resp.status == 409
