"""Triton kernels, installed as `fastrag.kernels` (one op per module): the retrieval signals (token_signals,
attn_stats; definitions: fastrag.signals.reference), the model's paged decode attention on CUDA
(paged_attention), the decode step's fused small operations (fused_decode) and the packed prefill's paged attention
(paged_prefill; $FASTRAG_PAGED_PREFILL, the default for CUDA tensors); `compiles` records Triton's compiles of them
in a run.

Triton decides at decoration time whether a kernel is compiled for the GPU or run by its interpreter
(TRITON_INTERPRET=1, numpy on the CPU), so `INTERPRETED` records which mode these modules were imported in.
"""

from __future__ import annotations

import functools

import triton
from triton import knobs as _knobs

INTERPRETED: bool = bool(_knobs.runtime.interpret)


def device_function(fn):
    """`triton.jit` for a function that kernels call (a device function). Compiled, it is inlined into each kernel
    as Triton does. Under the interpreter, Triton 3.9 patches triton.language afresh at each call of a jit function
    from a running kernel (`InterpretedFunction.__call__`: `inspect.getmembers` over tl, tl.tensor and tl.math,
    a few milliseconds); a kernel launch has patched it already, so here a call goes straight to the function as the
    interpreter rewrites it (the same AST rewrite, made once). Triton's own jit functions (tl.sum, tl.max) still
    patch at each call. On a 2-core CPU VM tests/test_signals.py and tests/test_kernels.py took 467 s together
    (541 s before). A Triton without that rewrite method gets the plain jit function."""
    jitted = triton.jit(fn)
    rewrite = getattr(jitted, "rewrite", None) if INTERPRETED else None
    if rewrite is None:
        return jitted

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return rewrite()(*args, **kwargs)  # cached by Triton after the first call

    return call
