"""Cascade prefill attention: a prefill's new tokens attend to the shared prefix once for all of them (no mask, the
prefix's keys read once) and to each sequence's own context with its causal mask, the two merged by their
log-sum-exps (`lse_attention`). Used wherever $FASTRAG_CASCADE_PREFILL allows it and `check_cascade` passed on the
device and dtype; otherwise a prefill bucket is one masked call over [prefix | context]."""

from __future__ import annotations

import torch

from fastrag.model.attention.batch import AttnBatch, CascadeMask, prefix_kv
from fastrag.model.attention.checks import describe_failure, verdict
from fastrag.model.attention.torch_sdpa import lse_attention, masked_attention


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


def cascade_core(q, kpre, vpre, ks, vs, cm: CascadeMask, scale: float):
    """Cascade prefill attention: q [B, H, T, D] over the prefix kpre/vpre [Hkv, P, D] (every new token sees all
    of it: one call for all B*T tokens, no mask) and over its own context ks/vs [B, Hkv, S, D] (causal and
    padding mask `cm.bias`), merged by the two log-sum-exps. The query heads that share a kv head are stacked as
    rows, so neither call repeats keys. Returns [B, H, T, D] in q's dtype."""
    B, H, T, D = q.shape
    Hkv, G = kpre.shape[0], cm.groups
    qg = q.reshape(B, Hkv, G * T, D)  # head h = kv head h // G, row (h % G) * T + t
    o1, l1 = lse_attention(qg.transpose(0, 1).reshape(1, Hkv, B * G * T, D), kpre.unsqueeze(0),
                           vpre.unsqueeze(0), None, scale)
    o2, l2 = lse_attention(qg, ks, vs, cm.bias.expand(B, Hkv, G * T, ks.shape[2]), scale)
    o1 = o1.reshape(Hkv, B, G * T, D).transpose(0, 1)
    w = torch.sigmoid(l1.reshape(Hkv, B, G * T).transpose(0, 1) - l2).unsqueeze(-1)  # the prefix's share
    return torch.lerp(o2.float(), o1.float(), w).to(q.dtype).reshape(B, H, T, D)


def attend_prefill_cascade(q, b: AttnBatch, kp, vp, ks, vs, cm: CascadeMask, scale: float):
    """A prefill bucket's attention with the prefix as a cascade (`cascade_core`); ks/vs: [Hkv, B, S, D] gathered."""
    kpre, vpre = prefix_kv(b, kp, vp)
    return cascade_core(q, kpre, vpre, ks.transpose(0, 1), vs.transpose(0, 1), cm, scale)


def prefill_mask(model, b: AttnBatch, mask_ctx):
    """The prefill attention's mask, built once per forward: with a shared prefix and the cascade in use, a
    `CascadeMask` of the own context alone; else [B, 1, T, P + S] over [prefix | context] (prefix entries
    always visible)."""
    dtype = model.embed.weight.dtype
    if b.prefix_len and model.uses_cascade_prefill(mask_ctx.device, dtype):
        G = model.c.num_heads // model.c.num_kv_heads
        return CascadeMask(cascade_bias(mask_ctx, G, dtype), G)
    B, _, T, _ = mask_ctx.shape
    mask = mask_ctx
    if b.prefix_len:
        mask = torch.cat([mask.new_ones(B, 1, T, b.prefix_len), mask], dim=-1)
    # padding query rows see nothing after masking; let them see key 0 so no row is all -inf (NaN)
    return mask | (~mask.any(-1, keepdim=True) & (torch.arange(mask.shape[-1], device=mask.device) == 0))


def check_cascade(c, scale: float, device: torch.device, dtype: torch.dtype) -> str:
    """The cascade against the one masked call on a small random problem of the heads of config `c`: "on" when they
    agree, else "off: " and why (a kernel this torch lacks or refuses, or a wrong result)."""
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
            got = cascade_core(q, kpre, vpre, ks, vs, CascadeMask(cascade_bias(m, H // Hkv, dtype), H // Hkv), scale)
            full = torch.cat([m.new_ones(B, 1, T, P), m], dim=-1)
            want = masked_attention(q.float(), torch.cat([kpre.unsqueeze(0).expand(B, -1, -1, -1), ks], 2).float(),
                                    torch.cat([vpre.unsqueeze(0).expand(B, -1, -1, -1), vs], 2).float(), full,
                                    scale, expand=True)
    except Exception as e:  # (an op this torch build lacks, or one that refuses these shapes or this dtype)
        return describe_failure(e)
    err = (got.float() - want).abs().max().item()
    return verdict(err, dtype, "the cascade differed from the masked call")
