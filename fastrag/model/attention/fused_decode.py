"""The forward's small per-layer operations through the fused Triton kernels (kernels/fused_decode.py): residual
add + RMSNorm, rotary embedding with the KV write, SiLU-gated product, and a decode step's shared prefixes in one
flash-decoding launch ($FASTRAG_PREFIX_FLASH). Used for decode steps wherever $FASTRAG_FUSED_DECODE puts them, and
for prefills and attention passes too unless $FASTRAG_FUSED_PREFILL=0."""

from __future__ import annotations

import torch

from fastrag.model.attention.attend import attend as attend_cache
from fastrag.model.attention.batch import AttnBatch, ctx_mask, prefix_groups
from fastrag.model.attention.torch_sdpa import masked_attention

FLASH_PREFIXES = 4  # prefixes one flash launch takes (kernels/fused_decode.py MAX_FLASH_PREFIXES)


def flash_prefix_rows(model, b: AttnBatch, B: int, device: torch.device) -> torch.Tensor | None:
    """[B] int32, each row's index in the step's prefix groups (-1: none), when the flash prefix kernel takes
    this step (FASTRAG_PREFIX_FLASH=1, the fused decode kernels on this device, 1 to MAX_FLASH_PREFIXES prefixes,
    each in consecutive slots); else None. Made on the device from the groups' rows or member masks, so a CUDA
    graph recomputes it on every replay."""
    if not model.backends.prefix_flash or not model.uses_fused_decode(device):
        return None
    groups = prefix_groups(b)
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


def forward_decode_fused(model, ids, batch: AttnBatch, k_pool, v_pool, logits_index=None):
    """forward() for one new token per row with the small operations fused: per layer, residual add + RMSNorm
    (twice), rotary embedding of q and k with k and v written straight into the pool, and SiLU-gated product
    are 4 launches instead of about 35; the GEMMs and the attention are the unfused path's own."""
    fd, c = model.backends.fused_decode, model.c
    B = ids.shape[0]
    x = model.embed(ids[:, 0])  # [B, hidden]
    cos, sin = model.rope(batch.positions)  # [B, 1, D]
    cos, sin = cos[:, 0], sin[:, 0]
    mask_ctx = ctx_mask(batch)
    batch.prefix_rows = flash_prefix_rows(model, batch, B, ids.device)  # (once for all layers)
    stats_at = len(model.layers) - 1 if batch.last_layer is not None else -1
    delta = None
    for li, layer in enumerate(model.layers):
        x, h = fd.add_rms_norm(x, delta, layer.input_layernorm.weight, layer.input_layernorm.eps)
        q = fd.rope_write_kv(layer.qkv(h), cos, sin, batch.write_slots, k_pool[li], v_pool[li],
                             c.num_heads, c.num_kv_heads)  # [B, H, D]
        q4 = q.unsqueeze(2)
        if li == stats_at:
            o, lse = attend_cache(model, q4, batch, k_pool[li], v_pool[li], mask_ctx, want_lse=True)
            batch.last_layer.update(q=q, lse=lse)
        else:
            o = attend_cache(model, q4, batch, k_pool[li], v_pool[li], mask_ctx)
        x, h = fd.add_rms_norm(x, layer.o(o.reshape(B, -1)), layer.post_attention_layernorm.weight,
                               layer.post_attention_layernorm.eps)
        delta = layer.down(fd.silu_mul(layer.gate_up(h)))
    x = x + delta
    if logits_index is None:
        logits_index = batch.valid.reshape(-1).nonzero().squeeze(-1)
    return model.lm_head(model.norm(x[logits_index])).float()


def fused_layers(model, x, cos, sin, slots, k_pools, v_pools, attend, last_q: bool = False):
    """The fused small operations' layers over x [M, hidden]: layer li writes its keys and values to `slots` of
    k_pools[li], v_pools[li] ([Hkv, slots, D]) and attends with `attend(q, kp, vp)` -> [M, H * D]. Returns the
    last layer's output [M, hidden], or with last_q its q [M, H, D] (before its attention)."""
    fd, c = model.backends.fused_decode, model.c
    delta = None
    for li, layer in enumerate(model.layers):
        kp, vp = k_pools[li], v_pools[li]
        x, h = fd.add_rms_norm(x, delta, layer.input_layernorm.weight, layer.input_layernorm.eps)
        q = fd.rope_write_kv(layer.qkv(h), cos, sin, slots, kp, vp, c.num_heads, c.num_kv_heads)  # [M, H, D]
        if last_q and li == len(model.layers) - 1:
            return q
        x, h = fd.add_rms_norm(x, layer.o(attend(q, kp, vp)), layer.post_attention_layernorm.weight,
                               layer.post_attention_layernorm.eps)
        delta = layer.down(fd.silu_mul(layer.gate_up(h)))
    return x + delta


def qk_layers(model, x, cos, sin, slots, ks, vs, attend):
    """The fused small operations' layers over x [M, hidden] up to the last layer's q [M, H, D] (returned):
    each layer writes its keys and values to `slots` of the scratch pair ks, vs [Hkv, slots, D] and attends
    with `attend(q)` -> [M, H * D]."""
    n = len(model.layers)
    return fused_layers(model, x, cos, sin, slots, [ks] * n, [vs] * n, lambda q, kp, vp: attend(q), last_q=True)


def last_layer_qk_fused(model, x, cos, sin, mask):
    """last_layer_qk with the fused small operations over its B x T rows and one masked attention call a layer
    (mask [B, 1, T, T]). The rotary + KV-write kernel writes each row's keys and values to a scratch
    [Hkv, B * T, D] pair (row r in slot r), which the layer's attention reads as [B, Hkv, T, D] views; the
    padding rows go through too (their outputs are never read)."""
    c = model.c
    B, T, _ = x.shape
    M, H, Hkv, D = B * T, c.num_heads, c.num_kv_heads, c.head_dim
    x, cos, sin = x.reshape(M, -1), cos.reshape(M, D), sin.reshape(M, D)
    ks = torch.empty(Hkv, M, D, dtype=x.dtype, device=x.device)
    vs = torch.empty_like(ks)

    def attend(q):
        q = q.view(B, T, H, D).transpose(1, 2)
        return masked_attention(q, ks.view(Hkv, B, T, D).transpose(0, 1), vs.view(Hkv, B, T, D).transpose(0, 1),
                                mask, expand=model.gqa_expand(q.device)).transpose(1, 2).reshape(M, -1)

    q = qk_layers(model, x, cos, sin, torch.arange(M, device=x.device), ks, vs, attend)
    return q.view(B, T, H, D).transpose(1, 2), ks.view(Hkv, B, T, D).transpose(0, 1)
