"""The engine: batched prefill and decode of many sequences over the paged KV cache, wired from its parts.

A sequence (`SeqState`) keeps its KV between the generations of one question: a new prompt is tokenised whole
(exactly what a per-question implementation feeds the model), matched against the shared demo prefix and then
against the sequence's own cached tokens (longest common prefix), then against the prefix cache (full blocks
that any sequence computed for the same tokens), and only the rest is prefilled.

Each step the planner (planner.py) decides what runs and returns a `StepPlan`; the model runner (runner.py)
executes it; the prefix registry (registry.py) knows which blocks are whose (docs/architecture.md).
"""

from __future__ import annotations

import math
import time

import torch

from fastrag.cache.kv import KVPool, OutOfBlocks, SharedPrefix
from fastrag.engine.clock import DeviceClock, new_stats, step_row
from fastrag.engine.passes import AttentionPasses
from fastrag.engine.planner import StepPlan, StepPlanner
from fastrag.engine.registry import PrefixRegistry
from fastrag.engine.runner import ModelRunner, build_graphs
from fastrag.engine.sequence import Generation, PendingPasses, PendingStep, SamplingParams, SeqState, check_token_ids
from fastrag.engine.sizing import (as_int, auto_kv_cache_gb, check_seed, default_async_prefill, default_mix_prefill,
                                   default_prefill_hold, track_capacity)
from fastrag.model.llama import LlamaModel
from fastrag.signals import get_backend
from fastrag.transfer import tensor_on


def _forward(part: str, name: str, doc: str = "") -> property:
    """An Engine attribute that lives on one of its parts (read and set there)."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value), doc=doc)


class Engine:
    # the settings and state its parts hold, under the names callers use
    waiting = _forward("planner", "waiting", "Sequences that need a prefill.")
    running = _forward("planner", "running", "Sequences decoding.")
    max_batch = _forward("planner", "max_batch")
    max_prefill_tokens = _forward("planner", "max_prefill_tokens")
    prefill_hold = _forward("planner", "prefill_hold")
    mix_prefill = _forward("planner", "mix_prefill")
    prefix_caching = _forward("planner", "prefix_caching")
    prefixes = _forward("registry", "prefixes", "The shared prefixes held (one per method/dataset prompt family).")
    live = _forward("registry", "live", "Sequences that may hold blocks, by id.")
    signals = _forward("runner", "signals")
    sampling = _forward("runner", "sampling")
    eos_ids = _forward("runner", "eos_ids")
    graphs = _forward("runner", "graphs")
    prefill_graphs = _forward("runner", "prefill_graphs")
    _trace_row = _forward("runner", "trace_row")
    pass_graphs = _forward("passes", "pass_graphs")

    def __init__(self, model: LlamaModel, tokenizer, *, block_size: int = 16, kv_cache_gb: float | None = None,
                 max_batch: int = 64, max_prefill_tokens: int = 4096, sampling: SamplingParams | None = None,
                 signals: str | None = None, mix_prefill: bool | None = None, cuda_graphs: bool | None = None,
                 prefix_caching: bool = True, prefill_hold: int | None = None, async_prefill: bool | None = None,
                 prefill_graphs: bool | None = None, pass_graphs: bool | None = None):
        for name, value in (("block_size", block_size), ("max_batch", max_batch),
                            ("max_prefill_tokens", max_prefill_tokens)):
            if as_int(value) is None or value < 1:  # (max_batch 0 left every sequence waiting forever)
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        block_size, max_batch, max_prefill_tokens = int(block_size), int(max_batch), int(max_prefill_tokens)
        self.model, self.tok = model, tokenizer
        c = model.c
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        per_block = 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * p.element_size()
        if kv_cache_gb is None:
            kv_cache_gb = auto_kv_cache_gb(model, max_batch, max_prefill_tokens)
        elif not (math.isfinite(kv_cache_gb) and kv_cache_gb > 0):  # (NaN, inf: no pool size)
            raise ValueError(f"kv_cache_gb must be a finite number > 0 (or None: sized from the device's memory), got "
                             f"{kv_cache_gb}")
        self.kv_cache_gb = kv_cache_gb
        self.pool = KVPool(c.num_layers, max(8, int(kv_cache_gb * 2**30 // per_block)), block_size,
                           c.num_kv_heads, c.head_dim, self.dtype, self.device)
        # (what mix_prefill, prefill_hold and async_prefill do, and their defaults: sizing.default_*)
        mix_prefill = default_mix_prefill() if mix_prefill is None else mix_prefill
        hold = default_prefill_hold(self.device) if prefill_hold is None else prefill_hold
        if isinstance(hold, bool) or not isinstance(hold, int) or hold < 0:
            raise ValueError(f"prefill_hold must be an int >= 0, got {prefill_hold!r}")
        if async_prefill is None:
            async_prefill = default_async_prefill(self.device)
        elif not isinstance(async_prefill, bool):
            raise ValueError(f"async_prefill must be a bool, got {async_prefill!r}")
        self.async_prefill = bool(async_prefill)
        # the cascade prefill's one-time self-check (a few small attention calls and a host read) here, not inside
        # the first step's launch, which reads nothing from the device
        if getattr(model, "cascade_prefill", False):
            model.uses_cascade_prefill(self.device, self.dtype)
        if getattr(model, "paged_prefill", None) is not None:  # (the paged prefill kernel's, likewise)
            model.uses_paged_prefill(self.device, self.dtype)
        sampling = sampling or SamplingParams()
        self.gen = torch.Generator(device="cpu").manual_seed(sampling.seed)
        signals = get_backend(signals)
        eos = set(c.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        self.max_context = c.max_position_embeddings
        # generations a step's prefill finished when that step then raised in its decode part: the next
        # step_finish returns them with its own
        self._carried: list[SeqState] = []
        self.stats = new_stats()  # (the counters and seconds: clock.new_stats)
        self.clock = DeviceClock(self.device, self.stats)
        # a row per step_launch when a list (`trace = []`, fastrag.eval with $FASTRAG_STEP_TRACE=1): what the step
        # prefilled and decoded, its host seconds and, once known, its device seconds (the scheduler adds its own);
        # and a `passes_only` row per scheduler step that launched attention passes without an engine step
        self.trace: list[dict] | None = None
        # torch.profiler over a window of steps (fastrag.kernel_parts.StepWindow; fastrag.eval with
        # $FASTRAG_KERNEL_PROFILE=FIRST:COUNT): told of every step launch
        self.kernel_window = None
        # cProfile over every step launch, kept apart by kind of step (fastrag.launch_profile.LaunchProfile;
        # fastrag.eval with $FASTRAG_LAUNCH_PROFILE=1): which calls the launch's host seconds are in
        self.launch_profile = None
        graphs, prefill, passes = build_graphs(model, self.pool, max_batch=max_batch,
                                               max_prefill_tokens=max_prefill_tokens, max_context=self.max_context,
                                               cuda_graphs=cuda_graphs, prefill_graphs=prefill_graphs,
                                               pass_graphs=pass_graphs)
        # the parts: which blocks are whose, what each step runs, and running it
        self.registry = PrefixRegistry(self.pool, self.stats)
        # (prefix caching (kv.py): a prompt's full blocks that some sequence already computed are shared, not
        # prefilled again)
        self.planner = StepPlanner(self.pool, self.registry, self.stats, max_batch=max_batch,
                                   max_prefill_tokens=max_prefill_tokens, prefill_hold=hold, mix_prefill=mix_prefill,
                                   prefix_caching=prefix_caching)
        self.runner = ModelRunner(model, self.pool, self.registry, self.stats, self.clock, signals=signals,
                                  sampling=sampling, eos_ids=eos, graphs=graphs, prefill_graphs=prefill)
        self.passes = AttentionPasses(self.runner, self.max_context, passes)

    def capture_graphs(self) -> int:
        """Capture, for every batch bucket, the decode graphs of the shared prefixes held now: each prefix alone,
        and where the model decodes mixed batches every set of two or more of them when they are 2 or 3 (a run's
        datasets finish at different times, so their subsets decode together too), all of them together when
        more (up to MAX_PREFIXES); sequences without a prefix when none is held. A step that needs another graph
        (a set of more prefixes, sequences with and without one, a prefix set later) still captures it then.
        Without graphs, or where graphs depend on the context's length (see fastrag/cuda_graphs/), nothing is
        captured. Returns the number of decode graphs captured now. The prefill and attention-pass graphs of every
        token bucket are captured here too (their counts and seconds in `prefill_graphs.stats`, `pass_graphs.stats`).

        A capture costs tens of milliseconds of host and device time; done inside a run it is paid by the step that
        first needs each graph (fastrag.eval calls this once the prefixes are set, before its clock starts)."""
        for g in (self.prefill_graphs, self.pass_graphs):
            if g is not None:
                g.capture_ahead()
        if self.graphs is None:
            return 0
        return self.graphs.capture_ahead(self.registry.graph_sets())

    # ------------------------------------------------------------------ sequences
    def new_sequence(self) -> SeqState:
        return self.registry.new_sequence()

    def release(self, s: SeqState) -> None:
        """The sequence is done for good: it leaves the queue or the decode batch (a step in flight drops it when
        it finishes), and gives back its blocks and its share of the prefix. Releasing twice does nothing more."""
        self.live.pop(id(s), None)
        self.planner.waiting = [x for x in self.planner.waiting if x is not s]
        self.planner.running = [x for x in self.planner.running if x is not s]
        self.registry.drop_cache(s)

    @property
    def prefix(self) -> SharedPrefix | None:
        """The most recently set shared prefix."""
        return self.registry.latest

    def set_prefix(self, text: str) -> SharedPrefix | None:
        """Compute the KV of a shared prefix once (whole blocks only) and keep it for all sequences.

        Several prefixes may be kept at once (e.g. the demos of two datasets run together): a prompt starts from the
        longest one it begins with, and sequences of different prefixes share decode steps where the model allows
        it (`LlamaModel.mixes_prefixes`). Setting a prefix already held returns it.
        """
        ids = self.tok.encode(text)
        n = len(ids) // self.pool.block_size * self.pool.block_size
        if n == 0:
            return None
        # (a tokenizer not the model's)
        check_token_ids(ids, self.model.c.vocab_size, "the shared prefix (the method's demos, tokenized)")
        if len(ids) >= self.max_context:  # no prompt that starts with it could fit a generated token
            raise ValueError(f"a shared prefix of {len(ids)} tokens leaves no room in the model context of "
                             f"{self.max_context} tokens (the method's demos: give fewer, e.g. its config's fewshot)")
        p = self.registry.held(ids[:n])
        if p is not None:
            return p
        need = n // self.pool.block_size
        if need > self.pool.num_free:
            self.registry.drop_idle()
        if need > self.pool.num_free:
            raise OutOfBlocks(f"a shared prefix of {n} tokens needs {need} KV blocks; {self.pool.num_free} of "
                              f"{self.pool.num_blocks} are free now (sequences in flight hold the rest)")
        s = self.new_sequence()
        self.live.pop(id(s))  # its blocks pass to the SharedPrefix below
        t0 = time.perf_counter()
        self.runner.prefill([(s, ids[:n])], want_logits=False)
        if self.device.type == "cuda":  # (set once per run: this wait is no per-step synchronisation)
            torch.cuda.synchronize(self.device)
        # its tokens count as prefilled (stats["prefill_tokens"]), so its seconds are kept too: fastrag.perf adds
        # them to the steps' prefill_s against a floor built from those counters
        self.stats["prefix_prefill_s"] += time.perf_counter() - t0
        blocks = list(s.table.blocks)
        slots = tensor_on(s.table.slots(0, n), self.device)
        pre = SharedPrefix(token_ids=ids[:n], blocks=blocks, slots=slots)  # owns the blocks' refcount
        self.registry.add(pre)
        return pre

    def clear_prefixes(self) -> None:
        """Give back the engine's hold on every shared prefix (sequences still using one keep it alive)."""
        for p in list(self.prefixes):
            self.drop_prefix(p)

    def drop_prefix(self, p: SharedPrefix) -> None:
        """Give back the engine's hold on one shared prefix: later prompts no longer start from it (sequences still
        using it keep its blocks alive). Dropping a prefix not held does nothing."""
        self.registry.drop(p)

    def start(self, s: SeqState, prompt_ids: list[int], max_new_tokens: int, track_from: int | None = None,
              sample_key: int | None = None, sampling: SamplingParams | None = None,
              stop_ids: frozenset | None = None, hidden_layer: int | None = None) -> None:
        """Queue a generation of up to max_new_tokens after prompt_ids on sequence s (reusing its cache).

        sample_key (sampling only): the generation's key; token t is drawn with sampling_key(seed, sample_key, t),
        so a caller that names its generations (the scheduler: question id and call number) gets the same tokens
        whatever else shares the batch and whenever the generation runs. None: the next key of the engine's
        seeded generator (reproducible for the same sequence of start calls).

        track_from: track the last layer's in-context attention received by every token from this position of
        prompt_ids on (Generation.attn). Those tokens are fed one per decode step (never in a prefill), so each
        of their queries goes through the decode attention, whose row log-sum-exp the fused attention-statistics
        kernel reuses; the running maximum carries over when a later start continues the same span (same
        track_from) on the same sequence, e.g. a generation resumed in chunks. A new span start begins from zero:
        span tokens already in the sequence's cache keep it, and only queries fed from this start on count.

        sampling: this generation's own sampling (None: the engine's): a step's rows of different settings are
        drawn by one signals call per setting, so greedy and sampled generations share a batch.
        stop_ids: token ids that end the generation when sampled (kept in its ids, unlike an EOS): a step's stop
        without decoding past it.
        hidden_layer: keep the residual stream after this layer (0-based) at the prompt's last token
        (Generation.hidden); the prefill of such a generation runs eagerly on the unfused paths.
        """
        if not prompt_ids:
            raise ValueError("empty prompt")
        check_token_ids(prompt_ids, self.model.c.vocab_size, "prompt_ids")
        n_new = as_int(max_new_tokens)
        if n_new is None or n_new < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        max_new_tokens = n_new
        if sample_key is not None:  # (checked before the sequence changes: a bad key used to fail the whole step)
            sample_key = check_seed(sample_key, "sample_key")
        if id(s) not in self.live:
            raise ValueError("the sequence was released (or not made by this engine's new_sequence)")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
        if hidden_layer is not None:
            layer = as_int(hidden_layer)
            if layer is None or not 0 <= layer < self.model.c.num_layers:
                raise ValueError(f"hidden_layer must be a layer index in [0, {self.model.c.num_layers}), got "
                                 f"{hidden_layer!r}")
            hidden_layer = layer
        if stop_ids is not None:
            stop_ids = frozenset(stop_ids)
            if stop_ids:
                check_token_ids(stop_ids, self.model.c.vocab_size, "stop_ids")
        if any(x is s for x in self.waiting) or any(x is s for x in self.running):
            raise ValueError("the sequence has a generation queued or running; start it again once that one "
                             "finished (or release it)")
        if track_from is not None and not 0 <= track_from <= len(prompt_ids):
            raise ValueError(f"track_from={track_from} must be a position in the prompt of {len(prompt_ids)} "
                             "tokens, or its length (the span starts with the first generated token)")
        if len(prompt_ids) + max_new_tokens > self.max_context:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens + {max_new_tokens} new exceeds the model "
                             f"context of {self.max_context} tokens (the prompt holds the method's demos, the "
                             "question, its retrieved passages and the text generated so far; the new tokens are "
                             "this generation call's budget, at most the method's generation length: "
                             "generate_max_length, BeamSearchQA's *_max_tokens, in its config)")
        # the prefix, the room check, the own cache kept and the content keys (PrefixRegistry.attach)
        self.registry.attach(s, prompt_ids, max_new_tokens, track_from, self._pinned_blocks(), self.prefix_caching)
        base = s.base
        s.sampling, s.stop_ids, s.hidden_layer = sampling, stop_ids or None, hidden_layer
        if (sampling or self.sampling).temperature > 0:
            s.sample_key = sample_key if sample_key is not None else \
                int(torch.randint(0, 2**62, (1,), generator=self.gen))
        s.out = Generation(ids=[], entropy=[], logprob=[], prompt_tokens=len(prompt_ids),
                           prefilled=len(s.pending_prompt))
        if track_from is not None:
            if track_from < base:
                raise ValueError(f"track_from={track_from} lies inside the shared prefix ({base} tokens)")
            s.track_span(track_from, track_capacity(len(prompt_ids) - track_from + max_new_tokens),
                         self.model.c.num_heads, self.device)
            # tracked tokens are fed by decode steps: prefill only what comes before the span
            lcp = s.table.num_tokens  # (the own tokens kept)
            s.pending_prompt = prompt_ids[base + lcp: max(track_from, base + lcp)]
        else:
            s.track_from = s.amax = None
        self.registry.adopt_cached(s)
        self.planner.waiting.append(s)

    def _pinned_blocks(self) -> int:
        """Blocks no sequence can ever get: the shared prefixes' and the decode and prefill graphs' scratch blocks."""
        return self.registry.pinned_blocks((self.graphs is not None) + (self.prefill_graphs is not None))

    @property
    def has_work(self) -> bool:
        p = self.planner
        return bool(p.waiting or p.running or any(id(s) in self.registry.live for s in self._carried))

    # ------------------------------------------------------------------ stepping
    @torch.inference_mode()
    def step(self) -> list[SeqState]:
        """Prefill what waits (within the token budget), then one decode step for all running sequences.

        Returns the sequences whose generation finished in this step (their `out` is complete).
        """
        return self.step_finish(self.step_launch())

    @torch.inference_mode()
    def step_launch(self, plan: StepPlan | None = None) -> PendingStep:
        """`step()`'s first half: the prefill (which ends in a host copy of its sampled tokens; with async_prefill
        that copy is non-blocking too and read in step_finish, and the prefilled sequences decode from the next
        step), then the decode step's kernels and the non-blocking copy of its sampled tokens and signals to pinned
        host memory. On a GPU it returns while the device still runs the decode step, so the caller can do host
        work (the methods' own logic for sequences that finished earlier) until `step_finish`. Between the two, the
        caller may start, release or drop other sequences (stream order keeps their blocks safe), but must not
        launch another step. When a forward raises, no sequence is lost: a failed prefill's sequences wait again as
        they were, and when the decode part fails after the prefill ran, the generations that prefill finished come
        back from the next `step_finish` (see `_carry_prefill`).

        plan: the step's decisions from `planner.plan()`, made just before (None: planned here, as step() does).
        """
        if self.kernel_window is not None:
            self.kernel_window.before_step(self.stats)
        lp = self.launch_profile
        if lp is not None:
            calls0 = self.stats["prefill_calls"]
            lp.start()
        finished: list[SeqState] = []
        joining: list[SeqState] = []
        join_sampled = None
        t0 = time.perf_counter()
        row = None
        if self.trace is not None:
            c0 = time.thread_time()  # (the launch's CPU seconds on this thread: wall minus these is time it waited)
            row = step_row(self.trace)
        self.runner.trace_row = row
        cap0 = self._captures() if row is not None else None
        if plan is None:
            plan = self.planner.plan()
        if plan.prefill:
            group = plan.group
            begun = self.runner.prefill_begin(plan, row)
            try:
                logits = self.runner.prefill(plan.prefill, want_logits=True)
            except BaseException:  # (the forward failed: out of memory, a kernel error, Ctrl-C) the group
                self.planner.requeue(group)  # waits again as it was, its blocks reserved, nothing computed
                raise
            done, joining, join_sampled = self.runner.prefill_end(plan, logits, begun, row, self.async_prefill)
            for i, s in enumerate(group):
                (finished if done.get(i, False) else self.planner.running).append(s)
        held = self.pool.num_blocks - self.pool.num_free
        if held > self.stats["kv_peak_blocks"]:
            self.stats["kv_peak_blocks"] = held
        t1 = time.perf_counter()
        self.stats["prefill_s"] += t1 - t0
        st = PendingStep(finished, trace_row=row)
        if joining:  # (in `running` already, so nothing else takes their place, but decoding from the next step)
            st.joining, st.join_sampled = joining, join_sampled
            if row is not None:
                row["joining"] = len(joining)
        plan.decode = self.planner.decode_batch(joining)
        if plan.decode:
            try:
                self.runner.launch_decode(st, plan.decode, row)
            except BaseException:  # the decode step failed (its sequences are as they were: nothing appended)
                self._carry_prefill(st)
                raise
            st.decode_s = time.perf_counter() - t1
        if row is not None:
            row["launch_s"] = time.perf_counter() - t0
            row["launch_cpu_s"] = time.thread_time() - c0
            if cap0 is not None and self._captures() > cap0:  # (graphs captured in this step: decode, prefill, pass)
                row["graph_captures"] = self._captures() - cap0
        if lp is not None:
            lp.stop(self.stats["prefill_calls"] > calls0, len(st.batch))
        return st

    def trace_passes_step(self) -> dict | None:
        """With the step trace on: a row for a scheduler step that launches attention passes but no engine step
        (`passes_only`), so that their device seconds and work are that step's, not the last launched step's (whose
        wall was already closed). Passes launched from here to the next step_launch go in it. Its `step` is the
        number of the launch it follows (-1 before the first), so that the launches keep their numbers (those of
        $FASTRAG_KERNEL_PROFILE's window). None without the trace."""
        if self.trace is None:
            return None
        row = {"step": self.trace[-1]["step"] if self.trace else -1, "prefill_seqs": 0, "prefill_tokens": 0,
               "decode_batch": 0, "passes_only": True}
        self.trace.append(row)
        self.runner.trace_row = row
        return row

    def _captures(self) -> int:
        return sum(g.stats["captures"] for g in (self.graphs, self.prefill_graphs, self.pass_graphs) if g is not None)

    def _carry_prefill(self, st: PendingStep) -> None:
        """A step whose decode part raised after its prefill ran: the prefill's outcome is kept, not lost with the
        step. Its first tokens (async_prefill) are read and appended now, and the generations it finished are
        returned by the next step_finish."""
        finished = list(st.finished)
        if st.joining:
            try:
                done = self.runner.sample_finish(st.joining, st.join_sampled)
            except BaseException:  # (the device itself failed: these sequences cannot decode on, they end here)
                done = [True] * len(st.joining)
                for s in st.joining:
                    s.out.error = s.out.error or "the engine failed while this generation's first token was read"
            ended = {id(s) for s, d in zip(st.joining, done) if d}
            self.planner.running = [s for s in self.planner.running if id(s) not in ended]
            finished += [s for s, d in zip(st.joining, done) if d]
        self._carried += finished

    @staticmethod
    def step_done(st: PendingStep) -> bool:
        """Whether a launched step's results are on the host already (step_finish would not wait)."""
        return all(x is None or x[1] is None or x[1].query() for x in (st.join_sampled, st.sampled))

    @torch.inference_mode()
    def step_finish(self, st: PendingStep) -> list[SeqState]:
        """`step()`'s second half: wait for the launched step's host copy, append the sampled tokens, and return the
        sequences whose generation finished (the prefill's and the decode step's)."""
        t_fin = time.perf_counter()
        carried, self._carried = self._carried, []
        finished = [s for s in carried + st.finished if id(s) in self.live]  # (one released since is gone)
        planner = self.planner
        if st.batch:
            t1 = time.perf_counter()
            batch = st.batch
            done = [False] * len(batch)
            if st.sampled is not None:
                ready = [batch[i] for i in st.ready]
                for i, d in zip(st.ready, self.runner.sample_finish(ready, st.sampled)):
                    done[i] = d
            # sequences released while the step ran (their question ended) leave the batch for good
            gone = {id(s) for s in batch}
            keep = [s for s, d in zip(batch, done) if not d and id(s) in self.live]
            planner.running = keep + [s for s in planner.running if id(s) not in gone]
            finished += [s for s, d in zip(batch, done) if d and id(s) in self.live]
            self.stats["decode_s"] += st.decode_s + time.perf_counter() - t1
        if st.joining:  # async_prefill: the prefill's first tokens (copied before the decode step's, in stream order)
            t1 = time.perf_counter()
            done = self.runner.sample_finish(st.joining, st.join_sampled)
            ended = {id(s) for s, d in zip(st.joining, done) if d}
            if ended:
                planner.running = [s for s in planner.running if id(s) not in ended]
            finished += [s for s, d in zip(st.joining, done) if d and id(s) in self.live]
            self.stats["prefill_s"] += time.perf_counter() - t1
        self.clock.settle()  # (the step's copy is on the host: its device time and any before it can be read)
        if st.trace_row is not None:
            st.trace_row["finish_s"] = time.perf_counter() - t_fin
        self.runner.attn_out([s for s in finished if s.amax is not None])
        return finished

    # ------------------------------------------------------------------ cache-free attention passes
    @torch.inference_mode()
    def attention_passes(self, seqs: list[list[int]], kind: str):
        """Batched last-layer attention over token lists alone (positions from 0, no cache).

        kind "colmax": per list, a_t = mean_h max_{j>=t} A[h, j, t]  -> list of [T_b] float lists
        kind "rows":   per list, the head-mean attention matrix       -> list of [T_b, T_b] tensors
        """
        return self.attention_passes_finish(self.attention_passes_launch(seqs, kind))

    @torch.inference_mode()
    def attention_passes_launch(self, seqs: list[list[int]], kind: str) -> PendingPasses:
        """`attention_passes`' first half: the forwards and signal kernels, and the non-blocking copies of their
        results to pinned host memory (AttentionPasses.launch); `attention_passes_finish` waits for the copies."""
        return self.passes.launch(seqs, kind, self.max_prefill_tokens)

    @torch.inference_mode()
    def attention_passes_finish(self, pending: PendingPasses) -> list:
        """Wait for launched attention passes; their results in the order of the lists given to the launch."""
        return self.passes.finish(pending)
