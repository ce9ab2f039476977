"""The attention paths of fastrag.model.llama, one module each, chosen once when a model is built.

`select.resolve_backends()` reads every switch below from the environment into a frozen `AttentionBackends`
(`LlamaModel.backends`); the forward asks that object, never the environment. A bad value is a ValueError naming
the variable. Paths that need a self-check run it once per device and dtype (`checks.py`) and fall back to torch,
with a warning, where it fails.

Modules and when each runs:

- batch.py: `AttnBatch`, `PrefixGroup`, `CascadeMask` and the mask / pool helpers every path shares.
- attend.py: the unfused forward's per-layer attention. Decode steps go to a paged kernel (paged_native.py) where one
  serves the device, else to a torch cascade (the shared prefix once for the batch, merged by log-sum-exp);
  prefills attend through cascade.py or one masked SDPA call.
- paged_native.py: decode attention with each sequence's keys read in place: the C++ kernel (csrc/paged_attn_cpu.cpp)
  for float32 CPU tensors when the extension is built; the Triton kernel (kernels/paged_attention.py) for CUDA
  tensors, and for CPU tensors under TRITON_INTERPRET=1 with FASTRAG_DECODE_ATTENTION=triton.
  Switch: FASTRAG_DECODE_ATTENTION = native (default) | triton | torch (torch: the torch cascade everywhere).
- torch_sdpa.py: torch's SDPA for the masked calls (prefills without the cascade, attention passes), restricted to
  the backends of FASTRAG_SDPA = flash,efficient,math (default) | a comma list of flash, efficient, cudnn, math |
  torch (torch's own choice); read per forward's backend scope, not at build. `lse_attention`: torch's fused
  kernels that return a log-sum-exp (the cascade's). Grouped-query heads: FASTRAG_PREFILL_GQA = auto (default:
  keys repeated to every head on CUDA, one grouped SDPA call elsewhere) | native | expand.
- cascade.py: a prefill's shared prefix attended once for all its tokens and merged with each sequence's own context
  by log-sum-exp. Switch: FASTRAG_CASCADE_PREFILL = auto (default: where its self-check passes) | 0.
- paged_triton.py: the Triton paged prefill kernel (kernels/paged_prefill.py), one launch a layer for a packed
  prefill or an attention pass, where its self-check passes. Switch: FASTRAG_PAGED_PREFILL = auto (default: CUDA
  tensors where Triton imports) | 1 (CPU tensors too under TRITON_INTERPRET=1; an error without Triton) | 0.
- fused_decode.py: the per-layer small operations as fused Triton kernels (kernels/fused_decode.py). Switches:
  FASTRAG_FUSED_DECODE = auto (default: CUDA tensors where Triton imports) | 1 (CPU tensors too, interpreted) | 0;
  FASTRAG_FUSED_PREFILL = auto (default: prefills and passes too, wherever the decode step has them) | 0;
  FASTRAG_PREFIX_FLASH = 1 | 0 (default): a decode step's shared prefixes in one flash-decoding launch a layer.
- packed.py: the packed prefill (real tokens only): the paged prefill kernel where it runs, else attention buckets
  of sequences of one prefix and similar lengths.
- checks.py: the self-check bookkeeping; select.py: the switches and `AttentionBackends`.
"""
