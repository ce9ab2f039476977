"""The small per-layer operations of a decode step, fused (Triton): residual add + RMSNorm, rotary embedding + the
KV-cache write, SiLU-gated multiply, and a shared prefix's softmax and log-sum-exp merge.

A decode step is mostly a few large GEMMs per layer, but torch runs each layer's two RMSNorms (8 kernels each in
bf16: cast, square, mean, add, rsqrt, scale, cast back, weight), rotary embedding of q and k (5 each), KV-cache
write (4), residual adds and SiLU product as about 35 separate small kernels beside its 4 GEMMs and the attention:
some 41 launches per layer, 1,300 per step on a 32-layer model. Inside a CUDA graph each small one still costs
microseconds, and a Llama-2-7B-shaped step at batch 1 took well above its weight-read floor
(benchmarks/results/README.md). These three kernels do that small work in 4 launches per layer (10 launches per
layer in all); bench_decode's "unfused layers" column times the same step without them. Each kernel rounds to the
model's dtype wherever torch's separate ops round, so the fused step decodes what the unfused one does up to the
order of a float32 sum.

    add_rms_norm(x, delta, w, eps) -> (x + delta, rmsnorm(x + delta) * w)    x, delta: [M, N]; delta may be None
    rope_write_kv(qkv, cos, sin, slots, k_pool, v_pool, H, Hkv) -> q [M, H, D]   (rotated k, v written to the pool)
    silu_mul(gate_up) -> silu(gate) * up                                     gate_up: [M, 2I] -> [M, I]
    prefix_softmax(s, scale, dtype) -> (e, (max, sum))        s: [Hkv, R, P] scores of a shared prefix's keys
    prefix_merge(e @ v, stat, o_own, lse_own, member) -> (o, lse)    the prefix part merged with the own part
    prefix_flash_decode(q, pools, starts, lengths, row_prefix, o_own, lse_own) -> (o, lse)
                                             every shared prefix in one flash-decoding launch, merged with the own part
                                             ($FASTRAG_PREFIX_FLASH=1; the two above otherwise)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastrag.kernels import INTERPRETED, rows_arg
from fastrag.kernels.paged_attention import online_softmax_tile


@triton.jit(do_not_specialize=["M"])
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, res_ptr, out_ptr, M, N, eps,
                         stride_x, stride_d, stride_r, stride_o,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]  # [ROWS, 1]
    cols = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    m = (rows < M) & (cols < N)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=m, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + rows * stride_d + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(res_ptr.dtype.element_ty)  # rounded as torch's add
        tl.store(res_ptr + rows * stride_r + cols, x, mask=m)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / N + eps)  # [ROWS]
    y = (xf * rstd[:, None]).to(out_ptr.dtype.element_ty)  # torch: normalise in fp32, round to the model dtype ...
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)  # ... then scale by the weight
    tl.store(out_ptr + rows * stride_o + cols, out, mask=m)


@triton.jit(do_not_specialize=["M"])
def _rope_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, M,
                          stride_row, stride_cos, stride_sin, stride_qm, stride_qh,
                          stride_kh, stride_ks, stride_vh, stride_vs,
                          H, Hkv, HALF: tl.constexpr, HALF_PAD: tl.constexpr, ROWS: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]  # [ROWS, 1]
    rm = rows < M
    # 0..H-1: query heads; H..H+Hkv-1: key heads (the program also copies the value head); int64: a head's offset
    # in a pool of more than 2**31 elements
    head = tl.program_id(1).to(tl.int64)
    o = tl.arange(0, HALF_PAD)[None, :]  # [1, HALF_PAD]
    m = rm & (o < HALF)
    D = 2 * HALF
    c1 = tl.load(cos_ptr + rows * stride_cos + o, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + rows * stride_cos + HALF + o, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + rows * stride_sin + o, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + rows * stride_sin + HALF + o, mask=m, other=0.0).to(tl.float32)
    base = qkv_ptr + rows * stride_row + head * D
    x1 = tl.load(base + o, mask=m, other=0.0)
    x2 = tl.load(base + HALF + o, mask=m, other=0.0)
    dt = x1.dtype
    # rotate-half: out = x * cos + cat(-x2, x1) * sin, each product rounded to the dtype as torch's ops round them
    y1 = ((x1.to(tl.float32) * c1).to(dt).to(tl.float32) + (-(x2.to(tl.float32)) * s1).to(dt).to(tl.float32)).to(dt)
    y2 = ((x2.to(tl.float32) * c2).to(dt).to(tl.float32) + (x1.to(tl.float32) * s2).to(dt).to(tl.float32)).to(dt)
    if head < H:
        dst = q_ptr + rows * stride_qm + head * stride_qh
        tl.store(dst + o, y1, mask=m)
        tl.store(dst + HALF + o, y2, mask=m)
    else:
        kh = head - H
        slot = tl.load(slot_ptr + rows, mask=rm, other=0).to(tl.int64)
        dst = k_ptr + kh * stride_kh + slot * stride_ks
        tl.store(dst + o, y1, mask=m)
        tl.store(dst + HALF + o, y2, mask=m)
        vsrc = qkv_ptr + rows * stride_row + (H + Hkv + kh) * D
        vdst = v_ptr + kh * stride_vh + slot * stride_vs
        tl.store(vdst + o, tl.load(vsrc + o, mask=m, other=0.0), mask=m)
        tl.store(vdst + HALF + o, tl.load(vsrc + HALF + o, mask=m, other=0.0), mask=m)


@triton.jit(do_not_specialize=["M"])
def _silu_mul_kernel(x_ptr, out_ptr, M, I, stride_x, stride_o, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]  # [ROWS, 1]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]  # [1, BLOCK]
    m = (rows < M) & (cols < I)
    g = tl.load(x_ptr + rows * stride_x + cols, mask=m, other=0.0)
    u = tl.load(x_ptr + rows * stride_x + I + cols, mask=m, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # torch's silu, rounded to the dtype before the product
    tl.store(out_ptr + rows * stride_o + cols, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=m)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{name}: expected a 2-D tensor with contiguous rows, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    return x


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                 rows: int | None = None):
    """(x + delta, RMSNorm(x + delta) * weight) in one pass; with delta None, (x, RMSNorm(x) * weight).

    rows: rows a program normalises (a power of two; rows_per_program(M) by default)."""
    _rows(x, "x")
    M, N = x.shape
    if weight.shape != (N,):
        raise ValueError(f"weight: expected shape ({N},), got {tuple(weight.shape)}")
    if delta is not None and (_rows(delta, "delta").shape != x.shape or delta.dtype != x.dtype):
        raise ValueError(f"delta: expected {tuple(x.shape)} {x.dtype}, got {tuple(delta.shape)} {delta.dtype}")
    res = torch.empty_like(x) if delta is not None else x
    out = torch.empty_like(x)
    rows = rows_arg(rows, M)
    if M:
        _add_rms_norm_kernel[(triton.cdiv(M, rows),)](
            x, x if delta is None else delta, weight, res, out, M, N, float(eps), x.stride(0),
            x.stride(0) if delta is None else delta.stride(0), res.stride(0), out.stride(0),
            HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(N), ROWS=rows)
    return res, out


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                  k_pool: torch.Tensor, v_pool: torch.Tensor, num_heads: int, num_kv_heads: int, *,
                  rows: int | None = None) -> torch.Tensor:
    """qkv: [M, (H + 2 Hkv) D] (q, k, v heads in that order); cos, sin: [M, D]; slots: [M] pool slot of each row.

    Writes the rotated keys and the values of row m to slot slots[m] of k_pool / v_pool ([Hkv, num_slots, D]) and
    returns the rotated queries [M, H, D]. rows: rows a program rotates, for one head (a power of two;
    rows_per_program(M) by default)."""
    _rows(qkv, "qkv")
    M = qkv.shape[0]
    H, Hkv = num_heads, num_kv_heads
    if qkv.shape[1] % (H + 2 * Hkv):
        raise ValueError(f"qkv: width {qkv.shape[1]} is not (H + 2 Hkv) x head_dim for H={H}, Hkv={Hkv}")
    D = qkv.shape[1] // (H + 2 * Hkv)
    if D % 2:
        raise ValueError(f"head_dim {D} must be even (rotate-half)")
    for name, t in (("cos", cos), ("sin", sin)):
        if _rows(t, name).shape != (M, D):
            raise ValueError(f"{name}: expected shape ({M}, {D}), got {tuple(t.shape)}")
    for name, p in (("k_pool", k_pool), ("v_pool", v_pool)):
        if p.dim() != 3 or p.shape[0] != Hkv or p.shape[2] != D or p.stride(2) != 1 or p.dtype != qkv.dtype:
            raise ValueError(f"{name}: expected [{Hkv}, slots, {D}] {qkv.dtype} with contiguous rows, got "
                             f"{tuple(p.shape)} {p.dtype}")
    if slots.shape != (M,):
        raise ValueError(f"slots: expected shape ({M},), got {tuple(slots.shape)}")
    rows = rows_arg(rows, M)
    q = torch.empty(M, H, D, dtype=qkv.dtype, device=qkv.device)
    if M:
        _rope_write_kv_kernel[(triton.cdiv(M, rows), H + Hkv)](
            qkv, cos, sin, slots, q, k_pool, v_pool, M, qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0),
            q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), H, Hkv,
            HALF=D // 2, HALF_PAD=triton.next_power_of_2(D // 2), ROWS=rows)
    return q


def silu_mul(gate_up: torch.Tensor, block: int = 1024, *, rows: int | None = None) -> torch.Tensor:
    """gate_up: [M, 2I] (gate columns first) -> silu(gate) * up: [M, I]. A program takes `rows` rows (a power of
    two; rows_per_program(M) by default) and `block` columns."""
    _rows(gate_up, "gate_up")
    M, W = gate_up.shape
    if W % 2:
        raise ValueError(f"gate_up: width {W} is odd (expected gate and up halves)")
    rows = rows_arg(rows, M)
    out = torch.empty(M, W // 2, dtype=gate_up.dtype, device=gate_up.device)
    if M:
        _silu_mul_kernel[(triton.cdiv(M, rows), triton.cdiv(W // 2, block))](
            gate_up, out, M, W // 2, gate_up.stride(0), out.stride(0), BLOCK=block, ROWS=rows)
    return out


# ------------------------------------------------------------------------------------- shared-prefix attention
# A shared demo prefix is attended as two batched GEMMs for all the sequences that start with it (its keys read once
# per step), torch.matmul in the model. Between and after them, these two kernels do the softmax and the
# log-sum-exp merge with each sequence's own-context attention that torch runs as some 25 small kernels.

@triton.jit(do_not_specialize=["NR"])
def _prefix_softmax_kernel(s_ptr, e_ptr, stat_ptr, NR, P, scale, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    # a program takes ROWS of the NR rows of scores [P] (a kv head x a query head of a sequence each); a row past NR
    # reads row NR - 1 (finite scores, no -inf - -inf) and stores nothing
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]  # [ROWS, 1]
    mr = rows < NR
    p_s = s_ptr + tl.minimum(rows, NR - 1) * P
    o = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    mx = tl.full([ROWS, BLOCK], float("-inf"), tl.float32)
    for p0 in range(0, P, BLOCK):
        x = tl.load(p_s + p0 + o, mask=p0 + o < P, other=float("-inf")).to(tl.float32) * scale
        mx = tl.maximum(mx, x)
    m = tl.max(mx, axis=1)[:, None]  # [ROWS, 1]
    acc = tl.zeros([ROWS, BLOCK], tl.float32)
    for p0 in range(0, P, BLOCK):
        mask = p0 + o < P
        x = tl.load(p_s + p0 + o, mask=mask, other=float("-inf")).to(tl.float32) * scale
        e = tl.exp(x - m)
        acc += tl.where(mask, e, 0.0)
        tl.store(e_ptr + rows * P + p0 + o, e.to(e_ptr.dtype.element_ty), mask=mr & mask)
    tl.store(stat_ptr + rows * 2, m, mask=mr)
    tl.store(stat_ptr + rows * 2 + 1, tl.sum(acc, axis=1)[:, None], mask=mr)


@triton.jit(do_not_specialize=["n"])
def _prefix_merge_kernel(num_ptr, stat_ptr, o_ptr, lse_ptr, mem_ptr, out_ptr, tot_ptr,
                         n, H, G, stride_nh, stride_nr, stride_ob, stride_oh,
                         HAS_MEMBER: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, ROWS: tl.constexpr):
    i = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]  # [ROWS, 1] sequences of the batch
    h = tl.program_id(1)  # query head
    mi = i < n
    kh = h // G
    r = i * G + h % G  # rows of the prefix GEMMs' [Hkv, n * G, .] layout
    od = tl.arange(0, D_PAD)[None, :]  # [1, D_PAD]
    md = mi & (od < D)
    mx = tl.load(stat_ptr + (kh * n * G + r) * 2, mask=mi, other=0.0)
    den = tl.load(stat_ptr + (kh * n * G + r) * 2 + 1, mask=mi, other=1.0)
    l_pre = mx + tl.log(den)
    if HAS_MEMBER:  # a row of another prefix: weight 0 here, its own output comes through exactly
        l_pre = tl.where(tl.load(mem_ptr + i, mask=mi, other=0) != 0, l_pre, float("-inf"))
    o_pre = tl.load(num_ptr + kh * stride_nh + r * stride_nr + od, mask=md, other=0.0).to(tl.float32) / den
    l_own = tl.load(lse_ptr + i * H + h, mask=mi, other=0.0)
    o_own = tl.load(o_ptr + i * stride_ob + h * stride_oh + od, mask=md, other=0.0).to(tl.float32)
    m = tl.maximum(l_pre, l_own)
    w_pre = tl.exp(l_pre - m)
    w_own = tl.exp(l_own - m)
    out = (o_pre * w_pre + o_own * w_own) / (w_pre + w_own)
    tl.store(out_ptr + i * stride_ob + h * stride_oh + od, out.to(out_ptr.dtype.element_ty), mask=md)
    tl.store(tot_ptr + i * H + h, m + tl.log(w_pre + w_own), mask=mi)


def prefix_softmax(s: torch.Tensor, scale: float, out_dtype: torch.dtype, block: int = 1024, *,
                   rows: int | None = None):
    """s: [Hkv, R, P] raw scores q.k (any float dtype) -> (e [Hkv, R, P] in out_dtype, stat [Hkv, R, 2] f32):
    e = exp(s * scale - max) and stat = (max, sum of e) of each row, in float32. A program takes `rows` of the
    Hkv * R rows (a power of two; rows_per_program(Hkv * R) by default) and `block` keys at a time."""
    if s.dim() != 3 or not s.is_contiguous():
        raise ValueError(f"s: expected a contiguous [Hkv, rows, P] tensor, got shape {tuple(s.shape)}")
    Hkv, R, P = s.shape
    if P == 0:
        raise ValueError("s: the prefix has no keys (P = 0)")
    rows = rows_arg(rows, Hkv * R)
    e = torch.empty(s.shape, dtype=out_dtype, device=s.device)
    stat = torch.empty(Hkv, R, 2, dtype=torch.float32, device=s.device)
    if Hkv * R:
        _prefix_softmax_kernel[(triton.cdiv(Hkv * R, rows),)](s, e, stat, Hkv * R, P, float(scale),
                                                              BLOCK=min(block, triton.next_power_of_2(P)), ROWS=rows)
    return e, stat


def prefix_merge(num: torch.Tensor, stat: torch.Tensor, o_own: torch.Tensor, lse_own: torch.Tensor,
                 member: torch.Tensor | None = None, *, rows: int | None = None):
    """Merge a prefix's attention with each sequence's own-context attention by their log-sum-exp.

    num: [Hkv, n*G, D] unnormalised prefix output (sum of e * v; row i*G + g is query head kh*G + g of sequence i);
    stat: [Hkv, n*G, 2] f32 its row (max, sum of e) from prefix_softmax; o_own: [n, H, D], lse_own: [n, H] f32 the
    own-context part; member: optional [n] bool, rows that do not share this prefix (False) keep their own part.
    Returns (o [n, H, D] in o_own's dtype, lse [n, H] f32 of the merged rows). A program merges `rows` sequences
    (a power of two; rows_per_program(n) by default) for one query head."""
    Hkv, nG, D = num.shape
    if o_own.dim() != 3 or o_own.stride(2) != 1:
        raise ValueError(f"o_own: expected [n, H, D] with contiguous rows, got {tuple(o_own.shape)}")
    n, H, Do = o_own.shape
    if Do != D or H % Hkv or nG != n * (H // Hkv):
        raise ValueError(f"num {tuple(num.shape)} does not fit o_own {tuple(o_own.shape)} (expected [Hkv, n*H/Hkv, D])")
    if num.stride(2) != 1:
        raise ValueError("num: the head dimension must be contiguous")
    if stat.shape != (Hkv, nG, 2) or stat.dtype != torch.float32 or not stat.is_contiguous():
        raise ValueError(f"stat: expected a contiguous float32 ({Hkv}, {nG}, 2), got {tuple(stat.shape)} {stat.dtype}")
    if lse_own.shape != (n, H) or lse_own.dtype != torch.float32 or not lse_own.is_contiguous():
        raise ValueError(f"lse_own: expected a contiguous float32 [{n}, {H}], got {tuple(lse_own.shape)} {lse_own.dtype}")
    if member is not None and member.shape != (n,):
        raise ValueError(f"member: expected shape ({n},), got {tuple(member.shape)}")
    rows = rows_arg(rows, n)
    out = torch.empty_like(o_own)
    tot = torch.empty(n, H, dtype=torch.float32, device=o_own.device)
    if n:
        _prefix_merge_kernel[(triton.cdiv(n, rows), H)](
            num, stat, o_own, lse_own, lse_own if member is None else member, out, tot, n, H, H // Hkv, num.stride(0),
            num.stride(1), o_own.stride(0), o_own.stride(1), HAS_MEMBER=member is not None, D=D,
            D_PAD=triton.next_power_of_2(D), ROWS=rows)
    return out, tot


# ---- every shared prefix of a decode step in one flash-decoding launch a layer (prefix_flash_decode) -------------

MAX_FLASH_PREFIXES = 4  # prefixes one launch takes (their first slots and lengths are scalar arguments)


@triton.jit(do_not_specialize=["B", "SPLIT_LEN", "NSPLIT", "S0", "S1", "S2", "S3", "L0", "L1", "L2", "L3"])
def _prefix_flash_partial_kernel(
    q_ptr, k_ptr, v_ptr, rp_ptr, acc_ptr, ml_ptr,
    stride_qb, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs,
    scale, B, H, SPLIT_LEN, NSPLIT, S0, S1, S2, S3, L0, L1, L2, L3,
    G: tl.constexpr, G_PAD: tl.constexpr, R_BLK: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    i_kh = tl.program_id(0).to(tl.int64)  # kv head (int64: a head's offset in a large pool)
    r0 = tl.program_id(1) * R_BLK  # first batch row of this block
    i_ks = tl.program_id(2)
    k = i_ks // NSPLIT  # the prefix
    i_s = i_ks % NSPLIT  # its split
    start = tl.where(k == 0, S0, tl.where(k == 1, S1, tl.where(k == 2, S2, S3))).to(tl.int64)
    plen = tl.where(k == 0, L0, tl.where(k == 1, L1, tl.where(k == 2, L2, L3)))
    # the block's [R_BLK x G_PAD] query rows: (batch row, query head of this kv head's group)
    o_m = tl.arange(0, R_BLK * G_PAD)
    row = r0 + o_m // G_PAD
    g = o_m % G_PAD
    in_b = row < B
    rp = tl.load(rp_ptr + row, mask=in_b, other=-1)
    member = in_b & (g < G) & (rp == k)  # rows of this prefix (the others are another prefix's, or have none)
    o_d = tl.arange(0, D_PAD)
    m_d = o_d < D
    head = i_kh * G + g
    b_q = tl.load(q_ptr + row.to(tl.int64)[:, None] * stride_qb + head[:, None] * stride_qh + o_d[None, :],
                  mask=member[:, None] & m_d[None, :], other=0.0)
    if UPCAST:
        b_q = b_q.to(tl.float32)
    b_m = tl.full([R_BLK * G_PAD], float("-inf"), tl.float32)
    b_l = tl.zeros([R_BLK * G_PAD], tl.float32)
    b_acc = tl.zeros([R_BLK * G_PAD, D_PAD], tl.float32)
    n_start = i_s * SPLIT_LEN
    # a block without a row of this prefix reads none of its keys
    any_row = tl.max(member.to(tl.int32), axis=0) > 0
    n_end = tl.where(any_row, tl.minimum(n_start + SPLIT_LEN, plen), n_start)
    for n0 in range(n_start, n_end, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < n_end
        slot = start + o_n.to(tl.int64)
        b_m, b_l, b_acc = online_softmax_tile(
            b_q, k_ptr + i_kh * stride_kh + slot[:, None] * stride_ks + o_d[None, :],
            v_ptr + i_kh * stride_vh + slot[:, None] * stride_vs + o_d[None, :], m_n, member[:, None], m_d, scale,
            b_m, b_l, b_acc, IEEE, UPCAST)
    # the partial state of (row, head, split) of each member row; a row has one prefix, so no two programs write it
    base = (row.to(tl.int64) * H + head) * NSPLIT + i_s
    tl.store(acc_ptr + base[:, None] * D_PAD + o_d[None, :], b_acc, mask=member[:, None] & m_d[None, :])
    tl.store(ml_ptr + base * 2, b_m, mask=member)
    tl.store(ml_ptr + base * 2 + 1, b_l, mask=member)


@triton.jit(do_not_specialize=["NSPLIT"])
def _prefix_flash_merge_kernel(acc_ptr, ml_ptr, rp_ptr, o_ptr, lse_ptr, out_ptr, tot_ptr,
                               H, NSPLIT, stride_ob, stride_oh,
                               D: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    rp = tl.load(rp_ptr + b)  # the row's prefix (-1: none; it keeps its own part)
    o_s = tl.arange(0, S_PAD)
    m_s = (o_s < NSPLIT) & (o_s * 0 + rp >= 0)
    o_d = tl.arange(0, D_PAD)
    m_d = o_d < D
    base = (b * H + h) * NSPLIT + o_s
    ms = tl.load(ml_ptr + base * 2, mask=m_s, other=float("-inf"))
    ls = tl.load(ml_ptr + base * 2 + 1, mask=m_s, other=0.0)
    acc = tl.load(acc_ptr + base[:, None] * D_PAD + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0)
    l_own = tl.load(lse_ptr + b * H + h)
    o_own = tl.load(o_ptr + b * stride_ob + h * stride_oh + o_d, mask=m_d, other=0.0).to(tl.float32)
    m = tl.maximum(tl.max(ms, axis=0), l_own)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_s = tl.where(ms == float("-inf"), 0.0, tl.exp(ms - m_safe))  # empty splits weigh nothing
    w_own = tl.where(l_own == float("-inf"), 0.0, tl.exp(l_own - m_safe))
    num = o_own * w_own + tl.sum(w_s[:, None] * acc, axis=0)
    den = w_own + tl.sum(w_s * ls, axis=0)
    ok = den > 0
    out = tl.where(ok, num / tl.where(ok, den, 1.0), 0.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + o_d, out.to(out_ptr.dtype.element_ty), mask=m_d)
    tl.store(tot_ptr + b * H + h, tl.where(ok, m_safe + tl.log(tl.where(ok, den, 1.0)), float("-inf")))


def prefix_flash_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, starts: list[int],
                        lengths: list[int], row_prefix: torch.Tensor, o_own: torch.Tensor, lse_own: torch.Tensor,
                        scale: float, num_splits: int | None = None, rows_per_block: int | None = None,
                        block_n: int | None = None, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every shared prefix of a decode step attended in one flash-decoding launch and merged with each sequence's
    own-context part by log-sum-exp: (o [B, H, D] in o_own's dtype, lse [B, H] f32).

    q [B, H, D]; k_pool, v_pool [Hkv, slots, D]; prefix i's keys are the consecutive slots starts[i] ..
    starts[i] + lengths[i] - 1 (at most MAX_FLASH_PREFIXES prefixes); row_prefix [B] int, each row's prefix (-1: none:
    the row keeps its own part exactly); o_own [B, H, D] and lse_own [B, H] f32, the own-context attention and its
    log-sum-exp (the paged decode kernel's).

    Program = (kv head, block of rows, prefix, split): it reads a tile of the prefix's keys and values once for the
    block's rows of that prefix (the G query heads of each row included), keeps the scores in registers (online
    softmax), and writes a partial (accumulator, max, sum) per row, head and split; a block with no row of the
    prefix reads nothing. A second kernel merges each row's splits with its own part. The scores never reach memory:
    the torch path (a GEMM, prefix_softmax, a GEMM and prefix_merge per prefix, each over every row of the batch)
    writes and reads them twice. The arguments that change between calls (rows, splits, slots, lengths) are
    not specialised, so one compile serves a run."""
    if q.dim() != 3 or k_pool.dim() != 3 or v_pool.shape != k_pool.shape:
        raise ValueError(f"q must be [B, H, D] and k_pool/v_pool [Hkv, slots, D] alike, got {tuple(q.shape)}, "
                         f"{tuple(k_pool.shape)}, {tuple(v_pool.shape)}")
    B, H, D = q.shape
    Hkv, n_slots, Dk = k_pool.shape
    if Dk != D or H % Hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit the pool {tuple(k_pool.shape)}")
    if k_pool.stride(2) != 1 or v_pool.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("q, k_pool and v_pool must be contiguous in the head dim")
    if len(starts) != len(lengths) or not 1 <= len(starts) <= MAX_FLASH_PREFIXES:
        raise ValueError(f"starts and lengths: 1 to {MAX_FLASH_PREFIXES} prefixes of one start and one length each, "
                         f"got {len(starts)} and {len(lengths)}")
    for s, n in zip(starts, lengths):
        if not (isinstance(s, int) and isinstance(n, int)) or s < 0 or n < 1 or s + n > n_slots:
            raise ValueError(f"a prefix of slots {s!r}..{s!r}+{n!r} does not lie in the pool's {n_slots} slots")
    if row_prefix.shape != (B,) or row_prefix.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"row_prefix: expected int [{B}], got {tuple(row_prefix.shape)} {row_prefix.dtype}")
    if o_own.shape != (B, H, D) or o_own.stride(2) != 1:
        raise ValueError(f"o_own: expected [{B}, {H}, {D}] with contiguous rows, got {tuple(o_own.shape)}")
    if lse_own.shape != (B, H) or lse_own.dtype != torch.float32 or not lse_own.is_contiguous():
        raise ValueError(f"lse_own: expected a contiguous float32 [{B}, {H}], got {tuple(lse_own.shape)} "
                         f"{lse_own.dtype}")
    # launch settings that keep a block's tiles in registers on sm_90 (tests/triton_sm90.py reports the spills):
    # tiles of 16 keys in float32 (IEEE dots), 32 in 16-bit types, 8 warps for blocks of 64 query rows
    block_n = block_n or (16 if q.dtype == torch.float32 else 32)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    out = torch.empty_like(o_own)
    tot = torch.empty(B, H, dtype=torch.float32, device=q.device)
    if B == 0:
        return out, tot
    G = H // Hkv
    g_pad = triton.next_power_of_2(G)
    # rows x heads of a block: at least 16 (tl.dot), 64 by default (a row block's keys are read once for them all)
    r_blk = rows_per_block or max(1, 64 // g_pad)
    r_blk = max(r_blk, triton.cdiv(16, g_pad))
    if r_blk & (r_blk - 1):
        raise ValueError(f"rows_per_block must be a power of two, got {rows_per_block}")
    n_blocks = triton.cdiv(B, r_blk)
    K, P = len(starts), max(lengths)
    if num_splits is None:
        if q.device.type == "cuda":  # about 2 programs per SM in all
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count
            num_splits = max(1, min(triton.cdiv(P, 256), triton.cdiv(2 * sms, Hkv * n_blocks * K)))
        else:
            num_splits = 1
    split_len = triton.cdiv(triton.cdiv(P, num_splits), block_n) * block_n
    nsplit = max(1, triton.cdiv(P, split_len))
    d_pad = max(16, triton.next_power_of_2(D))
    acc = torch.empty(B * H * nsplit, d_pad, dtype=torch.float32, device=q.device)
    ml = torch.empty(B * H * nsplit, 2, dtype=torch.float32, device=q.device)
    st = list(starts) + [0] * (MAX_FLASH_PREFIXES - K)
    ln = list(lengths) + [0] * (MAX_FLASH_PREFIXES - K)
    _prefix_flash_partial_kernel[(Hkv, n_blocks, K * nsplit)](
        q, k_pool, v_pool, row_prefix, acc, ml,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        float(scale), B, H, split_len, nsplit, *st, *ln,
        G=G, G_PAD=g_pad, R_BLK=r_blk, D=D, D_PAD=d_pad, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32 or INTERPRETED, UPCAST=q.dtype != torch.float32 and INTERPRETED,
        num_warps=num_warps or (8 if r_blk * g_pad >= 64 else 4),
    )
    _prefix_flash_merge_kernel[(B, H)](
        acc, ml, row_prefix, o_own, lse_own, out, tot, H, nsplit, o_own.stride(0), o_own.stride(1),
        D=D, D_PAD=d_pad, S_PAD=max(2, triton.next_power_of_2(nsplit)),
    )
    return out, tot
