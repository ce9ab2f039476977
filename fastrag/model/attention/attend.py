"""A layer's attention over the paged cache, one entry point for the unfused forward paths: decode steps go to the
paged kernels (attention/paged_native.py) where one serves the device, else to the torch cascade below; prefills
attend per bucket through the cascade (attention/cascade.py) or one masked SDPA call (attention/torch_sdpa.py)."""

from __future__ import annotations

import torch

from fastrag.model.attention import cascade
from fastrag.model.attention.batch import AttnBatch, CascadeMask, prefix_kv
from fastrag.model.attention.paged_native import decode_op, decode_paged
from fastrag.model.attention.torch_sdpa import masked_attention


def attend(model, q, b: AttnBatch, kp, vp, mask_ctx, want_lse: bool = False):
    """Cascade attention: the shared prefix once for the batch + each sequence's context, merged by LSE.

    q: [B, H, T, D] -> [B, H, T, D]. Work is laid out per kv head, `[Hkv, B, G*T, .]`, so the gathered
    context keys `[Hkv, B, S, D]` come out of the pool contiguous and the prefix keys `[Hkv, P, D]` are one
    contiguous read for the whole batch. want_lse (decode, T = 1): also return the row log-sum-exp [B, H].
    mask_ctx: the decode step's context mask, or a prefill's (context mask, `cascade.prefill_mask`).
    """
    B, H, T, D = q.shape
    if T == 1 and decode_op(model.backends, q.device, q.dtype) is not None:
        if want_lse:
            o, lse = decode_paged(model, q.reshape(B, H, D), b, kp, vp, want_lse=True)
            return o.view(B, H, 1, D), lse
        return decode_paged(model, q.reshape(B, H, D), b, kp, vp).view(B, H, 1, D)
    assert b.prefix_groups is None, "sequences of different prefixes decode together only on the native path"
    Hkv = model.c.num_kv_heads
    G = H // Hkv
    bs = b.block_size
    S = b.ctx_blocks.shape[1] * bs
    # gather whole blocks (block_size * D contiguous values each), not single slots
    blk = b.ctx_blocks.reshape(-1)
    ks = kp.view(Hkv, -1, bs, D).index_select(1, blk).view(Hkv, B, S, D)
    vs = vp.view(Hkv, -1, bs, D).index_select(1, blk).view(Hkv, B, S, D)
    if T > 1:
        return attend_prefill(model, q, b, kp, vp, ks, vs, mask_ctx[1])
    qh = q.reshape(B, Hkv, G * T, D).transpose(0, 1)  # [Hkv, B, G*T, D]; heads of a group share keys
    m = mask_ctx.expand(B, G, T, S).reshape(1, B, G * T, S)
    s_ctx = torch.matmul(qh, ks.transpose(-1, -2)).mul_(model.scale).masked_fill_(~m, float("-inf"))
    if b.prefix_len:
        kpre, vpre = prefix_kv(b, kp, vp)  # [Hkv, P, D], read once for all sequences
        s_pre = torch.matmul(qh.reshape(Hkv, B * G * T, D), kpre.transpose(-1, -2)).mul_(model.scale)
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


def attend_prefill(model, q, b: AttnBatch, kp, vp, ks, vs, mask):
    """Many new tokens per sequence. With a `CascadeMask` (the default where the shared prefix's cascade passed
    its self-check): `cascade.attend_prefill_cascade`. Else one fused SDPA call over [prefix | own context], the
    prefix keys copied for every sequence (an explicit-softmax cascade was ~2x slower than this on the CPU; the
    cascade of fused kernels that return their log-sum-exp is not)."""
    if isinstance(mask, CascadeMask):
        return cascade.attend_prefill_cascade(q, b, kp, vp, ks, vs, mask, model.scale)
    B, H, T, D = q.shape
    k = ks.transpose(0, 1)  # [B, Hkv, S, D]
    v = vs.transpose(0, 1)
    if b.prefix_len:
        kpre, vpre = prefix_kv(b, kp, vp)
        k = torch.cat([kpre.unsqueeze(0).expand(B, -1, -1, -1), k], dim=2)
        v = torch.cat([vpre.unsqueeze(0).expand(B, -1, -1, -1), v], dim=2)
    return masked_attention(q, k, v, mask, model.scale, expand=model.gqa_expand(q.device))
