"""The small per-layer operations of a decode step, fused (Triton): residual add + RMSNorm, rotary embedding + the
KV-cache write, SiLU-gated multiply, and a shared prefix's softmax and log-sum-exp merge.

A decode step is mostly a few large GEMMs per layer, but torch runs each layer's two RMSNorms (8 kernels each in
bf16: cast, square, mean, add, rsqrt, scale, cast back, weight), rotary embedding of q and k (5 each), KV-cache
write (4), residual adds and SiLU product as about 35 separate small kernels beside its 4 GEMMs and the attention:
some 41 launches per layer, 1,300 per step on a 32-layer model. Inside a CUDA graph each small one still costs
microseconds, and the first GPU session measured a Llama-2-7B-shaped step at batch 1 at 8.1 ms against its 4.7 ms
floor (benchmarks/results/gpu_h100_2026-11-23.md). These three kernels do that small work in 4 launches per layer
(10 launches per layer in all). What that saves on a GPU is not measured yet: bench_decode's "unfused layers"
column times the same step without them. Each kernel rounds to the model's dtype wherever torch's separate ops
round, so the fused step decodes what the unfused one does up to the order of a float32 sum.

    add_rms_norm(x, delta, w, eps) -> (x + delta, rmsnorm(x + delta) * w)    x, delta: [M, N]; delta may be None
    rope_write_kv(qkv, cos, sin, slots, k_pool, v_pool, H, Hkv) -> q [M, H, D]   (rotated k, v written to the pool)
    silu_mul(gate_up) -> silu(gate) * up                                     gate_up: [M, 2I] -> [M, I]
    prefix_softmax(s, scale, dtype) -> (e, (max, sum))        s: [Hkv, R, P] scores of a shared prefix's keys
    prefix_merge(e @ v, stat, o_own, lse_own, member) -> (o, lse)    the prefix part merged with the own part
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, res_ptr, out_ptr, N, eps,
                         stride_x, stride_d, stride_r, stride_o,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * stride_d + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(res_ptr.dtype.element_ty)  # rounded as torch's add
        tl.store(res_ptr + row * stride_r + cols, x, mask=m)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = (xf * rstd).to(out_ptr.dtype.element_ty)  # torch: normalise in fp32, round to the model dtype ...
    w = tl.load(w_ptr + cols, mask=m, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)  # ... then scale by the weight
    tl.store(out_ptr + row * stride_o + cols, out, mask=m)


@triton.jit
def _rope_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_ptr, v_ptr,
                          stride_row, stride_cos, stride_sin, stride_qm, stride_qh,
                          stride_kh, stride_ks, stride_vh, stride_vs,
                          H, Hkv, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    # 0..H-1: query heads; H..H+Hkv-1: key heads (the program also copies the value head); int64: a head's offset
    # in a pool of more than 2**31 elements
    head = tl.program_id(1).to(tl.int64)
    o = tl.arange(0, HALF_PAD)
    m = o < HALF
    D = 2 * HALF
    c1 = tl.load(cos_ptr + row * stride_cos + o, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row * stride_cos + HALF + o, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row * stride_sin + o, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row * stride_sin + HALF + o, mask=m, other=0.0).to(tl.float32)
    base = qkv_ptr + row * stride_row + head * D
    x1 = tl.load(base + o, mask=m, other=0.0)
    x2 = tl.load(base + HALF + o, mask=m, other=0.0)
    dt = x1.dtype
    # rotate-half: out = x * cos + cat(-x2, x1) * sin, each product rounded to the dtype as torch's ops round them
    y1 = ((x1.to(tl.float32) * c1).to(dt).to(tl.float32) + (-(x2.to(tl.float32)) * s1).to(dt).to(tl.float32)).to(dt)
    y2 = ((x2.to(tl.float32) * c2).to(dt).to(tl.float32) + (x1.to(tl.float32) * s2).to(dt).to(tl.float32)).to(dt)
    if head < H:
        dst = q_ptr + row * stride_qm + head * stride_qh
        tl.store(dst + o, y1, mask=m)
        tl.store(dst + HALF + o, y2, mask=m)
    else:
        kh = head - H
        slot = tl.load(slot_ptr + row).to(tl.int64)
        dst = k_ptr + kh * stride_kh + slot * stride_ks
        tl.store(dst + o, y1, mask=m)
        tl.store(dst + HALF + o, y2, mask=m)
        vsrc = qkv_ptr + row * stride_row + (H + Hkv + kh) * D
        vdst = v_ptr + kh * stride_vh + slot * stride_vs
        tl.store(vdst + o, tl.load(vsrc + o, mask=m, other=0.0), mask=m)
        tl.store(vdst + HALF + o, tl.load(vsrc + HALF + o, mask=m, other=0.0), mask=m)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, I, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    g = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    u = tl.load(x_ptr + row * stride_x + I + cols, mask=m, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # torch's silu, rounded to the dtype before the product
    tl.store(out_ptr + row * stride_o + cols, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=m)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{name}: expected a 2-D tensor with contiguous rows, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    return x


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(x + delta, RMSNorm(x + delta) * weight) in one pass; with delta None, (x, RMSNorm(x) * weight)."""
    _rows(x, "x")
    M, N = x.shape
    if weight.shape != (N,):
        raise ValueError(f"weight: expected shape ({N},), got {tuple(weight.shape)}")
    if delta is not None and (_rows(delta, "delta").shape != x.shape or delta.dtype != x.dtype):
        raise ValueError(f"delta: expected {tuple(x.shape)} {x.dtype}, got {tuple(delta.shape)} {delta.dtype}")
    res = torch.empty_like(x) if delta is not None else x
    out = torch.empty_like(x)
    if M:
        _add_rms_norm_kernel[(M,)](x, x if delta is None else delta, weight, res, out, N, float(eps),
                                   x.stride(0), x.stride(0) if delta is None else delta.stride(0), res.stride(0),
                                   out.stride(0), HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(N))
    return res, out


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                  k_pool: torch.Tensor, v_pool: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """qkv: [M, (H + 2 Hkv) D] (q, k, v heads in that order); cos, sin: [M, D]; slots: [M] pool slot of each row.

    Writes the rotated keys and the values of row m to slot slots[m] of k_pool / v_pool ([Hkv, num_slots, D]) and
    returns the rotated queries [M, H, D]."""
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
    q = torch.empty(M, H, D, dtype=qkv.dtype, device=qkv.device)
    if M:
        _rope_write_kv_kernel[(M, H + Hkv)](qkv, cos, sin, slots, q, k_pool, v_pool,
                                            qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1),
                                            k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
                                            H, Hkv, HALF=D // 2, HALF_PAD=triton.next_power_of_2(D // 2))
    return q


def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """gate_up: [M, 2I] (gate columns first) -> silu(gate) * up: [M, I]."""
    _rows(gate_up, "gate_up")
    M, W = gate_up.shape
    if W % 2:
        raise ValueError(f"gate_up: width {W} is odd (expected gate and up halves)")
    out = torch.empty(M, W // 2, dtype=gate_up.dtype, device=gate_up.device)
    if M:
        _silu_mul_kernel[(M, triton.cdiv(W // 2, block))](gate_up, out, W // 2, gate_up.stride(0), out.stride(0),
                                                           BLOCK=block)
    return out


# ------------------------------------------------------------------------------------- shared-prefix attention
# A shared demo prefix is attended as two batched GEMMs for all the sequences that start with it (its keys read once
# per step), torch.matmul in the model. Between and after them, these two kernels do the softmax and the
# log-sum-exp merge with each sequence's own-context attention that torch runs as some 25 small kernels.

@triton.jit
def _prefix_softmax_kernel(s_ptr, e_ptr, stat_ptr, P, scale, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one row of scores [P] (a kv head x a query head of a sequence)
    o = tl.arange(0, BLOCK)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    for p0 in range(0, P, BLOCK):
        x = tl.load(s_ptr + row * P + p0 + o, mask=p0 + o < P, other=float("-inf")).to(tl.float32) * scale
        mx = tl.maximum(mx, x)
    m = tl.max(mx, axis=0)
    acc = tl.zeros([BLOCK], tl.float32)
    for p0 in range(0, P, BLOCK):
        mask = p0 + o < P
        x = tl.load(s_ptr + row * P + p0 + o, mask=mask, other=float("-inf")).to(tl.float32) * scale
        e = tl.exp(x - m)
        acc += tl.where(mask, e, 0.0)
        tl.store(e_ptr + row * P + p0 + o, e.to(e_ptr.dtype.element_ty), mask=mask)
    tl.store(stat_ptr + row * 2, m)
    tl.store(stat_ptr + row * 2 + 1, tl.sum(acc, axis=0))


@triton.jit(do_not_specialize=["n"])
def _prefix_merge_kernel(num_ptr, stat_ptr, o_ptr, lse_ptr, mem_ptr, out_ptr, tot_ptr,
                         n, H, G, stride_nh, stride_nr, stride_ob, stride_oh,
                         HAS_MEMBER: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)  # sequence (row of this prefix's batch)
    h = tl.program_id(1)  # query head
    kh = h // G
    r = i * G + h % G  # row of the prefix GEMMs' [Hkv, n * G, .] layout
    od = tl.arange(0, D_PAD)
    md = od < D
    mx = tl.load(stat_ptr + (kh * n * G + r) * 2)
    den = tl.load(stat_ptr + (kh * n * G + r) * 2 + 1)
    l_pre = mx + tl.log(den)
    if HAS_MEMBER:  # a row of another prefix: weight 0 here, its own output comes through exactly
        l_pre = tl.where(tl.load(mem_ptr + i) != 0, l_pre, float("-inf"))
    o_pre = tl.load(num_ptr + kh * stride_nh + r * stride_nr + od, mask=md, other=0.0).to(tl.float32) / den
    l_own = tl.load(lse_ptr + i * H + h)
    o_own = tl.load(o_ptr + i * stride_ob + h * stride_oh + od, mask=md, other=0.0).to(tl.float32)
    m = tl.maximum(l_pre, l_own)
    w_pre = tl.exp(l_pre - m)
    w_own = tl.exp(l_own - m)
    out = (o_pre * w_pre + o_own * w_own) / (w_pre + w_own)
    tl.store(out_ptr + i * stride_ob + h * stride_oh + od, out.to(out_ptr.dtype.element_ty), mask=md)
    tl.store(tot_ptr + i * H + h, m + tl.log(w_pre + w_own))


def prefix_softmax(s: torch.Tensor, scale: float, out_dtype: torch.dtype, block: int = 1024):
    """s: [Hkv, R, P] raw scores q.k (any float dtype) -> (e [Hkv, R, P] in out_dtype, stat [Hkv, R, 2] f32):
    e = exp(s * scale - max) and stat = (max, sum of e) of each row, in float32."""
    if s.dim() != 3 or not s.is_contiguous():
        raise ValueError(f"s: expected a contiguous [Hkv, rows, P] tensor, got shape {tuple(s.shape)}")
    Hkv, R, P = s.shape
    if P == 0:
        raise ValueError("s: the prefix has no keys (P = 0)")
    e = torch.empty(s.shape, dtype=out_dtype, device=s.device)
    stat = torch.empty(Hkv, R, 2, dtype=torch.float32, device=s.device)
    if Hkv * R:
        _prefix_softmax_kernel[(Hkv * R,)](s, e, stat, P, float(scale), BLOCK=min(block, triton.next_power_of_2(P)))
    return e, stat


def prefix_merge(num: torch.Tensor, stat: torch.Tensor, o_own: torch.Tensor, lse_own: torch.Tensor,
                 member: torch.Tensor | None = None):
    """Merge a prefix's attention with each sequence's own-context attention by their log-sum-exp.

    num: [Hkv, n*G, D] unnormalised prefix output (sum of e * v; row i*G + g is query head kh*G + g of sequence i);
    stat: [Hkv, n*G, 2] f32 its row (max, sum of e) from prefix_softmax; o_own: [n, H, D], lse_own: [n, H] f32 the
    own-context part; member: optional [n] bool, rows that do not share this prefix (False) keep their own part.
    Returns (o [n, H, D] in o_own's dtype, lse [n, H] f32 of the merged rows)."""
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
    out = torch.empty_like(o_own)
    tot = torch.empty(n, H, dtype=torch.float32, device=o_own.device)
    if n:
        _prefix_merge_kernel[(n, H)](num, stat, o_own, lse_own, lse_own if member is None else member, out, tot,
                                     n, H, H // Hkv, num.stride(0), num.stride(1), o_own.stride(0), o_own.stride(1),
                                     HAS_MEMBER=member is not None, D=D, D_PAD=triton.next_power_of_2(D))
    return out, tot
