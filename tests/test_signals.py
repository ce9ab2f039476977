"""Retrieval signals: the float64 reference first (against independent formulas and a real transformers
forward), then every backend against the reference on fresh random inputs, then validation and selection."""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any fastrag.kernels import

from backend_cases import backend_case, one_thread  # noqa: E402,F401 (one_thread: autouse)
from fastrag import signals  # noqa: E402
from fastrag.signals import BackendUnavailableError, TokenSignals, get_backend  # noqa: E402
from fastrag.signals.reference import (  # noqa: E402
    causal_attn_colmax_ref,
    causal_attn_mean_rows_ref,
    nonstop_table_ref,
    token_signals_ref,
)
from fastrag.signals.vocab import build_nonstop_table  # noqa: E402

NEG_INF = float("-inf")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Inputs are rounded to the tested dtype before the reference sees them, so the tolerance only covers the
# backends' float32 arithmetic (logsumexp over up to 49k entries, softmax over up to 37 keys).
TOKEN_TOL = dict(atol=2e-5, rtol=2e-5)
ATTN_TOL = dict(atol=2e-6, rtol=1e-5)


CUDA = torch.cuda.is_available()


# Triton on the GPU, or on the CPU under TRITON_INTERPRET=1; C++ on the CPU; CUDA on the GPU; torch on the CPU.
BACKENDS = [backend_case("torch", "cpu"), backend_case("cpp", "cpu"),
            backend_case("triton", "cuda" if CUDA else "cpu"), backend_case("cuda", "cuda")]


def _on(device: str, kwargs: dict) -> dict:
    """The tensors of `kwargs` (a call's arguments, tuples of tensors included) on `device`; meta tensors stay."""
    def move(v):
        if isinstance(v, torch.Tensor) and v.device.type != "meta":
            return v.to(device)
        if isinstance(v, tuple):
            return type(v)(*map(move, v)) if hasattr(v, "_fields") else tuple(map(move, v))
        return v
    return {k: move(v) for k, v in kwargs.items()}


def _gen() -> tuple[torch.Generator, int]:
    seed = random.randrange(2**31)
    return torch.Generator().manual_seed(seed), seed


def _assert_close(actual, expected, what: str, seed: int, **tol) -> None:
    actual = actual.detach().cpu().double()
    expected = expected.detach().cpu().double()
    assert not torch.isnan(actual).any(), f"{what}: NaN at {torch.isnan(actual).nonzero()[:5].tolist()} (seed={seed})"
    if not torch.allclose(actual, expected, **tol):
        err = (actual - expected).abs()
        idx = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
        pytest.fail(f"{what}: max |diff| {err.max().item():.3e} at {idx}: got {actual[idx].item()!r}, "
                    f"expected {expected[idx].item()!r} (seed={seed}, tol={tol})")


# ---------------------------------------------------------------- reference


def test_token_signals_ref_matches_hand_formula():
    rows = [[1.0, 2.0, 3.0, NEG_INF], [0.5, 0.5, -1.0, 4.0]]
    chosen = torch.tensor([0, 2])
    ent, lp, am = token_signals_ref(torch.tensor(rows), chosen, temperature=0.5)
    for b, row in enumerate(rows):
        z = [math.exp(v / 0.5) for v in row]
        p = [e / sum(z) for e in z]
        assert ent[b].item() == pytest.approx(-sum(pi * math.log(pi) for pi in p if pi > 0), rel=1e-12)
        assert lp[b].item() == pytest.approx(math.log(p[chosen[b]]), rel=1e-12)
    assert am.tolist() == [2, 3]


def test_token_signals_ref_single_finite_logit_and_ties():
    x = torch.full((2, 7), NEG_INF)
    x[0, 3] = 5.0
    x[1] = torch.tensor([1.0, 4.0, 2.0, 4.0, 4.0, 0.0, 0.0])
    ent, lp, am = token_signals_ref(x)
    assert ent[0].item() == 0.0 and lp[0].item() == 0.0 and am[0].item() == 3
    assert am[1].item() == 1  # ties -> lowest index
    assert lp[1].item() == pytest.approx(math.log(math.exp(4) / (3 * math.exp(4) + math.exp(1) + math.exp(2) + 2)))


def _explicit_causal_attention(q, k, lengths, scale):
    """[B, H, T, T] from one masked softmax over all heads at once (an independent formula: additive mask,
    repeated kv heads) with rows of padded queries zeroed."""
    B, H, T, _ = q.shape
    kk = k.double().repeat_interleave(H // k.shape[1], dim=1)
    s = q.double() @ kk.transpose(-1, -2) * scale
    j = torch.arange(T)[:, None]
    i = torch.arange(T)[None, :]
    out = torch.zeros(B, H, T, T, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        bias = torch.where((i <= j) & (i < n), 0.0, NEG_INF).double()
        a = torch.softmax(s[b] + bias, dim=-1)
        out[b, :, :n] = a[:, :n]
    return out


@pytest.mark.parametrize("H,Hkv", [(9, 3), (4, 4), (6, 2)])
def test_attention_refs_match_explicit_formula(H, Hkv):
    g, seed = _gen()
    B, T, D = 3, 11, 8
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, Hkv, T, D, generator=g)
    lengths = torch.tensor([T, 4, 1])
    A = _explicit_causal_attention(q, k, lengths, 0.3)
    _assert_close(causal_attn_colmax_ref(q, k, lengths, 0.3), A.amax(dim=2).mean(dim=1), "colmax_ref", seed,
                  atol=1e-12, rtol=1e-12)
    _assert_close(causal_attn_mean_rows_ref(q, k, lengths, 0.3), A.mean(dim=1), "mean_rows_ref", seed,
                  atol=1e-12, rtol=1e-12)
    # Every valid row of the head-mean matrix is a distribution.
    M = causal_attn_mean_rows_ref(q, k, lengths, 0.3)
    assert torch.allclose(M[1, :4].sum(-1), torch.ones(4, dtype=torch.float64))
    assert M[1, 4:].abs().sum() == 0


def _smollm2():
    try:
        from fastrag.model.loading import load_hf_model

        return load_hf_model("smollm2")
    except (FileNotFoundError, ImportError, OSError) as e:
        pytest.skip(f"embedded model not available: {e}")


def test_colmax_ref_matches_transformers_attentions(monkeypatch):
    """DRAGIN's a_t from `output_attentions` of a real eager forward equals the reference fed with the last
    layer's post-rotary q and k (captured by wrapping apply_rotary_pos_emb)."""
    model = _smollm2()
    module = __import__(type(model.model.layers[-1].self_attn).__module__, fromlist=["apply_rotary_pos_emb"])
    captured = []
    orig = module.apply_rotary_pos_emb

    def capture(q, k, *args, **kwargs):
        q, k = orig(q, k, *args, **kwargs)
        captured.append((q.detach(), k.detach()))
        return q, k

    monkeypatch.setattr(module, "apply_rotary_pos_emb", capture)
    ids = torch.tensor([[504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 7043, 314]])
    with torch.no_grad():
        att = model(ids, output_attentions=True).attentions[-1][0].double()  # [H, T, T]
    q, k = captured[-1]
    expected = att.amax(dim=1).mean(dim=0)[None]  # max over query rows j, mean over heads
    scale = model.model.layers[-1].self_attn.scaling
    lengths = torch.tensor([ids.shape[1]])
    _assert_close(causal_attn_colmax_ref(q, k, lengths, scale), expected, "colmax_ref vs transformers", 0,
                  atol=1e-5, rtol=1e-4)
    _assert_close(causal_attn_mean_rows_ref(q, k, lengths, scale), att.mean(dim=0)[None],
                  "mean_rows_ref vs transformers", 0, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- backends vs reference


def _poisoned_token_out(B: int, device: str = "cpu") -> TokenSignals:
    return TokenSignals(torch.full((B,), float("nan"), device=device), torch.full((B,), float("nan"), device=device),
                        torch.full((B,), -7, dtype=torch.int64, device=device))


# Odd shapes: every B in (1, 3, 9) and every V in (7, 41, 4231, 49152), without the full cross product.
TOKEN_SHAPES = [(1, 7), (9, 7), (3, 41), (1, 4231), (9, 4231), (3, 49152), (9, 49152)]


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,V", TOKEN_SHAPES)
def test_token_signals_vs_reference(backend, device, dtype, B, V):
    g, seed = _gen()
    be = get_backend(backend)
    logits = (torch.randn(B, V, generator=g) * 4).to(dtype)
    chosen = torch.randint(0, V, (B,), generator=g)
    temperature = 0.6 if B == 3 else 1.0
    ent_r, lp_r, am_r = token_signals_ref(logits, chosen, temperature)
    out = _poisoned_token_out(B, device)
    res = be.token_signals(logits.to(device), chosen.to(device), temperature, out=out)
    assert res.entropy.data_ptr() == out.entropy.data_ptr(), "out= buffer was not written in place"
    _assert_close(res.entropy, ent_r, f"{backend} entropy", seed, **TOKEN_TOL)
    _assert_close(res.logprob, lp_r, f"{backend} logprob", seed, **TOKEN_TOL)
    assert torch.equal(res.argmax.cpu(), am_r), f"{backend} argmax {res.argmax} != {am_r} (seed={seed})"
    # Without `chosen` the logprob is that of the argmax.
    ent2, lp2, am2 = be.token_signals(logits.to(device), temperature=temperature)
    _, lp2_r, _ = token_signals_ref(logits, None, temperature)
    assert ent2.dtype == torch.float32 and lp2.dtype == torch.float32 and am2.dtype == torch.int64
    _assert_close(lp2, lp2_r, f"{backend} logprob(argmax)", seed, **TOKEN_TOL)
    assert torch.equal(am2.cpu(), am_r), f"{backend} argmax without chosen {am2} != {am_r} (seed={seed})"


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_token_signals_masked_rows(backend, device, dtype):
    g, seed = _gen()
    V = 4231
    logits = (torch.randn(4, V, generator=g) * 3).to(dtype)
    logits[0, ::2] = NEG_INF  # half the vocabulary masked (top-k/top-p style)
    logits[1, :] = NEG_INF  # a single finite logit: a one-hot distribution
    logits[1, 1234] = 2.5
    logits[2, :4000] = NEG_INF  # a masked prefix longer than one C++ chunk
    logits[3, 17] = logits[3, 4200] = 50.0  # tie at the max
    res = get_backend(backend).token_signals(logits.to(device), out=_poisoned_token_out(4, device))
    res = TokenSignals(*(t.cpu() for t in res))
    ent_r, lp_r, am_r = token_signals_ref(logits)
    _assert_close(res.entropy, ent_r, f"{backend} entropy", seed, **TOKEN_TOL)
    _assert_close(res.logprob, lp_r, f"{backend} logprob", seed, **TOKEN_TOL)
    assert res.entropy[1].item() == pytest.approx(0.0, abs=1e-6) and res.argmax[1].item() == 1234
    assert res.argmax[3].item() == 17
    assert torch.equal(res.argmax, am_r)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_token_signals_rows_without_a_distribution(backend, device):
    """A row holding a NaN or +inf logit, or none finite, has a NaN entropy as in the reference (not 0, which would
    read as a certain token) and an argmax inside the vocabulary; rows beside it are unaffected. V = 1100 spans
    three of the C++ path's 512-wide chunks; row 0's NaN sits in a chunk that is otherwise all -inf."""
    g, seed = _gen()
    V = 1100
    logits = torch.randn(5, V, generator=g) * 3
    logits[0, 512:1024] = NEG_INF
    logits[0, 600] = float("nan")
    logits[1, 3] = float("nan")
    logits[2, 900] = float("inf")
    logits[3] = NEG_INF
    res = get_backend(backend).token_signals(logits.to(device), out=_poisoned_token_out(5, device))
    res = TokenSignals(*(t.cpu() for t in res))
    ent_r, lp_r, am_r = token_signals_ref(logits)
    assert torch.isnan(ent_r[:4]).all()
    assert torch.isnan(res.entropy[:4]).all(), f"{backend}: entropy {res.entropy.tolist()} (seed={seed})"
    assert ((res.argmax >= 0) & (res.argmax < V)).all(), f"{backend}: argmax {res.argmax.tolist()}"
    assert int(res.argmax[3]) == int(am_r[3]) == 0  # no finite logit: index 0, as the reference
    _assert_close(res.entropy[4:], ent_r[4:], f"{backend} clean row entropy", seed, **TOKEN_TOL)
    _assert_close(res.logprob[4:], lp_r[4:], f"{backend} clean row logprob", seed, **TOKEN_TOL)


def test_signal_arguments_take_numpy_scalars():
    """numpy numbers are numbers: a temperature, top_p or top_k read from a numpy array is taken as its value."""
    np = pytest.importorskip("numpy")
    be = get_backend("torch")
    x = torch.randn(2, 50)
    keys = torch.tensor([1, 2])
    a = be.decode_signals(x, temperature=np.float32(0.5), rng_keys=keys, top_p=np.float64(0.9), top_k=np.int64(5))
    b = be.decode_signals(x, temperature=0.5, rng_keys=keys, top_p=0.9, top_k=5)
    assert torch.equal(a.chosen, b.chosen) and torch.equal(a.entropy, b.entropy)
    assert torch.equal(be.token_signals(x, temperature=np.float32(0.5)).entropy,
                       be.token_signals(x, temperature=0.5).entropy)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_token_signals_non_contiguous(backend, device):
    g, seed = _gen()
    base = (torch.randn(4231, 6, generator=g) * 3).to(device)  # logits = base.T is a transposed view
    chosen_base = torch.randint(0, 4231, (12,), generator=g).to(device)
    for logits, chosen in ((base.T, chosen_base[::2]), (base.T[:, ::3], chosen_base[1::2] % 1410)):
        assert not logits.is_contiguous()
        res = get_backend(backend).token_signals(logits, chosen)
        ent_r, lp_r, am_r = token_signals_ref(logits.cpu().contiguous(), chosen.cpu().contiguous())
        _assert_close(res.entropy, ent_r, f"{backend} entropy", seed, **TOKEN_TOL)
        _assert_close(res.logprob, lp_r, f"{backend} logprob", seed, **TOKEN_TOL)
        assert torch.equal(res.argmax.cpu(), am_r)


# (B, H, Hkv, D, T): each value of B (1, 3, 9), H/Hkv ((9, 3), (4, 4), (6, 2)), D (8, 64), T (1, 5, 37)
# appears with several others, without the full cross product.
ATTN_SHAPES = [
    (1, 9, 3, 8, 1), (1, 4, 4, 64, 37), (3, 6, 2, 8, 37), (3, 9, 3, 64, 5),
    (9, 4, 4, 8, 5), (9, 6, 2, 64, 1), (9, 9, 3, 64, 37), (3, 4, 4, 8, 37),
]


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,H,Hkv,D,T", ATTN_SHAPES)
def test_attention_vs_reference(backend, device, dtype, B, H, Hkv, D, T):
    g, seed = _gen()
    be = get_backend(backend)
    q = torch.randn(B, H, T, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, T, D, generator=g).to(dtype)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T  # at least one full sequence
    scale = D**-0.5
    qd, kd, nd = q.to(device), k.to(device), lengths.to(device)
    out = torch.full((B, T), float("nan"), device=device)
    a = be.causal_attn_colmax(qd, kd, nd, scale, out=out)
    assert a.data_ptr() == out.data_ptr()
    _assert_close(a, causal_attn_colmax_ref(q, k, lengths, scale), f"{backend} colmax", seed, **ATTN_TOL)
    out_m = torch.full((B, T, T), float("nan"), device=device)
    m = be.causal_attn_mean_rows(qd, kd, nd, scale, out=out_m)
    _assert_close(m, causal_attn_mean_rows_ref(q, k, lengths, scale), f"{backend} mean_rows", seed, **ATTN_TOL)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_attention_non_contiguous(backend, device):
    """The model's natural layout [B, T, H, D].transpose(1, 2), and a strided slice of the head dim."""
    g, seed = _gen()
    B, T, H, Hkv, D = 3, 19, 6, 2, 16
    q = torch.randn(B, T, H, 2 * D, generator=g).to(device).transpose(1, 2)[..., ::2]
    k = torch.randn(B, T, Hkv, D, generator=g).to(device).transpose(1, 2)
    lengths = torch.tensor([19, 7, 0], device=device)[::1]
    assert not q.is_contiguous() and not k.is_contiguous()
    be = get_backend(backend)
    qc, kc, nc = q.cpu(), k.cpu(), lengths.cpu()
    _assert_close(be.causal_attn_colmax(q, k, lengths, 0.25), causal_attn_colmax_ref(qc, kc, nc, 0.25),
                  f"{backend} colmax", seed, **ATTN_TOL)
    _assert_close(be.causal_attn_mean_rows(q, k, lengths, 0.25), causal_attn_mean_rows_ref(qc, kc, nc, 0.25),
                  f"{backend} mean_rows", seed, **ATTN_TOL)


# ---------------------------------------------------------------- validation and selection

_L = torch.zeros(2, 11)
_Q = torch.zeros(2, 6, 5, 8)
_K = torch.zeros(2, 2, 5, 8)
_N = torch.tensor([5, 3])

TOKEN_BAD = [
    ("logits", dict(logits=torch.zeros(2, 11, dtype=torch.int64))),
    ("logits", dict(logits=torch.zeros(11))),
    ("logits", dict(logits=torch.zeros(2, 0))),
    ("logits", dict(logits=torch.zeros(2, 11, device="meta"))),
    ("chosen", dict(chosen=torch.zeros(2, dtype=torch.int32))),
    ("chosen", dict(chosen=torch.zeros(3, dtype=torch.int64))),
    ("chosen", dict(chosen=torch.tensor([0, 11]))),
    ("temperature", dict(temperature=0.0)),
    ("temperature", dict(temperature=1e-40)),  # 1 / T overflows float32
    ("temperature", dict(temperature=float("inf"))),
    ("temperature", dict(temperature=True)),
    ("out", dict(out=(torch.zeros(2), torch.zeros(2)))),
    ("out.entropy", dict(out=(torch.zeros(3), torch.zeros(2), torch.zeros(2, dtype=torch.int64)))),
    ("out.argmax", dict(out=(torch.zeros(2), torch.zeros(2), torch.zeros(2)))),
]
ATTN_BAD = [
    ("q", dict(q=torch.zeros(2, 6, 5))),
    ("q", dict(q=torch.zeros(2, 6, 5, 8, dtype=torch.int32))),
    ("k", dict(k=torch.zeros(2, 2, 5, 8, dtype=torch.float16))),
    ("k", dict(k=torch.zeros(2, 2, 4, 8))),
    ("Hkv", dict(k=torch.zeros(2, 4, 5, 8))),
    ("lengths", dict(lengths=torch.tensor([5.0, 3.0]))),
    ("lengths", dict(lengths=torch.tensor([5]))),
    ("lengths", dict(lengths=torch.tensor([6, 3]))),
    ("lengths", dict(lengths=torch.tensor([-1, 3]))),
    ("out", dict(out=torch.zeros(2, 6))),
    ("out", dict(out=torch.zeros(5, 2).T)),
]


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("name,bad", TOKEN_BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(TOKEN_BAD)])
def test_token_signals_rejects(backend, device, name, bad):
    if device != "cpu" and name == "chosen" and bad["chosen"].dtype == torch.int64 and bad["chosen"].shape == (2,):
        pytest.skip("value checks read tensor contents: CPU only (GPU kernels clamp chosen into the vocabulary)")
    kwargs = _on(device, dict(logits=_L, chosen=None, temperature=1.0) | bad)
    with pytest.raises(ValueError, match=name):
        get_backend(backend).token_signals(**kwargs)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("name,bad", ATTN_BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(ATTN_BAD)])
def test_attention_rejects(backend, device, name, bad):
    n = bad.get("lengths")
    if device != "cpu" and n is not None and n.shape == (2,) and not n.is_floating_point():
        pytest.skip("value checks read tensor contents: CPU only (GPU kernels mask out-of-range positions)")
    kwargs = _on(device, dict(q=_Q, k=_K, lengths=_N, scale=0.5) | bad)
    be = get_backend(backend)
    with pytest.raises(ValueError, match=name):
        be.causal_attn_colmax(**kwargs)
    if "out" not in bad:  # mean_rows' out has another shape
        with pytest.raises(ValueError, match=name):
            be.causal_attn_mean_rows(**kwargs)


def test_get_backend_selection(monkeypatch):
    monkeypatch.delenv(signals.ENV_VAR, raising=False)
    default = get_backend()
    assert default.name.startswith("auto(") and "other=torch" in default.name
    if not torch.cuda.is_available():
        assert default.name == "auto(cuda=none,other=torch)"
    monkeypatch.setenv(signals.ENV_VAR, "torch")
    assert get_backend().name == "torch"  # the environment overrides the automatic choice
    monkeypatch.setenv(signals.ENV_VAR, "no-such-backend")
    with pytest.raises(ValueError, match="no-such-backend"):
        get_backend()
    with pytest.raises(ValueError, match="unknown signals backend"):
        get_backend("nope")


def test_unavailable_backend_is_reported(monkeypatch):
    from fastrag.signals import cpp_backend

    def missing():
        raise ImportError("fastrag._C not built")

    monkeypatch.setattr(cpp_backend, "load_extension", missing)
    with pytest.raises(BackendUnavailableError, match="'cpp'.*not built"):
        get_backend("cpp")
    monkeypatch.setitem(signals._FACTORIES, "fake-gpu", lambda: (_ for _ in ()).throw(RuntimeError("no GPU")))
    with pytest.raises(BackendUnavailableError, match="no GPU"):
        get_backend("fake-gpu")


def test_register_backend_is_used(monkeypatch):
    monkeypatch.setattr(signals, "_FACTORIES", dict(signals._FACTORIES))
    torch_be = get_backend("torch")
    signals.register_backend("mine", lambda: torch_be)
    monkeypatch.setenv(signals.ENV_VAR, "mine")
    assert get_backend() is torch_be and "mine" in signals.registered_backends()


# ---------------------------------------------------------------- non-stopword table


@pytest.fixture(scope="module")
def tokenizer():
    try:
        from fastrag.model.loading import load_tokenizer

        return load_tokenizer("smollm2")
    except (FileNotFoundError, ImportError, OSError) as e:
        pytest.skip(f"embedded tokenizer not available: {e}")


def test_nonstop_table_matches_reference(tokenizer):
    table = build_nonstop_table(tokenizer)
    ref = nonstop_table_ref(tokenizer)
    assert table.dtype == torch.bool and table.shape == (len(tokenizer),)
    diff = (table != ref).nonzero()[:10, 0].tolist()
    assert not diff, f"differs at {[(i, tokenizer.convert_ids_to_tokens(i)) for i in diff]}"


def test_nonstop_table_words(tokenizer):
    table = build_nonstop_table(tokenizer, vocab_size=len(tokenizer) + 64)
    assert table.shape == (len(tokenizer) + 64,) and not table[len(tokenizer):].any()
    ids = tokenizer.encode(" The capital of France is Paris, 1984.\n")
    flags = {tokenizer.decode([i]).strip(): bool(table[i]) for i in ids}
    assert flags["The"] is False and flags["of"] is False and flags["is"] is False  # stopwords
    assert flags["capital"] is True and flags["France"] is True and flags["Paris"] is True
    assert [flags[d] for d in "1984"] == [True] * 4  # (SmolLM2 writes a number a digit a token)
    assert flags[","] is False and flags[""] is False  # punctuation, newline
    assert not table[tokenizer.all_special_ids].any()
    custom = build_nonstop_table(tokenizer, stopwords={"paris"})
    paris = tokenizer.encode(" Paris")[0]
    the = tokenizer.encode(" The")[0]
    assert not custom[paris] and custom[the]
