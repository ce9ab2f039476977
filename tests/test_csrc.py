"""The C++ extension fastrag._C called directly: host-glue checks (RuntimeError naming the argument),
out= buffers, dtype dispatch, non-contiguous inputs, and OpenMP thread-count invariance.
Numerics against the float64 reference are covered backend-wide in test_signals.py."""

from __future__ import annotations

import random

import pytest
import torch

from fastrag.signals.reference import causal_attn_colmax_ref, token_signals_ref

_C = pytest.importorskip("fastrag._C", reason="C++ extension not built: pip install --no-build-isolation -e .")


def _gen() -> tuple[torch.Generator, int]:
    seed = random.randrange(2**31)
    return torch.Generator().manual_seed(seed), seed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_token_signals_dispatch_and_out(dtype):
    g, seed = _gen()
    logits = (torch.randn(5, 1031, generator=g) * 5).to(dtype)  # 1031: two full 512-chunks and a tail
    chosen = torch.randint(0, 1031, (5,), generator=g)
    ent = torch.full((5,), float("nan"))
    lp = torch.full((5,), float("nan"))
    am = torch.full((5,), -1, dtype=torch.int64)
    res = _C.token_signals(logits, chosen, 1.3, ent, lp, am)
    assert res[0] is ent or res[0].data_ptr() == ent.data_ptr()
    e_r, l_r, a_r = token_signals_ref(logits, chosen, 1.3)
    assert torch.allclose(ent.double(), e_r, atol=2e-5, rtol=2e-5), f"entropy {ent} vs {e_r} (seed={seed})"
    assert torch.allclose(lp.double(), l_r, atol=2e-5, rtol=2e-5), f"logprob {lp} vs {l_r} (seed={seed})"
    assert torch.equal(am, a_r), f"argmax {am} vs {a_r} (seed={seed})"
    e2, l2, a2 = _C.token_signals(logits)  # allocating call, chosen = argmax
    assert (e2.dtype, l2.dtype, a2.dtype) == (torch.float32, torch.float32, torch.int64)
    assert torch.allclose(l2.double(), token_signals_ref(logits)[1], atol=2e-5, rtol=2e-5), f"seed={seed}"


def test_glue_makes_inputs_contiguous():
    g, seed = _gen()
    base = torch.randn(700, 4, generator=g)
    e, l, a = _C.token_signals(base.T, None, 1.0)
    e_r, l_r, a_r = token_signals_ref(base.T.contiguous())
    assert torch.allclose(e.double(), e_r, atol=2e-5, rtol=2e-5) and torch.equal(a, a_r), f"seed={seed}"
    q = torch.randn(2, 11, 4, 8, generator=g).transpose(1, 2)  # [B, H, T, D] view of [B, T, H, D]
    k = torch.randn(2, 11, 2, 8, generator=g).transpose(1, 2)
    n = torch.tensor([11, 6])
    out = _C.causal_attn_colmax(q, k, n, 0.35)
    assert torch.allclose(out.double(), causal_attn_colmax_ref(q, k, n, 0.35), atol=2e-6, rtol=1e-5), f"seed={seed}"


def test_thread_count_does_not_change_results():
    """Each row / (sequence, head) is computed by one thread, so results are bitwise identical."""
    g, _ = _gen()
    logits = torch.randn(16, 5000, generator=g) * 3
    q = torch.randn(4, 6, 33, 16, generator=g)
    k = torch.randn(4, 3, 33, 16, generator=g)
    n = torch.tensor([33, 1, 20, 0])
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)  # same libgomp as torch (rpath), so this sets our OpenMP threads too
            results.append((_C.token_signals(logits), _C.causal_attn_colmax(q, k, n, 0.25)))
    finally:
        torch.set_num_threads(before)
    (t1, a1), (t2, a2) = results
    assert all(torch.equal(x, y) for x, y in zip(t1, t2)) and torch.equal(a1, a2)
    assert (a1[3] == 0).all() and (a1[1, 1:] == 0).all() and a1[1, 0].item() == pytest.approx(1.0)


_L = torch.zeros(2, 9)
TOKEN_BAD = [
    ("logits must be float32", dict(logits=torch.zeros(2, 9, dtype=torch.float64))),
    ("logits must have 2 dims", dict(logits=torch.zeros(9))),
    ("chosen must be Long", dict(chosen=torch.zeros(2, dtype=torch.int32))),
    ("chosen must have shape", dict(chosen=torch.zeros(3, dtype=torch.int64))),
    ("chosen\\[1\\] = 9 is outside", dict(chosen=torch.tensor([0, 9]))),
    ("temperature must be > 0", dict(temperature=-1.0)),
    ("entropy must have shape", dict(entropy=torch.zeros(3))),
    ("argmax must be Long", dict(argmax=torch.zeros(2))),
    ("logprob must be contiguous", dict(logprob=torch.zeros(4)[::2])),
]


@pytest.mark.parametrize("message,bad", TOKEN_BAD, ids=[m.split()[0] for m, _ in TOKEN_BAD])
def test_token_signals_glue_checks(message, bad):
    kwargs = dict(logits=_L, chosen=None, temperature=1.0) | bad
    with pytest.raises(RuntimeError, match=message):
        _C.token_signals(**kwargs)


_Q, _K, _N = torch.zeros(2, 4, 5, 8), torch.zeros(2, 2, 5, 8), torch.tensor([5, 2])
ATTN_BAD = [
    ("q must be Float", dict(q=torch.zeros(2, 4, 5, 8, dtype=torch.bfloat16))),
    ("k must have 4 dims", dict(k=torch.zeros(2, 5, 8))),
    ("k must have shape", dict(k=torch.zeros(2, 2, 6, 8))),
    ("must be a multiple of k heads", dict(k=torch.zeros(2, 3, 5, 8))),
    ("lengths must be Long", dict(lengths=torch.tensor([5, 2], dtype=torch.int32))),
    ("lengths\\[0\\] = 6 is outside", dict(lengths=torch.tensor([6, 2]))),
    ("out must have shape", dict(out=torch.zeros(2, 4))),
]


@pytest.mark.parametrize("message,bad", ATTN_BAD, ids=[m.split()[0] for m, _ in ATTN_BAD])
def test_colmax_glue_checks(message, bad):
    kwargs = dict(q=_Q, k=_K, lengths=_N, scale=0.5) | bad
    with pytest.raises(RuntimeError, match=message):
        _C.causal_attn_colmax(**kwargs)
