"""KV reuse on the real engine with a tiny random-initialised Llama (fp32, CPU): truncation frees exactly the blocks
past the kept tokens, the demo prefix is one physical copy shared by every sequence, a rebuilt sequence computes the
same logits as a from-scratch prefill of the same text, and a policy that continues without retrieval never
re-prefills what it already computed."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from fastrag.cache.kv import BlockTable, KVPool
from fastrag.engine import Engine
from fastrag.model.llama import LlamaModel

WORDS = [" Alpha", " Bravo", " Charlie", " Delta", " Echo", " Foxtrot", " Golf", " Hotel", " India", " Juliet",
         " Kilo", " Lima", " Mike", " Oscar", " Papa", " Quebec", " Romeo", " Sierra", " Tango", " Stop."]


class WordTok:
    """ASCII characters (ids 0-127) plus whole words with their leading space (ids 128+); EOS is the last id.
    Encoding prefers the longest word at each position, so `encode(decode(ids)) == ids` for word-only ids."""

    def __init__(self):
        self.words = sorted(WORDS, key=len, reverse=True)
        self.id_of = {w: 128 + i for i, w in enumerate(WORDS)}
        self.eos_token_id = 128 + len(WORDS)

    def __len__(self):
        return self.eos_token_id + 1

    def encode(self, s: str) -> list[int]:
        out, i = [], 0
        while i < len(s):
            for w in self.words:
                if s.startswith(w, i):
                    out.append(self.id_of[w])
                    i += len(w)
                    break
            else:
                out.append(ord(s[i]) if ord(s[i]) < 128 else ord("?"))
                i += 1
        return out

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(WORDS[t - 128] if 128 <= t < self.eos_token_id else (chr(t) if t < 128 else "")
                       for t in ids)


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig

    tok = WordTok()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=None, max_position_embeddings=4096)
    m = LlamaModel.from_hf_config(cfg, seed=0)
    with torch.no_grad():  # make the model write words only: character and EOS logits are 0, words ~N(0, 1)
        m.lm_head.weight[:128] = 0
        m.lm_head.weight[tok.eos_token_id] = 0
        m.lm_head.weight[128: tok.eos_token_id] *= 50.0
    return m


def engine(model, **kw):
    per_block = 2 * 2 * 16 * 2 * 8 * 4
    return Engine(model, WordTok(), kv_cache_gb=kw.pop("blocks", 256) * per_block / 2**30, **kw)


def finish(eng):
    while eng.has_work:
        eng.step()


# ---------------------------------------------------------------------------------------------- truncation


@pytest.mark.parametrize("n_tokens, keep", [(40, 17), (40, 16), (40, 0), (33, 32), (9, 9)])
def test_block_table_truncation_frees_exactly_the_blocks_past_the_kept_tokens(n_tokens, keep):
    pool = KVPool(1, 16, 8, 1, 4)
    t = BlockTable(pool)
    t.reserve(n_tokens)
    t.num_tokens = n_tokens
    before, free_before = list(t.blocks), pool.num_free
    t.truncate(keep)
    kept_blocks = -(-keep // 8)  # ceil: a partly used block stays
    assert t.blocks == before[:kept_blocks]
    assert pool.num_free == free_before + len(before) - kept_blocks
    for b in before[kept_blocks:]:
        assert pool.refcount[b] == 0 and b in pool._free
    for b in t.blocks:
        assert pool.refcount[b] == 1
    assert t.num_tokens == keep


def test_restart_at_a_sentence_start_frees_the_blocks_after_it(model):
    eng = engine(model)
    tok = eng.tok
    s = eng.new_sequence()
    prompt = tok.encode("Q: x?\nA:" + "".join(WORDS[:30 % len(WORDS)]) * 2)
    eng.start(s, prompt, 20)
    finish(eng)
    blocks = list(s.table.blocks)
    computed = s.computed
    # cut at a point inside the prompt (a sentence start) and append new text: lcp = cut
    cut = 21
    new = prompt[:cut] + tok.encode(" Stop. Mike")
    eng.start(s, new, 4)
    keep = -(-cut // eng.pool.block_size)
    assert s.table.blocks == blocks[:keep] and s.table.num_tokens == cut
    assert all(eng.pool.refcount[b] == 0 for b in blocks[keep:])
    assert s.out.prefilled == len(new) - cut and computed > cut
    finish(eng)


# ---------------------------------------------------------------------------------------------- shared prefix


def test_prefix_blocks_are_one_physical_copy_shared_by_every_sequence(model):
    eng = engine(model, prefix_caching=False)  # the demo prefix alone (tests/test_prefix_cache.py: own blocks)
    tok = eng.tok
    demos = "Question: one?\nAnswer: Alpha Bravo Stop.\n" * 4
    pre = eng.set_prefix(demos)
    assert pre is not None and pre.length % eng.pool.block_size == 0 and pre.length > 0
    seqs = [eng.new_sequence() for _ in range(3)]
    for i, s in enumerate(seqs):
        eng.start(s, tok.encode(demos + f"Question: q{i}?\nAnswer:"), 5)
    finish(eng)
    for b in pre.blocks:
        assert eng.pool.refcount[b] == 1 + len(seqs)  # the prefix itself + one share per sequence
    for s in seqs:
        assert s.prefix is pre and not set(s.table.blocks) & set(pre.blocks)
        assert s.out.prefilled == s.out.prompt_tokens - pre.length
    own = [set(s.table.blocks) for s in seqs]
    assert not (own[0] & own[1]) and not (own[1] & own[2])
    for s in seqs:
        eng.release(s)
    assert all(eng.pool.refcount[b] == 1 for b in pre.blocks)  # the prefix outlives its users
    assert eng.stats["prefix_hit_tokens"] == 3 * pre.length


def test_a_prompt_that_is_exactly_the_shared_prefix_runs_as_without_it(model):
    """A prompt exactly as long as the shared prefix leaves no token of its own to prefill: it must not start from the
    prefix (its last position's logits are what it samples from) and generates what it does with no prefix."""
    tok = WordTok()
    ids = tok.encode("".join(WORDS[:16]))
    outs = []
    for with_prefix in (False, True):
        eng = engine(model, prefix_caching=False)
        n = len(ids) // eng.pool.block_size * eng.pool.block_size
        if with_prefix:
            assert eng.set_prefix(tok.decode(ids[:n])).length == n > 0
        s = eng.new_sequence()
        eng.start(s, ids[:n], 5)
        finish(eng)
        assert s.out.prefilled == n
        outs.append(s.out.ids)
    assert outs[0] == outs[1] and len(outs[0]) == 5


# ---------------------------------------------------------------------------------------------- rebuild == scratch


def _capture_logits(eng):
    seen = []
    real = eng.runner.sample_launch  # every decode step's logits [B, V] pass through here to the fused signal kernel

    def spy(seqs, logits):
        seen.append(logits.detach().clone())
        return real(seqs, logits)

    eng.runner.sample_launch = spy
    return seen


def test_rebuilt_sequence_logits_equal_a_from_scratch_prefill(model):
    tok = WordTok()
    demos = "Question: one?\nAnswer: Alpha Bravo Stop.\n" * 4
    first = demos + "Question: who?\nAnswer:"
    # rebuilt: the same sequence generates, is cut back into its demos and gets a retrieval suffix
    eng = engine(model)
    eng.set_prefix(demos)
    s = eng.new_sequence()
    eng.start(s, tok.encode(first), 12)
    finish(eng)
    kept = tok.decode(s.out.ids[:5])
    rebuilt = demos + "Context:\n[1] Papa Quebec\nQuestion: who?\nAnswer:" + kept
    seen = _capture_logits(eng)
    eng.start(s, tok.encode(rebuilt), 6)
    finish(eng)
    assert s.out.prefilled < s.out.prompt_tokens  # it did reuse the prefix
    rebuilt_ids, rebuilt_logits = list(s.out.ids), torch.cat(seen)
    # from scratch: a fresh engine, no shared prefix, the whole text prefilled
    eng2 = engine(model)
    s2 = eng2.new_sequence()
    seen2 = _capture_logits(eng2)
    eng2.start(s2, tok.encode(rebuilt), 6)
    finish(eng2)
    assert s2.out.prefilled == s2.out.prompt_tokens
    assert s2.out.ids == rebuilt_ids
    torch.testing.assert_close(rebuilt_logits, torch.cat(seen2), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- policies


@dataclass
class Ex:
    qid: str
    question: str
    answers: list = field(default_factory=lambda: ["x"])


def test_continuing_without_retrieval_never_reprefills(model, monkeypatch):
    """FLARE with theta = 0 never retrieves: each look-ahead prompt is the previous one plus the accepted sentence,
    so the engine re-feeds one token per continuation; the answer generation prefills only its new suffix."""
    import fastrag.methods.common as common
    from fastrag.config import method_config
    from fastrag.data.metrics import ANSWER_PROMPT_SUFFIX
    from fastrag.loop import QuestionLoop
    from fastrag.methods.registry import get_method

    eng = engine(model, max_batch=4)
    cfg = method_config("flare", "2wikimultihopqa", overrides={
        "fewshot": 2, "generate_max_length": 40, "theta": 0.0, "retrieve_first": False, "look_ahead_tokens": 12})
    policy = get_method("flare").make_policy(cfg, eng.tok)
    eng.set_prefix(policy.shared_prefix)
    gens = []
    real = common.account

    def spy(res, g):
        gens.append((res.qid, g.prompt_tokens, g.prefilled))
        real(res, g)

    monkeypatch.setattr(common, "account", spy)
    out = []
    stats0 = dict(eng.stats)
    QuestionLoop(eng, None, policy, max_inflight=2).run([Ex("1", "Who?"), Ex("2", "Where?")], out.append)
    assert all(r.error is None for r in out), [r.error for r in out]
    assert all(r.retrievals == 0 for r in out)
    suffix = len(eng.tok.encode(ANSWER_PROMPT_SUFFIX))
    skipped = []
    for r in out:
        mine = [(n, p) for q, n, p in gens if q == r.qid]
        assert len(mine) >= 3, mine  # several look-aheads, then the answer generation
        n0, p0 = mine[0]
        # the first prompt: all but the shared demos, less whole blocks another question already computed (the
        # demos' tail after the last full prefix block is the same in both questions)
        skipped.append(n0 - eng.prefix.length - p0)
        assert skipped[-1] >= 0 and skipped[-1] % eng.pool.block_size == 0, mine
        for n, p in mine[1:-1]:
            assert p == 1, f"a continuation prefilled {p} tokens: {mine}"
        assert mine[-1][1] <= suffix + 1  # the answer prompt: " So the answer is " (+ the re-fed token)
        assert r.counters["reused_prompt_tokens"] == sum(n - p for n, p in mine)
    assert min(skipped) == 0, "the first question to start has nothing to share"
    assert eng.stats["prefill_tokens"] - stats0["prefill_tokens"] == sum(p for _, _, p in gens)


# ---------------------------------------------------------------------------------------------- a small KV pool


def _decode_all(eng, prompts, max_new):
    seqs = [eng.new_sequence() for _ in prompts]
    for s, p in zip(seqs, prompts):
        eng.start(s, p, max_new)
    finish(eng)
    return seqs


def test_a_full_pool_defers_admission_and_decodes_the_same_tokens(model):
    """Two prompts that cannot hold their blocks at once (8-block pool, 5 blocks each): the second waits while the
    first decodes (kv_waits counts the steps), then takes the blocks of the first, idle once finished (an
    eviction), and both decode what a roomy pool decodes."""
    tok = WordTok()
    prompts = [tok.encode("Q: " + "".join(WORDS[i:i + 12]) * 5) for i in (0, 5)]
    assert all(60 <= len(p) <= 72 for p in prompts), [len(p) for p in prompts]
    roomy = _decode_all(engine(model), prompts, 8)
    small = engine(model, blocks=8)
    assert small.pool.num_blocks == 8
    tight = _decode_all(small, prompts, 8)
    assert [s.out.ids for s in tight] == [s.out.ids for s in roomy]
    assert small.stats["kv_waits"] >= 1 and small.stats["evictions"] == 1
    assert not tight[0].table.blocks and small.stats["evicted_tokens"] >= len(prompts[0])
    roomy_eng = engine(model)
    _decode_all(roomy_eng, prompts, 8)
    assert (roomy_eng.stats["kv_waits"], roomy_eng.stats["evictions"], roomy_eng.stats["evicted_tokens"]) == (0, 0, 0)
    # the most blocks held at once: both prompts' blocks with room for their 8 new tokens in the roomy pool, the
    # whole small pool (the second's blocks taken while the first's idle cache still held them, then evicted) at most
    bs = roomy_eng.pool.block_size
    need = [-(-(len(p) + 8) // bs) for p in prompts]
    assert roomy_eng.stats["kv_peak_blocks"] == sum(need)
    assert max(need) <= small.stats["kv_peak_blocks"] <= 8


def test_an_idle_sequence_is_evicted_for_room_and_prefilled_again(model):
    """A question's idle sequence (between two generations) gives its blocks to a prompt that needs them when
    nothing is running; its next generation prefills its whole prompt again and decodes what it would have."""
    tok = WordTok()
    a_prompt = tok.encode("Q: " + "".join(WORDS[:10]))
    b_prompt = tok.encode("R: " + "".join(WORDS[3:15]) * 8)  # 7 of the 8 blocks

    def run(eng):
        a, b = eng.new_sequence(), eng.new_sequence()
        eng.start(a, a_prompt, 6)
        finish(eng)
        held = a.table.num_tokens
        eng.start(b, b_prompt, 6)
        finish(eng)
        held += b.table.num_tokens
        more = a.tokens + tok.encode(" Stop.")
        eng.start(a, more, 6)
        prefilled = a.out.prefilled
        finish(eng)
        return a.out.ids, b.out.ids, held, prefilled, len(more)

    want_a, want_b, _, roomy_prefill, n_more = run(engine(model))
    small = engine(model, blocks=8)
    got_a, got_b, held, prefilled, _ = run(small)
    assert (got_a, got_b) == (want_a, want_b)
    # a gives its blocks to b, then b (idle once finished) gives them back to a's continuation
    assert small.stats["evictions"] == 2 and small.stats["evicted_tokens"] == held > 0
    assert roomy_prefill < n_more  # with room, the continuation reuses a's own cache ...
    assert prefilled == n_more  # ... evicted, it prefills all of it again


def test_a_sequence_the_pool_can_never_hold_is_refused_at_start(model):
    """Room for one sequence = the pool less the shared prefixes' blocks: a generation that needs more is refused
    when it starts (ValueError naming the sizes and the fix), one that needs exactly that much runs."""
    tok = WordTok()
    eng = engine(model, blocks=8)
    prefix_text = "".join(WORDS[:16]) * 2  # 32 word tokens: two blocks
    pre = eng.set_prefix(prefix_text)
    assert pre is not None and len(pre.blocks) == 2
    body = tok.encode(prefix_text + "Q:" + "".join(WORDS[2:12]) * 9)  # 32 + 92 prompt tokens
    too_long = eng.new_sequence()
    with pytest.raises(ValueError, match=r"needs more than the 6 KV blocks .* raise --kv-cache-gb"):
        eng.start(too_long, body, 5)  # 92 + 5 own tokens: 7 blocks of 16
    assert not eng.waiting and not too_long.table.blocks
    fits = eng.new_sequence()
    eng.start(fits, body, 4)  # 96 own tokens: 6 blocks
    finish(eng)
    assert len(fits.out.ids) == 4
