"""The cascade prefill ($FASTRAG_CASCADE_PREFILL): a prefill's new tokens attend to the shared prefix in one unmasked
call for all of them and to their own context in a masked one, merged by log-sum-exp. `lse_attention` must equal an
explicit float64 softmax (output and log-sum-exp), the cascade must equal the one masked call over [prefix | context],
an engine's generations and written KV must not depend on it (packed and padded prefills, grouped and plain heads,
two prefixes in one call), and a device whose kernels fail the self-check must fall back with a warning."""

from __future__ import annotations

import random

import pytest
import torch

from fastrag.engine import Engine
from fastrag.model import llama
from fastrag.model.attention import cascade, select
from fastrag.model.llama import CascadeMask, LlamaModel, cascade_bias, lse_attention, masked_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV == "cuda" else [])


def _tol(dtype):
    return dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)


def _causal_mask(g, B, T, S):
    """[B, 1, T, S] bool: sequence b has lens[b] <= S context entries, its T new tokens the last of them (the
    rows past a short sequence's own tokens are padding and see nothing)."""
    lens = torch.randint(1, S + 1, (B,), generator=g)
    lens[0] = S
    t = torch.arange(T).view(1, T) + (lens.view(B, 1) - T)  # position of each new token in its context
    key = torch.arange(S).view(1, 1, S)
    return ((key <= t.unsqueeze(-1)) & (key < lens.view(B, 1, 1)) & (t.unsqueeze(-1) >= 0)).unsqueeze(1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(5))
def test_lse_attention_equals_an_explicit_softmax(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    B, H, T, S, D = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 4), (1, 5), (1, 24),
                                                                                     (1, 70), (1, 5)))
    D *= 16
    q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (T, S, S))
    mask = torch.rand(B, 1, T, S, generator=g) < 0.6
    mask[..., int(torch.randint(0, S, (1,), generator=g))] = True  # every row attends to something
    scale = D ** -0.5
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    for m in (None, mask):
        sm = s if m is None else s.masked_fill(~m, float("-inf"))
        want_o, want_lse = torch.softmax(sm, -1) @ v.double(), torch.logsumexp(sm, -1)
        bias = None
        if m is not None:
            bias = cascade_bias(m.to(DEV), 1, dtype).expand(B, H, T, S)
        o, lse = lse_attention(*(x.to(DEV, dtype) for x in (q, k, v)), bias, scale)
        assert o.shape == (B, H, T, D) and lse.shape == (B, H, T) and lse.dtype == torch.float32
        tol = _tol(dtype)
        torch.testing.assert_close(o.double().cpu(), want_o, **tol)
        torch.testing.assert_close(lse.double().cpu(), want_lse, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(6))
def test_cascade_equals_the_masked_call_over_prefix_and_context(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    Hkv, G, D = r(1, 4), r(1, 4), 16 * r(1, 5)
    B, T, P = r(1, 5), r(1, 20), r(1, 60)
    S = T + r(0, 30)
    H = Hkv * G
    m = LlamaModel.__new__(LlamaModel)  # (only `scale` is read)
    m.scale = D ** -0.5
    q, ks, vs = torch.randn(B, H, T, D, generator=g), torch.randn(B, Hkv, S, D, generator=g), \
        torch.randn(B, Hkv, S, D, generator=g)
    kpre, vpre = torch.randn(Hkv, P, D, generator=g), torch.randn(Hkv, P, D, generator=g)
    mask = _causal_mask(g, B, T, S)
    full = torch.cat([mask.new_ones(B, 1, T, P), mask], dim=-1)
    want = masked_attention(q.double(), torch.cat([kpre.expand(B, -1, -1, -1), ks], 2).double(),
                            torch.cat([vpre.expand(B, -1, -1, -1), vs], 2).double(), full, m.scale, expand=True)
    x = lambda t: t.to(DEV, dtype)  # noqa: E731
    got = cascade.cascade_core(x(q), x(kpre), x(vpre), x(ks), x(vs),
                               CascadeMask(cascade_bias(mask.to(DEV), G, dtype), G), m.scale)
    assert got.dtype == dtype and got.shape == (B, H, T, D)
    real = mask.any(-1).squeeze(1)  # [B, T]: rows of real tokens (padding rows are never read)
    torch.testing.assert_close(got.double().cpu().transpose(1, 2)[real], want.transpose(1, 2)[real], **_tol(dtype))


class Tok:
    eos_token_id = None

    def encode(self, s):
        return [int(x) for x in s.split()]


def _model(heads: int, kv_heads: int, cascade: bool):
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, eos_token_id=None)
    m = LlamaModel.from_hf_config(cfg, seed=4, device=DEV)
    m.cascade_prefill = cascade
    m.paged_prefill = None  # (the attention buckets, where the cascade lives: on CUDA the paged kernel is the default)
    assert not m.uses_paged_prefill(torch.device(DEV), torch.float32)
    return m


PREFIXES = (list(range(20, 52)), list(range(60, 77)))


def _run(heads, kv_heads, cascade_on, lengths, two_prefixes, seed):
    """Generations of 4 tokens after prompts of `lengths` new tokens (after one of the prefixes), all prefilled in
    the first step; returns (ids, log-probabilities, the written KV, how many cascade calls ran)."""
    m = _model(heads, kv_heads, cascade_on)
    calls = [0]
    inner = cascade.attend_prefill_cascade

    def counted(*a, **k):
        calls[0] += 1
        return inner(*a, **k)

    with pytest.MonkeyPatch.context() as mp:  # (the cascade's calls counted where attend.py looks it up)
        mp.setattr(cascade, "attend_prefill_cascade", counted)
        return _generate(m, lengths, two_prefixes, seed, calls)


def _generate(m, lengths, two_prefixes, seed, calls):
    eng = Engine(m, Tok(), kv_cache_gb=0.02, max_batch=8, mix_prefill=two_prefixes, prefill_hold=0)
    for p in PREFIXES[: 1 + two_prefixes]:
        eng.set_prefix(" ".join(map(str, p)))
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i, n in enumerate(lengths):
        s = eng.new_sequence()
        head = PREFIXES[i % 2 if two_prefixes else 0]
        eng.start(s, head + torch.randint(1, 96, (n,), generator=g).tolist(), 4)
        seqs.append(s)
    eng.step()
    slots = torch.cat([torch.tensor(s.table.slots(0, s.table.num_tokens)) for s in seqs]).to(DEV)
    kv = [(eng.pool.k[i][:, slots].clone(), eng.pool.v[i][:, slots].clone()) for i in range(len(eng.pool.k))]
    while eng.has_work:
        eng.step()
    return [s.out.ids for s in seqs], [s.out.logprob for s in seqs], kv, calls[0]


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("lengths,two_prefixes", [((3, 17, 40, 9), False), ((12, 12, 12), False),
                                                  ((5, 30, 11, 2, 19), True)])
def test_engine_generations_do_not_depend_on_the_cascade(heads, kv_heads, lengths, two_prefixes):
    seed = random.randrange(2**31)
    ids_c, lp_c, kv_c, calls_c = _run(heads, kv_heads, True, lengths, two_prefixes, seed)
    ids_m, lp_m, kv_m, calls_m = _run(heads, kv_heads, False, lengths, two_prefixes, seed)
    assert calls_c > 0 and calls_m == 0, (calls_c, calls_m)
    assert ids_c == ids_m, seed
    for a, b in zip(lp_c, lp_m):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-4)
    for (kc, vc), (km, vm) in zip(kv_c, kv_m):  # layer 0 is the same input; layer 1 reads the attention's output
        torch.testing.assert_close(kc, km, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(vc, vm, rtol=1e-4, atol=1e-4)


def test_a_failing_self_check_falls_back_with_a_warning(monkeypatch):
    m = _model(6, 2, True)

    def broken(*a, **k):
        raise RuntimeError("no such kernel here")

    monkeypatch.setattr(cascade, "lse_attention", broken)
    with pytest.warns(RuntimeWarning, match="without the cascade.*no such kernel here"):
        assert m.uses_cascade_prefill(torch.device(DEV), torch.float32) is False
    key = llama.self_check_key(DEV, torch.float32)
    assert m.cascade_checks[key].startswith("off: RuntimeError: no such kernel here")
    m2 = _model(6, 2, True)

    def wrong(q, k, v, bias, scale):
        return torch.zeros_like(q), torch.zeros(q.shape[:3], device=q.device)

    monkeypatch.setattr(cascade, "lse_attention", wrong)
    with pytest.warns(RuntimeWarning, match="differed from the masked call"):
        assert m2.uses_cascade_prefill(torch.device(DEV), torch.float32) is False
    # the engine still prefills, through the one masked call
    monkeypatch.setattr(cascade, "lse_attention", broken)
    eng = Engine(m, Tok(), kv_cache_gb=0.02, max_batch=4, prefill_hold=0)
    eng.set_prefix(" ".join(map(str, PREFIXES[0])))
    s = eng.new_sequence()
    eng.start(s, PREFIXES[0] + [5, 6, 7], 3)
    while eng.has_work:
        eng.step()
    assert len(s.out.ids) == 3


def test_switch_from_the_environment(monkeypatch):
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    assert LlamaModel.from_hf_config(cfg, seed=1).cascade_prefill is True
    monkeypatch.setenv(llama.CASCADE_PREFILL_ENV, "0")
    m = LlamaModel.from_hf_config(cfg, seed=1)
    assert m.cascade_prefill is False and m.uses_cascade_prefill(torch.device("cpu"), torch.float32) is False
    monkeypatch.setenv(llama.CASCADE_PREFILL_ENV, "on")
    with pytest.raises(ValueError, match="FASTRAG_CASCADE_PREFILL='on'"):
        select.cascade_prefill_mode()
    monkeypatch.delenv(llama.CASCADE_PREFILL_ENV)
    assert select.cascade_prefill_mode() == "auto"
