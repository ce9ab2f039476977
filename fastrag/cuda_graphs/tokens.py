"""Prefills (`PrefillGraphs`) and DRAGIN's attention passes (`PassGraphs`) replayed from CUDA graphs, one graph
per token bucket.

A DRAGIN run's prefills are mostly small: a retrieval's new prompt after the shared demonstrations, one or two
sequences and tens to hundreds of tokens. Launched eagerly, such a call costs the host about 18 dispatches a layer
whatever its size, and the device waits for them: below a few hundred tokens a call's device time is set by its
launches, not by its weight reads, and hardly grows with its tokens (benchmarks/results/README.md). A graph replays
the whole forward with one launch.

Everything a replay reads sits in static buffers shared by every prefill graph (each graph reads their first
rows): per token ids, positions, write slots [M]; per sequence the kernel's rows `seqs` [S + 1, 5] and block table
[S + 1, W] (W: the model's whole context); the tiles [M / block_m + S, 2]; the prefixes' slots, concatenated; the rows
whose logits come out [S]. A graph is keyed by its token bucket M alone: the sequences (up to S = max_seqs),
their prefixes (any mix, up to MAX_PREFIXES) and lengths are data. Padding costs nothing but its rows' GEMM work:
a padding token writes its key to a scratch block no sequence owns and is covered by no tile, and a padding tile
points at the all-zero row S of `seqs` (no query, no key: the kernel's program ends at once).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fastrag.cuda_graphs.capture import capture_cuda_graph, try_capture
from fastrag.cuda_graphs.decode import MAX_PREFIXES
from fastrag.transfer import copy_into



def _aligned(n: int) -> int:
    return -(-n // 16) * 16


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts a prefill graph is captured for: 16, 32, 64, then steps of 64 to 256, of 128 to 512, of 256
    after, and max_tokens itself. A prefill's GEMMs read every weight whatever their rows, so up to a few hundred
    rows padding costs little; past that each bucket is at most 1.5x its smallest call."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out, m = [], 16
    while m < max_tokens:
        out.append(m)
        m = m * 2 if m < 64 else m + (64 if m < 256 else 128 if m < 512 else 256)
    out.append(max_tokens)
    return out


@dataclass
class _TokenGraph:
    M: int
    out: object = None  # the graph's output (a tensor, or a tuple of them)
    graph: object = None  # torch.cuda.CUDAGraph (None when emulated)


class _TokenGraphs:
    """What the prefill and the attention-pass graphs share: one graph per token bucket M over static buffers, each
    graph reading their first M rows; captured as calls need them or all ahead; a capture that fails on the GPU
    leaves that call eager with a warning, and three failures turn them off. emulate=True (CPU, tests): the same
    buffers, and every replay re-runs the forward on them. Subclasses fill `_forward(M)` (the captured work, returning
    its output) and `_views(M)` (their buffers' views), and set `scratch_block` and `block_size`."""

    what = "a packed call"

    def __init__(self, device: torch.device, max_tokens: int, max_seqs: int, emulate: bool, block_m: int | None):
        from fastrag.kernels.paged_prefill import DEFAULT_BLOCK_M, PrefillLayout

        for name, v in (("max_tokens", max_tokens), ("max_seqs", max_seqs)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.device, self.emulate = device, emulate
        if not emulate and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, this one is on {device}; use emulate=True")
        self.buckets = token_buckets(max_tokens)
        self.max_seqs = max_seqs
        self.block_m = DEFAULT_BLOCK_M if block_m is None else block_m
        self._layout_cls = PrefillLayout
        self.graphs: dict[int, _TokenGraph] = {}
        self.disabled: str | None = None
        self.failures, self.max_failures = 0, 3
        self.mempool = None if emulate else torch.cuda.graph_pool_handle()
        self.stats = {"replays": 0, "captures": 0, "eager_calls": 0, "captured_ahead": 0, "capture_ahead_s": 0.0}

    def n_tiles(self, M: int) -> int:
        """The kernel's tiles a graph of M tokens launches: a sequence of n tokens takes ceil(n / block_m) <=
        n / block_m + 1, so M / block_m + max_seqs cover any call; the rest are padding."""
        return -(-M // self.block_m) + self.max_seqs

    def bucket(self, n_tokens: int) -> int | None:
        return next((m for m in self.buckets if m >= n_tokens), None)

    def _graph_for(self, lists: list[list[int]], fits: bool = True) -> _TokenGraph | None:
        """The graph a call of these token lists replays (its token bucket's), or None, counted as an eager call: more
        lists or tokens than the graphs take, an empty list, `fits` False (the caller's own limits), or graphs that do
        not apply here or failed to capture."""
        M = self.bucket(sum(len(x) for x in lists))
        g = None
        if fits and len(lists) <= self.max_seqs and M is not None and all(lists) and self.applies():
            g = self._graph(M)
        if g is None:
            self.stats["eager_calls"] += 1
        return g

    def _write_layout(self, M: int, rows: list[tuple[int, int, int, int, int]]) -> None:
        """The kernel's per-sequence rows (q_start, q_len, ctx_len, pre_off, pre_len) and their tiles, as a graph of
        M tokens reads them, into the int32 buffer in one host copy: `seqs` [S + 1, 5] (row S stays zero: the
        padding tiles' empty sequence) and `tiles` (the rest pointing at row S)."""
        S = self.max_seqs
        i32 = np.zeros(self._ta + 2 * self.n_tiles(M), dtype=np.int32)
        seqs, tiles = i32[: 5 * (S + 1)].reshape(S + 1, 5), i32[self._ta:].reshape(-1, 2)
        tiles[:, 0] = S
        t = 0
        for b, r in enumerate(rows):
            seqs[b] = r
            k = -(-r[1] // self.block_m)
            tiles[t: t + k, 0] = b
            tiles[t: t + k, 1] = np.arange(k) * self.block_m
            t += k
        copy_into(self.i32[: i32.size], torch.from_numpy(i32))

    def _pad_only(self, M: int) -> None:
        """The buffers a graph of M tokens reads, as padding only (the warm-up and the capture): token 0 at position
        0 written to the scratch block, every table entry the scratch block, every tile the empty row."""
        ids, pos, slots, rows, tab, seqs, tiles = self._views(M)
        ids.zero_(), pos.zero_(), rows.zero_(), seqs.zero_()
        slots.fill_(self.scratch_block * self.block_size)
        tab.fill_(self.scratch_block)
        tiles[:, 0].fill_(self.max_seqs)
        tiles[:, 1].zero_()

    def _replay(self, g: _TokenGraph):
        if self.emulate:
            g.out = self._forward(g.M)
        else:
            g.graph.replay()
        self.stats["replays"] += 1
        return g.out

    def _graph(self, M: int) -> _TokenGraph | None:
        g = self.graphs.get(M)
        if g is not None or self.disabled is not None:
            return g
        g = try_capture(self, lambda: self._capture(M), f"of {self.what} of {M} tokens ", "this call runs eagerly",
                         "eager from now on")
        if g is not None:
            self.graphs[M] = g
        return g

    def applies(self) -> bool:
        return self.disabled is None

    def capture_ahead(self) -> int:
        """Capture every token bucket's graph now (tens of milliseconds each on a GPU); returns how many were
        captured. Nothing where the model's calls cannot replay them (`applies`)."""
        import time

        if not self.applies():
            return 0
        t0, before = time.perf_counter(), len(self.graphs)
        for M in self.buckets:
            self._graph(M)
        n = len(self.graphs) - before
        self.stats["captured_ahead"] += n
        self.stats["capture_ahead_s"] += time.perf_counter() - t0
        return n

    @torch.inference_mode()  # (as the engine's steps run: no autograd record of the captured forward)
    def _capture(self, M: int) -> _TokenGraph:
        # the buffers as padding only: every token writes to a scratch block and every tile is the empty row, so the
        # warm-up runs and the capture touch nothing a sequence owns
        self._pad_only(M)
        g = _TokenGraph(M)
        self.stats["captures"] += 1
        if self.emulate:
            return g
        g.graph, g.out = capture_cuda_graph(self.device, self.mempool, lambda: self._forward(M))
        return g

    def _forward(self, M: int):
        raise NotImplementedError

    def _views(self, M: int):
        """(ids, positions, key slots, rows, block table, seqs, tiles): the buffers' views a graph of M tokens reads."""
        raise NotImplementedError


class PrefillGraphs(_TokenGraphs):
    """Captures and replays packed prefills for one engine (the module doc): a call of up to max_seqs sequences
    and max_tokens new tokens whose prefixes, concatenated, fit max_prefix_slots replays the graph of its token
    bucket; anything else is the caller's to run eagerly (`run` returns None). Only for a model that prefills through
    the paged prefill kernel with the fused small operations; where it does not, every call is eager.

    emulate=True (CPU, tests): every replay re-runs `LlamaModel.prefill_static` on the buffers."""

    what = "a prefill"

    def __init__(self, model, pool, *, ctx_blocks: int, max_tokens: int = 1024, max_seqs: int = 16,
                 max_prefix_slots: int | None = None, emulate: bool = False, block_m: int | None = None,
                 scratch_block: int | None = None):
        if not isinstance(ctx_blocks, int) or isinstance(ctx_blocks, bool) or ctx_blocks < 1:
            raise ValueError(f"ctx_blocks must be a positive int, got {ctx_blocks!r}")
        if scratch_block is not None and (isinstance(scratch_block, bool) or not isinstance(scratch_block, int)
                                          or not 0 <= scratch_block < pool.num_blocks):
            raise ValueError(f"scratch_block must be a block of the pool (0..{pool.num_blocks - 1}) or None, "
                             f"got {scratch_block!r}")
        super().__init__(pool.k[0].device, max_tokens, max_seqs, emulate, block_m)
        self.model, self.pool = model, pool
        bs = self.block_size = pool.block_size
        self.width = ctx_blocks
        self.max_prefix_slots = MAX_PREFIXES * ctx_blocks * bs if max_prefix_slots is None else max_prefix_slots
        # padding tokens write here; never freed. Another scratch block no sequence owns (the decode graphs') serves
        # as well: padding writes token 0's keys there and only padding reads them
        self.scratch_block = pool.allocate(1)[0] if scratch_block is None else scratch_block
        Mx, S, W = self.buckets[-1], max_seqs, ctx_blocks
        # the int64 inputs in one buffer (one host copy a call): ids, positions, write slots [Mx] | logit rows [S] |
        # block table [S + 1, W] (row S: the padding tiles' empty sequence); the kernel's int32 rows and tiles in
        # another
        # (each part from a multiple of 16 elements: the kernels' pointers keep Triton's 16-byte alignment)
        self._ma, self._sa, self._ta = _aligned(Mx), _aligned(S), _aligned(5 * (S + 1))
        self._i64_len = 3 * self._ma + self._sa + (S + 1) * W
        self._i32_len = self._ta + 2 * self.n_tiles(Mx)
        d = self.device
        self.i64 = torch.zeros(self._i64_len, dtype=torch.long, device=d)
        self.i32 = torch.zeros(self._i32_len, dtype=torch.int32, device=d)
        self.pre_slots = torch.zeros(max(1, self.max_prefix_slots), dtype=torch.long, device=d)
        # the prefix slot tensors copied into pre_slots, in order, kept alive here (so no other tensor takes their
        # memory): a call whose prefixes sit at the same addresses copies nothing (a prefix's slots never change)
        self._pre_held: list = []
        c = model.c
        self.out = torch.zeros(Mx, c.num_heads, c.head_dim, dtype=pool.k[0].dtype, device=d)

    # the views of the static buffers that a graph of M tokens reads
    def _views(self, M: int):
        S, W, Ma, Ta = self.max_seqs, self.width, self._ma, self._ta
        i64, i32 = self.i64, self.i32
        ids, pos, write = i64[:M], i64[Ma: Ma + M], i64[2 * Ma: 2 * Ma + M]
        rows = i64[3 * Ma: 3 * Ma + S]
        tab = i64[3 * Ma + self._sa:].view(S + 1, W)
        seqs = i32[: 5 * (S + 1)].view(S + 1, 5)
        tiles = i32[Ta: Ta + 2 * self.n_tiles(M)].view(-1, 2)
        return ids, pos, write, rows, tab, seqs, tiles

    def applies(self) -> bool:
        """Whether this model's prefills can replay these graphs on this device (the paged kernel passed its
        self-check there, and the small operations are fused) and the graphs are on."""
        m = self.model
        return self.disabled is None and m.uses_fused_prefill(self.device) \
            and m.uses_paged_prefill(self.device, self.pool.k[0].dtype)

    @torch.inference_mode()
    def run(self, tokens: list[list[int]], starts: list[int], write_slots: list[int],
            ctx: list[tuple[list[int], int]], prefixes: list) -> torch.Tensor | None:
        """One packed prefill: per sequence its new tokens, the position of the first, (own blocks, own keys after
        this call) and its shared prefix (an object with `.length` and `.slots`, or None); write_slots the new
        tokens' slots in packed order. Returns logits [B, V] float32 of each sequence's last new token (a tensor of
        its own), or None when this call does not fit a graph (the caller prefills eagerly)."""
        B, N = len(tokens), sum(len(t) for t in tokens)
        bs, W = self.pool.block_size, self.width
        # the prefixes, concatenated in order of first use (a sequence without one: length 0)
        order, where, off = [], {}, 0
        for p in prefixes:
            if p is not None and p.length and id(p.slots) not in where:
                where[id(p.slots)] = off
                order.append(p.slots[: p.length])
                off += p.length
        g = self._graph_for(tokens, len(order) <= MAX_PREFIXES and off <= self.max_prefix_slots
                            and all(n <= W * bs for _, n in ctx))
        if g is None:
            return None
        M, S, Ma = g.M, self.max_seqs, self._ma
        i64 = np.zeros(self._i64_len, dtype=np.int64)
        lens = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=B)
        first = np.cumsum(lens) - lens
        i64[:N] = np.fromiter((t for seq in tokens for t in seq), dtype=np.int64, count=N)
        i64[Ma: Ma + N] = np.repeat(np.asarray(starts, dtype=np.int64) - first, lens) + np.arange(N)
        i64[2 * Ma: 2 * Ma + M] = self.scratch_block * bs
        i64[2 * Ma: 2 * Ma + N] = write_slots
        i64[3 * Ma: 3 * Ma + B] = first + lens - 1
        tab = i64[3 * Ma + self._sa:].reshape(S + 1, W)
        tab[:] = self.scratch_block
        for b, (blocks, n_ctx) in enumerate(ctx):
            nb = -(-n_ctx // bs)
            tab[b, :nb] = blocks[:nb]
        self._write_layout(M, [
            (first[b], lens[b], n_ctx, where[id(p.slots)] if p is not None and p.length else 0,
             p.length if p is not None else 0) for b, ((_, n_ctx), p) in enumerate(zip(ctx, prefixes))])
        key = lambda ts: [(s.data_ptr(), s.numel()) for s in ts]  # noqa: E731
        if key(order) != key(self._pre_held[: len(order)]):
            at = 0
            for s in order:  # (device to device, enqueued)
                self.pre_slots[at: at + s.numel()].copy_(s)
                at += s.numel()
            self._pre_held = order
        copy_into(self.i64, torch.from_numpy(i64))
        return self._replay(g)[:B].clone()  # (the next replay of this graph overwrites its output)

    def _forward(self, M: int) -> torch.Tensor:
        ids, pos, write, rows, tab, seqs, tiles = self._views(M)
        layout = self._layout_cls(tiles, seqs, self.pre_slots, tab, self.pool.block_size, M, self.block_m)
        return self.model.prefill_static(ids, pos, write, layout, rows, self.pool.k, self.pool.v, self.out[:M])


class PassGraphs(_TokenGraphs):
    """DRAGIN's cache-free attention passes (`LlamaModel.last_layer_qk`: token lists from position 0 through every
    layer to the last one's queries and keys) replayed from graphs, one per token bucket, as PrefillGraphs does for
    prefills. The keys live in the graphs' own scratch pool [Hkv, slots, D], sequence b from a block boundary; the
    padding tokens write to its last block. A call of up to max_seqs lists and max_tokens tokens replays; anything
    else is the caller's to run eagerly (`run` returns None). Only for a model whose passes attend through the paged
    prefill kernel with the fused small operations.

    emulate=True (CPU, tests): every replay re-runs `LlamaModel.last_layer_qk_static` on the buffers."""

    what = "an attention pass"

    def __init__(self, model, *, max_tokens: int = 1024, max_seqs: int = 32, emulate: bool = False,
                 block_m: int | None = None):
        w = model.embed.weight
        super().__init__(w.device, max_tokens, max_seqs, emulate, block_m)
        self.model, self.dtype = model, w.dtype
        bs = self.block_size = 16
        Mx, S = self.buckets[-1], max_seqs
        self.width = W = -(-Mx // bs)  # (one list holds at most Mx tokens)
        # each list from a block boundary: at most Mx + S * (bs - 1) slots, then the padding's scratch block
        self.scratch_block = W + S
        c = model.c
        self.ks = torch.zeros(c.num_kv_heads, (self.scratch_block + 1) * bs, c.head_dim, dtype=w.dtype,
                              device=w.device)
        self.vs = torch.zeros_like(self.ks)
        self.out = torch.zeros(Mx, c.num_heads, c.head_dim, dtype=w.dtype, device=w.device)
        # int64: ids, positions, key slots [Mx] | each real token's row in the caller's [B * T] order [Mx] | block
        # table [S + 1, W]; int32: the kernel's rows and tiles
        self._ma, self._ta = _aligned(Mx), _aligned(5 * (S + 1))  # (16-byte aligned parts, as PrefillGraphs')
        self._i64_len = 4 * self._ma + (S + 1) * W
        self._i32_len = self._ta + 2 * self.n_tiles(Mx)
        self.i64 = torch.zeros(self._i64_len, dtype=torch.long, device=w.device)
        self.i32 = torch.zeros(self._i32_len, dtype=torch.int32, device=w.device)
        self._no_prefix = torch.zeros(1, dtype=torch.long, device=w.device)  # (the kernel's prefix slots: none read)

    def _views(self, M: int):
        S, W, Ma, Ta = self.max_seqs, self.width, self._ma, self._ta
        i64, i32 = self.i64, self.i32
        ids, pos, slots, rows = i64[:M], i64[Ma: Ma + M], i64[2 * Ma: 2 * Ma + M], i64[3 * Ma: 3 * Ma + M]
        tab = i64[4 * Ma:].view(S + 1, W)
        seqs = i32[: 5 * (S + 1)].view(S + 1, 5)
        tiles = i32[Ta: Ta + 2 * self.n_tiles(M)].view(-1, 2)
        return ids, pos, slots, rows, tab, seqs, tiles

    def applies(self) -> bool:
        m = self.model
        return self.disabled is None and m.uses_fused_prefill(self.device) \
            and m.uses_paged_prefill(self.device, self.dtype)

    @torch.inference_mode()
    def run(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`last_layer_qk` of the padded [B, T] batch of these token lists (T the longest) through a replayed graph:
        q [B, H, T, D] and k [B, Hkv, T, D] of the last layer, zero past each list's length (tensors of their own);
        None when the call does not fit a graph (the caller runs the pass eagerly)."""
        g = self._graph_for(seqs)
        if g is None:
            return None
        B, N, M = len(seqs), sum(len(x) for x in seqs), g.M
        S, W, Ma, bs = self.max_seqs, self.width, self._ma, self.block_size
        T = max(len(x) for x in seqs)
        lens = np.fromiter((len(x) for x in seqs), dtype=np.int64, count=B)
        first = np.cumsum(lens) - lens
        nb = -(-lens // bs)
        start_block = np.cumsum(nb) - nb  # list b's keys from block start_block[b]
        t = np.arange(N) - np.repeat(first, lens)  # each token's position in its list
        b_of = np.repeat(np.arange(B), lens)
        i64 = np.zeros(self._i64_len, dtype=np.int64)
        i64[:N] = np.fromiter((x for s in seqs for x in s), dtype=np.int64, count=N)
        i64[Ma: Ma + N] = t
        i64[2 * Ma: 2 * Ma + M] = self.scratch_block * bs
        i64[2 * Ma: 2 * Ma + N] = start_block[b_of] * bs + t
        i64[3 * Ma: 3 * Ma + N] = b_of * T + t
        tab = i64[4 * Ma:].reshape(S + 1, W)
        for b in range(B):
            tab[b, : nb[b]] = np.arange(start_block[b], start_block[b] + nb[b])
        self._write_layout(M, [(first[b], lens[b], lens[b], 0, 0) for b in range(B)])
        copy_into(self.i64, torch.from_numpy(i64))
        q_all = self._replay(g)  # [M, H, D] of the last layer; its keys in self.ks
        _, _, slots, rows, *_ = self._views(M)
        c = self.model.c
        H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        q = q_all.new_zeros(B * T, H, D).index_copy_(0, rows[:N], q_all[:N])
        k = self.ks.new_zeros(Hkv, B * T, D).index_copy_(1, rows[:N], self.ks.index_select(1, slots[:N]))
        return q.view(B, T, H, D).transpose(1, 2), k.view(Hkv, B, T, D).transpose(0, 1)

    def _forward(self, M: int) -> torch.Tensor:
        ids, pos, slots, rows, tab, seqs, tiles = self._views(M)
        layout = self._layout_cls(tiles, seqs, self._no_prefix, tab, self.block_size, M, self.block_m)
        return self.model.last_layer_qk_static(ids, pos, slots, layout, self.ks, self.vs, self.out[:M])
