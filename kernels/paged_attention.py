"""Paged decode attention over each sequence's own KV blocks, returning the row log-sum-exp (Triton).

One new query per sequence: q [B, H, D]; keys/values live in the engine's pool [Hkv, num_slots, D], sequence b's
token n in slot ctx_blocks[b, n // bs] * bs + n % bs, for n < ctx_lens[b]. Returns out [B, H, D] (q's dtype) and
lse [B, H] f32 (natural log of the sum of exp(q . k * scale)), the same contract as the C++ CPU op
`torch.ops.fastrag.paged_decode_attention_lse` with no prefix keys: the model computes each shared prefix as one
GEMM for the whole batch and merges it with this part by LSE (cascade attention), and the decode attention
statistics reuse the merged LSE. A sequence with no own key gets out = 0 and lse = -inf (neutral in that merge).

Program = (sequence, kv head, split): the G = H / Hkv query heads of a group share every key/value row, so a row is
read once per sequence (one tl.dot of the [G, D] queries against a tile of keys); long contexts are cut into
NSPLIT slices whose partial (max, sum, accumulator) states a second kernel merges (flash-decoding), so small
batches still fill the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastrag.kernels import INTERPRETED, device_function


@device_function
def online_softmax_tile(b_q, k_rows, v_rows, m_n, visible, m_d, scale, b_m, b_l, b_acc,
                        IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """One tile of keys in a flash-attention loop: load the keys and values at pointers k_rows / v_rows
    [BLOCK_N, D_PAD] (rows where m_n holds, head-dim lanes where m_d holds), score the queries b_q [M, D_PAD]
    against them where `visible` (broadcast to [M, BLOCK_N]) holds, and fold them into the running row max b_m,
    sum b_l and accumulator b_acc (all float32). Returns the three. Tiles multiply in the pool's dtype with float32
    accumulation (tensor cores), fp32 pools in IEEE fp32 (not tf32); UPCAST: every tile in float32 first (the
    interpreter multiplies bf16 tiles as raw integers). A tile of masked keys only leaves the state as it was."""
    b_k = tl.load(k_rows, mask=m_n[:, None] & m_d[None, :], other=0.0)
    b_v = tl.load(v_rows, mask=m_n[:, None] & m_d[None, :], other=0.0)
    if UPCAST:
        b_k = b_k.to(tl.float32)
        b_v = b_v.to(tl.float32)
    if IEEE:
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * scale
    else:
        b_s = tl.dot(b_q, tl.trans(b_k)) * scale
    b_s = tl.where(m_n[None, :] & visible, b_s, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
    b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    b_alpha = tl.exp(b_m - b_m_safe)
    b_p = tl.exp(b_s - b_m_safe[:, None])
    b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
    if IEEE:
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p, b_v, input_precision="ieee")
    else:
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
    return b_m_new, b_l, b_acc


@triton.jit(do_not_specialize=["stride_tb", "SPLIT_LEN", "NSPLIT", "MAX_CTX"])
def _paged_decode_partial_kernel(
    q_ptr, k_ptr, v_ptr, tab_ptr, len_ptr, acc_ptr, ml_ptr,
    stride_qb, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_tb,
    scale, SPLIT_LEN, NSPLIT, H, MAX_CTX, NB_POOL,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_kh = tl.program_id(1).to(tl.int64)  # int64: a head's offset in a pool of more than 2**31 elements
    i_s = tl.program_id(2)
    # (lengths and block ids are checked on the host for CPU tensors only, as every kernel here: on a GPU they are
    # clamped and masked so that any value stays inside the table and the pool)
    n_ctx = tl.minimum(tl.maximum(tl.load(len_ptr + i_b), 0), MAX_CTX)
    o_g = tl.arange(0, G_PAD)
    o_d = tl.arange(0, D_PAD)
    m_g = o_g < G
    m_d = o_d < D
    # q: [G_PAD, D_PAD], the query heads i_kh * G + g of this sequence
    b_q = tl.load(q_ptr + i_b * stride_qb + (i_kh * G + o_g)[:, None] * stride_qh + o_d[None, :],
                  mask=m_g[:, None] & m_d[None, :], other=0.0)
    if UPCAST:
        b_q = b_q.to(tl.float32)
    b_m = tl.full([G_PAD], float("-inf"), tl.float32)
    b_l = tl.zeros([G_PAD], tl.float32)
    b_acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    n_start = i_s * SPLIT_LEN
    n_end = tl.minimum(n_start + SPLIT_LEN, n_ctx)
    for n0 in range(n_start, n_end, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < n_end
        blk = tl.load(tab_ptr + i_b * stride_tb + o_n // BS, mask=m_n, other=0).to(tl.int64)
        m_n = m_n & (blk >= 0) & (blk < NB_POOL)
        slot = blk * BS + (o_n % BS).to(tl.int64)
        # this kv head's rows of the tile (the G query heads share them)
        b_m, b_l, b_acc = online_softmax_tile(
            b_q, k_ptr + i_kh * stride_kh + slot[:, None] * stride_ks + o_d[None, :],
            v_ptr + i_kh * stride_vh + slot[:, None] * stride_vs + o_d[None, :], m_n, True, m_d, scale, b_m, b_l,
            b_acc, IEEE, UPCAST)
    # partial state of (sequence, head, split): acc [D], (m, l)
    base = (i_b * H + i_kh * G + o_g) * NSPLIT + i_s  # [G_PAD] row of (sequence, head, split)
    tl.store(acc_ptr + base[:, None] * D_PAD + o_d[None, :], b_acc, mask=m_g[:, None])
    tl.store(ml_ptr + base * 2, b_m, mask=m_g)
    tl.store(ml_ptr + base * 2 + 1, b_l, mask=m_g)


@triton.jit(do_not_specialize=["NSPLIT"])
def _paged_decode_merge_kernel(
    acc_ptr, ml_ptr, out_ptr, lse_ptr, stride_ob, stride_oh, H, NSPLIT,
    D: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    o_s = tl.arange(0, S_PAD)
    o_d = tl.arange(0, D_PAD)
    m_s = o_s < NSPLIT
    base = (i_b * H + i_h) * NSPLIT + o_s  # [S_PAD]
    b_m = tl.load(ml_ptr + base * 2, mask=m_s, other=float("-inf"))
    b_l = tl.load(ml_ptr + base * 2 + 1, mask=m_s, other=0.0)
    m = tl.max(b_m, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    b_w = tl.where(b_m == float("-inf"), 0.0, tl.exp(b_m - m_safe))  # empty splits weigh nothing
    den = tl.sum(b_l * b_w, axis=0)
    b_acc = tl.load(acc_ptr + base[:, None] * D_PAD + o_d[None, :], mask=m_s[:, None], other=0.0)
    num = tl.sum(b_acc * b_w[:, None], axis=0)  # [D_PAD]
    out = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
    tl.store(out_ptr + i_b * stride_ob + i_h * stride_oh + o_d, out.to(out_ptr.dtype.element_ty), mask=o_d < D)
    tl.store(lse_ptr + i_b * H + i_h, tl.where(den > 0, m_safe + tl.log(tl.where(den > 0, den, 1.0)),
                                               float("-inf")))


def check_query_and_pool(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: str) -> None:
    """ValueError naming the problem unless q is [rows, H, D] and k_pool/v_pool one [Hkv, num_slots, D] shape of
    q's dtype and head dim, with H a multiple of Hkv (the paged attention kernels' shared contract)."""
    if q.dim() != 3 or k_pool.dim() != 3 or v_pool.shape != k_pool.shape:
        raise ValueError(f"q must be [{rows}, H, D] and k_pool/v_pool equal [Hkv, num_slots, D], got q "
                         f"{tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)}")
    H, D, Hkv = q.shape[1], q.shape[2], k_pool.shape[0]
    if k_pool.shape[2] != D or H % Hkv:
        raise ValueError(f"k_pool head dim {k_pool.shape[2]} must equal q's {D} and H={H} a multiple of Hkv={Hkv}")
    if k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise ValueError(f"k_pool/v_pool dtype {k_pool.dtype}/{v_pool.dtype} must equal q's {q.dtype}")


def paged_decode_attention_lse(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                               prefix_slots: torch.Tensor, ctx_blocks: torch.Tensor, ctx_lens: torch.Tensor,
                               block_size: int, scale: float, num_splits: int | None = None,
                               block_n: int = 64, num_warps: int | None = None,
                               num_stages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, D], lse [B, H] f32) of each sequence's query over its own paged context (see the module doc).

    q [B, H, D]; k_pool/v_pool [Hkv, num_slots, D] (last dim contiguous, q's dtype); ctx_blocks [B, NB] int;
    ctx_lens [B] int (own keys, the new token's included); prefix_slots must be empty (shared prefixes are merged
    by the caller). num_splits, block_n, num_warps, num_stages: launch settings of the partial kernel (None:
    the launcher's and Triton's defaults; benchmarks/bench_paged_attention.py sweeps them). Raises ValueError
    naming a bad argument (lengths and block ids too, for CPU tensors; on a GPU out-of-range values are clamped
    and masked in the kernel instead of costing a device sync).
    """
    if prefix_slots.numel():
        raise ValueError("prefix_slots: the Triton paged decode attention covers the own context only; merge "
                         "shared prefixes by LSE (fastrag/model/attention/paged_native.py)")
    check_query_and_pool(q, k_pool, v_pool, "B")
    B, H, D = q.shape
    Hkv = k_pool.shape[0]
    if k_pool.stride(2) != 1 or v_pool.stride(2) != 1:
        raise ValueError("k_pool/v_pool must be contiguous in the head dim")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if ctx_blocks.dim() != 2 or ctx_blocks.shape[0] != B or ctx_lens.shape != (B,):
        raise ValueError(f"ctx_blocks must be [B={B}, NB] and ctx_lens [B], got {tuple(ctx_blocks.shape)} and "
                         f"{tuple(ctx_lens.shape)}")
    if ctx_blocks.dtype not in (torch.int32, torch.int64) or ctx_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ctx_blocks and ctx_lens must be int32/int64, got {ctx_blocks.dtype} and {ctx_lens.dtype}")
    if not (isinstance(block_size, int) and block_size > 0) or k_pool.shape[1] % block_size:
        raise ValueError(f"block_size must be a positive int dividing the pool's {k_pool.shape[1]} slots, got "
                         f"{block_size!r}")
    max_ctx, pool_blocks = ctx_blocks.shape[1] * block_size, k_pool.shape[1] // block_size
    if ctx_lens.device.type == "cpu" and ctx_blocks.device.type == "cpu" and B:
        _check_reads(ctx_blocks, ctx_lens, block_size, max_ctx, pool_blocks)
    G = H // Hkv
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, dtype=torch.float32, device=q.device)
    if B == 0:
        return out, lse
    q = q.contiguous() if q.stride(2) != 1 else q
    tab = ctx_blocks.contiguous()
    lens = ctx_lens.contiguous()
    if num_splits is None:
        if q.device.type == "cuda":  # about 2 programs per SM in all
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count
            num_splits = max(1, min(triton.cdiv(max_ctx, 256), triton.cdiv(2 * sms, B * Hkv)))
        else:
            num_splits = 1
    split_len = triton.cdiv(triton.cdiv(max(max_ctx, 1), num_splits), block_n) * block_n
    nsplit = max(1, triton.cdiv(max_ctx, split_len))
    d_pad = max(16, triton.next_power_of_2(D))  # tl.dot needs every dim >= 16
    g_pad = max(16, triton.next_power_of_2(G))
    acc = torch.empty(B * H * nsplit, d_pad, dtype=torch.float32, device=q.device)
    ml = torch.empty(B * H * nsplit, 2, dtype=torch.float32, device=q.device)
    _paged_decode_partial_kernel[(B, Hkv, nsplit)](
        q, k_pool, v_pool, tab, lens, acc, ml,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        tab.stride(0), float(scale), split_len, nsplit, H, max_ctx, pool_blocks,
        # the interpreter multiplies bf16 tiles in tl.dot as raw integers (garbage scores): there every tile is
        # upcast to float32 first, as in attn_stats.py
        G=G, G_PAD=g_pad, D=D, D_PAD=d_pad, BS=block_size, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32 or INTERPRETED, UPCAST=q.dtype != torch.float32 and INTERPRETED,
        **{k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None},
    )
    _paged_decode_merge_kernel[(B, H)](
        acc, ml, out, lse, out.stride(0), out.stride(1), H, nsplit,
        D=D, D_PAD=d_pad, S_PAD=max(2, triton.next_power_of_2(nsplit)),
    )
    return out, lse


def _check_reads(ctx_blocks: torch.Tensor, ctx_lens: torch.Tensor, block_size: int, max_ctx: int,
                 pool_blocks: int) -> None:
    """CPU tensors: every context length fits the table and every block the keys read lies inside the pool
    (ValueError naming the first that does not). A GPU launch skips this (no copy back): there the kernel masks such
    reads."""
    bad = ((ctx_lens < 0) | (ctx_lens > max_ctx)).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        raise ValueError(f"ctx_lens[{b}] = {int(ctx_lens[b])} is outside [0, {max_ctx}] ({ctx_blocks.shape[1]} "
                         f"blocks x {block_size})")
    used = torch.arange(ctx_blocks.shape[1])[None, :] * block_size < ctx_lens[:, None]  # blocks the keys read
    bad = (used & ((ctx_blocks < 0) | (ctx_blocks >= pool_blocks))).nonzero()
    if bad.numel():
        b, j = int(bad[0, 0]), int(bad[0, 1])
        raise ValueError(f"ctx_blocks[{b}, {j}] = {int(ctx_blocks[b, j])} is outside the pool's {pool_blocks} "
                         "blocks")
