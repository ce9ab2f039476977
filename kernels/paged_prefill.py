"""Paged prefill attention: every new token of a packed prefill over its shared prefix and its own paged context, in
one launch per layer (Triton).

A prefill call packs the new tokens of B sequences into N rows: q [N, H, D], sequence b's tokens in rows
q_start[b] .. q_start[b] + q_len[b]. Its keys and values are in the engine's pool [Hkv, num_slots, D] already (the
rotary + KV-write step of the same layer put them there):
- its shared prefix (the demonstrations), pre_len[b] keys in slots pre_slots[pre_off[b] + i], which every new token
  sees whole. Sequences of one prefix point at the same slots; pre_len[b] = 0: no prefix;
- its own context of ctx_len[b] keys (the new tokens included, last), token n in slot
  ctx_blocks[b, n // bs] * bs + n % bs. New token j of b is own token ctx_len[b] - q_len[b] + j and sees its own
  tokens up to itself (causal).

Program = (tile of BLOCK_M new tokens of one sequence, query head): the tile's queries against the prefix's keys,
then against its own keys up to its last token, in tiles of BLOCK_N with an online softmax in float32. The tiles are
listed on the host (`prefill_layout`), so a call of very different lengths runs without padding, and nothing is
gathered or copied: the keys are read in place.

Per layer this one launch replaces the packed prefill's attention buckets of torch calls (per bucket a gather of
its blocks, the cascade's two fused calls, their merge and the scatter back; benchmarks/bench_host.py counts them).
The default for CUDA tensors ($FASTRAG_PAGED_PREFILL, fastrag.model.llama); DRAGIN's attention passes
(`last_layer_qk`) attend through it too. Checked against fastrag.signals.reference.paged_prefill_ref and against the
model's torch path in tests/test_paged_prefill.py.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from fastrag.kernels import INTERPRETED
from fastrag.kernels.paged_attention import check_query_and_pool, online_softmax_tile


@triton.jit(do_not_specialize=["stride_tb", "MAX_CTX"])
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, tiles_ptr, seq_ptr, pre_slots_ptr, tab_ptr,
    stride_qn, stride_qh, stride_on, stride_oh, stride_kh, stride_ks, stride_vh, stride_vs, stride_tb,
    scale, G, MAX_CTX, NB_POOL, NUM_SLOTS,
    D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, WIDE: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    i_kh = i_h // G
    # the kv head's rows as a scalar base (int64: a pool may pass 2**31 elements); the keys' offsets in it are
    # int32 unless one head's slots pass 2**31 elements (WIDE). On sm_90 (cuobjdump -res-usage, 64 x 64 bf16 tiles)
    # int32 offsets took 221 registers against 235 at 8 warps and 2 stages, and spilled nothing at 3 stages where
    # int64 ones spilled 104 bytes a thread
    k_head = k_ptr + i_kh * stride_kh
    v_head = v_ptr + i_kh * stride_vh
    i_b = tl.load(tiles_ptr + i_t * 2).to(tl.int64)
    m0 = tl.load(tiles_ptr + i_t * 2 + 1)
    # the sequence's row: q_start, q_len, ctx_len, pre_off, pre_len (int32)
    q_start = tl.load(seq_ptr + i_b * 5)
    q_len = tl.load(seq_ptr + i_b * 5 + 1)
    ctx_len = tl.minimum(tl.maximum(tl.load(seq_ptr + i_b * 5 + 2), q_len), MAX_CTX)
    pre_off = tl.load(seq_ptr + i_b * 5 + 3)
    pre_len = tl.load(seq_ptr + i_b * 5 + 4)
    o_m = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, D_PAD)
    m_d = o_d < D
    m_m = (m0 + o_m) < q_len
    rows = (q_start + m0 + o_m).to(tl.int64)
    b_q = tl.load(q_ptr + rows[:, None] * stride_qn + i_h * stride_qh + o_d[None, :],
                  mask=m_m[:, None] & m_d[None, :], other=0.0)
    if UPCAST:
        b_q = b_q.to(tl.float32)
    b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_M], tl.float32)
    b_acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # 1. the shared prefix: every row sees all of it
    for p0 in range(0, pre_len, BLOCK_N):
        o_n = p0 + tl.arange(0, BLOCK_N)
        m_n = o_n < pre_len
        slot = tl.load(pre_slots_ptr + pre_off + o_n, mask=m_n, other=0)
        m_n = m_n & (slot >= 0) & (slot < NUM_SLOTS)
        if WIDE:
            slot = slot.to(tl.int64)
        else:
            slot = slot.to(tl.int32)
        b_m, b_l, b_acc = online_softmax_tile(b_q, k_head + slot[:, None] * stride_ks + o_d[None, :],
                                              v_head + slot[:, None] * stride_vs + o_d[None, :], m_n, True, m_d,
                                              scale, b_m, b_l, b_acc, IEEE, UPCAST)
    # 2. the own context, causal: row i is own token first + m0 + i and sees own tokens 0 .. itself
    first = ctx_len - q_len
    own = first + m0 + o_m  # [BLOCK_M] each row's own position
    n_end = tl.minimum(first + m0 + BLOCK_M, ctx_len)
    for n0 in range(0, n_end, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < n_end
        blk = tl.load(tab_ptr + i_b * stride_tb + o_n // BS, mask=m_n, other=0)
        m_n = m_n & (blk >= 0) & (blk < NB_POOL)
        if WIDE:
            slot = blk.to(tl.int64) * BS + (o_n % BS).to(tl.int64)
        else:
            slot = blk.to(tl.int32) * BS + o_n % BS
        b_m, b_l, b_acc = online_softmax_tile(b_q, k_head + slot[:, None] * stride_ks + o_d[None, :],
                                              v_head + slot[:, None] * stride_vs + o_d[None, :], m_n,
                                              o_n[None, :] <= own[:, None], m_d, scale, b_m, b_l, b_acc, IEEE,
                                              UPCAST)
    out = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
    tl.store(o_ptr + rows[:, None] * stride_on + i_h * stride_oh + o_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=m_m[:, None] & m_d[None, :])


class PrefillLayout:
    """What `paged_prefill_attention` needs besides q and the pool, built once per forward on the host and moved to
    the device in two copies: `tiles` [n_tiles, 2] int32 (sequence, first new token) and `seqs` [B, 5] int32
    (q_start, q_len, ctx_len, pre_off, pre_len), plus `pre_slots` (the prefixes' slots, one tensor) and
    `ctx_blocks` [B, NB] (the block table)."""

    __slots__ = ("tiles", "seqs", "pre_slots", "ctx_blocks", "block_size", "n_rows", "block_m")

    def __init__(self, tiles, seqs, pre_slots, ctx_blocks, block_size: int, n_rows: int, block_m: int):
        self.tiles, self.seqs, self.pre_slots, self.ctx_blocks = tiles, seqs, pre_slots, ctx_blocks
        self.block_size, self.n_rows, self.block_m = block_size, n_rows, block_m


# Query rows per program: 64, on a GPU (tensor-core tiles) and under the interpreter, whose cost is per program and
# per key tile rather than per element: padded rows cost it next to nothing, and a tile of 16 rows re-reads the keys
# 4 times as often (interpreted, 64 x 128 tiles run a prefill several times faster than 16 x 64:
# benchmarks/gpu/NOTES.md).
DEFAULT_BLOCK_M = 64


def default_block_n() -> int:
    """Keys per tile of the prefill kernel's loop: 64 compiled for a GPU (spill-free 64 x 64 bf16 tiles on sm_90,
    tests/test_triton_sm90.py); 128 under the interpreter, fewer passes of the loop (DEFAULT_BLOCK_M)."""
    return 128 if INTERPRETED else 64


def prefill_layout(q_lens: list[int], ctx_lens: list[int], pre: list[tuple[int, int]], pre_slots: torch.Tensor,
                   ctx_blocks: torch.Tensor, block_size: int, block_m: int | None = None) -> PrefillLayout:
    """The layout of a packed prefill of len(q_lens) sequences (host lists): q_lens[b] new tokens of sequence b,
    packed in order; ctx_lens[b] its own keys after this call (>= q_lens[b]); pre[b] = (offset into pre_slots,
    length) of its prefix ((0, 0): none); pre_slots the concatenated prefix slots (device tensor, int32/int64);
    ctx_blocks [B, NB] its block table (device). Raises ValueError naming the first bad entry."""
    B = len(q_lens)
    if len(ctx_lens) != B or len(pre) != B or ctx_blocks.dim() != 2 or ctx_blocks.shape[0] != B:
        raise ValueError(f"q_lens, ctx_lens, pre and ctx_blocks must describe the same {B} sequences, got "
                         f"{len(ctx_lens)}, {len(pre)} and {tuple(ctx_blocks.shape)}")
    if not (isinstance(block_size, int) and block_size > 0):
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    block_m = DEFAULT_BLOCK_M if block_m is None else block_m
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    max_ctx = ctx_blocks.shape[1] * block_size
    seqs = np.zeros((B, 5), dtype=np.int32)
    tiles = []
    start = 0
    for b in range(B):
        n, c, (off, plen) = q_lens[b], ctx_lens[b], pre[b]
        if not 0 <= n <= c <= max_ctx:
            raise ValueError(f"sequence {b}: {n} new tokens and {c} own keys must satisfy 0 <= new <= keys <= "
                             f"{max_ctx} (its table's {ctx_blocks.shape[1]} blocks x {block_size})")
        if plen < 0 or off < 0 or off + plen > pre_slots.numel():
            raise ValueError(f"sequence {b}: its prefix (offset {off}, {plen} keys) lies outside the "
                             f"{pre_slots.numel()} prefix slots given")
        seqs[b] = (start, n, c, off, plen)
        tiles += [(b, m) for m in range(0, n, block_m)]
        start += n
    dev = ctx_blocks.device
    return PrefillLayout(_to(np.asarray(tiles, dtype=np.int32).reshape(-1, 2), dev), _to(seqs, dev),
                         pre_slots, ctx_blocks, block_size, start, block_m)


def _to(a: np.ndarray, device) -> torch.Tensor:
    from fastrag.transfer import to_device

    return to_device(torch.from_numpy(np.ascontiguousarray(a)), device)


def paged_prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, layout: PrefillLayout,
                            scale: float, out: torch.Tensor | None = None, block_n: int | None = None,
                            num_warps: int | None = None, num_stages: int | None = None,
                            wide: bool | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v of every packed new token over its prefix and its causal own context (module doc).

    q [N, H, D] (any strides with a contiguous last dim, e.g. a transposed [H, N, D]); k_pool/v_pool
    [Hkv, num_slots, D], q's dtype; layout from `prefill_layout` (its sequences' q_lens summing to N). Returns
    [N, H, D] in q's dtype (into `out` when given). On a GPU, out-of-range lengths, slots and block ids in the layout
    are clamped and masked in the kernel (checked on the host only in `prefill_layout`). block_n, num_warps,
    num_stages: launch settings (None: default_block_n(), 8 warps and 2 stages); wide: int64 key offsets within a
    kv head (None: only where a pool's head passes 2**31 elements).
    """
    check_query_and_pool(q, k_pool, v_pool, "N")
    N, H, D = q.shape
    Hkv = k_pool.shape[0]
    if q.stride(2) != 1 or k_pool.stride(2) != 1 or v_pool.stride(2) != 1:
        raise ValueError("q, k_pool and v_pool must be contiguous in the head dim")
    if N != layout.n_rows:
        raise ValueError(f"q has {N} rows but the layout packs {layout.n_rows} new tokens")
    block_n = default_block_n() if block_n is None else block_n
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if k_pool.shape[1] % layout.block_size:
        raise ValueError(f"the layout's block_size {layout.block_size} does not divide the pool's "
                         f"{k_pool.shape[1]} slots")
    if out is None:
        out = torch.empty(N, H, D, dtype=q.dtype, device=q.device)
    elif out.shape != (N, H, D) or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be [N, H, D] = {(N, H, D)} of {q.dtype}, contiguous in D")
    n_tiles = layout.tiles.shape[0]
    if n_tiles == 0:
        return out
    if layout.ctx_blocks.device.type == "cpu" and layout.seqs.device.type == "cpu":
        _check_reads(layout, k_pool.shape[1])
    tab = layout.ctx_blocks if layout.ctx_blocks.stride(1) == 1 else layout.ctx_blocks.contiguous()
    if wide is None:
        wide = max(k_pool.shape[1] * k_pool.stride(1), v_pool.shape[1] * v_pool.stride(1)) >= 2**31
    # (8 warps, 2 stages: spill-free on sm_90 for 64 x 64 bf16 tiles of head dim 128, tests/test_triton_sm90.py;
    # Triton's defaults, 4 and 3, spill 256 bytes a thread; the interpreter ignores both)
    num_warps = 8 if num_warps is None else num_warps
    num_stages = 2 if num_stages is None else num_stages
    _paged_prefill_kernel[(n_tiles, H)](
        q, k_pool, v_pool, out, layout.tiles, layout.seqs, layout.pre_slots, tab,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1), tab.stride(0),
        float(scale), H // Hkv, tab.shape[1] * layout.block_size, k_pool.shape[1] // layout.block_size,
        k_pool.shape[1],
        D=D, D_PAD=max(16, triton.next_power_of_2(D)), BS=layout.block_size, BLOCK_M=layout.block_m,
        BLOCK_N=block_n,
        # (the interpreter multiplies bf16 tiles in tl.dot as raw integers: there every tile is upcast first)
        IEEE=q.dtype == torch.float32 or INTERPRETED, UPCAST=q.dtype != torch.float32 and INTERPRETED, WIDE=bool(wide),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def _check_reads(layout: PrefillLayout, num_slots: int) -> None:
    """CPU tensors: every block id and prefix slot the kernel will read lies inside the pool (ValueError naming the
    first that does not). A GPU launch skips this (no copy back): there the kernel masks such reads."""
    seqs, tab, bs = layout.seqs, layout.ctx_blocks, layout.block_size
    pool_blocks = num_slots // bs
    used = torch.arange(tab.shape[1])[None, :] * bs < seqs[:, 2:3].to(torch.int64)
    bad = (used & ((tab < 0) | (tab >= pool_blocks))).nonzero()
    if bad.numel():
        b, j = int(bad[0, 0]), int(bad[0, 1])
        raise ValueError(f"ctx_blocks[{b}, {j}] = {int(tab[b, j])} is outside the pool's {pool_blocks} blocks")
    for b, (off, n) in enumerate(seqs[:, 3:5].tolist()):
        if n:
            part = layout.pre_slots[off: off + n]
            bad = ((part < 0) | (part >= num_slots)).nonzero()
            if bad.numel():
                i = off + int(bad[0, 0])
                raise ValueError(f"sequence {b}'s prefix slot pre_slots[{i}] = {int(layout.pre_slots[i])} is "
                                 f"outside the pool's {num_slots} slots")
