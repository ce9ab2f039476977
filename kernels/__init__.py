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


def rows_per_program(n_rows: int) -> int:
    """Rows a program of the row-tiled kernels takes: fused_decode's row-wise kernels (add_rms_norm, rope_write_kv,
    silu_mul) and shared-prefix softmax and merge (prefix_softmax, prefix_merge), and attn_stats' prefill rows
    kernels (_causal_row_lse_kernel, _causal_rows_kernel).

    Compiled for a GPU, 1: a program per row (and per head, column or key block), the launch every GPU session
    measured. Under the interpreter, whose cost is per program and per operation rather than per element, n_rows
    rounded up to a power of two, at most 64: on a CPU an interpreted kernel's time falls by an order of magnitude or
    more from 1 row a program to 64 (benchmarks/gpu/NOTES.md). No sum runs across rows, so the values do not depend
    on it (tests/test_fused_decode.py and tests/test_kernels.py compare 1, 4, 16 and 64 bit for bit)."""
    return min(64, triton.next_power_of_2(max(n_rows, 1))) if INTERPRETED else 1


def rows_arg(rows: int | None, n_rows: int, name: str = "rows") -> int:
    """A launcher's rows-a-program argument: rows_per_program(n_rows) when None, else a checked power of two."""
    rows = rows_per_program(n_rows) if rows is None else rows
    if rows < 1 or rows & (rows - 1):
        raise ValueError(f"{name}: expected a power of two >= 1 (rows per program), got {rows}")
    return rows
