"""The packed prefill: sequences of very different lengths without padding. The projections and the MLP run on the
real tokens packed into one row; attention runs through the paged prefill kernel (attention/paged_triton.py) where
it serves the device, else per bucket of sequences of one prefix and similar lengths (`attention_buckets`), padded
within the bucket only."""

from __future__ import annotations

import torch

from fastrag.model.attention.attend import attend
from fastrag.model.attention.batch import AttnBatch, ctx_mask, real_positions
from fastrag.model.attention.cascade import prefill_mask
from fastrag.model.attention.paged_triton import paged_fused_layers, paged_layout
from fastrag.transfer import tensor_on


def forward_packed(model, ids, batch: AttnBatch, k_pool, v_pool, logits_index=None):
    """Prefill of sequences of very different lengths without padding: the projections and the MLP (most of
    the FLOPs) run on the N real tokens packed into one row; attention runs per bucket of sequences of one
    prefix and similar lengths (`attention_buckets`), padded within the bucket only. Same results as the
    padded forward (each token sees exactly the same keys). Sequences of different shared prefixes
    (`batch.prefix_groups`) are fine here: each sequence attends to its own prefix.
    """
    B, T = ids.shape
    if batch.lens is not None:  # [N] real tokens, row-major (= write_slots order), laid out on the host
        lens = list(batch.lens)
        flat = real_positions(lens, T, ids.device)
    else:
        flat = batch.valid.reshape(-1).nonzero().squeeze(-1)
        lens = batch.valid.sum(1).tolist()
    N = flat.numel()
    x = model.embed(ids.reshape(-1)[flat]).unsqueeze(0)  # [1, N, hidden]
    cos, sin = model.rope(batch.positions.reshape(-1)[flat].unsqueeze(0))
    keep = batch.hidden_layer is not None  # (layers' hidden states kept: the loop below, unfused)
    if keep:
        batch.hidden = {}
    paged = paged_layout(model, batch, lens, ids.device) \
        if not keep and model.uses_paged_prefill(ids.device, model.embed.weight.dtype) else None
    if paged is None:
        buckets = attention_buckets(model, batch, lens)
        singles = all(idx[1] == 1 for idx, _, _ in buckets)
    fd = model.backends.fused_decode if not keep and model.uses_fused_prefill(ids.device) else None
    if fd is not None and paged is not None:  # per layer one attention launch over the tokens' keys in place
        x = paged_fused_layers(model, x[0], cos[0], sin[0], batch.write_slots, k_pool, v_pool, paged)
        rows = torch.arange(N, device=x.device) if logits_index is None else torch.searchsorted(flat, logits_index)
        return model.lm_head(model.norm(x[rows])).float()
    if fd is not None:  # rows: the N tokens; the residual stream and each sublayer's output kept apart
        x, cos, sin, delta = x[0], cos[0], sin[0], None
    for li, layer in enumerate(model.layers):
        kp, vp = k_pool[li], v_pool[li]
        if fd is not None:
            x, h = fd.add_rms_norm(x, delta, layer.input_layernorm.weight, layer.input_layernorm.eps)
            q = fd.rope_write_kv(layer.qkv(h), cos, sin, batch.write_slots, kp, vp, model.c.num_heads,
                                 model.c.num_kv_heads)  # [N, H, D]
            q = q.transpose(0, 1).unsqueeze(0)  # [1, H, N, D]
        else:
            q, k, v = layer.project_qk(x, cos, sin)  # [1, H, N, D], [1, Hkv, N, D]
            kp.index_copy_(1, batch.write_slots, k[0])
            vp.index_copy_(1, batch.write_slots, v[0])
        if paged is not None:
            o = model.backends.paged_prefill.paged_prefill_attention(q[0].transpose(0, 1), kp, vp, paged,
                                                                     model.scale)
            x = layer.mlp(x + layer.o(o.view(1, N, -1)))
            continue
        if singles:  # one sequence a bucket (in packed order): slices of the packed row, concatenated
            o = torch.cat([attend(model, q[:, :, d: d + t_b], bb, kp, vp, m)
                           for (d, _, t_b, *_), bb, m in buckets], dim=2)
        else:
            H, D = q.shape[1], q.shape[3]
            o = torch.empty_like(q)
            for (first, k_b, t_b, gather, real, dst), bb, m in buckets:
                if k_b == 1:  # one sequence: its tokens are a slice of the packed row
                    o[:, :, first: first + t_b] = attend(model, q[:, :, first: first + t_b], bb, kp, vp, m)
                    continue
                qb = q[0].index_select(1, gather).view(H, k_b, t_b, D).transpose(0, 1)  # [k, H, t, D]
                ob = attend(model, qb, bb, kp, vp, m).transpose(0, 1).reshape(H, k_b * t_b, D)
                o[0].index_copy_(1, dst, ob if real is None else ob.index_select(1, real))
        if fd is not None:
            x, h = fd.add_rms_norm(x, layer.o(o[0].transpose(0, 1).reshape(N, -1)),
                                   layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
            delta = layer.down(fd.silu_mul(layer.gate_up(h)))
            continue
        x = x + layer.o(o.transpose(1, 2).reshape(1, N, -1))
        x = layer.mlp(x)
        if keep and li in batch.hidden_layer:
            batch.hidden[li] = x
    if fd is not None:
        x = x + delta
    x = x.reshape(N, -1)
    if logits_index is None:
        rows = torch.arange(N, device=x.device)
    else:  # flat [B*T] indices -> packed rows
        rows = torch.searchsorted(flat, logits_index)
    if keep:
        batch.hidden = {li: h.reshape(N, -1)[rows] for li, h in batch.hidden.items()}
    return model.lm_head(model.norm(x[rows])).float()


def attention_buckets(model, batch: AttnBatch, lens: list[int]) -> list:
    """The packed prefill's attention work, in packed order: [(index, its AttnBatch, its masks)], built once per
    forward. index is (first packed token, k sequences, t = the longest's length, gather [k*t] the packed token
    of each cell of the bucket's padded [k, t] grid, real [n] its cells holding a token (None: all), dst [n]
    their packed positions); the three tensors are None for k = 1 (a slice of the packed row). Per layer a
    bucket is one attention call instead of one per sequence. How full a bucket must be: the model's
    `bucket_fill` (CUDA) or `bucket_fill_cpu`, at most `bucket_tokens` query tokens."""
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
        m = ctx_mask(bb)
        return bb, (m if t == 1 else (m, prefill_mask(model, bb, m)))

    fill = model.bucket_fill if dev.type == "cuda" else model.bucket_fill_cpu
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
            while j < len(rows) and (j - i + 1) * t <= model.bucket_tokens \
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
