"""Triton kernels of the retrieval signals, installed as `fastrag.kernels` (one op per module:
token_signals, attn_stats). Definitions: fastrag.signals.reference.

Triton decides at decoration time whether a kernel is compiled for the GPU or run by its interpreter
(TRITON_INTERPRET=1, numpy on the CPU), so `INTERPRETED` records which mode these modules were imported in.
"""

from __future__ import annotations

from triton import knobs as _knobs

INTERPRETED: bool = bool(_knobs.runtime.interpret)
