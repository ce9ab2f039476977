"""Prefix caching: full blocks of computed prompt tokens are found again by content, shared by later sequences
(and by sequences started together), never written while shared, evicted least recently released first; the
shared KV gives the same tokens and logits as a prefill from scratch."""

from __future__ import annotations

import random

import pytest
import torch

from fastrag.cache.kv import BlockTable, KVPool, OutOfBlocks, chain_keys
from test_kv_reuse import WORDS, WordTok, _capture_logits, engine, finish
from test_kv_reuse import model  # noqa: F401  (the tiny random Llama fixture)


def pool(n=6, bs=4):
    return KVPool(num_layers=1, num_blocks=n, block_size=bs, num_kv_heads=1, head_dim=2)


def held(p: KVPool, tokens: list[int]) -> tuple[BlockTable, list[bytes]]:
    """A table holding `tokens`, its full blocks registered under their chain keys."""
    t = BlockTable(p)
    t.reserve(len(tokens))
    t.num_tokens = len(tokens)
    keys = chain_keys(b"", tokens, p.block_size)
    for b, k in zip(t.blocks, keys):
        p.register(b, k)
    return t, keys


# ---------------------------------------------------------------------------------------------- pool


def test_chain_keys_name_everything_up_to_their_block():
    a = chain_keys(b"", list(range(12)), 4)
    assert len(a) == 3 and len(set(a)) == 3
    assert chain_keys(b"", list(range(11)), 4) == a[:2]  # a partial block has no key
    b = chain_keys(b"", [0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11], 4)
    assert b[0] == a[0] and b[1] != a[1] and b[2] != a[2]  # block 2 equal, but what precedes it differs
    assert chain_keys(b"root", list(range(12)), 4)[0] != a[0]  # after another shared prefix: another content


def test_released_blocks_stay_findable_and_shareable_until_reused():
    p = pool()
    t, keys = held(p, list(range(10)))  # 2 full blocks registered, the third partial
    blocks = list(t.blocks)
    assert p.lookup(keys) == blocks[:2] and p.num_cached == 2
    t.free()
    assert p.num_free == 6  # cached blocks nobody holds count as free
    assert p.lookup(keys) == blocks[:2]
    p.share(blocks[:2])  # held again, straight from the cache
    assert [p.refcount[b] for b in blocks[:2]] == [1, 1] and p.num_free == 4
    p.release(blocks[:2])
    assert p.lookup(keys + chain_keys(b"", [7] * 4, 4)) == blocks[:2]  # the longest run of known keys


def test_allocation_takes_empty_blocks_first_then_the_least_recently_released_cached_one():
    p = pool(n=4)
    t1, k1 = held(p, list(range(4)))
    t2, k2 = held(p, list(range(100, 104)))
    t1.free()
    t2.free()  # both cached; t1's released first
    t3 = BlockTable(p)
    t3.reserve(8)  # the two empty blocks
    assert p.lookup(k1) and p.lookup(k2)
    t3.reserve(12)  # one more: evicts t1's block, the older
    assert p.lookup(k1) == [] and p.lookup(k2) != []
    assert p.num_cached == 1
    t3.reserve(16)
    assert p.lookup(k2) == [] and p.num_cached == 0
    with pytest.raises(OutOfBlocks):
        t3.reserve(17)


def test_a_key_already_cached_keeps_its_first_block():
    p = pool()
    t1, keys = held(p, list(range(4)))
    t2, _ = held(p, list(range(4)))  # the same content computed twice
    assert p.lookup(keys) == t1.blocks
    t2.free()
    assert p.num_free == 5 and p.lookup(keys) == t1.blocks  # the duplicate went back empty


def test_truncating_into_a_shared_block_gives_it_up_instead_of_writing_it():
    p = pool()
    t1, keys = held(p, list(range(12)))
    t2 = BlockTable(p)
    hit = p.lookup(keys)
    p.share(hit)
    t2.blocks, t2.num_tokens = list(hit), 12
    t2.truncate(6)  # the cut falls inside block 1, which t1 holds too
    assert t2.num_tokens == 4 and t2.blocks == hit[:1]
    assert p.refcount[hit[1]] == 1 and p.lookup(keys) == hit  # t1's copy is still findable
    t1.truncate(6)  # t1 alone holds block 1: it keeps it, and the block's old content is forgotten
    assert t1.num_tokens == 6 and t1.blocks == hit[:2]
    assert p.lookup(keys) == hit[:1]


# ---------------------------------------------------------------------------------------------- engine

STEM = "Question: who wrote it?\nContext:\n[1] Alpha Bravo Charlie Delta Echo Foxtrot Golf Hotel India Juliet\n"


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run_alone(model, text: str, n: int, **kw):  # noqa: F811
    """Generate from text on a fresh engine with no prefix caching: (ids, logits of every sampled token)."""
    eng = engine(model, prefix_caching=False, **kw)
    s = eng.new_sequence()
    seen = _capture_logits(eng)
    eng.start(s, WordTok().encode(text), n)
    finish(eng)
    assert s.out.prefilled == s.out.prompt_tokens
    return s.out.ids, torch.cat(seen)


def kv_of(eng, blocks: list[int]) -> torch.Tensor:
    bs = eng.pool.block_size
    idx = torch.tensor([b * bs + i for b in blocks for i in range(bs)])
    return torch.stack([t.index_select(1, idx) for t in eng.pool.k + eng.pool.v]).clone()


def test_a_later_prompt_with_the_same_start_prefills_only_the_rest(model):  # noqa: F811
    tok = WordTok()
    eng = engine(model)
    a, b = STEM + "[2] Kilo Lima\nAnswer:", STEM + "[2] Mike Oscar Papa\nAnswer:"
    s1 = eng.new_sequence()
    eng.start(s1, tok.encode(a), 4)
    finish(eng)
    bs = eng.pool.block_size
    shared = lcp(tok.encode(a), tok.encode(b)) // bs * bs
    assert shared >= 2 * bs
    eng.release(s1)  # gone (a one-shot sequence), its blocks stay cached
    s2 = eng.new_sequence()
    seen = _capture_logits(eng)
    eng.start(s2, tok.encode(b), 6)
    assert s2.out.prefilled == s2.out.prompt_tokens - shared
    finish(eng)
    assert eng.stats["cached_hit_tokens"] == shared
    ids, logits = run_alone(model, b, 6)
    assert s2.out.ids == ids
    torch.testing.assert_close(torch.cat(seen), logits, rtol=1e-5, atol=1e-5)


def test_sequences_started_together_compute_their_common_blocks_once(model):  # noqa: F811
    tok = WordTok()
    eng = engine(model)
    tails = ["[2] Kilo Lima\nAnswer:", "[2] Mike Oscar Papa\nAnswer:", "[2] Quebec\nAnswer: Romeo"]
    seqs = [eng.new_sequence() for _ in tails]
    for s, t in zip(seqs, tails):
        eng.start(s, tok.encode(STEM + t), 5)
    finish(eng)
    bs = eng.pool.block_size
    enc = [tok.encode(STEM + t) for t in tails]
    shared = min(lcp(enc[0], e) for e in enc[1:]) // bs * bs
    assert shared >= 2 * bs
    prefilled = sorted(s.out.prefilled for s in seqs)
    total = [s.out.prompt_tokens for s in seqs]
    assert sum(prefilled) == sum(total) - 2 * shared  # the first computed the stem, two shared it
    first = [s.table.blocks[: shared // bs] for s in seqs]
    assert first[0] == first[1] == first[2]  # one physical copy
    for s, t in zip(seqs, tails):
        ids, _ = run_alone(model, STEM + t, 5)
        assert s.out.ids == ids


def test_a_shared_block_is_never_written(model):  # noqa: F811
    tok = WordTok()
    eng = engine(model)
    s1 = eng.new_sequence()
    eng.start(s1, tok.encode(STEM + "Answer:"), 3)
    finish(eng)
    bs = eng.pool.block_size
    n_full = len(tok.encode(STEM)) // bs
    blocks = s1.table.blocks[:n_full]
    before = kv_of(eng, blocks)
    # another sequence shares the stem, then is restarted with a prompt that diverges inside a shared block
    s2 = eng.new_sequence()
    eng.start(s2, tok.encode(STEM + "[2] Kilo\nAnswer:"), 4)
    finish(eng)
    assert s2.table.blocks[:n_full] == blocks
    cut = tok.encode(STEM)[: n_full * bs - bs // 2]
    eng.start(s2, cut + tok.encode(" Zulu Sierra Tango\nAnswer:"), 4)
    finish(eng)
    torch.testing.assert_close(kv_of(eng, blocks), before, rtol=0, atol=0)
    assert s2.table.blocks[: n_full - 1] == blocks[: n_full - 1] and s2.table.blocks[n_full - 1] != blocks[-1]
    ids, _ = run_alone(model, tok.decode(cut) + " Zulu Sierra Tango\nAnswer:", 4)
    assert s2.out.ids == ids


def test_eviction_under_a_small_pool_keeps_outputs_exact(model):  # noqa: F811
    """Many one-shot prompts over a pool that holds only a few of them: cached blocks are handed out again, and
    every generation equals its run alone."""
    tok = WordTok()
    rng = random.Random(0)
    prompts = []
    for i in range(10):
        doc = " ".join(rng.choice(WORDS[:-1]).strip() for _ in range(rng.randint(25, 50)))
        prompts.append((STEM if i % 2 else "") + f"[{i}] {doc}\nAnswer:")
    eng = engine(model, blocks=16, max_batch=2)
    outs = []
    for group in (prompts[:4], prompts[4:7], prompts[7:]):
        seqs = [eng.new_sequence() for _ in group]
        for s, p in zip(seqs, group):
            eng.start(s, tok.encode(p), 5)
        finish(eng)
        outs += [list(s.out.ids) for s in seqs]
        for s in seqs:
            eng.release(s)
        assert eng.pool.num_free == eng.pool.num_blocks
    assert eng.stats["cached_hit_tokens"] > 0
    distinct = {k for p in prompts for k in chain_keys(b"", tok.encode(p), eng.pool.block_size)}
    assert len(distinct) > eng.pool.num_blocks  # more content than the pool holds: blocks were evicted
    for p, got in zip(prompts, outs):
        assert got == run_alone(model, p, 5)[0]


def test_tracked_tokens_are_never_taken_from_the_cache(model):  # noqa: F811
    """Attention tracking needs every tracked token fed by a decode step: with the whole prompt cached by an
    untracked generation, a tracked one takes only the blocks before its span, and its attention equals that of
    an engine without prefix caching."""
    tok = WordTok()
    ids = tok.encode(STEM + "Answer: Kilo Lima Mike Oscar Papa Quebec Romeo Sierra Tango Alpha Bravo")
    track = len(tok.encode(STEM))
    bs = 16
    assert (len(ids) - 1) // bs > track // bs + 1  # the cache holds blocks inside the span
    got = []
    for caching in (True, False):
        eng = engine(model, prefix_caching=caching)
        s = eng.new_sequence()
        eng.start(s, ids, 3)  # untracked: the prompt is prefilled and its full blocks cached
        finish(eng)
        eng.release(s)
        s = eng.new_sequence()
        eng.start(s, ids, 3, track_from=track)
        finish(eng)
        got.append(s.out)
    assert got[0].prefilled == len(ids) - track // bs * bs  # the blocks before the span came from the cache
    assert got[1].prefilled == len(ids)
    assert got[0].ids == got[1].ids
    assert got[0].attn == pytest.approx(got[1].attn, rel=1e-5, abs=1e-6)
    assert len(got[0].attn) == len(ids) - track + len(got[0].ids)


def test_a_shared_prefix_counts_its_prefill_time_with_its_tokens(model):  # noqa: F811
    """set_prefix adds to prefill_tokens (the perf floor is built from it), so its seconds are kept too
    (prefix_prefill_s, which fastrag.perf adds to the measured prefill): otherwise a run's measured prefill could
    come out below its own floor."""
    eng = engine(model)
    tokens0, steps0 = eng.stats["prefill_tokens"], eng.stats["prefill_s"]
    pre = eng.set_prefix(" ".join(WORDS * 4))
    assert pre is not None and eng.stats["prefill_tokens"] - tokens0 == len(pre.token_ids)
    assert eng.stats["prefix_prefill_s"] > 0 and eng.stats["prefill_s"] == steps0  # (no step ran)
