"""Which attention backends a model runs: every FASTRAG_* attention switch (parsed by fastrag.settings) resolved.

`resolve_backends()` reads them all once (when a model is built) into a frozen `AttentionBackends`; the forward asks
that object, never the environment. The per-switch readers stay public so a setting can be checked on its own (a
bad value is an error naming the variable). $FASTRAG_SDPA is the exception that is read per backend scope
(`sdpa_backends`): the masked SDPA calls outside a model (fastrag.parity) follow it too, and a change between two
forwards of one model takes effect, as it always has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastrag.settings import setting

DECODE_ATTENTION_ENV = "FASTRAG_DECODE_ATTENTION"  # native (default) | triton | torch
PAGED_PREFILL_ENV = "FASTRAG_PAGED_PREFILL"  # auto (default: CUDA tensors) | 1 (CPU too, interpreted) | 0
PREFILL_GQA_ENV = "FASTRAG_PREFILL_GQA"  # auto (default: expand for CUDA tensors, native elsewhere) | native | expand
SDPA_ENV = "FASTRAG_SDPA"  # flash,efficient,math (default) | any comma list of flash, efficient, cudnn, math | torch
FUSED_DECODE_ENV = "FASTRAG_FUSED_DECODE"  # auto (default: on for CUDA tensors) | 1 | 0
PREFIX_FLASH_ENV = "FASTRAG_PREFIX_FLASH"  # 1: shared prefixes through fd.prefix_flash_decode | 0 (default)
FUSED_PREFILL_ENV = "FASTRAG_FUSED_PREFILL"  # auto (default: wherever the decode step's fused kernels run) | 0
CASCADE_PREFILL_ENV = "FASTRAG_CASCADE_PREFILL"  # auto (default: wherever the self-check passes) | 0

SDPA_NAMES = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
              "math": "MATH"}


class ModuleRef:
    """A module's functions as attributes, copied and pickled by reference (a model that holds a module itself
    cannot be deep-copied or sent to another process)."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        if name == "_module":  # not set yet (during unpickling)
            raise AttributeError(name)
        return getattr(self._module, name)

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return import_module_ref, (self._module.__name__,)


def import_module_ref(name: str) -> ModuleRef:
    import importlib

    return ModuleRef(importlib.import_module(name))


def decode_attention_mode() -> str:
    return setting(DECODE_ATTENTION_ENV)


def native_decode_attention(mode: str | None = None):
    """The C++ paged decode attention (csrc/paged_attn_cpu.cpp) when the extension is built, else None.
    FASTRAG_DECODE_ATTENTION=torch forces the pure-torch cascade path (and =triton the Triton kernel).
    mode: that setting, already read (None: read it)."""
    if (decode_attention_mode() if mode is None else mode) != "native":
        return None
    try:
        import fastrag._C  # noqa: F401  (registers torch.ops.fastrag.*)

        return torch.ops.fastrag.paged_decode_attention_lse
    except (ImportError, AttributeError, RuntimeError):
        return None


def triton_decode_attention(mode: str | None = None):
    """(op, runs on CPU tensors) of the Triton paged decode attention (kernels/paged_attention.py), or (None, False).

    Used for CUDA tensors unless FASTRAG_DECODE_ATTENTION=torch; with =triton also for CPU tensors when the kernels
    were imported under TRITON_INTERPRET=1 (how CI runs this path without a GPU)."""
    mode = decode_attention_mode() if mode is None else mode
    if mode == "torch" or (mode == "native" and not torch.cuda.is_available()):
        return None, False  # nothing for Triton to run here (and no triton import on CPU-only machines)
    try:
        from fastrag.kernels import INTERPRETED
        from fastrag.kernels.paged_attention import paged_decode_attention_lse
    except ImportError:
        return None, False
    return paged_decode_attention_lse, mode == "triton" and INTERPRETED


def paged_prefill_attention():
    """(op, runs on CPU tensors) of the Triton paged prefill attention (kernels/paged_prefill.py), or (None, False).

    A packed prefill's attention through that kernel is one launch per layer over all the call's new tokens, their
    prefixes and their own paged context read in place, instead of the attention buckets of torch calls
    (fastrag/model/attention/packed.py), wherever its self-check passes (`LlamaModel.uses_paged_prefill`).
    $FASTRAG_PAGED_PREFILL: auto (the default) for CUDA tensors wherever Triton imports; 1 for CUDA tensors, and for
    CPU tensors when the kernels were imported under TRITON_INTERPRET=1 (how CI runs it without a GPU), an error
    where Triton does not import; 0 never. A prefill call through the kernel costs less device time than through
    the buckets, most for the short calls that are most of a DRAGIN run's (benchmarks/results/)."""
    on = setting(PAGED_PREFILL_ENV)
    if on == "auto":
        try:
            from fastrag.kernels import paged_prefill
        except ImportError:  # (no Triton: the buckets)
            return None, False
        return ModuleRef(paged_prefill), False
    if not on:
        return None, False
    try:
        from fastrag.kernels import INTERPRETED
        from fastrag.kernels import paged_prefill
    except ImportError as e:
        raise RuntimeError(f"${PAGED_PREFILL_ENV}=1 but the Triton kernels do not import: {e}") from e
    return ModuleRef(paged_prefill), INTERPRETED


def prefill_gqa_mode() -> str:
    """How the masked attention of prefills and attention passes meets grouped-query heads (fewer kv heads than
    query heads, e.g. SmolLM2's 9 / 3). native: one SDPA call with enable_gqa. expand: the keys and values are
    repeated to every query head first. torch's fused CUDA kernels take either an explicit mask (memory-efficient
    attention) or grouped heads (flash), not both in torch <= 2.13, so a masked GQA call may fall back to the
    math kernel there; benchmarks/bench_prefill_attention.py times both forms and lists the backends that accept
    each (benchmarks/results/prefill_attention_*.md: expand is the faster form on a GPU, native on a CPU).
    auto (the default): expand for CUDA tensors, native elsewhere. Models without grouped heads (Llama-2-7B) are
    unaffected."""
    return setting(PREFILL_GQA_ENV)


_sdpa_cache: dict[str | tuple, list | None] = {}


def sdpa_backends() -> list | None:
    """The SDPA backends the masked attention of prefills and attention passes may use ($FASTRAG_SDPA), or None for
    torch's own choice ("torch"). A CPU has flash and math, the two it uses anyway.

    The default leaves cuDNN out. torch builds a cuDNN attention graph for every new set of shapes (tens of
    milliseconds each in public measurements), its CUDA 13 builds try cuDNN first on Hopper, and no two prefill
    calls or attention passes of a run have the same shapes: with torch's choice the host's time per SDPA call
    dominated a GPU prefill (benchmarks/results/gpu_h200_*.md); benchmarks/bench_prefill.py times both settings
    side by side.

    The cascade prefill (`lse_attention`) calls its kernels itself (flash and memory-efficient on CUDA, flash on the
    CPU), never cuDNN: this setting governs the masked calls, i.e. prefills without a shared prefix or with the
    cascade off, and the attention passes."""
    mode = setting(SDPA_ENV)  # "torch" or a tuple of SDPA_NAMES' keys
    if mode in _sdpa_cache:
        return _sdpa_cache[mode]
    if mode == "torch":
        backends = None
    else:
        names = mode
        from torch.nn.attention import SDPBackend

        backends = [getattr(SDPBackend, SDPA_NAMES[n]) for n in names if hasattr(SDPBackend, SDPA_NAMES[n])]
    _sdpa_cache[mode] = backends
    return backends


def fused_decode_ops():
    """(kernels/fused_decode.py, runs on CPU tensors) or (None, False): the decode step's per-layer small operations
    (residual add + RMSNorm, rotary embedding + KV write, SiLU-gated product) as 4 Triton launches per layer, and a
    shared prefix's softmax and log-sum-exp merge as 2 (its two GEMMs stay torch.matmul).

    auto: used for CUDA tensors when Triton imports. 1: also for CPU tensors when fastrag.kernels was imported under
    TRITON_INTERPRET=1 (how CI runs this path without a GPU). 0: torch's separate operations everywhere."""
    mode = setting(FUSED_DECODE_ENV)
    if mode == "0" or (mode == "auto" and not torch.cuda.is_available()):
        return None, False
    try:
        from fastrag.kernels import INTERPRETED
        from fastrag.kernels import fused_decode
    except ImportError as e:
        if mode == "1":
            raise RuntimeError(f"${FUSED_DECODE_ENV}=1 but the Triton kernels do not import: {e}") from e
        return None, False
    return ModuleRef(fused_decode), mode == "1" and INTERPRETED


def prefix_flash_mode() -> bool:
    """$FASTRAG_PREFIX_FLASH as a switch (off unless 1): the decode step's shared prefixes in one flash-decoding
    launch a layer (kernels/fused_decode.py prefix_flash_decode) instead of a GEMM, softmax, GEMM and merge per
    prefix over every row. Off by default until a GPU has timed both (bench_decode --prefixes)."""
    return setting(PREFIX_FLASH_ENV)


def fused_prefill_mode() -> str:
    """The prefill's and the attention passes' per-layer small operations (residual add + RMSNorm, rotary embedding
    with the KV write, SiLU-gated product) through the decode step's fused kernels: one launch each over all the
    call's tokens instead of torch's ~30 separate kernels a layer. A prefill of a few hundred tokens is bound by
    those launches on a GPU (benchmarks/results/prefill_gpu_h200_*.md). auto: wherever $FASTRAG_FUSED_DECODE puts
    the decode step's; 0: torch's operations in prefills."""
    return setting(FUSED_PREFILL_ENV)


def cascade_prefill_mode() -> str:
    """How a prefill's new tokens attend to the shared prefix (the demonstrations every sequence starts with).
    auto: as a cascade, the prefix once for all the call's tokens without a mask and each sequence's own context
    with its causal mask, the two merged by their log-sum-exp (fastrag/model/attention/cascade.py), wherever the
    attention kernels that return a log-sum-exp pass a self-check (run when an Engine is built, else on first use);
    0: one masked call per bucket over [prefix | context], the prefix keys copied for every sequence. That copy and
    the masked attention over the whole prefix are a large share of a prefill's device time on a GPU
    (benchmarks/results/prefill_gpu_h200_*.md)."""
    return setting(CASCADE_PREFILL_ENV)


@dataclass(frozen=True, slots=True)
class AttentionBackends:
    """The attention paths a model runs, chosen once when it is built (`resolve_backends`). A path's kernels are
    None where it is off; *_on_cpu: whether that path also serves CPU tensors (under TRITON_INTERPRET=1)."""
    native_decode: object = None  # C++ paged decode attention (float32 CPU tensors)
    triton_decode: object = None  # Triton paged decode attention
    triton_on_cpu: bool = False
    fused_decode: object = None  # kernels/fused_decode.py (a ModuleRef)
    fused_on_cpu: bool = False
    # every shared prefix of a decode step in one flash-decoding launch a layer (fd.prefix_flash_decode) where
    # the fused decode kernels run; off: a GEMM, softmax, GEMM and merge per prefix ($FASTRAG_PREFIX_FLASH)
    prefix_flash: bool = False
    fused_prefill: bool = True  # prefills through the fused small operations wherever the decode step has them
    expand_gqa: bool | None = None  # None: by device (LlamaModel.gqa_expand)
    cascade_prefill: bool = True  # the shared prefix of a prefill as a cascade, where its self-check passes
    paged_prefill: object = None  # kernels/paged_prefill.py (a ModuleRef)
    paged_prefill_on_cpu: bool = False


def resolve_backends() -> AttentionBackends:
    """Every attention switch of the environment, each read once, in the order a model has always read them (so
    the first bad setting is the one named)."""
    decode = decode_attention_mode()
    native = native_decode_attention(decode)
    triton, triton_on_cpu = triton_decode_attention(decode)
    fused, fused_on_cpu = fused_decode_ops()
    flash = prefix_flash_mode()
    fused_prefill = fused_prefill_mode() == "auto"
    gqa = prefill_gqa_mode()
    cascade = cascade_prefill_mode() == "auto"
    paged, paged_on_cpu = paged_prefill_attention()
    return AttentionBackends(native_decode=native, triton_decode=triton, triton_on_cpu=triton_on_cpu,
                             fused_decode=fused, fused_on_cpu=fused_on_cpu, prefix_flash=flash,
                             fused_prefill=fused_prefill, expand_gqa=None if gqa == "auto" else gqa == "expand",
                             cascade_prefill=cascade, paged_prefill=paged, paged_prefill_on_cpu=paged_on_cpu)
