"""Retrieval signals (docs/architecture.md "Signals"): token entropy/logprob/argmax, last-layer attention column max,
QFS attention rows, and the non-stopword vocabulary table.

A backend is chosen once, at construction: `get_backend("auto" | "cuda" | "triton" | "cpp" | "torch")`, default
from the environment variable FASTRAG_SIGNALS_BACKEND, else "auto": per device type, the first that runs there of
cuda > triton > torch (CUDA tensors), torch elsewhere (the C++ CPU path `cpp` is opt-in on the CPU: it agrees with
torch to float32 rounding, and the CPU parity figures were measured with torch). Every backend's methods validate
their arguments in the same place (fastrag.signals.checks, ValueError naming the argument) and then call the
backend's kernels. A factory raises ImportError or RuntimeError when its backend cannot run here, which
get_backend reports as BackendUnavailableError.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from fastrag.signals import checks
from fastrag.signals.vocab import build_nonstop_table

ENV_VAR = "FASTRAG_SIGNALS_BACKEND"
DEFAULT_BACKEND = "auto"


class TokenSignals(NamedTuple):
    entropy: torch.Tensor  # [B] f32, -sum p ln p of softmax(logits / temperature)
    logprob: torch.Tensor  # [B] f32, ln p of the chosen token (argmax when none was given)
    argmax: torch.Tensor  # [B] i64, lowest index of the largest logit


class DecodeSignals(NamedTuple):
    """The per-token signals of one decode step (reference.decode_signals_ref); every field is [B] on the device."""

    chosen: torch.Tensor  # i64, the decoded token: greedy argmax, Gumbel-max sample, or the caller's `chosen`
    entropy: torch.Tensor  # f32, -sum p ln p of p = softmax(logits / T) (T = 1 when greedy; restricted to the
    #                        top-p nucleus when sampling with top_p < 1): DRAGIN's H_i
    logprob: torch.Tensor  # f32, ln p_chosen
    prob: torch.Tensor  # f32, p_chosen = exp(logprob): FLARE's token probability
    nonstop: torch.Tensor | None  # bool, nonstop[chosen] (DRAGIN's s_i); None when no table was given


# Kernel signatures a backend provides (arguments already validated; `out` may be None).
TokenSignalsFn = Callable[[torch.Tensor, "torch.Tensor | None", float, "TokenSignals | None"], tuple]
AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, "torch.Tensor | None"], torch.Tensor]
# (logits, temperature, rng_keys, chosen, nonstop, out: DecodeSignals, *, top_p) -> None, writes every field of out
DecodeFn = Callable[..., None]
# (q, k_cache, block_tables, ctx_lens, span_start, lse, block_size, scale, amax, row_out) -> None, in place
AttnDecodeFn = Callable[..., None]
# (q, k, lengths, scale, rows, out) -> None, writes out [B, R, T]
AttnRowsFn = Callable[..., None]


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
    decode_signals_fn: DecodeFn
    attn_decode_update_fn: AttnDecodeFn
    causal_attn_rows_fn: AttnRowsFn

    def token_signals(self, logits: torch.Tensor, chosen: torch.Tensor | None = None, temperature: float = 1.0,
                      *, out: TokenSignals | tuple | None = None) -> TokenSignals:
        """entropy, logprob, argmax of p = softmax(logits [B, V] / temperature); see reference.token_signals_ref.

        chosen: [B] int64 (None: the argmax). out: optional (entropy [B] f32, logprob [B] f32, argmax [B] i64).
        """
        checks.check_token_signals(logits, chosen, temperature, self.devices)
        if out is not None:
            checks.check_out_tuple(out, "out", TokenSignals._fields)
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


    def decode_signals(self, logits: torch.Tensor, *, temperature: float = 0.0,
                       rng_keys: torch.Tensor | None = None, chosen: torch.Tensor | None = None,
                       nonstop: torch.Tensor | None = None, out: DecodeSignals | tuple | None = None,
                       top_p: float = 1.0, top_k: int = 0) -> DecodeSignals:
        """All token signals of a decode step from logits [B, V] in one pass (reference.decode_signals_ref).

        temperature 0: greedy argmax, entropy of softmax(logits); > 0: Gumbel-max draw from softmax(logits / T)
        keyed by rng_keys [B] int64 (same keys, same logits -> same token on every backend). top_p < 1 (with
        temperature > 0): nucleus sampling, the distribution (and so entropy/logprob) restricted to the smallest
        set of most likely tokens holding top_p of the mass, ties kept (the kernels' nucleus path reads a row ten
        times). 0 < top_k < V (with temperature > 0): logits below each row's k-th largest are masked first (ties
        kept), as transformers' top-k warper does before top-p; the mask is one torch op ahead of the backend's
        kernel, which reads masked logits like any others. chosen [B] int64 skips the choice. nonstop [V] bool: the non-stopword table (build_nonstop_table).
        out: optional buffers (chosen [B] i64, entropy, logprob, prob [B] f32, nonstop [B] bool or None), written
        in place.
        """
        checks.check_decode_signals(logits, temperature, rng_keys, chosen, nonstop, self.devices, top_p, top_k)
        B, dev = logits.shape[0], logits.device
        top_k = int(top_k)  # (a numpy integer too)
        if temperature > 0 and 0 < top_k < logits.shape[1]:
            from fastrag.signals.torch_backend import top_k_filter

            logits = top_k_filter(logits, top_k)
        if out is None:
            f32 = dict(dtype=torch.float32, device=dev)
            out = DecodeSignals(torch.empty(B, dtype=torch.int64, device=dev), torch.empty(B, **f32),
                                torch.empty(B, **f32), torch.empty(B, **f32),
                                None if nonstop is None else torch.empty(B, dtype=torch.bool, device=dev))
        else:
            if nonstop is None and isinstance(out, (tuple, list)) and len(out) == 4:
                out = (*out, None)  # (no table: no flag buffer)
            checks.check_out_tuple(out, "out", DecodeSignals._fields)
            out = DecodeSignals(*out)
            for buf, name, dtype in zip(out[:4], ("out.chosen", "out.entropy", "out.logprob", "out.prob"),
                                        (torch.int64, torch.float32, torch.float32, torch.float32)):
                checks.check_out(buf, name, (B,), dtype, dev)
            if nonstop is not None:
                checks.check_out(out.nonstop, "out.nonstop", (B,), torch.bool, dev)
            elif out.nonstop is not None:
                raise ValueError("out.nonstop was given but no nonstop table: pass nonstop= or out.nonstop=None")
        self.decode_signals_fn(logits, float(temperature), rng_keys, chosen, nonstop, out, top_p=float(top_p))
        return out

    def attn_decode_update(self, q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                           ctx_lens: torch.Tensor, span_start: torch.Tensor, lse: torch.Tensor, block_size: int,
                           scale: float, amax: torch.Tensor, *, want_row: bool = False,
                           row_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Fold one decode step's last-layer attention into the running per-head max (reference.attn_decode_update_ref).

        q [B, H, D] new queries; k_cache [Hkv, num_slots, D] the last layer's paged keys; block_tables [B, NB]
        (int32/int64) pool blocks of each sequence in order; ctx_lens [B] i64 keys attended (the new one
        included); span_start [B] i64 position of the first generated key; lse [B, H] f32 row log-sum-exp of the
        main attention (natural log); amax [B, H, S] f32 updated in place. With want_row (or row_out [B, NB*bs]
        f32) also the QFS row: mean over heads of this query's attention over all its keys.
        """
        if want_row and row_out is None:
            row_out = torch.empty(q.shape[0], block_tables.shape[1] * block_size, dtype=torch.float32,
                                  device=q.device)
        checks.check_attn_decode(q, k_cache, block_tables, ctx_lens, span_start, lse, block_size, scale, amax,
                                 row_out, self.devices)
        self.attn_decode_update_fn(q, k_cache, block_tables, ctx_lens, span_start, lse, int(block_size),
                                   float(scale), amax, row_out)
        return amax, row_out

    def causal_attn_rows(self, q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float,
                         rows: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """R [B, Rn, T] f32: head-mean causal attention of the query rows `rows` [B, Rn] i64 (QFS rows of a
        prefill pass; a row outside [0, lengths[b]) is all zeros); q [B,H,T,D], k [B,Hkv,T,D]."""
        checks.check_attention(q, k, lengths, scale, self.devices)
        checks.check_rows(rows, q, out, self.devices)
        if out is None:
            out = torch.empty(q.shape[0], rows.shape[1], q.shape[2], dtype=torch.float32, device=q.device)
        self.causal_attn_rows_fn(q, k, lengths, float(scale), rows, out)
        return out


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
        decode_signals_fn=_torch_decode,
        attn_decode_update_fn=tb.attn_decode_update,
        causal_attn_rows_fn=lambda q, k, n, s, r, out: out.copy_(tb.causal_attn_rows(q, k, n, s, r)),
    )


def _torch_decode(logits, temperature, rng_keys, chosen, nonstop, out, *, top_p=1.0):
    from fastrag.signals import torch_backend as tb

    for o, r in zip(out, tb.decode_signals(logits, temperature, rng_keys, chosen, nonstop, top_p)):
        if o is not None:
            o.copy_(r)


# The kernel entry points a backend module defines under these names, each with the contract of SignalBackend's
# field of the same name and `_fn`.
_ENTRY_POINTS = ("token_signals", "causal_attn_colmax", "causal_attn_mean_rows", "decode_signals",
                 "attn_decode_update", "causal_attn_rows")


def _of_module(name: str, devices, module) -> SignalBackend:
    return SignalBackend(name=name, devices=frozenset(devices),
                         **{f"{entry}_fn": getattr(module, entry) for entry in _ENTRY_POINTS})


def _make_cpp() -> SignalBackend:
    from fastrag.signals import cpp_backend as cb

    cb.load_extension()  # fail at construction, not at the first decode step
    return _of_module("cpp", {"cpu"}, cb)


def _make_triton() -> SignalBackend:
    from fastrag.signals import triton_backend as trb

    return _of_module("triton", trb.devices(), trb)  # devices() raises RuntimeError without a GPU or the interpreter


def _make_cuda() -> SignalBackend:
    from fastrag.signals import cuda_backend as cu

    cu.load_cuda_extension()  # raises ImportError/RuntimeError without a CUDA build of fastrag._C or a GPU
    return _of_module("cuda", {"cuda"}, cu)


# Preference order of the "auto" backend for CUDA tensors (issue 3: cuda > triton > torch).
AUTO_ORDER_CUDA = ("cuda", "triton", "torch")


def _make_auto() -> SignalBackend:
    """Resolve once, per device type, which backend runs tensors there; the methods dispatch on the inputs'
    device type (a dict lookup), so a CPU engine on a GPU machine still gets a CPU backend."""
    table: dict[str, SignalBackend] = {}
    torch_be = _make_torch()
    if torch.cuda.is_available():
        for name in AUTO_ORDER_CUDA:
            try:
                be = _FACTORIES[name]()
            except (ImportError, RuntimeError):
                continue
            if "cuda" in be.devices:
                table["cuda"] = be
                break

    def pick(x: torch.Tensor) -> SignalBackend:
        return table.get(x.device.type, torch_be)

    chosen = ",".join(f"{d}={b.name}" for d, b in sorted(table.items())) or "cuda=none"
    return SignalBackend(
        name=f"auto({chosen},other=torch)",
        devices=torch_be.devices,
        token_signals_fn=lambda x, *a: pick(x).token_signals_fn(x, *a),
        causal_attn_colmax_fn=lambda q, *a: pick(q).causal_attn_colmax_fn(q, *a),
        causal_attn_mean_rows_fn=lambda q, *a: pick(q).causal_attn_mean_rows_fn(q, *a),
        decode_signals_fn=lambda x, *a, **kw: pick(x).decode_signals_fn(x, *a, **kw),
        attn_decode_update_fn=lambda q, *a: pick(q).attn_decode_update_fn(q, *a),
        causal_attn_rows_fn=lambda q, *a: pick(q).causal_attn_rows_fn(q, *a),
    )


_FACTORIES: dict[str, Callable[[], SignalBackend]] = {
    "auto": _make_auto, "cuda": _make_cuda, "triton": _make_triton, "cpp": _make_cpp, "torch": _make_torch,
}


def register_backend(name: str, factory: Callable[[], SignalBackend]) -> None:
    """Add a backend (e.g. "triton", "cuda"); `factory` raises ImportError/RuntimeError when it cannot run here."""
    _FACTORIES[name] = factory


def registered_backends() -> list[str]:
    return sorted(_FACTORIES)


def get_backend(name: str | None = None) -> SignalBackend:
    """The named backend; None: $FASTRAG_SIGNALS_BACKEND, else "auto". Unknown name -> ValueError;
    known but not runnable here -> BackendUnavailableError."""
    source = "argument name"
    if name is None:
        from fastrag.settings import setting

        name = setting(ENV_VAR)
        source = f"${ENV_VAR}" if name is not None else "default"
        name = name or DEFAULT_BACKEND
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown signals backend {name!r} (from {source}); registered: {registered_backends()}")
    try:
        return factory()
    except (ImportError, RuntimeError) as e:
        raise BackendUnavailableError(f"signals backend {name!r} is not available: {e}") from e


__all__ = [
    "BackendUnavailableError", "DecodeSignals", "SignalBackend", "TokenSignals", "build_nonstop_table", "get_backend",
    "register_backend", "registered_backends",
]
