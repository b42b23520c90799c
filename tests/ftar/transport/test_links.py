"""Which link kind each ring link gets: the pure choice, `ftar.transport=auto` on one host
(shm, and the choice in the log), mixed settings, and the refusals that name the fix."""
from __future__ import annotations

import threading

import pytest
import torch

from lightning_ft.ftar.engine import FTAR, FTARSettings
from lightning_ft.ftar.transport.base import FatalError, RecoverableError, allowed_kinds, choose_link, host_id


@pytest.mark.parametrize("transport,device,want", [
    ("tcp", False, ["tcp"]), ("shm", False, ["shm"]), ("rdma", False, ["rdma"]), ("rdma", True, ["rdma"]),
    ("auto", False, ["shm", "tcp"]), ("auto", True, ["shm", "rdma", "tcp"]),
])
def test_allowed_kinds_follow_the_config(transport, device, want):
    assert allowed_kinds(transport, rdma_device=device) == want


def test_unknown_transport_is_fatal_with_the_choices():
    with pytest.raises(FatalError, match="use one of tcp, rdma, shm, auto"):
        allowed_kinds("ib", False)


@pytest.mark.parametrize("offered,mine,same_host,want", [
    (["shm", "tcp"], ["shm", "tcp"], True, "shm"),
    (["shm", "tcp"], ["shm", "tcp"], False, "tcp"),       # auto across hosts
    (["shm", "rdma", "tcp"], ["shm", "rdma", "tcp"], False, "rdma"),
    (["shm", "tcp"], ["shm", "rdma", "tcp"], False, "tcp"),  # only one end has a device
    (["tcp"], ["shm", "tcp"], True, "tcp"),               # tcp dialer, auto acceptor
    (["shm", "tcp"], ["tcp"], True, "tcp"),               # auto dialer, tcp acceptor
    (["rdma"], ["rdma"], True, "rdma"),
])
def test_choose_link_takes_the_dialers_first_kind_that_both_accept(offered, mine, same_host, want):
    kind, why = choose_link(offered, mine, same_host)
    assert kind == want, why


@pytest.mark.parametrize("offered,mine,same_host,match", [
    (["shm"], ["shm"], False, "needs ring neighbours on one host.*use ftar.transport=auto or tcp"),
    (["tcp"], ["shm"], True, r"offers \['tcp'\], this rank accepts \['shm'\].*same ftar.transport"),
    (["rdma"], ["shm", "tcp"], True, "no common link kind"),
    ([], ["tcp"], True, "offered no link kind"),
])
def test_choose_link_refuses_with_the_reason(offered, mine, same_host, match):
    kind, why = choose_link(offered, mine, same_host)
    assert kind is None
    assert __import__("re").search(match, why), why


def test_host_id_is_stable_within_a_process():
    assert host_id() == host_id() and not host_id().startswith("unknown")


def _connect(fs):
    addrs = [f.address for f in fs]
    errors = {}

    def go(i, f):
        try:
            f.reconfigure(1, addrs, i)
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors[i] = e

    ts = [threading.Thread(target=go, args=(i, f)) for i, f in enumerate(fs)]
    [t.start() for t in ts]
    [t.join(10) for t in ts]
    return errors


def _ring(transports, **kw):
    return [FTAR("j", r, 0, "s", FTARSettings(chunk_bytes=1 << 12, num_chunks=2, transport=t, connect_timeout_s=2.0,
                                              **kw))
            for r, t in enumerate(transports)]


def test_auto_picks_shm_on_one_host_and_reports_it_in_the_run_log(capfd):
    fs = _ring(["auto", "auto", "auto"])
    try:
        assert _connect(fs) == {}
        assert [f.transport.tx.kind for f in fs] == ["shm"] * 3
        assert [f.transport.rx.kind for f in fs] == ["shm"] * 3
        xs = [torch.full((5000,), float(i)) for i in range(3)]
        for w in [f.allreduce([x]) for f, x in zip(fs, xs, strict=True)]:
            w.wait(10)
        assert all(torch.equal(x, torch.full((5000,), 3.0)) for x in xs)
        err = capfd.readouterr().err
        assert "FTAR r0/rank0 links (ftar.transport=auto)" in err
        assert "to the right neighbour" in err and ": shm" in err and "(same host)" in err
    finally:
        for f in fs:
            f.close()


def test_auto_next_to_tcp_settles_on_tcp_for_the_links_they_share():
    fs = _ring(["auto", "tcp"])
    try:
        assert _connect(fs) == {}
        assert [f.transport.tx.kind for f in fs] == ["tcp", "tcp"]
        xs = [torch.ones(3000), torch.ones(3000)]
        for w in [f.allreduce([x]) for f, x in zip(fs, xs, strict=True)]:
            w.wait(10)
        assert torch.equal(xs[0], torch.full((3000,), 2.0))
    finally:
        for f in fs:
            f.close()


def test_shm_next_to_tcp_is_refused_with_the_fix():
    fs = _ring(["shm", "tcp"])
    try:
        errors = _connect(fs)
        assert set(errors) == {0, 1} and all(isinstance(e, RecoverableError) for e in errors.values())
        text = " ".join(str(e) for e in errors.values())
        assert "every replica of a job must use the same ftar.transport" in text, text
    finally:
        for f in fs:
            f.close()
