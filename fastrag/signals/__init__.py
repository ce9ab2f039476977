"""Retrieval signals (DESIGN.md "Signals"): token entropy/logprob/argmax, last-layer attention column max,
QFS attention rows, and the non-stopword vocabulary table.

A backend is chosen once, at construction: `get_backend("torch" | "cpp")`, default from the environment
variable FASTRAG_SIGNALS_BACKEND, else "torch". Every backend's methods validate their arguments in the same
place (fastrag.signals.checks, ValueError naming the argument) and then call the backend's kernels.
New backends (triton, cuda) register a factory with `register_backend`; a factory raises ImportError or
RuntimeError when its backend cannot run here, which get_backend reports as BackendUnavailableError.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from fastrag.signals import checks
from fastrag.signals.vocab import build_nonstop_table

ENV_VAR = "FASTRAG_SIGNALS_BACKEND"
DEFAULT_BACKEND = "torch"


class TokenSignals(NamedTuple):
    entropy: torch.Tensor  # [B] f32, -sum p ln p of softmax(logits / temperature)
    logprob: torch.Tensor  # [B] f32, ln p of the chosen token (argmax when none was given)
    argmax: torch.Tensor  # [B] i64, lowest index of the largest logit


# Kernel signatures a backend provides (arguments already validated; `out` may be None).
TokenSignalsFn = Callable[[torch.Tensor, "torch.Tensor | None", float, "TokenSignals | None"], tuple]
AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, "torch.Tensor | None"], torch.Tensor]


class BackendUnavailableError(RuntimeError):
    """A registered backend cannot run in this environment (extension not built, no GPU, no triton...)."""


@dataclass(frozen=True, slots=True)
class SignalBackend:
    """One implementation of the signal kernels; the methods validate, allocate nothing extra, and dispatch."""

    name: str
    devices: frozenset[str]  # device types its kernels accept, e.g. {"cpu"}
    token_signals_fn: TokenSignalsFn
    causal_attn_colmax_fn: AttnFn
    causal_attn_mean_rows_fn: AttnFn

    def token_signals(self, logits: torch.Tensor, chosen: torch.Tensor | None = None, temperature: float = 1.0,
                      *, out: TokenSignals | tuple | None = None) -> TokenSignals:
        """entropy, logprob, argmax of p = softmax(logits [B, V] / temperature); see reference.token_signals_ref.

        chosen: [B] int64 (None: the argmax). out: optional (entropy [B] f32, logprob [B] f32, argmax [B] i64).
        """
        checks.check_token_signals(logits, chosen, temperature, self.devices)
        if out is not None:
            B = logits.shape[0]
            for buf, name, dtype in zip(out, ("out.entropy", "out.logprob", "out.argmax"),
                                        (torch.float32, torch.float32, torch.int64)):
                checks.check_out(buf, name, (B,), dtype, logits.device)
            out = TokenSignals(*out)
        return TokenSignals(*self.token_signals_fn(logits, chosen, float(temperature), out))

    def causal_attn_colmax(self, q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float,
                           *, out: torch.Tensor | None = None) -> torch.Tensor:
        """a [B, T] f32: a[b, i] = mean_h max_{i <= j < n} A[h, j, i] (0 for i >= n); q [B,H,T,D], k [B,Hkv,T,D]."""
        checks.check_attention(q, k, lengths, scale, self.devices)
        if out is not None:
            checks.check_out(out, "out", (q.shape[0], q.shape[2]), torch.float32, q.device)
        return self.causal_attn_colmax_fn(q, k, lengths, float(scale), out)

    def causal_attn_mean_rows(self, q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float,
                              *, out: torch.Tensor | None = None) -> torch.Tensor:
        """M [B, T, T] f32: M[b, j, i] = mean_h A[h, j, i] for i <= j < n, else 0 (QFS attention rows)."""
        checks.check_attention(q, k, lengths, scale, self.devices)
        if out is not None:
            T = q.shape[2]
            checks.check_out(out, "out", (q.shape[0], T, T), torch.float32, q.device)
        return self.causal_attn_mean_rows_fn(q, k, lengths, float(scale), out)


def _copy_out(result, out):
    """Adapter for kernels that allocate their result: copy into the caller's `out` buffer(s) if given."""
    if out is None:
        return result
    if isinstance(result, torch.Tensor):
        return out.copy_(result)
    return tuple(o.copy_(r) for o, r in zip(out, result))


def _make_torch() -> SignalBackend:
    from fastrag.signals import torch_backend as tb

    return SignalBackend(
        name="torch",
        devices=frozenset({"cpu", "cuda", "mps", "xpu"}),
        token_signals_fn=lambda x, c, t, out: _copy_out(tb.token_signals(x, c, t), out),
        causal_attn_colmax_fn=lambda q, k, n, s, out: _copy_out(tb.causal_attn_colmax(q, k, n, s), out),
        causal_attn_mean_rows_fn=lambda q, k, n, s, out: _copy_out(tb.causal_attn_mean_rows(q, k, n, s), out),
    )


def _make_cpp() -> SignalBackend:
    from fastrag.signals import cpp_backend as cb

    cb.load_extension()  # fail at construction, not at the first decode step
    return SignalBackend(
        name="cpp",
        devices=frozenset({"cpu"}),
        token_signals_fn=cb.token_signals,
        causal_attn_colmax_fn=cb.causal_attn_colmax,
        causal_attn_mean_rows_fn=lambda q, k, n, s, out: _copy_out(cb.causal_attn_mean_rows(q, k, n, s), out),
    )


_FACTORIES: dict[str, Callable[[], SignalBackend]] = {"torch": _make_torch, "cpp": _make_cpp}


def register_backend(name: str, factory: Callable[[], SignalBackend]) -> None:
    """Add a backend (e.g. "triton", "cuda"); `factory` raises ImportError/RuntimeError when it cannot run here."""
    _FACTORIES[name] = factory


def registered_backends() -> list[str]:
    return sorted(_FACTORIES)


def get_backend(name: str | None = None) -> SignalBackend:
    """The named backend; None: $FASTRAG_SIGNALS_BACKEND, else "torch". Unknown name -> ValueError;
    known but not runnable here -> BackendUnavailableError."""
    source = "argument name"
    if name is None:
        name = os.environ.get(ENV_VAR) or DEFAULT_BACKEND
        source = f"${ENV_VAR}" if os.environ.get(ENV_VAR) else "default"
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown signals backend {name!r} (from {source}); registered: {registered_backends()}")
    try:
        return factory()
    except (ImportError, RuntimeError) as e:
        raise BackendUnavailableError(f"signals backend {name!r} is not available: {e}") from e


__all__ = [
    "BackendUnavailableError", "SignalBackend", "TokenSignals", "build_nonstop_table", "get_backend",
    "register_backend", "registered_backends",
]
