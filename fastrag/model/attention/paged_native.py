"""Paged decode attention (one new token per sequence) through a kernel that reads each sequence's own keys in place
from the pool and returns their log-sum-exp: the C++ kernel (csrc/paged_attn_cpu.cpp) for float32 CPU tensors, the
Triton kernel (kernels/paged_attention.py) for CUDA tensors. Each shared prefix is merged in by its log-sum-exp;
`decode_op` says which kernel serves a device (None: the torch cascade of attention/attend.py)."""

from __future__ import annotations

import torch

from fastrag.model.attention.batch import AttnBatch, prefix_groups
from fastrag.model.attention.select import AttentionBackends


def decode_op(backends: AttentionBackends, device: torch.device, dtype: torch.dtype):
    """The own-context paged decode attention for tensors of this device/dtype, or None (torch cascade):
    the Triton kernel on CUDA (or on CPU under TRITON_INTERPRET=1 with FASTRAG_DECODE_ATTENTION=triton), the
    C++ kernel for float32 on CPU. Both return (out, lse), so the shared prefixes are merged the same way."""
    if device.type == "cuda" and backends.triton_decode is not None:
        return backends.triton_decode
    if device.type == "cpu" and backends.triton_on_cpu:
        return backends.triton_decode
    if device.type == "cpu" and dtype == torch.float32:
        return backends.native_decode
    return None


def decode_paged(model, q, b: AttnBatch, kp, vp, want_lse: bool = False):
    """One new token per sequence, q: [B, H, D] -> [B, H, D].

    Each shared prefix is one GEMM for all the sequences that start with it: [Hkv, n*G, D] x [Hkv, D, P], the
    prefix's keys and values read once for the batch (read once per sequence, the prefix is most of the
    traffic of a decode step at batch 32). Each sequence's own tokens go through the paged kernel
    (`decode_op`), which reads them in place from the pool and returns their log-sum-exp; the parts are merged by
    LSE. want_lse: also return the merged row log-sum-exp [B, H].
    """
    B, H, D = q.shape
    Hkv = model.c.num_kv_heads
    G = H // Hkv
    scale = model.scale
    groups = prefix_groups(b)
    no_prefix = b.prefix_slots[:0]
    op = decode_op(model.backends, q.device, q.dtype)
    o, lse = op(q, kp, vp, no_prefix, b.ctx_blocks, b.ctx_lens, b.block_size, scale)
    fused = model.uses_fused_decode(q.device)
    if b.prefix_rows is not None and fused:  # every prefix in one launch, merged with the own part
        # (fused_decode.flash_prefix_rows)
        o, tot = model.backends.fused_decode.prefix_flash_decode(q, kp, vp, [g.start for g in groups],
                                                                 [g.length for g in groups], b.prefix_rows, o, lse,
                                                                 scale)
        return (o, tot) if want_lse else o
    lse_all = lse.clone() if want_lse else None
    fd = model.backends.fused_decode if fused else None
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
            e, stat = fd.prefix_softmax(torch.matmul(qh, kpre.transpose(1, 2)), scale, vpre.dtype)
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
        s = torch.matmul(qh, kpre.transpose(1, 2)).float().mul_(scale)  # [Hkv, n*G, P]
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
