"""The masked attention of prefills and attention passes with grouped-query heads, in both forms
(`FASTRAG_PREFILL_GQA`: one SDPA call with enable_gqa, or keys and values repeated to every query head): each equals
an explicit float64 softmax on random shapes and masks, and an engine's prefill logits, written KV and attention
passes do not depend on the form."""

from __future__ import annotations

import pytest
import torch

from fastrag.engine import Engine
from fastrag.model import llama
from fastrag.model.attention.torch_sdpa import in_sdpa_scope
from fastrag.model.llama import LlamaModel, masked_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(q, k, v, mask, scale):
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("seed", range(6))
def test_both_forms_equal_an_explicit_softmax(seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    Hkv, G, D = r(1, 4), r(1, 5), 8 * r(1, 5)
    B, T, S = r(1, 5), r(1, 20), r(20, 70)
    q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((Hkv * G, T), (Hkv, S), (Hkv, S)))
    mask = torch.rand(B, 1, T, S, generator=g) < 0.6
    mask[..., r(0, S)] = True  # every row attends to something
    scale = D ** -0.5
    want = _reference(q, k, v, mask, scale)
    for expand in (False, True):
        got = masked_attention(q.to(DEV), k.to(DEV), v.to(DEV), mask.to(DEV), scale, expand=expand)
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-5)


class Tok:
    eos_token_id = None

    def encode(self, s):
        return [int(x) for x in s.split()]


def _model():
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, eos_token_id=None)
    m = LlamaModel.from_hf_config(cfg, seed=4, device=DEV)
    m.paged_prefill = None  # (the masked calls whose GQA form is under test: on CUDA the paged kernel is the default)
    return m


def _prefill_and_passes(expand: bool):
    m = _model()
    m.expand_gqa = expand
    eng = Engine(m, Tok(), kv_cache_gb=0.02, max_batch=8)
    eng.set_prefix(" ".join(str(t) for t in range(20, 52)))
    g = torch.Generator().manual_seed(9)
    seqs = []
    for n in (3, 17, 40, 9):  # very different lengths: the packed forward
        s = eng.new_sequence()
        eng.start(s, list(range(20, 52)) + torch.randint(1, 96, (n,), generator=g).tolist(), 1)
        seqs.append(s)
    eng.step()
    # the slots written (the pool's other slots hold whatever was in memory)
    slots = torch.cat([eng.prefix.slots.cpu()] + [torch.tensor(s.table.slots(0, s.table.num_tokens)) for s in seqs])
    kv = [(eng.pool.k[i][:, slots.to(DEV)].clone(), eng.pool.v[i][:, slots.to(DEV)].clone())
          for i in range(len(eng.pool.k))]
    lists = [torch.randint(1, 96, (n,), generator=g).tolist() for n in (4, 15, 31)]
    return [s.out.ids for s in seqs], [s.out.logprob for s in seqs], kv, \
        eng.attention_passes(lists, "colmax"), eng.attention_passes(lists, "rows")


def test_engine_prefill_and_attention_passes_do_not_depend_on_the_form():
    ids_n, lp_n, kv_n, col_n, rows_n = _prefill_and_passes(False)
    ids_e, lp_e, kv_e, col_e, rows_e = _prefill_and_passes(True)
    assert ids_n == ids_e
    torch.testing.assert_close(torch.tensor(lp_e), torch.tensor(lp_n), rtol=1e-4, atol=1e-5)
    for (kn, vn), (ke, ve) in zip(kv_n, kv_e):
        torch.testing.assert_close(ke, kn, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ve, vn, rtol=1e-4, atol=1e-5)
    for a, b in zip(col_e, col_n):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5)
    for a, b in zip(rows_e, rows_n):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_env_switch(monkeypatch):
    """auto (the default): repeated keys on CUDA devices (2.3-5.6x faster there for grouped heads, H200
    2026-11-26), one grouped SDPA call elsewhere; native and expand force one form everywhere."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(llama.PREFILL_GQA_ENV, raising=False)
    m = _model()
    assert m.expand_gqa is None and m.gqa_expand(cpu) is False and m.gqa_expand(cuda) is True
    monkeypatch.setenv(llama.PREFILL_GQA_ENV, "native")
    m = _model()
    assert m.gqa_expand(cpu) is False and m.gqa_expand(cuda) is False
    monkeypatch.setenv(llama.PREFILL_GQA_ENV, "expand")
    m = _model()
    assert m.expand_gqa is True and m.gqa_expand(cpu) is True and m.gqa_expand(cuda) is True
    monkeypatch.setenv(llama.PREFILL_GQA_ENV, "repeat")
    with pytest.raises(ValueError, match="FASTRAG_PREFILL_GQA='repeat'"):
        _model()


def test_sdpa_backend_setting(monkeypatch):
    """$FASTRAG_SDPA: every SDPA backend but cuDNN by default (torch builds a cuDNN graph for each new set of shapes,
    and no two prefill calls of a run share them), 'torch' leaves the choice to torch, a bad name is an error naming
    the variable, and the masked attention really is restricted to the backends named."""
    from torch.nn.attention import SDPBackend

    monkeypatch.delenv(llama.SDPA_ENV, raising=False)
    assert llama.sdpa_backends() == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    monkeypatch.setenv(llama.SDPA_ENV, "torch")
    assert llama.sdpa_backends() is None
    monkeypatch.setenv(llama.SDPA_ENV, "math, cudnn")
    assert llama.sdpa_backends() == [SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION]
    monkeypatch.setenv(llama.SDPA_ENV, "flash,fast")
    with pytest.raises(ValueError, match="FASTRAG_SDPA='flash,fast'"):
        llama.sdpa_backends()

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, n, 16, generator=g) for n in (5, 9, 9))
    mask = torch.rand(2, 1, 5, 9, generator=g) < 0.7
    mask[..., 0] = True
    want = _reference(q, k, v, mask, 0.25)
    for setting in ("math", "torch", "flash,efficient,math"):
        monkeypatch.setenv(llama.SDPA_ENV, setting)
        got = masked_attention(q.to(DEV), k.to(DEV), v.to(DEV), mask.to(DEV), 0.25)
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-5)
    # cuDNN alone cannot take a float32 call (nor run on a CPU): no kernel is left, so the setting is applied
    monkeypatch.setenv(llama.SDPA_ENV, "cudnn")
    with pytest.raises(RuntimeError):
        masked_attention(q.to(DEV), k.to(DEV), v.to(DEV), mask.to(DEV), 0.25)


def test_a_prefill_forward_enters_the_backend_scope_once(monkeypatch):
    """The backend restriction is entered once per prefill forward and once per attention pass, not once per layer
    and bucket (entering costs ~10 us), and every masked SDPA call runs inside it."""
    import torch.nn.attention as attn

    monkeypatch.delenv(llama.SDPA_ENV, raising=False)
    entered, calls = [], []
    real_kernel, real_sdpa = attn.sdpa_kernel, torch.nn.functional.scaled_dot_product_attention

    def counting_kernel(*a, **kw):
        entered.append(1)
        return real_kernel(*a, **kw)

    def watched_sdpa(*a, **kw):
        calls.append(torch.backends.cuda.cudnn_sdp_enabled() is False and in_sdpa_scope())
        return real_sdpa(*a, **kw)

    monkeypatch.setattr(attn, "sdpa_kernel", counting_kernel)
    monkeypatch.setattr(llama.F, "scaled_dot_product_attention", watched_sdpa)
    m = _model()
    eng = Engine(m, Tok(), kv_cache_gb=0.02, max_batch=8)
    assert len(entered) == 1 and all(calls)  # the cascade's one-time self-check, inside a scope of its own
    entered.clear()
    calls.clear()
    g = torch.Generator().manual_seed(5)
    for n in (3, 17, 40):  # the packed forward: several buckets, each a masked call per layer
        s = eng.new_sequence()
        eng.start(s, torch.randint(1, 96, (n,), generator=g).tolist(), 1)
    eng.step()
    assert len(entered) == 1 and len(calls) >= 2 * len(m.layers) and all(calls), (len(entered), calls)
    eng.attention_passes([[5, 6, 7], [8, 9]], "colmax")
    assert len(entered) == 2 and all(calls)
    # torch's own choice: nothing is restricted, and a prefill and a pass still run (each enters its scope once)
    monkeypatch.setenv(llama.SDPA_ENV, "torch")
    calls.clear()
    s = eng.new_sequence()
    eng.start(s, torch.randint(1, 96, (30,), generator=g).tolist(), 1)
    eng.step()
    eng.attention_passes([[5, 6, 7]], "colmax")
    assert len(entered) == 2 and calls and not any(calls) and not in_sdpa_scope()
