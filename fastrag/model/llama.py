"""Llama-family decoder (Llama-2/3, Mistral, Qwen2-style q/k/v bias, SmolLM2) over a paged KV cache.

The forward works on a padded batch `[B, T]` of new tokens; each sequence's keys/values live in the paged pool
(`fastrag.cache.KVPool`) and are addressed by slots. Attention is split in two parts that are merged by their
log-sum-exp (cascade attention): the shared demo prefix, read once for the whole batch, and each sequence's own
suffix, gathered from its blocks. The last layer can hand back its queries and keys for the retrieval signals.

This file holds the layers, the weights' loading and the one forward; each attention path is a module of
fastrag/model/attention/ (its __init__ lists them), chosen once when the model is built (`AttentionBackends`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fastrag.model.attention import fused_decode as fused_path
from fastrag.model.attention import packed, paged_triton
from fastrag.model.attention.attend import attend
from fastrag.model.attention.batch import AttnBatch, CascadeMask, PrefixGroup, ctx_mask, real_positions, write_kv
from fastrag.model.attention.cascade import cascade_bias, check_cascade, prefill_mask
from fastrag.model.attention.checks import self_check_key, self_checked
from fastrag.model.attention.fused_decode import FLASH_PREFIXES
from fastrag.model.attention.paged_native import decode_op
from fastrag.model.attention.select import (
    CASCADE_PREFILL_ENV, DECODE_ATTENTION_ENV, FUSED_DECODE_ENV, FUSED_PREFILL_ENV, PAGED_PREFILL_ENV,
    PREFILL_GQA_ENV, PREFIX_FLASH_ENV, SDPA_ENV, SDPA_NAMES, AttentionBackends, ModuleRef, resolve_backends,
    sdpa_backends,
)
from fastrag.model.attention.torch_sdpa import in_sdpa_scope, lse_attention, masked_attention, sdpa_scope
from fastrag.model.linear import Linear

# names other modules import from here (the attention ones live in fastrag/model/attention/)
__all__ = [
    "CASCADE_PREFILL_ENV", "DECODE_ATTENTION_ENV", "FLASH_PREFIXES", "FUSED_DECODE_ENV", "FUSED_PREFILL_ENV",
    "PAGED_PREFILL_ENV", "PREFILL_GQA_ENV", "PREFIX_FLASH_ENV", "SDPA_ENV", "SDPA_NAMES", "SUPPORTED_MODEL_TYPES",
    "AttentionBackends", "AttnBatch", "CascadeMask", "Layer", "LlamaModel", "ModelConfig", "ModuleRef",
    "PrefixGroup", "RMSNorm", "apply_rope", "cascade_bias", "lse_attention", "masked_attention", "rope_inv_freq",
    "sdpa_backends", "sdpa_scope", "self_check_key",
]

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


def rope_inv_freq(hf, head_dim: int) -> tuple[torch.Tensor, float]:
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


def _backend(field: str, doc: str) -> property:
    """A model attribute that reads and sets one field of its `AttentionBackends` (tests and benchmarks switch a
    path on or off on a built model this way; the forward reads `self.backends`)."""
    def get(self):
        return getattr(self.backends, field)

    def put(self, value):
        self.backends = dataclasses.replace(self.backends, **{field: value})

    return property(get, put, doc=doc)


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
        # the attention paths, from the environment's switches, read once here (attention/select.py)
        self.backends: AttentionBackends = resolve_backends()
        # per "device dtype": "on", or "off: why" when the log-sum-exp kernels failed their self-check there
        self.cascade_checks: dict[str, str] = {}
        self.paged_prefill_checks: dict[str, str] = {}  # as cascade_checks, for the paged prefill kernel

    native_decode = _backend("native_decode", "the C++ paged decode attention, or None")
    triton_decode = _backend("triton_decode", "the Triton paged decode attention, or None")
    _triton_on_cpu = _backend("triton_on_cpu", "whether the Triton decode attention serves CPU tensors")
    fused_decode = _backend("fused_decode", "kernels/fused_decode.py, or None")
    _fused_on_cpu = _backend("fused_on_cpu", "whether the fused kernels serve CPU tensors")
    prefix_flash = _backend("prefix_flash", "a decode step's shared prefixes in one flash launch a layer")
    fused_prefill = _backend("fused_prefill", "prefills through the fused small operations")
    expand_gqa = _backend("expand_gqa", "grouped keys repeated to every query head (None: by device)")
    cascade_prefill = _backend("cascade_prefill", "a prefill's shared prefix as a cascade")
    paged_prefill = _backend("paged_prefill", "kernels/paged_prefill.py, or None")
    _paged_prefill_on_cpu = _backend("paged_prefill_on_cpu", "whether the paged prefill kernel serves CPU tensors")


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
        inv_freq, scaling = rope_inv_freq(hf, c.head_dim)
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


    def _load_hf_state_dict(self, sd: dict, dtype, device):
        from fastrag.model.loading import load_hf_state_dict

        load_hf_state_dict(self, sd, dtype, device)

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
        if T > 1 and not in_sdpa_scope():  # a prefill: its masked SDPA calls in one backend scope
            with sdpa_scope():
                return self.forward(ids, batch, k_pool, v_pool, logits_index)
        mixed = batch.prefix_groups is not None and not (T == 1 and self.mixes_prefixes)
        keep = batch.hidden_layer is not None  # (layers' hidden states kept: the unfused loops below)
        if keep:
            batch.hidden = {}
        # a prefill with the fused small operations runs packed: its rows are the real tokens, each written to
        # its own slot by the fused rotary + KV-write kernel (a padded row has no slot)
        if mixed or (T > 1 and not keep and ((B > 1 and self._real_tokens(batch) < self.pack_below * B * T)
                                             or self.uses_fused_prefill(ids.device)
                                             or self.uses_paged_prefill(ids.device, self.embed.weight.dtype))):
            return packed.forward_packed(self, ids, batch, k_pool, v_pool, logits_index)
        if T == 1 and not keep and self.uses_fused_decode(ids.device):
            return fused_path.forward_decode_fused(self, ids, batch, k_pool, v_pool, logits_index)
        x = self.embed(ids)
        cos, sin = self.rope(batch.positions)
        mask_ctx = ctx_mask(batch)
        if T > 1:  # the prefill mask over [prefix | context] is the same for every layer: build it once
            mask_ctx = (mask_ctx, prefill_mask(self, batch, mask_ctx))
            if batch.lens is not None and sum(batch.lens) < B * T:
                batch.valid_index = real_positions(batch.lens, T, ids.device)
        stats_at = len(self.layers) - 1 if batch.last_layer is not None and T == 1 else -1
        for li, layer in enumerate(self.layers):
            q, k, v = layer.project_qk(x, cos, sin)
            write_kv(k, v, batch, k_pool[li], v_pool[li])
            if li == stats_at:
                o, lse = attend(self, q, batch, k_pool[li], v_pool[li], mask_ctx, want_lse=True)
                batch.last_layer.update(q=q[:, :, 0], lse=lse)
            else:
                o = attend(self, q, batch, k_pool[li], v_pool[li], mask_ctx)
            x = x + layer.o(o.transpose(1, 2).reshape(B, T, -1))
            x = layer.mlp(x)
            if keep and li in batch.hidden_layer:
                batch.hidden[li] = x
        x = x.reshape(B * T, -1)
        if logits_index is None:
            logits_index = batch.valid.reshape(-1).nonzero().squeeze(-1)
        if keep:
            batch.hidden = {li: h.reshape(B * T, -1)[logits_index] for li, h in batch.hidden.items()}
        return self.lm_head(self.norm(x[logits_index])).float()

    @staticmethod
    def _real_tokens(batch: AttnBatch) -> int:
        return sum(batch.lens) if batch.lens is not None else int(batch.valid.sum())

    # a prefill batch whose real tokens fill less than this fraction of the padded [B, T] runs packed
    pack_below = 0.85
    # a bucket of the packed prefill's attention (attention/packed.py): sequences of one prefix whose padded grid
    # (count x longest) is at least this full and holds at most this many query tokens (the longest sequence alone
    # may hold more). On a GPU an attention call costs its launches (~8 kernels) more than the padding's FLOPs
    # (attention is ~7% of a 7B prefill's); on a CPU it costs its FLOPs alone, so only sequences of equal length
    # share a bucket there (with 60% fill, one packed forward of 12 random lengths took 1.36x as long on a 2-core
    # CPU)
    bucket_fill = 0.6
    bucket_fill_cpu = 1.0
    bucket_tokens = 4096

    # ------------------------------------------------------------------ which attention path serves a device
    def uses_fused_decode(self, device: torch.device) -> bool:
        """Whether a decode step on this device runs the fused per-layer kernels (kernels/fused_decode.py)."""
        be = self.backends
        return be.fused_decode is not None and (device.type == "cuda" or (device.type == "cpu" and be.fused_on_cpu))

    def uses_fused_prefill(self, device: torch.device) -> bool:
        """Whether prefills and attention passes on this device run the same fused kernels ($FASTRAG_FUSED_PREFILL,
        default: wherever the decode step does)."""
        return self.backends.fused_prefill and self.uses_fused_decode(device)

    def gqa_expand(self, device: torch.device) -> bool:
        """Whether the masked attention on this device repeats grouped keys and values to every query head
        ($FASTRAG_PREFILL_GQA; auto: on CUDA devices)."""
        expand = self.backends.expand_gqa
        return device.type == "cuda" if expand is None else expand

    def uses_paged_prefill(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether a prefill on this device attends through the paged prefill kernel ($FASTRAG_PAGED_PREFILL, auto:
        for CUDA tensors; 1: CPU tensors too, under TRITON_INTERPRET=1) where its self-check passed, run once per
        device and dtype against fastrag.signals.reference.paged_prefill_ref (a warning and the reason in
        `paged_prefill_checks` when it fails: a Triton that cannot compile it there, or a wrong result)."""
        be = self.backends
        if be.paged_prefill is None or not (device.type == "cuda"
                                            or (device.type == "cpu" and be.paged_prefill_on_cpu)):
            return False
        return self_checked(self.paged_prefill_checks, lambda d, t: paged_triton.check_paged_prefill(self, d, t),
                            device, dtype, "the packed prefill's attention without the paged kernel")

    def uses_cascade_prefill(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether prefills on this device attend to their shared prefix as a cascade ($FASTRAG_CASCADE_PREFILL):
        on unless switched off or `lse_attention` failed its self-check here (checked once per device and dtype,
        with a warning and the reason in `cascade_checks` when it fails)."""
        if not self.backends.cascade_prefill:
            return False
        return self_checked(self.cascade_checks, lambda d, t: check_cascade(self.c, self.scale, d, t), device, dtype,
                            "prefix attention without the cascade")

    def paged_decode_op(self, device: torch.device, dtype: torch.dtype):
        """The own-context paged decode attention for tensors of this device/dtype, or None (torch cascade):
        attention/paged_native.py `decode_op`."""
        return decode_op(self.backends, device, dtype)

    @property
    def mixes_prefixes(self) -> bool:
        """Whether one decode batch may hold sequences of different shared prefixes (AttnBatch.prefix_groups)."""
        p = self.embed.weight
        return decode_op(self.backends, p.device, p.dtype) is not None

    # ------------------------------------------------------------------ fixed-shape entry points and passes
    def prefill_static(self, ids, positions, write_slots, paged, rows, k_pool, v_pool, out):
        """A packed prefill whose every input is a tensor of fixed shape (a CUDA graph's, fastrag/cuda_graphs/
        `PrefillGraphs`): ids, positions, write_slots [M] (rows past the real tokens are padding: any token, a
        scratch slot, covered by no tile of `paged`), `paged` a PrefillLayout over fixed buffers, out [M, H, D] the
        attention's buffer, rows [R] the rows whose logits are wanted. Returns logits [R, V] float32. Needs the paged
        prefill kernel and the fused small operations (`uses_paged_prefill`, `uses_fused_prefill`)."""
        x = self.embed(ids)
        cos, sin = self.rope(positions.unsqueeze(0))
        x = paged_triton.paged_fused_layers(self, x, cos[0], sin[0], write_slots, k_pool, v_pool, paged, out=out)
        return self.lm_head(self.norm(x.index_select(0, rows))).float()

    def last_layer_qk_static(self, ids, positions, slots, paged, ks, vs, out):
        """`last_layer_qk` over fixed-shape tensors (a CUDA graph's, fastrag/cuda_graphs/ `PassGraphs`): ids,
        positions, slots [M] (padding rows: any token, a scratch slot, in no tile of `paged`), each row's keys and
        values written to `slots` of the scratch pair ks, vs [Hkv, slots, D], attending through the paged prefill
        kernel with layout `paged` into out [M, H, D]. Returns the last layer's q [M, H, D]; its keys are in ks."""
        x = self.embed(ids)
        cos, sin = self.rope(positions.unsqueeze(0))
        pp = self.backends.paged_prefill
        return fused_path.qk_layers(self, x, cos[0], sin[0], slots, ks, vs, lambda q: pp.paged_prefill_attention(
            q, ks, vs, paged, self.scale, out=out).view(q.shape[0], -1))

    def last_layer_qk(self, ids, lengths, host_lengths: list[int] | None = None):
        """A cache-free causal pass over ids: [B, T] (padded, positions from 0) that stops at the last layer.

        Returns q: [B, H, T, D] and k: [B, Hkv, T, D] of the last layer (what the RIND and QFS signals need);
        no logits are computed. Only each sequence's first lengths[b] rows are meaningful. host_lengths (the same
        lengths as a host list, optional): through the paged prefill kernel only those rows are computed (packed),
        and q and k are zero past them.
        """
        if not in_sdpa_scope():  # its masked SDPA calls in one backend scope
            with sdpa_scope():
                return self.last_layer_qk(ids, lengths, host_lengths)
        B, T = ids.shape
        fused = self.uses_fused_prefill(ids.device)
        if fused and self.uses_paged_prefill(ids.device, self.embed.weight.dtype):  # (no mask: the kernel is causal)
            # (without the host lengths every row goes through, padding included: nothing waits for the device)
            return paged_triton.last_layer_qk_paged(self, ids, [T] * B if host_lengths is None else host_lengths)
        pos = torch.arange(T, device=ids.device).expand(B, T)
        cos, sin = self.rope(pos)
        valid = pos < lengths.to(ids.device).unsqueeze(1)
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        mask = (causal.unsqueeze(0) & valid.unsqueeze(1)).unsqueeze(1)  # [B, 1, T, T]
        x = self.embed(ids)
        if fused:
            return fused_path.last_layer_qk_fused(self, x, cos, sin, mask)
        for layer in self.layers[:-1]:
            q, k, v = layer.project_qk(x, cos, sin)
            o = masked_attention(q, k, v, mask, expand=self.gqa_expand(q.device))
            x = layer.mlp(x + layer.o(o.transpose(1, 2).reshape(B, T, -1)))
        q, k, _ = self.layers[-1].project_qk(x, cos, sin)
        return q, k

