"""Llama-family decoder (Llama-2/3, Mistral, Qwen2-style q/k/v bias, SmolLM2) over a paged KV cache.

The forward works on a padded batch `[B, T]` of new tokens; each sequence's keys/values live in the paged pool
(`fastrag.cache.KVPool`) and are addressed by slots. Attention is split in two parts that are merged by their
log-sum-exp (cascade attention): the shared demo prefix, read once for the whole batch, and each sequence's own
suffix, gathered from its blocks. The last layer can hand back its queries and keys for the retrieval signals.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fastrag.model.linear import Linear
from fastrag.transfer import tensor_on, to_device


DECODE_ATTENTION_ENV = "FASTRAG_DECODE_ATTENTION"  # native (default) | triton | torch


def _decode_attention_mode() -> str:
    import os

    mode = os.environ.get(DECODE_ATTENTION_ENV, "native")
    if mode not in ("native", "triton", "torch"):
        raise ValueError(f"${DECODE_ATTENTION_ENV}={mode!r}: expected native, triton or torch")
    return mode


def _native_decode_attention():
    """The C++ paged decode attention (csrc/paged_attn_cpu.cpp) when the extension is built, else None.
    FASTRAG_DECODE_ATTENTION=torch forces the pure-torch cascade path (and =triton the Triton kernel)."""
    if _decode_attention_mode() != "native":
        return None
    try:
        import fastrag._C  # noqa: F401  (registers torch.ops.fastrag.*)

        return torch.ops.fastrag.paged_decode_attention_lse
    except (ImportError, AttributeError, RuntimeError):
        return None


def _triton_decode_attention():
    """(op, runs on CPU tensors) of the Triton paged decode attention (kernels/paged_attention.py), or (None, False).

    Used for CUDA tensors unless FASTRAG_DECODE_ATTENTION=torch; with =triton also for CPU tensors when the kernels
    were imported under TRITON_INTERPRET=1 (how CI runs this path without a GPU)."""
    mode = _decode_attention_mode()
    if mode == "torch" or (mode == "native" and not torch.cuda.is_available()):
        return None, False  # nothing for Triton to run here (and no triton import on CPU-only machines)
    try:
        from fastrag.kernels import INTERPRETED
        from fastrag.kernels.paged_attention import paged_decode_attention_lse
    except ImportError:
        return None, False
    return paged_decode_attention_lse, mode == "triton" and INTERPRETED


PAGED_PREFILL_ENV = "FASTRAG_PAGED_PREFILL"  # auto (default: CUDA tensors) | 1 (CPU too, interpreted) | 0


def _paged_prefill_attention():
    """(op, runs on CPU tensors) of the Triton paged prefill attention (kernels/paged_prefill.py), or (None, False).

    A packed prefill's attention through that kernel is one launch per layer over all the call's new tokens, their
    prefixes and their own paged context read in place, instead of the attention buckets of torch calls
    (`LlamaModel._attention_buckets`), wherever its self-check passes (`LlamaModel.uses_paged_prefill`).
    $FASTRAG_PAGED_PREFILL: auto (the default) for CUDA tensors wherever Triton imports; 1 for CUDA tensors, and for
    CPU tensors when the kernels were imported under TRITON_INTERPRET=1 (how CI runs it without a GPU), an error
    where Triton does not import; 0 never. On the H200 (2026-11-26d, 128 DRAGIN questions, Llama-2-7B shape) a
    prefill call took 17.5 ms of device time against 28.9 ms (median of the calls under 500 new tokens, most of a
    DRAGIN run's calls) and 100.0 against 114.0 ms (3,000 tokens and more) through the buckets
    (benchmarks/results/gpu_h200_2026-11-26d.md)."""
    import os

    from fastrag.switches import env_switch

    raw = os.environ.get(PAGED_PREFILL_ENV, "").strip().lower()
    if raw in ("", "auto"):
        try:
            from fastrag.kernels import paged_prefill
        except ImportError:  # (no Triton: the buckets)
            return None, False
        return _ModuleRef(paged_prefill), False
    try:
        on = env_switch(PAGED_PREFILL_ENV)
    except ValueError:
        raise ValueError(f"${PAGED_PREFILL_ENV}={os.environ[PAGED_PREFILL_ENV]!r}: expected auto, 1 or 0") from None
    if not on:
        return None, False
    try:
        from fastrag.kernels import INTERPRETED
        from fastrag.kernels import paged_prefill
    except ImportError as e:
        raise RuntimeError(f"${PAGED_PREFILL_ENV}=1 but the Triton kernels do not import: {e}") from e
    return _ModuleRef(paged_prefill), INTERPRETED


PREFILL_GQA_ENV = "FASTRAG_PREFILL_GQA"  # auto (default: expand for CUDA tensors, native elsewhere) | native | expand


def _prefill_gqa_mode() -> str:
    """How the masked attention of prefills and attention passes meets grouped-query heads (fewer kv heads than
    query heads, e.g. SmolLM2's 9 / 3). native: one SDPA call with enable_gqa. expand: the keys and values are
    repeated to every query head first. torch's fused CUDA kernels take either an explicit mask (memory-efficient
    attention) or grouped heads (flash), not both in torch <= 2.13, so a masked GQA call may fall back to the
    math kernel there; benchmarks/bench_prefill_attention.py times both forms and lists the backends that accept
    each. On the H200 (2026-11-26, the engine's SDPA backends) native took 2.3-5.6x expand's time for
    SmolLM2's and Llama-3-8B's heads; on the 2-core CPU native took 0.6-1.0x expand's
    (benchmarks/results/prefill_attention_{gpu_h200_2026-11-26,cpu}.md). auto (the default): expand for CUDA
    tensors, native elsewhere. Models without grouped heads (Llama-2-7B) are unaffected."""
    import os

    mode = os.environ.get(PREFILL_GQA_ENV, "auto")
    if mode not in ("auto", "native", "expand"):
        raise ValueError(f"${PREFILL_GQA_ENV}={mode!r}: expected auto, native or expand")
    return mode


SDPA_ENV = "FASTRAG_SDPA"  # flash,efficient,math (default) | any comma list of flash, efficient, cudnn, math | torch
SDPA_NAMES = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
              "math": "MATH"}
_sdpa_cache: dict[str, list | None] = {}


def sdpa_backends() -> list | None:
    """The SDPA backends the masked attention of prefills and attention passes may use ($FASTRAG_SDPA), or None for
    torch's own choice ("torch"). A CPU has flash and math, the two it uses anyway.

    The default leaves cuDNN out. torch builds a cuDNN attention graph for every new set of shapes (tens of
    milliseconds each in public measurements), its CUDA 13 builds try cuDNN first on Hopper, and no two prefill
    calls or attention passes of a run have the same shapes. In the H200 DRAGIN run of 2026-11-25 (torch's choice)
    the host spent 1.16 ms per SDPA call, about 37 ms per forward, and prefill ran at 8.7x its floor
    (benchmarks/results/gpu_h200_2026-11-25.md); benchmarks/bench_prefill.py times both settings side by side.

    The cascade prefill (`lse_attention`) calls its kernels itself (flash and memory-efficient on CUDA, flash on the
    CPU), never cuDNN: this setting governs the masked calls, i.e. prefills without a shared prefix or with the
    cascade off, and the attention passes."""
    import os

    mode = os.environ.get(SDPA_ENV, "flash,efficient,math").strip()
    if mode in _sdpa_cache:
        return _sdpa_cache[mode]
    if mode == "torch":
        backends = None
    else:
        names = [n.strip() for n in mode.split(",") if n.strip()]
        bad = [n for n in names if n not in SDPA_NAMES]
        if bad or not names:
            raise ValueError(f"${SDPA_ENV}={mode!r}: expected 'torch' or a comma list of "
                             f"{', '.join(SDPA_NAMES)}")
        from torch.nn.attention import SDPBackend

        backends = [getattr(SDPBackend, SDPA_NAMES[n]) for n in names if hasattr(SDPBackend, SDPA_NAMES[n])]
    _sdpa_cache[mode] = backends
    return backends


def masked_attention(q, k, v, mask, scale: float | None = None, expand: bool = False):
    """softmax(q k^T * scale, masked) v for q [B, H, T, D], k/v [B, Hkv, S, D] (H a multiple of Hkv), mask [B, 1, T, S]
    (True: attend). expand: repeat k and v to H heads instead of asking SDPA for grouped heads. The call may use only
    the backends of `sdpa_backends()`."""
    if getattr(_SCOPE, "on", False):
        return _masked_attention(q, k, v, mask, scale, expand)
    with sdpa_scope():
        return _masked_attention(q, k, v, mask, scale, expand)


_SCOPE = threading.local()


@contextlib.contextmanager
def sdpa_scope():
    """SDPA restricted to `sdpa_backends()` for the block, entered once for a whole forward (`sdpa_kernel` costs ~10
    us to enter and leave: once per layer and bucket that is ~1 ms a prefill forward); nested scopes are free.
    ("torch": torch's own choice, nothing to restrict; the scope is still marked, so a forward enters it once.)"""
    if getattr(_SCOPE, "on", False):
        yield
        return
    backends = sdpa_backends()
    _SCOPE.on = True
    try:
        if backends is None:
            yield
        else:
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel(backends):
                yield
    finally:
        _SCOPE.on = False


def _masked_attention(q, k, v, mask, scale: float | None, expand: bool):
    H, Hkv = q.shape[1], k.shape[1]
    if H == Hkv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if expand:
        g = H // Hkv
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1),
                                              attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


FUSED_DECODE_ENV = "FASTRAG_FUSED_DECODE"  # auto (default: on for CUDA tensors) | 1 | 0


def _fused_decode_ops():
    """(kernels/fused_decode.py, runs on CPU tensors) or (None, False): the decode step's per-layer small operations
    (residual add + RMSNorm, rotary embedding + KV write, SiLU-gated product) as 4 Triton launches per layer, and a
    shared prefix's softmax and log-sum-exp merge as 2 (its two GEMMs stay torch.matmul).

    auto: used for CUDA tensors when Triton imports. 1: also for CPU tensors when fastrag.kernels was imported under
    TRITON_INTERPRET=1 (how CI runs this path without a GPU). 0: torch's separate operations everywhere."""
    import os

    mode = os.environ.get(FUSED_DECODE_ENV, "auto")
    if mode not in ("auto", "1", "0"):
        raise ValueError(f"${FUSED_DECODE_ENV}={mode!r}: expected auto, 1 or 0")
    if mode == "0" or (mode == "auto" and not torch.cuda.is_available()):
        return None, False
    try:
        from fastrag.kernels import INTERPRETED
        from fastrag.kernels import fused_decode
    except ImportError as e:
        if mode == "1":
            raise RuntimeError(f"${FUSED_DECODE_ENV}=1 but the Triton kernels do not import: {e}") from e
        return None, False
    return _ModuleRef(fused_decode), mode == "1" and INTERPRETED


PREFIX_FLASH_ENV = "FASTRAG_PREFIX_FLASH"  # 1: shared prefixes through fd.prefix_flash_decode | 0 (default)
FLASH_PREFIXES = 4  # prefixes one flash launch takes (kernels/fused_decode.py MAX_FLASH_PREFIXES)


def _prefix_flash_mode() -> bool:
    """$FASTRAG_PREFIX_FLASH as a switch (off unless 1): the decode step's shared prefixes in one flash-decoding
    launch a layer (kernels/fused_decode.py prefix_flash_decode) instead of a GEMM, softmax, GEMM and merge per
    prefix over every row. Off by default until a GPU has timed both (bench_decode --prefixes)."""
    from fastrag.switches import env_switch

    return env_switch(PREFIX_FLASH_ENV)


FUSED_PREFILL_ENV = "FASTRAG_FUSED_PREFILL"  # auto (default: wherever the decode step's fused kernels run) | 0


def _fused_prefill_mode() -> str:
    """The prefill's and the attention passes' per-layer small operations (residual add + RMSNorm, rotary embedding
    with the KV write, SiLU-gated product) through the decode step's fused kernels: one launch each over all the
    call's tokens instead of torch's ~30 separate kernels a layer. A prefill of a few hundred tokens is bound by
    those launches on a GPU (benchmarks/results/prefill_gpu_h200_2026-11-26.md: 1 x 300 tokens at 6.4x its floor).
    auto: wherever $FASTRAG_FUSED_DECODE puts the decode step's; 0: torch's operations in prefills."""
    import os

    mode = os.environ.get(FUSED_PREFILL_ENV, "auto")
    if mode not in ("auto", "0"):
        raise ValueError(f"${FUSED_PREFILL_ENV}={mode!r}: expected auto or 0")
    return mode


CASCADE_PREFILL_ENV = "FASTRAG_CASCADE_PREFILL"  # auto (default: wherever the self-check passes) | 0


def _cascade_prefill_mode() -> str:
    """How a prefill's new tokens attend to the shared prefix (the demonstrations every sequence starts with).
    auto: as a cascade, the prefix once for all the call's tokens without a mask and each sequence's own context
    with its causal mask, the two merged by their log-sum-exp (`LlamaModel._attend_prefill_cascade`), wherever the
    attention kernels that return a log-sum-exp pass a self-check (run when an Engine is built, else on first use);
    0: one masked call per bucket over [prefix | context], the prefix keys copied for every sequence. On the H200
    that copy (`cat`) took 21% of a 12 x 300-token prefill's device time and the masked attention over the whole
    prefix 25% (benchmarks/results/prefill_gpu_h200_2026-11-26b.md)."""
    import os

    mode = os.environ.get(CASCADE_PREFILL_ENV, "auto")
    if mode not in ("auto", "0"):
        raise ValueError(f"${CASCADE_PREFILL_ENV}={mode!r}: expected auto or 0")
    return mode


def lse_attention(q, k, v, bias, scale: float):
    """softmax(q k^T * scale + bias) v and its row log-sum-exp, for q [B, H, T, D], k/v [B, H, S, D] (as many heads as
    q), bias None or an additive float mask of q's dtype, [B, H, T, S] (broadcast views welcome; on CUDA its rows
    16-element aligned, see `cascade_bias`). Returns (o [B, H, T, D] in q's dtype, lse [B, H, T] float32, natural
    log of the scaled scores' sum of exponentials). torch's fused kernels return the log-sum-exp only through their
    aten entry points: flash attention on CUDA for half types without a mask, memory-efficient attention on CUDA
    otherwise, and the CPU's flash kernel (mask included)."""
    T = q.shape[2]
    if q.device.type == "cuda":
        if bias is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 \
                and q.shape[-1] <= 256:
            out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
            return out[0], out[1][..., :T].float()
        out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, False, scale=scale)
        return out[0], out[1][..., :T].float()
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias,
                                                                         scale=scale)
    return o, lse.float()


def cascade_bias(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive float mask of the cascade's own-context call from a bool mask [B, 1, T, S] (True: attend):
    [B, 1, groups * T, S], each query row repeated for the `groups` query heads that share a kv head (the call
    stacks them as rows), 0 where visible and -inf elsewhere. A row that sees nothing (padding) sees key 0, so no
    row is all -inf. On CUDA the rows are allocated 16-element aligned (the memory-efficient kernel's requirement)
    and the result is a view of the first S columns."""
    B, _, T, S = mask.shape
    mask = mask | (~mask.any(-1, keepdim=True) & (torch.arange(S, device=mask.device) == 0))
    if groups > 1:
        mask = mask.expand(B, groups, T, S).reshape(B, 1, groups * T, S)
    width = -(-S // 16) * 16 if mask.device.type == "cuda" else S
    bias = torch.full((B, 1, mask.shape[2], width), float("-inf"), dtype=dtype, device=mask.device)
    bias[..., :S].masked_fill_(mask, 0.0)
    return bias[..., :S]


@dataclass(slots=True)
class CascadeMask:
    """A prefill bucket's masks when its prefix is attended as a cascade: `bias` from `cascade_bias` (the own
    context), `groups` query heads per kv head."""
    bias: torch.Tensor
    groups: int


def _real_positions(lens: list[int], T: int, device) -> torch.Tensor:
    """[N] int64 flat positions (row-major over [B, T]) of each row's first lens[b] tokens, built on the host."""
    return tensor_on(np.concatenate([np.arange(n) + b * T for b, n in enumerate(lens)]), device)


class _ModuleRef:
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
        return _import_module_ref, (self._module.__name__,)


def _import_module_ref(name: str) -> _ModuleRef:
    import importlib

    return _ModuleRef(importlib.import_module(name))


# the architectures whose math is this file's: Llama, Mistral (without a window shorter than the context, see
# ModelConfig.max_position_embeddings) and Qwen2 (q/k/v biases)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases
    o_bias: bool = False  # the output projection's bias (Llama's attention_bias; Qwen2 has none)
    # the longest context the engine allows: the model's max_position_embeddings, or its sliding window when that
    # is shorter (the engine attends to the whole context, which equals windowed attention only within the window)
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        """From a transformers config of a supported architecture (SUPPORTED_MODEL_TYPES); anything the model
        computes differently from Llama math is refused by name, never run as Llama."""
        kind = getattr(hf, "model_type", None)
        if kind not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {kind!r} is not supported: fastrag runs {', '.join(SUPPORTED_MODEL_TYPES)} "
                             "checkpoints (its own Llama-family implementation)")
        act = getattr(hf, "hidden_act", "silu")
        if act not in ("silu", "swish"):  # (transformers' "swish" is SiLU)
            raise ValueError(f"hidden_act {act!r} is not supported (the MLP is SiLU-gated)")
        if getattr(hf, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported (the MLP projections have no bias)")
        eos = hf.eos_token_id
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        heads = hf.num_attention_heads
        max_pos = hf.max_position_embeddings
        window = getattr(hf, "sliding_window", None)
        if kind == "qwen2" and not getattr(hf, "use_sliding_window", False):
            window = None
        if isinstance(window, int) and 0 < window < max_pos:
            max_pos = window  # within the window, full attention is windowed attention
        llama_bias = bool(getattr(hf, "attention_bias", False)) and kind == "llama"
        return cls(
            vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            rms_norm_eps=hf.rms_norm_eps, tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=llama_bias or kind == "qwen2", o_bias=llama_bias,
            max_position_embeddings=max_pos, eos_token_ids=eos,
        )


@dataclass(slots=True)
class AttnBatch:
    """Where a padded batch of new tokens reads and writes its KV.

    write_slots: [N]        pool slot of each valid new token (row-major over the batch, padding skipped)
    valid:       [B, T]     bool, which new-token positions are real
    positions:   [B, T]     absolute position of each new token (0 for padding)
    prefix_len:  int        length P of the shared prefix every sequence starts with (0: none)
    prefix_slots:[P]        pool slots of that prefix
    prefix_start:int        first slot when those slots are consecutive (then the prefix is read as a view), else -1
    ctx_blocks:  [B, NB]    pool blocks of each sequence's context after the prefix (new tokens included), padded;
                            context entry i lives in slot ctx_blocks[b, i // block_size] * block_size + i % block_size
    ctx_lens:    [B]        number of real context entries
    prefix_groups:          decode only (one new token per sequence), for sequences of different prefixes in one
                            batch: a list of PrefixGroup, each a shared prefix and the batch rows that start with
                            it (prefix_len is then 0: ctx_* describe each sequence's own tokens after its prefix).
                            None: every sequence starts with the one prefix above.
    last_layer:             decode only: a dict the forward fills with the last layer's queries "q" [B, H, D]
                            (rotated) and the row log-sum-exp "lse" [B, H] of their attention over prefix and
                            context (the input of the attention-statistics kernels); None: not wanted.
    lens:                   optional host list, per row the number of real new tokens (valid's row sums): with it
                            the forward lays out a packed prefill without reading valid back from the device
    valid_index:            [N] flat positions of the real tokens (row-major), set by a padded prefill from `lens`
                            so that writing the KV needs no boolean indexing (a host synchronisation per layer)
    ctx_lens_host:          optional host list of ctx_lens (what the paged prefill kernel's layout reads without a
                            copy back from the device)
    """

    write_slots: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor
    prefix_len: int
    prefix_slots: torch.Tensor
    ctx_blocks: torch.Tensor
    ctx_lens: torch.Tensor
    block_size: int
    prefix_start: int = -1
    prefix_groups: list["PrefixGroup"] | None = None
    last_layer: dict | None = None
    lens: list[int] | None = None
    valid_index: torch.Tensor | None = None
    ctx_lens_host: list[int] | None = None
    prefix_rows: torch.Tensor | None = None  # decode: [B] int32 each row's prefix group (-1: none), set by the
    # forward for the flash prefix kernel (LlamaModel._flash_prefix_rows); None: that kernel is not used


@dataclass(slots=True)
class PrefixGroup:
    rows: torch.Tensor | None  # [n] int64 batch rows of the sequences starting with this prefix (None: all)
    length: int
    slots: torch.Tensor  # [P] pool slots
    start: int = -1  # first slot when consecutive, else -1
    # with rows None: [B] bool, which rows start with this prefix (the others are left as they are). The shape
    # does not depend on how many rows a prefix has, so a decode step of several prefixes can be a CUDA graph
    # (fastrag/cuda_graphs.py): the prefix's GEMM runs over every row and only its rows merge the result.
    member: torch.Tensor | None = None
    host_rows: list[int] | None = None  # rows as a host list (what the packed prefill's layout reads)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # fp32 statistics, as transformers' LlamaRMSNorm does
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Layer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.qkv = Linear(c.hidden_size, q + 2 * kv, bias=c.attention_bias)  # fused q/k/v projection
        self.o = Linear(q, c.hidden_size, bias=c.o_bias)
        self.gate_up = Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)  # fused gate/up
        self.down = Linear(c.intermediate_size, c.hidden_size, bias=False)

    def project_qk(self, x, cos, sin):
        """x: [B, T, hidden] -> q [B, H, T, D], k [B, Hkv, T, D] (rotated), v [B, Hkv, T, D]."""
        c = self.c
        B, T, _ = x.shape
        h = self.input_layernorm(x)
        q, k, v = self.qkv(h).split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                                     c.num_kv_heads * c.head_dim], dim=-1)
        q = q.view(B, T, c.num_heads, c.head_dim).transpose(1, 2)
        k = k.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def mlp(self, x):
        g, u = self.gate_up(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


def _rope_inv_freq(hf, head_dim: int) -> tuple[torch.Tensor, float]:
    """Rotary inverse frequencies; non-default rope types (llama3, yarn, ...) use transformers' own init."""
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "longrope":  # its frequencies depend on the sequence length (short/long factors): not modelled
        raise ValueError("rope_scaling type 'longrope' is not supported (frequencies that change with the "
                         "sequence length)")
    if kind == "default":
        theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # slow import: only when needed

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    return inv_freq.float(), float(scaling)


def apply_rope(x, cos, sin):
    """x: [B, H, T, D]; cos/sin: [B, T, D] (rotate-half convention of transformers)."""
    d = x.shape[-1] // 2
    rot = torch.cat((-x[..., d:], x[..., :d]), dim=-1)
    return x * cos.unsqueeze(1) + rot * sin.unsqueeze(1)


def self_check_key(device, dtype: torch.dtype) -> str:
    """The key of a self-check's verdict: one per physical device and dtype. A CUDA device named without its index
    ("cuda") is the current one ("cuda:0"), so a check asked for with torch.device("cuda") and the tensors' own
    "cuda:0" runs once, not twice (the second run came inside the first prefill: a GPU run of 2026-11-27 counted it
    as a kernel call of the prefill)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return f"{device} {str(dtype).removeprefix('torch.')}"


class LlamaModel(nn.Module):
    def __init__(self, c: ModelConfig, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = attention_scaling
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self.native_decode = _native_decode_attention()
        self.triton_decode, self._triton_on_cpu = _triton_decode_attention()
        self.fused_decode, self._fused_on_cpu = _fused_decode_ops()
        # every shared prefix of a decode step in one flash-decoding launch a layer (fd.prefix_flash_decode) where
        # the fused decode kernels run; off: a GEMM, softmax, GEMM and merge per prefix ($FASTRAG_PREFIX_FLASH)
        self.prefix_flash = _prefix_flash_mode()
        self.fused_prefill = _fused_prefill_mode() == "auto"
        mode = _prefill_gqa_mode()
        self.expand_gqa = None if mode == "auto" else mode == "expand"  # None: by device (gqa_expand)
        self.cascade_prefill = _cascade_prefill_mode() == "auto"
        # per "device dtype": "on", or "off: why" when the log-sum-exp kernels failed their self-check there
        self.cascade_checks: dict[str, str] = {}
        self.paged_prefill, self._paged_prefill_on_cpu = _paged_prefill_attention()
        self.paged_prefill_checks: dict[str, str] = {}  # as cascade_checks, for the paged prefill kernel

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32, device="cpu") -> "LlamaModel":
        """Load from a local HF directory (use fastrag.model.loading.resolve_model for GGUF / 'smollm2')."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        from transformers import AutoConfig

        path = Path(path)
        hf = AutoConfig.from_pretrained(path)
        model = cls.from_hf_config(hf, dtype=dtype, device="meta")
        index = path / "model.safetensors.index.json"
        if not index.exists() and not (path / "model.safetensors").exists():
            other = sorted(f.name for f in path.glob("*.bin")) + sorted(f.name for f in path.glob("*.pt*"))
            held = (f"; it holds {', '.join(other[:3])}, which fastrag does not read: convert it to safetensors, "
                    "as transformers' save_pretrained writes") if other else ""
            raise FileNotFoundError(f"{path}: no weights in the model directory (expected model.safetensors or "
                                    f"model.safetensors.index.json{held})")
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
            else ["model.safetensors"]
        sd = {}
        for f in files:
            try:
                sd.update(load_file(str(path / f)))
            except SafetensorError as e:  # (not an OSError or ValueError: a traceback otherwise)
                raise ValueError(f"{path / f}: not a readable safetensors file, truncated or damaged? ({e})") from e
        model._load_hf_state_dict(sd, dtype, device)
        gen = path / "generation_config.json"
        if gen.exists():  # end-of-generation ids listed there only (instruct models) end a generation too
            eos = json.loads(gen.read_text()).get("eos_token_id")
            eos = eos if isinstance(eos, list) else ([eos] if isinstance(eos, int) else [])
            model.c.eos_token_ids = tuple(dict.fromkeys([*model.c.eos_token_ids, *eos]))
        return model.eval()

    @classmethod
    def from_hf_config(cls, hf, dtype=torch.float32, device="cpu", seed: int | None = None) -> "LlamaModel":
        """Random-initialised weights with the real shapes (throughput work: speed does not depend on values)."""
        c = ModelConfig.from_hf(hf)
        inv_freq, scaling = _rope_inv_freq(hf, c.head_dim)
        if seed is not None:
            torch.manual_seed(seed)
        with torch.device(device):
            model = cls(c, inv_freq.to("cpu" if device == "meta" else device), scaling)
        if device != "meta":
            for p in model.parameters():
                nn.init.normal_(p, std=0.02)
            for m in model.modules():
                if isinstance(m, RMSNorm):
                    m.weight.data.fill_(1.0)
        # on "meta" too: from_pretrained allocates the real tensors from these (to_empty), in this dtype. The rotary
        # frequencies stay float32 (positions x inv_freq in bf16 would be off by whole radians at long positions)
        inv = model.inv_freq
        model.to(dtype)
        model.inv_freq = inv
        return model

    def _hf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint (transformers) names of the weights this model computes with, in load order, and the
        shape its config gives each."""
        c = self.c
        h, q, kv, inter = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                           p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                           p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                           p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                           p + "mlp.down_proj.weight": (h, inter)})
            if c.attention_bias:
                shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                               p + "self_attn.v_proj.bias": (kv,)})
            if c.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
        if not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (c.vocab_size, h)
        return shapes

    def _load_hf_state_dict(self, sd: dict, dtype, device):
        c = self.c
        # a weight this model computes with that the checkpoint lacks: name them all (not a KeyError on the first)
        shapes = self._hf_weight_shapes()
        absent = [k for k in shapes if k not in sd]
        if absent:
            raise ValueError(f"the checkpoint is missing {len(absent)} weight(s) this model needs (first: "
                             f"{', '.join(absent[:4])})")
        # weights of other shapes than config.json gives (a config that is not the weights'): name the first
        wrong = [(k, tuple(sd[k].shape), want) for k, want in shapes.items() if tuple(sd[k].shape) != want]
        if wrong:
            k, got, want = wrong[0]
            raise ValueError(f"the checkpoint's weights do not have the shapes its config.json gives: {len(wrong)} "
                             f"differ, first {k} of shape {list(got)} where the config gives {list(want)}")
        g = lambda k: sd[k].to(dtype)  # noqa: E731
        new = {"embed.weight": g("model.embed_tokens.weight"), "norm.weight": g("model.norm.weight")}
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            new[f"layers.{i}.input_layernorm.weight"] = g(p + "input_layernorm.weight")
            new[f"layers.{i}.post_attention_layernorm.weight"] = g(p + "post_attention_layernorm.weight")
            new[f"layers.{i}.qkv.weight"] = torch.cat([g(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            if c.attention_bias:
                new[f"layers.{i}.qkv.bias"] = torch.cat([g(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            new[f"layers.{i}.o.weight"] = g(p + "self_attn.o_proj.weight")
            if c.o_bias:
                new[f"layers.{i}.o.bias"] = g(p + "self_attn.o_proj.bias")
            new[f"layers.{i}.gate_up.weight"] = torch.cat([g(p + "mlp.gate_proj.weight"), g(p + "mlp.up_proj.weight")])
            new[f"layers.{i}.down.weight"] = g(p + "mlp.down_proj.weight")
        if not c.tie_word_embeddings:
            new["lm_head.weight"] = g("lm_head.weight")
        # a checkpoint weight this model does not use means another computation (extra norms, biases): refuse
        used = set(shapes) | {"lm_head.weight"}  # (a tied checkpoint may hold its head too)
        unused = sorted(k for k in sd if k not in used and not k.endswith("rotary_emb.inv_freq"))
        if unused:
            raise ValueError(f"the checkpoint holds {len(unused)} weight(s) this Llama-family model does not use "
                             f"(first: {', '.join(unused[:4])}): another architecture or options it does not "
                             "implement")
        inv_freq = self.inv_freq
        self.to_empty(device=device)
        self.load_state_dict(new, strict=False, assign=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.inv_freq = inv_freq.to(device)
        missing = [k for k in self.state_dict() if k not in new and not (c.tie_word_embeddings and k == "lm_head.weight")]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}")

    # ------------------------------------------------------------------ forward
    def rope(self, positions):
        """positions: [B, T] -> cos, sin: [B, T, D]."""
        freqs = positions.to(self.inv_freq.dtype).unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        dt = self.embed.weight.dtype
        return (emb.cos() * self.attention_scaling).to(dt), (emb.sin() * self.attention_scaling).to(dt)

    def forward(self, ids, batch: AttnBatch, k_pool, v_pool, logits_index=None):
        """One step over the paged cache.

        ids: [B, T] new tokens; k_pool/v_pool: per-layer lists of [Hkv, num_slots, D].
        logits_index: [M] flat indices into B*T whose logits are wanted (default: all valid).
        Returns logits [M, V] (float32).
        """
        B, T = ids.shape
        if T > 1 and not getattr(_SCOPE, "on", False):  # a prefill: its masked SDPA calls in one backend scope
            with sdpa_scope():
                return self.forward(ids, batch, k_pool, v_pool, logits_index)
        mixed = batch.prefix_groups is not None and not (T == 1 and self.mixes_prefixes)
        # a prefill with the fused small operations runs packed: its rows are the real tokens, each written to
        # its own slot by the fused rotary + KV-write kernel (a padded row has no slot)
        if mixed or (T > 1 and ((B > 1 and self._real_tokens(batch) < self.pack_below * B * T)
                                or self.uses_fused_prefill(ids.device)
                                or self.uses_paged_prefill(ids.device, self.embed.weight.dtype))):
            return self._forward_packed(ids, batch, k_pool, v_pool, logits_index)
        if T == 1 and self.uses_fused_decode(ids.device):
            return self._forward_decode_fused(ids, batch, k_pool, v_pool, logits_index)
        x = self.embed(ids)
        cos, sin = self.rope(batch.positions)
        mask_ctx = self._ctx_mask(batch)
        if T > 1:  # the prefill mask over [prefix | context] is the same for every layer: build it once
            mask_ctx = (mask_ctx, self._prefill_mask(batch, mask_ctx))
            if batch.lens is not None and sum(batch.lens) < B * T:
                batch.valid_index = _real_positions(batch.lens, T, ids.device)
        stats_at = len(self.layers) - 1 if batch.last_layer is not None and T == 1 else -1
        for li, layer in enumerate(self.layers):
            q, k, v = layer.project_qk(x, cos, sin)
            self._write_kv(k, v, batch, k_pool[li], v_pool[li])
            if li == stats_at:
                o, lse = self._attend(q, batch, k_pool[li], v_pool[li], mask_ctx, want_lse=True)
                batch.last_layer.update(q=q[:, :, 0], lse=lse)
            else:
                o = self._attend(q, batch, k_pool[li], v_pool[li], mask_ctx)
            x = x + layer.o(o.transpose(1, 2).reshape(B, T, -1))
            x = layer.mlp(x)
        x = x.reshape(B * T, -1)
        if logits_index is None:
            logits_index = batch.valid.reshape(-1).nonzero().squeeze(-1)
        return self.lm_head(self.norm(x[logits_index])).float()

    @staticmethod
    def _real_tokens(batch: AttnBatch) -> int:
        return sum(batch.lens) if batch.lens is not None else int(batch.valid.sum())

    def uses_fused_decode(self, device: torch.device) -> bool:
        """Whether a decode step on this device runs the fused per-layer kernels (kernels/fused_decode.py)."""
        return self.fused_decode is not None and (device.type == "cuda" or (device.type == "cpu" and self._fused_on_cpu))

    def gqa_expand(self, device: torch.device) -> bool:
        """Whether the masked attention on this device repeats grouped keys and values to every query head
        ($FASTRAG_PREFILL_GQA; auto: on CUDA devices)."""
        return device.type == "cuda" if self.expand_gqa is None else self.expand_gqa

    def uses_paged_prefill(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether a prefill on this device attends through the paged prefill kernel ($FASTRAG_PAGED_PREFILL, auto:
        for CUDA tensors; 1: CPU tensors too, under TRITON_INTERPRET=1) where its self-check passed, run once per
        device and dtype against fastrag.signals.reference.paged_prefill_ref (a warning and the reason in
        `paged_prefill_checks` when it fails: a Triton that cannot compile it there, or a wrong result)."""
        if self.paged_prefill is None or not (device.type == "cuda" or (device.type == "cpu"
                                                                         and self._paged_prefill_on_cpu)):
            return False
        return self._self_checked(self.paged_prefill_checks, self._check_paged_prefill, device, dtype,
                                  "the packed prefill's attention without the paged kernel")

    @staticmethod
    def _self_checked(checks: dict[str, str], check, device: torch.device, dtype: torch.dtype, fallback: str) -> bool:
        """Whether a path passed its self-check `check(device, dtype)` ("on", else "off: why"), run once per device
        and dtype and kept in `checks`; a failure warns once, naming the `fallback` taken instead."""
        key = self_check_key(device, dtype)
        if key not in checks:
            checks[key] = check(torch.device(device), dtype)
            if checks[key] != "on":
                import warnings

                warnings.warn(f"fastrag: {fallback} on {key} ({checks[key]})", RuntimeWarning, stacklevel=3)
        return checks[key] == "on"

    def _check_paged_prefill(self, device: torch.device, dtype: torch.dtype) -> str:
        """The paged prefill kernel against the project's reference (`paged_prefill_ref`, float64) on a random
        problem of this model's heads: a sequence of several query and key tiles after an 80-token prefix, a short
        one of the same prefix and one without, blocks out of order. "on" when they agree, else "off: " and why."""
        c = self.c
        H, Hkv, D, bs = c.num_heads, c.num_kv_heads, c.head_dim, 16
        g = torch.Generator().manual_seed(0)
        P, q_lens, ctx_lens = 80, [70, 5, 2], [90, 5, 4]
        nb = [-(-n // bs) for n in ctx_lens]
        first = -(-(1 + P) // bs)  # the prefix in slots 1 .. P, the own blocks after its blocks
        pool_blocks = first + sum(nb) + 1
        kp = torch.randn(Hkv, pool_blocks * bs, D, generator=g)
        vp = torch.randn(Hkv, pool_blocks * bs, D, generator=g)
        q = torch.randn(sum(q_lens), H, D, generator=g)
        order = torch.randperm(pool_blocks - first, generator=g) + first
        table, used = torch.zeros(3, max(nb), dtype=torch.long), 0
        for b, n in enumerate(nb):
            table[b, :n] = order[used: used + n]
            used += n
        pre_slots = torch.arange(1, 1 + P)
        pre = [(0, P), (0, P), (0, 0)]
        try:
            pp = self.paged_prefill
            lay = pp.prefill_layout(q_lens, ctx_lens, pre, pre_slots.to(device), table.to(device), bs)
            with torch.inference_mode():
                got = pp.paged_prefill_attention(q.to(device, dtype), kp.to(device, dtype), vp.to(device, dtype),
                                                 lay, self.scale).float().cpu()
        except Exception as e:  # (a Triton that cannot compile or launch it here)
            return f"off: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        from fastrag.signals.reference import paged_prefill_ref

        r = lambda t: t.to(dtype)  # noqa: E731  (the reference reads the inputs the kernel read)
        want = paged_prefill_ref(r(q), r(kp), r(vp), q_lens, ctx_lens, [pre_slots[: n] for _, n in pre], table, bs,
                                 self.scale)
        err = (got.double() - want).abs().max().item()
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        if not err <= tol:  # (NaN included)
            return f"off: the kernel differed from the dense computation by {err:.3g} (tolerance {tol:g})"
        return "on"

    def _paged_layout(self, batch: AttnBatch, lens: list[int], device: torch.device):
        """The paged prefill kernel's layout of this packed forward (kernels/paged_prefill.py `prefill_layout`):
        each sequence's new tokens, own keys and prefix (from `prefix_groups` when the call mixes prefixes)."""
        B = len(lens)
        ctx = batch.ctx_lens_host if batch.ctx_lens_host is not None else batch.ctx_lens.tolist()
        if batch.prefix_groups is None:
            pre_slots = batch.prefix_slots
            pre = [(0, batch.prefix_len)] * B
        else:
            pre, parts, off = [(0, 0)] * B, [], 0
            for grp in batch.prefix_groups:
                if grp.rows is not None:
                    rows = grp.host_rows if grp.host_rows is not None else grp.rows.tolist()
                elif grp.member is not None:  # (a graphed decode's layout: which rows start with it)
                    rows = [r for r, m in enumerate(grp.member.tolist()) if m]
                else:
                    rows = range(B)
                for r in rows:
                    pre[r] = (off, grp.length)
                parts.append(grp.slots)
                off += grp.length
            pre_slots = torch.cat(parts) if len(parts) > 1 else parts[0] if parts else batch.prefix_slots
        if pre_slots.numel() == 0:  # (a kernel argument must point somewhere: one slot no sequence reads)
            pre_slots = torch.zeros(1, dtype=torch.long, device=device)
        return self.paged_prefill.prefill_layout(lens, ctx, pre, pre_slots, batch.ctx_blocks, batch.block_size)

    def uses_fused_prefill(self, device: torch.device) -> bool:
        """Whether prefills and attention passes on this device run the same fused kernels ($FASTRAG_FUSED_PREFILL,
        default: wherever the decode step does)."""
        return self.fused_prefill and self.uses_fused_decode(device)

    def _forward_decode_fused(self, ids, batch: AttnBatch, k_pool, v_pool, logits_index=None):
        """forward() for one new token per row with the small operations fused: per layer, residual add + RMSNorm
        (twice), rotary embedding of q and k with k and v written straight into the pool, and SiLU-gated product
        are 4 launches instead of about 35; the GEMMs and the attention are the unfused path's own."""
        fd, c = self.fused_decode, self.c
        B = ids.shape[0]
        x = self.embed(ids[:, 0])  # [B, hidden]
        cos, sin = self.rope(batch.positions)  # [B, 1, D]
        cos, sin = cos[:, 0], sin[:, 0]
        mask_ctx = self._ctx_mask(batch)
        batch.prefix_rows = self._flash_prefix_rows(batch, B, ids.device)  # (once for all layers)
        stats_at = len(self.layers) - 1 if batch.last_layer is not None else -1
        delta = None
        for li, layer in enumerate(self.layers):
            x, h = fd.add_rms_norm(x, delta, layer.input_layernorm.weight, layer.input_layernorm.eps)
            q = fd.rope_write_kv(layer.qkv(h), cos, sin, batch.write_slots, k_pool[li], v_pool[li],
                                 c.num_heads, c.num_kv_heads)  # [B, H, D]
            q4 = q.unsqueeze(2)
            if li == stats_at:
                o, lse = self._attend(q4, batch, k_pool[li], v_pool[li], mask_ctx, want_lse=True)
                batch.last_layer.update(q=q, lse=lse)
            else:
                o = self._attend(q4, batch, k_pool[li], v_pool[li], mask_ctx)
            x, h = fd.add_rms_norm(x, layer.o(o.reshape(B, -1)), layer.post_attention_layernorm.weight,
                                   layer.post_attention_layernorm.eps)
            delta = layer.down(fd.silu_mul(layer.gate_up(h)))
        x = x + delta
        if logits_index is None:
            logits_index = batch.valid.reshape(-1).nonzero().squeeze(-1)
        return self.lm_head(self.norm(x[logits_index])).float()

    # a prefill batch whose real tokens fill less than this fraction of the padded [B, T] runs packed
    pack_below = 0.85

    def _forward_packed(self, ids, batch: AttnBatch, k_pool, v_pool, logits_index=None):
        """Prefill of sequences of very different lengths without padding: the projections and the MLP (most of
        the FLOPs) run on the N real tokens packed into one row; attention runs per bucket of sequences of one
        prefix and similar lengths (`_attention_buckets`), padded within the bucket only. Same results as the
        padded forward (each token sees exactly the same keys). Sequences of different shared prefixes
        (`batch.prefix_groups`) are fine here: each sequence attends to its own prefix.
        """
        B, T = ids.shape
        if batch.lens is not None:  # [N] real tokens, row-major (= write_slots order), laid out on the host
            lens = list(batch.lens)
            flat = _real_positions(lens, T, ids.device)
        else:
            flat = batch.valid.reshape(-1).nonzero().squeeze(-1)
            lens = batch.valid.sum(1).tolist()
        N = flat.numel()
        x = self.embed(ids.reshape(-1)[flat]).unsqueeze(0)  # [1, N, hidden]
        cos, sin = self.rope(batch.positions.reshape(-1)[flat].unsqueeze(0))
        paged = self._paged_layout(batch, lens, ids.device) \
            if self.uses_paged_prefill(ids.device, self.embed.weight.dtype) else None
        if paged is None:
            buckets = self._attention_buckets(batch, lens)
            singles = all(idx[1] == 1 for idx, _, _ in buckets)
        fd = self.fused_decode if self.uses_fused_prefill(ids.device) else None
        if fd is not None and paged is not None:  # per layer one attention launch over the tokens' keys in place
            x = self._paged_fused_layers(x[0], cos[0], sin[0], batch.write_slots, k_pool, v_pool, paged)
            rows = torch.arange(N, device=x.device) if logits_index is None else torch.searchsorted(flat, logits_index)
            return self.lm_head(self.norm(x[rows])).float()
        if fd is not None:  # rows: the N tokens; the residual stream and each sublayer's output kept apart
            x, cos, sin, delta = x[0], cos[0], sin[0], None
        for li, layer in enumerate(self.layers):
            kp, vp = k_pool[li], v_pool[li]
            if fd is not None:
                x, h = fd.add_rms_norm(x, delta, layer.input_layernorm.weight, layer.input_layernorm.eps)
                q = fd.rope_write_kv(layer.qkv(h), cos, sin, batch.write_slots, kp, vp, self.c.num_heads,
                                     self.c.num_kv_heads)  # [N, H, D]
                q = q.transpose(0, 1).unsqueeze(0)  # [1, H, N, D]
            else:
                q, k, v = layer.project_qk(x, cos, sin)  # [1, H, N, D], [1, Hkv, N, D]
                kp.index_copy_(1, batch.write_slots, k[0])
                vp.index_copy_(1, batch.write_slots, v[0])
            if paged is not None:
                o = self.paged_prefill.paged_prefill_attention(q[0].transpose(0, 1), kp, vp, paged, self.scale)
                x = layer.mlp(x + layer.o(o.view(1, N, -1)))
                continue
            if singles:  # one sequence a bucket (in packed order): slices of the packed row, concatenated
                o = torch.cat([self._attend(q[:, :, d: d + t_b], bb, kp, vp, m)
                               for (d, _, t_b, *_), bb, m in buckets], dim=2)
            else:
                H, D = q.shape[1], q.shape[3]
                o = torch.empty_like(q)
                for (first, k_b, t_b, gather, real, dst), bb, m in buckets:
                    if k_b == 1:  # one sequence: its tokens are a slice of the packed row
                        o[:, :, first: first + t_b] = self._attend(q[:, :, first: first + t_b], bb, kp, vp, m)
                        continue
                    qb = q[0].index_select(1, gather).view(H, k_b, t_b, D).transpose(0, 1)  # [k, H, t, D]
                    ob = self._attend(qb, bb, kp, vp, m).transpose(0, 1).reshape(H, k_b * t_b, D)
                    o[0].index_copy_(1, dst, ob if real is None else ob.index_select(1, real))
            if fd is not None:
                x, h = fd.add_rms_norm(x, layer.o(o[0].transpose(0, 1).reshape(N, -1)),
                                       layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
                delta = layer.down(fd.silu_mul(layer.gate_up(h)))
                continue
            x = x + layer.o(o.transpose(1, 2).reshape(1, N, -1))
            x = layer.mlp(x)
        if fd is not None:
            x = x + delta
        x = x.reshape(N, -1)
        if logits_index is None:
            rows = torch.arange(N, device=x.device)
        else:  # flat [B*T] indices -> packed rows
            rows = torch.searchsorted(flat, logits_index)
        return self.lm_head(self.norm(x[rows])).float()

    def _paged_fused_layers(self, x, cos, sin, write_slots, k_pool, v_pool, paged, out=None):
        """Every layer of a packed prefill with the fused small operations and the paged prefill kernel: x [N, hidden]
        (the embedded tokens), cos, sin [N, D], each token's keys and values written to write_slots [N], `paged`
        its layout (`_paged_layout`); out: an [N, H, D] buffer the attention writes into (None: a new one a layer).
        Returns the last layer's output [N, hidden] (before the final norm)."""
        return self._fused_layers(x, cos, sin, write_slots, k_pool, v_pool, lambda q, kp, vp: (
            self.paged_prefill.paged_prefill_attention(q, kp, vp, paged, self.scale, out=out).view(q.shape[0], -1)))

    def prefill_static(self, ids, positions, write_slots, paged, rows, k_pool, v_pool, out):
        """A packed prefill whose every input is a tensor of fixed shape (a CUDA graph's, fastrag/cuda_graphs.py
        `PrefillGraphs`): ids, positions, write_slots [M] (rows past the real tokens are padding: any token, a
        scratch slot, covered by no tile of `paged`), `paged` a PrefillLayout over fixed buffers, out [M, H, D] the
        attention's buffer, rows [R] the rows whose logits are wanted. Returns logits [R, V] float32. Needs the paged
        prefill kernel and the fused small operations (`uses_paged_prefill`, `uses_fused_prefill`)."""
        x = self.embed(ids)
        cos, sin = self.rope(positions.unsqueeze(0))
        x = self._paged_fused_layers(x, cos[0], sin[0], write_slots, k_pool, v_pool, paged, out=out)
        return self.lm_head(self.norm(x.index_select(0, rows))).float()

    def last_layer_qk_static(self, ids, positions, slots, paged, ks, vs, out):
        """`last_layer_qk` over fixed-shape tensors (a CUDA graph's, fastrag/cuda_graphs.py `PassGraphs`): ids,
        positions, slots [M] (padding rows: any token, a scratch slot, in no tile of `paged`), each row's keys and
        values written to `slots` of the scratch pair ks, vs [Hkv, slots, D], attending through the paged prefill
        kernel with layout `paged` into out [M, H, D]. Returns the last layer's q [M, H, D]; its keys are in ks."""
        x = self.embed(ids)
        cos, sin = self.rope(positions.unsqueeze(0))
        return self._qk_layers(x, cos[0], sin[0], slots, ks, vs, lambda q: self.paged_prefill.paged_prefill_attention(
            q, ks, vs, paged, self.scale, out=out).view(q.shape[0], -1))

    # a bucket of the packed prefill's attention: sequences of one prefix whose padded grid (count x longest) is at
    # least this full and holds at most this many query tokens (the longest sequence alone may hold more). On a GPU
    # an attention call costs its launches (~8 kernels) more than the padding's FLOPs (attention is ~7% of a 7B
    # prefill's); on a CPU it costs its FLOPs alone, so only sequences of equal length share a bucket there (with
    # 60% fill, one packed forward of 12 random lengths took 1.36x as long on the 2-core CPU)
    bucket_fill = 0.6
    bucket_fill_cpu = 1.0
    bucket_tokens = 4096

    def _attention_buckets(self, batch: AttnBatch, lens: list[int]) -> list:
        """The packed prefill's attention work, in packed order: [(index, its AttnBatch, its masks)], built once per
        forward. index is (first packed token, k sequences, t = the longest's length, gather [k*t] the packed token
        of each cell of the bucket's padded [k, t] grid, real [n] its cells holding a token (None: all), dst [n]
        their packed positions); the three tensors are None for k = 1 (a slice of the packed row). Per layer a
        bucket is one attention call instead of one per sequence."""
        B = len(lens)
        dev = batch.valid.device
        prefix_of = {}  # batch row -> (length, slots, start) of its prefix
        for g in batch.prefix_groups or ():
            rows = range(B) if g.rows is None else g.host_rows if g.host_rows is not None else g.rows.tolist()
            for r in rows:
                prefix_of[r] = (g.length, g.slots, g.start)
        no_prefix = (0, batch.prefix_slots[:0], -1)
        off, offs = 0, []
        for n in lens:
            offs.append(off)
            off += n
        live = [b for b in range(B) if lens[b]]

        def prefix(b):
            if batch.prefix_groups is None:
                return batch.prefix_len, batch.prefix_slots, batch.prefix_start
            return prefix_of.get(b, no_prefix)

        def attn_batch(rows, t, pre):
            idx = tensor_on(rows, dev)
            plen, pslots, pstart = pre
            bb = AttnBatch(write_slots=batch.write_slots[:0], valid=batch.valid.index_select(0, idx)[:, :t],
                           positions=batch.positions.index_select(0, idx)[:, :t], prefix_len=plen,
                           prefix_slots=pslots, ctx_blocks=batch.ctx_blocks.index_select(0, idx),
                           ctx_lens=batch.ctx_lens.index_select(0, idx), block_size=batch.block_size,
                           prefix_start=pstart)
            m = self._ctx_mask(bb)
            return bb, (m if t == 1 else (m, self._prefill_mask(bb, m)))

        fill = self.bucket_fill if dev.type == "cuda" else self.bucket_fill_cpu
        families: dict[tuple, list[int]] = {}
        for b in live:
            plen, pslots, pstart = prefix(b)
            families.setdefault((plen, id(pslots), pstart), []).append(b)
        out = []
        for rows in families.values():
            rows.sort(key=lambda b: -lens[b])
            i = 0
            while i < len(rows):
                t, j, real = lens[rows[i]], i + 1, lens[rows[i]]
                while j < len(rows) and (j - i + 1) * t <= self.bucket_tokens \
                        and real + lens[rows[j]] >= fill * (j - i + 1) * t:
                    real += lens[rows[j]]
                    j += 1
                members = rows[i:j]
                k = len(members)
                if k == 1:  # (a slice of the packed row: no index)
                    b = members[0]
                    out.append(((offs[b], 1, lens[b], None, None, None), *attn_batch(members, lens[b], prefix(b))))
                    i = j
                    continue
                gather, dst, real_cells = [], [], []
                for r, b in enumerate(members):
                    n = lens[b]
                    gather += list(range(offs[b], offs[b] + n)) + [offs[b]] * (t - n)
                    dst += range(offs[b], offs[b] + n)
                    real_cells += range(r * t, r * t + n)
                full = len(real_cells) == k * t
                index = (min(offs[b] for b in members), k, t, tensor_on(gather, dev),
                         None if full else tensor_on(real_cells, dev), tensor_on(dst, dev))
                out.append((index, *attn_batch(members, t, prefix(members[0]))))
                i = j
        out.sort(key=lambda x: x[0][0])
        return out

    def last_layer_qk(self, ids, lengths, host_lengths: list[int] | None = None):
        """A cache-free causal pass over ids: [B, T] (padded, positions from 0) that stops at the last layer.

        Returns q: [B, H, T, D] and k: [B, Hkv, T, D] of the last layer (what the RIND and QFS signals need);
        no logits are computed. Only each sequence's first lengths[b] rows are meaningful. host_lengths (the same
        lengths as a host list, optional): through the paged prefill kernel only those rows are computed (packed),
        and q and k are zero past them.
        """
        if not getattr(_SCOPE, "on", False):  # its masked SDPA calls in one backend scope
            with sdpa_scope():
                return self.last_layer_qk(ids, lengths, host_lengths)
        B, T = ids.shape
        fused = self.uses_fused_prefill(ids.device)
        if fused and self.uses_paged_prefill(ids.device, self.embed.weight.dtype):  # (no mask: the kernel is causal)
            # (without the host lengths every row goes through, padding included: nothing waits for the device)
            return self._last_layer_qk_paged(ids, [T] * B if host_lengths is None else host_lengths)
        pos = torch.arange(T, device=ids.device).expand(B, T)
        cos, sin = self.rope(pos)
        valid = pos < lengths.to(ids.device).unsqueeze(1)
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        mask = (causal.unsqueeze(0) & valid.unsqueeze(1)).unsqueeze(1)  # [B, 1, T, T]
        x = self.embed(ids)
        if fused:
            return self._last_layer_qk_fused(x, cos, sin, mask)
        for layer in self.layers[:-1]:
            q, k, v = layer.project_qk(x, cos, sin)
            o = masked_attention(q, k, v, mask, expand=self.gqa_expand(q.device))
            x = layer.mlp(x + layer.o(o.transpose(1, 2).reshape(B, T, -1)))
        q, k, _ = self.layers[-1].project_qk(x, cos, sin)
        return q, k

    def _last_layer_qk_paged(self, ids, lens: list[int]):
        """last_layer_qk with the fused small operations and the paged prefill kernel as each layer's attention, one
        launch a layer without a mask, over sequence b's first lens[b] rows only, packed (sum(lens) rows through
        every layer; lens [T] * B: all B x T). The keys sit in a scratch pool of 16-slot blocks, sequence b from
        slot b * Tp (T rounded up to a block), and every row attends causally within its own sequence, so a real
        row sees exactly the keys a masked call leaves it. The last layer's q is put back in [B, H, T, D] with
        zeros past each length, as k is."""
        B, T = ids.shape
        if len(lens) != B or any(not 0 < n <= T for n in lens):
            raise ValueError(f"host_lengths must give each of the {B} sequences a length in 1..{T}, got {lens}")
        c = self.c
        H, Hkv, D, bs = c.num_heads, c.num_kv_heads, c.head_dim, 16
        nb = -(-T // bs)
        tp = nb * bs
        t = np.concatenate([np.arange(n) for n in lens])
        b = np.repeat(np.arange(B), lens)
        dev = ids.device
        rows = to_device(torch.from_numpy(b * T + t), dev)  # each real row in the [B * T] padded order
        slots = to_device(torch.from_numpy(b * tp + t), dev)
        pos = to_device(torch.from_numpy(t), dev)
        table = to_device(torch.arange(B * nb).view(B, nb), dev)
        paged = self.paged_prefill.prefill_layout(list(lens), list(lens), [(0, 0)] * B, slots[:1], table, bs)
        x = self.embed(ids.reshape(-1).index_select(0, rows))  # [M, hidden]
        cos, sin = self.rope(pos.unsqueeze(0))
        cos, sin = cos[0], sin[0]  # [M, D]
        ks = torch.zeros(Hkv, B * tp, D, dtype=x.dtype, device=dev)  # (zero past each length, read by no query)
        vs = torch.empty_like(ks)
        q = self._qk_layers(x, cos, sin, slots, ks, vs, lambda q: self.paged_prefill.paged_prefill_attention(
            q, ks, vs, paged, self.scale).view(q.shape[0], -1))
        if q.shape[0] < B * T:  # (all rows: already in place)
            q = q.new_zeros(B * T, H, D).index_copy_(0, rows, q)
        return q.view(B, T, H, D).transpose(1, 2), ks.view(Hkv, B, tp, D)[:, :, :T].transpose(0, 1)

    def _qk_layers(self, x, cos, sin, slots, ks, vs, attend):
        """The fused small operations' layers over x [M, hidden] up to the last layer's q [M, H, D] (returned):
        each layer writes its keys and values to `slots` of the scratch pair ks, vs [Hkv, slots, D] and attends
        with `attend(q)` -> [M, H * D]."""
        n = len(self.layers)
        return self._fused_layers(x, cos, sin, slots, [ks] * n, [vs] * n, lambda q, kp, vp: attend(q), last_q=True)

    def _fused_layers(self, x, cos, sin, slots, k_pools, v_pools, attend, last_q: bool = False):
        """The fused small operations' layers over x [M, hidden]: layer li writes its keys and values to `slots` of
        k_pools[li], v_pools[li] ([Hkv, slots, D]) and attends with `attend(q, kp, vp)` -> [M, H * D]. Returns the
        last layer's output [M, hidden], or with last_q its q [M, H, D] (before its attention)."""
        fd, c = self.fused_decode, self.c
        delta = None
        for li, layer in enumerate(self.layers):
            kp, vp = k_pools[li], v_pools[li]
            x, h = fd.add_rms_norm(x, delta, layer.input_layernorm.weight, layer.input_layernorm.eps)
            q = fd.rope_write_kv(layer.qkv(h), cos, sin, slots, kp, vp, c.num_heads, c.num_kv_heads)  # [M, H, D]
            if last_q and li == len(self.layers) - 1:
                return q
            x, h = fd.add_rms_norm(x, layer.o(attend(q, kp, vp)), layer.post_attention_layernorm.weight,
                                   layer.post_attention_layernorm.eps)
            delta = layer.down(fd.silu_mul(layer.gate_up(h)))
        return x + delta

    def _last_layer_qk_fused(self, x, cos, sin, mask):
        """last_layer_qk with the fused small operations over its B x T rows and one masked attention call a layer
        (mask [B, 1, T, T]). The rotary + KV-write kernel writes each row's keys and values to a scratch
        [Hkv, B * T, D] pair (row r in slot r), which the layer's attention reads as [B, Hkv, T, D] views; the
        padding rows go through too (their outputs are never read)."""
        c = self.c
        B, T, _ = x.shape
        M, H, Hkv, D = B * T, c.num_heads, c.num_kv_heads, c.head_dim
        x, cos, sin = x.reshape(M, -1), cos.reshape(M, D), sin.reshape(M, D)
        ks = torch.empty(Hkv, M, D, dtype=x.dtype, device=x.device)
        vs = torch.empty_like(ks)

        def attend(q):
            q = q.view(B, T, H, D).transpose(1, 2)
            return masked_attention(q, ks.view(Hkv, B, T, D).transpose(0, 1), vs.view(Hkv, B, T, D).transpose(0, 1),
                                    mask, expand=self.gqa_expand(q.device)).transpose(1, 2).reshape(M, -1)

        q = self._qk_layers(x, cos, sin, torch.arange(M, device=x.device), ks, vs, attend)
        return q.view(B, T, H, D).transpose(1, 2), ks.view(Hkv, B, T, D).transpose(0, 1)

    def _ctx_mask(self, b: AttnBatch):
        """[B, 1, T, S] causal + padding mask of new tokens over the per-sequence context part."""
        B, S = b.ctx_blocks.shape[0], b.ctx_blocks.shape[1] * b.block_size
        kpos = torch.arange(S, device=b.ctx_blocks.device) + b.prefix_len  # absolute position of context entry
        m = (kpos.view(1, 1, S) <= b.positions.unsqueeze(-1)) & (kpos.view(1, 1, S) < (b.ctx_lens + b.prefix_len).view(B, 1, 1))
        return m.unsqueeze(1)

    def _write_kv(self, k, v, b: AttnBatch, kp, vp):
        """k, v: [B, Hkv, T, D] -> pool slots (pool layout [Hkv, num_slots, D])."""
        Hkv, D = k.shape[1], k.shape[3]
        k, v = k.transpose(0, 1).reshape(Hkv, -1, D), v.transpose(0, 1).reshape(Hkv, -1, D)
        if k.shape[1] != b.write_slots.numel():
            # padding to skip (a prefill batch). A decode step (T = 1) has one real token per row: no boolean
            # mask, whose indexing waits for the GPU (a host synchronisation per layer) and cannot be graph-captured;
            # a prefill laid out from host lengths has the real positions as an index (no synchronisation either)
            if b.valid_index is not None:
                k, v = k.index_select(1, b.valid_index), v.index_select(1, b.valid_index)
            else:
                flat = b.valid.reshape(-1)
                k, v = k[:, flat], v[:, flat]
        kp.index_copy_(1, b.write_slots, k)
        vp.index_copy_(1, b.write_slots, v)

    def uses_cascade_prefill(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether prefills on this device attend to their shared prefix as a cascade ($FASTRAG_CASCADE_PREFILL):
        on unless switched off or `lse_attention` failed its self-check here (checked once per device and dtype,
        with a warning and the reason in `cascade_checks` when it fails)."""
        if not self.cascade_prefill:
            return False
        return self._self_checked(self.cascade_checks, self._check_cascade, device, dtype,
                                  "prefix attention without the cascade")

    def _check_cascade(self, device: torch.device, dtype: torch.dtype) -> str:
        """The cascade against the one masked call on a small random problem of this model's heads: "on" when they
        agree, else "off: " and why (a kernel this torch lacks or refuses, or a wrong result)."""
        c = self.c
        H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        B, T, S, P = 2, 5, 9, 7
        g = torch.Generator().manual_seed(0)

        def rnd(*shape):
            return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

        # laid out as the engine's: the prefix a slice of a pool [Hkv, slots, D], the context gathered [Hkv, B, S, D]
        q, pool_k, pool_v = rnd(B, H, T, D), rnd(Hkv, P + 3, D), rnd(Hkv, P + 3, D)
        kpre, vpre = pool_k[:, 2: 2 + P], pool_v[:, 2: 2 + P]
        ks, vs = rnd(Hkv, B, S, D).transpose(0, 1), rnd(Hkv, B, S, D).transpose(0, 1)
        lens = torch.tensor([S, S - 2], device=device)  # the new tokens are each sequence's last T entries
        pos = (lens - T).view(B, 1) + torch.arange(T, device=device)
        m = ((torch.arange(S, device=device).view(1, 1, S) <= pos.unsqueeze(-1))
             & (torch.arange(S, device=device).view(1, 1, S) < lens.view(B, 1, 1))).unsqueeze(1)
        try:
            with torch.inference_mode():
                got = self._cascade_core(q, kpre, vpre, ks, vs, CascadeMask(cascade_bias(m, H // Hkv, dtype),
                                                                             H // Hkv))
                full = torch.cat([m.new_ones(B, 1, T, P), m], dim=-1)
                want = masked_attention(q.float(), torch.cat([kpre.unsqueeze(0).expand(B, -1, -1, -1), ks], 2).float(),
                                        torch.cat([vpre.unsqueeze(0).expand(B, -1, -1, -1), vs], 2).float(), full,
                                        self.scale, expand=True)
        except Exception as e:  # (an op this torch build lacks, or one that refuses these shapes or this dtype)
            return f"off: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        err = (got.float() - want).abs().max().item()
        if not err <= tol:  # (NaN included)
            return f"off: the cascade differed from the masked call by {err:.3g} (tolerance {tol:g})"
        return "on"

    def _cascade_core(self, q, kpre, vpre, ks, vs, cm: CascadeMask):
        """Cascade prefill attention: q [B, H, T, D] over the prefix kpre/vpre [Hkv, P, D] (every new token sees all
        of it: one call for all B*T tokens, no mask) and over its own context ks/vs [B, Hkv, S, D] (causal and
        padding mask `cm.bias`), merged by the two log-sum-exps. The query heads that share a kv head are stacked as
        rows, so neither call repeats keys. Returns [B, H, T, D] in q's dtype."""
        B, H, T, D = q.shape
        Hkv, G = kpre.shape[0], cm.groups
        qg = q.reshape(B, Hkv, G * T, D)  # head h = kv head h // G, row (h % G) * T + t
        o1, l1 = lse_attention(qg.transpose(0, 1).reshape(1, Hkv, B * G * T, D), kpre.unsqueeze(0),
                               vpre.unsqueeze(0), None, self.scale)
        o2, l2 = lse_attention(qg, ks, vs, cm.bias.expand(B, Hkv, G * T, ks.shape[2]), self.scale)
        o1 = o1.reshape(Hkv, B, G * T, D).transpose(0, 1)
        w = torch.sigmoid(l1.reshape(Hkv, B, G * T).transpose(0, 1) - l2).unsqueeze(-1)  # the prefix's share
        return torch.lerp(o2.float(), o1.float(), w).to(q.dtype).reshape(B, H, T, D)

    @staticmethod
    def _prefix_kv(b: AttnBatch, kp, vp):
        """The shared prefix's keys and values [Hkv, P, D] from a layer's pool: a view when its slots are
        consecutive, else gathered."""
        if b.prefix_start >= 0:
            end = b.prefix_start + b.prefix_len
            return kp[:, b.prefix_start: end], vp[:, b.prefix_start: end]
        return kp.index_select(1, b.prefix_slots), vp.index_select(1, b.prefix_slots)

    def _attend_prefill_cascade(self, q, b: AttnBatch, kp, vp, ks, vs, cm: CascadeMask):
        """`_attend_prefill` with the prefix as a cascade (`_cascade_core`); ks/vs: [Hkv, B, S, D] gathered."""
        kpre, vpre = self._prefix_kv(b, kp, vp)
        return self._cascade_core(q, kpre, vpre, ks.transpose(0, 1), vs.transpose(0, 1), cm)

    def _prefill_mask(self, b: AttnBatch, mask_ctx):
        """The prefill attention's mask, built once per forward: with a shared prefix and the cascade in use, a
        `CascadeMask` of the own context alone; else [B, 1, T, P + S] over [prefix | context] (prefix entries
        always visible)."""
        dtype = self.embed.weight.dtype
        if b.prefix_len and self.uses_cascade_prefill(mask_ctx.device, dtype):
            G = self.c.num_heads // self.c.num_kv_heads
            return CascadeMask(cascade_bias(mask_ctx, G, dtype), G)
        B, _, T, _ = mask_ctx.shape
        mask = mask_ctx
        if b.prefix_len:
            mask = torch.cat([mask.new_ones(B, 1, T, b.prefix_len), mask], dim=-1)
        # padding query rows see nothing after masking; let them see key 0 so no row is all -inf (NaN)
        return mask | (~mask.any(-1, keepdim=True) & (torch.arange(mask.shape[-1], device=mask.device) == 0))

    def _attend_prefill(self, q, b: AttnBatch, kp, vp, ks, vs, mask):
        """Many new tokens per sequence. With a `CascadeMask` (the default where the shared prefix's cascade passed
        its self-check): `_attend_prefill_cascade`. Else one fused SDPA call over [prefix | own context], the prefix
        keys copied for every sequence (an explicit-softmax cascade was ~2x slower than this on the CPU; the
        cascade of fused kernels that return their log-sum-exp is not)."""
        if isinstance(mask, CascadeMask):
            return self._attend_prefill_cascade(q, b, kp, vp, ks, vs, mask)
        B, H, T, D = q.shape
        k = ks.transpose(0, 1)  # [B, Hkv, S, D]
        v = vs.transpose(0, 1)
        if b.prefix_len:
            kpre, vpre = self._prefix_kv(b, kp, vp)
            k = torch.cat([kpre.unsqueeze(0).expand(B, -1, -1, -1), k], dim=2)
            v = torch.cat([vpre.unsqueeze(0).expand(B, -1, -1, -1), v], dim=2)
        return masked_attention(q, k, v, mask, self.scale, expand=self.gqa_expand(q.device))

    def paged_decode_op(self, device: torch.device, dtype: torch.dtype):
        """The own-context paged decode attention for tensors of this device/dtype, or None (torch cascade):
        the Triton kernel on CUDA (or on CPU under TRITON_INTERPRET=1 with FASTRAG_DECODE_ATTENTION=triton), the
        C++ kernel for float32 on CPU. Both return (out, lse), so the shared prefixes are merged the same way."""
        if device.type == "cuda" and self.triton_decode is not None:
            return self.triton_decode
        if device.type == "cpu" and self._triton_on_cpu:
            return self.triton_decode
        if device.type == "cpu" and dtype == torch.float32:
            return self.native_decode
        return None

    @property
    def mixes_prefixes(self) -> bool:
        """Whether one decode batch may hold sequences of different shared prefixes (AttnBatch.prefix_groups)."""
        p = self.embed.weight
        return self.paged_decode_op(p.device, p.dtype) is not None

    @staticmethod
    def _prefix_groups(b: AttnBatch) -> list:
        if b.prefix_groups is not None:
            return b.prefix_groups
        return [PrefixGroup(None, b.prefix_len, b.prefix_slots, b.prefix_start)] if b.prefix_len else []

    def _flash_prefix_rows(self, b: AttnBatch, B: int, device: torch.device) -> torch.Tensor | None:
        """[B] int32, each row's index in the step's prefix groups (-1: none), when the flash prefix kernel takes
        this step (FASTRAG_PREFIX_FLASH=1, the fused decode kernels on this device, 1 to MAX_FLASH_PREFIXES prefixes,
        each in consecutive slots); else None. Made on the device from the groups' rows or member masks, so a CUDA
        graph recomputes it on every replay."""
        if not self.prefix_flash or not self.uses_fused_decode(device):
            return None
        groups = self._prefix_groups(b)
        if not groups or len(groups) > FLASH_PREFIXES or any(g.start < 0 for g in groups):
            return None
        rp = torch.full((B,), -1, dtype=torch.int32, device=device)
        for k, g in enumerate(groups):
            if g.rows is not None:
                rp.index_fill_(0, g.rows, k)
            elif g.member is not None:
                rp = torch.where(g.member, torch.full_like(rp, k), rp)
            else:
                rp.fill_(k)
        return rp

    def _decode_native(self, q, b: AttnBatch, kp, vp, want_lse: bool = False):
        """One new token per sequence, q: [B, H, D] -> [B, H, D].

        Each shared prefix is one GEMM for all the sequences that start with it: [Hkv, n*G, D] x [Hkv, D, P], the
        prefix's keys and values read once for the batch (read once per sequence, the prefix is most of the
        traffic of a decode step at batch 32). Each sequence's own tokens go through the paged kernel
        (paged_decode_op: C++ csrc/paged_attn_cpu.cpp on CPU, Triton kernels/paged_attention.py on CUDA), which
        reads them in place from the pool and returns their log-sum-exp; the parts are merged by LSE.
        want_lse: also return the merged row log-sum-exp [B, H].
        """
        B, H, D = q.shape
        Hkv = self.c.num_kv_heads
        G = H // Hkv
        groups = self._prefix_groups(b)
        no_prefix = b.prefix_slots[:0]
        op = self.paged_decode_op(q.device, q.dtype)
        o, lse = op(q, kp, vp, no_prefix, b.ctx_blocks, b.ctx_lens, b.block_size, self.scale)
        if b.prefix_rows is not None and self.uses_fused_decode(q.device):  # every prefix in one launch, merged
            # with the own part (_flash_prefix_rows)
            o, tot = self.fused_decode.prefix_flash_decode(q, kp, vp, [g.start for g in groups],
                                                           [g.length for g in groups], b.prefix_rows, o, lse,
                                                           self.scale)
            return (o, tot) if want_lse else o
        lse_all = lse.clone() if want_lse else None
        fd = self.fused_decode if self.uses_fused_decode(q.device) else None
        for g in groups:
            if g.start >= 0:
                kpre, vpre = kp[:, g.start: g.start + g.length], vp[:, g.start: g.start + g.length]
            else:
                kpre, vpre = kp.index_select(1, g.slots), vp.index_select(1, g.slots)
            qg = q if g.rows is None else q.index_select(0, g.rows)
            n = qg.shape[0]
            member = None if g.member is None else g.member.view(n, 1, 1)
            qh = qg.reshape(n, Hkv, G, D).transpose(0, 1).reshape(Hkv, n * G, D)
            if fd is not None:  # the same arithmetic, with the softmax and the merge as one kernel each
                e, stat = fd.prefix_softmax(torch.matmul(qh, kpre.transpose(1, 2)), self.scale, vpre.dtype)
                merged, tot = fd.prefix_merge(torch.matmul(e, vpre), stat,
                                              o if g.rows is None else o.index_select(0, g.rows),
                                              lse if g.rows is None else lse.index_select(0, g.rows), g.member)
                o = merged if g.rows is None else o.index_copy(0, g.rows, merged)
                if want_lse:
                    if g.member is not None:
                        lse_all = torch.where(g.member.view(n, 1), tot, lse_all)
                    else:
                        lse_all = tot if g.rows is None else lse_all.index_copy(0, g.rows, tot)
                continue
            # softmax and merge in float32 (no-ops for the fp32 CPU path); the GEMMs stay in the model's dtype
            s = torch.matmul(qh, kpre.transpose(1, 2)).float().mul_(self.scale)  # [Hkv, n*G, P]
            mx = s.amax(-1, keepdim=True)
            e = s.sub_(mx).exp_()
            den = e.sum(-1, keepdim=True)
            o_pre = torch.matmul(e.to(vpre.dtype), vpre).float().div_(den)  # [Hkv, n*G, D]
            l_pre = (mx + den.log()).view(Hkv, n, G).transpose(0, 1).reshape(n, H, 1)
            o_pre = o_pre.view(Hkv, n, G, D).transpose(0, 1).reshape(n, H, D)
            o_own = (o if g.rows is None else o.index_select(0, g.rows)).float()
            l_own = (lse if g.rows is None else lse.index_select(0, g.rows)).unsqueeze(-1)
            if member is not None:  # other rows: weight 0 on this prefix, so their output comes through exactly
                l_pre = l_pre.masked_fill(~member, float("-inf"))
            m = torch.maximum(l_pre, l_own)
            w_pre, w_own = (l_pre - m).exp_(), (l_own - m).exp_()
            merged = (o_pre * w_pre + o_own * w_own).div_(w_pre + w_own).to(q.dtype)
            if g.rows is None:
                o = merged
            else:
                o = o.index_copy(0, g.rows, merged)
            if want_lse:
                tot = (m + (w_pre + w_own).log()).squeeze(-1)
                if member is not None:
                    lse_all = torch.where(member.view(n, 1), tot, lse_all)
                else:
                    lse_all = tot if g.rows is None else lse_all.index_copy(0, g.rows, tot)
        return (o, lse_all) if want_lse else o

    def _attend(self, q, b: AttnBatch, kp, vp, mask_ctx, want_lse: bool = False):
        """Cascade attention: the shared prefix once for the batch + each sequence's context, merged by LSE.

        q: [B, H, T, D] -> [B, H, T, D]. Work is laid out per kv head, `[Hkv, B, G*T, .]`, so the gathered
        context keys `[Hkv, B, S, D]` come out of the pool contiguous and the prefix keys `[Hkv, P, D]` are one
        contiguous read for the whole batch. want_lse (decode, T = 1): also return the row log-sum-exp [B, H].
        """
        B, H, T, D = q.shape
        if T == 1 and self.paged_decode_op(q.device, q.dtype) is not None:
            if want_lse:
                o, lse = self._decode_native(q.reshape(B, H, D), b, kp, vp, want_lse=True)
                return o.view(B, H, 1, D), lse
            return self._decode_native(q.reshape(B, H, D), b, kp, vp).view(B, H, 1, D)
        assert b.prefix_groups is None, "sequences of different prefixes decode together only on the native path"
        Hkv = self.c.num_kv_heads
        G = H // Hkv
        bs = b.block_size
        S = b.ctx_blocks.shape[1] * bs
        # gather whole blocks (block_size * D contiguous values each), not single slots
        blk = b.ctx_blocks.reshape(-1)
        ks = kp.view(Hkv, -1, bs, D).index_select(1, blk).view(Hkv, B, S, D)
        vs = vp.view(Hkv, -1, bs, D).index_select(1, blk).view(Hkv, B, S, D)
        if T > 1:
            return self._attend_prefill(q, b, kp, vp, ks, vs, mask_ctx[1])
        qh = q.reshape(B, Hkv, G * T, D).transpose(0, 1)  # [Hkv, B, G*T, D]; heads of a group share keys
        m = mask_ctx.expand(B, G, T, S).reshape(1, B, G * T, S)
        s_ctx = torch.matmul(qh, ks.transpose(-1, -2)).mul_(self.scale).masked_fill_(~m, float("-inf"))
        if b.prefix_len:
            kpre, vpre = self._prefix_kv(b, kp, vp)  # [Hkv, P, D], read once for all sequences
            s_pre = torch.matmul(qh.reshape(Hkv, B * G * T, D), kpre.transpose(-1, -2)).mul_(self.scale)
            s_pre = s_pre.view(Hkv, B, G * T, -1)
            mx = torch.maximum(s_pre.amax(-1, keepdim=True), s_ctx.amax(-1, keepdim=True))
            e_pre, e_ctx = torch.exp(s_pre - mx), torch.exp(s_ctx - mx)
            num = torch.matmul(e_pre.view(Hkv, B * G * T, -1), vpre).view(Hkv, B, G * T, D)
            num = num + torch.matmul(e_ctx, vs)
            den = e_pre.sum(-1, keepdim=True) + e_ctx.sum(-1, keepdim=True)
        else:
            # padding rows are fully masked (bounds of the scores' own dtype: fp16 cannot hold 1e30)
            mx = s_ctx.amax(-1, keepdim=True).clamp_min(torch.finfo(s_ctx.dtype).min)
            e_ctx = torch.exp(s_ctx - mx)
            num = torch.matmul(e_ctx, vs)
            den = e_ctx.sum(-1, keepdim=True).clamp_min(torch.finfo(e_ctx.dtype).tiny)
        o = (num / den).transpose(0, 1).reshape(B, H, T, D)
        if want_lse:  # [Hkv, B, G*T, 1] -> [B, H] (T = 1)
            return o, (mx.float() + den.float().log()).squeeze(-1).transpose(0, 1).reshape(B, H)
        return o
