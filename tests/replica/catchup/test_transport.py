"""The catch-up transport's contract (replica/catchup_transport.py), one suite over both
implementations: HTTP (the job's) and in-memory (fast tests). The HTTP wire itself (MACs,
parts, stalls, tampering): test_catchup.py."""
from __future__ import annotations

import time

import pytest
import torch

from lightning_ft.replica.catchup.http import HTTPTransport
from lightning_ft.replica.catchup.memory import InMemoryTransport
from lightning_ft.replica.catchup.wire import CatchupError

SECRET = b"job-secret-0123456789abcdef"


@pytest.fixture(params=[HTTPTransport, InMemoryTransport], ids=["http", "memory"])
def kind(request):
    return request.param


@pytest.fixture
def pair(kind):
    """(server, client): two ranks' transports of one job."""
    server, client = kind(SECRET, "127.0.0.1", "r0/rank0"), kind(SECRET, "127.0.0.1", "r1/rank0")
    yield server, client
    server.close(), client.close()


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(64, 33, generator=g), "b": torch.randn(17, generator=g).to(torch.bfloat16),
            "h": torch.randn(9, generator=g).to(torch.float16), "step": torch.tensor(7, dtype=torch.int64),
            "empty": torch.empty(0)}


def _like(state):
    return {n: torch.full_like(t, 3) for n, t in state.items()}


def _same(a, b) -> bool:
    return list(a) == list(b) and all(torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
                                      for x, y in zip(a.values(), b.values(), strict=True))


def _completed(server, want: set[str]) -> set[str]:
    """HTTP counts a fetcher when its ACK arrives, just after the fetch returned."""
    deadline = time.monotonic() + 5
    while not want <= server.completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.completed()


def test_roundtrip_is_bitwise_with_meta_and_counts_the_fetcher(pair):
    server, client = pair
    state = _state()
    server.publish(41, state, {"step": 41, "note": ("a", 1)}, expected={"r1/rank0"})
    into = _like(state)
    meta, stats = client.fetch(server.address, 41, into, "r1/rank0")
    assert _same(into, state)
    assert meta == {"step": 41, "note": ["a", 1]}  # JSON: tuples arrive as lists
    assert stats["bytes"] == sum(t.numel() * t.element_size() for t in state.values())
    assert {"seconds", "gbps", "streams"} <= set(stats)
    assert _completed(server, {"r1/rank0"}) == {"r1/rank0"}


def test_the_address_is_resolved_by_its_port_whatever_the_host(pair):
    server, client = pair
    state = _state()
    server.publish(2, state, {})
    into = _like(state)
    client.fetch("127.0.0.1:" + server.address.rpartition(":")[2], 2, into, "r1/rank0")  # base._with_host
    assert _same(into, state)


def test_another_version_is_409_with_the_servers_version(pair):
    server, client = pair
    server.publish(11, _state(), {})
    with pytest.raises(CatchupError, match="server has version 11") as e:
        client.fetch(server.address, 12, _like(_state()), "r1/rank0")
    assert e.value.status == 409 and e.value.server_version == 11 and not e.value.partial
    assert e.value.not_yet_published(12)  # the source may publish 12 soon
    with pytest.raises(CatchupError) as e:
        client.fetch(server.address, 10, _like(_state()), "r1/rank0")
    assert not e.value.not_yet_published(10)  # it moved on


def test_nothing_published_or_retired_is_404(pair):
    server, client = pair
    with pytest.raises(CatchupError, match="nothing published") as e:
        client.fetch(server.address, 1, _like(_state()), "r1/rank0")
    assert e.value.status == 404 and e.value.not_yet_published(1)
    server.publish(1, _state(), {})
    server.retire()
    with pytest.raises(CatchupError) as e:
        client.fetch(server.address, 1, _like(_state()), "r1/rank0")
    assert e.value.status == 404


def test_a_wrong_secret_is_401_and_writes_nothing(kind, pair):
    server, _ = pair
    state = _state()
    server.publish(3, state, {}, expected={"r1/rank0"})
    intruder = kind(b"not-the-job-secret", "127.0.0.1", "r9/rank0")
    into = _like(state)
    try:
        with pytest.raises(CatchupError, match="authentication refused") as e:
            intruder.fetch(server.address, 3, into, "r1/rank0")
    finally:
        intruder.close()
    assert e.value.status == 401 and not e.value.partial
    assert _same(into, _like(state))
    assert server.completed() == set()


def test_a_closed_transport_is_not_reachable(kind):
    server, client = kind(SECRET, "127.0.0.1", "a"), kind(SECRET, "127.0.0.1", "b")
    server.publish(1, _state(), {})
    server.close()
    try:
        with pytest.raises(CatchupError) as e:
            client.fetch(server.address, 1, _like(_state()), "b", timeout_s=2.0)
        assert e.value.status is None and not e.value.partial
    finally:
        client.close()


def test_until_freeze_a_fetch_sees_the_live_tensors(pair):
    server, client = pair
    state = _state()
    server.publish(2, state, {})
    state["w"].add_(1)  # publish kept a reference, not a copy
    into = _like(state)
    client.fetch(server.address, 2, into, "r1/rank0")
    assert _same(into, state)


def test_after_freeze_a_pending_fetcher_gets_the_published_bytes(pair):
    server, client = pair
    state = _state()
    published = {n: t.clone() for n, t in state.items()}
    server.publish(2, state, {"step": 2}, expected={"r1/rank0", "r2/rank0"})
    client.fetch(server.address, 2, _like(state), "r1/rank0")
    _completed(server, {"r1/rank0"})
    assert server.freeze() >= 0
    for t in state.values():  # the owner's optimizer step, in place
        t.add_(5) if t.dtype != torch.int64 else t.fill_(99)
    into = _like(state)
    meta, _ = client.fetch(server.address, 2, into, "r2/rank0")
    assert _same(into, published) and meta == {"step": 2}
    assert _completed(server, {"r1/rank0", "r2/rank0"}) == {"r1/rank0", "r2/rank0"}
    assert server.freeze() >= 0  # a second freeze changes nothing


def test_freeze_after_every_expected_fetcher_drops_the_state(pair):
    server, client = pair
    state = _state()
    server.publish(9, state, {}, expected={"r1/rank0"})
    client.fetch(server.address, 9, _like(state), "r1/rank0")
    _completed(server, {"r1/rank0"})
    server.freeze()
    with pytest.raises(CatchupError) as e:
        client.fetch(server.address, 9, _like(state), "late")
    assert e.value.status == 410 and not e.value.not_yet_published(9)


def test_a_republished_version_replaces_the_state_and_its_completions(pair):
    server, client = pair
    server.publish(1, _state(), {}, expected={"r1/rank0"})
    client.fetch(server.address, 1, _like(_state()), "r1/rank0")
    _completed(server, {"r1/rank0"})
    state = {n: t + 1 if t.dtype.is_floating_point else t for n, t in _state().items()}
    server.publish(2, state, {})
    assert server.completed() == set()
    into = _like(state)
    client.fetch(server.address, 2, into, "r1/rank0")
    assert _same(into, state)


@pytest.mark.parametrize("change,needle", [("shape", "shape"), ("dtype", "dtype"), ("extra", "2 tensors")])
def test_a_layout_that_is_not_ours_is_refused_naming_the_tensor(pair, change, needle):
    server, client = pair
    server.publish(5, {"a": torch.zeros(4), "b": torch.zeros(3)}, {})
    into = {"a": torch.ones(4), "b": torch.ones(3)}
    if change == "shape":
        into["b"] = torch.ones(4)
    elif change == "dtype":
        into["b"] = torch.ones(3, dtype=torch.float64)
    else:
        into["c"] = torch.ones(1)
    with pytest.raises(CatchupError, match=needle):
        client.fetch(server.address, 5, into, "r1/rank0")
    assert torch.equal(into["a"], torch.ones(4))  # refused before a byte was written


def test_meta_is_checked_against_the_local_optimizer(pair):
    server, client = pair
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    groups = [{k: v for k, v in g.items() if k != "params"} | {"lr": 0.5} for g in opt.param_groups]
    server.publish(7, {"x": torch.ones(2)}, {"step": 7, "param_groups": groups, "evil": 1})
    meta, _ = client.fetch(server.address, 7, {"x": torch.zeros(2)}, "r1/rank0", param_groups=opt.param_groups)
    assert "evil" not in meta and meta["step"] == 7
    assert meta["param_groups"][0]["lr"] == 0.5 and isinstance(meta["param_groups"][0]["betas"], tuple)
    server.publish(8, {"x": torch.ones(2)}, {"param_groups": groups * 2})
    with pytest.raises(CatchupError, match="param groups"):
        client.fetch(server.address, 8, {"x": torch.zeros(2)}, "r1/rank0", param_groups=opt.param_groups)


def test_a_fetcher_id_must_be_printable(pair):
    server, client = pair
    server.publish(1, {"x": torch.ones(1)}, {})
    with pytest.raises(ValueError, match="fetcher id"):
        client.fetch(server.address, 1, {"x": torch.zeros(1)}, " r1\n")


def test_a_joiner_catches_up_through_the_in_memory_transport_in_process():
    """The replica layer over `InMemoryTransport`: two managers in threads on a MemoryStore (no
    etcd, no processes). Replica 0 trains alone, replica 1 joins with another initialization,
    catches up in a round (its fetch and replica 0's publish and freeze: catchup/transfer.py,
    driven by replica/step.py), and both end bitwise equal."""
    import threading

    from lightning_ft.coord.store import MemoryStore
    from lightning_ft.replica.core import Do
    from lightning_ft.replica.replica import Replica
    from lightning_ft.replica.settings import Identity, Settings

    store = MemoryStore()

    def make(rid: int):
        torch.manual_seed(rid)
        model = torch.nn.Linear(8, 4)
        mgr = Replica(model, torch.optim.AdamW(model.parameters(), lr=0.01), Identity("j", rid, 0, 2, "s" * 16),
                      Settings(min_replicas=1, init_timeout_s=0.2, poll_interval_s=0.01), store=store,
                      catchup_transport=InMemoryTransport)

        def compute(plan) -> None:
            g = torch.Generator().manual_seed(plan.batch_index)
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
            torch.nn.functional.mse_loss(model(x), y).backward()
        return mgr, model, compute

    (a, model_a, compute_a), (b, model_b, compute_b) = make(0), make(1)
    joined, errors, prepared = threading.Event(), [], []

    def drive(step, compute=None):
        for ask in step:
            if ask.do in (Do.COMPUTE, Do.RECOMPUTE):
                compute(ask.plan)
        return step.result

    def guarded(fn):
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)
                joined.set()
        return run

    def run_a() -> None:
        a.start()
        drive(a.prepare())
        while a.step < 8:
            if a.step == 3:
                joined.wait(30)  # replica 1 registered: the next round has it lagging
            drive(a.begin(), compute_a)

    def run_b() -> None:
        b.start()
        joined.set()
        prepared.append(drive(b.prepare()))
        while b.step < 8:
            drive(b.begin(), compute_b)

    threads = [threading.Thread(target=guarded(run_a), daemon=True)]
    threads[0].start()
    deadline = time.monotonic() + 30
    while a.step < 3 and not errors and time.monotonic() < deadline:
        time.sleep(0.01)
    threads.append(threading.Thread(target=guarded(run_b), daemon=True))
    threads[1].start()
    for t in threads:
        t.join(60)
    try:
        assert not errors, errors
        assert not any(t.is_alive() for t in threads), "a replica did not reach step 8"
        assert all(isinstance(r.transfer.transport, InMemoryTransport) for r in (a, b))
        assert prepared and prepared[0].caught_up and a.step == b.step == 8
        assert "1/0" in a.transfer.transport.completed()  # replica 1 rank 0 fetched replica 0's publication
        assert all(torch.equal(p, q) for p, q in zip(model_a.parameters(), model_b.parameters(), strict=True))
    finally:
        a.close(), b.close(), store.close()
