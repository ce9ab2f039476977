"""The Triton paged decode attention (kernels/paged_attention.py, the model's own-context decode attention on CUDA)
against a float64 softmax over gathered keys, and the model's decode with it against the C++ and torch paths.

Without a GPU the kernels run under TRITON_INTERPRET=1 on CPU tensors (set before fastrag.kernels is imported);
with one, on the GPU (bf16/fp16 too).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from fastrag.kernels import INTERPRETED  # noqa: E402
from fastrag.kernels.paged_attention import paged_decode_attention_lse  # noqa: E402
from test_paged_attention import _dense  # noqa: E402  (the float64 reference over gathered paged keys)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and not INTERPRETED,
                                reason="no GPU and fastrag.kernels was imported without TRITON_INTERPRET=1")
# (on the CPU the interpreter runs bf16/fp16 pools too: the kernel upcasts their tiles there)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# block_n 16: several key tiles per split (the online-softmax rescaling); None splits: the launcher's choice
@pytest.mark.parametrize("B,H,Hkv,D,bs,splits,block_n", [(5, 6, 2, 24, 4, 1, 16), (3, 9, 3, 64, 16, 3, 16),
                                                         (1, 4, 4, 8, 8, 2, 16), (4, 32, 8, 128, 16, None, 64)])
def test_matches_dense_softmax_on_random_pools(dtype, B, H, Hkv, D, bs, splits, block_n):
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    num_blocks, NB = 48, 9
    kp = torch.randn(Hkv, num_blocks * bs, D, generator=g).to(dtype)
    vp = torch.randn(Hkv, num_blocks * bs, D, generator=g).to(dtype)
    blocks = torch.stack([torch.randperm(num_blocks, generator=g)[:NB] for _ in range(B)])
    lens = torch.randint(1, NB * bs + 1, (B,), generator=g)
    lens[0] = 0 if B > 2 else lens[0]  # a sequence with no own key: out 0, lse -inf
    q = torch.randn(B, H, D, generator=g).to(dtype)
    scale = D**-0.5
    out, lse = paged_decode_attention_lse(q.to(DEV), kp.to(DEV), vp.to(DEV), torch.empty(0, dtype=torch.long),
                                          blocks.to(DEV), lens.to(DEV), bs, scale, num_splits=splits,
                                          block_n=block_n)
    ref_o, ref_l = _dense(q, kp, vp, torch.empty(0, dtype=torch.long), blocks, lens, bs, scale, with_lse=True)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.cpu().double(), ref_o, **tol, msg=lambda m: f"{m} (seed={seed})")
    torch.testing.assert_close(lse.cpu().double(), ref_l, **tol, msg=lambda m: f"{m} (seed={seed})")


@pytest.mark.parametrize("launch", [dict(num_warps=8), dict(num_stages=2), dict(num_warps=2, num_stages=4)],
                         ids=str)
def test_launch_settings_change_nothing_but_speed(launch):
    """The settings bench_paged_attention.py sweeps give the same attention as the defaults."""
    g = torch.Generator().manual_seed(random.randrange(2**31))
    B, H, Hkv, D, bs, nb = 3, 8, 2, 32, 8, 6
    kp, vp = torch.randn(Hkv, 40 * bs, D, generator=g), torch.randn(Hkv, 40 * bs, D, generator=g)
    blocks = torch.stack([torch.randperm(40, generator=g)[:nb] for _ in range(B)])
    lens = torch.randint(1, nb * bs + 1, (B,), generator=g)
    q = torch.randn(B, H, D, generator=g)
    args = (q.to(DEV), kp.to(DEV), vp.to(DEV), torch.empty(0, dtype=torch.long), blocks.to(DEV), lens.to(DEV), bs,
            D ** -0.5)
    out, lse = paged_decode_attention_lse(*args, **launch)
    ref_o, ref_l = _dense(q, kp, vp, torch.empty(0, dtype=torch.long), blocks, lens, bs, D ** -0.5, with_lse=True)
    torch.testing.assert_close(out.cpu().double(), ref_o, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.cpu().double(), ref_l, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("bad, match", [
    (dict(prefix_slots=torch.tensor([0, 1])), "prefix_slots"),
    (dict(q=torch.zeros(2, 4, 8, dtype=torch.float64)), "dtype"),
    (dict(q=torch.zeros(2, 4, 6)), "head dim"),
    (dict(q=torch.zeros(2, 3, 8)), "multiple of Hkv"),
    (dict(ctx_lens=torch.tensor([1, 2, 3])), "ctx_lens"),
    (dict(block_n=24), "block_n"),
])
def test_bad_input_is_a_clear_error(bad, match):
    kw = dict(q=torch.zeros(2, 4, 8), k_pool=torch.zeros(2, 64, 8), v_pool=torch.zeros(2, 64, 8),
              prefix_slots=torch.empty(0, dtype=torch.long), ctx_blocks=torch.zeros(2, 4, dtype=torch.long),
              ctx_lens=torch.tensor([3, 5]), block_size=16, scale=0.3) | bad
    kw = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    with pytest.raises(ValueError, match=match):
        paged_decode_attention_lse(**kw)


@pytest.mark.skipif(DEV != "cpu", reason="on a GPU lengths and block ids are clamped in the kernel, not read back")
@pytest.mark.parametrize("bad, match", [
    (dict(ctx_lens=torch.tensor([3, 65])), r"ctx_lens\[1\] = 65 is outside \[0, 64\]"),
    (dict(ctx_lens=torch.tensor([-1, 5])), r"ctx_lens\[0\] = -1"),
    (dict(ctx_lens=torch.tensor([3.0, 5.0])), "ctx_lens must be int32/int64"),
    (dict(ctx_blocks=torch.tensor([[0, 1, 2, 3], [1, 4, 0, 0]])), r"ctx_blocks\[1, 1\] = 4 is outside the pool's 4"),
    (dict(ctx_blocks=torch.tensor([[-1, 1, 2, 3], [0, 0, 0, 0]])), r"ctx_blocks\[0, 0\] = -1"),
    (dict(block_size=24), "block_size must be a positive int dividing the pool's 64 slots"),
])
def test_bad_lengths_and_block_ids_are_named(bad, match):
    """CPU tensors: a length beyond the table or a used block id outside the pool is an error naming the entry
    (it would read outside the pool); block ids past a sequence's length are not read and not checked."""
    kw = dict(q=torch.zeros(2, 4, 8), k_pool=torch.zeros(2, 64, 8), v_pool=torch.zeros(2, 64, 8),
              prefix_slots=torch.empty(0, dtype=torch.long), ctx_blocks=torch.zeros(2, 4, dtype=torch.long),
              ctx_lens=torch.tensor([3, 17]), block_size=16, scale=0.3)
    unused = kw | dict(ctx_blocks=torch.tensor([[0, 99, -5, 7], [3, 2, 99, -1]]))
    assert paged_decode_attention_lse(**unused)[1].isfinite().all()
    with pytest.raises(ValueError, match=match):
        paged_decode_attention_lse(**(kw | bad))


class _Tok:
    eos_token_id = None

    def encode(self, s):
        return [int(x) for x in s.split()]


def _decode(path: str, prompts, prefixes, seed: int, graphs: bool = False, max_new=None):
    """Greedy decoding through the engine with the model's decode attention forced to `path` (graphs: decode steps
    through DecodeGraphs, real CUDA graphs on a GPU, the emulated protocol on CPU)."""
    from transformers import LlamaConfig

    from fastrag.engine import Engine
    from fastrag.model.llama import LlamaModel

    cfg = LlamaConfig(vocab_size=90, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, eos_token_id=None)
    m = LlamaModel.from_hf_config(cfg, seed=seed, device=DEV)
    if path == "triton":
        m.triton_decode, m._triton_on_cpu = paged_decode_attention_lse, DEV == "cpu"
        assert m.paged_decode_op(torch.device(DEV), torch.float32) is m.triton_decode
    elif path == "torch":
        m.native_decode, m.triton_decode, m._triton_on_cpu = None, None, False
    eng = Engine(m, _Tok(), kv_cache_gb=0.01, max_batch=8, mix_prefill=True, cuda_graphs=graphs)
    for p in prefixes:
        eng.set_prefix(" ".join(map(str, p)))
    seqs = [eng.new_sequence() for _ in prompts]
    for s, p, n in zip(seqs, prompts, max_new or [10] * len(prompts)):
        eng.start(s, p, n)
    mixed = 0
    while eng.has_work:
        mixed += len({id(s.prefix) for s in eng.running}) > 1
        eng.step()
    if graphs:
        assert eng.graphs.disabled is None and eng.graphs.stats["replays"] > 0
    return [s.out.ids for s in seqs], [s.out.logprob for s in seqs], mixed


def test_model_decode_with_triton_attention_equals_the_other_paths():
    """Two shared prefixes and a prompt with none decode in one batch through the Triton own-context kernel
    (prefix GEMMs merged by its LSE): the same tokens as the torch cascade path (and the C++ kernel on CPU),
    log-probabilities equal to float32 rounding."""
    pa, pb = list(range(20, 52)), list(range(40, 88))
    prompts = [pa + [1, 2, 3], pb + list(range(1, 12)), pa + list(range(5, 25)), pb + [7], [3, 4, 5, 6, 8]]
    ids_tr, lp_tr, mixed = _decode("triton", prompts, [pa, pb], seed=9)
    assert mixed > 0, "the prefix families did not share decode steps"
    others = ["torch"] + (["native"] if DEV == "cpu" else [])
    for path in others:
        ids, lp, _ = _decode(path, prompts, [pa, pb], seed=9)
        assert ids == ids_tr, f"triton decode attention drew other tokens than the {path} path"
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(lp_tr), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("with_prefix", [True, False])
def test_graphed_decode_with_triton_attention_equals_eager(with_prefix):
    """Decode steps replayed through DecodeGraphs with the Triton kernel (the GPU's decode path): padding rows of
    the batch buckets attend to the scratch block only, and tokens and log-probabilities equal eager decoding's as
    the batch shrinks through several buckets."""
    pa = list(range(20, 52))
    head = pa if with_prefix else []
    prompts = [head + list(range(1, 1 + n)) for n in (3, 11, 20, 1, 7)]
    max_new = [4, 12, 7, 15, 2]
    ids_e, lp_e, _ = _decode("triton", prompts, [pa], seed=4, max_new=max_new)
    ids_g, lp_g, _ = _decode("triton", prompts, [pa], seed=4, graphs=True, max_new=max_new)
    assert ids_g == ids_e
    torch.testing.assert_close(torch.tensor([x for r in lp_g for x in r]), torch.tensor([x for r in lp_e for x in r]),
                               rtol=1e-4, atol=1e-5)


def test_unknown_decode_attention_setting_is_named(monkeypatch):
    from transformers import LlamaConfig

    from fastrag.model.llama import LlamaModel

    monkeypatch.setenv("FASTRAG_DECODE_ATTENTION", "flash")
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="FASTRAG_DECODE_ATTENTION='flash'"):
        LlamaModel.from_hf_config(cfg, seed=0)
