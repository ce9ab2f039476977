"""The C++ paged decode attention (csrc/paged_attn_cpu.cpp) against a dense softmax over gathered keys, and the
model's decode with it against the pure-torch cascade path."""

from __future__ import annotations

import pytest
import torch

from fastrag.model.attention.select import native_decode_attention

op_lse = native_decode_attention()  # (out, lse) variant the model uses
pytestmark = pytest.mark.skipif(op_lse is None, reason="fastrag._C is not built (pip install --no-build-isolation -e .)")
op = torch.ops.fastrag.paged_decode_attention if op_lse is not None else None


def _dense(q, kp, vp, prefix_slots, blocks, lens, bs, scale, with_lse=False):
    B, H, D = q.shape
    Hkv = kp.shape[0]
    G = H // Hkv
    out = torch.empty(B, H, D, dtype=torch.float64)
    lse = torch.empty(B, H, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        slots = prefix_slots.tolist() + [int(blocks[b, i // bs]) * bs + i % bs for i in range(n)]
        for h in range(H):
            k = kp[h // G, slots].double()
            v = vp[h // G, slots].double()
            sc = k @ q[b, h].double() * scale
            out[b, h] = torch.softmax(sc, 0) @ v
            lse[b, h] = torch.logsumexp(sc, 0)
    return (out, lse) if with_lse else out


@pytest.mark.parametrize("B,H,Hkv,D,P,bs", [(5, 6, 2, 24, 0, 4), (3, 9, 3, 64, 37, 16), (1, 4, 4, 8, 5, 8)])
def test_matches_dense_softmax_on_random_pools(B, H, Hkv, D, P, bs):
    g = torch.Generator().manual_seed(B * 100 + H)
    num_blocks = 40
    kp = torch.randn(Hkv, num_blocks * bs, D, generator=g)
    vp = torch.randn(Hkv, num_blocks * bs, D, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    prefix_slots = torch.randperm(num_blocks * bs, generator=g)[:P]  # any slots, not necessarily consecutive
    NB = 5
    blocks = perm[: B * NB].view(B, NB).clone()
    lens = torch.randint(1, NB * bs + 1, (B,), generator=g)
    # rows past each sequence's length hold NaN: they must never be read
    for b in range(B):
        n = int(lens[b])
        for i in range(n, NB * bs):
            slot = int(blocks[b, i // bs]) * bs + i % bs
            if slot not in set(prefix_slots.tolist()):
                kp[:, slot] = float("nan")
                vp[:, slot] = float("nan")
    q = torch.randn(B, H, D, generator=g)
    scale = D ** -0.5
    got = op(q, kp, vp, prefix_slots, blocks, lens, bs, scale)
    ref = _dense(q, kp, vp, prefix_slots, blocks, lens, bs, scale)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("G,D", [(1, 128), (2, 64), (3, 64), (4, 128), (8, 64), (5, 64), (3, 128), (2, 32)])
@pytest.mark.parametrize("P", [0, 21])
def test_compiled_shapes_and_generic_shapes_match_the_reference(G, D, P):
    """Group sizes 1-4 and 8 at head dims 64/128 run the compiled-shape item, others the generic one (5 x 64,
    2 x 32); contexts long enough that the row prefetch crosses blocks, one of length 1; unread rows are NaN."""
    g = torch.Generator().manual_seed(1000 * G + D + P)
    Hkv, bs, NB, num_blocks = 2, 16, 6, 64
    B = 4
    kp = torch.randn(Hkv, num_blocks * bs, D, generator=g)
    vp = torch.randn(Hkv, num_blocks * bs, D, generator=g)
    prefix_blocks = torch.randperm(num_blocks, generator=g)
    pre = (prefix_blocks[:2].repeat_interleave(bs) * bs + torch.arange(bs).repeat(2))[:P]
    blocks = prefix_blocks[2: 2 + B * NB].view(B, NB).clone()
    lens = torch.tensor([1, NB * bs, 37, 70])
    for b in range(B):  # the rest of each sequence's blocks: never read
        for i in range(int(lens[b]), NB * bs):
            slot = int(blocks[b, i // bs]) * bs + i % bs
            kp[:, slot] = float("nan")
            vp[:, slot] = float("nan")
    q = torch.randn(B, Hkv * G, D, generator=g)
    scale = D ** -0.5
    out, lse = op_lse(q, kp, vp, pre, blocks, lens, bs, scale)
    ref, _ = _dense(q, kp, vp, pre, blocks, lens, bs, scale, with_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    if P == 0:  # the project's reference covers the sequence's own keys
        from fastrag.signals.reference import decode_lse_ref

        torch.testing.assert_close(lse.double(), decode_lse_ref(q, kp, blocks, lens, bs, scale), rtol=1e-5,
                                   atol=1e-5)
    torch.testing.assert_close(op(q, kp, vp, pre, blocks, lens, bs, scale), out, rtol=0, atol=0)


@pytest.mark.parametrize("P", [0, 13])
def test_lse_variant_returns_the_log_sum_exp_and_handles_empty_rows(P):
    g = torch.Generator().manual_seed(31 + P)
    bs, Hkv, H, D, NB = 8, 2, 6, 16, 4
    kp = torch.randn(Hkv, 30 * bs, D, generator=g)
    vp = torch.randn(Hkv, 30 * bs, D, generator=g)
    pre = torch.randperm(30 * bs, generator=g)[:P]
    blocks = torch.randperm(30, generator=g)[: 3 * NB].view(3, NB).clone()
    lens = torch.tensor([5, 0, 29])  # row 1: no own context
    kp[:, blocks[1].repeat_interleave(bs) * bs + torch.arange(bs).repeat(NB)] = float("nan")
    q = torch.randn(3, H, D, generator=g)
    out, lse = op_lse(q, kp, vp, pre, blocks, lens, bs, 0.3)
    ref, ref_lse = _dense(q, kp, vp, pre, blocks, lens, bs, 0.3, with_lse=True)
    if P == 0:  # no key at all: out 0, lse -inf (neutral in an LSE merge)
        assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()
        keep = [0, 2]
        out, lse, ref, ref_lse = out[keep], lse[keep], ref[keep], ref_lse[keep]
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_non_contiguous_query_is_accepted():
    g = torch.Generator().manual_seed(7)
    kp, vp = torch.randn(2, 64, 16, generator=g), torch.randn(2, 64, 16, generator=g)
    q = torch.randn(4, 3, 16, generator=g).transpose(0, 1)  # [3, 4, 16] non-contiguous
    blocks = torch.tensor([[0, 1], [2, 3], [4, 5]])
    lens = torch.tensor([5, 16, 9])
    pre = torch.tensor([40, 41, 42])
    got = op(q, kp, vp, pre, blocks, lens, 8, 0.25)
    torch.testing.assert_close(got.double(), _dense(q, kp, vp, pre, blocks, lens, 8, 0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad,match", [
    ("dtype", "float32"), ("lens", "exceeds its block table"), ("block", "outside the pool"),
    ("heads", "multiple of Hkv"), ("prefix", "outside the pool"),
])
def test_bad_input_is_a_clear_error(bad, match):
    kp, vp = torch.randn(2, 64, 8), torch.randn(2, 64, 8)
    q = torch.randn(2, 4, 8)
    blocks = torch.tensor([[0, 1], [2, 3]])
    lens = torch.tensor([3, 9])
    pre = torch.tensor([60, 61])
    if bad == "dtype":
        q = q.double()
    elif bad == "lens":
        lens = torch.tensor([3, 17])
    elif bad == "block":
        blocks = torch.tensor([[0, 1], [2, 99]])
    elif bad == "heads":
        q = torch.randn(2, 3, 8)
    else:
        pre = torch.tensor([60, 64])
    with pytest.raises(RuntimeError, match=match):
        op(q, kp, vp, pre, blocks, lens, 8, 0.3)


def test_model_decode_equals_torch_cascade_path():
    """Greedy decoding through the engine with the C++ decode attention and with the torch cascade path: same
    tokens, logits equal to fp32 rounding."""
    from transformers import LlamaConfig

    from fastrag.engine import Engine
    from fastrag.model.llama import LlamaModel

    class Tok:
        eos_token_id = None

        def encode(self, s):
            return [int(x) for x in s.split()]

    cfg = LlamaConfig(vocab_size=80, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, eos_token_id=None)
    prompts = [list(range(20, 52)) + list(range(1, 1 + n)) for n in (3, 11, 20)]

    def run(native: bool):
        m = LlamaModel.from_hf_config(cfg, seed=5)
        if not native:
            m.native_decode = None
        eng = Engine(m, Tok(), kv_cache_gb=0.01, max_batch=8)
        eng.set_prefix(" ".join(map(str, range(20, 52))))
        seqs = [eng.new_sequence() for _ in prompts]
        for s, p in zip(seqs, prompts):
            eng.start(s, p, 12)
        while eng.has_work:
            eng.step()
        return [s.out.ids for s in seqs], [s.out.logprob for s in seqs]

    ids_n, lp_n = run(True)
    ids_t, lp_t = run(False)
    assert ids_n == ids_t
    torch.testing.assert_close(torch.tensor(lp_n), torch.tensor(lp_t), rtol=1e-4, atol=1e-5)


def test_sequences_of_two_prefixes_decode_in_one_batch():
    """Two shared prefixes held at once: a prompt starts from the one it begins with; sequences of both (and one
    with no prefix) prefill together (packed, each attending to its own prefix) and decode in the same forward
    (per-prefix GEMM + own-context kernel, merged by LSE); tokens equal those of engines that hold one prefix each,
    and of the torch path (which decodes the families in separate forwards)."""
    from transformers import LlamaConfig

    from fastrag.engine import Engine
    from fastrag.model.llama import LlamaModel

    class Tok:
        eos_token_id = None

        def encode(self, s):
            return [int(x) for x in s.split()]

    cfg = LlamaConfig(vocab_size=90, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, eos_token_id=None)
    pa, pb = list(range(20, 52)), list(range(40, 88))  # 32 and 48 tokens
    prompts = [pa + [1, 2, 3], pb + list(range(1, 12)), pa + list(range(5, 25)), pb + [7], [3, 4, 5, 6, 8]]

    def run(prefixes, idx, native=True, mix=True, fill=1.0):
        m = LlamaModel.from_hf_config(cfg, seed=9)
        m.bucket_fill_cpu = fill
        if not native:
            m.native_decode = None
        eng = Engine(m, Tok(), kv_cache_gb=0.01, max_batch=8, mix_prefill=mix)
        held = [eng.set_prefix(" ".join(map(str, p))) for p in prefixes]
        seqs = [eng.new_sequence() for _ in idx]
        for s, i in zip(seqs, idx):
            eng.start(s, prompts[i], 10)
        mixed_steps = 0
        while eng.has_work:
            mixed_steps += len({id(s.prefix) for s in eng.running}) > 1
            eng.step()
        for s, i in zip(seqs, idx):
            want = [h for h, p in zip(held, prefixes) if prompts[i][: len(p)] == p]
            assert s.prefix is (want[0] if want else None)
        return {i: s.out.ids for s, i in zip(seqs, idx)}, mixed_steps

    both, mixed = run([pa, pb], [0, 1, 2, 3, 4])
    assert mixed > 0  # the two families (and the prompt with no prefix) really shared decode steps
    only_a, _ = run([pa], [0, 2, 4])
    only_b, _ = run([pb], [1, 3])
    assert both == {**only_a, **only_b}
    torch_path, _ = run([pa, pb], [0, 1, 2, 3, 4], native=False)
    assert torch_path == both
    split_prefill, _ = run([pa, pb], [0, 1, 2, 3, 4], mix=False)  # prefill batches split by prefix (default)
    assert split_prefill == both
    bucketed, _ = run([pa, pb], [0, 1, 2, 3, 4], fill=0.3)  # packed attention in padded buckets (a GPU's rule)
    assert bucketed == both


@pytest.mark.parametrize("native,lens,bucket_tokens,fill", [
    (True, [1, 37, 5, 20], 4096, 1.0), (False, [1, 37, 5, 20], 4096, 0.6),
    (True, "random", 4096, 0.6), (True, "random", 48, 0.6), (False, "random", 1, 0.6), (True, "random", 4096, 1.0)])
def test_packed_prefill_equals_padded_prefill(native, lens, bucket_tokens, fill):
    """Prompts of very different lengths prefilled together: the packed forward (no padding; attention per bucket of
    similar lengths) gives the logits of the padded one, with a one-token prompt, random lengths, and buckets from
    one sequence each (bucket_tokens 1, or fill 1: only equal lengths share one, the CPU's rule) to many (the
    GPU's fill of 0.6, here on the CPU)."""
    from transformers import LlamaConfig

    from fastrag.model.llama import AttnBatch, LlamaModel

    cfg = LlamaConfig(vocab_size=70, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2)
    m = LlamaModel.from_hf_config(cfg, seed=11)
    if not native:
        m.native_decode = None
    g = torch.Generator().manual_seed(3)
    bs = 8
    if lens == "random":  # fresh lengths each run, some repeated so that buckets fill exactly too
        r = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
        lens = [int(x) for x in torch.randint(1, 40, (9,), generator=r)]
        lens[3] = lens[5]
    m.bucket_tokens, m.bucket_fill_cpu = bucket_tokens, fill
    B, T = len(lens), max(lens)
    kp = [torch.randn(2, 80 * bs, 8, generator=g) for _ in range(2)]
    vp = [torch.randn(2, 80 * bs, 8, generator=g) for _ in range(2)]
    old = [(3, 9, 0, 14)[b % 4] for b in range(B)]  # context entries already cached per sequence
    blocks = torch.randperm(78, generator=g)[:B * 7].view(B, 7) + 2  # blocks 0, 1: the prefix
    ids = torch.randint(0, 70, (B, T), generator=g)
    valid = torch.arange(T).expand(B, T) < torch.tensor(lens).unsqueeze(1)
    P = 16
    pos = (P + torch.tensor(old).unsqueeze(1) + torch.arange(T)) * valid
    write = [int(blocks[b, i // bs]) * bs + i % bs for b in range(B) for i in range(old[b], old[b] + lens[b])]
    batch = AttnBatch(write_slots=torch.tensor(write), valid=valid, positions=pos, prefix_len=P,
                      prefix_slots=torch.arange(P), ctx_blocks=blocks,
                      ctx_lens=torch.tensor([o + n for o, n in zip(old, lens)]), block_size=bs, prefix_start=0)
    last = valid.reshape(-1).nonzero().squeeze(-1)  # every token's logits: each reads its own attention output
    out = {}
    for mode, below in (("padded", 0.0), ("packed", 1.0)):
        m.pack_below = below
        k2, v2 = [k.clone() for k in kp], [v.clone() for v in vp]
        out[mode] = (m(ids, batch, k2, v2, logits_index=last), k2, v2)
    assert torch.isfinite(out["packed"][0]).all()
    torch.testing.assert_close(out["packed"][0], out["padded"][0], rtol=1e-4, atol=1e-5)
    for li in range(2):  # the same KV written to the same slots
        torch.testing.assert_close(out["packed"][1][li], out["padded"][1][li], rtol=1e-5, atol=1e-6)
