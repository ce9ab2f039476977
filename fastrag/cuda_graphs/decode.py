"""Decode steps replayed from CUDA graphs, one per (batch bucket, context-block bucket, shared prefix); small
prefills and DRAGIN's attention passes are replayed from graphs of their token bucket by
`fastrag.cuda_graphs.tokens` (`PrefillGraphs`, `PassGraphs`).

A decode step of a small model, or of a large one at a small batch, is dominated by kernel launches: ~15 per layer,
a few microseconds each, against a step of a few milliseconds. A CUDA graph records the whole forward once and
replays it with one launch. Everything a replay reads lives in static buffers that each step overwrites in place:

    ids [Bb, 1], positions [Bb, 1], write_slots [Bb], ctx_blocks [Bb, NBb], ctx_lens [Bb]

with Bb the batch rounded up to a bucket and NBb the table's width in blocks. Where the model decodes its own context
through a paged kernel (`LlamaModel.paged_decode_op`: its work follows the real lengths, so extra columns cost a
wider host copy of the table and nothing on the device), every graph takes the width of the model's whole context
(`ctx_blocks=`), so a graph is keyed by batch bucket and prefix only and a run's graphs can all be captured before
its first question (`capture_ahead`): captured as steps need them, a DRAGIN run's graphs come by the dozen as
batch sizes and context lengths change, each capture a stall inside the run's clock (benchmarks/results/README.md).
Elsewhere (the torch cascade, which gathers every column) the width is the longest own context rounded up to a power
of two, and graphs are captured as steps need them. Rows past the real batch are padding:
token 0 at position 0, written to a scratch block that no sequence owns and attending to that one key, so they stay
finite and never touch a sequence's cache; their logits are dropped. The shared prefix is part of the
graph (its consecutive slots are a fixed view of the pool, or its slot tensor is kept alive by the graph), so each
prefix gets its own graphs. A batch that mixes prefixes (two datasets run together, BeamSearchQA's prompt
families) replays a graph of its set of prefixes (up to MAX_PREFIXES) when the model decodes mixed batches in one
forward (`LlamaModel.mixes_prefixes`): one more static buffer, `member [K, Bb]`, says which rows start with which
prefix; each prefix's GEMM runs over every row (its keys and values are read once either way) and only its rows
merge the result, so the graph's shapes do not depend on how the rows split. Graphs are always captured with the
last layer's queries and row log-sum-exp as outputs, so steps that track DRAGIN's attention statistics replay the
same graph.

`emulate=True` (CPU, tests) runs the same protocol without CUDA: the AttnBatch and buffers are built once at
"capture" and every "replay" re-runs the forward on them, so a step that depended on anything but the static
buffers would show up as a wrong token in the CPU tests. A capture that fails on the GPU leaves that step to eager
decoding with a warning, and three failures turn graphs off for the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fastrag.cache.kv import block_table_tensor, blocks_needed
from fastrag.cuda_graphs.capture import capture_cuda_graph, try_capture
from fastrag.transfer import copy_into
from fastrag.model.llama import AttnBatch, PrefixGroup

# prefixes one decode graph may mix: each adds a GEMM over every row of the batch
MAX_PREFIXES = 4


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes a graph is captured for: 1, 2, 4, 8, 16, 24, 32, then steps of 16 to 64, of 32 to 256, of 64
    after, and max_batch itself (padding costs little: a decode step reads all weights whatever the batch)."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b = b * 2 if b < 16 else b + (8 if b < 32 else 16 if b < 64 else 32 if b < 256 else 64)
    out.append(max_batch)
    return out


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()

@dataclass
class _Graph:
    ids: torch.Tensor  # [Bb, 1]
    positions: torch.Tensor  # [Bb, 1]
    write_slots: torch.Tensor  # [Bb]
    ctx_blocks: torch.Tensor  # [Bb, NBb]
    ctx_lens: torch.Tensor  # [Bb]
    batch: AttnBatch  # built once on the buffers above
    member: torch.Tensor | None = None  # [K, Bb] bool: row b starts with prefix k (graphs of several prefixes)
    logits: torch.Tensor | None = None  # [Bb, V], the graph's output
    graph: object = None  # torch.cuda.CUDAGraph (None when emulated)


class DecodeGraphs:
    """Captures and replays decode steps for one engine (see the module doc).

    model, pool: the engine's.
    ctx_blocks: the fixed width (blocks) of every graph's block table, at least the most blocks one sequence's own
    context can take; None: the longest context of the step rounded up to a power of two (a graph per width).
    max_graphs: captures beyond it decode eagerly (each graph holds its own kernel arguments; memory is shared).
    """

    def __init__(self, model, pool, max_batch: int, *, emulate: bool = False, max_graphs: int = 160,
                 ctx_blocks: int | None = None):
        if ctx_blocks is not None and (not isinstance(ctx_blocks, int) or ctx_blocks < 1):
            raise ValueError(f"ctx_blocks must be a positive int or None, got {ctx_blocks!r}")
        self.model, self.pool = model, pool
        self.width = ctx_blocks
        self.emulate = emulate
        self.device = pool.k[0].device
        if not emulate and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, this one is on {self.device}; use emulate=True")
        self.buckets = batch_buckets(max_batch)
        self.max_graphs = max_graphs
        self.scratch_block = pool.allocate(1)[0]  # padding rows write and read here; never freed
        self.graphs: dict[tuple, _Graph] = {}
        self.disabled: str | None = None  # why graphs were turned off (max_failures failed captures), else None
        self.failures, self.max_failures = 0, 3  # a capture can fail once for a passing reason (another thread's
        # CUDA call during it); a step whose capture fails decodes eagerly and the next one tries again
        self.mempool = None if emulate else torch.cuda.graph_pool_handle()
        self.stats = {"replays": 0, "captures": 0, "eager_steps": 0}
        self._all_rows = torch.arange(self.buckets[-1], device=self.device)  # logits of every row, padding too

    def reset(self) -> None:
        """Drop every captured graph (e.g. after changing how the model decodes); later steps capture again. The
        graphs' memory pool goes with them and later captures take a new one: PyTorch's allocator refuses a capture
        into a private pool whose every graph was destroyed."""
        self.graphs.clear()
        if not self.emulate:
            self.mempool = torch.cuda.graph_pool_handle()

    def bucket(self, B: int, NB: int) -> tuple[int, int] | None:
        """(batch bucket, block bucket) for B sequences whose longest context takes NB blocks; None: too big."""
        if B > self.buckets[-1] or (self.width is not None and NB > self.width):
            return None
        return next(b for b in self.buckets if b >= B), self.width or _pow2(max(NB, 1))

    def run(self, ids: list[int], positions: list[int], write_slots: list[int],
            ctx: list[tuple[list[int], int]], prefix, prefix_start: int = -1,
            row_prefix: list[int] | None = None) -> tuple[torch.Tensor, AttnBatch] | None:
        """One decode step: per sequence its fed token, position, write slot and (blocks, context entries); the
        shared prefix all of them start with (None: none) and its first slot when its slots are consecutive.
        A batch of several prefixes passes `prefix` as a list of (prefix, first slot or -1) and `row_prefix`, per
        sequence the index in that list of its prefix (-1: none); the model must decode mixed batches in one
        forward (`mixes_prefixes`).

        Returns (logits [B, V] float32, the step's AttnBatch with last_layer filled, rows >= B padding) or None
        when this step cannot replay a graph (the caller decodes eagerly).
        """
        if self.disabled is not None:
            self.stats["eager_steps"] += 1
            return None
        bs = self.pool.block_size
        B = len(ids)
        bk = self.bucket(B, blocks_needed(ctx, bs))
        if bk is None:
            self.stats["eager_steps"] += 1
            return None
        Bb, NBb = bk
        mixed = row_prefix is not None
        g = self._graph(Bb, NBb, prefix, prefix_start, mixed)
        if g is None:
            self.stats["eager_steps"] += 1
            return None
        # the whole padded host image of the buffers, so rows left by a bigger previous batch become padding again
        sb = self.scratch_block * bs
        ids_h = torch.zeros(Bb, 1, dtype=torch.long)
        pos_h = torch.zeros(Bb, 1, dtype=torch.long)
        write_h = torch.full((Bb,), sb, dtype=torch.long)
        ids_h[:B, 0] = torch.tensor(ids, dtype=torch.long)
        pos_h[:B, 0] = torch.tensor(positions, dtype=torch.long)
        write_h[:B] = torch.tensor(write_slots, dtype=torch.long)
        tab_h, lens_h = block_table_tensor(ctx, bs, Bb, NBb, fill=self.scratch_block)
        bufs = [(g.ids, ids_h), (g.positions, pos_h), (g.write_slots, write_h), (g.ctx_blocks, tab_h),
                (g.ctx_lens, lens_h)]
        if mixed:
            mem = np.zeros(tuple(g.member.shape), dtype=np.bool_)
            rp = np.asarray(row_prefix, dtype=np.int64)
            real = np.flatnonzero(rp >= 0)
            mem[rp[real], real] = True
            bufs.append((g.member, torch.from_numpy(mem)))
        for dst, src in bufs:
            copy_into(dst, src)
        if self.emulate:
            g.logits = self._forward(g)
        else:
            g.graph.replay()
        self.stats["replays"] += 1
        return g.logits[:B], g.batch

    def _graph(self, Bb: int, NBb: int, prefix, prefix_start: int, mixed: bool) -> _Graph | None:
        """The graph of (Bb, NBb, prefix set), captured now if it is new; None: there is none (a mixed set of more
        than MAX_PREFIXES or on a model that cannot mix them, max_graphs reached, graphs turned off, or this capture
        failed: warned)."""
        if mixed and (len(prefix) > MAX_PREFIXES or not self.model.mixes_prefixes):
            return None
        if mixed:
            key = (Bb, NBb, ("mixed", *(_pkey(p, st) for p, st in prefix)))
        else:
            key = (Bb, NBb, _pkey(prefix, prefix_start))
        g = self.graphs.get(key)
        if g is not None:
            return g
        if self.disabled is not None or len(self.graphs) >= self.max_graphs:
            return None
        g = try_capture(self, lambda: self._capture(Bb, NBb, prefix, prefix_start, mixed), "",
                         "this step decodes eagerly", "decoding eagerly from now on")
        if g is not None:
            self.graphs[key] = g
        return g

    def capture_ahead(self, prefix_sets: list[list[tuple[object, int]]]) -> int:
        """Capture, for every batch bucket, the graph of each prefix set: a list of (prefix, first slot or -1) whose
        one element (prefix None: sequences without one) is a plain graph, and whose several elements, in the order
        `run` gets them, are a graph of mixed prefixes. Only with a fixed table width (the graphs then depend on
        nothing else); returns the number of graphs captured now."""
        if self.width is None:
            return 0
        before = len(self.graphs)
        for Bb in self.buckets:
            for pset in prefix_sets:
                if len(pset) > 1:
                    self._graph(Bb, self.width, pset, -1, True)
                else:
                    self._graph(Bb, self.width, pset[0][0], pset[0][1], False)
        return len(self.graphs) - before

    def _forward(self, g: _Graph) -> torch.Tensor:
        return self.model(g.ids, g.batch, self.pool.k, self.pool.v, logits_index=self._all_rows[: g.ids.shape[0]])

    def _capture(self, Bb: int, NBb: int, prefix, prefix_start: int, mixed: bool = False) -> _Graph:
        d = self.device
        bs = self.pool.block_size
        if mixed:  # every prefix of the set as a group over all rows, its rows named by the member buffer
            member = torch.zeros(len(prefix), Bb, dtype=torch.bool, device=d)
            groups = [PrefixGroup(None, p.length, p.slots, st, member=member[k]) for k, (p, st) in enumerate(prefix)]
            prefix, prefix_start = None, -1
        g = _Graph(
            ids=torch.zeros(Bb, 1, dtype=torch.long, device=d),
            positions=torch.zeros(Bb, 1, dtype=torch.long, device=d),
            write_slots=torch.full((Bb,), self.scratch_block * bs, dtype=torch.long, device=d),
            ctx_blocks=torch.full((Bb, NBb), self.scratch_block, dtype=torch.long, device=d),
            ctx_lens=torch.ones(Bb, dtype=torch.long, device=d),
            batch=None,
        )
        g.batch = AttnBatch(
            write_slots=g.write_slots, valid=torch.ones(Bb, 1, dtype=torch.bool, device=d), positions=g.positions,
            prefix_len=prefix.length if prefix is not None else 0,
            prefix_slots=prefix.slots if prefix is not None else torch.zeros(0, dtype=torch.long, device=d),
            ctx_blocks=g.ctx_blocks, ctx_lens=g.ctx_lens, block_size=bs,
            prefix_start=prefix_start if prefix is not None else -1, last_layer={},
        )
        if mixed:
            g.member, g.batch.prefix_groups = member, groups
        self.stats["captures"] += 1
        if self.emulate:
            return g
        # the buffers hold padding only (every row writes to the scratch block), so the warm-up runs that compile
        # the Triton kernels and the capture itself touch no sequence's cache
        g.graph, g.logits = capture_cuda_graph(d, self.mempool, lambda: self._forward(g))
        return g


def _pkey(prefix, start: int):
    """What a graph's reading of one shared prefix depends on: a consecutive prefix is a fixed view of the pool; a
    gathered one is read through its slot tensor (the graph's AttnBatch keeps that tensor alive, so its id is not
    reused while the graph exists)."""
    if prefix is None:
        return None
    return (prefix.length, start) if start >= 0 else (prefix.length, "slots", id(prefix.slots))

