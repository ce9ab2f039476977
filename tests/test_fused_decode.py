"""The fused per-layer decode kernels (kernels/fused_decode.py) against the model's own torch operations, and a
decode through the engine with them against one without.

Without a GPU the kernels run under TRITON_INTERPRET=1 on CPU tensors (set before fastrag.kernels is imported);
with one, on the GPU (bf16 too).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from fastrag.kernels import INTERPRETED  # noqa: E402
from fastrag.kernels import fused_decode as fd  # noqa: E402
from fastrag.model.llama import RMSNorm, apply_rope  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and not INTERPRETED,
                                reason="no GPU and fastrag.kernels was imported without TRITON_INTERPRET=1")
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV == "cuda" else [])


def _tol(dtype):
    # bf16: the kernels round where torch rounds, so they differ by at most one bf16 step from a float32 sum order
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)


def _gen():
    seed = random.randrange(2**31)
    return torch.Generator().manual_seed(seed), seed


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,N", [(1, 576), (7, 48), (5, 100), (3, 4096)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_equals_torch(dtype, M, N, with_delta):
    g, seed = _gen()
    x = (torch.randn(M, N, generator=g) * 3).to(dtype)
    d = torch.randn(M, N, generator=g).to(dtype) if with_delta else None
    norm = RMSNorm(N, 1e-5)
    norm.weight.data = (torch.rand(N, generator=g) + 0.5).to(dtype)
    want_res = x + d if with_delta else x
    want = norm(want_res)
    res, out = fd.add_rms_norm(x.to(DEV), None if d is None else d.to(DEV), norm.weight.data.to(DEV), norm.eps)
    assert res.dtype == out.dtype == dtype and out.shape == (M, N)
    msg = lambda m: f"{m} (seed={seed})"  # noqa: E731
    torch.testing.assert_close(res.cpu(), want_res, rtol=0, atol=0, msg=msg)  # the add rounds as torch's does
    torch.testing.assert_close(out.cpu().float(), want.float(), **_tol(dtype), msg=msg)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,H,Hkv,D", [(1, 4, 4, 8), (5, 6, 2, 24), (3, 9, 3, 64), (2, 32, 8, 128)])
def test_rope_write_kv_equals_torch(dtype, M, H, Hkv, D):
    """Rotated queries returned; rotated keys and the values written to each row's slot, and to no other slot
    (the pools start NaN)."""
    g, seed = _gen()
    slots_total = 64
    qkv = torch.randn(M, (H + 2 * Hkv) * D, generator=g).to(dtype)
    pos = torch.randint(0, 5000, (M, 1), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.cat([pos * inv, pos * inv], dim=-1)  # [M, D]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    slots = torch.randperm(slots_total, generator=g)[:M]
    kp = torch.full((Hkv, slots_total, D), float("nan"), dtype=dtype)
    vp = kp.clone()
    q_ref, k_ref, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q_ref = apply_rope(q_ref.view(M, H, 1, D).transpose(1, 2), cos.unsqueeze(1), sin.unsqueeze(1))[:, 0]
    k_ref = apply_rope(k_ref.view(M, Hkv, 1, D).transpose(1, 2), cos.unsqueeze(1), sin.unsqueeze(1))[:, 0]
    kp_d, vp_d = kp.to(DEV), vp.to(DEV)
    q = fd.rope_write_kv(qkv.to(DEV), cos.to(DEV), sin.to(DEV), slots.to(DEV), kp_d, vp_d, H, Hkv)
    msg = lambda m: f"{m} (seed={seed})"  # noqa: E731
    assert q.shape == (M, H, D) and q.dtype == dtype
    torch.testing.assert_close(q.cpu().float(), q_ref.float(), **_tol(dtype), msg=msg)
    kp_d, vp_d = kp_d.cpu(), vp_d.cpu()
    torch.testing.assert_close(kp_d[:, slots].transpose(0, 1).float(), k_ref.float(), **_tol(dtype), msg=msg)
    torch.testing.assert_close(vp_d[:, slots].transpose(0, 1), v.reshape(M, Hkv, D), rtol=0, atol=0, msg=msg)
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[slots] = False
    assert kp_d[:, untouched].isnan().all() and vp_d[:, untouched].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,I,block", [(1, 64, 1024), (4, 1000, 256), (3, 1536, 512)])
def test_silu_mul_equals_torch(dtype, M, I, block):
    g, seed = _gen()
    x = (torch.randn(M, 2 * I, generator=g) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = fd.silu_mul(x.to(DEV), block=block)
    assert got.shape == (M, I) and got.dtype == dtype
    torch.testing.assert_close(got.cpu().float(), want.float(), **_tol(dtype), msg=lambda m: f"{m} (seed={seed})")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_per_program_change_no_value(dtype):
    """The row-wise kernels give the same bits at 1, 4, 16 and 64 rows a program (1 is the GPU's launch, larger
    tiles the interpreter's), on 37 rows: the last program of each tiled launch is part empty. The rotation writes
    no pool slot but its rows' (slot 0 is never one of them, and a masked row would read slot 0)."""
    g, seed = _gen()
    M, H, Hkv, D, N, I = 37, 6, 2, 24, 100, 300
    x, d = torch.randn(M, N, generator=g).to(dtype), torch.randn(M, N, generator=g).to(dtype)
    w = (torch.rand(N, generator=g) + 0.5).to(dtype)
    gate_up = (torch.randn(M, 2 * I, generator=g) * 4).to(dtype)
    qkv = torch.randn(M, (H + 2 * Hkv) * D, generator=g).to(dtype)
    cos, sin = torch.randn(M, D, generator=g).to(dtype), torch.randn(M, D, generator=g).to(dtype)
    slots = 1 + torch.randperm(3 * M, generator=g)[:M]
    runs = {}
    for rows in (1, 4, 16, 64):
        kp = torch.full((Hkv, 3 * M + 1, D), float("nan"), dtype=dtype, device=DEV)
        vp = kp.clone()
        q = fd.rope_write_kv(qkv.to(DEV), cos.to(DEV), sin.to(DEV), slots.to(DEV), kp, vp, H, Hkv, rows=rows)
        runs[rows] = (*fd.add_rms_norm(x.to(DEV), d.to(DEV), w.to(DEV), 1e-5, rows=rows),
                      fd.add_rms_norm(x.to(DEV), None, w.to(DEV), 1e-5, rows=rows)[1],
                      fd.silu_mul(gate_up.to(DEV), block=128, rows=rows), q, kp, vp)
        untouched = torch.ones(3 * M + 1, dtype=torch.bool)
        untouched[slots] = False
        assert kp[:, untouched].isnan().all() and vp[:, untouched].isnan().all(), f"rows={rows} (seed={seed})"
        assert not kp[:, slots].isnan().any() and not vp[:, slots].isnan().any(), f"rows={rows} (seed={seed})"
    names = ("x + delta", "norm(x + delta)", "norm(x)", "silu_mul", "q", "k_pool", "v_pool")
    for rows in (4, 16, 64):
        for name, a, b in zip(names, runs[1], runs[rows]):
            torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m: f"{name} at rows={rows} against rows=1: {m} (seed={seed})")
    want = F.silu(gate_up[:, :I]) * gate_up[:, I:]
    torch.testing.assert_close(runs[1][3].cpu().float(), want.float(), **_tol(dtype),
                               msg=lambda m: f"silu_mul against torch: {m} (seed={seed})")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefix_rows_per_program_change_no_value(dtype):
    """The shared-prefix softmax and merge give the same bits at 1, 4, 16 and 64 rows a program, on 3 x 13 score
    rows and 13 sequences of 9 heads (the last program of each tiled launch is part empty; at 64 one program takes
    every row), and the values of torch's float64 softmax. The scores are the head of a NaN-filled buffer, so a
    load past the last score (a key mask dropped) reads memory the test owns; the float64 comparison is what
    catches the wrong values such a load brings in."""
    g, seed = _gen()
    n, H, Hkv, D, P = 13, 9, 3, 24, 45
    G = H // Hkv
    buf = torch.full((Hkv + 1, n * G, P), float("nan"), dtype=dtype, device=DEV)
    buf[:Hkv] = (torch.randn(Hkv, n * G, P, generator=g) * 6).to(dtype).to(DEV)
    s = buf[:Hkv]
    v = torch.randn(Hkv, P, D, generator=g).to(dtype).to(DEV)
    o_own, lse_own = torch.randn(n, H, D, generator=g).to(dtype).to(DEV), torch.randn(n, H, generator=g).to(DEV)
    member = (torch.arange(n) % 3 != 1).to(DEV)
    runs = {}
    for rows in (1, 4, 16, 64):
        e, stat = fd.prefix_softmax(s, 0.125, dtype, block=16, rows=rows)
        num = torch.matmul(e, v)
        runs[rows] = (e, stat, *fd.prefix_merge(num, stat, o_own, lse_own, rows=rows),
                      *fd.prefix_merge(num, stat, o_own, lse_own, member, rows=rows))
        assert not any(t.isnan().any() for t in runs[rows]), f"rows={rows}: a NaN came out (seed={seed})"
    names = ("e", "stat", "o", "lse", "o (member)", "lse (member)")
    for rows in (4, 16, 64):
        for name, a, b in zip(names, runs[1], runs[rows]):
            torch.testing.assert_close(b, a, rtol=0, atol=0,
                                       msg=lambda m: f"{name} at rows={rows} against rows=1: {m} (seed={seed})")
    sf = s.cpu().double() * 0.125
    mx = sf.amax(-1)
    e_ref = (sf - mx.unsqueeze(-1)).exp()
    msg = lambda m: f"{m} (seed={seed})"  # noqa: E731
    torch.testing.assert_close(runs[64][0].cpu().double(), e_ref, **_tol(dtype), msg=msg)
    torch.testing.assert_close(runs[64][1][..., 0].cpu().double(), mx, rtol=1e-6, atol=1e-6, msg=msg)
    torch.testing.assert_close(runs[64][1][..., 1].cpu().double(), e_ref.sum(-1), rtol=1e-5, atol=1e-5, msg=msg)
    keep = ~member.cpu()
    assert torch.equal(runs[64][4].cpu()[keep], o_own.cpu()[keep]), f"rows outside the prefix changed (seed={seed})"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("Hkv,R,P,block", [(1, 1, 1, 1024), (2, 5, 37, 16), (3, 4, 1000, 256), (2, 3, 70, 1024)])
def test_prefix_softmax_equals_torch(dtype, Hkv, R, P, block):
    g, seed = _gen()
    s = (torch.randn(Hkv, R, P, generator=g) * 6).to(dtype)
    scale = 0.125
    sf = s.double() * scale
    mx = sf.amax(-1)
    e_ref = (sf - mx.unsqueeze(-1)).exp()
    e, stat = fd.prefix_softmax(s.to(DEV), scale, dtype, block=block)
    assert e.dtype == dtype and stat.shape == (Hkv, R, 2) and stat.dtype == torch.float32
    msg = lambda m: f"{m} (seed={seed})"  # noqa: E731
    torch.testing.assert_close(e.cpu().double(), e_ref, **_tol(dtype), msg=msg)
    torch.testing.assert_close(stat[..., 0].cpu().double(), mx, rtol=1e-6, atol=1e-6, msg=msg)
    torch.testing.assert_close(stat[..., 1].cpu().double(), e_ref.sum(-1), rtol=1e-5, atol=1e-5, msg=msg)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,H,Hkv,D,with_member", [(1, 4, 4, 8, False), (5, 6, 2, 24, True), (3, 9, 3, 64, False),
                                                   (4, 32, 8, 128, True)])
def test_prefix_merge_equals_attention_over_both_parts(dtype, n, H, Hkv, D, with_member):
    """Prefix softmax -> e @ v -> merge with an own-context part by LSE equals one softmax over [prefix | own] keys
    (float64), for member rows; rows outside the prefix (member False) get their own part back exactly."""
    g, seed = _gen()
    G, P, S = H // Hkv, 29, 11
    q = torch.randn(n, H, D, generator=g)
    kpre, vpre = torch.randn(Hkv, P, D, generator=g), torch.randn(Hkv, P, D, generator=g)
    kown, vown = torch.randn(n, Hkv, S, D, generator=g), torch.randn(n, Hkv, S, D, generator=g)
    scale = D ** -0.5
    kh = torch.arange(H) // G
    s_own = torch.einsum("nhd,nhsd->nhs", q.double(), kown[:, kh].double()) * scale
    lse_own = torch.logsumexp(s_own, -1)
    o_own = torch.einsum("nhs,nhsd->nhd", s_own.softmax(-1), vown[:, kh].double())
    s_pre = torch.einsum("nhd,hpd->nhp", q.double(), kpre[kh].double()) * scale
    s_all = torch.cat([s_pre, s_own], -1)
    want = torch.einsum("nhs,nhsd->nhd", s_all.softmax(-1),
                        torch.cat([vpre[kh].double().unsqueeze(0).expand(n, -1, -1, -1), vown[:, kh].double()], 2))
    want_lse = torch.logsumexp(s_all, -1)
    member = torch.rand(n, generator=g) < 0.6 if with_member else None
    if member is not None:
        member[0] = False
        want = torch.where(member.view(n, 1, 1), want, o_own)
        want_lse = torch.where(member.view(n, 1), want_lse, lse_own)
    dq = q.to(dtype).to(DEV)
    qh = dq.reshape(n, Hkv, G, D).transpose(0, 1).reshape(Hkv, n * G, D)
    e, stat = fd.prefix_softmax(torch.matmul(qh, kpre.to(dtype).to(DEV).transpose(1, 2)).contiguous(), scale, dtype)
    num = torch.matmul(e, vpre.to(dtype).to(DEV))
    out, tot = fd.prefix_merge(num, stat, o_own.to(dtype).to(DEV), lse_own.float().to(DEV),
                               None if member is None else member.to(DEV))
    msg = lambda m: f"{m} (seed={seed})"  # noqa: E731
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    assert out.shape == (n, H, D) and out.dtype == dtype and tot.dtype == torch.float32
    torch.testing.assert_close(out.cpu().double(), want, **tol, msg=msg)
    torch.testing.assert_close(tot.cpu().double(), want_lse, **tol, msg=msg)
    if member is not None:
        assert torch.equal(out.cpu()[~member], o_own.to(dtype)[~member])


def test_bad_arguments_name_the_problem():
    x = torch.zeros(2, 8, device=DEV)
    with pytest.raises(ValueError, match="weight: expected shape"):
        fd.add_rms_norm(x, None, torch.ones(4, device=DEV), 1e-5)
    with pytest.raises(ValueError, match="delta: expected"):
        fd.add_rms_norm(x, torch.zeros(2, 4, device=DEV), torch.ones(8, device=DEV), 1e-5)
    with pytest.raises(ValueError, match="x: expected a 2-D tensor"):
        fd.add_rms_norm(x.t(), None, torch.ones(2, device=DEV), 1e-5)
    with pytest.raises(ValueError, match="gate_up: width 7 is odd"):
        fd.silu_mul(torch.zeros(2, 7, device=DEV))
    with pytest.raises(ValueError, match="rows: expected a power of two >= 1 \\(rows per program\\), got 3"):
        fd.silu_mul(torch.zeros(2, 8, device=DEV), rows=3)
    with pytest.raises(ValueError, match="rows: expected a power of two"):
        fd.add_rms_norm(x, None, torch.ones(8, device=DEV), 1e-5, rows=0)
    qkv, cs = torch.zeros(2, 6 * 8, device=DEV), torch.zeros(2, 8, device=DEV)
    pool, slots = torch.zeros(1, 4, 8, device=DEV), torch.zeros(2, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match="not \\(H \\+ 2 Hkv\\) x head_dim"):
        fd.rope_write_kv(qkv, cs, cs, slots, pool, pool, 3, 2)
    with pytest.raises(ValueError, match="k_pool: expected \\[1, slots, 8\\]"):
        fd.rope_write_kv(qkv, cs, cs, slots, torch.zeros(2, 4, 8, device=DEV), pool, 4, 1)
    with pytest.raises(ValueError, match="slots: expected shape"):
        fd.rope_write_kv(qkv, cs, cs, slots[:1], pool, pool, 4, 1)
    with pytest.raises(ValueError, match="no keys"):
        fd.prefix_softmax(torch.zeros(2, 3, 0, device=DEV), 1.0, torch.float32)
    num, stat = torch.zeros(2, 6, 8, device=DEV), torch.zeros(2, 6, 2, device=DEV)
    o, lse = torch.zeros(3, 4, 8, device=DEV), torch.zeros(3, 4, device=DEV)
    with pytest.raises(ValueError, match="does not fit o_own"):
        fd.prefix_merge(num, stat, torch.zeros(2, 4, 8, device=DEV), lse[:2])
    with pytest.raises(ValueError, match="stat: expected"):
        fd.prefix_merge(num, stat[:1], o, lse)
    with pytest.raises(ValueError, match="lse_own: expected"):
        fd.prefix_merge(num, stat, o, lse.double())
    with pytest.raises(ValueError, match="member: expected"):
        fd.prefix_merge(num, stat, o, lse, torch.ones(2, dtype=torch.bool, device=DEV))
    with pytest.raises(ValueError, match="rows: expected a power of two >= 1 \\(rows per program\\), got 6"):
        fd.prefix_merge(num, stat, o, lse, rows=6)
    with pytest.raises(ValueError, match="rows: expected a power of two"):
        fd.prefix_softmax(torch.zeros(2, 3, 5, device=DEV), 1.0, torch.float32, rows=-2)


# ------------------------------------------------------------------------------------------------ in the model

class _Tok:
    eos_token_id = None

    def encode(self, s):
        return [int(x) for x in s.split()]


def _decode(fused: bool, graphs: bool, prompts, prefixes, max_new, track: bool, fused_prefill: bool = True,
            passes=None, calls=None, prefix_flash: bool = False):
    from transformers import LlamaConfig

    from fastrag.engine import Engine
    from fastrag.model.llama import LlamaModel

    cfg = LlamaConfig(vocab_size=90, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, eos_token_id=None)
    m = LlamaModel.from_hf_config(cfg, seed=13, device=DEV)
    with torch.no_grad():  # peaked attention (the init's scores are all near 0), so an error in it would show
        for layer in m.layers:
            layer.qkv.weight.mul_(8.0)
    m.fused_decode, m._fused_on_cpu = (fd, DEV == "cpu") if fused else (None, False)
    m.fused_prefill = fused_prefill
    m.prefix_flash = prefix_flash
    assert m.uses_fused_decode(torch.device(DEV)) == fused
    assert m.uses_fused_prefill(torch.device(DEV)) == (fused and fused_prefill)
    if calls is not None:  # count the fused kernels' calls over more rows than sequences (prefills and passes)
        calls.clear()
        ref = _CountingOps(fd, len(prompts), calls) if fused else None
        m.fused_decode = ref if fused else None
    eng = Engine(m, _Tok(), kv_cache_gb=0.01, max_batch=8, mix_prefill=True, cuda_graphs=graphs)
    for p in prefixes:
        eng.set_prefix(" ".join(map(str, p)))
    seqs = [eng.new_sequence() for _ in prompts]
    for s, p, n in zip(seqs, prompts, max_new):
        eng.start(s, p, n, track_from=len(p) - 2 if track else None)
    while eng.has_work:
        eng.step()
    if graphs:
        assert eng.graphs.disabled is None and eng.graphs.stats["replays"] > 0
    out = [(s.out.ids, s.out.logprob, s.out.entropy, s.out.attn) for s in seqs]
    if passes is not None:  # DRAGIN's attention passes (a cache-free forward to the last layer) over these texts
        out += [eng.attention_passes(passes, kind) for kind in ("colmax", "rows")]
    return out


class _CountingOps:
    """kernels/fused_decode.py with a count of its calls over more than `rows` rows (a decode step has at most one
    row a sequence: more rows are a prefill's or an attention pass's tokens)."""

    def __init__(self, mod, rows: int, calls: dict):
        self._mod, self._rows, self._calls = mod, rows, calls

    def __getattr__(self, name):
        f = getattr(self._mod, name)

        def counted(*a, **kw):
            if a[0].shape[0] > self._rows:
                self._calls[name] = self._calls.get(name, 0) + 1
            return f(*a, **kw)
        return counted


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_fused_decode_equals_unfused(graphs):
    """Two shared prefixes and a prompt with none, sequences of different budgets (the batch shrinks through
    several graph buckets), DRAGIN's attention tracking on: the same tokens, log-probabilities, entropies and
    tracked attention as the unfused decode."""
    want, got = _unfused_and_fused(graphs)
    _assert_same_decodes(got, want)


def _unfused_and_fused(graphs: bool, **fused_kw):
    """The decodes of two shared prefixes and a prompt with none (DRAGIN's attention tracked) without and with the
    fused kernels (fused_kw: more _decode settings of the fused side)."""
    pa, pb = list(range(20, 52)), list(range(40, 88))
    prompts = [pa + [1, 2, 3], pb + list(range(1, 12)), pa + list(range(5, 25)), pb + [7, 9], [3, 4, 5, 6, 8]]
    max_new = [6, 14, 3, 11, 8]
    want = _decode(False, graphs, prompts, [pa, pb], max_new, track=True)
    return want, _decode(True, graphs, prompts, [pa, pb], max_new, track=True, **fused_kw)


def _assert_same_decodes(got, want):
    """The same tokens; log-probabilities, entropies and tracked attention up to float32 sum order."""
    for (ia, la, ea, aa), (ib, lb, eb, ab) in zip(got, want):
        assert ia == ib
        torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.tensor(ea), torch.tensor(eb), rtol=1e-4, atol=1e-5)
        assert aa is not None and len(aa) > 2
        torch.testing.assert_close(torch.tensor(aa), torch.tensor(ab), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("track", [False, True], ids=["first-token-from-prefill", "tracked"])
def test_fused_prefill_equals_unfused(track):
    """Prefills (two shared prefixes and none, so packed with several attention buckets) and DRAGIN's attention
    passes through the fused kernels: the same tokens, log-probabilities, entropies, tracked attention and pass
    results as torch's operations in them (the decode step fused both ways), and the fused kernels did run over
    the prefills' and the passes' tokens. Untracked, each generation's first token comes from its prefill's logits;
    tracked, its last two prompt tokens go through decode steps (the prefill's logits unused)."""
    pa, pb = list(range(20, 52)), list(range(40, 88))
    prompts = [pa + [1, 2, 3], pb + list(range(1, 12)), pa + list(range(5, 25)), pb + [7, 9], [3, 4, 5, 6, 8],
               [5, 6, 7, 8, 9, 10, 11]]
    max_new = [5, 9, 3, 7, 6, 4]
    passes = [list(range(2, 30)), [9, 8, 7, 6], list(range(30, 41)), [4] * 17]
    calls: dict = {}
    want = _decode(True, False, prompts, [pa, pb], max_new, track=track, fused_prefill=False, passes=passes,
                   calls=calls)
    assert not calls  # no fused call over a prefill's rows with the switch off
    got = _decode(True, False, prompts, [pa, pb], max_new, track=track, passes=passes, calls=calls)
    # per layer: two RMSNorms, one rotary + KV write, one SiLU product, in the prefills and the passes alike
    assert calls.get("rope_write_kv", 0) >= 2 * 3 and calls.get("add_rms_norm", 0) >= 4 * 3 \
        and calls.get("silu_mul", 0) >= 2 * 2, calls
    for (ia, la, ea, aa), (ib, lb, eb, ab) in zip(got[: len(prompts)], want[: len(prompts)]):
        assert ia == ib
        torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.tensor(ea), torch.tensor(eb), rtol=1e-4, atol=1e-5)
        if track:
            assert aa is not None and len(aa) > 2
            torch.testing.assert_close(torch.tensor(aa), torch.tensor(ab), rtol=1e-4, atol=1e-5)
    colmax_got, rows_got = got[len(prompts):]
    colmax_want, rows_want = want[len(prompts):]
    for a, b, p in zip(colmax_got, colmax_want, passes):
        assert len(a) == len(p)
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5)
    for a, b, p in zip(rows_got, rows_want, passes):
        assert a.shape == (len(p), len(p))
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_fused_prefill_switch(monkeypatch):
    from fastrag.model import llama
    from fastrag.model.attention import select

    monkeypatch.setenv(llama.FUSED_PREFILL_ENV, "0")
    assert select.fused_prefill_mode() == "0"
    monkeypatch.setenv(llama.FUSED_PREFILL_ENV, "1")
    with pytest.raises(ValueError, match="FASTRAG_FUSED_PREFILL='1'"):
        select.fused_prefill_mode()
    monkeypatch.delenv(llama.FUSED_PREFILL_ENV)
    assert select.fused_prefill_mode() == "auto"


def test_env_switch(monkeypatch):
    from fastrag.model import llama
    from fastrag.model.attention import select

    monkeypatch.setenv(llama.FUSED_DECODE_ENV, "0")
    assert select.fused_decode_ops() == (None, False)
    monkeypatch.setenv(llama.FUSED_DECODE_ENV, "1")
    mod, on_cpu = select.fused_decode_ops()
    assert mod._module is fd and mod.add_rms_norm is fd.add_rms_norm and on_cpu == INTERPRETED
    monkeypatch.setenv(llama.FUSED_DECODE_ENV, "yes")
    with pytest.raises(ValueError, match="FASTRAG_FUSED_DECODE='yes'"):
        select.fused_decode_ops()


def test_bench_prefill_times_fused_and_unfused_prefills(tmp_path, monkeypatch):
    """bench_prefill --unfused where the fused kernels run (the GPU's, or on a CPU the interpreter's with
    $FASTRAG_FUSED_DECODE=1): each cell timed with them and again with torch's operations, each row saying which,
    both one prefill call. CPU tensors take the fused kernels only under the interpreter, so a GPU machine times
    its own device (2026-11-26 on an H200, --cpu-small there gave the unfused row alone)."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    monkeypatch.setenv("FASTRAG_FUSED_DECODE", "1")
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_prefill.py"
    spec = importlib.util.spec_from_file_location("_bench_prefill_fused", path)
    bp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bp)
    where = [] if DEV == "cuda" else ["--cpu-small"]
    monkeypatch.setattr(sys, "argv", ["bench_prefill.py", *where, "--shape", "tiny", "--cells", "2x12",
                                      "--prefix", "16", "--jitter", "0", "--reps", "1", "--warmup", "0",
                                      "--unfused", "--results", str(tmp_path), "--name", "prefill_tiny"])
    bp.main()
    rows = json.loads((tmp_path / "prefill_tiny.json").read_text())["rows"]
    assert [(r["seqs"], r["new"], r["fused"]) for r in rows] == [(2, 12, "yes"), (2, 12, "no")], rows
    assert all(r["tokens_per_call"] == 24 and r["wall_ms"] > 0 for r in rows), rows
    assert "| 2 x 12 | default (flash,efficient,math) | yes |" in (tmp_path / "prefill_tiny.md").read_text()
