"""The Triton paged prefill attention (kernels/paged_prefill.py, $FASTRAG_PAGED_PREFILL) against the project's
reference (fastrag.signals.reference.paged_prefill_ref) on fresh random layouts, and the model's prefill through it
against the attention buckets of torch calls.

Without a GPU the kernel runs under TRITON_INTERPRET=1 on CPU tensors (set before fastrag.kernels is imported);
with one, on the GPU (bf16/fp16 too).
"""

from __future__ import annotations

import random

import pytest
import torch

# (TRITON_INTERPRET=1 without a GPU, set before Triton loads, and the same device, dtypes and skip rule)
from test_paged_attention_triton import DEV, DTYPES, pytestmark  # noqa: F401

from fastrag.kernels.paged_prefill import paged_prefill_attention, prefill_layout  # noqa: E402
from fastrag.model.attention.checks import self_checked  # noqa: E402
from fastrag.model.llama import LlamaModel, self_check_key  # noqa: E402
from fastrag.signals.reference import paged_prefill_ref  # noqa: E402


def _problem(g: torch.Generator, B: int, H: int, Hkv: int, D: int, bs: int, max_new: int, dtype):
    """A random pool and packed prefill: two prefixes at scattered slots (some sequences have none), block tables
    in random order with unused entries of garbage ids, own contexts that start before this call's tokens for some
    sequences, a sequence with no new token. Every slot no sequence reads holds NaN."""
    num_blocks = 64
    kp = torch.full((Hkv, num_blocks * bs, D), float("nan"))
    vp = torch.full_like(kp, float("nan"))
    perm = torch.randperm(num_blocks * bs, generator=g).tolist()
    pa, pb = perm[:7], perm[7:7 + 13]  # two prefixes' slots, not consecutive
    free_blocks = sorted({s // bs for s in range(num_blocks * bs)} - {s // bs for s in pa + pb})
    free_blocks = [free_blocks[i] for i in torch.randperm(len(free_blocks), generator=g).tolist()]
    pre_slots = torch.tensor(pa + pb)
    q_lens, ctx_lens, pre, prefixes = [], [], [], []
    NB = -(-(max_new + 20) // bs)
    table = torch.randint(-50, 10**6, (B, NB), generator=g)  # garbage past each sequence's own blocks
    used = 0
    for b in range(B):
        n = 0 if b == 1 else int(torch.randint(1, max_new + 1, (1,), generator=g))
        c = n + int(torch.randint(0, 20, (1,), generator=g)) * (b % 2)  # own tokens before this call
        c = max(c, 1)
        nb = -(-c // bs)
        table[b, :nb] = torch.tensor(free_blocks[used: used + nb])
        used += nb
        which = b % 3  # prefix a, prefix b, none
        off, plen = [(0, 7), (7, 13), (0, 0)][which]
        q_lens.append(n), ctx_lens.append(c), pre.append((off, plen)), prefixes.append(pre_slots[off: off + plen])
        own = (table[b, :nb].repeat_interleave(bs) * bs + torch.arange(bs).repeat(nb))[:c]
        for pool in (kp, vp):
            pool[:, own] = torch.randn(Hkv, c, D, generator=g)
    for pool in (kp, vp):
        pool[:, pre_slots] = torch.randn(Hkv, len(pre_slots), D, generator=g)
    q = torch.randn(sum(q_lens), H, D, generator=g)
    return q.to(dtype), kp.to(dtype), vp.to(dtype), q_lens, ctx_lens, pre, prefixes, pre_slots, table


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,H,Hkv,D,bs,max_new,block_m,block_n", [
    (5, 4, 2, 24, 4, 40, 16, 16),   # GQA, a head dim that is not a power of two, several query tiles a sequence
    (4, 3, 3, 16, 8, 17, 16, 32),   # no GQA, tiles of 16 and 17 tokens
    (3, 8, 2, 64, 16, 70, 32, 64),  # 4 query heads a kv head, bigger tiles
])
def test_matches_the_reference_on_random_layouts(dtype, B, H, Hkv, D, bs, max_new, block_m, block_n):
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    q, kp, vp, q_lens, ctx_lens, pre, prefixes, pre_slots, table = _problem(g, B, H, Hkv, D, bs, max_new, dtype)
    lay = prefill_layout(q_lens, ctx_lens, pre, pre_slots.to(DEV), table.to(DEV), bs, block_m=block_m)
    out = torch.full_like(q, float("nan"), device=DEV)  # every row the kernel must write starts as NaN
    got = paged_prefill_attention(q.to(DEV), kp.to(DEV), vp.to(DEV), lay, D**-0.5, out=out, block_n=block_n)
    assert got is out and got.dtype == dtype
    want = paged_prefill_ref(q, kp, vp, q_lens, ctx_lens, prefixes, table, bs, D**-0.5)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.cpu().double(), want, **tol, msg=lambda m: f"{m} (seed={seed})")


@pytest.mark.parametrize("launch", [dict(wide=True), dict(block_n=32, num_warps=4, num_stages=3)], ids=str)
def test_launch_settings_change_nothing_but_speed(launch):
    """The int64 key offsets of pools past 2**31 elements a head (forced here on a small pool) and other tile and
    warp settings give the reference's result too."""
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    q, kp, vp, q_lens, ctx_lens, pre, prefixes, pre_slots, table = _problem(g, 4, 4, 2, 32, 8, 40, torch.float32)
    lay = prefill_layout(q_lens, ctx_lens, pre, pre_slots.to(DEV), table.to(DEV), 8, block_m=16)
    got = paged_prefill_attention(q.to(DEV), kp.to(DEV), vp.to(DEV), lay, 0.2, **launch)
    want = paged_prefill_ref(q, kp, vp, q_lens, ctx_lens, prefixes, table, 8, 0.2)
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-5, rtol=2e-5, msg=lambda m: f"{m} (seed={seed})")


def test_a_transposed_query_and_the_default_tiles_give_the_same_result():
    """The model hands the kernel [H, N, D] queries transposed to [N, H, D] (a view); the launcher's default tile
    sizes change nothing but speed."""
    g = torch.Generator().manual_seed(random.randrange(2**31))
    q, kp, vp, q_lens, ctx_lens, pre, prefixes, pre_slots, table = _problem(g, 4, 4, 2, 32, 8, 30, torch.float32)
    lay = prefill_layout(q_lens, ctx_lens, pre, pre_slots.to(DEV), table.to(DEV), 8)
    qt = q.transpose(0, 1).contiguous().to(DEV).transpose(0, 1)  # [N, H, D] with stride(0) = D
    assert not qt.is_contiguous()
    got = paged_prefill_attention(qt, kp.to(DEV), vp.to(DEV), lay, 0.2)
    want = paged_prefill_ref(q, kp, vp, q_lens, ctx_lens, prefixes, table, 8, 0.2)
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-5, rtol=2e-5)


def _small():
    return dict(q=torch.zeros(5, 4, 8), k_pool=torch.zeros(2, 64, 8), v_pool=torch.zeros(2, 64, 8))


@pytest.mark.parametrize("bad, match", [
    (dict(q=torch.zeros(5, 4, 8, dtype=torch.float64)), "dtype"),
    (dict(q=torch.zeros(5, 4, 6)), "head dim"),
    (dict(q=torch.zeros(5, 3, 8)), "multiple of Hkv"),
    (dict(q=torch.zeros(6, 4, 8)), "q has 6 rows but the layout packs 5"),
    (dict(q=torch.zeros(5, 8, 4).transpose(1, 2)), "contiguous in the head dim"),
    (dict(block_n=24), "block_n"),
])
def test_bad_input_is_a_clear_error(bad, match):
    lay = prefill_layout([2, 3], [2, 5], [(0, 0), (0, 0)], torch.zeros(1, dtype=torch.long, device=DEV),
                         torch.zeros(2, 4, dtype=torch.long, device=DEV), 16)
    kw = _small() | bad
    kw = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(layout=lay, scale=0.3, **kw)


@pytest.mark.parametrize("args, match", [
    (dict(q_lens=[3, 1]), r"sequence 1: 1 new tokens and 0 own keys"),
    (dict(ctx_lens=[3, 65]), r"sequence 1: .* <= 64"),
    (dict(pre=[(0, 0), (1, 2)]), r"sequence 1: its prefix \(offset 1, 2 keys\) lies outside the 2 prefix slots"),
    (dict(pre=[(0, 0)]), "the same 2 sequences"),
    (dict(block_m=24), "block_m must be a power of two"),
    (dict(block_size=0), "block_size"),
])
def test_bad_layouts_are_named(args, match):
    kw = dict(q_lens=[3, 0], ctx_lens=[3, 0], pre=[(0, 0), (0, 2)], pre_slots=torch.zeros(2, dtype=torch.long),
              ctx_blocks=torch.zeros(2, 4, dtype=torch.long), block_size=16) | args
    with pytest.raises(ValueError, match=match):
        prefill_layout(**kw)


@pytest.mark.skipif(DEV != "cpu", reason="on a GPU block ids and slots are masked in the kernel, not read back")
@pytest.mark.parametrize("table, pre_slots, match", [
    ([[0, 1, 9, 9], [3, 4, 9, 9]], [0, 1], r"ctx_blocks\[0, 2\] = 9 is outside the pool's 4 blocks"),
    ([[0, 1, 2, -1], [3, 0, 0, 0]], [0, 1], r"ctx_blocks\[0, 3\] = -1"),
    ([[0, 1, 2, 3], [3, 0, 0, 0]], [0, 64], r"sequence 1's prefix slot pre_slots\[1\] = 64 is outside"),
])
def test_block_ids_and_prefix_slots_outside_the_pool_are_named(table, pre_slots, match):
    """CPU tensors: an id the kernel would read outside the pool is an error naming it; ids past a sequence's own
    keys are not read and not checked."""
    lay = prefill_layout([3, 2], [49, 2], [(0, 0), (0, 2)], torch.tensor(pre_slots), torch.tensor(table), 16)
    kw = _small()
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(layout=lay, scale=0.3, **kw)
    ok = prefill_layout([3, 2], [3, 2], [(0, 0), (0, 1)], torch.tensor([0, 1]), torch.tensor([[0, 99, -5, 7],
                                                                                              [3, 99, -1, 0]]), 16)
    assert paged_prefill_attention(layout=ok, scale=0.3, **kw).isfinite().all()


# ----------------------------------------------------------------------------------------------- in the model


class _Tok:
    eos_token_id = None

    def encode(self, s):
        return [int(x) for x in s.split()]


def _model(monkeypatch, paged: bool, seed: int, fused: bool = False):
    from transformers import LlamaConfig

    from fastrag.model.llama import LlamaModel

    monkeypatch.setenv("FASTRAG_PAGED_PREFILL", "1" if paged else "0")
    if fused:  # the GPU's prefill: the small operations as kernels/fused_decode.py's launches (interpreted on CPU)
        monkeypatch.setenv("FASTRAG_FUSED_DECODE", "1")
    cfg = LlamaConfig(vocab_size=90, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, eos_token_id=None)
    return LlamaModel.from_hf_config(cfg, seed=seed, device=DEV)


def _generate(m, prompts, prefixes, max_new):
    """Greedy generations through the engine, prefills mixing prefixes in one call; a second round on the same
    sequences continues their own context (a prefill that starts after cached own tokens)."""
    from fastrag.engine import Engine

    # (eager prefills: on a GPU a replayed prefill graph would hide the kernel's calls; tests/test_prefill_graphs.py)
    eng = Engine(m, _Tok(), kv_cache_gb=0.01, max_batch=8, mix_prefill=True, prefill_hold=0, prefill_graphs=False)
    for p in prefixes:
        eng.set_prefix(" ".join(map(str, p)))
    seqs = [eng.new_sequence() for _ in prompts]
    out = []
    for round_ in range(2):
        for s, p, n in zip(seqs, prompts, max_new):
            eng.start(s, p + (s.out.ids + [5, 6, 7] if round_ else []), n)
        while eng.has_work:
            eng.step()
        out.append(([s.out.ids for s in seqs], [s.out.logprob for s in seqs]))
    return out, eng.stats["prefill_calls"]


@pytest.mark.parametrize("fused", [False, True], ids=["torch-small-ops", "fused-small-ops"])
def test_the_models_prefill_through_the_kernel_equals_the_torch_buckets(monkeypatch, fused):
    """The engine's generations with the paged prefill kernel and with the torch attention buckets: the same
    tokens and log-probabilities (float32 rounding), over two shared prefixes, no prefix, prompts of 1-40 new
    tokens in mixed prefill calls, and a second round that extends each sequence's cached context; with torch's
    small operations and with the fused ones (the GPU's prefill)."""
    pa, pb = list(range(20, 52)), list(range(40, 88))
    rng = random.Random(random.randrange(2**31))
    prompts = [pa + [rng.randrange(1, 80) for _ in range(rng.randint(1, 40))] for _ in range(3)] \
        + [pb + [rng.randrange(1, 80) for _ in range(rng.randint(1, 40))] for _ in range(2)] + [[3, 4, 5, 6, 8]]
    max_new = [rng.randint(2, 9) for _ in prompts]
    m_on = _model(monkeypatch, True, seed=3, fused=fused)
    assert m_on.uses_paged_prefill(torch.device(DEV), torch.float32)
    assert m_on.uses_fused_prefill(torch.device(DEV)) == (fused or DEV == "cuda")
    calls = {}
    on, calls["on"] = _generate(m_on, prompts, [pa, pb], max_new)
    m_off = _model(monkeypatch, False, seed=3, fused=fused)
    assert not m_off.uses_paged_prefill(torch.device(DEV), torch.float32)
    off, calls["off"] = _generate(m_off, prompts, [pa, pb], max_new)
    assert calls["on"] == calls["off"]
    for (ids_on, lp_on), (ids_off, lp_off) in zip(on, off):
        assert ids_on == ids_off
        torch.testing.assert_close(torch.tensor([x for r in lp_on for x in r]),
                                   torch.tensor([x for r in lp_off for x in r]), rtol=1e-4, atol=1e-5)


def _spy_on_the_kernel(m) -> list[int]:
    """The model's paged kernel wrapped so that each call records its query rows (the list returned)."""
    calls = []
    module = m.paged_prefill._module

    class Spy:
        def __getattr__(self, name):
            return getattr(module, name)

        def paged_prefill_attention(self, *a, **k):
            calls.append(a[0].shape[0])
            return module.paged_prefill_attention(*a, **k)

    m.paged_prefill = Spy()
    return calls


def test_the_kernel_is_what_the_prefill_calls(monkeypatch):
    """With the switch on, a packed prefill's attention is one kernel call per layer, whatever the prefixes."""
    m = _model(monkeypatch, True, seed=5)
    calls = _spy_on_the_kernel(m)
    m.paged_prefill_checks = {self_check_key(DEV, torch.float32): "on"}  # (its self-check passed already)
    _generate(m, [list(range(20, 52)) + [1, 2, 3], [9, 8, 7, 6]], [list(range(20, 52))], [2, 2])
    # per layer (2): the prefix's own 32 tokens, then both prompts' new tokens in one call, then the second round's
    assert calls[:4] == [32, 32, 3 + 4, 3 + 4] and len(calls) == 6 and calls[4] == calls[5]


@pytest.mark.parametrize("broken, reason", [
    ("wrong", "off: the kernel differed from the dense computation"),
    ("raises", "off: RuntimeError: no such kernel here"),
])
def test_a_failed_self_check_falls_back_with_a_warning(monkeypatch, broken, reason):
    """A kernel that computes something else, or cannot run on this device, is not used: the prefill takes the
    torch buckets and `paged_prefill_checks` says why."""
    m = _model(monkeypatch, True, seed=1)
    real = m.paged_prefill._module

    class Broken:
        def __getattr__(self, name):
            return getattr(real, name)

        def paged_prefill_attention(self, q, *a, **k):
            if broken == "raises":
                raise RuntimeError("no such kernel here")
            o = real.paged_prefill_attention(q, *a, **k)
            return o.index_fill_(0, torch.tensor([0], device=o.device), 0.0)  # one wrong row

    m.paged_prefill = Broken()
    with pytest.warns(RuntimeWarning, match="without the paged kernel"):
        assert m.uses_paged_prefill(torch.device(DEV), torch.float32) is False
    assert m.paged_prefill_checks[self_check_key(DEV, torch.float32)].startswith(reason)
    out, _ = _generate(m, [list(range(20, 40)) + [1, 2]], [list(range(20, 40))], [3])
    assert len(out[0][0][0]) == 3


def test_a_self_check_runs_once_per_physical_device_and_dtype(monkeypatch):
    """"cuda" and the tensors' "cuda:0" are one device: its self-check runs once (a second run inside the first
    prefill was counted as one of its kernel calls on an H200, 2026-11-27); another index or dtype is checked anew.
    torch.device("cuda") needs no GPU, and the current device is set here."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    ran, checks = [], {}

    def check(device, dtype):
        ran.append((str(device), dtype))
        return "on"

    for dev in ("cuda", "cuda:1", torch.device("cuda"), "cuda", "cuda:0", "cpu", "cpu"):
        for dtype in (torch.float32, torch.bfloat16):
            assert self_checked(checks, check, torch.device(dev), dtype, "fallback") is True
    assert sorted(checks) == ["cpu bfloat16", "cpu float32", "cuda:0 bfloat16", "cuda:0 float32",
                              "cuda:1 bfloat16", "cuda:1 float32"]
    assert len(ran) == 6  # once per key: "cuda" was "cuda:1" here
    assert self_check_key("cuda", torch.float16) == "cuda:1 float16"


def test_on_for_cuda_tensors_by_default_and_an_unknown_setting_is_named(monkeypatch):
    from transformers import LlamaConfig

    from fastrag.model.llama import LlamaModel

    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    for setting in (None, "auto", " Auto "):  # the default: the kernel for CUDA tensors, never for CPU ones
        if setting is None:
            monkeypatch.delenv("FASTRAG_PAGED_PREFILL", raising=False)
        else:
            monkeypatch.setenv("FASTRAG_PAGED_PREFILL", setting)
        m = LlamaModel.from_hf_config(cfg, seed=0)
        assert m.paged_prefill is not None and m._paged_prefill_on_cpu is False
        assert not m.uses_paged_prefill(torch.device("cpu"), torch.float32)
        assert m.paged_prefill_checks == {}  # (no self-check ran for a device it does not serve)
    monkeypatch.setenv("FASTRAG_PAGED_PREFILL", "0")
    m = LlamaModel.from_hf_config(cfg, seed=0)
    assert m.paged_prefill is None and not m.uses_paged_prefill(torch.device(DEV), torch.float32)
    monkeypatch.setenv("FASTRAG_PAGED_PREFILL", "sometimes")
    with pytest.raises(ValueError, match="FASTRAG_PAGED_PREFILL='sometimes': expected auto, 1 or 0"):
        LlamaModel.from_hf_config(cfg, seed=0)


@pytest.mark.parametrize("T", [7, 16, 37])
@pytest.mark.parametrize("packed", [False, True])
def test_attention_passes_through_the_kernel_equal_the_masked_call(monkeypatch, T, packed):
    """DRAGIN's cache-free attention passes (`last_layer_qk`, the fused small operations: the GPU's path) with the
    paged prefill kernel as each layer's attention, against the masked call: the last layer's q and k of every real
    row agree, for sequences padded to T tokens (T a block multiple or not); the kernel runs once per layer before
    the last, over all B x T rows, or with the host lengths (packed) over the real rows only, q and k zero past
    them."""
    g = torch.Generator().manual_seed(random.randrange(2**31))
    n_mid = random.randint(1, T)
    lens = torch.tensor([T, n_mid, 1]).to(DEV)
    ids = torch.randint(1, 90, (3, T), generator=g).to(DEV)
    m_off = _model(monkeypatch, False, seed=7, fused=True)
    q_off, k_off = m_off.last_layer_qk(ids, lens)
    m_on = _model(monkeypatch, True, seed=7, fused=True)
    assert m_on.uses_paged_prefill(ids.device, torch.float32)
    calls = _spy_on_the_kernel(m_on)
    q_on, k_on = m_on.last_layer_qk(ids, lens, lens.tolist() if packed else None)
    assert calls == [T + n_mid + 1 if packed else 3 * T] * (len(m_on.layers) - 1)
    assert q_on.shape == q_off.shape and k_on.shape == k_off.shape
    for b, n in enumerate(lens.tolist()):
        torch.testing.assert_close(q_on[b, :, :n], q_off[b, :, :n], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(k_on[b, :, :n], k_off[b, :, :n], rtol=1e-4, atol=1e-5)
        if packed:
            assert not q_on[b, :, n:].any() and not k_on[b, :, n:].any()


def test_packed_attention_passes_refuse_lengths_that_do_not_fit(monkeypatch):
    m = _model(monkeypatch, True, seed=7, fused=True)
    ids = torch.randint(1, 90, (2, 5)).to(DEV)
    lens = torch.tensor([5, 3]).to(DEV)
    for bad in ([5], [5, 0], [6, 3]):
        with pytest.raises(ValueError, match="host_lengths must give each of the 2 sequences a length in 1..5"):
            m.last_layer_qk(ids, lens, bad)


def test_the_engines_attention_passes_are_the_same_through_the_kernel(monkeypatch):
    """Engine.attention_passes (colmax and rows) with and without the kernel: the same signals."""
    from fastrag.engine import Engine

    rng = random.Random(random.randrange(2**31))
    seqs = [[rng.randrange(1, 90) for _ in range(rng.randint(1, 40))] for _ in range(5)]
    out = {}
    for paged in (False, True):
        m = _model(monkeypatch, paged, seed=11, fused=True)
        eng = Engine(m, _Tok(), kv_cache_gb=0.01, max_batch=8, prefill_hold=0)
        out[paged] = (eng.attention_passes(seqs, "colmax"), eng.attention_passes(seqs, "rows"))
    for a, b in zip(out[False][0], out[True][0]):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-4, atol=1e-6)
    for a, b in zip(out[False][1], out[True][1]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
