"""Per-rank addresses out of the rounds' messages: blocks that round-trip exactly, stay small
at the paper's size, live and die with their lease, and are read once per incarnation."""
from __future__ import annotations

import pytest

from lightning_ft.coord import keys
from lightning_ft.coord.addresses import (BLOCK_RANKS, AddressBook, AddressesMissing, blocks_of, decode_blocks,
                                          encode_blocks, fetch, publish)
from lightning_ft.coord.store import MemoryStore
from lightning_ft.sim.leaders import rank_addresses


@pytest.mark.parametrize("world", [1, 7, BLOCK_RANKS - 1, BLOCK_RANKS, BLOCK_RANKS + 1, 8192])
def test_blocks_round_trip_every_rank_in_order(world):
    ftar, state = rank_addresses(world, 29500), rank_addresses(world, 29600)
    blocks = encode_blocks(ftar, state)
    assert len(blocks) == blocks_of(world) == -(-world // BLOCK_RANKS)
    assert decode_blocks(blocks, world) == (ftar, state)


def test_a_block_of_the_papers_replica_is_far_below_etcds_request_limit():
    # 8192 ranks with long IPv6 endpoints: the largest block still fits a 64 KB message
    ftar = tuple(f"[2001:db8:{r // 8:x}::{r % 8 + 1}]:29500" for r in range(8192))
    blocks = encode_blocks(ftar, tuple(a.replace("29500", "29600") for a in ftar))
    assert len(blocks) == 32 and max(len(b) for b in blocks) < 24 << 10


def test_decode_refuses_missing_reordered_or_extra_blocks():
    ftar = rank_addresses(600)
    blocks = encode_blocks(ftar, ftar)
    with pytest.raises(ValueError, match="hold 512 ranks, not 600"):
        decode_blocks(blocks[:2], 600)
    with pytest.raises(ValueError, match="block 0 is malformed"):
        decode_blocks([blocks[1], blocks[0], blocks[2]], 600)
    with pytest.raises(ValueError, match="hold 600 ranks, not 599"):
        decode_blocks(blocks, 599)
    with pytest.raises(ValueError, match="2 FTAR addresses but 1 state"):
        encode_blocks(("a:1", "b:2"), ("a:3",))


def test_addresses_vanish_with_the_lease_and_the_book_reads_each_incarnation_once():
    s = MemoryStore()
    root = keys.root("/lft", "j")
    ftar, state = rank_addresses(300, 1), rank_addresses(300, 2)
    lease = s.lease_grant(5.0)
    publish(s, root, 3, 1, encode_blocks(ftar, state), lease)
    assert [kv.key for kv in s.get_prefix(keys.addrs(root))[0]] == [
        f"{root}addrs/3/1/000000", f"{root}addrs/3/1/000001"]
    book = AddressBook(s, root, 300)
    assert book.get(3, 1) == (ftar, state) and book.get(3, 1) == (ftar, state)
    assert book.fetches == 1
    assert book.get(3, 0) is None  # another incarnation published nothing
    s.lease_revoke(lease)
    with pytest.raises(AddressesMissing, match="replica 3 incarnation 1 has no published addresses"):
        fetch(s, root, 3, 1, 300)
    s.close()
