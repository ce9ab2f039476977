"""Last-layer attention statistics for DRAGIN's RIND (a_i) and QFS (Triton).

Decode (docs/architecture.md "Signals"): the main attention kernel already reduced each query row to its log-sum-exp, so
p = exp(q . k * scale - lse) is recomputed for the generated span only (tens to hundreds of keys, not the whole
context) and folded into the running per-head max amax [B, H, S]; the QFS row (all keys, mean over heads) only
when asked. Prefill (reference mode's pass over the generated tokens, and the QFS pass): a flash-style row
log-sum-exp pass, then per key block the column max over rows per head (diagonal included) averaged over heads,
and selected rows' head-mean attention. Only the last layer's attention is ever formed, tile by tile.
Definitions: fastrag.signals.reference (attn_decode_update_ref, causal_attn_colmax_ref, causal_attn_rows_ref).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastrag.kernels import INTERPRETED, device_function, rows_arg

# A prefill statistic normalises each row by scores one kernel formed and divides scores another kernel forms by it,
# so both must round s = q.k * scale the same way. On a GPU Triton fuses a product into the subtraction that
# follows it (enable_fp_fusion, on by default): `dot * scale - m` became one fma, the exact product less m, against
# the rounded product the pass that found m compared, and at the largest score p = exp(r - log l) with r up to half a
# float32 step of s (at |s| ~ 1e6 and a scale that is not a power of two, such as 128 ** -0.5: p up to 1.03).
# `_scaled` is the multiply rounded to nearest that no compiler fuses (libdevice's __nv_fmul_rn, PTX mul.rn.f32);
# the interpreter's numpy multiply rounds each product already and has no libdevice.
if INTERPRETED:
    @device_function
    def _scaled(x, scale):
        return x * scale
else:
    from triton.language.extra import libdevice

    @device_function
    def _scaled(x, scale):
        return libdevice.mul_rn(x, scale)


@triton.jit(do_not_specialize=["sbt_b", "S", "NB"])
def _attn_decode_span_kernel(
    q_ptr, sq_b, sq_h, k_ptr, sk_h, sk_s, bt_ptr, sbt_b, ctx_ptr, start_ptr, lse_ptr, amax_ptr,
    H, G, S, D, NB, NB_POOL, BS, scale,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    n = tl.load(ctx_ptr + i_b)
    s0 = tl.load(start_ptr + i_b)
    lse = tl.load(lse_ptr + i_b * H + i_h)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    # q: [BLOCK_D] new query of (b, h); head dim contiguous (checked by the launcher)
    b_q = tl.load(q_ptr + i_b * sq_b + i_h * sq_h + o_d, mask=m_d, other=0.0).to(tl.float32)
    p_k = k_ptr + (i_h // G).to(tl.int64) * sk_h
    p_amax = amax_ptr + (i_b * H + i_h) * S
    for c0 in range(0, S, BLOCK_S):
        o_s = c0 + tl.arange(0, BLOCK_S)
        pos = s0 + o_s
        # positions outside the context or the block table never touch memory (safe for any lengths on GPU)
        valid = (o_s < S) & (pos >= 0) & (pos < n) & (pos < NB * BS)
        blk = tl.load(bt_ptr + i_b * sbt_b + pos // BS, mask=valid, other=0).to(tl.int64)
        valid = valid & (blk >= 0) & (blk < NB_POOL)
        slot = blk * BS + pos % BS
        # k: [BLOCK_S, BLOCK_D] keys of the span positions, gathered through the block table
        b_k = tl.load(p_k + slot[:, None] * sk_s + o_d[None, :], mask=valid[:, None] & m_d[None, :],
                      other=0.0).to(tl.float32)
        b_p = tl.exp(tl.sum(b_k * b_q[None, :], axis=1) * scale - lse)
        b_old = tl.load(p_amax + o_s, mask=o_s < S, other=0.0)
        tl.store(p_amax + o_s, tl.where(valid, tl.maximum(b_old, b_p), b_old), mask=o_s < S)


@triton.jit(do_not_specialize=["sbt_b", "NB"])
def _attn_decode_row_kernel(
    q_ptr, sq_b, sq_h, k_ptr, sk_h, sk_s, bt_ptr, sbt_b, ctx_ptr, lse_ptr, row_ptr,
    H, G, D, NB, NB_POOL, BS, scale,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1)
    L = NB * BS
    n = tl.load(ctx_ptr + i_b)
    pos = i_s * BLOCK_S + tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    valid = (pos < n) & (pos < L)
    blk = tl.load(bt_ptr + i_b * sbt_b + pos // BS, mask=valid, other=0).to(tl.int64)
    valid = valid & (blk >= 0) & (blk < NB_POOL)
    slot = blk * BS + pos % BS
    acc = tl.zeros([BLOCK_S], tl.float32)
    for h in range(H):
        b_q = tl.load(q_ptr + i_b * sq_b + h * sq_h + o_d, mask=m_d, other=0.0).to(tl.float32)
        # k: [BLOCK_S, BLOCK_D] (heads of one GQA group re-read the same keys from cache)
        b_k = tl.load(k_ptr + (h // G).to(tl.int64) * sk_h + slot[:, None] * sk_s + o_d[None, :],
                      mask=valid[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + i_b * H + h)
        acc += tl.where(valid, tl.exp(tl.sum(b_k * b_q[None, :], axis=1) * scale - lse), 0.0)
    tl.store(row_ptr + i_b * L + pos, acc / H, mask=pos < L)


@triton.jit(do_not_specialize=["T"])
def _causal_lse_kernel(
    q_ptr, sq_b, sq_h, sq_t, k_ptr, sk_b, sk_h, sk_t, len_ptr, lse_ptr,
    H, G, T, D, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    i_bh = tl.program_id(0)
    i_m = tl.program_id(1)
    i_b = (i_bh // H).to(tl.int64)
    i_h = i_bh % H
    n = tl.load(len_ptr + i_b)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    # q: [BLOCK_M, BLOCK_D] query rows of (b, h)
    b_q = tl.load(q_ptr + i_b * sq_b + i_h * sq_h + o_m[:, None] * sq_t + o_d[None, :],
                  mask=(o_m[:, None] < n) & m_d[None, :], other=0.0)
    if UPCAST:
        b_q = b_q.to(tl.float32)
    p_k = k_ptr + i_b * sk_b + (i_h // G) * sk_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    hi = tl.minimum((i_m + 1) * BLOCK_M, n)
    for n0 in range(0, hi, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        # k: [BLOCK_N, BLOCK_D]
        b_k = tl.load(p_k + o_n[:, None] * sk_t + o_d[None, :], mask=(o_n[:, None] < n) & m_d[None, :], other=0.0)
        if UPCAST:
            b_k = b_k.to(tl.float32)
        if IEEE:
            b_s = _scaled(tl.dot(b_q, tl.trans(b_k), input_precision="ieee"), scale)
        else:
            b_s = _scaled(tl.dot(b_q, tl.trans(b_k)), scale)
        ok = (o_n[None, :] <= o_m[:, None]) & (o_n[None, :] < n)
        b_s = tl.where(ok, b_s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(b_s - m_safe[:, None]), axis=1)
        m_i = m_new
    tl.store(lse_ptr + i_bh.to(tl.int64) * T + o_m, m_i + tl.log(l_i), mask=o_m < T)


@triton.jit(do_not_specialize=["T"])
def _causal_colmax_kernel(
    q_ptr, sq_b, sq_h, sq_t, k_ptr, sk_b, sk_h, sk_t, len_ptr, lse_ptr, out_ptr,
    H, G, T, D, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_n = tl.program_id(1)
    n = tl.load(len_ptr + i_b)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    acc = tl.zeros([BLOCK_N], tl.float32)
    for h in range(H):
        # k: [BLOCK_N, BLOCK_D] this program's key columns
        b_k = tl.load(k_ptr + i_b * sk_b + (h // G) * sk_h + o_n[:, None] * sk_t + o_d[None, :],
                      mask=(o_n[:, None] < n) & m_d[None, :], other=0.0)
        if UPCAST:
            b_k = b_k.to(tl.float32)
        b_cm = tl.zeros([BLOCK_N], tl.float32)
        for m0 in range(i_n * BLOCK_N, n, BLOCK_M):  # causal: only rows j >= the first key of the block
            o_m = m0 + tl.arange(0, BLOCK_M)
            b_q = tl.load(q_ptr + i_b * sq_b + h * sq_h + o_m[:, None] * sq_t + o_d[None, :],
                          mask=(o_m[:, None] < n) & m_d[None, :], other=0.0)
            if UPCAST:
                b_q = b_q.to(tl.float32)
            b_lse = tl.load(lse_ptr + (i_b * H + h) * T + o_m, mask=o_m < n, other=0.0)
            if IEEE:
                b_s = _scaled(tl.dot(b_q, tl.trans(b_k), input_precision="ieee"), scale)
            else:
                b_s = _scaled(tl.dot(b_q, tl.trans(b_k)), scale)
            ok = (o_n[None, :] <= o_m[:, None]) & (o_m[:, None] < n) & (o_n[None, :] < n)
            b_p = tl.where(ok, tl.exp(b_s - b_lse[:, None]), 0.0)
            b_cm = tl.maximum(b_cm, tl.max(b_p, axis=0))
        acc += b_cm
    tl.store(out_ptr + i_b * T + o_n, acc / H, mask=o_n < T)


@triton.jit(do_not_specialize=["T", "R", "NR"])
def _causal_row_lse_kernel(
    q_ptr, sq_b, sq_h, sq_t, k_ptr, sk_b, sk_h, sk_t, len_ptr, rows_ptr, ml_ptr,
    H, G, T, D, R, NR,
    scale, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
):
    # log-sum-exp of selected rows' scores for one head, the scores computed exactly as _causal_rows_kernel
    # computes them (same tiles, same elementwise products and sums): its probabilities then sum to 1 to float32
    # rounding at any score size (normalising by the tl.dot scores of _causal_lse_kernel did not: two roundings).
    # Stored as its two parts, the row's largest score m and log(l), [.., 2]: m + log(l) in float32 loses log(l)
    # next to a large m (at |m| ~ 1e6 a float32 step is 0.06, so a row of p = 1 - 4.5e-5 and 4.5e-5 came out as
    # 1 and 4.5e-5); the rows kernel takes exp((s - m) - log(l)), where s - m is exact near the largest score.
    # A program takes ROWS of the NR = B * R selected rows (fastrag.kernels.rows_per_program); a row past NR reads
    # row NR - 1 and writes nothing.
    i_br = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    i_rd = tl.minimum(i_br, NR - 1)
    h = tl.program_id(1)
    i_b = i_rd // R
    n = tl.load(len_ptr + i_b)
    j = tl.load(rows_ptr + i_rd)
    j_last = tl.where((j >= 0) & (j < n), j, -1)
    jj = tl.maximum(j_last, 0)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    # (a row's base pointer first, then the tile's int32 offsets: int64 offsets per element cost registers)
    p_q = q_ptr + i_b * sq_b + h * sq_h + jj * sq_t  # [ROWS]
    b_q = tl.load(p_q[:, None] + o_d[None, :], mask=m_d[None, :], other=0.0).to(tl.float32)  # [ROWS, BLOCK_D]
    p_k = (k_ptr + i_b * sk_b + (h // G) * sk_h)[:, None, None]
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    # (a row's tiles past its own last key add exp(-inf) = 0 to l and leave m as it is: bit for bit the row alone)
    for n0 in range(0, tl.max(j_last, axis=0) + 1, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        ok = (o_n[None, :] <= j_last[:, None]) & (o_n[None, :] < n[:, None])  # [ROWS, BLOCK_N]
        b_k = tl.load(p_k + (o_n[None, :, None] * sk_t + o_d[None, None, :]),
                      mask=ok[:, :, None] & m_d[None, None, :], other=0.0).to(tl.float32)  # [ROWS, BLOCK_N, BLOCK_D]
        s = tl.where(ok, _scaled(tl.sum(b_k * b_q[:, None, :], axis=2), scale), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m_i = m_new
    keep = i_br < NR
    tl.store(ml_ptr + (i_br * H + h) * 2, tl.where(j_last >= 0, m_i, 0.0), mask=keep)
    tl.store(ml_ptr + (i_br * H + h) * 2 + 1, tl.where(j_last >= 0, tl.log(l_i), 0.0), mask=keep)


@triton.jit(do_not_specialize=["T", "R", "NR"])
def _causal_rows_kernel(
    q_ptr, sq_b, sq_h, sq_t, k_ptr, sk_b, sk_h, sk_t, len_ptr, ml_ptr, rows_ptr, out_ptr,
    H, G, T, D, R, NR, scale,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
):
    i_br = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS] (as _causal_row_lse_kernel)
    i_rd = tl.minimum(i_br, NR - 1)
    i_n = tl.program_id(1)
    i_b = i_rd // R
    n = tl.load(len_ptr + i_b)
    j = tl.load(rows_ptr + i_rd)
    j_last = tl.where((j >= 0) & (j < n), j, -1)  # last visible key; -1: the row is outside [0, n), all zeros
    jj = tl.maximum(j_last, 0)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    ok = (o_n[None, :] <= j_last[:, None]) & (o_n[None, :] < n[:, None])  # [ROWS, BLOCK_N]
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for h in range(H):
        p_q = q_ptr + i_b * sq_b + h * sq_h + jj * sq_t  # [ROWS] (base pointers, then int32 offsets)
        b_q = tl.load(p_q[:, None] + o_d[None, :], mask=m_d[None, :], other=0.0).to(tl.float32)  # [ROWS, BLOCK_D]
        # k: [ROWS, BLOCK_N, BLOCK_D]
        p_k = (k_ptr + i_b * sk_b + (h // G) * sk_h)[:, None, None]
        b_k = tl.load(p_k + (o_n[None, :, None] * sk_t + o_d[None, None, :]),
                      mask=ok[:, :, None] & m_d[None, None, :], other=0.0).to(tl.float32)
        m = tl.load(ml_ptr + (i_rd * H + h) * 2)  # (the row's own m and log(l), _causal_row_lse_kernel)
        log_l = tl.load(ml_ptr + (i_rd * H + h) * 2 + 1)
        s = _scaled(tl.sum(b_k * b_q[:, None, :], axis=2), scale)
        acc += tl.where(ok, tl.exp((s - m[:, None]) - log_l[:, None]), 0.0)
    tl.store(out_ptr + i_br[:, None] * T + o_n[None, :], acc / H, mask=(i_br[:, None] < NR) & (o_n[None, :] < T))


def _block_d(D: int) -> int:
    return max(16, triton.next_power_of_2(D))


def attn_decode_update(q, k_cache, block_tables, ctx_lens, span_start, lse, block_size: int, scale: float,
                       amax, row_out, block_s: int = 64) -> None:
    """Launch on validated inputs (checks.check_attn_decode). q [B, H, D], k_cache [Hkv, slots, D],
    block_tables [B, NB], ctx_lens/span_start [B] i64, lse [B, H] f32, amax [B, H, S] f32 (in place),
    row_out [B, NB * block_size] f32 or None."""
    B, H, D = q.shape
    if B == 0:
        return
    if q.stride(2) != 1:
        q = q.contiguous()
    if k_cache.stride(2) != 1:
        raise ValueError("k_cache must have a contiguous head dim (stride 1 in its last dim)")
    lse = lse.contiguous()
    G = H // k_cache.shape[0]
    NB = block_tables.shape[1]
    nb_pool = k_cache.shape[1] // block_size
    S = amax.shape[2]
    BD = _block_d(D)
    ctx_lens, span_start = ctx_lens.contiguous(), span_start.contiguous()
    bt = block_tables.contiguous()  # [B, NB] a few hundred ints: the kernels index it with row stride only
    if S:
        _attn_decode_span_kernel[(B, H)](
            q, q.stride(0), q.stride(1), k_cache, k_cache.stride(0), k_cache.stride(1), bt, bt.stride(0),
            ctx_lens, span_start, lse, amax, H, G, S, D, NB, nb_pool, block_size, scale,
            BLOCK_S=block_s, BLOCK_D=BD, num_warps=4,
        )
    if row_out is not None:
        L = NB * block_size
        _attn_decode_row_kernel[(B, triton.cdiv(L, block_s))](
            q, q.stride(0), q.stride(1), k_cache, k_cache.stride(0), k_cache.stride(1), bt, bt.stride(0),
            ctx_lens, lse, row_out, H, G, D, NB, nb_pool, block_size, scale,
            BLOCK_S=block_s, BLOCK_D=BD, num_warps=4,
        )


def causal_attn_stats(q, k, lengths, scale: float, rows=None, colmax_out=None, rows_out=None,
                      block: int | None = None, rows_per_prog: int | None = None):
    """Launch on validated inputs (checks.check_attention [+ check_rows]). q [B, H, T, D], k [B, Hkv, T, D],
    lengths [B] i64. Writes colmax_out [B, T] f32 if given, rows_out [B, R, T] f32 if `rows` [B, R] is given.
    rows_per_prog: selected rows a program of the two rows kernels takes (a power of two; fastrag.kernels.
    rows_per_program(B * R) by default)."""
    B, H, T, D = q.shape
    if B == 0 or T == 0:
        return
    if q.stride(3) != 1:
        q = q.contiguous()
    if k.stride(3) != 1:
        k = k.contiguous()
    lengths = lengths.contiguous()
    G = H // k.shape[1]
    BD = _block_d(D)
    if block is None:
        block = 64  # interpreter too: fewer, larger numpy tiles
    ieee = q.dtype == torch.float32  # keep float32 inputs out of tf32 (reference-grade error, not 3e-4)
    # bf16/fp16 tiles go to the tensor cores as they are on a GPU; Triton 3.9's interpreter multiplies 16-bit
    # tiles in tl.dot as raw integers (seen here: garbage scores), so there they are upcast first.
    upcast = ieee or INTERPRETED
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    qs = (q.stride(0), q.stride(1), q.stride(2))
    ks = (k.stride(0), k.stride(1), k.stride(2))
    _causal_lse_kernel[(B * H, triton.cdiv(T, block))](
        q, *qs, k, *ks, lengths, lse, H, G, T, D, scale,
        BLOCK_M=block, BLOCK_N=block, BLOCK_D=BD, IEEE=ieee, UPCAST=upcast, num_warps=4,
    )
    if colmax_out is not None:
        _causal_colmax_kernel[(B, triton.cdiv(T, block))](
            q, *qs, k, *ks, lengths, lse, colmax_out, H, G, T, D, scale,
            BLOCK_M=block, BLOCK_N=block, BLOCK_D=BD, IEEE=ieee, UPCAST=upcast, num_warps=4,
        )
    if rows is not None and rows.shape[1]:
        R = rows.shape[1]
        rows = rows.contiguous()
        per = rows_arg(rows_per_prog, B * R, "rows_per_prog")
        row_ml = torch.empty(B * R, H, 2, dtype=torch.float32, device=q.device)  # (m, log l) a row and head
        _causal_row_lse_kernel[(triton.cdiv(B * R, per), H)](
            q, *qs, k, *ks, lengths, rows, row_ml, H, G, T, D, R, B * R, scale,
            BLOCK_N=block, BLOCK_D=BD, ROWS=per, num_warps=4,
        )
        _causal_rows_kernel[(triton.cdiv(B * R, per), triton.cdiv(T, block))](
            q, *qs, k, *ks, lengths, row_ml, rows, rows_out, H, G, T, D, R, B * R, scale,
            BLOCK_N=block, BLOCK_D=BD, ROWS=per, num_warps=4,
        )
