"""Fused decode-step token signals over logits [B, V] in one read (Triton).

Per row: greedy argmax or Gumbel-max sample, entropy of p = softmax(y), ln p of the chosen token, FLARE's
p_chosen and the non-stopword flag of the chosen token (reference: fastrag.signals.reference.decode_signals_ref).
Top-p (nucleus) sampling has its own kernel (_token_signals_top_p_kernel: a radix select of the nucleus
threshold, ten reads of the row).

Split-V layout: a row of 128k logits is one program's worth of bytes but would leave most of the GPU idle at
small B, so each row is cut into NSPLIT slices (B * NSPLIT programs fill the SMs). A slice keeps an online
softmax state relative to its running max m:  s = sum e^{y-m},  u = sum (y-m) e^{y-m},  and the best score with
its index. A second, tiny kernel merges the NSPLIT states of a row:  H = ln s - u / s,  ln p_c = y_c - m - ln s.
The logits are read once (plus one element per row for y_chosen).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastrag.kernels import device_function


@device_function
def _mix32(x):
    # lowbias32 finaliser on uint32 (wrapping multiplies); must match reference.mix32 bit for bit.
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@device_function
def _gumbel_score(b_y, key, o_v):
    # y - ln(-ln u), u = ((hash(key, v) >> 9) + 0.5) * 2^-23: a 23-bit integer + 0.5 is exact in float32, so u is
    # the reference's value and lies in [2^-24, 1 - 2^-24] (never 1.0, whose Gumbel noise would be +inf)
    h = _mix32(key ^ _mix32(o_v.to(tl.uint32)))
    b_u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
    return b_y - tl.log(-tl.log(b_u))


@triton.jit
def _token_signals_partial_kernel(
    x_ptr, stride_xb, stride_xv, keys_ptr, part_ptr, pidx_ptr,
    V, inv_t, SPLIT_LEN, NSPLIT,
    SAMPLE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1)
    v_start = i_s * SPLIT_LEN
    v_end = tl.minimum(v_start + SPLIT_LEN, V)
    o_v0 = tl.arange(0, BLOCK_V)
    if SAMPLE:
        key = tl.load(keys_ptr + i_b).to(tl.uint32)
    m = float("-inf")
    s = 0.0
    u = 0.0
    b_best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    b_best_i = tl.full([BLOCK_V], 2147483647, tl.int32)
    for c0 in range(v_start, v_end, BLOCK_V):
        o_v = c0 + o_v0
        m_v = o_v < v_end
        # x: [BLOCK_V] slice of row i_b; masked lanes read -inf and so weigh nothing
        b_y = tl.load(x_ptr + i_b * stride_xb + o_v.to(tl.int64) * stride_xv, mask=m_v,
                      other=float("-inf")).to(tl.float32) * inv_t
        if SAMPLE:
            b_score = _gumbel_score(b_y, key, o_v)
        else:
            b_score = b_y
        # strict >: within a lane the earlier (lower) index wins ties; NaN never wins
        upd = b_score > b_best
        b_best = tl.where(upd, b_score, b_best)
        b_best_i = tl.where(upd, o_v, b_best_i)
        m_new = tl.maximum(m, tl.max(b_y, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked so far: keep everything at 0
        alpha = tl.exp(m - m_safe)
        b_e = tl.exp(b_y - m_safe)
        # 0 * ln 0 := 0, never (-inf) * 0: also where y - m overflows float32 (d = -inf, e = 0; a tiny temperature)
        b_de = tl.where(b_e > 0, (b_y - m_safe) * b_e, 0.0)
        # u' = r (u + (m - m') s) + sum d e, r = e^{m - m'};  (m - m') s is 0 (not NaN) while s = 0, and the old
        # state weighs 0 when r = 0
        u = tl.where(alpha > 0, alpha * (u + tl.where(s > 0, m - m_safe, 0.0) * s), 0.0) + tl.sum(b_de, axis=0)
        s = alpha * s + tl.sum(b_e, axis=0)
        m = m_new
    best = tl.max(b_best, axis=0)
    best_i = tl.min(tl.where(b_best == best, b_best_i, 2147483647), axis=0)
    p_part = part_ptr + (i_b * NSPLIT + i_s) * 4
    tl.store(p_part + 0, m)
    tl.store(p_part + 1, s)
    tl.store(p_part + 2, u)
    tl.store(p_part + 3, best)
    tl.store(pidx_ptr + i_b * NSPLIT + i_s, best_i)


@triton.jit
def _token_signals_combine_kernel(
    x_ptr, stride_xb, stride_xv, part_ptr, pidx_ptr, chosen_ptr, nonstop_ptr,
    out_chosen_ptr, out_ent_ptr, out_lp_ptr, out_prob_ptr, out_flag_ptr,
    inv_t, NSPLIT, V,
    HAS_CHOSEN: tl.constexpr, HAS_NONSTOP: tl.constexpr, BLOCK_S: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < NSPLIT
    p_part = part_ptr + (i_b * NSPLIT + o_s) * 4
    # partial states of the row: [BLOCK_S] each
    b_m = tl.load(p_part + 0, mask=m_s, other=float("-inf"))
    b_s = tl.load(p_part + 1, mask=m_s, other=0.0)
    b_u = tl.load(p_part + 2, mask=m_s, other=0.0)
    b_best = tl.load(p_part + 3, mask=m_s, other=float("-inf"))
    b_idx = tl.load(pidx_ptr + i_b * NSPLIT + o_s, mask=m_s, other=2147483647)
    m = tl.max(b_m, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    b_r = tl.exp(b_m - m_safe)
    s = tl.sum(b_s * b_r, axis=0)
    u = tl.sum(tl.where(b_r > 0, b_r * (b_u + tl.where(b_s > 0, b_m - m_safe, 0.0) * b_s), 0.0), axis=0)
    best = tl.max(b_best, axis=0)
    if HAS_CHOSEN:  # (checked on the CPU only: clamped so that any value stays inside the row)
        c = tl.minimum(tl.maximum(tl.load(chosen_ptr + i_b), 0), V - 1)
    else:
        # an all -inf row leaves no index: index 0, as the reference
        c = tl.min(tl.where(b_best == best, b_idx, 2147483647), axis=0)
        c = tl.where(c == 2147483647, 0, c).to(tl.int64)
    y_c = tl.load(x_ptr + i_b * stride_xb + c * stride_xv).to(tl.float32) * inv_t
    log_s = tl.log(s)
    lp = y_c - m_safe - log_s
    tl.store(out_chosen_ptr + i_b, c)
    tl.store(out_ent_ptr + i_b, log_s - u / s)
    tl.store(out_lp_ptr + i_b, lp)
    tl.store(out_prob_ptr + i_b, tl.exp(lp))
    if HAS_NONSTOP:
        tl.store(out_flag_ptr + i_b, tl.load(nonstop_ptr + c))


@device_function
def _order_key(y):
    # order-preserving int64 image of float32 y (a < b <=> key(a) < key(b)), in [0, 2^32), -0.0 keyed as +0.0 (one
    # tie group, as in the reference): as csrc order_key
    bits = y.to(tl.uint32, bitcast=True).to(tl.int64)
    bits = tl.where(bits == 0x80000000, 0, bits)
    return tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits + 0x80000000)


@triton.jit
def _token_signals_top_p_kernel(
    x_ptr, stride_xb, stride_xv, keys_ptr, chosen_ptr, nonstop_ptr,
    out_chosen_ptr, out_ent_ptr, out_lp_ptr, out_prob_ptr, out_flag_ptr,
    V, inv_t, top_p,
    SAMPLE: tl.constexpr, HAS_CHOSEN: tl.constexpr, HAS_NONSTOP: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # Nucleus (top-p) sampling and signals of one row (reference decode_signals_ref with top_p < 1). Pass 1: max m
    # and s = sum e^{y-m} (online). Passes 2-9: radix select of K0 = min{K : sum_{key(y) > K} e^{y-m} < top_p s},
    # 4 key bits per pass: a 16-bucket mass histogram of the keys that share the prefix chosen so far, keep the
    # smallest digit whose strictly-larger mass stays below the target. Pass 10: entropy, Gumbel-max draw and
    # ln p_chosen over the nucleus {key >= K0} (it holds the max, so m stays the reference point).
    i_b = tl.program_id(0).to(tl.int64)
    o_v0 = tl.arange(0, BLOCK_V)
    o_d = tl.arange(0, 16)
    row = x_ptr + i_b * stride_xb
    m = float("-inf")
    s = 0.0
    for c0 in range(0, V, BLOCK_V):
        o_v = c0 + o_v0
        b_y = tl.load(row + o_v.to(tl.int64) * stride_xv, mask=o_v < V, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(b_y, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(b_y - m_safe), axis=0)
        m = m_new
    m = tl.where(m == float("-inf"), 0.0, m)
    target = top_p * s
    prefix = tl.zeros([], tl.int64)
    above = tl.zeros([], tl.float32)
    for lvl in tl.static_range(8):
        shift = 28 - 4 * lvl  # constexpr: lvl is a static_range index
        hist = tl.zeros([16], tl.float32)
        for c0 in range(0, V, BLOCK_V):
            o_v = c0 + o_v0
            b_y = tl.load(row + o_v.to(tl.int64) * stride_xv, mask=o_v < V,
                          other=float("-inf")).to(tl.float32) * inv_t
            b_k = _order_key(b_y)
            b_e = tl.where((b_y > float("-inf")) & ((b_k >> (shift + 4)) == prefix), tl.exp(b_y - m), 0.0)
            b_dig = (b_k >> shift) & 15
            hist += tl.sum(tl.where(b_dig[:, None] == o_d[None, :], b_e[:, None], 0.0), axis=0)
        # suffix[d] = sum_{d' > d} hist[d']; the smallest digit with above + suffix < target (15 always qualifies)
        suffix = tl.sum(tl.where(o_d[None, :] > o_d[:, None], hist[None, :], 0.0), axis=1)
        digit = tl.min(tl.where(above + suffix < target, o_d, 15), axis=0)
        above = above + tl.sum(tl.where(o_d == digit, suffix, 0.0), axis=0)
        prefix = prefix * 16 + digit.to(tl.int64)
    if SAMPLE:
        key = tl.load(keys_ptr + i_b).to(tl.uint32)
    sn = 0.0
    un = 0.0
    b_best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    b_best_i = tl.full([BLOCK_V], 2147483647, tl.int32)
    for c0 in range(0, V, BLOCK_V):
        o_v = c0 + o_v0
        b_y = tl.load(row + o_v.to(tl.int64) * stride_xv, mask=o_v < V, other=float("-inf")).to(tl.float32) * inv_t
        b_in = (b_y > float("-inf")) & (_order_key(b_y) >= prefix)
        b_d = tl.where(b_in, b_y - m, 0.0)
        b_e = tl.where(b_in, tl.exp(b_d), 0.0)
        sn += tl.sum(b_e, axis=0)
        un += tl.sum(tl.where(b_e > 0, b_d * b_e, 0.0), axis=0)  # (d = -inf where y - m overflows float32)
        if SAMPLE:
            b_score = _gumbel_score(b_y, key, o_v)
        else:
            b_score = b_y
        b_score = tl.where(b_in, b_score, float("-inf"))
        upd = b_score > b_best
        b_best = tl.where(upd, b_score, b_best)
        b_best_i = tl.where(upd, o_v, b_best_i)
    best = tl.max(b_best, axis=0)
    if HAS_CHOSEN:  # (checked on the CPU only: clamped so that any value stays inside the row)
        c = tl.minimum(tl.maximum(tl.load(chosen_ptr + i_b), 0), V - 1)
    else:
        # an all -inf row leaves no index: index 0, as the reference
        c = tl.min(tl.where(b_best == best, b_best_i, 2147483647), axis=0)
        c = tl.where(c == 2147483647, 0, c).to(tl.int64)
    y_c = tl.load(row + c * stride_xv).to(tl.float32) * inv_t
    c_in = (y_c > float("-inf")) & (_order_key(y_c) >= prefix)
    log_s = tl.log(sn)
    lp = tl.where(c_in, y_c - m - log_s, float("-inf"))
    tl.store(out_chosen_ptr + i_b, c)
    tl.store(out_ent_ptr + i_b, log_s - un / sn)
    tl.store(out_lp_ptr + i_b, lp)
    tl.store(out_prob_ptr + i_b, tl.exp(lp))
    if HAS_NONSTOP:
        tl.store(out_flag_ptr + i_b, tl.load(nonstop_ptr + c))


def num_splits_for(B: int, V: int, block_v: int, device: torch.device) -> int:
    """Slices per row so that B * NSPLIT programs cover the GPU about 4 times over (1 on the CPU interpreter)."""
    n_chunks = triton.cdiv(V, block_v)
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(n_chunks, triton.cdiv(4 * sms, max(B, 1))))


def token_signals(logits: torch.Tensor, temperature: float, rng_keys: torch.Tensor | None,
                  chosen: torch.Tensor | None, nonstop: torch.Tensor | None,
                  out: tuple[torch.Tensor, ...], num_splits: int | None = None, block_v: int | None = None,
                  top_p: float = 1.0, greedy: bool = False) -> None:
    """Launch on validated inputs (fastrag.signals.checks.check_decode_signals did shapes/dtypes/devices).

    logits [B, V] fp32/bf16/fp16 (any strides); temperature 0 = greedy; rng_keys [B] int64 when sampling;
    chosen [B] int64 or None; nonstop [V] bool or None; out = (chosen [B] i64, entropy [B] f32, logprob [B] f32,
    prob [B] f32, flag [B] bool or None), all written. top_p < 1 (with temperature > 0): the nucleus kernel, one
    program per row reading it ten times (no split). greedy: the argmax and the signals of softmax(logits /
    temperature) for a temperature > 0 (no draw, rng_keys unused; the older token_signals contract).

    Every launch turns off Triton's FMA contraction (enable_fp_fusion=False): contracted, `x * inv_t - m` keeps the
    product's rounding error, so the row's maximum got y - m = 9.4e30 at T = 1e-30 on a GPU (a positive
    log-probability, and an infinite weight that made the nucleus pick token 0). The interpreter, which never
    contracts, drops the option.
    """
    B, V = logits.shape
    if B == 0:
        return
    if temperature > 0 and top_p < 1 and not greedy:
        bv = block_v or min(1024, triton.next_power_of_2(V))
        o_chosen, o_ent, o_lp, o_prob, o_flag = out
        sample = chosen is None
        dummy = o_chosen
        _token_signals_top_p_kernel[(B,)](
            logits, logits.stride(0), logits.stride(1), rng_keys.contiguous() if sample else dummy,
            chosen.contiguous() if chosen is not None else dummy,
            nonstop.view(torch.uint8) if nonstop is not None else dummy,
            o_chosen, o_ent, o_lp, o_prob, o_flag.view(torch.uint8) if o_flag is not None else dummy,
            V, 1.0 / temperature, float(top_p),
            SAMPLE=sample, HAS_CHOSEN=chosen is not None, HAS_NONSTOP=nonstop is not None, BLOCK_V=bv,
            num_warps=4, enable_fp_fusion=False,
        )
        return
    if block_v is None:
        block_v = min(4096, triton.next_power_of_2(V))
    nsplit = num_splits if num_splits is not None else num_splits_for(B, V, block_v, logits.device)
    split_len = triton.cdiv(triton.cdiv(V, block_v), nsplit) * block_v
    nsplit = triton.cdiv(V, split_len)  # no empty slice
    sample = temperature > 0 and chosen is None and not greedy
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    part = torch.empty(B, nsplit, 4, dtype=torch.float32, device=logits.device)
    pidx = torch.empty(B, nsplit, dtype=torch.int32, device=logits.device)
    if chosen is not None:
        chosen = chosen.contiguous()
    keys = rng_keys.contiguous() if sample else part  # unused pointer when not sampling
    _token_signals_partial_kernel[(B, nsplit)](
        logits, logits.stride(0), logits.stride(1), keys, part, pidx, V, inv_t, split_len, nsplit,
        SAMPLE=sample, BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4, enable_fp_fusion=False,
    )
    o_chosen, o_ent, o_lp, o_prob, o_flag = out
    nonstop_u8 = nonstop.view(torch.uint8) if nonstop is not None else None
    flag_u8 = o_flag.view(torch.uint8) if o_flag is not None else None
    _token_signals_combine_kernel[(B,)](
        logits, logits.stride(0), logits.stride(1), part, pidx,
        chosen if chosen is not None else pidx, nonstop_u8 if nonstop_u8 is not None else pidx,
        o_chosen, o_ent, o_lp, o_prob, flag_u8 if flag_u8 is not None else pidx,
        inv_t, nsplit, V,
        HAS_CHOSEN=chosen is not None, HAS_NONSTOP=nonstop is not None,
        BLOCK_S=max(16, triton.next_power_of_2(nsplit)), num_warps=1, enable_fp_fusion=False,
    )
