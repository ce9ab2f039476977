"""Fast PyTorch implementation of the signals: float32 math, batched, no Python loop over tokens or heads.

Runs on any device torch supports. Inputs are assumed validated (fastrag.signals.checks); the `SignalBackend`
returned by `fastrag.signals.get_backend("torch")` validates before calling these.
"""

from __future__ import annotations

import torch


def token_signals(logits: torch.Tensor, chosen: torch.Tensor | None = None, temperature: float = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(entropy [B] f32, logprob [B] f32, argmax [B] i64) of p = softmax(logits [B, V] / temperature).

    entropy = -sum_v p_v ln p_v with masked (-inf) logits contributing 0; logprob = ln p_chosen (chosen [B]
    int64, the argmax when None); argmax = lowest index of the largest logit.
    """
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    logp = x - torch.logsumexp(x, dim=-1, keepdim=True)  # [B, V]
    p = logp.exp()
    # 0 * ln 0 := 0; p * logp is 0 * -inf = NaN on masked entries. A NaN p (a NaN or +inf logit, an all -inf
    # row) stays NaN: such a row has no distribution.
    entropy = -torch.where((p > 0) | p.isnan(), p * logp, 0.0).sum(-1)
    argmax = logits.argmax(dim=-1)  # torch returns the first maximal index
    pick = argmax if chosen is None else chosen
    logprob = logp.gather(1, pick[:, None])[:, 0]
    return entropy, logprob, argmax


def causal_attn_probs(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """A [B, H, T, T] f32: A[b, h, j, i] = softmax_{i <= j}(q[b,h,j] . k[b,h//G,i] * scale) for i <= j < n_b, else 0.

    q: [B, H, T, D], k: [B, Hkv, T, D], G = H / Hkv. The GQA group is a broadcast dim, so k is never copied.
    """
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    qg = q.float().reshape(B, Hkv, H // Hkv, T, D)  # head h = kv * G + g
    kg = k.float()[:, :, None]  # [B, Hkv, 1, T, D]
    s = torch.matmul(qg, kg.transpose(-1, -2)).reshape(B, H, T, T) * scale  # [B, H, T(j), T(i)]
    pos = torch.arange(T, device=q.device)
    valid_col = pos[None, :] < lengths[:, None]  # [B, T]: key i < n
    valid_row = pos[None, :] < lengths[:, None]  # [B, T]: query j < n
    causal = pos[None, :] <= pos[:, None]  # [T(j), T(i)]
    mask = causal[None] & valid_col[:, None, :]  # [B, T, T]
    s = s.masked_fill(~mask[:, None], float("-inf"))
    A = torch.softmax(s, dim=-1)
    # Padded rows (j >= n) may be all -inf (n = 0) and so NaN: select, never multiply, to drop them.
    return torch.where(valid_row[:, None, :, None], A, 0.0)


def causal_attn_colmax(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """a [B, T] f32: a[b, i] = mean_h max_{i <= j < n} A[b, h, j, i] for i < n, 0 for i >= n (n = lengths[b])."""
    if q.shape[0] == 0 or q.shape[2] == 0:
        return torch.zeros(q.shape[0], q.shape[2], dtype=torch.float32, device=q.device)
    return causal_attn_probs(q, k, lengths, scale).amax(dim=2).mean(dim=1)


def causal_attn_mean_rows(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """M [B, T, T] f32: M[b, j, i] = mean_h A[b, h, j, i] (zeros outside i <= j < n): QFS attention rows."""
    return causal_attn_probs(q, k, lengths, scale).mean(dim=1)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    from fastrag.signals.reference import mix32

    return mix32(x)


def sampling_gumbel(rng_keys: torch.Tensor, V: int) -> torch.Tensor:
    """g [B, V] f32 = -ln(-ln u), u from the counter hash of (key, v) (same bits as reference.sampling_uniform_ref)."""
    v = _mix32(torch.arange(V, dtype=torch.int64, device=rng_keys.device))
    h = _mix32((rng_keys[:, None] & 0xFFFFFFFF) ^ v[None, :])
    u = ((h >> 9).to(torch.float32) + 0.5) * 2.0**-23
    return -torch.log(-torch.log(u))


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """logits [B, V] (any float dtype, any device) with -inf below each row's k-th largest value (ties with it
    kept; reference.decode_signals_ref). A new tensor; no host synchronisation (CUDA-graph safe)."""
    kth = logits.topk(top_k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(y: torch.Tensor, top_p: float) -> torch.Tensor:
    """y [B, V] f32 with -inf outside each row's nucleus (reference.top_p_nucleus_ref: keep the tokens whose
    strictly-more-likely tokens hold less than top_p of the mass; boundary ties all kept). One sort per row."""
    srt, _ = y.sort(dim=-1, descending=True)
    p = torch.softmax(srt.double(), dim=-1)  # float64: a float32 running sum over 100k+ entries drifts ~1e-5
    n_keep = ((p.cumsum(-1) - p) < top_p).sum(-1, keepdim=True).clamp(min=1)  # a prefix of the sorted row
    tau = srt.gather(1, n_keep - 1)  # the smallest kept value: every tie of it stays
    return y.masked_fill(y < tau, float("-inf"))


def decode_signals(logits: torch.Tensor, temperature: float, rng_keys: torch.Tensor | None,
                   chosen: torch.Tensor | None, nonstop: torch.Tensor | None, top_p: float = 1.0):
    """(chosen [B] i64, entropy [B] f32, logprob [B] f32, prob [B] f32, flag [B] bool | None); see
    reference.decode_signals_ref. Greedy at temperature 0, Gumbel-max sampling from softmax(logits / T) above,
    restricted to the top-p nucleus when top_p < 1."""
    y = logits.float()
    if temperature > 0:
        y = y / temperature
        if top_p < 1:
            y = top_p_filter(y, top_p)
    # On the CPU, with z = y - max and s = sum e^z: H = ln s - sum(e^z z) / s and ln p_c = z_c - ln s. Five passes
    # over the row instead of the ten of logsumexp, log-softmax, p, p ln p and argmax apart (on the CPU the decode
    # step's signals took more time than the model's projections for a small model). Rows whose max is not finite
    # (all -inf, +inf or NaN) take the reference's formula (_decode_slow), as does every row elsewhere: picking
    # them out looks at the rows on the host, a sync on a GPU.
    fast = y.device.type == "cpu"
    m = None
    if chosen is None and temperature <= 0 and fast:
        m, chosen = y.max(dim=-1, keepdim=True)  # the max and its first index, in one pass
        chosen = chosen[:, 0]
    elif chosen is None:
        chosen = (y + sampling_gumbel(rng_keys, y.shape[1]) if temperature > 0 else y).argmax(dim=-1)  # first max
    if fast:
        m = y.amax(dim=-1, keepdim=True) if m is None else m
        z = y - m
        e = z.exp()
        s = e.sum(-1)
        log_s = s.log()
        entropy = log_s - (e * z).nansum(-1) / s  # (e^z z = 0 * -inf = NaN for -inf logits: they contribute 0)
        logprob = z.gather(1, chosen[:, None])[:, 0] - log_s
        bad = ~torch.isfinite(m[:, 0])
        if bool(bad.any()):
            entropy[bad], logprob[bad] = _decode_slow(y[bad], chosen[bad])
    else:
        entropy, logprob = _decode_slow(y, chosen)
    flag = None if nonstop is None else nonstop[chosen]
    return chosen, entropy, logprob, logprob.exp(), flag


def _decode_slow(y: torch.Tensor, chosen: torch.Tensor):
    """(entropy, ln p_chosen) by the reference's formula: any row, whatever its values (a NaN logit: NaN)."""
    logp = y - torch.logsumexp(y, dim=-1, keepdim=True)
    p = logp.exp()
    return -torch.where((p > 0) | p.isnan(), p * logp, 0.0).sum(-1), logp.gather(1, chosen[:, None])[:, 0]


def _paged_scores(q, k_cache, block_tables, pos, block_size: int, scale: float):
    """s [B, H, P] f32 = q . k * scale for key positions pos [B, P] (clamped into the table; callers mask)."""
    B, H, D = q.shape
    Hkv = k_cache.shape[0]
    NB = block_tables.shape[1]
    nb_pool = k_cache.shape[1] // block_size
    pos = pos.clamp(0, NB * block_size - 1)
    blk = block_tables.long().gather(1, pos // block_size).clamp(0, nb_pool - 1)
    slots = blk * block_size + pos % block_size  # [B, P]
    P = pos.shape[1]
    keys = k_cache[:, slots.reshape(-1)].reshape(Hkv, B, P, D).float()  # [Hkv, B, P, D]
    qg = q.float().reshape(B, Hkv, H // Hkv, D).permute(1, 0, 2, 3)  # [Hkv, B, G, D]
    s = torch.matmul(qg, keys.transpose(-1, -2)) * scale  # [Hkv, B, G, P]
    return s.permute(1, 0, 2, 3).reshape(B, H, P)


def attn_decode_update(q, k_cache, block_tables, ctx_lens, span_start, lse, block_size: int, scale: float,
                       amax, row_out):
    """In place: amax [B, H, S] = max(amax, p over the generated span); row_out [B, L] = mean_h p (0 past ctx_lens).
    p = exp(q . k * scale - lse); see reference.attn_decode_update_ref. Only the span's keys are gathered unless
    the QFS row is wanted."""
    B = q.shape[0]
    S = amax.shape[2]
    L = block_tables.shape[1] * block_size
    nb_pool = k_cache.shape[1] // block_size
    if S:
        pos = span_start[:, None] + torch.arange(S, device=q.device)[None, :]  # [B, S]
        blk_ok = block_tables.long().gather(1, pos.clamp(0, L - 1) // block_size)
        ok = (pos < ctx_lens[:, None]) & (pos < L) & (blk_ok >= 0) & (blk_ok < nb_pool)
        p = torch.exp(_paged_scores(q, k_cache, block_tables, pos, block_size, scale) - lse[:, :, None])
        amax.copy_(torch.where(ok[:, None, :], torch.maximum(amax, p), amax))
    if row_out is not None:
        pos = torch.arange(L, device=q.device).expand(B, L)
        blk_ok = block_tables.long().gather(1, pos // block_size)
        ok = (pos < ctx_lens[:, None]) & (blk_ok >= 0) & (blk_ok < nb_pool)
        p = torch.exp(_paged_scores(q, k_cache, block_tables, pos, block_size, scale) - lse[:, :, None])
        row_out.copy_(torch.where(ok[:, None, :], p, 0.0).mean(dim=1))
    return amax, row_out


def causal_attn_rows(q, k, lengths, scale: float, rows):
    """R [B, Rn, T] f32: head-mean causal attention of the selected query rows (zeros for rows outside [0, n))."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    if B == 0 or T == 0 or rows.shape[1] == 0:
        return torch.zeros(B, rows.shape[1], T, dtype=torch.float32, device=q.device)
    r = rows.clamp(0, max(T - 1, 0))
    qs = q.float().gather(2, r[:, None, :, None].expand(B, H, r.shape[1], D))  # [B, H, Rn, D]
    qg = qs.reshape(B, Hkv, H // Hkv, -1, D)
    s = torch.matmul(qg, k.float()[:, :, None].transpose(-1, -2)).reshape(B, H, -1, T) * scale
    i = torch.arange(T, device=q.device)
    ok_row = (rows >= 0) & (rows < lengths[:, None])  # [B, Rn]
    mask = (i[None, None, :] <= rows[:, :, None]) & (i[None, None, :] < lengths[:, None, None]) & ok_row[..., None]
    s = s.masked_fill(~mask[:, None], float("-inf"))
    A = torch.softmax(s, dim=-1)
    return torch.where(ok_row[:, None, :, None], A, 0.0).mean(dim=1)
