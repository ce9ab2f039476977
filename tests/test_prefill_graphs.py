"""Prefills and attention passes replayed from CUDA graphs (fastrag/cuda_graphs/tokens.py `PrefillGraphs`, `PassGraphs`)
against the eager packed prefill and `last_layer_qk`.

On the CPU the protocol is emulated: the static buffers are written as on a GPU and every replay re-runs
`LlamaModel.prefill_static` on them (the paged prefill kernel and the fused small operations under
TRITON_INTERPRET=1), so a replay that reads anything but its buffers, padding that reaches a real token or a
sequence's cache, or a buffer left stale by a bigger earlier call changes a token or a slot here. On a GPU the same
tests capture and replay real graphs.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch

# (TRITON_INTERPRET=1 without a GPU, set before Triton loads, and the same device and skip rule)
from test_paged_attention_triton import DEV, pytestmark  # noqa: F401

from fastrag.cuda_graphs import PassGraphs, PrefillGraphs, token_buckets  # noqa: E402


class _Tok:
    eos_token_id = None

    def encode(self, s):
        return [int(x) for x in s.split()]


def _model(monkeypatch, seed: int = 3):
    from transformers import LlamaConfig

    from fastrag.model.llama import LlamaModel

    monkeypatch.setenv("FASTRAG_PAGED_PREFILL", "1")
    monkeypatch.setenv("FASTRAG_FUSED_DECODE", "1")
    cfg = LlamaConfig(vocab_size=90, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, eos_token_id=None, max_position_embeddings=512)
    return LlamaModel.from_hf_config(cfg, seed=seed, device=DEV)


def _engine(monkeypatch, graphs: bool, **kw):
    from fastrag.engine import Engine

    return Engine(_model(monkeypatch), _Tok(), kv_cache_gb=0.01, max_batch=kw.pop("max_batch", 8), mix_prefill=True,
                  prefill_hold=0, prefill_graphs=graphs, pass_graphs=kw.pop("pass_graphs", graphs),
                  cuda_graphs=kw.pop("cuda_graphs", False), **kw)


def _generate(eng, prompts, prefixes, max_new, rounds=2):
    """Greedy generations, prefills mixing prefixes in one call; each later round continues every sequence's own
    context (a prefill that starts after cached own tokens) with fewer sequences, so a smaller call replays a
    bucket a bigger one wrote first."""
    for p in prefixes:
        eng.set_prefix(" ".join(map(str, p)))
    seqs = [eng.new_sequence() for _ in prompts]
    out = []
    for r in range(rounds):
        live = seqs[: max(1, len(seqs) >> r)]
        for s, p, n in zip(live, prompts, max_new):
            eng.start(s, p + (s.out.ids + [5, 6, 7] if r else []), n)
        while eng.has_work:
            eng.step()
        out.append(([s.out.ids for s in live], [s.out.logprob for s in live]))
    return out


def _same(a, b):
    for (ids_a, lp_a), (ids_b, lp_b) in zip(a, b):
        assert ids_a == ids_b
        torch.testing.assert_close(torch.tensor([x for r in lp_a for x in r]),
                                   torch.tensor([x for r in lp_b for x in r]), rtol=1e-4, atol=1e-5)


def _case(seed, most_new: int = 9):
    rng = random.Random(seed)
    pa, pb = list(range(20, 36)), list(range(40, 72))  # (one block and two: the interpreter's time goes with tokens)
    prompts = [pa + [rng.randrange(1, 80) for _ in range(rng.randint(1, 24))] for _ in range(3)] \
        + [pb + [rng.randrange(1, 80) for _ in range(rng.randint(1, 24))] for _ in range(2)] \
        + [[rng.randrange(1, 80) for _ in range(rng.randint(1, 9))]]
    return prompts, [pa, pb], [rng.randint(2, most_new) for _ in prompts]


def test_token_buckets_cover_every_call_with_bounded_padding():
    for mx in (1, 16, 100, 512, 1024, 1500):
        b = token_buckets(mx)
        assert b == sorted(set(b)) and b[-1] == mx
        for n in range(1, mx + 1):
            m = next(x for x in b if x >= n)
            assert m < 2 * max(n, 16) and (n < 256 or m <= 1.5 * n)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        token_buckets(0)


def test_graphed_prefills_equal_eager(monkeypatch):
    """Prompts of 1-40 new tokens after two prefixes and none, mixed in one call, then calls that continue each
    sequence's own context with fewer sequences: the same tokens and log-probabilities as the eager prefill, and
    the graphed prefills were replayed (not skipped)."""
    prompts, prefixes, max_new = _case(random.randrange(2**31))
    eager = _engine(monkeypatch, False)
    want = _generate(eager, prompts, prefixes, max_new, rounds=3)
    eng = _engine(monkeypatch, True)
    eng.trace = []
    got = _generate(eng, prompts, prefixes, max_new, rounds=3)
    _same(got, want)
    st = eng.prefill_graphs.stats
    assert st["replays"] >= 3 and st["replays"] + st["eager_calls"] == eng.stats["prefill_calls"]
    # (the step trace marks each prefill step graphed or not: one replay a step; the two prefixes' own prefills,
    # outside any step, replayed too)
    pre = [r for r in eng.trace if r["prefill_seqs"]]
    assert all("prefill_graphed" in r for r in pre)
    assert sum(r["prefill_graphed"] for r in pre) == st["replays"] - len(prefixes)
    assert eng.stats["prefill_calls"] == eager.stats["prefill_calls"]
    assert eng.stats["prefill_tokens"] == eager.stats["prefill_tokens"]


def test_padding_writes_only_the_scratch_block(monkeypatch):
    """A graphed prefill changes the pool at its tokens' slots and in the graphs' scratch block, nowhere else."""
    eng = _engine(monkeypatch, True)
    for layer in range(len(eng.pool.k)):
        eng.pool.k[layer].normal_()
        eng.pool.v[layer].normal_()
    before = [t.clone() for t in eng.pool.k + eng.pool.v]
    s = eng.new_sequence()
    eng.start(s, [1, 2, 3, 4, 5, 6, 7], 1)  # 7 tokens in the 16-token bucket: 9 padding rows
    eng.step()
    written = set(s.table.slots(0, 7))
    bs = eng.pool.block_size
    own = set(range(s.table.blocks[0] * bs, (s.table.blocks[0] + 1) * bs))  # (zeroed when allocated)
    scratch = set(range(eng.prefill_graphs.scratch_block * bs, (eng.prefill_graphs.scratch_block + 1) * bs))
    assert eng.prefill_graphs.stats["replays"] == 1 and len(s.table.blocks) == 1
    for t0, t1 in zip(before, eng.pool.k + eng.pool.v):
        changed = set((t0 != t1).any(-1).any(0).nonzero().flatten().tolist())
        assert written <= changed and changed <= own | scratch and changed & scratch
        assert (t1[:, sorted(own - written)] == 0).all()  # the rest of its block as allocated: nothing written


def test_decode_and_prefill_graphs_share_one_scratch_block(monkeypatch):
    """With the decode graphs and the prefill graphs both on (the GPU default), the pool gives up one block to
    padding, not one per kind of graph: the prefill graphs write their padding into the decode graphs' scratch block.
    The tokens equal eager decoding's, and once every sequence and prefix is released every block but that one is
    free again."""
    prompts, prefixes, max_new = _case(random.randrange(2**31), most_new=4)
    want = _generate(_engine(monkeypatch, False), prompts, prefixes, max_new, rounds=2)
    eng = _engine(monkeypatch, True, cuda_graphs=True)
    assert eng.graphs is not None and eng.prefill_graphs.scratch_block == eng.graphs.scratch_block
    assert eng.pool.num_free == eng.pool.num_blocks - 1
    got = _generate(eng, prompts, prefixes, max_new, rounds=2)
    _same(got, want)
    assert eng.prefill_graphs.stats["replays"] > 0 and eng.graphs.stats["replays"] > 0
    for s in list(eng.live.values()):
        eng.release(s)
    eng.clear_prefixes()
    assert eng.pool.num_free == eng.pool.num_blocks - 1
    from fastrag.cuda_graphs import PrefillGraphs as PG

    with pytest.raises(ValueError, match="scratch_block must be a block of the pool"):
        PG(eng.model, eng.pool, ctx_blocks=4, scratch_block=eng.pool.num_blocks, emulate=True)


def test_calls_that_do_not_fit_a_graph_prefill_eagerly(monkeypatch):
    """More sequences than a graph takes, more tokens than its largest bucket, or more prefix slots than its buffer:
    eager prefills, with the same results."""
    prompts, prefixes, max_new = _case(random.randrange(2**31), most_new=2)
    want = _generate(_engine(monkeypatch, False), prompts, prefixes, max_new, rounds=1)
    for cap in ({"max_seqs": 2}, {"max_tokens": 16}, {"max_prefix_slots": 40}):
        eng = _engine(monkeypatch, True)
        g = eng.prefill_graphs
        eng.prefill_graphs = PrefillGraphs(eng.model, eng.pool, ctx_blocks=g.width, emulate=g.emulate,
                                           **{"max_tokens": 64, "max_seqs": 8} | cap)
        _same(_generate(eng, prompts, prefixes, max_new, rounds=1), want)
        assert eng.prefill_graphs.stats["eager_calls"] >= 1, cap


def test_a_failed_capture_warns_and_prefills_eagerly(monkeypatch):
    """A capture that raises: a warning, that call eager (same results); the third failure turns graphs off."""
    prompts, prefixes, max_new = _case(7, most_new=2)
    prompts, max_new = prompts[2:], max_new[2:]  # (both prefixes and none; fewer tokens for the interpreter)
    want = _generate(_engine(monkeypatch, False), prompts, prefixes, max_new)
    eng = _engine(monkeypatch, True)

    def broken(M):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(eng.prefill_graphs, "_capture", broken)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = _generate(eng, prompts, prefixes, max_new)
    _same(got, want)
    msgs = [str(x.message) for x in w if "capture of a prefill of" in str(x.message)]
    assert msgs and "operation not permitted" in msgs[0] and "this call runs eagerly" in msgs[0]
    assert eng.prefill_graphs.disabled and "eager from now on" in msgs[-1]
    assert eng.prefill_graphs.stats["replays"] == 0


def test_capture_ahead_captures_every_bucket_once(monkeypatch):
    """Engine.capture_graphs captures each token bucket's prefill graph once; a run after it captures none."""
    eng = _engine(monkeypatch, True)
    g, pg = eng.prefill_graphs, eng.pass_graphs
    assert eng.capture_graphs() == 0  # (no decode graphs here: the count is theirs)
    assert sorted(g.graphs) == g.buckets and g.stats["captured_ahead"] == len(g.buckets)
    assert sorted(pg.graphs) == pg.buckets and pg.stats["captured_ahead"] == len(pg.buckets)
    eng.capture_graphs()
    prompts, prefixes, max_new = _case(3, most_new=2)
    _generate(eng, prompts, prefixes, max_new, rounds=1)
    assert g.stats["captures"] == len(g.buckets) and g.stats["replays"] >= 2
    eng.attention_passes([[1, 2, 3], [4, 5]], "colmax")
    assert pg.stats["captures"] == len(pg.buckets) and pg.stats["replays"] == 1


def test_default_and_switch(monkeypatch):
    """Off on a CPU unless asked for; on a GPU on with the decode graphs unless $FASTRAG_PREFILL_GRAPHS=0; a
    setting that is not a bool is named."""
    from fastrag.engine import Engine

    m = _model(monkeypatch)
    monkeypatch.delenv("FASTRAG_PREFILL_GRAPHS", raising=False)
    eng = Engine(m, _Tok(), kv_cache_gb=0.01, max_batch=4)
    assert (eng.prefill_graphs is not None) == (DEV == "cuda")
    assert (eng.pass_graphs is not None) == (DEV == "cuda")
    monkeypatch.setenv("FASTRAG_PREFILL_GRAPHS", "0")
    eng = Engine(m, _Tok(), kv_cache_gb=0.01, max_batch=4)
    assert eng.prefill_graphs is None and (eng.pass_graphs is not None) == (DEV == "cuda")
    monkeypatch.setenv("FASTRAG_PASS_GRAPHS", "0")
    assert Engine(m, _Tok(), kv_cache_gb=0.01, max_batch=4).pass_graphs is None
    monkeypatch.setenv("FASTRAG_PASS_GRAPHS", "maybe")
    with pytest.raises(ValueError, match="FASTRAG_PASS_GRAPHS='maybe'"):
        Engine(m, _Tok(), kv_cache_gb=0.01, max_batch=4)
    monkeypatch.delenv("FASTRAG_PASS_GRAPHS")
    for arg in ("prefill_graphs", "pass_graphs"):
        with pytest.raises(ValueError, match=f"{arg} must be a bool or None"):
            Engine(m, _Tok(), kv_cache_gb=0.01, max_batch=4, **{arg: "yes"})
    if DEV == "cpu":
        with pytest.raises(ValueError, match="use emulate=True"):
            PrefillGraphs(m, eng.pool, ctx_blocks=8)
        with pytest.raises(ValueError, match="use emulate=True"):
            PassGraphs(m)


def _lists(rng, n, longest):
    return [[rng.randrange(1, 90) for _ in range(rng.randint(1, longest))] for _ in range(n)]


def test_prefill_graphs_take_calls_up_to_the_prefill_budget(monkeypatch):
    """The prefill graphs' largest bucket is the engine's prefill token budget (4,096 by default) unless
    $FASTRAG_PREFILL_GRAPH_TOKENS says less, and a call takes up to 32 sequences (the H200's 1,000-question run
    prefilled 245 calls of 1,024-3,900 tokens and 2-38 sequences eagerly while the graphs stopped at 1,024 and 16); a
    setting below the smallest bucket, or not an integer, is named."""
    from fastrag.engine import Engine

    m = _model(monkeypatch)
    monkeypatch.delenv("FASTRAG_PREFILL_GRAPH_TOKENS", raising=False)
    g = Engine(m, _Tok(), kv_cache_gb=0.01, max_batch=64, prefill_graphs=True).prefill_graphs
    assert g.buckets[-1] == 4096 and g.max_seqs == 32 and 1280 in g.buckets
    g = Engine(m, _Tok(), kv_cache_gb=0.01, max_batch=8, max_prefill_tokens=2000, prefill_graphs=True).prefill_graphs
    assert g.buckets[-1] == 2000 and g.max_seqs == 8
    monkeypatch.setenv("FASTRAG_PREFILL_GRAPH_TOKENS", "1024")
    assert Engine(m, _Tok(), kv_cache_gb=0.01, prefill_graphs=True).prefill_graphs.buckets[-1] == 1024
    for bad in ("8", "lots"):
        monkeypatch.setenv("FASTRAG_PREFILL_GRAPH_TOKENS", bad)
        with pytest.raises(ValueError, match=f"FASTRAG_PREFILL_GRAPH_TOKENS='{bad}'"):
            Engine(m, _Tok(), kv_cache_gb=0.01, prefill_graphs=True)


def test_graphed_attention_passes_equal_eager(monkeypatch):
    """Engine.attention_passes (colmax and rows) from the pass graphs and eagerly: the same signals, over calls of
    several lists and then fewer, shorter ones in a bucket a bigger call wrote first; the engine's KV pool is not
    touched (the graphs' keys live in their own scratch pool)."""
    rng = random.Random(random.randrange(2**31))
    calls = [(_lists(rng, 5, 24), "colmax"), (_lists(rng, 3, 20), "rows"), (_lists(rng, 2, 9), "colmax"),
             (_lists(rng, 1, 5), "rows")]
    eager = _engine(monkeypatch, False)
    want = [eager.attention_passes(x, kind) for x, kind in calls]
    eng = _engine(monkeypatch, True)
    pool = [t.clone() for t in eng.pool.k + eng.pool.v]
    got = [eng.attention_passes(x, kind) for x, kind in calls]
    assert eng.pass_graphs.stats["replays"] == len(calls) and eng.pass_graphs.stats["eager_calls"] == 0
    for (x, kind), a, b in zip(calls, got, want):
        for ra, rb in zip(a, b):
            if kind == "colmax":
                ra, rb = torch.tensor(ra), torch.tensor(rb)
            torch.testing.assert_close(ra, rb, rtol=1e-4, atol=1e-6)
    # (bit for bit: blocks never allocated hold whatever the allocator left, NaN included)
    assert all(torch.equal(t0.view(torch.uint8), t1.view(torch.uint8)) for t0, t1 in zip(pool, eng.pool.k + eng.pool.v))


def test_the_pass_graphs_q_and_k_equal_last_layer_qk(monkeypatch):
    """PassGraphs.run against the model's own last_layer_qk: q and k of the real rows, zeros past each length."""
    rng = random.Random(random.randrange(2**31))
    m = _model(monkeypatch)
    g = PassGraphs(m, max_tokens=128, max_seqs=8, emulate=DEV != "cuda")
    for n, longest in ((6, 20), (2, 7)):
        lists = _lists(rng, n, longest)
        T = max(map(len, lists))
        ids = torch.zeros(n, T, dtype=torch.long)
        for b, x in enumerate(lists):
            ids[b, : len(x)] = torch.tensor(x)
        lens = torch.tensor([len(x) for x in lists])
        with torch.inference_mode():
            q, k = g.run(lists)
            q0, k0 = m.last_layer_qk(ids.to(DEV), lens.to(DEV), lens.tolist())
        torch.testing.assert_close(q, q0, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(k, k0, rtol=1e-4, atol=1e-5)
        past = torch.arange(T)[None, :] >= lens[:, None]  # [n, T]
        assert (q.transpose(1, 2)[past.to(q.device)] == 0).all() and (k.transpose(1, 2)[past.to(k.device)] == 0).all()


def test_passes_are_grouped_for_the_graphs_and_the_rest_run_eagerly(monkeypatch):
    """With pass graphs the engine groups a call's lists by the graphs' limits (lists, tokens): a cap of 2 lists makes
    groups of at most 2, all replayed; a list longer than the largest bucket runs eagerly. The same results as
    without graphs either way; PassGraphs.run itself refuses what does not fit."""
    rng = random.Random(random.randrange(2**31))
    lists = _lists(rng, 5, 20) + [[rng.randrange(1, 90) for _ in range(21)]]
    want = _engine(monkeypatch, False).attention_passes(lists, "colmax")
    for cap in ({"max_seqs": 2}, {"max_tokens": 16}):
        eng = _engine(monkeypatch, True)
        eng.pass_graphs = g = PassGraphs(eng.model, emulate=eng.pass_graphs.emulate, **{"max_tokens": 256} | cap)
        sizes = []
        run = g.run
        g.run = lambda x: sizes.append(len(x)) or run(x)  # noqa: E731
        eng._trace_row = row = {}  # (what a step's launch sets: its passes' forwards are counted in its row)
        got = eng.attention_passes(lists, "colmax")
        assert row["pass_graphed"] == g.stats["replays"] and row["pass_calls"] == len(sizes)
        assert (row["pass_lists"], row["pass_tokens"]) == (6, sum(map(len, lists)))
        assert row["pass_ctx_tokens"] == sum(len(x) * (len(x) + 1) // 2 for x in lists)
        for a, b in zip(got, want):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-6)
        if "max_seqs" in cap:
            assert max(sizes) <= 2 and sum(sizes) == 6 and g.stats["eager_calls"] == 0 and g.stats["replays"] >= 3
        else:  # (the 21-token list, and any other over 16, in eager calls)
            assert g.stats["eager_calls"] >= 1 and sum(sizes) == 6
        eager = g.stats["eager_calls"]
        assert g.run([[1, 2]] * (g.max_seqs + 1)) is None and g.run([[1] * (g.buckets[-1] + 1)]) is None
        assert g.stats["eager_calls"] == eager + 2


def test_every_static_input_starts_16_byte_aligned(monkeypatch):
    """The graphs' input views share two buffers; each starts at a multiple of 16 bytes whatever the sizes (odd
    sequence caps and token budgets too), as a tensor of its own would, so the kernels see the alignment Triton
    specialises on in the eager calls."""
    from fastrag.engine import Engine

    for max_batch, budget in ((5, 100), (8, 4096), (3, 37)):
        eng = Engine(_model(monkeypatch), _Tok(), kv_cache_gb=0.01, max_batch=max_batch, max_prefill_tokens=budget,
                     prefill_graphs=True, pass_graphs=True, cuda_graphs=False)
        for g in (eng.prefill_graphs, eng.pass_graphs):
            for M in g.buckets:
                views = g._views(M)
                assert all(v.data_ptr() % 16 == 0 for v in views), (type(g).__name__, max_batch, budget, M)
                assert views[-1].shape == (g.n_tiles(M), 2) and views[-2].shape == (g.max_seqs + 1, 5)
