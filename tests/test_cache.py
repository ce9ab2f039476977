"""Paged KV blocks: allocation, reference counts, truncation, shared prefix."""

import pytest

from fastrag.cache.kv import BlockTable, KVPool, OutOfBlocks


def pool(n=10, bs=4):
    return KVPool(num_layers=1, num_blocks=n, block_size=bs, num_kv_heads=1, head_dim=2)


def test_reserve_allocates_whole_blocks_and_slots_follow_blocks():
    p = pool()
    t = BlockTable(p)
    t.reserve(9)  # 9 tokens -> 3 blocks of 4
    assert len(t.blocks) == 3 and p.num_free == 7
    t.num_tokens = 9
    slots = t.slots(0, 9)
    assert slots == [t.blocks[i // 4] * 4 + i % 4 for i in range(9)]
    assert len(set(slots)) == 9


def test_truncate_frees_exactly_the_blocks_past_the_position():
    p = pool()
    t = BlockTable(p)
    t.reserve(12)
    t.num_tokens = 12
    kept = list(t.blocks[:2])
    gone = list(t.blocks[2:])
    t.truncate(5)  # tokens 0..4 live in blocks 0 and 1
    assert t.blocks == kept and t.num_tokens == 5
    assert all(p.refcount[b] == 0 for b in gone) and p.num_free == 8
    t.truncate(4)  # exactly one block
    assert t.blocks == kept[:1] and p.num_free == 9
    t.free()
    assert t.blocks == [] and p.num_free == 10


def test_shared_blocks_survive_until_last_release():
    p = pool()
    owner = p.allocate(2)
    p.share(owner)  # a second sequence starts with the prefix
    p.share(owner)
    p.release(owner)
    p.release(owner)
    assert all(p.refcount[b] == 1 for b in owner) and p.num_free == 8  # one physical copy, still held
    p.release(owner)
    assert p.num_free == 10
    with pytest.raises(AssertionError):
        p.release(owner)  # double free is caught


def test_out_of_blocks_is_a_clear_error():
    p = pool(n=2)
    with pytest.raises(OutOfBlocks, match="need 3 KV blocks, 2 free"):
        p.allocate(3)
