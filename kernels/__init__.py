"""Triton kernels, installed as `fastrag.kernels` (one op per module): the retrieval signals (token_signals,
attn_stats; definitions: fastrag.signals.reference), the model's paged decode attention on CUDA
(paged_attention), the decode step's fused small operations (fused_decode) and the packed prefill's paged attention
(paged_prefill; $FASTRAG_PAGED_PREFILL, the default for CUDA tensors); `compiles` records Triton's compiles of them
in a run.

Triton decides at decoration time whether a kernel is compiled for the GPU or run by its interpreter
(TRITON_INTERPRET=1, numpy on the CPU), so `INTERPRETED` records which mode these modules were imported in.
"""

from __future__ import annotations

from triton import knobs as _knobs

INTERPRETED: bool = bool(_knobs.runtime.interpret)
