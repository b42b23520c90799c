"""`Store.put_if`, the fence of ledger writes, on both stores (the contract of store.py)."""
from __future__ import annotations

from tests.coord.test_store import store  # noqa: F401  (the two-store fixture)


def test_put_if_writes_only_while_every_create_revision_matches(store):  # noqa: F811
    rev = store.put("/t/members/1", b"me")
    created = store.get("/t/members/1").create_revision
    assert created == rev
    assert store.put_if("/t/rec/a", b"1", {"/t/members/1": created, "/t/evict/1/0": 0})
    assert store.get("/t/rec/a").value == b"1"
    store.put("/t/evict/1/0", b"dead")
    assert not store.put_if("/t/rec/b", b"2", {"/t/members/1": created, "/t/evict/1/0": 0})
    assert store.get("/t/rec/b") is None


def test_put_if_fails_once_the_key_was_recreated(store):  # noqa: F811
    store.put("/t/members/2", b"old")
    created = store.get("/t/members/2").create_revision
    store.delete("/t/members/2")
    assert not store.put_if("/t/rec/c", b"x", {"/t/members/2": created})
    store.put("/t/members/2", b"new")  # a re-registration: a new create revision
    assert not store.put_if("/t/rec/c", b"x", {"/t/members/2": created})
    assert store.put_if("/t/rec/c", b"x", {"/t/members/2": store.get("/t/members/2").create_revision})


def test_put_many_if_writes_all_or_nothing(store):  # noqa: F811
    store.put("/t/members/3", b"me")
    fence = {"/t/members/3": store.get("/t/members/3").create_revision}
    assert store.put_many_if([("/t/r/1", b"a"), ("/t/r/2", b"b")], fence)
    assert [kv.value for kv in store.get_prefix("/t/r/")[0]] == [b"a", b"b"]
    store.put("/t/members/3", b"me again")  # same key: create revision unchanged
    assert store.put_many_if([("/t/r/3", b"c")], fence)
    store.delete("/t/members/3")
    assert not store.put_many_if([("/t/r/4", b"d"), ("/t/r/5", b"e")], fence)
    assert store.get("/t/r/4") is None and store.get("/t/r/5") is None
