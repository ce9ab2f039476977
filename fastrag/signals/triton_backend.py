"""Triton backend: launchers over fastrag.kernels (kernels/token_signals.py, kernels/attn_stats.py).

Runs CUDA tensors when a GPU is there, and CPU tensors when the kernels were imported under TRITON_INTERPRET=1
(Triton's interpreter: how CI checks these kernels without a GPU). Arguments arrive validated
(fastrag.signals.checks); these functions only allocate outputs and launch.
"""

from __future__ import annotations

import torch

from fastrag.signals import TokenSignals


def _kernels():
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise ImportError(f"triton is not installed ({e}); pip install triton==3.9.0") from e
    try:
        import fastrag.kernels as k
    except ModuleNotFoundError as e:
        if e.name != "fastrag.kernels":
            raise
        raise ImportError("fastrag.kernels (the repository's kernels/ folder) is not importable: fastrag runs from a "
                          "source tree that is not installed; pip install -e . there") from e
    return k


def devices() -> frozenset[str]:
    """Device types the Triton kernels run here; RuntimeError when none."""
    k = _kernels()
    if k.INTERPRETED:
        return frozenset({"cpu"})
    if torch.cuda.is_available():
        return frozenset({"cuda"})
    raise RuntimeError("no CUDA GPU, and the Triton kernels were not imported under TRITON_INTERPRET=1")


def decode_signals(logits, temperature, rng_keys, chosen, nonstop, out, *, top_p=1.0) -> None:
    from fastrag.kernels import token_signals as ts

    ts.token_signals(logits, temperature, rng_keys, chosen, nonstop, tuple(out), top_p=top_p)


def token_signals(logits, chosen, temperature, out):
    """The older (entropy, logprob, argmax) contract on top of the fused kernel: entropy/logprob of
    softmax(logits / temperature) for `chosen` (or the argmax)."""
    from fastrag.kernels import token_signals as ts

    B, dev = logits.shape[0], logits.device
    if out is None:
        out = TokenSignals(torch.empty(B, device=dev), torch.empty(B, device=dev),
                           torch.empty(B, dtype=torch.int64, device=dev))
    prob = torch.empty(B, device=dev)
    ts.token_signals(logits, float(temperature), None, None, None, (out[2], out[0], out[1], prob, None), greedy=True)
    if chosen is not None:
        # ln p_c = ln p_argmax + y_c - y_argmax (same max and normaliser): two gathers, no second pass
        y_c = logits.gather(1, chosen[:, None])[:, 0].float() / temperature
        y_a = logits.gather(1, out[2][:, None])[:, 0].float() / temperature
        out[1].add_(y_c - y_a)  # ln p_c - ln p_a = y_c - y_a
    return tuple(out)


def causal_attn_colmax(q, k, lengths, scale, out):
    from fastrag.kernels import attn_stats

    if out is None:
        out = torch.empty(q.shape[0], q.shape[2], dtype=torch.float32, device=q.device)
    attn_stats.causal_attn_stats(q, k, lengths, scale, colmax_out=out)
    return out


def causal_attn_mean_rows(q, k, lengths, scale, out):
    from fastrag.kernels import attn_stats

    B, T = q.shape[0], q.shape[2]
    if out is None:
        out = torch.empty(B, T, T, dtype=torch.float32, device=q.device)
    rows = torch.arange(T, device=q.device).expand(B, T)
    attn_stats.causal_attn_stats(q, k, lengths, scale, rows=rows, rows_out=out)
    return out


def causal_attn_rows(q, k, lengths, scale, rows, out) -> None:
    from fastrag.kernels import attn_stats

    attn_stats.causal_attn_stats(q, k, lengths, scale, rows=rows, rows_out=out)


def attn_decode_update(q, k_cache, block_tables, ctx_lens, span_start, lse, block_size, scale, amax,
                       row_out) -> None:
    from fastrag.kernels import attn_stats

    attn_stats.attn_decode_update(q, k_cache, block_tables, ctx_lens, span_start, lse, block_size, scale, amax,
                                  row_out)
