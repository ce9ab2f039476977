"""Paged KV blocks: allocation, reference counts, truncation, shared prefix."""

import pytest

from engine_fakes import count_ops

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


@pytest.mark.parametrize("zero_at_start", [False, True])
def test_every_block_is_zero_at_its_first_use_and_a_zeroed_pool_allocates_without_device_work(zero_at_start):
    """Blocks handed out for the first time hold zeros (never-written memory could hold NaN, and attention reads a
    last block's unwritten tail with weight 0). Zeroed lazily, each allocation of fresh blocks fills them in every
    layer (a launch each on a GPU, inside a step's launch); zeroed at the start, an allocation dispatches nothing."""
    import torch

    p = KVPool(num_layers=3, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8, zero_at_start=zero_at_start)
    for t in p.k + p.v:  # what never-written memory may hold, where the pool has not zeroed yet
        view = t.view(2, 6, 4, 8)
        for b in range(6):
            if not p._zeroed[b]:
                view[:, b] = float("nan")
    blocks = []
    ops = count_ops(lambda: blocks.extend(p.allocate(3)))
    assert (ops == 0) == zero_at_start and (ops >= 6 or zero_at_start)  # (lazily: a fill a layer, keys and values)
    for t in p.k + p.v:
        assert torch.equal(t.view(2, 6, 4, 8)[:, blocks], torch.zeros(2, 3, 4, 8))
    p.release(blocks)
    assert count_ops(lambda: p.allocate(3)) == 0  # (blocks zeroed once are not zeroed again)


def test_the_pool_zeroes_at_the_start_on_a_gpu_only_by_default():
    """Default: zeroed at the start on CUDA devices (the memory is held anyway), lazily elsewhere (an unused CPU
    block costs no memory); a setting that is not a bool is named."""
    assert KVPool(1, 4, 4, 1, 8).zero_at_start is False
    with pytest.raises(ValueError, match="zero_at_start must be a bool or None"):
        KVPool(1, 4, 4, 1, 8, zero_at_start="yes")
    import torch

    if torch.cuda.is_available():
        p = KVPool(1, 4, 4, 1, 8, device="cuda")
        assert p.zero_at_start is True and all(p._zeroed) and not p.k[0].isnan().any()
