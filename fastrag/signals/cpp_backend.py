"""C++ CPU backend: thin launchers over the `fastrag._C` extension (csrc/signals_cpu.cpp).

The prefill attention kernels (colmax, rows) are float32: q/k are upcast here. The decode kernels
(decode_signals, attn_decode_update) read fp32/bf16/fp16 directly.
"""

from __future__ import annotations

import torch



def load_extension():
    """Import `fastrag._C`, or raise ImportError saying how to build it."""
    try:
        from fastrag import _C
    except ImportError as e:
        raise ImportError(
            f"the C++ extension fastrag._C is not built ({e}); build it with "
            "`pip install --no-build-isolation -e .` from the repository root"
        ) from e
    return _C


def token_signals(logits: torch.Tensor, chosen: torch.Tensor | None = None, temperature: float = 1.0,
                  out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as torch_backend.token_signals; writes into `out` = (entropy, logprob, argmax) if given."""
    outs = (None, None, None) if out is None else out
    return tuple(load_extension().token_signals(logits, chosen, float(temperature), *outs))


def causal_attn_colmax(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as torch_backend.causal_attn_colmax; writes into `out` [B, T] f32 if given."""
    return load_extension().causal_attn_colmax(q.float(), k.float(), lengths, float(scale), out)


def decode_signals(logits, temperature, rng_keys, chosen, nonstop, out, *, top_p=1.0) -> None:
    """Fused decode-step signals (reference.decode_signals_ref) into `out` (DecodeSignals of [B] buffers)."""
    load_extension().decode_signals(logits, float(temperature), rng_keys, chosen, nonstop, *out, top_p=float(top_p))


def attn_decode_update(q, k_cache, block_tables, ctx_lens, span_start, lse, block_size, scale, amax,
                       row_out) -> None:
    """Running attention max over the generated span (+ QFS row), in place; the kernel reads q/k in their dtype."""
    load_extension().attn_decode_update(q, k_cache, block_tables, ctx_lens, span_start, lse, int(block_size),
                                        float(scale), amax, row_out)


def causal_attn_rows(q, k, lengths, scale, rows, out) -> None:
    """Head-mean causal attention of the selected rows into out [B, R, T] (float32 kernel: q/k upcast)."""
    load_extension().causal_attn_rows(q.float(), k.float(), lengths, rows, float(scale), out)


def causal_attn_mean_rows(q, k, lengths, scale, out=None):
    """All rows: M [B, T, T] f32 (the C++ rows kernel with rows = 0..T-1)."""
    B, T = q.shape[0], q.shape[2]
    rows = torch.arange(T).expand(B, T)
    return load_extension().causal_attn_rows(q.float(), k.float(), lengths, rows, float(scale), out)
