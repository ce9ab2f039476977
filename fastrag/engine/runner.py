"""The model runner: executes a step's plan on the device. Prefill and decode forwards (eager, or replayed from CUDA
graphs), the decode step's attention tracking, the fused sampling kernel's launch and the host copy of its
results, and the host-device copies around them."""

from __future__ import annotations

import time

import torch

from fastrag.cache.kv import KVPool, block_table_tensor, blocks_needed
from fastrag.cuda_graphs import DecodeGraphs, PassGraphs, PrefillGraphs
from fastrag.engine.clock import DeviceClock
from fastrag.engine.planner import StepPlan
from fastrag.engine.registry import PrefixRegistry
from fastrag.engine.sequence import PendingStep, SamplingParams, SeqState
from fastrag.engine.sizing import (CUDA_GRAPHS_ENV, PASS_GRAPH_SEQS, PASS_GRAPH_TOKENS, PASS_GRAPHS_ENV,
                                   PREFILL_GRAPH_SEQS, PREFILL_GRAPHS_ENV, prefill_graph_tokens, sampling_key)
from fastrag.model.llama import AttnBatch, LlamaModel, PrefixGroup
from fastrag.settings import setting
from fastrag.transfer import tensor_on, to_device


class ModelRunner:
    """The forwards and sampling of the engine's steps. `graphs` / `prefill_graphs`: the decode and prefill graphs
    (None: eager); `trace_row`: the step trace's row of the step launched last (None: not tracing)."""

    def __init__(self, model: LlamaModel, pool: KVPool, registry: PrefixRegistry, stats: dict, clock: DeviceClock,
                 *, signals, sampling: SamplingParams, eos_ids: set, graphs=None, prefill_graphs=None):
        self.model, self.pool, self.registry, self.stats, self.clock = model, pool, registry, stats, clock
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.signals, self.sampling, self.eos_ids = signals, sampling, eos_ids
        self.graphs, self.prefill_graphs = graphs, prefill_graphs
        self.trace_row: dict | None = None

    # ------------------------------------------------------------------ a step's parts
    def prefill_begin(self, plan: StepPlan, row: dict | None):
        """Before the plan's prefill forward: its trace row's sizes and the counters it is measured against."""
        group = plan.group
        replays0 = work0 = None
        if row is not None:
            row["prefill_seqs"], row["prefill_tokens"] = len(group), sum(len(s.pending_prompt) for s in group)
            replays0 = self.prefill_graphs.stats["replays"] if self.prefill_graphs is not None else 0
            work0 = (self.stats["prefill_calls"], self.stats["prefill_ctx_tokens"])
        return self.clock.mark(), replays0, work0

    def prefill_end(self, plan: StepPlan, logits: torch.Tensor, begun, row: dict | None, async_prefill: bool):
        """After the plan's prefill forward: the first token of every prefilled generation in one signals call and
        one host copy (a sequence with tracked tokens still to feed samples nothing yet: they go in one per decode
        step). Returns (which group rows finished, the sequences whose first token is in flight, their sampled
        handle): with async_prefill the tokens are sampled now and read in step_finish, and the sequences decode from
        the next step."""
        group = plan.group
        dev0, replays0, work0 = begun
        joining, join_sampled = [], None
        if row is not None:  # its forwards and the KV entries their attention read (fastrag.perf's floor)
            row["prefill_calls"] = self.stats["prefill_calls"] - work0[0]
            row["prefill_ctx_tokens"] = self.stats["prefill_ctx_tokens"] - work0[1]
            if self.prefill_graphs is not None:  # (graphed prefills apart from eager ones)
                row["prefill_graphed"] = self.prefill_graphs.stats["replays"] > replays0
        for s in group:
            s.pending_prompt = []
        rows = [i for i, s in enumerate(group) if s.computed == len(s.tokens)]
        done = {}
        if rows:
            sel, lg = [group[i] for i in rows], logits if len(rows) == len(group) else logits[rows]
            if async_prefill:
                joining, join_sampled = sel, self.sample_launch(sel, lg)
                self.clock.stop("device_prefill_s", dev0, join_sampled[1], row)
            else:
                done = dict(zip(rows, self.append_batch(sel, lg, dev0, row)))
        else:
            self.clock.stop("device_prefill_s", dev0, row=row)
        return done, joining, join_sampled

    def launch_decode(self, st: PendingStep, batch: list[SeqState], row: dict | None) -> None:
        """One decode step for batch: its forward and the launch of its sampling (st.sampled); raises with nothing
        appended when a forward fails."""
        st.batch = batch
        if row is not None:
            row["decode_batch"] = len(batch)
            kv0 = (self.stats["decode_ctx_tokens"], self.stats["decode_prefix_tokens"])
        dev0 = self.clock.mark()
        logits = self.decode(batch)
        if row is not None:  # the KV entries this step's attention read (each shared prefix once)
            row["decode_ctx_tokens"] = self.stats["decode_ctx_tokens"] - kv0[0]
            row["decode_prefix_tokens"] = self.stats["decode_prefix_tokens"] - kv0[1]
            row["decode_prefixes"] = len({id(s.prefix) for s in batch if s.prefix is not None})
        # a sequence still feeding the tracked tokens of its prompt samples nothing this step
        # (s.computed written out: this runs for every sequence of every step)
        st.ready = [i for i, s in enumerate(batch)
                    if (s.prefix.length if s.prefix else 0) + s.table.num_tokens == len(s.tokens)]
        if st.ready:
            st.sampled = self.sample_launch([batch[i] for i in st.ready],
                                            logits if len(st.ready) == len(batch) else logits[st.ready])
        self.clock.stop("device_decode_s", dev0, st.sampled[1] if st.sampled is not None else None, row)

    # ------------------------------------------------------------------ forwards
    def prefill(self, items: list[tuple[SeqState, list[int]]], want_logits: bool, decode: bool = False):
        """Compute KV for each sequence's new tokens (padded batch). Returns last-token logits [B, V].
        The sequences may start with different shared prefixes. decode: one token each (a decode step), whose
        tracked sequences' attention statistics are updated."""
        B = len(items)
        T = max(len(ids) for _, ids in items)
        for s, ids in items:
            s.table.reserve(len(ids))
        # (a decode step never keeps a hidden state: not looked for on that path)
        keep = [] if decode else [b for b, (s, _) in enumerate(items) if s.hidden_layer is not None]
        graphed = self.prefill_graphs is not None and not decode and not keep
        logits = self.prefill_graphed(items) if graphed else None
        if logits is not None:
            self.prefilled(items, decode)
            return logits if want_logits else logits[:0]
        ids_t = torch.zeros(B, T, dtype=torch.long)
        valid = torch.zeros(B, T, dtype=torch.bool)
        pos = torch.zeros(B, T, dtype=torch.long)
        write, ctx = [], []
        for b, (s, ids) in enumerate(items):
            n0, n = s.table.num_tokens, len(ids)
            ids_t[b, :n] = torch.tensor(ids)
            valid[b, :n] = True
            pos[b, :n] = torch.arange(s.base + n0, s.base + n0 + n)
            write += s.table.slots(n0, n0 + n)
            ctx.append((s.table.blocks, n0 + n))
        prefix = items[0][0].prefix
        if any(s.prefix is not prefix for s, _ in items):
            # sequences of different prefixes, each attending to its own: a decode step on a model that mixes
            # prefixes, else the packed forward
            batch = self.batch(write, valid, pos, None, ctx)
            batch.prefix_groups = self.groups([s for s, _ in items])
        else:
            batch = self.batch(write, valid, pos, prefix, ctx)
        batch.lens = [len(ids) for _, ids in items]  # (the packed forward's layout, without reading valid back)
        last = torch.tensor([b * T + len(ids) - 1 for b, (_, ids) in enumerate(items)])
        tracked = [b for b, (s, _) in enumerate(items) if s.amax is not None and s.computed >= s.track_from]
        if decode and tracked:
            batch.last_layer = {}  # the model leaves the last layer's queries and row log-sum-exp here
        if keep:
            batch.hidden_layer = frozenset(items[b][0].hidden_layer for b in keep)
            want_logits = True
        logits = self.model(self.h2d(ids_t), batch, self.pool.k, self.pool.v,
                            logits_index=self.h2d(last if want_logits else last[:0]))
        for b in keep:
            items[b][0].out.hidden = batch.hidden[items[b][0].hidden_layer][b]
        if decode and tracked:
            self.track(items, tracked, batch)
        self.prefilled(items, decode)
        return logits

    def prefilled(self, items: list[tuple[SeqState, list[int]]], decode: bool) -> None:
        """The bookkeeping after a prefill forward of items: tokens held, counters, content keys registered."""
        for s, ids in items:
            n0, n = s.table.num_tokens, len(ids)
            s.table.num_tokens += n
            if not decode:
                self.stats["prefill_ctx_tokens"] += n * (s.base + n0) + n * (n + 1) // 2
                if s.keys:
                    self.registry.register(s, n0)
        self.stats["prefill_tokens"] += sum(len(ids) for _, ids in items)
        self.stats["prefill_calls"] += 1

    def prefill_graphed(self, items: list[tuple[SeqState, list[int]]]) -> torch.Tensor | None:
        """A prefill of items through a replayed graph (their blocks reserved): last-token logits [B, V], or None
        where it does not fit one (the caller prefills eagerly)."""
        starts, write, ctx = [], [], []
        for s, ids in items:
            n0, n = s.table.num_tokens, len(ids)
            starts.append(s.base + n0)
            write += s.table.slots(n0, n0 + n)
            ctx.append((s.table.blocks, n0 + n))
        return self.prefill_graphs.run([ids for _, ids in items], starts, write, ctx, [s.prefix for s, _ in items])

    def decode(self, seqs: list[SeqState]) -> torch.Tensor:
        """One token per sequence: the last sampled token goes in, next-token logits [B, V] come out."""
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            groups.setdefault(id(s.prefix), []).append(i)
        self.stats["decode_tokens"] += len(seqs)
        self.stats["decode_steps"] += 1
        heads = [seqs[idx[0]].prefix for idx in groups.values()]  # each group's prefix (None: no prefix)
        self.stats["decode_ctx_tokens"] += sum(s.table.num_tokens for s in seqs) + len(seqs)
        self.stats["decode_prefix_tokens"] += sum(p.length for p in heads if p is not None)
        if self.graphs is not None and (len(groups) == 1 or self.model.mixes_prefixes):
            logits = self.decode_graphed(seqs, heads)
            if logits is not None:
                return logits
        if len(groups) == 1 or self.model.mixes_prefixes:
            logits = self.prefill([(s, [s.tokens[s.computed]]) for s in seqs], want_logits=True, decode=True)
        else:  # different prefixes on the torch cascade path: one forward per prefix
            out = [None] * len(seqs)
            for idx in groups.values():
                g = [seqs[i] for i in idx]
                lg = self.prefill([(s, [s.tokens[s.computed]]) for s in g], want_logits=True, decode=True)
                self.stats["prefill_calls"] -= 1
                for j, i in enumerate(idx):
                    out[i] = lg[j]
            logits = torch.stack(out)
            self.stats["prefill_calls"] += 1
        self.stats["prefill_tokens"] -= len(seqs)
        self.stats["prefill_calls"] -= 1
        return logits

    def decode_graphed(self, seqs: list[SeqState], heads: list) -> torch.Tensor | None:
        """_decode through a replayed graph (sequences of one shared prefix, or of several on a model that mixes
        prefixes in one forward; heads: the distinct prefixes of seqs, None for no prefix); None: decode eagerly
        instead."""
        # (the per-sequence host work of every decode step: reserve(1), base, computed and slots written out, a few
        # us a sequence less on the launch's critical path)
        bs = self.pool.block_size
        ids, pos, write, ctx = [], [], [], []
        for s in seqs:
            t = s.table
            n0 = t.num_tokens
            if n0 >= len(t.blocks) * bs:  # (t.reserve(1): the next token opens a block)
                t.reserve(1)
            at = (s.prefix.length if s.prefix else 0) + n0  # (s.computed: the fed token's position)
            ids.append(s.tokens[at])
            pos.append(at)
            write.append(t.blocks[n0 // bs] * bs + n0 % bs)
            ctx.append((t.blocks, n0 + 1))
        if len(heads) == 1:
            prefix = heads[0]
            res = self.graphs.run(ids, pos, write, ctx, prefix, self.registry.start_of(prefix))
        else:  # several prefixes: a graph of their set, in a fixed order (rows of no prefix: -1)
            order = sorted((p for p in heads if p is not None), key=id)
            where = {id(p): k for k, p in enumerate(order)}
            res = self.graphs.run(ids, pos, write, ctx, [(p, self.registry.start_of(p)) for p in order],
                                  row_prefix=[where.get(id(s.prefix), -1) for s in seqs])
        if res is None:
            return None
        logits, batch = res
        tracked = [b for b, s in enumerate(seqs) if s.amax is not None and s.computed >= s.track_from]
        if tracked:
            self.track([(s, None) for s in seqs], tracked, batch)
        for s in seqs:
            s.table.num_tokens += 1
        return logits

    def track(self, items, rows: list[int], batch: AttnBatch) -> None:
        """Fold this decode step's last-layer attention into the running maxima of the tracked sequences (one
        fused call for all of them), reusing the row log-sum-exp of the decode attention.

        The kernel takes the maxima as one [R, H, width] tensor. The sequences' own tensors go in and come back a
        capacity at a time (track_capacity): the rows are ordered by capacity, and each capacity's sequences are
        stacked, copied into their rows and copied back in a fixed number of operations, so a step's operations
        grow with the capacities in the batch, not with its sequences (on a GPU each is a launch or at least a
        dispatch; row by row, about 6 a sequence a step)."""
        t0 = time.perf_counter()
        rows = sorted(rows, key=lambda b: items[b][0].amax.shape[1])
        seqs = [items[b][0] for b in rows]
        idx = self.h2d(torch.tensor(rows, dtype=torch.long))
        q, lse = batch.last_layer["q"].index_select(0, idx), batch.last_layer["lse"].index_select(0, idx)
        # own-relative positions: the span starts track_from - base into the sequence's own blocks; only its
        # tokens with a key so far (the one fed now included) can receive attention
        starts = [s.track_from - s.base for s in seqs]
        cols = [min(s.amax.shape[1], s.table.num_tokens + 1 - st) for s, st in zip(seqs, starts)]
        width = max(cols)  # the span columns any tracked sequence has keys for (the kernel's S)
        groups = []  # (first row, end row, capacity): the rows of one capacity, consecutive
        for i, s in enumerate(seqs):
            cap = s.amax.shape[1]
            if groups and groups[-1][2] == cap:
                groups[-1][1] = i + 1
            else:
                groups.append([i, i + 1, cap])
        # each capacity's tensors stacked [Rg, H, cap]; the kernel leaves each sequence's columns past its keys
        # unchanged, so whole rows go in and come back
        wholes = [torch.stack([s.amax for s in seqs[a:b]]) for a, b, _ in groups]
        if len(groups) == 1:
            whole = wholes[0]
            amax = whole if width == whole.shape[2] else whole[:, :, :width].contiguous()
        else:
            amax = torch.zeros(len(seqs), q.shape[1], width, dtype=torch.float32, device=self.device)
            for (a, b, cap), whole in zip(groups, wholes):
                w = min(cap, width)
                amax[a:b, :, :w] = whole[:, :, :w]
        self.signals.attn_decode_update(q.contiguous(), self.pool.k[-1], batch.ctx_blocks.index_select(0, idx),
                                        batch.ctx_lens.index_select(0, idx),
                                        self.h2d(torch.tensor(starts, dtype=torch.long)),
                                        lse.float().contiguous(), self.pool.block_size, self.model.scale, amax)
        for (a, b, cap), whole in zip(groups, wholes):
            w = min(cap, width)
            if amax is not whole:
                whole[:, :, :w] = amax[a:b, :, :w]
            torch._foreach_copy_([s.amax for s in seqs[a:b]], list(whole.unbind(0)))
        if self.trace_row is not None:  # (the step trace: host seconds of the tracking, and its capacities)
            row = self.trace_row
            row["track_s"] = row.get("track_s", 0.0) + time.perf_counter() - t0
            row["track_seqs"], row["track_capacities"] = len(seqs), len(groups)

    def h2d(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the engine's device. On a GPU through pinned memory with non_blocking: a copy from
        pageable memory would wait for the GPU's queue to drain, one host synchronisation per upload; this way
        the step's only synchronisation is the host copy of its signals."""
        return to_device(t, self.device)

    def d2h(self, t: torch.Tensor) -> torch.Tensor:
        """A device tensor's host copy; on a GPU into pinned memory without waiting (an event marks it done)."""
        if t.device.type != "cuda":
            return t.cpu()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def batch(self, write, valid, pos, prefix, ctx: list[tuple[list[int], int]]) -> AttnBatch:
        """ctx: per sequence (its blocks, number of context entries after the prefix)."""
        bs = self.pool.block_size
        B = len(ctx)
        ctx_t, lens = block_table_tensor(ctx, bs, B, blocks_needed(ctx, bs))
        d = self.device
        return AttnBatch(
            write_slots=self.h2d(torch.tensor(write, dtype=torch.long)), valid=self.h2d(valid),
            positions=self.h2d(pos), prefix_len=prefix.length if prefix else 0,
            prefix_slots=prefix.slots if prefix else torch.zeros(0, dtype=torch.long, device=d),
            ctx_blocks=self.h2d(ctx_t), ctx_lens=self.h2d(lens), block_size=bs,
            prefix_start=self.registry.start_of(prefix), ctx_lens_host=[n for _, n in ctx],
        )

    def groups(self, seqs: list[SeqState]) -> list[PrefixGroup]:
        rows: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            if s.prefix is not None:
                rows.setdefault(id(s.prefix), []).append(i)
        by_id = {id(s.prefix): s.prefix for s in seqs if s.prefix is not None}
        return [PrefixGroup(self.h2d(torch.tensor(r, dtype=torch.long)), by_id[k].length, by_id[k].slots,
                            self.registry.starts.get(k, -1), host_rows=r) for k, r in rows.items()]

    def append_batch(self, seqs: list[SeqState], logits: torch.Tensor, prefill_start=None,
                      row: dict | None = None) -> list[bool]:
        """Sample one token per row of logits for seqs and append it; returns which generations finished.
        prefill_start: the DeviceClock mark of the prefill these logits end (its device time ends at the copy);
        row: its step's trace row."""
        sampled = self.sample_launch(seqs, logits)
        if prefill_start is not None:
            self.clock.stop("device_prefill_s", prefill_start, sampled[1], row)
        return self.sample_finish(seqs, sampled)

    def sample_launch(self, seqs: list[SeqState], logits: torch.Tensor):
        """Launch the fused decode-signals kernel over logits and the one host copy of its results per step
        ([3, B] float64: token ids, entropies, log-probabilities; ids < 2^53 are exact). On a GPU the copy goes
        to pinned memory without waiting: returns (host tensor, CUDA event), the event marking the copy done."""
        # Greedy, temperature and top-p sampling all happen inside the fused decode-signals kernel (argmax, or a
        # Gumbel-max draw over the nucleus keyed per token); entropy and logprob are those of the distribution
        # the token is drawn from (docs/architecture.md, "Signals").
        if not any(s.sampling is not None for s in seqs):
            dev = self.draw(seqs, logits, self.sampling)
        else:  # rows of generations with their own sampling: one signals call per setting, rows put back in order
            parts: dict[tuple, list[int]] = {}
            for i, s in enumerate(seqs):
                sp = s.sampling or self.sampling
                parts.setdefault((sp.temperature, sp.top_p, sp.top_k, sp.seed), []).append(i)
            dev = torch.empty(3, len(seqs), dtype=torch.float64, device=logits.device)
            for rows in parts.values():
                sp = seqs[rows[0]].sampling or self.sampling
                idx = tensor_on(rows, logits.device)
                dev.index_copy_(1, idx, self.draw([seqs[i] for i in rows], logits.index_select(0, idx), sp))
        if dev.device.type != "cuda":
            return dev, None
        host = self.d2h(dev)
        ev = torch.cuda.Event(enable_timing=True)  # (timing: it also ends the phase's DeviceClock interval)
        ev.record()
        return host, ev

    def draw(self, seqs: list[SeqState], logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
        """[3, B] float64 on the logits' device: the token drawn from each row with `sp`, its distribution's
        entropy and its log-probability."""
        keys = None
        if sp.temperature > 0:  # per-row keys of the in-kernel sampler: (seed, generation key, token index)
            keys = torch.tensor([sampling_key(sp.seed, s.sample_key, len(s.out.ids)) & 0xFFFFFFFF for s in seqs],
                                dtype=torch.int64)
            keys = self.h2d(keys) if logits.device == self.device else keys.to(logits.device)
        sig = self.signals.decode_signals(logits, temperature=sp.temperature, rng_keys=keys, top_p=sp.top_p,
                                          top_k=sp.top_k)
        return torch.stack([sig.chosen.double(), sig.entropy.double(), sig.logprob.double()])

    def sample_finish(self, seqs: list[SeqState], sampled) -> list[bool]:
        host, ev = sampled
        if ev is not None:
            ev.synchronize()  # the step's one host synchronisation
        chosen, ent, logp = host[0].long().tolist(), host[1].tolist(), host[2].tolist()
        done = []
        for s, t, h, lp in zip(seqs, chosen, ent, logp):
            if h != h or lp != lp:  # NaN: no distribution to draw from (the signal kernels propagate NaN logits)
                s.out.error = (f"the model's next-token distribution is NaN at generated token {len(s.out.ids)} "
                               "(non-finite logits: broken weights or a dtype overflow, e.g. fp16)")
                done.append(True)
                continue
            if t in self.eos_ids:
                s.out.ended_by_eos = True
                s.out.end_id, s.out.end_entropy, s.out.end_logprob = t, h, lp
                done.append(True)
                continue
            s.out.ids.append(t)
            s.out.entropy.append(h)
            s.out.logprob.append(lp)
            s.tokens.append(t)
            if s.on_token is not None:
                s.on_token(t)
            done.append(len(s.out.ids) >= s.max_new or (s.stop_ids is not None and t in s.stop_ids))
        return done

    def attn_out(self, seqs: list[SeqState]) -> None:
        """The tracked a_i of sequences that ended in this step (the head mean of their running maxima), brought to
        the host in one copy for all of them: a copy a sequence would be a host synchronisation a sequence on a
        GPU, beside the step's one."""
        if not seqs:
            return
        means = [s.amax[:, : len(s.tokens) - s.track_from].mean(0) for s in seqs]
        flat = torch.cat(means).tolist()
        at = 0
        for s, m in zip(seqs, means):
            s.out.attn = flat[at: at + m.shape[0]]
            at += m.shape[0]


def build_graphs(model: LlamaModel, pool: KVPool, *, max_batch: int, max_prefill_tokens: int, max_context: int,
                 cuda_graphs: bool | None, prefill_graphs: bool | None, pass_graphs: bool | None):
    """The engine's decode, prefill and attention-pass graphs (each None where off), from its settings.

    Decode steps replayed from CUDA graphs (fastrag/cuda_graphs/): on by default on a GPU, FASTRAG_CUDA_GRAPHS=0
    turns them off; cuda_graphs=True on a CPU runs the same static-buffer protocol without CUDA (emulated; how the
    tests check it). Prefills replayed from CUDA graphs (`PrefillGraphs`): calls of up to PREFILL_GRAPH_SEQS
    sequences and prefill_graph_tokens() new tokens, where the model prefills through the paged prefill kernel with
    the fused small operations; None: on where the decode graphs are, unless $FASTRAG_PREFILL_GRAPHS=0; True on a
    CPU runs the same protocol emulated. DRAGIN's attention passes likewise (`PassGraphs`; FASTRAG_PASS_GRAPHS=0
    turns them off)."""
    p = next(model.parameters())
    device, dtype = p.device, p.dtype
    block_size = pool.block_size
    if cuda_graphs is None:
        cuda_graphs = device.type == "cuda" and setting(CUDA_GRAPHS_ENV) is not False
    # (a model whose own-context decode attention is a paged kernel takes graphs of the whole context's width,
    # which depend on batch bucket and prefix only: capture_graphs() captures them all before a run)
    paged = getattr(model, "paged_decode_op", None)
    width = -(-max_context // block_size) if paged is not None and paged(device, dtype) is not None else None
    graphs = DecodeGraphs(model, pool, max_batch, emulate=device.type != "cuda", ctx_blocks=width) \
        if cuda_graphs else None

    def graphs_on(value, env: str, name: str) -> bool:  # (the env setting read, a bad one named, on any device)
        set_to = setting(env)
        if value is None:
            return bool(cuda_graphs) and device.type == "cuda" and set_to is not False
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool or None, got {value!r}")
        return value

    prefill_graphs = graphs_on(prefill_graphs, PREFILL_GRAPHS_ENV, "prefill_graphs")
    prefill = PrefillGraphs(
        model, pool, ctx_blocks=-(-max_context // block_size),
        max_tokens=min(prefill_graph_tokens(), max_prefill_tokens), max_seqs=min(PREFILL_GRAPH_SEQS, max_batch),
        emulate=device.type != "cuda",
        scratch_block=None if graphs is None else graphs.scratch_block) if prefill_graphs else None
    pass_graphs = graphs_on(pass_graphs, PASS_GRAPHS_ENV, "pass_graphs")
    passes = PassGraphs(model, max_tokens=min(PASS_GRAPH_TOKENS, max_prefill_tokens), max_seqs=PASS_GRAPH_SEQS,
                        emulate=device.type != "cuda") if pass_graphs else None
    return graphs, prefill, passes
