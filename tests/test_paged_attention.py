"""The C++ paged decode attention (csrc/paged_attn_cpu.cpp) against a dense softmax over gathered keys, and the
model's decode with it against the pure-torch cascade path."""

from __future__ import annotations

import pytest
import torch

from fastrag.model.llama import _native_decode_attention

op = _native_decode_attention()
pytestmark = pytest.mark.skipif(op is None, reason="fastrag._C is not built (pip install --no-build-isolation -e .)")


def _dense(q, kp, vp, prefix_slots, blocks, lens, bs, scale):
    B, H, D = q.shape
    Hkv = kp.shape[0]
    G = H // Hkv
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        slots = prefix_slots.tolist() + [int(blocks[b, i // bs]) * bs + i % bs for i in range(n)]
        for h in range(H):
            k = kp[h // G, slots].double()
            v = vp[h // G, slots].double()
            p = torch.softmax(k @ q[b, h].double() * scale, 0)
            out[b, h] = p @ v
    return out


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
