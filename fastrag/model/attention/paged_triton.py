"""The Triton paged prefill attention (kernels/paged_prefill.py): a packed prefill's or an attention pass's
attention as one launch a layer over all the call's new tokens, their prefixes and their own paged context read in
place, with the fused small operations around it. Runs where $FASTRAG_PAGED_PREFILL allows it and
`check_paged_prefill` passed on the device and dtype. (The Triton paged decode kernel is picked by
attention/paged_native.py `decode_op`: it shares the C++ kernel's (out, lse) interface.)"""

from __future__ import annotations

import numpy as np
import torch

from fastrag.model.attention.batch import AttnBatch
from fastrag.model.attention.checks import describe_failure, verdict
from fastrag.model.attention.fused_decode import fused_layers, qk_layers
from fastrag.transfer import to_device


def check_paged_prefill(model, device: torch.device, dtype: torch.dtype) -> str:
    """The paged prefill kernel against the project's reference (`paged_prefill_ref`, float64) on a random
    problem of the model's heads: a sequence of several query and key tiles after an 80-token prefix, a short
    one of the same prefix and one without, blocks out of order. "on" when they agree, else "off: " and why."""
    c = model.c
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
        pp = model.backends.paged_prefill
        lay = pp.prefill_layout(q_lens, ctx_lens, pre, pre_slots.to(device), table.to(device), bs)
        with torch.inference_mode():
            got = pp.paged_prefill_attention(q.to(device, dtype), kp.to(device, dtype), vp.to(device, dtype),
                                             lay, model.scale).float().cpu()
    except Exception as e:  # (a Triton that cannot compile or launch it here)
        return describe_failure(e)
    from fastrag.signals.reference import paged_prefill_ref

    r = lambda t: t.to(dtype)  # noqa: E731  (the reference reads the inputs the kernel read)
    want = paged_prefill_ref(r(q), r(kp), r(vp), q_lens, ctx_lens, [pre_slots[: n] for _, n in pre], table, bs,
                             model.scale)
    err = (got.double() - want).abs().max().item()
    return verdict(err, dtype, "the kernel differed from the dense computation")


def paged_layout(model, batch: AttnBatch, lens: list[int], device: torch.device):
    """The paged prefill kernel's layout of a packed forward (kernels/paged_prefill.py `prefill_layout`):
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
    return model.backends.paged_prefill.prefill_layout(lens, ctx, pre, pre_slots, batch.ctx_blocks, batch.block_size)


def paged_fused_layers(model, x, cos, sin, write_slots, k_pool, v_pool, paged, out=None):
    """Every layer of a packed prefill with the fused small operations and the paged prefill kernel: x [N, hidden]
    (the embedded tokens), cos, sin [N, D], each token's keys and values written to write_slots [N], `paged`
    its layout (`paged_layout`); out: an [N, H, D] buffer the attention writes into (None: a new one a layer).
    Returns the last layer's output [N, hidden] (before the final norm)."""
    pp = model.backends.paged_prefill
    return fused_layers(model, x, cos, sin, write_slots, k_pool, v_pool, lambda q, kp, vp: (
        pp.paged_prefill_attention(q, kp, vp, paged, model.scale, out=out).view(q.shape[0], -1)))


def last_layer_qk_paged(model, ids, lens: list[int]):
    """last_layer_qk with the fused small operations and the paged prefill kernel as each layer's attention, one
    launch a layer without a mask, over sequence b's first lens[b] rows only, packed (sum(lens) rows through
    every layer; lens [T] * B: all B x T). The keys sit in a scratch pool of 16-slot blocks, sequence b from
    slot b * Tp (T rounded up to a block), and every row attends causally within its own sequence, so a real
    row sees exactly the keys a masked call leaves it. The last layer's q is put back in [B, H, T, D] with
    zeros past each length, as k is."""
    B, T = ids.shape
    if len(lens) != B or any(not 0 < n <= T for n in lens):
        raise ValueError(f"host_lengths must give each of the {B} sequences a length in 1..{T}, got {lens}")
    c = model.c
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
    pp = model.backends.paged_prefill
    paged = pp.prefill_layout(list(lens), list(lens), [(0, 0)] * B, slots[:1], table, bs)
    x = model.embed(ids.reshape(-1).index_select(0, rows))  # [M, hidden]
    cos, sin = model.rope(pos.unsqueeze(0))
    cos, sin = cos[0], sin[0]  # [M, D]
    ks = torch.zeros(Hkv, B * tp, D, dtype=x.dtype, device=dev)  # (zero past each length, read by no query)
    vs = torch.empty_like(ks)
    q = qk_layers(model, x, cos, sin, slots, ks, vs, lambda q: pp.paged_prefill_attention(
        q, ks, vs, paged, model.scale).view(q.shape[0], -1))
    if q.shape[0] < B * T:  # (all rows: already in place)
        q = q.new_zeros(B * T, H, D).index_copy_(0, rows, q)
    return q.view(B, T, H, D).transpose(1, 2), ks.view(Hkv, B, tp, D)[:, :, :T].transpose(0, 1)
