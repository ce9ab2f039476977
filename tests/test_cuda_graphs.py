"""Decode steps through DecodeGraphs (fastrag/cuda_graphs/decode.py): on the CPU the graph protocol is emulated (buffers
and AttnBatch built once at capture, every replay re-runs the forward on them), so any dependence of a step on
something outside the static buffers, a padding row that leaks into a real one, or a bucket that is reused with
stale contents changes a token here. On a GPU the same tests capture real CUDA graphs."""

from __future__ import annotations

import warnings

import pytest
import torch

from fastrag.cuda_graphs import DecodeGraphs, batch_buckets
from fastrag.engine import Engine, SamplingParams
from fastrag.model.llama import LlamaModel

DEV = "cuda" if torch.cuda.is_available() else "cpu"


class Tok:
    eos_token_id = None

    def encode(self, s):
        return [int(x) for x in s.split()]


def LlamaConfig(**kw):  # (transformers imported lazily: at collection it would import triton before the modules
    from transformers import LlamaConfig as C  # that set TRITON_INTERPRET=1 for their interpreted kernels)

    return C(**kw)


CFG = dict(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
           num_key_value_heads=2, eos_token_id=None)
PREFIX = list(range(20, 52))  # 32 tokens: two whole blocks of 16


def _engine(graphs: bool, native: bool = True, **kw) -> Engine:
    m = LlamaModel.from_hf_config(LlamaConfig(**CFG), seed=5, device=DEV)
    if not native:
        m.native_decode = None
    return Engine(m, Tok(), kv_cache_gb=kw.pop("kv_cache_gb", 0.02), max_batch=kw.pop("max_batch", 12),
                  cuda_graphs=graphs, **kw)


def _run(eng: Engine, prompts, max_new, prefix=True, track=False):
    if prefix:
        eng.set_prefix(" ".join(map(str, PREFIX)))
    seqs = [eng.new_sequence() for _ in prompts]
    for s, p, n in zip(seqs, prompts, max_new):
        eng.start(s, p, n, track_from=len(p) - 2 if track else None)
    batches = set()
    while eng.has_work:
        batches.add(len(eng.running))
        eng.step()
    out = [(s.out.ids, s.out.logprob, s.out.entropy, s.out.attn) for s in seqs]
    return out, batches


def _prompts(n, seed=0, prefix=True):
    g = torch.Generator().manual_seed(seed)
    head = PREFIX if prefix else []
    return [head + torch.randint(1, 96, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _same(a, b):
    for (ia, la, ea, aa), (ib, lb, eb, ab) in zip(a, b):
        assert ia == ib
        torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.tensor(ea), torch.tensor(eb), rtol=1e-4, atol=1e-4)
        if aa is not None or ab is not None:
            torch.testing.assert_close(torch.tensor(aa), torch.tensor(ab), rtol=1e-4, atol=1e-5)


def test_batch_buckets_cover_every_batch_size():
    for mb in (1, 5, 16, 64, 100, 256, 300):
        b = batch_buckets(mb)
        assert b == sorted(set(b)) and b[0] == 1 and b[-1] == mb
        for n in range(1, mb + 1):  # every batch has a bucket, and padding stays under 2x (1.5x from 16 on)
            k = next(x for x in b if x >= n)
            assert k < 2 * n or n == 1 or k == n + 1
            if n >= 16:
                assert k <= 1.5 * n


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("prefix", [True, False])
def test_graphed_decode_equals_eager(native, prefix):
    """Sequences of different lengths and budgets, so the batch shrinks step by step (several batch and block
    buckets, graphs replayed with other contents than at capture): same tokens, logprobs and entropies."""
    prompts = _prompts(9, seed=1, prefix=prefix)
    max_new = [3, 17, 9, 30, 1, 24, 12, 5, 40]
    eager, _ = _run(_engine(False, native), prompts, max_new, prefix)
    eng = _engine(True, native)
    got, batches = _run(eng, prompts, max_new, prefix)
    _same(got, eager)
    st = eng.graphs.stats
    assert len(batches) >= 4 and st["captures"] >= 3 and st["replays"] > 3 * st["captures"]
    assert st["eager_steps"] == 0 and eng.graphs.disabled is None
    assert eng.stats["decode_steps"] == st["replays"]
    assert eng.stats["decode_tokens"] == sum(len(o[0]) for o in got) - len(prompts)  # first tokens come from prefill


def test_graphed_decode_tracks_attention_like_eager():
    """DRAGIN's in-context attention maxima (last layer's queries + the decode attention's LSE, read from the
    graph's outputs) equal those of eager decoding."""
    prompts = _prompts(5, seed=2)
    max_new = [6, 20, 11, 2, 15]
    eager, _ = _run(_engine(False), prompts, max_new, track=True)
    got, _ = _run(_engine(True), prompts, max_new, track=True)
    assert all(o[3] is not None and len(o[3]) > 2 for o in got)
    _same(got, eager)


@pytest.mark.parametrize("top_k", [0, 20])
def test_graphed_decode_with_top_p_sampling_equals_eager(top_k):
    prompts = _prompts(6, seed=3)
    max_new = [10, 4, 16, 8, 12, 3]
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=11, top_k=top_k)
    eager, _ = _run(_engine(False, sampling=sp), prompts, max_new)
    got, _ = _run(_engine(True, sampling=sp), prompts, max_new)
    _same(got, eager)


def test_padding_rows_never_touch_a_sequence_cache():
    """One sequence in a bucket of 2+ rows: the padding rows write only to the scratch block, which no sequence or
    prefix ever holds; the pool's free count accounts for it; the live sequence's KV equals eager decoding's."""
    prompts = _prompts(3, seed=4)
    outs = {}
    for graphs in (False, True):
        eng = _engine(graphs)
        eng.set_prefix(" ".join(map(str, PREFIX)))
        seqs = [eng.new_sequence() for _ in prompts]
        for s, p, n in zip(seqs, prompts, [2, 2, 20]):  # two finish early: one sequence decodes in a bucket
            eng.start(s, p, n)
        while eng.has_work:
            eng.step()
        s = seqs[2]
        slots = torch.tensor(s.table.slots(0, s.table.num_tokens), device=eng.device)
        outs[graphs] = (s.out.ids, [k.index_select(1, slots).cpu() for k in eng.pool.k])
        if graphs:
            sb = eng.graphs.scratch_block
            assert eng.pool.refcount[sb] == 1
            held = {b for x in eng.live.values() for b in x.table.blocks} | set(eng.prefix.blocks)
            assert sb not in held
            for x in seqs:
                eng.release(x)
            eng.clear_prefixes()
            assert eng.pool.num_free == eng.pool.num_blocks - 1  # everything back but the scratch block
    assert outs[True][0] == outs[False][0]
    for a, b in zip(outs[True][1], outs[False][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("track", [False, True])
@pytest.mark.parametrize("native", [True, False])
def test_mixed_prefix_batches_replay_graphs_like_eager(native, track):
    """A batch of sequences of two prefixes and of none replays a graph of that set of prefixes (with a model that
    decodes mixed batches in one forward) and gives the tokens, log-probabilities, entropies and tracked attention
    of an engine without graphs. The torch cascade path (no paged kernel) decodes each family in its own forward:
    those steps stay eager."""
    pb = list(range(50, 82))
    prompts = [PREFIX + [1, 2, 3], pb + [4, 5], PREFIX + [9, 6], pb + [7, 7, 7, 7], [3, 1, 4, 1, 5], PREFIX + [8] * 20]

    def run(graphs):
        eng = _engine(graphs, native)
        eng.set_prefix(" ".join(map(str, PREFIX)))
        eng.set_prefix(" ".join(map(str, pb)))
        seqs = [eng.new_sequence() for _ in prompts]
        for s, p, n in zip(seqs, prompts, (8, 12, 5, 9, 11, 7)):
            eng.start(s, p, n, track_from=len(p) - 2 if track else None)
        mixed = 0
        while eng.has_work:
            mixed += len({id(s.prefix) for s in eng.running}) > 1 and not eng.waiting
            eng.step()
        return [(s.out.ids, s.out.logprob, s.out.entropy, s.out.attn) for s in seqs], eng, mixed

    want, plain, _ = run(False)
    got, eng, mixed = run(True)
    _same(got, want)
    assert [x[0] for x in got] == [x[0] for x in want] and all(len(x[0]) > 0 for x in got)
    assert mixed > 0
    st = eng.graphs.stats
    if eng.model.mixes_prefixes:
        assert st["replays"] == eng.stats["decode_steps"] and st["eager_steps"] == 0
        assert any(k[2] is not None and k[2][0] == "mixed" for k in eng.graphs.graphs)
    else:
        assert st["replays"] <= eng.stats["decode_steps"] - mixed
        assert not any(k[2] is not None and k[2][0] == "mixed" for k in eng.graphs.graphs)
    assert eng.stats["decode_steps"] == plain.stats["decode_steps"]


def test_mixed_graph_over_more_prefixes_than_its_cap_decodes_eagerly(monkeypatch):
    """A batch of more prefixes than one graph may mix decodes eagerly (and still gives eager tokens)."""
    import fastrag.cuda_graphs.decode as cg_decode  # (the module whose DecodeGraphs reads the cap)

    monkeypatch.setattr(cg_decode, "MAX_PREFIXES", 1)
    pb = list(range(50, 82))
    prompts = [PREFIX + [1, 2, 3], pb + [4, 5], PREFIX + [9], pb + [7, 7, 7, 7]]

    def run(graphs):
        eng = _engine(graphs)
        eng.set_prefix(" ".join(map(str, PREFIX)))
        eng.set_prefix(" ".join(map(str, pb)))
        seqs = [eng.new_sequence() for _ in prompts]
        for s, p in zip(seqs, prompts):
            eng.start(s, p, 8)
        while eng.has_work:
            eng.step()
        return [s.out.ids for s in seqs], eng

    want, _ = run(False)
    got, eng = run(True)
    assert got == want
    assert eng.graphs.stats["eager_steps"] > 0
    assert not any(k[2] is not None and k[2][0] == "mixed" for k in eng.graphs.graphs)


def test_prefix_group_members_equal_row_groups():
    """The graph form of a mixed decode batch (every prefix's GEMM over all rows, merged where `member`) gives the
    output and row log-sum-exp of the eager form (each prefix's GEMM over its own rows), rows of no prefix too;
    fresh random queries and cache contents."""
    from fastrag.model.attention.paged_native import decode_paged
    from fastrag.model.llama import AttnBatch, PrefixGroup

    m = LlamaModel.from_hf_config(LlamaConfig(**CFG), seed=5, device=DEV)
    if m.paged_decode_op(torch.device(DEV), torch.float32) is None:
        pytest.skip("no paged decode kernel for float32 on this device: mixed batches decode per family here")
    g = torch.Generator(device="cpu").manual_seed(11)
    H, Hkv, D, bs, nblk = 6, 2, 8, 16, 12
    kp = torch.randn(Hkv, nblk * bs, D, generator=g).to(DEV)
    vp = torch.randn(Hkv, nblk * bs, D, generator=g).to(DEV)
    B = 7
    q = torch.randn(B, H, D, generator=g).to(DEV)
    which = [0, 1, -1, 0, 1, 1, -1]  # prefix of each row (-1: none)
    pre = [(32, 0), (20, -1)]  # prefix 0: consecutive slots 0..31; prefix 1: gathered slots
    slots = [torch.arange(32), torch.randperm(nblk * bs, generator=g)[:20]]
    ctx = torch.tensor([[2 + b % 3, 3 + b % 5] for b in range(B)]).to(DEV)
    lens = torch.tensor([5 + 3 * b for b in range(B)]).to(DEV)
    base = dict(write_slots=torch.zeros(B, dtype=torch.long, device=DEV),
                valid=torch.ones(B, 1, dtype=torch.bool, device=DEV),
                positions=torch.zeros(B, 1, dtype=torch.long, device=DEV), prefix_len=0,
                prefix_slots=torch.zeros(0, dtype=torch.long, device=DEV), ctx_blocks=ctx, ctx_lens=lens,
                block_size=bs)
    rows = [torch.tensor([b for b in range(B) if which[b] == k]).to(DEV) for k in range(2)]
    eager = AttnBatch(**base, prefix_groups=[PrefixGroup(rows[k], pre[k][0], slots[k].to(DEV), pre[k][1])
                                             for k in range(2)])
    member = torch.tensor([[w == k for w in which] for k in range(2)]).to(DEV)
    graph = AttnBatch(**base, prefix_groups=[PrefixGroup(None, pre[k][0], slots[k].to(DEV), pre[k][1],
                                                         member=member[k]) for k in range(2)])
    o_want, l_want = decode_paged(m, q, eager, kp, vp, want_lse=True)
    o_got = torch.full_like(o_want, float("nan"))
    l_got = torch.full_like(l_want, float("nan"))
    o, lse = decode_paged(m, q, graph, kp, vp, want_lse=True)
    o_got.copy_(o)
    l_got.copy_(lse)
    torch.testing.assert_close(o_got, o_want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l_got, l_want, rtol=1e-5, atol=1e-5)
    alone = AttnBatch(**base)  # rows of no prefix: their own context only, exactly
    o_own, l_own = decode_paged(m, q, alone, kp, vp, want_lse=True)
    none = [b for b in range(B) if which[b] < 0]
    assert torch.equal(o_got[none], o_own[none]) and torch.equal(l_got[none], l_own[none])
    assert not torch.allclose(o_got[0], o_own[0])  # a prefix row did take its prefix in


def test_failed_capture_warns_and_decodes_eagerly(monkeypatch):
    prompts = _prompts(4, seed=5)
    want, _ = _run(_engine(False), prompts, [8] * 4)
    eng = _engine(True)

    def boom(*a, **k):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(eng.graphs, "_capture", boom)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got, _ = _run(eng, prompts, [8] * 4)
    msgs = [str(x.message) for x in w if "CUDA graph capture failed" in str(x.message)]
    assert len(msgs) == 3 and all("stream is capturing" in m for m in msgs)  # three tries, then off for good
    assert "this step decodes eagerly" in msgs[0] and "from now on" in msgs[2]
    assert eng.graphs.disabled and eng.graphs.stats["replays"] == 0 and eng.graphs.stats["eager_steps"] > 3
    _same(got, want)


def test_one_failed_capture_is_retried(monkeypatch):
    prompts = _prompts(4, seed=5)
    want, _ = _run(_engine(False), prompts, [8] * 4)
    eng = _engine(True)
    real, calls = eng.graphs._capture, []

    def flaky(*a, **k):
        calls.append(a)
        if len(calls) == 1:
            raise RuntimeError("operation not permitted when stream is capturing")
        return real(*a, **k)

    monkeypatch.setattr(eng.graphs, "_capture", flaky)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        got, _ = _run(eng, prompts, [8] * 4)
    assert eng.graphs.disabled is None and eng.graphs.failures == 1
    assert eng.graphs.stats["eager_steps"] == 1 and eng.graphs.stats["replays"] > 0 and calls[0] == calls[1]
    _same(got, want)


def test_graph_cap_and_oversized_batches_fall_back_to_eager():
    prompts = _prompts(6, seed=6)
    max_new = [2, 4, 6, 8, 10, 12]
    want, _ = _run(_engine(False), prompts, max_new)
    eng = _engine(True)
    eng.graphs.max_graphs = 1
    got, _ = _run(eng, prompts, max_new)
    _same(got, want)
    assert len(eng.graphs.graphs) == 1 and eng.graphs.stats["eager_steps"] > 0 and eng.graphs.stats["replays"] > 0
    g = eng.graphs
    assert g.bucket(g.buckets[-1] + 1, 3) is None
    if g.width is not None:  # a paged kernel: every graph as wide as the model's context
        assert g.width == -(-eng.max_context // eng.pool.block_size)
        assert g.bucket(5, 3) == (8, g.width) and g.bucket(1, 1) == (1, g.width) and g.bucket(12, 9) == (12, g.width)
        assert g.bucket(1, g.width + 1) is None
    # without a fixed width (the torch cascade): the step's longest context rounded up to a power of two
    p = DecodeGraphs(eng.model, eng.pool, 12, emulate=DEV != "cuda")
    assert p.width is None
    assert p.bucket(5, 3) == (8, 4) and p.bucket(1, 1) == (1, 1) and p.bucket(12, 9) == (12, 16)
    assert p.bucket(1, 10_000) == (1, 16384)
    with pytest.raises(ValueError, match="ctx_blocks"):
        DecodeGraphs(eng.model, eng.pool, 12, emulate=DEV != "cuda", ctx_blocks=0)


def test_graphs_captured_ahead_serve_every_step_of_a_run():
    """With the paged kernel a graph depends on batch bucket and prefix set only: Engine.capture_graphs() captures
    each prefix's graphs and the mixed set's for every bucket before the run, and a run whose batch shrinks and whose
    contexts grow across several powers of two (16 to 120+ tokens, 1 to 8+ blocks) then captures nothing; its
    tokens, log-probabilities and entropies equal eager decoding's."""
    pb = list(range(50, 82))
    g = torch.Generator().manual_seed(21)
    prompts = [(PREFIX if i % 2 else pb) + torch.randint(1, 96, (int(torch.randint(1, 30, (1,), generator=g)),),
                                                         generator=g).tolist() for i in range(10)]
    max_new = [4, 90, 12, 60, 7, 33, 100, 2, 45, 70]

    def run(graphs):
        eng = _engine(graphs)
        eng.set_prefix(" ".join(map(str, PREFIX)))
        eng.set_prefix(" ".join(map(str, pb)))
        ahead = eng.capture_graphs() if graphs else 0
        eng.trace = []  # (the steps' rows: one that captured a graph says how many)
        seqs = [eng.new_sequence() for _ in prompts]
        for s, p, n in zip(seqs, prompts, max_new):
            eng.start(s, p, n)
        sizes, longest = set(), 0
        while eng.has_work:
            sizes.add(len(eng.running))
            longest = max([longest] + [s.table.num_tokens for s in eng.running])
            eng.step()
        return [(s.out.ids, s.out.logprob, s.out.entropy, None) for s in seqs], eng, ahead, sizes, longest

    want, _, _, _, _ = run(False)
    got, eng, ahead, sizes, longest = run(True)
    _same(got, want)
    gr = eng.graphs
    if gr.width is None:
        pytest.skip("no paged decode kernel here: graphs follow the context's length and are captured as needed")
    sets = 3 if eng.model.mixes_prefixes else 2
    assert ahead == sets * len(gr.buckets) == len(gr.graphs)
    assert {k[1] for k in gr.graphs} == {gr.width}
    assert len(sizes) >= 4 and longest > 96  # (several batch buckets, contexts past 6 blocks of 16)
    assert gr.stats["captures"] == ahead and gr.stats["replays"] == eng.stats["decode_steps"] > 0
    assert gr.stats["eager_steps"] == 0 and not any("graph_captures" in r for r in eng.trace)
    assert eng.capture_graphs() == 0  # nothing new to capture
    # without the captures ahead, the steps that capture say so in their trace rows
    lazy = _engine(True)
    lazy.set_prefix(" ".join(map(str, PREFIX)))
    lazy.trace = []
    cap0 = lazy._captures()  # (on a GPU the prefix's prefill may have captured a prefill graph)
    _run(lazy, [p for p in prompts if p[:32] == PREFIX], [n for p, n in zip(prompts, max_new) if p[:32] == PREFIX],
         prefix=False)
    caps = [r["graph_captures"] for r in lazy.trace if "graph_captures" in r]
    # (a row counts every graph its step captured: decode, and on a GPU prefill graphs too)
    assert sum(caps) == lazy._captures() - cap0 and len(caps) > 1
    assert lazy.graphs.stats["captures"] == len(lazy.graphs.graphs) > 1


def test_three_prefixes_capture_every_subset_ahead():
    """Three families, one finishing long before the others: the batches mix all three, then two. Every set of two
    or more prefixes was captured ahead, so no step captures; tokens equal eager decoding's."""
    fams = [PREFIX, list(range(50, 82)), list(range(10, 42))]
    g = torch.Generator().manual_seed(33)
    prompts, max_new = [], []
    for k, fam in enumerate(fams):
        for _ in range(3):
            prompts.append(fam + torch.randint(1, 96, (int(torch.randint(1, 12, (1,), generator=g)),),
                                               generator=g).tolist())
            max_new.append(3 if k == 0 else int(torch.randint(20, 40, (1,), generator=g)))

    def run(graphs):
        eng = _engine(graphs)
        for fam in fams:
            eng.set_prefix(" ".join(map(str, fam)))
        ahead = eng.capture_graphs() if graphs else 0
        seqs = [eng.new_sequence() for _ in prompts]
        for s, p, n in zip(seqs, prompts, max_new):
            eng.start(s, p, n)
        mixes = set()
        while eng.has_work:
            mixes.add(len({id(s.prefix) for s in eng.running}))
            eng.step()
        return [s.out.ids for s in seqs], eng, ahead, mixes

    want, _, _, _ = run(False)
    got, eng, ahead, mixes = run(True)
    assert got == want
    gr = eng.graphs
    if gr.width is None or not eng.model.mixes_prefixes:
        pytest.skip("no paged decode kernel here, or a model that decodes each prefix family on its own")
    assert {2, 3} <= mixes
    assert ahead == 7 * len(gr.buckets) == gr.stats["captures"]  # 3 alone, 3 pairs, 1 triple
    assert gr.stats["replays"] == eng.stats["decode_steps"] and gr.stats["eager_steps"] == 0


def test_capture_ahead_without_a_prefix_and_without_a_fixed_width():
    """No prefix held: the graphs of sequences without one are captured ahead. The torch cascade (no paged kernel
    on the CPU once the C++ op is removed) keeps graphs per context width and captures nothing ahead."""
    eng = _engine(True)
    if eng.graphs.width is not None:
        assert eng.capture_graphs() == len(eng.graphs.buckets)
        assert {k[2] for k in eng.graphs.graphs} == {None}
        prompts = _prompts(5, seed=4, prefix=False)
        want, _ = _run(_engine(False), prompts, [6, 9, 3, 12, 1], prefix=False)
        got, _ = _run(eng, prompts, [6, 9, 3, 12, 1], prefix=False)
        _same(got, want)
        assert eng.graphs.stats["captures"] == len(eng.graphs.buckets)
    if DEV == "cpu":
        flat = _engine(True, native=False)
        assert flat.graphs.width is None and flat.capture_graphs() == 0 and not flat.graphs.graphs


def test_a_context_wider_than_the_graphs_decodes_eagerly():
    """A step whose longest context needs more blocks than the graphs' fixed width decodes eagerly (the same
    tokens); steps that fit replay."""
    prompts = _prompts(3, seed=8)
    want, _ = _run(_engine(False), prompts, [40, 5, 20])
    eng = _engine(True)
    if eng.graphs.width is None:
        pytest.skip("no paged decode kernel here")
    eng.graphs.width = 3  # 48 tokens: the 40-token generation passes it
    got, _ = _run(eng, prompts, [40, 5, 20])
    _same(got, want)
    st = eng.graphs.stats
    assert st["eager_steps"] > 0 and st["replays"] > 0 and {k[1] for k in eng.graphs.graphs} == {3}


def test_real_graphs_need_cuda():
    if DEV == "cuda":
        pytest.skip("a GPU is present: the real capture is what the tests above ran")
    m = LlamaModel.from_hf_config(LlamaConfig(**CFG), seed=5)
    eng = Engine(m, Tok(), kv_cache_gb=0.02, cuda_graphs=False)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
        DecodeGraphs(m, eng.pool, 8)


def test_default_is_off_on_cpu_and_env_switch(monkeypatch):
    m = LlamaModel.from_hf_config(LlamaConfig(**CFG), seed=5, device=DEV)
    eng = Engine(m, Tok(), kv_cache_gb=0.02)
    assert (eng.graphs is not None) == (DEV == "cuda")
    monkeypatch.setenv("FASTRAG_CUDA_GRAPHS", "0")
    assert Engine(m, Tok(), kv_cache_gb=0.02).graphs is None


def test_continuous_batching_with_block_reuse_equals_eager(monkeypatch):
    """Finished sequences are released and new ones start while others decode (as the scheduler does), so freed
    blocks go to new sequences while a graph of the same bucket is replayed with fewer rows: rows left over from a
    bigger batch must become padding again, or they would write into blocks that now belong to someone else."""
    prompts = _prompts(14, seed=7)
    max_new = [int(x) for x in torch.randint(1, 30, (14,), generator=torch.Generator().manual_seed(8))]

    def run(graphs):
        eng = _engine(graphs, max_batch=6)
        eng.set_prefix(" ".join(map(str, PREFIX)))
        queue = list(range(len(prompts)))
        live, out = {}, {}
        while queue or eng.has_work:
            while queue and len(live) < 6:
                i = queue.pop(0)
                s = eng.new_sequence()
                eng.start(s, prompts[i], max_new[i])
                live[id(s)] = (i, s)
            for s in eng.step():
                i, _ = live.pop(id(s))
                out[i] = (s.out.ids, s.out.logprob, s.out.entropy, None)
                eng.release(s)
        return [out[i] for i in range(len(prompts))], eng

    want, _ = run(False)
    checked = []
    orig = DecodeGraphs.run

    def run_and_check(self, ids, *a, **k):  # after every replay: rows past the batch are pure padding
        res = orig(self, ids, *a, **k)
        if res is not None:
            b, B = res[1], len(ids)
            sb = self.scratch_block
            assert (b.write_slots[B:] == sb * self.pool.block_size).all() and (b.ctx_lens[B:] == 1).all()
            assert (b.ctx_blocks[B:] == sb).all() and (b.positions[B:] == 0).all()
            assert not (b.write_slots[:B] == sb * self.pool.block_size).any()
            checked.append(b.write_slots.numel() - B)
        return res

    monkeypatch.setattr(DecodeGraphs, "run", run_and_check)
    got, eng = run(True)
    _same(got, want)
    assert eng.graphs.stats["replays"] > 10 and sum(x > 0 for x in checked) > 3  # steps with padding rows


def test_each_prefix_gets_its_own_graphs():
    """Two families with the same batch and block buckets decode one after the other in one engine: the second
    must not replay the graph captured with the first one's prefix."""
    pb = list(range(50, 82))
    fam_a = [PREFIX + [1, 2, 3], PREFIX + [9, 8]]
    fam_b = [pb + [1, 2, 3], pb + [9, 8]]

    def run(graphs):
        eng = _engine(graphs)
        eng.set_prefix(" ".join(map(str, PREFIX)))
        eng.set_prefix(" ".join(map(str, pb)))
        out = []
        for fam in (fam_a, fam_b, [p[32:] for p in fam_a]):  # and no prefix at all
            seqs = [eng.new_sequence() for _ in fam]
            for s, p in zip(seqs, fam):
                eng.start(s, p, 10)
            while eng.has_work:
                eng.step()
            out += [s.out.ids for s in seqs]
        return out, eng

    want, _ = run(False)
    got, eng = run(True)
    assert got == want
    assert len({k[2] for k in eng.graphs.graphs}) == 3


def test_small_kv_pool_with_graphs_equals_eager():
    """A pool too small for every sequence at once (24 blocks, the scratch block one of them): sequences wait for
    blocks and decode in smaller batches; the tokens equal eager decoding's with the same pool."""
    prompts = _prompts(9, seed=9)
    max_new = [3, 17, 9, 30, 1, 24, 12, 5, 20]
    per_block = 2 * CFG["num_hidden_layers"] * 16 * CFG["num_key_value_heads"] * 8 * 4
    kv = 24 * per_block / 2**30
    eager, b_e = _run(_engine(False, kv_cache_gb=kv), prompts, max_new)
    eng = _engine(True, kv_cache_gb=kv)
    assert eng.pool.num_blocks == 24 and eng.pool.num_free == 23
    got, b_g = _run(eng, prompts, max_new)
    _same(got, eager)
    assert max(b_g) < len(prompts) and eng.graphs.stats["replays"] > 0  # the pool, not max_batch, bounded the batch


def test_an_evicted_sequence_is_recomputed_with_graphs():
    """Out of KV blocks (an 8-block pool, the scratch block one of them) an idle sequence is preempted: its blocks go
    to a prompt that needs them, and its next generation prefills its prompt again. On a GPU this runs with
    real graphs and the fused prefill; the tokens equal a roomy pool's, and nothing fails."""
    g = torch.Generator().manual_seed(21)
    a_prompt = torch.randint(1, 96, (20,), generator=g).tolist()  # 20 + 6 new: 2 blocks
    b_prompt = torch.randint(1, 96, (90,), generator=g).tolist()  # 90 + 6 new: 6 blocks, 7 free in all

    def run(eng):
        a, b = eng.new_sequence(), eng.new_sequence()
        eng.start(a, a_prompt, 6)
        while eng.has_work:
            eng.step()
        eng.start(b, b_prompt, 6)
        while eng.has_work:
            eng.step()
        more = a.tokens + [7]  # a's continuation: 27 tokens + 6 new, 3 blocks while b holds 6
        eng.start(a, more, 6)
        prefilled = a.out.prefilled
        while eng.has_work:
            eng.step()
        return (a.out.ids, a.out.logprob), (b.out.ids, b.out.logprob), prefilled, len(more)

    want_a, want_b, roomy_prefill, n_more = run(_engine(True))
    per_block = 2 * CFG["num_hidden_layers"] * 16 * CFG["num_key_value_heads"] * 8 * 4
    small = _engine(True, kv_cache_gb=8.5 * per_block / 2**30)
    assert small.pool.num_blocks == 8
    got_a, got_b, prefilled, _ = run(small)
    for (ia, la), (ib, lb) in ((got_a, want_a), (got_b, want_b)):
        assert ia == ib
        torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=1e-4, atol=1e-4)
    assert small.stats["evictions"] == 2 and small.stats["evicted_tokens"] > 0
    # evicted, the continuation prefills again what a roomy pool kept (less the full blocks that prefix caching
    # still finds intact in the pool)
    assert roomy_prefill < prefilled <= n_more, (roomy_prefill, prefilled, n_more)
    assert small.graphs.stats["replays"] > 0


def test_a_run_captures_its_graphs_once_its_prefixes_are_set_and_outside_its_clock(tmp_path, monkeypatch):
    """fastrag.eval calls Engine.capture_graphs once the run's shared prefixes are held, and the seconds it takes
    are not in the run's wall time (a capture is engine start-up, as its loading is)."""
    import json
    import sys
    import time

    from fastrag.eval import BUNDLED, RunOptions, run

    sys.path.insert(0, str(BUNDLED.parents[2] / "benchmarks"))
    from make_random_model import make

    model_dir = make("tiny", tmp_path / "tiny", dtype=torch.float32, device="cpu")
    cfg = tmp_path / "dragin.json"
    cfg.write_text(json.dumps({"method": "attn_entropy", "generate_max_length": 8, "hallucination_threshold": 0.5,
                               "retrieve_topk": 2, "query_formulation": "real_words"}))
    calls = []

    def slow_capture(self):
        t0 = time.perf_counter()
        time.sleep(1.5)
        calls.append((len(self.prefixes), t0, time.perf_counter()))
        return 0

    monkeypatch.setattr(Engine, "capture_graphs", slow_capture)
    m = run(RunOptions(method="dragin", dataset="hotpotqa", data=str(BUNDLED / "hotpotqa_dev20.jsonl"),
                       corpus=str(BUNDLED / "wiki_passages.jsonl"), model=str(model_dir), config=str(cfg), limit=2,
                       batch_size=4, output=str(tmp_path / "out"), progress=False))
    end = time.perf_counter()
    assert len(calls) == 1 and calls[0][0] == 1  # once, with the method's demo prefix held
    assert m["computed_this_run"] == 2
    # the clock holds the demo prefix's prefill (before the capture, a fraction of a second here) and the questions,
    # not the 1.5 s capture: with it the wall would pass end - (the capture's end) + 1.5
    assert m["wall_s"] < end - calls[0][2] + 0.75
