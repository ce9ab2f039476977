"""The one slow, exact reference for every retrieval signal (float64 inside). Tests and benchmarks import it.

Written for clarity, not speed: explicit loops over sequences and heads, slicing to each valid length.
Definitions (docs/architecture.md "Signals", docs/dragin-reference.md "RIND"/"QFS"):

- token signals of a decode step: p = softmax(logits / temperature) over the full vocabulary,
  entropy = -sum_v p_v ln p_v (masked -inf logits contribute 0 * ln 0 = 0), logprob = ln p_chosen,
  argmax = lowest index of the largest logit.
- causal attention of one sequence of length n: A[h, j, i] = softmax_{i <= j}(q[h, j] . k[h // G, i] * scale)
  for 0 <= i <= j < n, G = H / Hkv (grouped-query attention).
"""

from __future__ import annotations

import torch

from fastrag.signals.vocab import is_word_text


def token_signals_ref(logits: torch.Tensor, chosen: torch.Tensor | None = None, temperature: float = 1.0
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(entropy [B] f64, logprob [B] f64, argmax [B] i64) of softmax(logits [B, V] / temperature).

    `chosen` [B] int64 selects the token whose log-probability is returned (the argmax when None).
    A row with no distribution (a NaN or +inf logit, or no finite one) has a NaN entropy; its argmax is any index
    inside the vocabulary (0 here).
    """
    x = logits.to(torch.float64) / temperature  # [B, V]
    B, V = x.shape
    logp = x - torch.logsumexp(x, dim=-1, keepdim=True)
    p = logp.exp()
    # 0 * ln 0 := 0 for masked (-inf) entries; p * logp would be 0 * -inf = NaN there.
    entropy = -torch.where((p > 0) | p.isnan(), p * logp, torch.zeros_like(p)).sum(-1)
    # Lowest index among the maxima, written out rather than trusting argmax's tie rule.
    mx = x.max(dim=-1, keepdim=True).values
    idx = torch.arange(V).expand(B, V)
    argmax = torch.where(x == mx, idx, V).min(dim=-1).values
    argmax = torch.where(argmax == V, 0, argmax)  # (a row with a NaN: no value equals its NaN max)
    pick = argmax if chosen is None else chosen.to(torch.int64)
    logprob = logp.gather(1, pick[:, None])[:, 0]
    return entropy, logprob, argmax


def _causal_probs(q: torch.Tensor, k: torch.Tensor, n: int, scale: float) -> torch.Tensor:
    """A [H, n, n] f64 of one sequence: q [H, T, D], k [Hkv, T, D]; rows j (queries), cols i (keys)."""
    H, Hkv = q.shape[0], k.shape[0]
    group = H // Hkv
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    out = torch.zeros(H, n, n, dtype=torch.float64)
    for h in range(H):
        qh = q[h, :n].to(torch.float64)
        kh = k[h // group, :n].to(torch.float64)
        s = (qh @ kh.T) * scale
        s = s.masked_fill(~causal, float("-inf"))
        out[h] = torch.softmax(s, dim=-1)
    return out


def causal_attn_colmax_ref(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """a [B, T] f64: a[b, i] = mean_h max_{i <= j < n} A[h, j, i] for i < n = lengths[b], 0 for i >= n.

    q: [B, H, T, D], k: [B, Hkv, T, D]. The diagonal j = i is included (DRAGIN reference mode).
    """
    B, _, T, _ = q.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        if n == 0:
            continue
        A = _causal_probs(q[b].cpu(), k[b].cpu(), n, scale)  # [H, n, n]
        out[b, :n] = A.max(dim=1).values.mean(dim=0)  # A[h, j, i] = 0 for j < i, so the max is over j >= i
    return out


def causal_attn_mean_rows_ref(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float
                              ) -> torch.Tensor:
    """M [B, T, T] f64: M[b, j, i] = mean_h A[h, j, i] for i <= j < n, 0 elsewhere (the QFS attention rows)."""
    B, _, T, _ = q.shape
    out = torch.zeros(B, T, T, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        if n:
            out[b, :n, :n] = _causal_probs(q[b].cpu(), k[b].cpu(), n, scale).mean(dim=0)
    return out


def nonstop_table_ref(tokenizer, stopwords: set[str] | None = None) -> torch.Tensor:
    """s [len(tokenizer)] bool: True where a vocabulary piece is a content (non-stop) word piece.

    A piece's text is `convert_tokens_to_string([piece])` with "Ġ"/"▁" removed, stripped and lowercased; it is
    True when that text is non-empty, has a letter or digit (not all punctuation/symbols) and is not a stopword.
    Special tokens are False. Default stopwords: spaCy's English STOP_WORDS.
    """
    if stopwords is None:
        from spacy.lang.en.stop_words import STOP_WORDS

        stopwords = set(STOP_WORDS)
    special = set(tokenizer.all_special_ids)
    V = len(tokenizer)
    out = torch.zeros(V, dtype=torch.bool)
    for i in range(V):
        if i in special:
            continue
        piece = tokenizer.convert_ids_to_tokens(i)
        text = tokenizer.convert_tokens_to_string([piece]).replace("Ġ", "").replace("▁", "").strip().lower()
        out[i] = is_word_text(text) and text not in stopwords
    return out


# ---------------------------------------------------------------- fused decode-step signals (issue 3)
#
# Sampling in one pass over the logits uses the Gumbel-max trick: argmax_v (y_v + g_v) with g_v = -ln(-ln u_v)
# is a draw from softmax(y). u_v comes from a counter-based hash of (row key, v), so every backend (torch, C++,
# Triton, CUDA) draws the same token from the same logits and keys, with no RNG state on the device.

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), without int64 overflow (c split in 16-bit halves)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift / multiply, "lowbias32"); int64 tensor in [0, 2^32) -> same."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def sampling_uniform_ref(rng_keys: torch.Tensor, V: int) -> torch.Tensor:
    """u [B, V] f64 in (0, 1): u[b, v] = ((mix32(key_b ^ mix32(v)) >> 9) + 0.5) / 2^23.

    A 23-bit integer plus one half has 24 significant bits, so every u is exactly a float32 and the float32
    kernels draw from the same u; u lies in [2^-24, 1 - 2^-24], so -ln(-ln u) is finite. (With 24 bits, +0.5
    would round in float32, the largest value to 1.0 and an infinite Gumbel score for a random token.)
    """
    v = mix32(torch.arange(V, dtype=torch.int64))
    h = mix32((rng_keys.to(torch.int64).cpu()[:, None] & _MASK32) ^ v[None, :])
    return ((h >> 9).to(torch.float64) + 0.5) * 2.0**-23


def top_p_nucleus_ref(y: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep [B, V] bool, margin [B] f64) of nucleus (top-p) filtering of softmax(y), y [B, V] float64.

    Token v is kept when the probability mass of the tokens with a strictly larger y is below top_p: the smallest
    set of most likely tokens whose mass reaches top_p, ties at the boundary all kept (HF's TopPLogitsWarper up to
    its tie order). -inf tokens are never kept (for top_p < 1). margin[b] = min over the distinct values of row b
    of |mass strictly above - top_p|: how far the row is from a boundary decision (float32 kernels may keep or
    drop a boundary group differently when it is ~1e-6).
    """
    B, _ = y.shape
    p = torch.softmax(y, dim=-1)
    keep = torch.zeros_like(y, dtype=torch.bool)
    margin = torch.empty(B, dtype=torch.float64)
    for b in range(B):
        vals, inv = torch.unique(y[b], return_inverse=True)  # ascending distinct values
        mass = torch.zeros(len(vals), dtype=torch.float64).scatter_add_(0, inv, p[b])
        above = mass.flip(0).cumsum(0).flip(0) - mass  # mass of the strictly larger values
        keep[b] = (above < top_p)[inv] & (y[b] > float("-inf"))
        margin[b] = (above - top_p).abs().min()
    return keep, margin


def decode_signals_ref(logits: torch.Tensor, temperature: float = 0.0, rng_keys: torch.Tensor | None = None,
                       chosen: torch.Tensor | None = None, nonstop: torch.Tensor | None = None,
                       top_p: float = 1.0, top_k: int = 0) -> dict:
    """The decode-step token signals, float64. logits [B, V]; returns a dict of [B] tensors:

    y = logits (temperature 0: greedy) or logits / temperature; with temperature > 0 and 0 < top_k < V, first every
    logit below the row's k-th largest becomes -inf (ties with it kept: transformers' top-k rule); with temperature
    > 0 and top_p < 1, y is then warped: -inf outside the nucleus of what is left (top_p_nucleus_ref). The order is
    transformers' sampling warpers' (temperature, top-k, top-p). p = softmax(y), the distribution the token is
    drawn from.
    chosen  i64: `chosen` if given; else argmax_v y_v (greedy, lowest index) or, temperature > 0, the Gumbel-max
                 draw argmax_v (y_v - ln(-ln u_v)) with u = sampling_uniform_ref(rng_keys, V) (lowest index on ties).
    entropy f64: -sum_v p_v ln p_v (masked -inf entries contribute 0);  logprob f64: ln p_chosen;
    prob    f64: exp(logprob) (FLARE's token probability);  nonstop bool: nonstop[chosen] (None without a table).
    score   f64: the value whose argmax picked `chosen` (y, or y + Gumbel noise), for tie-aware comparisons.
    margin  f64: top-p boundary margin per row (top_p_nucleus_ref; +inf when no nucleus filtering happened).
    A row holding a NaN logit has no distribution: entropy and logprob NaN (kernels: entropy NaN, logprob not
    finite), chosen any index in [0, V) (here 0 unless given); the engine ends such a generation with an error.
    """
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0: no top-k filtering), got {top_k!r}")
    x = logits.detach().cpu().to(torch.float64)
    B, V = x.shape
    if temperature > 0 and 0 < top_k < V:
        x = x.masked_fill(x < x.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
    y = x if temperature == 0 else x / temperature
    margin = torch.full((B,), float("inf"), dtype=torch.float64)
    if temperature > 0 and top_p < 1:
        keep, margin = top_p_nucleus_ref(y, top_p)
        y = y.masked_fill(~keep, float("-inf"))
    logp = y - torch.logsumexp(y, dim=-1, keepdim=True)
    p = logp.exp()
    entropy = -torch.where((p > 0) | p.isnan(), p * logp, torch.zeros_like(p)).sum(-1)
    if temperature > 0 and chosen is None:
        if rng_keys is None:
            raise ValueError("sampling (temperature > 0) needs rng_keys")
        score = y - torch.log(-torch.log(sampling_uniform_ref(rng_keys, V)))
    else:
        score = y
    mx = score.max(dim=-1, keepdim=True).values
    idx = torch.arange(V).expand(B, V)
    pick = torch.where(score == mx, idx, V).min(dim=-1).values
    pick = torch.where(pick == V, 0, pick)  # (a row with a NaN: no value equals its NaN max)
    if chosen is not None:
        pick = chosen.detach().cpu().to(torch.int64)
    logprob = logp.gather(1, pick[:, None])[:, 0]
    flag = None if nonstop is None else nonstop.detach().cpu().bool()[pick]
    return {"chosen": pick, "entropy": entropy, "logprob": logprob, "prob": logprob.exp(), "nonstop": flag,
            "score": score, "margin": margin}


# ---------------------------------------------------------------- attention statistics (issue 3)


def paged_keys_ref(k_cache: torch.Tensor, block_table: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    """[Hkv, n, D] f64: the first n keys of one sequence from the paged pool k_cache [Hkv, num_slots, D]."""
    pos = torch.arange(n)
    slots = block_table.detach().cpu().to(torch.int64)[pos // block_size] * block_size + pos % block_size
    return k_cache.detach().cpu().to(torch.float64)[:, slots]


def decode_lse_ref(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, ctx_lens: torch.Tensor,
                   block_size: int, scale: float) -> torch.Tensor:
    """lse [B, H] f64: ln sum_i exp(q[b, h] . k_i * scale) over the ctx_lens[b] keys of sequence b (the row
    log-sum-exp a flash-decoding kernel returns, natural log)."""
    B, H, _ = q.shape
    G = H // k_cache.shape[0]
    out = torch.full((B, H), float("-inf"), dtype=torch.float64)
    for b in range(B):
        n = int(ctx_lens[b])
        if n == 0:
            continue
        k = paged_keys_ref(k_cache, block_tables[b], n, block_size)  # [Hkv, n, D]
        for h in range(H):
            s = (k[h // G] @ q[b, h].detach().cpu().to(torch.float64)) * scale
            out[b, h] = torch.logsumexp(s, dim=0)
    return out


def cascade_decode_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, prefix_slots: list,
                       row_prefix: torch.Tensor, ctx_blocks: torch.Tensor, ctx_lens: torch.Tensor, block_size: int,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, D] f64, lse [B, H] f64): one new query per sequence attending, in one softmax, the keys of its
    shared prefix (prefix_slots[row_prefix[b]], a list of pool slots; row_prefix[b] = -1: no prefix) followed by its
    own ctx_lens[b] paged keys; pools [Hkv, num_slots, D], the G = H / Hkv query heads of a group sharing a kv
    head. A row with no key at all gets out = 0 and lse = -inf."""
    B, H, D = q.shape
    G = H // k_pool.shape[0]
    kp, vp = k_pool.detach().cpu().to(torch.float64), v_pool.detach().cpu().to(torch.float64)
    out = torch.zeros(B, H, D, dtype=torch.float64)
    lse = torch.full((B, H), float("-inf"), dtype=torch.float64)
    for b in range(B):
        n = int(ctx_lens[b])
        k_idx = int(row_prefix[b])
        pre = torch.as_tensor(prefix_slots[k_idx] if k_idx >= 0 else [], dtype=torch.int64)
        k = torch.cat([kp[:, pre], paged_keys_ref(k_pool, ctx_blocks[b], n, block_size)], 1)  # [Hkv, P + n, D]
        v = torch.cat([vp[:, pre], paged_keys_ref(v_pool, ctx_blocks[b], n, block_size)], 1)
        if k.shape[1] == 0:
            continue
        for h in range(H):
            s = (k[h // G] @ q[b, h].detach().cpu().to(torch.float64)) * scale
            lse[b, h] = torch.logsumexp(s, dim=0)
            out[b, h] = torch.softmax(s, dim=0) @ v[h // G]
    return out, lse


def attn_decode_update_ref(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                           ctx_lens: torch.Tensor, span_start: torch.Tensor, lse: torch.Tensor, block_size: int,
                           scale: float, amax: torch.Tensor, want_row: bool = False):
    """One decode step of the running attention max (docs/architecture.md "Signals", a_i) and the optional QFS row.

    q [B, H, D] is the new query of each sequence (last layer), k_cache [Hkv, num_slots, D] the paged keys
    (sequence b's key at position i in slot block_tables[b, i // bs] * bs + i % bs), ctx_lens [B] the keys
    the query attends (the new token's own key included), lse [B, H] the row log-sum-exp of that attention.
    p[b, h, i] = exp(q[b, h] . k_i * scale - lse[b, h]).

    Returns (amax' [B, H, S] f64, row [B, L] f64 or None) where for the generated span at positions
    span_start[b] + s:  amax'[b, h, s] = max(amax[b, h, s], p[b, h, span_start[b] + s]) when that position is
    < ctx_lens[b], else amax[b, h, s] unchanged;  row[b, i] = mean_h p[b, h, i] for i < ctx_lens[b], 0 for
    i >= ctx_lens[b] (L = block_tables.shape[1] * bs).
    """
    B, H, _ = q.shape
    S = amax.shape[2]
    G = H // k_cache.shape[0]
    L = block_tables.shape[1] * block_size
    out = amax.detach().cpu().to(torch.float64).clone()
    row = torch.zeros(B, L, dtype=torch.float64) if want_row else None
    for b in range(B):
        n = int(ctx_lens[b])
        if n == 0:
            continue
        k = paged_keys_ref(k_cache, block_tables[b], n, block_size)
        p = torch.empty(H, n, dtype=torch.float64)
        for h in range(H):
            s = (k[h // G] @ q[b, h].detach().cpu().to(torch.float64)) * scale
            p[h] = torch.exp(s - float(lse[b, h]))
        s0 = int(span_start[b])
        m = max(0, min(S, n - s0))
        if m:
            out[b, :, :m] = torch.maximum(out[b, :, :m], p[:, s0:s0 + m])
        if want_row:
            row[b, :n] = p.mean(dim=0)
    return out, row


def causal_attn_rows_ref(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float,
                         rows: torch.Tensor) -> torch.Tensor:
    """R [B, Rn, T] f64: R[b, r] = M[b, rows[b, r]] of causal_attn_mean_rows_ref (head-mean attention of the
    selected query rows); a row index outside [0, lengths[b]) gives a zero row."""
    M = causal_attn_mean_rows_ref(q, k, lengths, scale)
    B, T = M.shape[0], M.shape[1]
    r = rows.detach().cpu().to(torch.int64)
    out = torch.zeros(B, r.shape[1], T, dtype=torch.float64)
    for b in range(B):
        for j, row in enumerate(r[b].tolist()):
            if 0 <= row < int(lengths[b]):
                out[b, j] = M[b, row]
    return out


def paged_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_lens: list[int],
                      ctx_lens: list[int], prefixes: list[torch.Tensor], block_tables: torch.Tensor,
                      block_size: int, scale: float) -> torch.Tensor:
    """out [N, H, D] f64: the prefill attention of packed new tokens over the paged cache (the model's attention,
    not a signal; the reference of kernels/paged_prefill.py).

    q [N, H, D] holds sequence b's q_lens[b] new tokens after those of sequences 0 .. b-1; they are its own tokens
    ctx_lens[b] - q_lens[b] .. ctx_lens[b] - 1. Token j of them attends to its prefix (the keys in slots
    prefixes[b], all of them) and to its own tokens 0 .. ctx_lens[b] - q_lens[b] + j (causal), the own token i in
    slot block_tables[b, i // block_size] * block_size + i % block_size:
    out = softmax(q . k * scale) v over those keys, head h reading kv head h // G."""
    N, H, _ = q.shape
    G = H // k_cache.shape[0]
    vf = v_cache.detach().cpu().to(torch.float64)
    qf = q.detach().cpu().to(torch.float64)
    out = torch.empty(N, H, q.shape[2], dtype=torch.float64)
    row = 0
    for b, (n, c) in enumerate(zip(q_lens, ctx_lens)):
        pre = prefixes[b].detach().cpu().to(torch.int64)
        own_k = paged_keys_ref(k_cache, block_tables[b], c, block_size)  # [Hkv, c, D]
        own_v = paged_keys_ref(v_cache, block_tables[b], c, block_size)
        k_all = torch.cat([k_cache.detach().cpu().to(torch.float64)[:, pre], own_k], dim=1)
        v_all = torch.cat([vf[:, pre], own_v], dim=1)
        for j in range(n):
            seen = pre.numel() + c - n + j + 1  # the prefix, then own tokens up to this one
            for h in range(H):
                s = (k_all[h // G, :seen] @ qf[row + j, h]) * scale
                out[row + j, h] = torch.softmax(s, dim=0) @ v_all[h // G, :seen]
        row += n
    return out
