"""C++ CPU backend: thin launchers over the `fastrag._C` extension (csrc/signals_cpu.cpp).

`causal_attn_mean_rows` has no C++ kernel (it runs once per retrieval, not per decode step) and uses the torch
implementation. q/k are upcast to float32 here because the C++ attention kernel is float32 only.
"""

from __future__ import annotations

import torch

from fastrag.signals import torch_backend


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


causal_attn_mean_rows = torch_backend.causal_attn_mean_rows
