"""Fused signal kernels (Triton, C++ CPU, CUDA) against fastrag/signals/reference.py on fresh random inputs.

Without a GPU the Triton kernels run under TRITON_INTERPRET=1 on CPU tensors (set below, before the kernels are
imported) and the CUDA cases skip; with one, Triton and CUDA run on the GPU. Every output is poisoned before the
kernel runs (NaN floats, impossible indices, the negated expected flag), so an unwritten element fails.
Tolerances: inputs are rounded to the tested dtype before the float64 reference sees them, so they cover only the
kernels' float32 arithmetic: token signals 2e-5 (a logsumexp over up to 49k entries), attention 2e-6 abs / 1e-5
rel (fp32 products) and 1e-4 rel where Triton's tl.dot multiplies bf16/fp16 tiles on a GPU.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any fastrag.kernels import

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from backend_cases import backend_case, one_thread  # noqa: E402,F401 (one_thread: autouse)
from fastrag.kernels import INTERPRETED, device_function  # noqa: E402
from fastrag.signals import BackendUnavailableError, get_backend  # noqa: E402
from fastrag.signals.reference import (  # noqa: E402
    attn_decode_update_ref,
    causal_attn_colmax_ref,
    causal_attn_mean_rows_ref,
    causal_attn_rows_ref,
    decode_lse_ref,
    decode_signals_ref,
)

CUDA = torch.cuda.is_available()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOKEN_TOL = dict(atol=2e-5, rtol=2e-5)
NEG_INF = float("-inf")


# (backend, device of the inputs): Triton on the GPU or under the interpreter, C++ on the CPU, CUDA on the GPU,
# and the torch backend (the engine's CPU default and the baseline of the decision-parity test).
KERNEL_BACKENDS = [backend_case("triton", "cuda" if CUDA else "cpu"), backend_case("cpp", "cpu"),
                   backend_case("cuda", "cuda"), backend_case("torch", "cpu")]


def _gen():
    seed = random.randrange(2**31)
    return torch.Generator().manual_seed(seed), seed


def _close(actual, expected, what, seed, **tol):
    actual = actual.detach().cpu().double()
    expected = expected.detach().cpu().double()
    assert not torch.isnan(actual).any(), f"{what}: NaN (unwritten?) at {torch.isnan(actual).nonzero()[:5].tolist()} (seed={seed})"
    if not torch.allclose(actual, expected, **tol):
        err = (actual - expected).abs()
        idx = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
        pytest.fail(f"{what}: max |diff| {err.max().item():.3e} at {idx}: got {actual[idx].item()!r}, expected "
                    f"{expected[idx].item()!r} (seed={seed}, tol={tol})")


def _to_keeping_strides(t: torch.Tensor, device) -> torch.Tensor:
    """t on `device` with t's sizes and strides: `Tensor.to` makes a non-dense view (a `[..., ::2]` slice)
    contiguous when it crosses devices, so a layout check would never see the layout it is tested with."""
    if t.device.type == torch.device(device).type:
        return t
    out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
    out.copy_(t)
    assert out.stride() == t.stride()
    return out


def _poisoned(B: int, device, expected_flag=None):
    f = dict(dtype=torch.float32, device=device)
    flag = None if expected_flag is None else (~expected_flag).to(device)
    return (torch.full((B,), -7, dtype=torch.int64, device=device), torch.full((B,), float("nan"), **f),
            torch.full((B,), float("nan"), **f), torch.full((B,), float("nan"), **f), flag)


def _check_decode(res, ref, logits_dtype, what, seed, sampled: bool):
    got = res.chosen.cpu()
    if sampled:
        # Gumbel scores are float32 in the kernels, float64 in the reference: a different pick is acceptable only
        # between two (near-)tied scores.
        diff = (got != ref["chosen"]).nonzero()[:, 0].tolist()
        for b in diff:
            s = ref["score"][b]
            gap = abs(float(s[got[b]]) - float(s[ref["chosen"][b]]))
            assert gap <= 1e-4 * max(1.0, abs(float(s[ref["chosen"][b]]))), \
                f"{what}: sampled {int(got[b])}, reference {int(ref['chosen'][b])}, score gap {gap} (seed={seed})"
        keep = torch.tensor([b not in diff for b in range(len(got))])
    else:
        assert torch.equal(got, ref["chosen"]), f"{what}: chosen {got.tolist()} != {ref['chosen'].tolist()} (seed={seed})"
        keep = torch.ones(len(got), dtype=torch.bool)
    _close(res.entropy, ref["entropy"], f"{what} entropy", seed, **TOKEN_TOL)
    _close(res.logprob[keep], ref["logprob"][keep], f"{what} logprob", seed, **TOKEN_TOL)
    _close(res.prob[keep], ref["prob"][keep], f"{what} prob", seed, **TOKEN_TOL)
    if ref["nonstop"] is not None:
        assert torch.equal(res.nonstop.cpu()[keep], ref["nonstop"][keep]), f"{what} nonstop flag (seed={seed})"


# odd B and V; V = 49157 crosses several 4096-wide chunks of the Triton/CUDA kernels and 512-wide C++ chunks
DECODE_SHAPES = [(1, 7), (3, 4231), (9, 41), (2, 49157)]
MODES = ["greedy", "sample", "chosen"]


@pytest.mark.parametrize("backend,device", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,V", DECODE_SHAPES)
@pytest.mark.parametrize("mode", MODES)
def test_decode_signals_vs_reference(backend, device, dtype, B, V, mode):
    g, seed = _gen()
    be = get_backend(backend)
    logits = (torch.randn(B, V, generator=g) * 4).to(dtype)
    nonstop = torch.rand(V, generator=g) < 0.5
    keys = torch.randint(0, 2**32, (B,), generator=g)
    chosen = torch.randint(0, V, (B,), generator=g) if mode == "chosen" else None
    temperature = {"greedy": 0.0, "sample": 0.7, "chosen": 1.3}[mode]
    ref = decode_signals_ref(logits, temperature, keys, chosen, nonstop)
    out = _poisoned(B, device, ref["nonstop"])
    res = be.decode_signals(logits.to(device), temperature=temperature, rng_keys=keys.to(device),
                            chosen=None if chosen is None else chosen.to(device), nonstop=nonstop.to(device),
                            out=out)
    assert res.entropy.data_ptr() == out[1].data_ptr(), "out= buffers were not written in place"
    _check_decode(res, ref, dtype, f"{backend} {mode}", seed, sampled=mode == "sample")
    # without a table the flag is not produced
    res2 = be.decode_signals(logits.to(device), temperature=temperature, rng_keys=keys.to(device),
                             chosen=None if chosen is None else chosen.to(device))
    assert res2.nonstop is None
    assert torch.equal(res2.chosen.cpu(), res.chosen.cpu())


@pytest.mark.parametrize("backend,device", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_signals_masked_rows(backend, device, dtype):
    """Rows with -inf logits (top-p/top-k masks): half masked, a single finite logit, a masked prefix longer than
    a chunk, a masked tail, and a tie at the max (lowest index wins)."""
    g, seed = _gen()
    V = 9001
    logits = (torch.randn(5, V, generator=g) * 3).to(dtype)
    logits[0, ::2] = NEG_INF
    logits[1, :] = NEG_INF
    logits[1, 4321] = 2.5
    logits[2, :8500] = NEG_INF
    logits[3, 17] = logits[3, 8999] = 50.0
    logits[4, 100:] = NEG_INF
    nonstop = torch.rand(V, generator=g) < 0.5
    keys = torch.randint(0, 2**32, (5,), generator=g)
    for temperature in (0.0, 0.9):
        ref = decode_signals_ref(logits, temperature, keys, None, nonstop)
        res = get_backend(backend).decode_signals(logits.to(device), temperature=temperature,
                                                  rng_keys=keys.to(device), nonstop=nonstop.to(device),
                                                  out=_poisoned(5, device, ref["nonstop"]))
        _check_decode(res, ref, dtype, f"{backend} masked T={temperature}", seed, sampled=temperature > 0)
        assert int(res.chosen[1]) == 4321 and abs(float(res.entropy[1])) < 1e-6
        chosen_logits = logits.float().gather(1, res.chosen.cpu()[:, None])[:, 0]
        assert torch.isfinite(chosen_logits).all(), "a masked (-inf) token was chosen"
    assert int(res.chosen[3]) in (17, 8999)
    greedy = get_backend(backend).decode_signals(logits.to(device))
    assert int(greedy.chosen[3]) == 17


@pytest.mark.parametrize("backend,device", KERNEL_BACKENDS)
def test_decode_signals_non_contiguous(backend, device):
    g, seed = _gen()
    base = torch.randn(4231, 6, generator=g) * 3
    keys = torch.randint(0, 2**32, (12,), generator=g)
    for logits, k in ((base.T, keys[::2]), (base.T[:, ::3], keys[1::2])):
        assert not logits.is_contiguous() and not k.is_contiguous()
        for temperature in (0.0, 0.8):
            ref = decode_signals_ref(logits.contiguous(), temperature, k.contiguous())
            res = get_backend(backend).decode_signals(logits.to(device), temperature=temperature, rng_keys=k.to(device))
            _check_decode(res, ref, torch.float32, f"{backend} strided", seed, sampled=temperature > 0)


@pytest.mark.parametrize("backend,device", KERNEL_BACKENDS)
@pytest.mark.parametrize("top_p", [1.0, 0.999])
def test_sampling_uniform_never_reaches_one(backend, device, top_p):
    """Key 12829346 hashes token 5 to 0xffffffec, the largest class of hash values. Its uniform must stay below 1
    in float32 (u = 1 would give token 5 an infinite Gumbel score and draw it whatever its probability)."""
    from fastrag.signals.reference import mix32, sampling_uniform_ref

    key = torch.tensor([12829346])
    assert int(mix32(key ^ mix32(torch.tensor([5])))[0]) == 0xFFFFFFEC
    u = sampling_uniform_ref(key, 8)[0, 5]
    assert u < 1 and float(torch.tensor(float(u), dtype=torch.float32)) == float(u)  # exact in float32
    logits = torch.zeros(1, 5000)
    logits[0, 5] = -60.0  # probability ~e^-60: never drawn by a correct sampler
    res = get_backend(backend).decode_signals(logits.to(device), temperature=1.0, rng_keys=key.to(device),
                                              top_p=top_p)
    ref = decode_signals_ref(logits, 1.0, key, top_p=top_p)
    assert int(res.chosen[0]) != 5 and int(res.chosen[0]) == int(ref["chosen"][0])


@pytest.mark.parametrize("backend,device", KERNEL_BACKENDS)
def test_decode_signals_all_masked_row_stays_in_bounds(backend, device):
    """A row with no finite logit has no defined signals (the reference needs one finite logit), but every path
    must still return an index inside the vocabulary instead of reading past the row."""
    logits = torch.full((2, 3001), NEG_INF)
    logits[1, 7] = 1.0
    keys = torch.tensor([3, 4])
    for kw in (dict(), dict(temperature=0.9, rng_keys=keys), dict(temperature=0.9, rng_keys=keys, top_p=0.5)):
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        res = get_backend(backend).decode_signals(logits.to(device), **kw)
        assert 0 <= int(res.chosen[0]) < 3001 and int(res.chosen[1]) == 7, kw


def _top_p_logits(B: int, V: int, top_p: float, g, dtype, top_k: int = 0) -> torch.Tensor:
    """Random logits in `dtype` whose rows (after the top-k mask, with top_k) are all > 2e-5 of probability mass
    away from a nucleus boundary decision (so float32 kernels and the float64 reference must keep the same set;
    top_p = 1 has no boundary); rows are redrawn until they are (at V = 16k and top_p = 0.95 about 3 in 4 rows
    qualify)."""
    rows = []
    for _ in range(200):
        x = (torch.randn(1, V, generator=g) * 3).to(dtype)
        ref = decode_signals_ref(x, 0.8, torch.zeros(1, dtype=torch.int64), top_p=top_p, top_k=top_k)
        if float(ref["margin"][0]) > 2e-5:
            rows.append(x)
            if len(rows) == B:
                return torch.cat(rows)
    raise AssertionError(f"no {B} rows of V={V} away from the top_p={top_p} boundary (top_k={top_k}) in 200 draws")


@pytest.mark.parametrize("backend,device", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,V", [(1, 7), (3, 4231), (2, 16411)])
@pytest.mark.parametrize("top_p", [0.05, 0.6, 0.95])
@pytest.mark.parametrize("mode", ["sample", "chosen"])
def test_decode_signals_top_p_vs_reference(backend, device, dtype, B, V, top_p, mode):
    """Nucleus sampling inside the kernel: the chosen token, and entropy/logprob of the nucleus-restricted
    distribution (a chosen token outside the nucleus has logprob -inf)."""
    g, seed = _gen()
    logits = _top_p_logits(B, V, top_p, g, dtype)
    nonstop = torch.rand(V, generator=g) < 0.5
    keys = torch.randint(0, 2**32, (B,), generator=g)
    chosen = torch.randint(0, V, (B,), generator=g) if mode == "chosen" else None
    if chosen is not None:
        chosen[0] = logits[0].float().argmax()  # one in the nucleus for sure, the others mostly outside
    ref = decode_signals_ref(logits, 0.8, keys, chosen, nonstop, top_p=top_p)
    res = get_backend(backend).decode_signals(
        logits.to(device), temperature=0.8, rng_keys=keys.to(device),
        chosen=None if chosen is None else chosen.to(device), nonstop=nonstop.to(device),
        out=_poisoned(B, device, ref["nonstop"]), top_p=top_p)
    _check_decode(res, ref, dtype, f"{backend} top_p={top_p} {mode}", seed, sampled=mode == "sample")
    if mode == "sample":
        assert torch.isfinite(ref["logprob"]).all() and torch.isfinite(res.logprob.cpu()).all(), \
            f"a sampled token outside the nucleus (seed={seed})"


@pytest.mark.parametrize("backend,device", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,V", [(1, 7), (3, 4231), (2, 16411)])
@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (3, 1.0), (50, 1.0), (50, 0.9), (7, 0.3), (10**6, 0.9)])
@pytest.mark.parametrize("mode", ["sample", "chosen"])
def test_decode_signals_top_k_vs_reference(backend, device, dtype, B, V, top_k, top_p, mode):
    """Top-k before top-p (transformers' order): the chosen token, and entropy/logprob of the distribution left
    after both filters (a chosen token outside it has logprob -inf); k >= V filters nothing."""
    g, seed = _gen()
    logits = _top_p_logits(B, V, top_p, g, dtype, top_k)
    nonstop = torch.rand(V, generator=g) < 0.5
    keys = torch.randint(0, 2**32, (B,), generator=g)
    chosen = torch.randint(0, V, (B,), generator=g) if mode == "chosen" else None
    if chosen is not None:
        chosen[0] = logits[0].float().argmax()  # one kept for sure, the others mostly filtered out
    ref = decode_signals_ref(logits, 0.8, keys, chosen, nonstop, top_p=top_p, top_k=top_k)
    res = get_backend(backend).decode_signals(
        logits.to(device), temperature=0.8, rng_keys=keys.to(device),
        chosen=None if chosen is None else chosen.to(device), nonstop=nonstop.to(device),
        out=_poisoned(B, device, ref["nonstop"]), top_p=top_p, top_k=top_k)
    _check_decode(res, ref, dtype, f"{backend} top_k={top_k} top_p={top_p} {mode}", seed, sampled=mode == "sample")
    if mode == "sample":
        kth = logits.float().topk(min(top_k, V), dim=-1).values[:, -1]
        picked = logits.float().gather(1, res.chosen.cpu()[:, None])[:, 0]
        assert (picked >= kth).all(), f"a token outside the top {top_k} was sampled (seed={seed})"
    if top_k == 1:  # one token left, or the tie group of the maximum (bf16/fp16 rows tie often): ln(#ties)
        ties = (logits == logits.max(dim=-1, keepdim=True).values).sum(-1).double()
        _close(res.entropy, ties.log(), "top-k 1 entropy", seed, atol=1e-5, rtol=1e-5)


def test_decode_signals_ref_top_k_top_p_is_transformers_sampling_distribution():
    """The reference's warped distribution (temperature, then top-k, then top-p) is the one transformers'
    sampling warpers give, which the published DRAGIN runs sampled from and took entropies of (random rows away
    from a top-p boundary; transformers is the independent side)."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g, seed = _gen()
    for t, k, p in ((0.6, 50, 0.9), (1.0, 5, 1.0), (0.7, 0, 0.8), (1.3, 200, 0.95)):
        x = _top_p_logits(6, 3001, p, g, torch.float32, k).double()
        warp = LogitsProcessorList([TemperatureLogitsWarper(t), *([TopKLogitsWarper(k)] if k else []),
                                    *([TopPLogitsWarper(p)] if p < 1 else [])])
        y = warp(torch.zeros(6, 1, dtype=torch.long), x.clone())
        logp = torch.log_softmax(y, dim=-1)
        ent = -torch.where(logp > float("-inf"), logp.exp() * logp, torch.zeros_like(logp)).sum(-1)
        ref = decode_signals_ref(x, t, torch.arange(6), top_p=p, top_k=k)
        _close(ref["entropy"], ent, f"entropy T={t} k={k} p={p}", seed, atol=1e-9, rtol=1e-9)
        kept = torch.isfinite(y)
        assert torch.equal(torch.isfinite(ref["score"]), kept), f"kept tokens T={t} k={k} p={p} (seed={seed})"


@pytest.mark.parametrize("backend,device", KERNEL_BACKENDS)
def test_decode_signals_top_p_ties_and_masks(backend, device):
    """A tie group straddling the nucleus boundary is kept whole; -inf tokens never enter it; a tiny top_p leaves
    the argmax alone (entropy 0); top_p = 1 is the plain sampler."""
    g, seed = _gen()
    V = 4099
    logits = torch.full((4, V), -30.0)
    logits[0, [5, 900, 4000]] = 2.0  # three equal tokens of mass ~1/3 each: top_p 0.5 must keep all three
    logits[1] = torch.randn(V, generator=g) * 3
    logits[1, ::2] = NEG_INF
    logits[2] = torch.randn(V, generator=g)
    logits[3] = torch.randn(V, generator=g) * 5
    keys = torch.randint(0, 2**32, (4,), generator=g)
    be = get_backend(backend)
    ref = decode_signals_ref(logits, 1.0, keys, top_p=0.5)
    res = be.decode_signals(logits.to(device), temperature=1.0, rng_keys=keys.to(device), top_p=0.5,
                            out=_poisoned(4, device))
    assert int(res.chosen[0]) in (5, 900, 4000)
    assert abs(float(res.entropy[0]) - float(ref["entropy"][0])) < 1e-4
    assert abs(float(ref["entropy"][0]) - torch.log(torch.tensor(3.0)).item()) < 1e-3, "the tie group was split"
    _check_decode(res, ref, torch.float32, f"{backend} ties/masks", seed, sampled=True)
    assert bool(torch.isfinite(logits[1, res.chosen[1].cpu()])), "a masked token was sampled"
    tiny = be.decode_signals(logits.to(device), temperature=1.0, rng_keys=keys.to(device), top_p=1e-9)
    assert tiny.chosen.cpu().tolist()[1:] == logits[1:].argmax(-1).tolist()
    assert tiny.entropy.cpu()[1:].abs().max().item() < 1e-6 and tiny.logprob.cpu()[1:].abs().max().item() < 1e-6
    full = be.decode_signals(logits.to(device), temperature=1.0, rng_keys=keys.to(device), top_p=1.0)
    plain = be.decode_signals(logits.to(device), temperature=1.0, rng_keys=keys.to(device))
    assert torch.equal(full.chosen, plain.chosen) and torch.equal(full.entropy, plain.entropy)


@pytest.mark.parametrize("backend,device", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_signals_top_p_signed_zeros_tie(backend, device, dtype):
    """+0.0 and -0.0 are one value, so one tie group of the nucleus (the radix select keys floats by their bits:
    -0.0 must take +0.0's key). Such rows are common: fp16 logits of |x| < 3e-8 round to a signed zero. Mass above
    the value 0 is 0.576 < top_p = 0.6, so both zeros are in the nucleus; the row is 0.025 from the boundary."""
    seed = 0
    logits = torch.tensor([[1.0, 0.0, -0.0, -5.0], [1.0, -0.0, 0.0, -5.0]]).to(dtype)
    assert logits.view(torch.int16 if dtype != torch.float32 else torch.int32)[0, 2] != 0, "no -0.0 in the row"
    keys = torch.tensor([123, 7])
    for chosen in (torch.tensor([2, 1]), torch.tensor([1, 2])):
        ref = decode_signals_ref(logits, 1.0, keys, chosen, top_p=0.6)
        assert bool(torch.isfinite(ref["logprob"]).all())
        res = get_backend(backend).decode_signals(logits.to(device), temperature=1.0, rng_keys=keys.to(device),
                                                  chosen=chosen.to(device), top_p=0.6, out=_poisoned(2, device))
        _check_decode(res, ref, dtype, f"{backend} signed zeros", seed, sampled=False)


@pytest.mark.parametrize("backend,device", KERNEL_BACKENDS)
@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.7), dict(temperature=0.7, top_p=0.9), dict(chosen=True),
                                dict(temperature=0.7, top_k=40)],
                         ids=["greedy", "sample", "top_p", "chosen", "top_k"])
def test_decode_signals_rows_with_nan_have_no_distribution(backend, device, kw):
    """A row holding a NaN logit (one, the last, all, one in a 512-wide span that is otherwise -inf) or a +inf one
    gives a NaN entropy and a non-finite logprob, as the reference does (the engine ends such a generation with an
    error: nothing is drawn from it), and a chosen index inside the vocabulary; the other rows are unaffected. The
    -inf span is what a top-k mask leaves around a NaN (torch's topk ranks NaN first): the C++ path reads the row
    in 512-wide chunks and once took such a chunk for fully masked; the CUDA kernel's online state once forgot a
    NaN at the next larger logit, and a warp lane holding only -inf and a NaN."""
    g, seed = _gen()
    B, V = 7, 1100
    x = torch.randn(B, V, generator=g)
    x[0, 5] = float("nan")
    x[1] = float("nan")
    x[2, V - 1] = float("nan")
    x[3, 512:1024] = NEG_INF
    x[3, 600] = float("nan")
    x[4, 300] = float("inf")
    x[5, 512:1024] = NEG_INF
    x[5, 700] = float("inf")
    keys = torch.randint(0, 2**32, (B,), generator=g)
    chosen = torch.randint(0, V, (B,), generator=g) if kw.get("chosen") else None
    t, top_p, top_k = kw.get("temperature", 0.0), kw.get("top_p", 1.0), kw.get("top_k", 0)
    ref = decode_signals_ref(x, t, keys if t > 0 else None, chosen, top_p=top_p, top_k=top_k)
    assert torch.isnan(ref["entropy"][:6]).all() and not torch.isfinite(ref["logprob"][:6]).any()
    res = get_backend(backend).decode_signals(
        x.to(device), temperature=t, rng_keys=keys.to(device) if t > 0 else None,
        chosen=None if chosen is None else chosen.to(device), top_p=top_p, top_k=top_k, out=_poisoned(B, device))
    ent, lp, c = res.entropy.cpu(), res.logprob.cpu(), res.chosen.cpu()
    assert torch.isnan(ent[:6]).all(), f"{backend}: entropy {ent.tolist()} (seed={seed})"
    assert not torch.isfinite(lp[:6]).any(), f"{backend}: logprob {lp.tolist()} (seed={seed})"
    assert ((c >= 0) & (c < V)).all(), f"{backend}: chosen {c.tolist()}"
    _close(ent[6:], ref["entropy"][6:], f"{backend} clean row entropy", seed, **TOKEN_TOL)
    _close(lp[6:], ref["logprob"][6:], f"{backend} clean row logprob", seed, **TOKEN_TOL)


@pytest.mark.parametrize("backend,device", KERNEL_BACKENDS)
@pytest.mark.parametrize("top_p", [1.0, 0.5])
def test_decode_signals_at_the_smallest_temperature(backend, device, top_p):
    """At MIN_TEMPERATURE the scaled logits stay finite in float32, but their spread can exceed float32's range
    (y - m = -inf for the smallest): such entries weigh exactly 0, never (-inf) * 0 = NaN. V = 5000 spans several
    chunks of every kernel, so the running state's rescaling meets the same spread."""
    from fastrag.signals.checks import MIN_TEMPERATURE

    g, seed = _gen()
    V = 5000
    x = torch.randn(2, V, generator=g) * 1e7
    x[0, 4500] = 2e8  # the max, in a late chunk: earlier chunks' states are rescaled by e^{-inf} = 0
    x[0, 10] = -2e8
    x[1, 3] = 2e8
    x[1, 4999] = -2e8
    keys = torch.randint(0, 2**32, (2,), generator=g)
    ref = decode_signals_ref(x, MIN_TEMPERATURE, keys, top_p=top_p)
    res = get_backend(backend).decode_signals(x.to(device), temperature=MIN_TEMPERATURE, rng_keys=keys.to(device),
                                              top_p=top_p, out=_poisoned(2, device))
    assert res.chosen.cpu().tolist() == ref["chosen"].tolist() == [4500, 3]
    _close(res.entropy, ref["entropy"], f"{backend} entropy", seed, atol=1e-6, rtol=0)
    _close(res.logprob, ref["logprob"], f"{backend} logprob", seed, atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend,device", KERNEL_BACKENDS)
def test_decode_signals_out_without_a_flag_buffer(backend, device):
    """With no nonstop table, out= may be the four buffers alone; any other length is an error naming `out`."""
    x = torch.randn(3, 40).to(device)
    res = get_backend(backend).decode_signals(x, out=_poisoned(3, device)[:4])
    assert res.nonstop is None and res.chosen.cpu().tolist() == x.cpu().argmax(-1).tolist()
    with pytest.raises(ValueError, match=r"out must be a tuple \(chosen, entropy, logprob, prob, nonstop\), got 3"):
        get_backend(backend).decode_signals(x, out=_poisoned(3, device)[:3])


def test_top_p_nucleus_reference_matches_transformers_warper():
    """The reference's nucleus is the set HF's TopPLogitsWarper keeps (tie-free random rows), and Gumbel-max
    draws over it follow the renormalised nucleus distribution."""
    from transformers.generation.logits_process import TopPLogitsWarper

    from fastrag.signals.reference import top_p_nucleus_ref

    g, seed = _gen()
    y = torch.randn(6, 500, generator=g, dtype=torch.float64) * 2
    for top_p in (0.1, 0.5, 0.9, 0.99):
        keep, _ = top_p_nucleus_ref(y, top_p)
        hf = TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1)(None, y.float())
        assert torch.equal(keep, torch.isfinite(hf)), f"top_p={top_p} (seed={seed})"
    # frequencies of the in-kernel draw over 4000 keys vs the nucleus distribution (torch backend, V = 6)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]]).expand(4000, 6).contiguous()
    keys = torch.randint(0, 2**32, (4000,), generator=g)
    res = get_backend("torch").decode_signals(logits, temperature=1.0, rng_keys=keys, top_p=0.8)
    keep, _ = top_p_nucleus_ref(logits[:1].double(), 0.8)
    p = torch.softmax(logits[0].double().masked_fill(~keep[0], float("-inf")), -1)
    freq = torch.bincount(res.chosen, minlength=6).double() / 4000
    assert (freq[~keep[0]] == 0).all(), f"drawn outside the nucleus: {freq.tolist()}"
    assert (freq - p).abs().max() < 0.035, f"frequencies {freq.tolist()} vs nucleus probabilities {p.tolist()}"


def test_top_p_nucleus_reference_at_an_exact_boundary():
    """softmax([ln 2, 0, 0, -inf]) is exactly (1/2, 1/4, 1/4, 0). With top_p = 1/2 the first token's mass reaches
    top_p: the nucleus is that token alone (the two 1/4 tokens have exactly top_p above them) and the row sits on
    the boundary (margin 0), as HF's warper decides; with top_p = 3/4 the tied pair is kept whole; -inf never."""
    from transformers.generation.logits_process import TopPLogitsWarper

    from fastrag.signals.reference import top_p_nucleus_ref

    y = torch.tensor([[math.log(2.0), 0.0, 0.0, float("-inf")]], dtype=torch.float64)
    assert torch.softmax(y, -1).tolist() == [[0.5, 0.25, 0.25, 0.0]]
    keep, margin = top_p_nucleus_ref(y, 0.5)
    assert keep.tolist() == [[True, False, False, False]] and margin.tolist() == [0.0]
    assert torch.equal(keep, torch.isfinite(TopPLogitsWarper(top_p=0.5)(None, y.clone())))
    keep, margin = top_p_nucleus_ref(y, 0.75)
    assert keep.tolist() == [[True, True, True, False]] and margin.tolist() == [0.25]


def test_triton_split_rows_merge():
    """The split-V path (several slices per row merged by the second kernel) on the CPU interpreter too."""
    be = get_backend("triton") if "triton" in _available() else pytest.skip("triton unavailable")
    from fastrag.kernels import token_signals as ts

    g, seed = _gen()
    dev = next(iter(be.devices))
    logits = torch.randn(3, 3001, generator=g) * 5
    logits[1, :2500] = NEG_INF  # whole slices masked
    keys = torch.randint(0, 2**32, (3,), generator=g)
    for temperature in (0.0, 1.1):
        ref = decode_signals_ref(logits, temperature, keys)
        out = _poisoned(3, dev)
        ts.token_signals(logits.to(dev), temperature, keys.to(dev), None, None, out, num_splits=5, block_v=256)
        from fastrag.signals import DecodeSignals

        _check_decode(DecodeSignals(*out), ref, torch.float32, "triton split", seed, sampled=temperature > 0)


def _available():
    out = []
    for name in ("triton", "cpp", "cuda"):
        try:
            get_backend(name)
            out.append(name)
        except BackendUnavailableError:
            pass
    return out


# ---------------------------------------------------------------- decode attention statistics


def _paged_problem(g, B, H, Hkv, D, bs, NB, S, dtype, strided: bool):
    """Random paged keys with shuffled block tables, random lengths and spans, lse of the true attention."""
    nb_pool = B * NB + 3
    if strided:  # [slots, Hkv, D] storage viewed as [Hkv, slots, D]: non-contiguous k_cache
        k_cache = torch.randn(nb_pool * bs, Hkv, D, generator=g).to(dtype).transpose(0, 1)
        q = torch.randn(B, H, 2 * D, generator=g).to(dtype)[..., :D]
    else:
        k_cache = torch.randn(Hkv, nb_pool * bs, D, generator=g).to(dtype)
        q = torch.randn(B, H, D, generator=g).to(dtype)
    block_tables = torch.randperm(nb_pool, generator=g)[: B * NB].reshape(B, NB)
    L = NB * bs
    ctx_lens = torch.randint(1, L + 1, (B,), generator=g)
    ctx_lens[0] = L
    span_start = torch.stack([torch.randint(0, int(n) + 1, (1,), generator=g)[0] for n in ctx_lens])
    scale = D**-0.5
    lse = decode_lse_ref(q, k_cache, block_tables, ctx_lens, bs, scale).float()
    amax = torch.rand(B, H, S, generator=g) * 0.3
    return q, k_cache, block_tables, ctx_lens, span_start, lse, scale, amax


# (B, H, Hkv, D, block_size, NB, S): odd sizes, GQA groups 1 and 3, a span that outlives the context
DECODE_ATTN_SHAPES = [(1, 4, 4, 16, 16, 3, 37), (3, 9, 3, 40, 5, 7, 33), (5, 6, 2, 64, 8, 4, 1)]


@pytest.mark.parametrize("backend,device", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,H,Hkv,D,bs,NB,S", DECODE_ATTN_SHAPES)
def test_attn_decode_update_vs_reference(backend, device, dtype, B, H, Hkv, D, bs, NB, S):
    g, seed = _gen()
    q, k_cache, bt, n, s0, lse, scale, amax = _paged_problem(g, B, H, Hkv, D, bs, NB, S, dtype, strided=S == 33)
    ref_amax, ref_row = attn_decode_update_ref(q, k_cache, bt, n, s0, lse, bs, scale, amax, want_row=True)
    d = device
    amax_d = amax.to(d)
    row = torch.full((B, NB * bs), float("nan"), device=d)
    got_amax, got_row = get_backend(backend).attn_decode_update(
        q.to(d), k_cache.to(d), bt.to(d), n.to(d), s0.to(d), lse.to(d), bs, scale, amax_d, row_out=row)
    assert got_amax.data_ptr() == amax_d.data_ptr() and got_row.data_ptr() == row.data_ptr()
    _close(got_amax, ref_amax, f"{backend} amax", seed, atol=2e-6, rtol=1e-5)
    _close(got_row, ref_row, f"{backend} qfs row", seed, atol=2e-6, rtol=1e-5)
    # a valid row of the QFS matrix is a distribution (lse is the true one)
    assert abs(float(got_row[0].sum()) - 1.0) < 1e-4
    # without a row: amax only, and int32 block tables are accepted
    amax2 = amax.to(d)
    _, none_row = get_backend(backend).attn_decode_update(q.to(d), k_cache.to(d), bt.int().to(d), n.to(d), s0.to(d),
                                                          lse.to(d), bs, scale, amax2)
    assert none_row is None
    _close(amax2, ref_amax, f"{backend} amax (int32 tables)", seed, atol=2e-6, rtol=1e-5)


# ---------------------------------------------------------------- prefill (causal block) statistics

# (B, H, Hkv, D, T): odd T and D, GQA
PREFILL_SHAPES = [(1, 4, 4, 16, 1), (3, 6, 2, 40, 37), (2, 9, 3, 24, 19)]


@pytest.mark.parametrize("backend,device", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,H,Hkv,D,T", PREFILL_SHAPES)
def test_causal_attn_stats_vs_reference(backend, device, dtype, B, H, Hkv, D, T):
    g, seed = _gen()
    be = get_backend(backend)
    # the model's layout [B, T, H, D] viewed as [B, H, T, D]: non-contiguous q and k
    q = torch.randn(B, T, H, D, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(B, T, Hkv, D, generator=g).to(dtype).transpose(1, 2)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T
    scale = D**-0.5
    gpu_dot = device == "cuda" and backend == "triton" and dtype != torch.float32
    tol = dict(atol=2e-6, rtol=1e-4 if gpu_dot else 1e-5)
    d = device
    cm = torch.full((B, T), float("nan"), device=d)
    be.causal_attn_colmax(q.to(d), k.to(d), lengths.to(d), scale, out=cm)
    _close(cm, causal_attn_colmax_ref(q, k, lengths, scale), f"{backend} colmax", seed, **tol)
    mr = torch.full((B, T, T), float("nan"), device=d)
    be.causal_attn_mean_rows(q.to(d), k.to(d), lengths.to(d), scale, out=mr)
    _close(mr, causal_attn_mean_rows_ref(q, k, lengths, scale), f"{backend} mean_rows", seed, **tol)
    rows = torch.randint(-1, T + 2, (B, 5), generator=g)  # includes rows outside [0, n): zero rows
    rows[0, 0] = T - 1
    ro = torch.full((B, 5, T), float("nan"), device=d)
    be.causal_attn_rows(q.to(d), k.to(d), lengths.to(d), scale, rows.to(d), out=ro)
    _close(ro, causal_attn_rows_ref(q, k, lengths, scale, rows), f"{backend} rows", seed, **tol)


@pytest.mark.parametrize("backend,device", KERNEL_BACKENDS)
@pytest.mark.parametrize("fixed_seed", [None, 32126980], ids=["fresh", "near_tie"])
@pytest.mark.parametrize("D", [64, 128])
def test_causal_attn_rows_large_scores_stay_normalised(backend, device, fixed_seed, D):
    """Scores of size ~64 and ~1e4 (fp32 inputs): each selected row is a distribution (sums to 1, no p > 1) and
    matches the reference to float32 rounding: the probabilities must be normalised by the scores they are made
    of (Triton once divided by the log-sum-exp of differently rounded scores: rows summed to 1.2 at q, k ~ 1e3).
    Fresh inputs, and the inputs of seed 32126980, where a head's row at q, k ~ 1e3 holds a second key 10 below its
    largest score: Triton normalised by m + log(l) in float32, which drops log(l) = 4.5e-5 next to m ~ 1e6, and the
    row summed to 1 + 4.5e-5 (CI, 2026-11-27). The CUDA prefill kernels had the same m + log(l) and keep the two
    apart since 2026-11-28 (first run here on a GPU: see benchmarks/gpu/NOTES.md). Head dims 64 and 128: at 128 the
    scale 128 ** -0.5 is not a power of two, so a product by it is rounded, and a GPU compiler that fuses the product
    into the subtraction after it normalises by other scores than it divides (a float32 emulation: rows off by 0.13
    at |s| ~ 1e6; tests/test_triton_sm90.py and tests/test_kernels_build.py check the compiled code for it, this
    test checks the result on a GPU)."""
    g, seed = _gen()
    if fixed_seed is not None:
        g, seed = torch.Generator().manual_seed(fixed_seed), fixed_seed
    be = get_backend(backend)
    for mag, tol in ((8.0, 1e-5), (1e3, None)):
        B, H, Hkv, T = 2, 4, 2, 40
        q = torch.randn(B, H, T, D, generator=g) * mag
        k = torch.randn(B, Hkv, T, D, generator=g) * mag
        n = torch.tensor([T, 23])
        out = torch.full((B, T, T), float("nan"), device=device)
        be.causal_attn_mean_rows(q.to(device), k.to(device), n.to(device), D**-0.5, out=out)
        out = out.cpu().double()
        ref = causal_attn_mean_rows_ref(q, k, n, D**-0.5)
        assert not torch.isnan(out).any()
        sums = out.sum(-1)
        for b in range(B):
            assert (sums[b, : n[b]] - 1).abs().max() < 1e-5, f"{backend} mag {mag}: row sums {sums[b, :n[b]]} (seed={seed})"
        assert out.max() <= 1 + 1e-6, f"{backend} mag {mag}: p = {out.max().item()} (seed={seed})"
        if tol is not None:
            _close(out, ref, f"{backend} rows at |s|~{mag * mag:g}", seed, atol=tol, rtol=0)


@pytest.mark.parametrize("backend,device", KERNEL_BACKENDS)
@pytest.mark.parametrize("B,T,R", [(2, 0, 3), (0, 5, 3), (2, 4, 0)])
def test_causal_attn_stats_empty_shapes(backend, device, B, T, R):
    """Empty batches, sequences and row lists (shapes validation accepts) give empty results, as the reference."""
    be, d = get_backend(backend), device
    q, k = torch.zeros(B, 2, T, 4, device=d), torch.zeros(B, 1, T, 4, device=d)
    n, rows = torch.zeros(B, dtype=torch.int64, device=d), torch.zeros(B, R, dtype=torch.int64, device=d)
    assert tuple(be.causal_attn_colmax(q, k, n, 0.5).shape) == tuple(causal_attn_colmax_ref(q, k, n, 0.5).shape)
    assert tuple(be.causal_attn_mean_rows(q, k, n, 0.5).shape) == (B, T, T)
    out = torch.full((B, R, T), float("nan"), device=d)
    be.causal_attn_rows(q, k, n, 0.5, rows, out=out)
    ref = causal_attn_rows_ref(q.cpu(), k.cpu(), n.cpu(), 0.5, rows.cpu())
    assert tuple(ref.shape) == (B, R, T) and torch.equal(out.cpu(), ref.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_causal_rows_per_program_change_no_value(dtype):
    """The prefill statistics' rows kernels give the same bits at 1, 4, 16 and 64 selected rows a program (1 is the
    GPU's launch, more the interpreter's), on 3 x 7 rows (the last program of each tiled launch is part empty)
    that include rows past a sequence's length and outside [0, T), keys past 64 (two key tiles, rows of one and of
    two tiles in one program) and a GQA group: the output is NaN-poisoned and every element is written."""
    from fastrag.kernels import attn_stats

    g, seed = _gen()
    dev = "cuda" if CUDA else "cpu"
    B, H, Hkv, D, T, R = 3, 6, 2, 24, 90, 7
    q = torch.randn(B, H, T, D, generator=g).to(dtype).to(dev)
    k = torch.randn(B, Hkv, T, D, generator=g).to(dtype).to(dev)
    lengths = torch.tensor([T, 70, 13], device=dev)
    rows = torch.randint(-2, T + 3, (B, R), generator=g)
    rows[0, :3] = torch.tensor([T - 1, 0, 63])  # the last row, the first, the last of the first key tile
    rows[1, 0], rows[2, 0] = 80, 12  # past its sequence's length: zeros; the last row of a short sequence
    rows = rows.to(dev)
    runs = {}
    for per in (1, 4, 16, 64):
        out = torch.full((B, R, T), float("nan"), device=dev)
        attn_stats.causal_attn_stats(q, k, lengths, D ** -0.5, rows=rows, rows_out=out, rows_per_prog=per)
        assert not out.isnan().any(), f"rows a program {per}: elements left unwritten (seed={seed})"
        runs[per] = out
    for per in (4, 16, 64):
        torch.testing.assert_close(runs[per], runs[1], rtol=0, atol=0,
                                   msg=lambda m: f"{per} rows a program against 1: {m} (seed={seed})")
    _close(runs[1], causal_attn_rows_ref(q.cpu(), k.cpu(), lengths.cpu(), D ** -0.5, rows.cpu()), "triton rows",
           seed, atol=2e-6, rtol=1e-4 if CUDA and dtype != torch.float32 else 1e-5)
    with pytest.raises(ValueError, match="rows_per_prog: expected a power of two"):
        attn_stats.causal_attn_stats(q, k, lengths, D ** -0.5, rows=rows, rows_out=runs[1], rows_per_prog=3)


# ---------------------------------------------------------------- bad input: clear errors from the launchers


def _decode_args():
    return dict(logits=torch.zeros(2, 11), temperature=0.0, rng_keys=None, chosen=None, nonstop=None)


DECODE_BAD = [
    ("logits", dict(logits=torch.zeros(2, 11, dtype=torch.int32))),
    ("logits", dict(logits=torch.zeros(11))),
    ("logits", dict(logits=torch.zeros(2, 11, device="meta"))),
    ("temperature", dict(temperature=-0.5)),
    ("temperature", dict(temperature=float("inf"), rng_keys=torch.zeros(2, dtype=torch.int64))),
    ("temperature", dict(temperature=1e-38, rng_keys=torch.zeros(2, dtype=torch.int64))),
    ("rng_keys", dict(temperature=0.5)),
    ("rng_keys", dict(temperature=0.5, rng_keys=torch.zeros(3, dtype=torch.int64))),
    ("rng_keys", dict(temperature=0.5, rng_keys=torch.zeros(2, dtype=torch.int32))),
    ("chosen", dict(chosen=torch.tensor([0, 11]))),
    ("nonstop", dict(nonstop=torch.zeros(10, dtype=torch.bool))),
    ("nonstop", dict(nonstop=torch.zeros(11, dtype=torch.uint8))),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_p", dict(top_p=float("nan"), temperature=0.5, rng_keys=torch.zeros(2, dtype=torch.int64))),
]


@pytest.mark.parametrize("backend,device", KERNEL_BACKENDS)
@pytest.mark.parametrize("name,bad", DECODE_BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(DECODE_BAD)])
def test_decode_signals_rejects(backend, device, name, bad):
    if device != "cpu" and name == "chosen":
        pytest.skip("value checks read tensor contents: CPU only (GPU kernels clamp chosen into the vocabulary)")
    kw = _decode_args() | bad
    kw = {k: (_to_keeping_strides(v, device) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v)
          for k, v in kw.items()}
    logits = kw.pop("logits")
    with pytest.raises(ValueError, match=name):
        get_backend(backend).decode_signals(logits, **kw)


def _attn_args():
    B, H, Hkv, D, bs, NB = 2, 4, 2, 8, 4, 3
    return dict(q=torch.zeros(B, H, D), k_cache=torch.zeros(Hkv, 10 * bs, D), block_tables=torch.zeros(B, NB,
                dtype=torch.int64), ctx_lens=torch.tensor([12, 5]), span_start=torch.tensor([2, 0]),
                lse=torch.zeros(B, H), block_size=bs, scale=0.3, amax=torch.zeros(B, H, 7))


ATTN_BAD = [
    ("q", dict(q=torch.zeros(2, 4, 8, dtype=torch.int32))),
    ("k_cache", dict(k_cache=torch.zeros(2, 40, 8, dtype=torch.float16))),
    ("head dim", dict(k_cache=torch.zeros(2, 40, 6))),
    ("multiple of k_cache heads", dict(k_cache=torch.zeros(3, 40, 8))),
    ("block_size", dict(block_size=7)),
    ("lse", dict(lse=torch.zeros(2, 3))),
    ("longer than the cache", dict(amax=torch.zeros(2, 4, 13))),
    ("ctx_lens", dict(ctx_lens=torch.tensor([13, 5]))),
    ("span_start", dict(span_start=torch.tensor([-1, 0]))),
    ("block_tables", dict(block_tables=torch.full((2, 3), 10, dtype=torch.int64))),
    ("amax", dict(amax=torch.zeros(2, 7, 4).transpose(1, 2))),
    ("row_out", dict(row_out=torch.zeros(2, 11))),
    ("head dim must be contiguous", dict(k_cache=torch.zeros(2, 40, 16)[..., ::2])),
]


@pytest.mark.parametrize("backend,device", KERNEL_BACKENDS)
@pytest.mark.parametrize("name,bad", ATTN_BAD, ids=[f"{n.split()[0]}-{i}" for i, (n, _) in enumerate(ATTN_BAD)])
def test_attn_decode_rejects(backend, device, name, bad):
    if device != "cpu" and name in ("ctx_lens", "span_start", "block_tables"):
        pytest.skip("value checks read tensor contents: CPU only (GPU kernels mask out-of-range positions)")
    kw = _attn_args() | bad
    kw = {k: (_to_keeping_strides(v, device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    with pytest.raises(ValueError, match=name):
        get_backend(backend).attn_decode_update(**kw)


def test_cpp_glue_rejects_span_longer_than_cache():
    """The C++ entry point checks too (direct callers of fastrag._C get a RuntimeError, not a crash)."""
    _C = pytest.importorskip("fastrag._C")
    kw = _attn_args()
    with pytest.raises(RuntimeError, match="longer than the cache"):
        _C.attn_decode_update(kw["q"], kw["k_cache"], kw["block_tables"], kw["ctx_lens"], kw["span_start"],
                              kw["lse"], kw["block_size"], kw["scale"], torch.zeros(2, 4, 13))
    with pytest.raises(RuntimeError, match="ctx_lens\\[0\\] = 13"):
        _C.attn_decode_update(kw["q"], kw["k_cache"], kw["block_tables"], torch.tensor([13, 5]), kw["span_start"],
                              kw["lse"], kw["block_size"], kw["scale"], kw["amax"])
    o = [torch.zeros(2, dtype=torch.int64), torch.zeros(2), torch.zeros(2), torch.zeros(2)]
    with pytest.raises(RuntimeError, match="rng_keys"):
        _C.decode_signals(torch.zeros(2, 11), 0.5, None, None, None, *o, None)
    with pytest.raises(RuntimeError, match="out_flag"):
        _C.decode_signals(torch.zeros(2, 11), 0.0, None, None, torch.zeros(11, dtype=torch.bool), *o, None)
    with pytest.raises(RuntimeError, match="top_p"):
        _C.decode_signals(torch.zeros(2, 11), 0.5, torch.zeros(2, dtype=torch.int64), None, None, *o, None, top_p=0.0)


def test_auto_backend_prefers_kernels_on_cuda_and_torch_elsewhere():
    be = get_backend("auto")
    assert "other=torch" in be.name
    if CUDA:
        assert "cuda=cuda" in be.name or "cuda=triton" in be.name, be.name
    # dispatch follows the input's device: a CPU call works on any machine
    res = be.decode_signals(torch.randn(2, 50))
    assert res.chosen.device.type == "cpu"


# A device function (fastrag.kernels.device_function) and a kernel that calls it REPS times: acc <- 2 acc + 1.
REPS = 5


@device_function
def _twice_plus(x, y):
    z = x * 2.0  # an assignment: the interpreter's rewrite of it applies here too
    return z + y


@triton.jit
def _device_function_kernel(x_ptr, out_ptr, N: tl.constexpr, N_CALLS: tl.constexpr):
    o = tl.arange(0, N)
    acc = tl.load(x_ptr + o)
    for _ in range(N_CALLS):
        acc = _twice_plus(acc, 1.0)
    tl.store(out_ptr + o, acc)


def test_device_function_calls_give_the_jit_result_without_repatching_the_language(monkeypatch):
    """Compiled, a device function is Triton's own jit function (inlined). Under the interpreter a call from a
    running kernel goes to the rewritten function directly: triton.language is patched once, at the launch, not
    again at each of the REPS calls (Triton's own jit call does, a few milliseconds each), and the values are the
    float32 arithmetic's, as torch computes it."""
    x = torch.randn(16, generator=torch.Generator().manual_seed(random.randrange(2**31)))
    want = x.clone()
    for _ in range(REPS):
        want = want * 2.0 + 1.0
    dev = "cuda" if CUDA else "cpu"
    out = torch.full((16,), float("nan"), device=dev)
    if not INTERPRETED:
        assert isinstance(_twice_plus, triton.runtime.JITFunction)
        _device_function_kernel[(1,)](x.to(dev), out, N=16, N_CALLS=REPS)
    else:
        import triton.runtime.interpreter as interp

        patched = []
        real = interp._patch_lang
        monkeypatch.setattr(interp, "_patch_lang", lambda fn: patched.append(fn.__name__) or real(fn))
        _device_function_kernel[(1,)](x, out, N=16, N_CALLS=REPS)
        assert patched == ["_device_function_kernel"], patched
    assert torch.equal(out.cpu(), want)
