"""CUDA backend: launchers over the CUDA kernels of `fastrag._C` (csrc/*.cu, built when torch is a CUDA build and
nvcc is on PATH). Arguments arrive validated (fastrag.signals.checks); the C++ glue checks again and raises
RuntimeError naming the argument for direct callers.
"""

from __future__ import annotations

import torch

from fastrag.signals import TokenSignals


def load_cuda_extension():
    """`fastrag._C` with its CUDA kernels, or ImportError/RuntimeError saying what is missing."""
    from fastrag.signals.cpp_backend import load_extension

    ext = load_extension()
    if not getattr(ext, "with_cuda", False):
        raise ImportError("fastrag._C was built without CUDA (needs a CUDA build of torch and nvcc at build time; "
                          "rebuild with `pip install --no-build-isolation -e .`)")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU is visible")
    return ext


def decode_signals(logits, temperature, rng_keys, chosen, nonstop, out, *, top_p=1.0, num_splits: int = 0) -> None:
    load_cuda_extension().decode_signals_cuda(logits, float(temperature), rng_keys, chosen, nonstop, *out,
                                              num_splits, top_p=float(top_p))


def token_signals(logits, chosen, temperature, out):
    """(entropy, logprob, argmax) of softmax(logits / temperature) on top of the fused kernel."""
    B, dev = logits.shape[0], logits.device
    if out is None:
        out = TokenSignals(torch.empty(B, device=dev), torch.empty(B, device=dev),
                           torch.empty(B, dtype=torch.int64, device=dev))
    prob = torch.empty(B, device=dev)
    load_cuda_extension().decode_signals_cuda(logits, float(temperature), None, None, None, out[2], out[0], out[1],
                                              prob, None, 0, greedy=True)
    if chosen is not None:  # ln p_c = ln p_argmax + y_c - y_argmax
        y_c = logits.gather(1, chosen[:, None])[:, 0].float() / temperature
        y_a = logits.gather(1, out[2][:, None])[:, 0].float() / temperature
        out[1].add_(y_c - y_a)
    return tuple(out)


def causal_attn_colmax(q, k, lengths, scale, out):
    if out is None:
        out = torch.empty(q.shape[0], q.shape[2], dtype=torch.float32, device=q.device)
    load_cuda_extension().causal_attn_stats_cuda(q, k, lengths, float(scale), out, None, None)
    return out


def causal_attn_mean_rows(q, k, lengths, scale, out):
    B, T = q.shape[0], q.shape[2]
    if out is None:
        out = torch.empty(B, T, T, dtype=torch.float32, device=q.device)
    rows = torch.arange(T, device=q.device).expand(B, T).contiguous()
    load_cuda_extension().causal_attn_stats_cuda(q, k, lengths, float(scale), None, rows, out)
    return out


def causal_attn_rows(q, k, lengths, scale, rows, out) -> None:
    load_cuda_extension().causal_attn_stats_cuda(q, k, lengths, float(scale), None, rows, out)


def attn_decode_update(q, k_cache, block_tables, ctx_lens, span_start, lse, block_size, scale, amax,
                       row_out) -> None:
    load_cuda_extension().attn_decode_update_cuda(q, k_cache, block_tables, ctx_lens, span_start, lse,
                                                  int(block_size), float(scale), amax, row_out)
