"""The model runner: batched prefill and decode of many sequences over the paged KV cache.

A sequence (`SeqState`) keeps its KV between the generations of one question: a new prompt is tokenised whole
(exactly what a per-question implementation feeds the model), matched against the shared demo prefix and then
against the sequence's own cached tokens (longest common prefix), then against the prefix cache (full blocks
that any sequence computed for the same tokens), and only the rest is prefilled.
"""

from __future__ import annotations

import itertools
import math
import numbers
import os
import time
from dataclasses import dataclass, field

import torch

from fastrag.cache.kv import (BlockTable, KVPool, OutOfBlocks, SharedPrefix, block_table_tensor, blocks_needed,
                              chain_keys)
from fastrag.cuda_graphs import DecodeGraphs, PassGraphs, PrefillGraphs
from fastrag.model.llama import AttnBatch, LlamaModel, PrefixGroup
from fastrag.signals import get_backend
from fastrag.switches import env_int, env_setting
from fastrag.transfer import tensor_on, to_device


_M64 = (1 << 64) - 1
CUDA_GRAPHS_ENV = "FASTRAG_CUDA_GRAPHS"
PREFILL_GRAPHS_ENV = "FASTRAG_PREFILL_GRAPHS"
PASS_GRAPHS_ENV = "FASTRAG_PASS_GRAPHS"
# the largest prefill (new tokens; capped by the engine's max_prefill_tokens) and the most sequences a prefill graph
# takes (fastrag/cuda_graphs.py); $FASTRAG_PREFILL_GRAPH_TOKENS overrides the first. Up to 2026-11-27b the graphs
# stopped at 1,024 tokens and 16 sequences: on the H200 the 245 eager calls past them (1,024-3,900 tokens, 2-38
# sequences) each took a median 28.8 ms of host launch and 43.5 ms of device time at 1.62x their floor
PREFILL_GRAPH_TOKENS, PREFILL_GRAPH_SEQS = 4096, 32
PREFILL_GRAPH_TOKENS_ENV = "FASTRAG_PREFILL_GRAPH_TOKENS"
# and for the attention passes' graphs (token lists of DRAGIN's RIND and QFS passes)
PASS_GRAPH_TOKENS, PASS_GRAPH_SEQS = 1024, 32
# a tracked span's maxima are held in columns of a power-of-two capacity, at least this many (track_capacity)
TRACK_MIN_CAPACITY = 64
PREFILL_HOLD_ENV = "FASTRAG_PREFILL_HOLD"  # steps a small prefill may wait for more (default: 2 on CUDA, else 0)
DEFAULT_PREFILL_HOLD = 2  # on CUDA devices (Engine's prefill_hold)
MIX_PREFILL_ENV = "FASTRAG_MIX_PREFILL"  # 1: prefill batches mix shared prefixes (default 0)
ASYNC_PREFILL_ENV = "FASTRAG_ASYNC_PREFILL"  # 1: a prefill's first tokens reach the host with its step (default:
# 1 on CUDA, else 0)


def _env_int(name: str, default: int) -> int:
    """$name as an integer >= 0 (unset or blank: default); anything else is an error naming the variable."""
    v = env_int(name, 0)
    return default if v is None else v


def prefill_graph_tokens() -> int:
    """The most new tokens a prefill graph takes: $FASTRAG_PREFILL_GRAPH_TOKENS (an integer >= 16) when set, else
    PREFILL_GRAPH_TOKENS."""
    v = _env_int(PREFILL_GRAPH_TOKENS_ENV, PREFILL_GRAPH_TOKENS)
    if v < 16:
        raise ValueError(f"${PREFILL_GRAPH_TOKENS_ENV}={os.environ[PREFILL_GRAPH_TOKENS_ENV]!r}: expected an integer "
                         ">= 16 (the smallest token bucket)")
    return v


def default_async_prefill(device: torch.device) -> bool:
    """Engine(async_prefill=None): $FASTRAG_ASYNC_PREFILL (0 or 1) when set, else on for CUDA devices and off elsewhere
    (a CPU computes as it launches: there is nothing to overlap). On the H200 (2026-11-26d, 128 DRAGIN questions at
    batch 128, Llama-2-7B shape) it left the device idle 0.46 s in prefill steps against 0.74 s and 2.21 s in steps with
    attention passes against 2.60 s, 17.25 s of wall against 18.31 s (benchmarks/results/gpu_h200_2026-11-26d.md)."""
    v = _env_int(ASYNC_PREFILL_ENV, int(torch.device(device).type == "cuda"))
    if v > 1:
        raise ValueError(f"${ASYNC_PREFILL_ENV}={os.environ[ASYNC_PREFILL_ENV]!r}: expected 0 or 1")
    return bool(v)


def default_prefill_hold(device: torch.device) -> int:
    """Engine(prefill_hold=None): $FASTRAG_PREFILL_HOLD when set, else DEFAULT_PREFILL_HOLD on CUDA devices (where a
    prefill call's fixed cost is large) and 0 elsewhere."""
    return _env_int(PREFILL_HOLD_ENV, DEFAULT_PREFILL_HOLD if torch.device(device).type == "cuda" else 0)


def sampling_key(*parts: int) -> int:
    """A 64-bit key from integers (splitmix64 steps over the parts): the same parts give the same key in every
    process, unlike Python's salted hash()."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p & _M64)) * 0xBF58476D1CE4E5B9 & _M64
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & _M64
        x ^= x >> 29
    return x


def as_int(value) -> int | None:
    """value as a Python int when it is an integer (numpy's and other types with __index__; not a bool), else None."""
    import operator

    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_seed(seed, name: str = "seed") -> int:
    """seed as a Python int of 64 bits (numpy and other integer types too, through __index__); anything else, or an
    int outside [-2**63, 2**64), is a ValueError naming `name`."""
    value = as_int(seed)
    if value is None or not -2**63 <= value < 2**64:
        raise ValueError(f"{name} must be an int of 64 bits, in [-2**63, 2**64), got {seed!r}")
    return value


def _compile_log():
    """fastrag.kernels.compiles.COMPILES where its hook is on (it names a step's Triton compiles in the step trace),
    else None."""
    try:
        from fastrag.kernels.compiles import COMPILES
    except ImportError:  # (no Triton here)
        return None
    return COMPILES if COMPILES.installed else None


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0  # 0: off; else only the k most likely tokens (ties kept) before top-p, as transformers samples

    def __post_init__(self):
        from fastrag.signals.checks import MIN_TEMPERATURE

        t = self.temperature
        if not (isinstance(t, (int, float)) and math.isfinite(t) and (t == 0 or t >= MIN_TEMPERATURE)):
            raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got {t!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: off), got {self.top_k!r}")
        if self.top_k and self.temperature == 0:
            raise ValueError(f"top_k={self.top_k} applies only when sampling: give a temperature > 0 too (greedy "
                             "decoding takes the most likely token whatever k is)")
        self.seed = check_seed(self.seed, "seed")


@dataclass(slots=True)
class Generation:
    """The output of one generate call."""

    ids: list[int]  # generated tokens, a final EOS dropped
    entropy: list[float]  # entropy of the (warped) next-token distribution that produced each token of ids
    logprob: list[float]  # log-probability of each token of ids
    prompt_tokens: int = 0
    prefilled: int = 0  # prompt tokens actually computed (the rest came from the prefix / own cache)
    ended_by_eos: bool = False
    # the EOS that ended it, the entropy of the distribution it was drawn from and its log-probability (None unless
    # ended_by_eos): the
    # published DRAGIN code keeps that token in its text, words and signals (fastrag.methods.published)
    end_id: int | None = None
    end_entropy: float | None = None
    end_logprob: float | None = None
    # answered from an identical earlier one-shot greedy generation of the same question (Scheduler): nothing was
    # prefilled or decoded for it
    reused: bool = False
    # with attention tracking (Engine.start(track_from=...)): for every token of the tracked span (from track_from
    # to the last generated token), the mean over heads of the largest last-layer attention it has received from
    # any query so far, in context (DRAGIN's a_i, streaming semantics); 0 for a token no query has seen yet (the
    # last sampled token of a length-capped generation is never fed)
    attn: list[float] | None = None
    # set when the generation could not go on: the model's next-token distribution was NaN (non-finite logits from
    # broken weights or a dtype overflow); ids hold the tokens before it, and the caller fails its question
    error: str | None = None


@dataclass(eq=False)  # identity semantics: the scheduler looks sequences up in lists
class SeqState:
    table: BlockTable
    prefix: SharedPrefix | None = None
    tokens: list[int] = field(default_factory=list)  # all tokens of the sequence (prefix included)
    # current generation
    max_new: int = 0
    out: Generation | None = None
    pending_prompt: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    on_token: object = None  # optional callable(token_id) run as each token of the current generation is kept
    # attention tracking: absolute position of the tracked span's first token, and the running per-head max
    # attention [H, cap] each span token received (column j: position track_from + j)
    track_from: int | None = None
    amax: torch.Tensor | None = None
    sample_key: int = 0  # sampling: the key of the current generation (token t draws with sampling_key(.., t))
    # prefix cache: content keys of the full blocks of the prompt's own tokens (kv.chain_keys), and how many of
    # them a lookup may adopt (a generation prefills at least one token; tracked tokens are fed by decode steps)
    keys: list = field(default_factory=list)
    adoptable: int = 0

    @property
    def base(self) -> int:
        return self.prefix.length if self.prefix else 0

    @property
    def computed(self) -> int:
        """Tokens whose KV is in the cache (absolute count)."""
        return self.base + self.table.num_tokens


@dataclass(eq=False)
class PendingStep:
    """A launched engine step (`Engine.step_launch`) whose decode results are not yet on the host."""

    finished: list  # sequences the step's prefill already finished (a generation of one token, or an EOS)
    batch: list = field(default_factory=list)  # the decode batch
    ready: list = field(default_factory=list)  # rows of batch that sample a token this step
    sampled: tuple | None = None  # (host tensor [3, len(ready)], CUDA event or None)
    joining: list = field(default_factory=list)  # async_prefill: prefilled sequences whose first token is in flight
    join_sampled: tuple | None = None  # their (host tensor, CUDA event or None), as `sampled`
    decode_s: float = 0.0  # host seconds of the launch's decode part
    trace_row: dict | None = None  # the step's row of Engine.trace (None: not tracing)


class DeviceClock:
    """Device seconds of the engine's launches, so that a run can say how long the device was busy beside its wall
    time (the rest is the device waiting for the host).

    On a GPU a phase is timed by CUDA events on the launching stream: a mark recorded before its first kernel and
    one after its last (the timing-enabled event that marks the phase's host copy done, where it has one). One stream
    runs the phases one after another, so their spans do not overlap; a span includes the gaps where the device
    waited for the host to launch the phase's next kernel (a graphed decode step is one launch, an eager prefill a few
    thousand). A pair is read once its end has completed (`settle`, called after the waits the engine makes anyway:
    the clock adds no synchronisation). On a CPU the work runs as it is launched, so a phase's seconds are host
    seconds."""

    def __init__(self, device: torch.device, totals: dict):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.totals = totals  # key -> seconds (the engine's stats)
        self._pending: list[tuple[str, object, object, dict | None]] = []

    def mark(self):
        """A point on the device's timeline, now (in stream order on a GPU)."""
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))  # (the engine's device, whichever is current)
        return ev

    def stop(self, key: str, start, end=None, row: dict | None = None) -> None:
        """Add the seconds from `start` (a mark) to `end` (a recorded timing event; None: a mark now) to totals[key],
        and to row[key] when a step's trace row is given: at once on a CPU, on a GPU when the end has completed."""
        end = self.mark() if end is None else end
        if self.cuda:
            self._pending.append((key, start, end, row))
            self.settle()
        else:
            self._add(key, end - start, row)

    def _add(self, key: str, seconds: float, row: dict | None) -> None:
        self.totals[key] += seconds
        if row is not None:
            row[key] = row.get(key, 0.0) + seconds

    def settle(self) -> None:
        """Count the timed phases the device has finished (no waiting)."""
        left = []
        for key, a, b, row in self._pending:
            if b.query():
                self._add(key, a.elapsed_time(b) / 1e3, row)
            else:
                left.append((key, a, b, row))
        self._pending = left

    @property
    def pending(self) -> int:
        """Timed phases not yet counted (the device had not finished them at the last settle)."""
        return len(self._pending)


@dataclass(eq=False)
class PendingPasses:
    """Launched attention passes (`Engine.attention_passes_launch`) whose results may still be on their way."""

    kind: str
    lengths: list  # token count of each list, in the caller's order
    groups: list = field(default_factory=list)  # (indices into the lists, host tensor of their padded results)
    event: object = None  # CUDA event after the last copy (None: the results are already on the host)

    def done(self) -> bool:
        return self.event is None or self.event.query()


CPU_KV_CACHE_GB = 4.0  # the pool on a CPU when none is asked for
# share of the GPU's memory the engine plans to use in all (weights, KV pool, activations) when sizing its pool
GPU_MEMORY_FRACTION = 0.8


def track_capacity(n: int) -> int:
    """The columns held for a tracked span of at most n tokens: the next power of two >= n, at least
    TRACK_MIN_CAPACITY. A decode step moves the tracked sequences' maxima to the kernel and back one capacity at a
    time, a fixed number of operations per capacity (`Engine._track`); spans of exact lengths would almost all differ
    (dragin-streaming's continuations carry their earlier text) and cost operations per sequence instead."""
    return max(TRACK_MIN_CAPACITY, 1 << max(int(n) - 1, 0).bit_length())


def auto_kv_cache_gb(model: LlamaModel, max_batch: int, max_prefill_tokens: int) -> float:
    """The KV pool's size (GiB) when none is given. CPU: CPU_KV_CACHE_GB. GPU: GPU_MEMORY_FRACTION of the device's
    memory, less what is allocated now (the weights), the largest prefill chunk's activations and a full decode
    batch's logits (both counted in float32, four times over). A fixed 8 GB pool held about ten questions at once
    for a Llama-2-7B-shaped model (0.5 MiB of KV per token) on an 80 GB H100 (2026-11-24: a mean decode batch of
    8.7 out of 128). The 20% left over is room for what the sum does not count: CUDA graphs, the allocator's
    slack, DRAGIN's attention passes; on that H100 a run whose pool left 10 GiB free still ran out of memory in its
    first prefill (with a float32 model; cause not found), so give kv_cache_gb where the default does not fit."""
    p = next(model.parameters())
    if p.device.type != "cuda":
        return CPU_KV_CACHE_GB
    import gc

    gc.collect()  # what an engine freed earlier holds goes back to the device first
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(p.device).total_memory
    used = total - torch.cuda.mem_get_info(p.device)[0]  # the weights, the CUDA context, other processes
    return kv_room_gb(model.c, total, used, max_batch, max_prefill_tokens, str(p.device))


def kv_room_gb(c, total: int, used: int, max_batch: int, max_prefill_tokens: int, where: str = "the GPU") -> float:
    """auto_kv_cache_gb's arithmetic: GiB of KV pool on a device of `total` bytes with `used` in use."""
    act = max_prefill_tokens * (4 * c.hidden_size + 2 * c.intermediate_size) * 4 * 4
    logits = max_batch * c.vocab_size * 4 * 4
    room = GPU_MEMORY_FRACTION * total - used - act - logits
    if room <= 2**28:
        raise ValueError(f"no room for a KV cache on {where}: {used / 2**30:.1f} of {total / 2**30:.1f} GiB in use "
                         f"with the model loaded, {(act + logits) / 2**30:.1f} GiB wanted for activations; lower the "
                         "batch size or give kv_cache_gb")
    return room / 2**30


class Engine:
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
        self.max_batch, self.max_prefill_tokens = max_batch, max_prefill_tokens
        # prefill batches of sequences with different shared prefixes (packed forward, each attends to its own).
        # Off by default: in the 100-question two-dataset DRAGIN run on the CPU it measured 789 s against 729 s with
        # batches split by prefix (one run each; benchmarks/results/e2e_cpu.md); on the H200 (128 questions, batch
        # 128; benchmarks/results/gpu_h200_2026-11-26b.md) 16.3-16.5 s of engine time against 17.0 s, less than the
        # prefill hold's gain, and the two together were not timed. None: $FASTRAG_MIX_PREFILL (0 or 1)
        self.mix_prefill = bool(_env_int(MIX_PREFILL_ENV, 0)) if mix_prefill is None else mix_prefill
        # prefill_hold: while sequences decode, a step may leave the waiting prefills (fewer new tokens than one
        # prefill's budget) for up to this many steps, so that more arrive and go in one call. On a GPU a prefill call
        # has a large fixed cost (H200, Llama-2-7B shape: 33.7 ms for 1 x 300 new tokens, 64.1 ms for 4 x 300;
        # benchmarks/results/prefill_gpu_h200_2026-11-26.md), and a DRAGIN run's prefills arrive one or two a step.
        # Default: DEFAULT_PREFILL_HOLD on CUDA devices, 0 elsewhere (every step prefills what waits). Measured on
        # the H200, 128 DRAGIN questions at batch 128 (benchmarks/results/gpu_h200_2026-11-26b.md): 2 steps gave 63
        # prefill calls instead of 96, decode batches of 65 instead of 53, and 14.5 s of engine time instead of 17.0
        # (20.1 s wall against 23.7-26.4 s). None: $FASTRAG_PREFILL_HOLD, else that default
        self.prefill_hold = default_prefill_hold(self.device) if prefill_hold is None else prefill_hold
        if isinstance(self.prefill_hold, bool) or not isinstance(self.prefill_hold, int) or self.prefill_hold < 0:
            raise ValueError(f"prefill_hold must be an int >= 0, got {prefill_hold!r}")
        self._held = 0  # consecutive steps the waiting prefills were held
        # async_prefill: a step's prefill samples its sequences' first tokens on the device and copies them to the
        # host together with the decode step's results, so step_launch never waits for a prefill (the caller's host
        # work then runs while the device computes the prefill and the decode step, not only the decode step); the
        # prefilled sequences join the decode batch one step later than without it (their first token is on the
        # host only after step_finish). Off (False): the prefill's first tokens are copied to the host inside
        # step_launch and the sequences decode in the same step. What a generation computes is the same either way.
        # None: `default_async_prefill` (on for CUDA devices, where the H200 measured less idle; off elsewhere)
        if async_prefill is None:
            async_prefill = default_async_prefill(self.device)
        elif not isinstance(async_prefill, bool):
            raise ValueError(f"async_prefill must be a bool, got {async_prefill!r}")
        self.async_prefill = bool(async_prefill)
        # prefix caching (kv.py): a prompt's full blocks that some sequence already computed are shared, not
        # prefilled again
        self.prefix_caching = prefix_caching
        # the cascade prefill's one-time self-check (a few small attention calls and a host read) here, not inside
        # the first step's launch, which reads nothing from the device
        if getattr(model, "cascade_prefill", False):
            model.uses_cascade_prefill(self.device, self.dtype)
        if getattr(model, "paged_prefill", None) is not None:  # (the paged prefill kernel's, likewise)
            model.uses_paged_prefill(self.device, self.dtype)
        self.sampling = sampling or SamplingParams()
        self.gen = torch.Generator(device="cpu").manual_seed(self.sampling.seed)
        self.signals = get_backend(signals)
        eos = set(c.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        self.eos_ids = eos
        self.max_context = c.max_position_embeddings
        self.waiting: list[SeqState] = []  # need prefill
        self.running: list[SeqState] = []  # decoding
        self.prefixes: list[SharedPrefix] = []  # shared prefixes (one per method/dataset prompt family)
        self._starts: dict[int, int] = {}  # id(prefix) -> first slot when its slots are consecutive, else -1
        self.live: dict[int, SeqState] = {}  # sequences that may hold blocks
        # generations a step's prefill finished when that step then raised in its decode part: the next
        # step_finish returns them with its own
        self._carried: list[SeqState] = []
        # counters, plus host seconds spent in step()'s prefill and decode parts (each ends in a host copy, so on
        # a GPU they include the device's time: where a run's time goes, beside the scheduler's method time).
        # Attention reads (fastrag/perf.py's floor): decode_ctx_tokens / decode_prefix_tokens are the own and the
        # shared-prefix KV entries decode steps read (a prefix once per step for all its sequences);
        # prefill_ctx_tokens sums, over prefilled tokens (attention passes too), the entries each attends to.
        # KV pressure: kv_waits counts, step by step, admissions put off because the pool had too few free
        # blocks (the sequence waits for running ones to finish); evictions / evicted_tokens count idle sequences
        # whose own cache was freed to make room (each evicted token is prefilled again when it next runs)
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "prefix_hit_tokens": 0, "own_hit_tokens": 0,
                      "decode_steps": 0, "prefill_calls": 0, "cached_hit_tokens": 0, "prefill_s": 0.0,
                      "decode_s": 0.0, "kv_waits": 0, "evictions": 0, "evicted_tokens": 0,
                      "decode_ctx_tokens": 0, "decode_prefix_tokens": 0, "prefill_ctx_tokens": 0,
                      "prefix_prefill_s": 0.0,  # (set_prefix's prefills: outside the steps, inside prefill_tokens)
                      "prefill_holds": 0,  # steps that left waiting prefills for a later step (prefill_hold)
                      # the most KV blocks held at once, seen after a step's admissions (sequences' own blocks and
                      # reservations, shared prefixes, the graphs' scratch block): against pool.num_blocks, how
                      # close a run came to waiting for room
                      "kv_peak_blocks": 0,
                      # device seconds of the steps' prefills, decode steps and the attention passes (DeviceClock):
                      # their sum against a run's wall time is how busy the device was
                      "device_prefill_s": 0.0, "device_decode_s": 0.0, "device_passes_s": 0.0}
        self.clock = DeviceClock(self.device, self.stats)
        # a row per step_launch when a list (`trace = []`, fastrag.eval with $FASTRAG_STEP_TRACE=1): what the step
        # prefilled and decoded, its host seconds and, once known, its device seconds (the scheduler adds its own);
        # and a `passes_only` row per scheduler step that launched attention passes without an engine step
        self.trace: list[dict] | None = None
        self._trace_row: dict | None = None
        # torch.profiler over a window of steps (fastrag.kernel_parts.StepWindow; fastrag.eval with
        # $FASTRAG_KERNEL_PROFILE=FIRST:COUNT): told of every step launch
        self.kernel_window = None
        # cProfile over every step launch, kept apart by kind of step (fastrag.launch_profile.LaunchProfile;
        # fastrag.eval with $FASTRAG_LAUNCH_PROFILE=1): which calls the launch's host seconds are in
        self.launch_profile = None
        # decode steps replayed from CUDA graphs (fastrag/cuda_graphs.py): on by default on a GPU,
        # FASTRAG_CUDA_GRAPHS=0 turns them off; cuda_graphs=True on a CPU runs the same static-buffer protocol
        # without CUDA (emulated; how the tests check it)
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and os.environ.get(CUDA_GRAPHS_ENV, "1") != "0"
        # (a model whose own-context decode attention is a paged kernel takes graphs of the whole context's width,
        # which depend on batch bucket and prefix only: capture_graphs() captures them all before a run)
        paged = getattr(model, "paged_decode_op", None)
        width = -(-self.max_context // block_size) if paged is not None and paged(self.device, self.dtype) is not None \
            else None
        self.graphs = DecodeGraphs(model, self.pool, max_batch, emulate=self.device.type != "cuda",
                                   ctx_blocks=width) if cuda_graphs else None
        # prefills replayed from CUDA graphs (fastrag/cuda_graphs.py `PrefillGraphs`): calls of up to
        # PREFILL_GRAPH_SEQS sequences and prefill_graph_tokens() new tokens, where the model prefills through the
        # paged prefill kernel with the fused small operations. None: on where the decode graphs are, unless
        # $FASTRAG_PREFILL_GRAPHS=0; True on a CPU runs the same static-buffer protocol emulated (the tests)
        def graphs_on(value, env: str, name: str) -> bool:  # (the env setting read, a bad one named, on any device)
            setting = env_setting(env)
            if value is None:
                return bool(cuda_graphs) and self.device.type == "cuda" and setting is not False
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool or None, got {value!r}")
            return value

        prefill_graphs = graphs_on(prefill_graphs, PREFILL_GRAPHS_ENV, "prefill_graphs")
        self.prefill_graphs = PrefillGraphs(
            model, self.pool, ctx_blocks=-(-self.max_context // block_size),
            max_tokens=min(prefill_graph_tokens(), max_prefill_tokens), max_seqs=min(PREFILL_GRAPH_SEQS, max_batch),
            emulate=self.device.type != "cuda",
            scratch_block=None if self.graphs is None else self.graphs.scratch_block) if prefill_graphs else None
        # DRAGIN's attention passes likewise (`PassGraphs`; FASTRAG_PASS_GRAPHS=0 turns them off)
        pass_graphs = graphs_on(pass_graphs, PASS_GRAPHS_ENV, "pass_graphs")
        self.pass_graphs = PassGraphs(model, max_tokens=min(PASS_GRAPH_TOKENS, max_prefill_tokens),
                                      max_seqs=PASS_GRAPH_SEQS, emulate=self.device.type != "cuda") \
            if pass_graphs else None

    def capture_graphs(self) -> int:
        """Capture, for every batch bucket, the decode graphs of the shared prefixes held now: each prefix alone,
        and where the model decodes mixed batches every set of two or more of them when they are 2 or 3 (a run's
        datasets finish at different times, so their subsets decode together too), all of them together when
        more (up to MAX_PREFIXES); sequences without a prefix when none is held. A step that needs another graph
        (a set of more prefixes, sequences with and without one, a prefix set later) still captures it then.
        Without graphs, or where graphs depend on the context's length (see fastrag/cuda_graphs.py), nothing is
        captured. Returns the number of decode graphs captured now. The prefill and attention-pass graphs of every
        token bucket are captured here too (their counts and seconds in `prefill_graphs.stats`, `pass_graphs.stats`).

        A capture costs tens of milliseconds of host and device time; done inside a run it is paid by the step that
        first needs each graph (fastrag.eval calls this once the prefixes are set, before its clock starts)."""
        for g in (self.prefill_graphs, self.pass_graphs):
            if g is not None:
                g.capture_ahead()
        if self.graphs is None:
            return 0
        held = [(p, self._starts.get(id(p), -1)) for p in self.prefixes]
        sets = [[h] for h in held] or [[(None, -1)]]
        sizes = range(2, len(held) + 1) if len(held) <= 3 else [len(held)]
        for r in sizes:  # (each set in the order _decode_graphed gives its prefixes)
            sets += [sorted(c, key=lambda h: id(h[0])) for c in itertools.combinations(held, r)]
        return self.graphs.capture_ahead(sets)

    # ------------------------------------------------------------------ sequences
    def new_sequence(self) -> SeqState:
        s = SeqState(table=BlockTable(self.pool))
        self.live[id(s)] = s
        return s

    def release(self, s: SeqState) -> None:
        """The sequence is done for good: it leaves the queue or the decode batch (a step in flight drops it when
        it finishes), and gives back its blocks and its share of the prefix. Releasing twice does nothing more."""
        self.live.pop(id(s), None)
        self.waiting = [x for x in self.waiting if x is not s]
        self.running = [x for x in self.running if x is not s]
        self._drop_cache(s)

    def _drop_cache(self, s: SeqState) -> None:
        s.table.free()
        if s.prefix is not None:
            self.pool.release(s.prefix.blocks)
            s.prefix = None
        s.tokens = []

    @property
    def prefix(self) -> SharedPrefix | None:
        """The most recently set shared prefix."""
        return self.prefixes[-1] if self.prefixes else None

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
        self._check_ids(ids, "the shared prefix (the method's demos, tokenized)")  # (a tokenizer not the model's)
        if len(ids) >= self.max_context:  # no prompt that starts with it could fit a generated token
            raise ValueError(f"a shared prefix of {len(ids)} tokens leaves no room in the model context of "
                             f"{self.max_context} tokens (the method's demos: give fewer, e.g. its config's fewshot)")
        for p in self.prefixes:
            if p.token_ids == ids[:n]:
                return p
        need = n // self.pool.block_size
        if need > self.pool.num_free:
            self._drop_idle_prefixes()
        if need > self.pool.num_free:
            raise OutOfBlocks(f"a shared prefix of {n} tokens needs {need} KV blocks; {self.pool.num_free} of "
                              f"{self.pool.num_blocks} are free now (sequences in flight hold the rest)")
        s = self.new_sequence()
        self.live.pop(id(s))  # its blocks pass to the SharedPrefix below
        t0 = time.perf_counter()
        self._prefill([(s, ids[:n])], want_logits=False)
        if self.device.type == "cuda":  # (set once per run: this wait is no per-step synchronisation)
            torch.cuda.synchronize(self.device)
        # its tokens count as prefilled (stats["prefill_tokens"]), so its seconds are kept too: fastrag.perf adds
        # them to the steps' prefill_s against a floor built from those counters
        self.stats["prefix_prefill_s"] += time.perf_counter() - t0
        blocks = list(s.table.blocks)
        slots = tensor_on(s.table.slots(0, n), self.device)
        pre = SharedPrefix(token_ids=ids[:n], blocks=blocks, slots=slots)  # owns the blocks' refcount
        self.prefixes.append(pre)
        self._starts[id(pre)] = pre.start
        return pre

    def clear_prefixes(self) -> None:
        """Give back the engine's hold on every shared prefix (sequences still using one keep it alive)."""
        for p in list(self.prefixes):
            self.drop_prefix(p)

    def drop_prefix(self, p: SharedPrefix) -> None:
        """Give back the engine's hold on one shared prefix: later prompts no longer start from it (sequences still
        using it keep its blocks alive). Dropping a prefix not held does nothing."""
        if not any(x is p for x in self.prefixes):
            return
        self.pool.release(p.blocks)
        self.prefixes = [x for x in self.prefixes if x is not p]
        self._starts.pop(id(p), None)

    def _idle_prefixes(self, keep: SharedPrefix | None = None) -> list[SharedPrefix]:
        """The held prefixes no live sequence starts from (keep excepted)."""
        used = {id(s.prefix) for s in self.live.values() if s.prefix is not None}
        return [p for p in self.prefixes if id(p) not in used and p is not keep]

    def _drop_idle_prefixes(self, keep: SharedPrefix | None = None) -> int:
        """Free the blocks of the prefixes no live sequence uses (the last resort before a request is refused
        for lack of room: e.g. a server that has seen many prompt families). Returns the blocks freed."""
        idle = self._idle_prefixes(keep)
        for p in idle:
            self.drop_prefix(p)
        return sum(len(p.blocks) for p in idle)

    def start(self, s: SeqState, prompt_ids: list[int], max_new_tokens: int, track_from: int | None = None,
              sample_key: int | None = None) -> None:
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
        """
        if not prompt_ids:
            raise ValueError("empty prompt")
        self._check_ids(prompt_ids, "prompt_ids")
        n_new = as_int(max_new_tokens)
        if n_new is None or n_new < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        max_new_tokens = n_new
        if sample_key is not None:  # (checked before the sequence changes: a bad key used to fail the whole step)
            sample_key = check_seed(sample_key, "sample_key")
        if id(s) not in self.live:
            raise ValueError("the sequence was released (or not made by this engine's new_sequence)")
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
        pre = max((p for p in self.prefixes if p.matches(prompt_ids)), key=lambda p: p.length, default=None)
        # a sequence that could not hold its blocks even alone in the pool would wait forever: refuse it here, so
        # the caller (the scheduler: this question only) gets the error, not the whole run at a later step
        own = len(prompt_ids) - (pre.length if pre is not None else 0) + max_new_tokens
        room = self.pool.num_blocks - self._pinned_blocks()
        if -(-own // self.pool.block_size) > room:  # prefixes nobody uses give their blocks back first
            room += self._drop_idle_prefixes(keep=pre)
        if -(-own // self.pool.block_size) > room:
            raise ValueError(f"a sequence of {own} tokens after its shared prefix ({len(prompt_ids)} prompt + "
                             f"{max_new_tokens} new) needs more than the {room} KV blocks of "
                             f"{self.pool.block_size} tokens the pool can ever give one sequence "
                             f"({self.pool.num_blocks} in all); raise --kv-cache-gb")
        if pre is not s.prefix:  # prefix changes: the own cache is relative to the old base, drop it
            self._drop_cache(s)
            if pre is not None:
                self.pool.share(pre.blocks)
            s.prefix = pre
        base = s.base
        if pre is not None:
            self.stats["prefix_hit_tokens"] += base
        # longest common prefix with the sequence's own computed tokens; keep >= 1 token to prefill (logits)
        own_prev = s.tokens[base: s.computed]
        own_new = prompt_ids[base:]
        lcp = 0
        limit = min(len(own_prev), len(own_new) - 1)
        while lcp < limit and own_prev[lcp] == own_new[lcp]:
            lcp += 1
        s.table.truncate(lcp)
        lcp = s.table.num_tokens  # one less block when the cut fell inside a block shared with another sequence
        self.stats["own_hit_tokens"] += lcp
        s.tokens = list(prompt_ids)
        s.pending_prompt = prompt_ids[base + lcp:]
        s.max_new = max_new_tokens
        bs = self.pool.block_size
        if self.prefix_caching:
            own = len(prompt_ids) - 1 if track_from is None else min(len(prompt_ids) - 1, track_from)
            s.adoptable = max(own - base, 0) // bs
            root = pre.key if pre is not None else b""
            s.keys = chain_keys(root, prompt_ids[base:], bs)
        else:
            s.keys, s.adoptable = [], 0
        if self.sampling.temperature > 0:
            s.sample_key = sample_key if sample_key is not None else \
                int(torch.randint(0, 2**62, (1,), generator=self.gen))
        s.out = Generation(ids=[], entropy=[], logprob=[], prompt_tokens=len(prompt_ids),
                           prefilled=len(s.pending_prompt))
        if track_from is not None:
            if track_from < base:
                raise ValueError(f"track_from={track_from} lies inside the shared prefix ({base} tokens)")
            cap = track_capacity(len(prompt_ids) - track_from + max_new_tokens)
            amax = torch.zeros(self.model.c.num_heads, cap, dtype=torch.float32, device=self.device)
            if s.track_from == track_from and s.amax is not None:  # the same span continues: keep what is cached
                keep = min(max(s.computed - track_from, 0), s.amax.shape[1], cap)
                amax[:, :keep] = s.amax[:, :keep]
            s.track_from, s.amax = track_from, amax
            # tracked tokens are fed by decode steps: prefill only what comes before the span
            s.pending_prompt = prompt_ids[base + lcp: max(track_from, base + lcp)]
        else:
            s.track_from = s.amax = None
        self._adopt_cached(s)
        self.waiting.append(s)

    def _check_ids(self, ids: list[int], what: str) -> None:
        """Token ids must be integers (Python's or numpy's) inside the model's vocabulary (an embedding lookup would
        fail a later step)."""
        V = self.model.c.vocab_size
        lo, hi = min(ids), max(ids)
        if not (isinstance(lo, numbers.Integral) and isinstance(hi, numbers.Integral)) or lo < 0 or hi >= V:
            bad = next(t for t in ids if not isinstance(t, numbers.Integral) or not 0 <= t < V)
            raise ValueError(f"{what} holds token id {bad!r}, outside the model's vocabulary [0, {V})")

    def _pinned_blocks(self) -> int:
        """Blocks no sequence can ever get: the shared prefixes' and the decode and prefill graphs' scratch blocks."""
        return sum(len(p.blocks) for p in self.prefixes) + (self.graphs is not None) \
            + (self.prefill_graphs is not None)

    def _adopt_cached(self, s: SeqState) -> bool:
        """Replace the sequence's own cache by the cached blocks of its prompt when they hold more of it; the
        prompt still to prefill shrinks to match. Returns whether it did."""
        bs = self.pool.block_size
        have = s.table.num_tokens // bs
        if s.adoptable <= have:
            return False
        hit = self.pool.lookup(s.keys[: s.adoptable])
        if len(hit) <= have:
            return False
        self.pool.share(hit)  # before the own blocks go: they may be among the hits
        # (the own tokens kept so far, a partial last block's included, are already in own_hit_tokens)
        self.stats["cached_hit_tokens"] += len(hit) * bs - s.table.num_tokens
        s.table.free()
        s.table.blocks, s.table.num_tokens = hit, len(hit) * bs
        end = len(s.tokens) if s.track_from is None else max(s.track_from, s.computed)
        s.pending_prompt = s.tokens[s.computed: end]
        s.out.prefilled = len(s.tokens) - s.computed
        return True

    def _register(self, s: SeqState, before: int) -> None:
        """Name the prompt blocks this prefill completed (own tokens `before` -> now) in the prefix cache."""
        bs = self.pool.block_size
        for j in range(before // bs, min(s.table.num_tokens // bs, len(s.keys))):
            self.pool.register(s.table.blocks[j], s.keys[j])

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or any(id(s) in self.live for s in self._carried))

    # ------------------------------------------------------------------ stepping
    @torch.inference_mode()
    def step(self) -> list[SeqState]:
        """Prefill what waits (within the token budget), then one decode step for all running sequences.

        Returns the sequences whose generation finished in this step (their `out` is complete).
        """
        return self.step_finish(self.step_launch())

    @torch.inference_mode()
    def step_launch(self) -> "PendingStep":
        """`step()`'s first half: the prefill (which ends in a host copy of its sampled tokens; with async_prefill
        that copy is non-blocking too and read in step_finish, and the prefilled sequences decode from the next
        step), then the decode step's kernels and the non-blocking copy of its sampled tokens and signals to pinned
        host memory. On a GPU it returns while the device still runs the decode step, so the caller can do host
        work (the methods' own logic for sequences that finished earlier) until `step_finish`. Between the two, the caller may start,
        release or drop other sequences (stream order keeps their blocks safe), but must not launch another step.
        When a forward raises, no sequence is lost: a failed prefill's sequences wait again as they were, and when
        the decode part fails after the prefill ran, the generations that prefill finished come back from the next
        `step_finish` (see `_carry_prefill`).
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
            # (step: the launch's number; a passes_only row carries the number of the launch it follows)
            row = {"step": self.trace[-1]["step"] + 1 if self.trace else 0, "prefill_seqs": 0, "prefill_tokens": 0,
                   "decode_batch": 0}
            self.trace.append(row)
            compile_log = _compile_log()
            if compile_log is not None:  # Triton compiles from here to the next launch are this step's ("compiles")
                compile_log.row = row
        self._trace_row = row
        cap0 = self._captures() if row is not None else None
        if self.waiting:
            self._admit_fed()
        if self.waiting and not self._hold_prefill():
            if self.prefix_caching:  # blocks computed since a sequence started (by the last step's prefill)
                for s in self.waiting:
                    if s.pending_prompt:
                        self._adopt_cached(s)
            group, budget = [], self.max_prefill_tokens
            computing: set[bytes] = set()  # content keys of the blocks the group's prefill completes
            bs = self.pool.block_size
            # (sequences with nothing to prefill, left by _admit_fed for lack of room, go last and wait)
            self.waiting.sort(key=lambda s: (not s.pending_prompt, s.prefix is None, len(s.pending_prompt)))
            i = 0
            while i < len(self.waiting) and self.waiting[i].pending_prompt \
                    and len(self.running) + len(group) < self.max_batch:
                s = self.waiting[i]
                n = len(s.pending_prompt)
                nxt = s.table.num_tokens // bs
                if computing and nxt < s.adoptable and s.keys[nxt] in computing:
                    i += 1  # its next block is being computed for another sequence: it shares it next step
                    continue
                if group and s.prefix is not group[0].prefix and not self.mix_prefill:
                    break
                # the token budget counts real tokens: a batch of very different lengths runs packed (no padding)
                if group and sum(len(x.pending_prompt) for x in group) + n > budget:
                    break
                try:
                    s.table.reserve(len(s.tokens) - s.computed + s.max_new)
                except OutOfBlocks:
                    if group or self.running:
                        self.stats["kv_waits"] += 1
                        break  # wait for running sequences to finish and free blocks
                    if not self._evict_idle(keep=s):
                        raise OutOfBlocks(f"the KV pool ({self.pool.num_blocks} blocks of {self.pool.block_size}) "
                                          f"cannot hold one sequence of {s.computed + n + s.max_new} tokens; "
                                          "raise --kv-cache-gb") from None
                    continue
                group.append(self.waiting.pop(i))
                end = min(s.computed + n - s.base, len(s.keys) * bs) // bs
                computing.update(s.keys[nxt:end])
            if group:
                if row is not None:
                    row["prefill_seqs"], row["prefill_tokens"] = len(group), sum(len(s.pending_prompt) for s in group)
                    replays0 = self.prefill_graphs.stats["replays"] if self.prefill_graphs is not None else 0
                    work0 = (self.stats["prefill_calls"], self.stats["prefill_ctx_tokens"])
                dev0 = self.clock.mark()
                try:
                    logits = self._prefill([(s, s.pending_prompt) for s in group], want_logits=True)
                except BaseException:  # (the forward failed: out of memory, a kernel error, Ctrl-C) the group
                    self.waiting[:0] = group  # waits again as it was, its blocks reserved, nothing computed
                    raise
                if row is not None:  # its forwards and the KV entries their attention read (fastrag.perf's floor)
                    row["prefill_calls"] = self.stats["prefill_calls"] - work0[0]
                    row["prefill_ctx_tokens"] = self.stats["prefill_ctx_tokens"] - work0[1]
                    if self.prefill_graphs is not None:  # (graphed prefills apart from eager ones)
                        row["prefill_graphed"] = self.prefill_graphs.stats["replays"] > replays0
                for s in group:
                    s.pending_prompt = []
                # the first token of every prefilled generation in one signals call and one host copy (a sequence
                # with tracked tokens still to feed samples nothing yet: they go in one per decode step)
                rows = [i for i, s in enumerate(group) if s.computed == len(s.tokens)]
                done = {}
                if rows:
                    sel, lg = [group[i] for i in rows], logits if len(rows) == len(group) else logits[rows]
                    if self.async_prefill:  # sampled now, read in step_finish: they decode from the next step
                        joining, join_sampled = sel, self._sample_launch(sel, lg)
                        self.clock.stop("device_prefill_s", dev0, join_sampled[1], row)
                    else:
                        done = dict(zip(rows, self._append_batch(sel, lg, dev0, row)))
                else:
                    self.clock.stop("device_prefill_s", dev0, row=row)
                for i, s in enumerate(group):
                    (finished if done.get(i, False) else self.running).append(s)
        held = self.pool.num_blocks - self.pool.num_free
        if held > self.stats["kv_peak_blocks"]:
            self.stats["kv_peak_blocks"] = held
        t1 = time.perf_counter()
        self.stats["prefill_s"] += t1 - t0
        st = PendingStep(finished, trace_row=row)
        decodable = self.running
        if joining:  # (in `running` already, so nothing else takes their place, but decoding from the next step)
            st.joining, st.join_sampled = joining, join_sampled
            if row is not None:
                row["joining"] = len(joining)
            pending = {id(s) for s in joining}
            decodable = [s for s in self.running if id(s) not in pending]
        if decodable:
            st.batch = batch = decodable[: self.max_batch]
            if row is not None:
                row["decode_batch"] = len(batch)
                kv0 = (self.stats["decode_ctx_tokens"], self.stats["decode_prefix_tokens"])
            dev0 = self.clock.mark()
            try:
                logits = self._decode(batch)
                if row is not None:  # the KV entries this step's attention read (each shared prefix once)
                    row["decode_ctx_tokens"] = self.stats["decode_ctx_tokens"] - kv0[0]
                    row["decode_prefix_tokens"] = self.stats["decode_prefix_tokens"] - kv0[1]
                    row["decode_prefixes"] = len({id(s.prefix) for s in batch if s.prefix is not None})
                # a sequence still feeding the tracked tokens of its prompt samples nothing this step
                # (s.computed written out: this runs for every sequence of every step)
                st.ready = [i for i, s in enumerate(batch)
                            if (s.prefix.length if s.prefix else 0) + s.table.num_tokens == len(s.tokens)]
                if st.ready:
                    st.sampled = self._sample_launch([batch[i] for i in st.ready],
                                                     logits if len(st.ready) == len(batch) else logits[st.ready])
            except BaseException:  # the decode step failed (its sequences are as they were: nothing appended)
                self._carry_prefill(st)
                raise
            self.clock.stop("device_decode_s", dev0, st.sampled[1] if st.sampled is not None else None, row)
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
        self._trace_row = row
        return row

    def _captures(self) -> int:
        return sum(g.stats["captures"] for g in (self.graphs, self.prefill_graphs, self.pass_graphs) if g is not None)

    def _carry_prefill(self, st: "PendingStep") -> None:
        """A step whose decode part raised after its prefill ran: the prefill's outcome is kept, not lost with the
        step. Its first tokens (async_prefill) are read and appended now, and the generations it finished are
        returned by the next step_finish."""
        finished = list(st.finished)
        if st.joining:
            try:
                done = self._sample_finish(st.joining, st.join_sampled)
            except BaseException:  # (the device itself failed: these sequences cannot decode on, they end here)
                done = [True] * len(st.joining)
                for s in st.joining:
                    s.out.error = s.out.error or "the engine failed while this generation's first token was read"
            ended = {id(s) for s, d in zip(st.joining, done) if d}
            self.running = [s for s in self.running if id(s) not in ended]
            finished += [s for s, d in zip(st.joining, done) if d]
        self._carried += finished

    def _hold_prefill(self) -> bool:
        """Whether this step leaves the waiting prefills for a later one (prefill_hold): only while sequences decode
        (the step does work without them), while what waits is less than one prefill's token budget, and for at most
        prefill_hold steps in a row."""
        if not self.prefill_hold or not self.running or self._held >= self.prefill_hold \
                or sum(len(s.pending_prompt) for s in self.waiting) >= self.max_prefill_tokens:
            self._held = 0
            return False
        self._held += 1
        self.stats["prefill_holds"] += 1
        return True

    @staticmethod
    def step_done(st: "PendingStep") -> bool:
        """Whether a launched step's results are on the host already (step_finish would not wait)."""
        return all(x is None or x[1] is None or x[1].query() for x in (st.join_sampled, st.sampled))

    @torch.inference_mode()
    def step_finish(self, st: "PendingStep") -> list[SeqState]:
        """`step()`'s second half: wait for the launched step's host copy, append the sampled tokens, and return the
        sequences whose generation finished (the prefill's and the decode step's)."""
        t_fin = time.perf_counter()
        carried, self._carried = self._carried, []
        finished = [s for s in carried + st.finished if id(s) in self.live]  # (one released since is gone)
        if st.batch:
            t1 = time.perf_counter()
            batch = st.batch
            done = [False] * len(batch)
            if st.sampled is not None:
                ready = [batch[i] for i in st.ready]
                for i, d in zip(st.ready, self._sample_finish(ready, st.sampled)):
                    done[i] = d
            # sequences released while the step ran (their question ended) leave the batch for good
            gone = {id(s) for s in batch}
            keep = [s for s, d in zip(batch, done) if not d and id(s) in self.live]
            self.running = keep + [s for s in self.running if id(s) not in gone]
            finished += [s for s, d in zip(batch, done) if d and id(s) in self.live]
            self.stats["decode_s"] += st.decode_s + time.perf_counter() - t1
        if st.joining:  # async_prefill: the prefill's first tokens (copied before the decode step's, in stream order)
            t1 = time.perf_counter()
            done = self._sample_finish(st.joining, st.join_sampled)
            ended = {id(s) for s, d in zip(st.joining, done) if d}
            if ended:
                self.running = [s for s in self.running if id(s) not in ended]
            finished += [s for s, d in zip(st.joining, done) if d and id(s) in self.live]
            self.stats["prefill_s"] += time.perf_counter() - t1
        self.clock.settle()  # (the step's copy is on the host: its device time and any before it can be read)
        if st.trace_row is not None:
            st.trace_row["finish_s"] = time.perf_counter() - t_fin
        self._attn_out([s for s in finished if s.amax is not None])
        return finished

    def _attn_out(self, seqs: list[SeqState]) -> None:
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

    def _admit_fed(self) -> None:
        """Waiting sequences with nothing to prefill (their next tokens are fed by decode steps) join the decode
        batch directly, as far as the batch and the KV pool have room."""
        for s in [s for s in self.waiting if not s.pending_prompt]:
            if len(self.running) >= self.max_batch:
                break
            try:
                s.table.reserve(len(s.tokens) - s.computed + s.max_new)
            except OutOfBlocks:
                if self.running:
                    self.stats["kv_waits"] += 1
                    break  # wait for running sequences to finish and free blocks
                if not self._evict_idle(keep=s):
                    raise OutOfBlocks(f"the KV pool ({self.pool.num_blocks} blocks of {self.pool.block_size}) "
                                      f"cannot hold one sequence of {len(s.tokens) + s.max_new} tokens; "
                                      "raise --kv-cache-gb") from None
                return  # evicted sequences may need a prefill again: the next step sorts it out
            self.waiting.remove(s)
            self.running.append(s)

    def _evict_idle(self, keep: SeqState) -> bool:
        """Free the own caches of sequences that are not decoding (waiting for a prefill, or between two
        generations of their question); they prefill their whole prompt again when they next run. A sequence
        between two generations also lets go of its shared prefix (its next start shares a prefix still held):
        a prefix dropped by `drop_prefix`, or one no waiting or running sequence uses, can then give its blocks
        back, which the room a start() was promised counted on."""
        running = {id(s) for s in self.running}
        waiting = {id(s) for s in self.waiting}
        freed = False
        for s in self.live.values():
            if s is keep or id(s) in running:
                continue
            if id(s) not in waiting and s.prefix is not None:  # (its tokens stay: callers read them)
                self.pool.release(s.prefix.blocks)
                s.prefix = None
            if not s.table.blocks:  # a prefix share alone: no own block comes back, so no eviction counted
                continue
            self.stats["evictions"] += 1
            self.stats["evicted_tokens"] += s.table.num_tokens
            s.table.free()
            if id(s) in waiting:
                s.pending_prompt = s.tokens[s.base: s.track_from]  # tracked tokens are fed by decode steps
                s.out.prefilled = len(s.tokens) - s.base
            freed = True
        # the last resort: the blocks of shared prefixes no live sequence starts from
        return freed or self._drop_idle_prefixes(keep=keep.prefix) > 0

    def _append_batch(self, seqs: list[SeqState], logits: torch.Tensor, prefill_start=None,
                      row: dict | None = None) -> list[bool]:
        """Sample one token per row of logits for seqs and append it; returns which generations finished.
        prefill_start: the DeviceClock mark of the prefill these logits end (its device time ends at the copy);
        row: its step's trace row."""
        sampled = self._sample_launch(seqs, logits)
        if prefill_start is not None:
            self.clock.stop("device_prefill_s", prefill_start, sampled[1], row)
        return self._sample_finish(seqs, sampled)

    def _sample_launch(self, seqs: list[SeqState], logits: torch.Tensor):
        """Launch the fused decode-signals kernel over logits and the one host copy of its results per step
        ([3, B] float64: token ids, entropies, log-probabilities; ids < 2^53 are exact). On a GPU the copy goes
        to pinned memory without waiting: returns (host tensor, CUDA event), the event marking the copy done."""
        # Greedy, temperature and top-p sampling all happen inside the fused decode-signals kernel (argmax, or a
        # Gumbel-max draw over the nucleus keyed per token); entropy and logprob are those of the distribution
        # the token is drawn from (DESIGN.md "Signals").
        sp = self.sampling
        keys = None
        if sp.temperature > 0:  # per-row keys of the in-kernel sampler: (seed, generation key, token index)
            keys = torch.tensor([sampling_key(sp.seed, s.sample_key, len(s.out.ids)) & 0xFFFFFFFF for s in seqs],
                                dtype=torch.int64)
            keys = self._h2d(keys) if logits.device == self.device else keys.to(logits.device)
        sig = self.signals.decode_signals(logits, temperature=sp.temperature, rng_keys=keys, top_p=sp.top_p,
                                          top_k=sp.top_k)
        dev = torch.stack([sig.chosen.double(), sig.entropy.double(), sig.logprob.double()])
        if dev.device.type != "cuda":
            return dev, None
        host = self._d2h(dev)
        ev = torch.cuda.Event(enable_timing=True)  # (timing: it also ends the phase's DeviceClock interval)
        ev.record()
        return host, ev

    def _sample_finish(self, seqs: list[SeqState], sampled) -> list[bool]:
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
            done.append(len(s.out.ids) >= s.max_new)
        return done

    def _prefill(self, items: list[tuple[SeqState, list[int]]], want_logits: bool, decode: bool = False):
        """Compute KV for each sequence's new tokens (padded batch). Returns last-token logits [B, V].
        The sequences may start with different shared prefixes. decode: one token each (a decode step), whose
        tracked sequences' attention statistics are updated."""
        B = len(items)
        T = max(len(ids) for _, ids in items)
        for s, ids in items:
            s.table.reserve(len(ids))
        logits = self._prefill_graphed(items) if self.prefill_graphs is not None and not decode else None
        if logits is not None:
            self._prefilled(items, decode)
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
            batch = self._batch(write, valid, pos, None, ctx)
            batch.prefix_groups = self._groups([s for s, _ in items])
        else:
            batch = self._batch(write, valid, pos, prefix, ctx)
        batch.lens = [len(ids) for _, ids in items]  # (the packed forward's layout, without reading valid back)
        last = torch.tensor([b * T + len(ids) - 1 for b, (_, ids) in enumerate(items)])
        tracked = [b for b, (s, _) in enumerate(items) if s.amax is not None and s.computed >= s.track_from]
        if decode and tracked:
            batch.last_layer = {}  # the model leaves the last layer's queries and row log-sum-exp here
        logits = self.model(self._h2d(ids_t), batch, self.pool.k, self.pool.v,
                            logits_index=self._h2d(last if want_logits else last[:0]))
        if decode and tracked:
            self._track(items, tracked, batch)
        self._prefilled(items, decode)
        return logits

    def _prefilled(self, items: list[tuple[SeqState, list[int]]], decode: bool) -> None:
        """The bookkeeping after a prefill forward of items: tokens held, counters, content keys registered."""
        for s, ids in items:
            n0, n = s.table.num_tokens, len(ids)
            s.table.num_tokens += n
            if not decode:
                self.stats["prefill_ctx_tokens"] += n * (s.base + n0) + n * (n + 1) // 2
                if s.keys:
                    self._register(s, n0)
        self.stats["prefill_tokens"] += sum(len(ids) for _, ids in items)
        self.stats["prefill_calls"] += 1

    def _prefill_graphed(self, items: list[tuple[SeqState, list[int]]]) -> torch.Tensor | None:
        """A prefill of items through a replayed graph (their blocks reserved): last-token logits [B, V], or None
        where it does not fit one (the caller prefills eagerly)."""
        starts, write, ctx = [], [], []
        for s, ids in items:
            n0, n = s.table.num_tokens, len(ids)
            starts.append(s.base + n0)
            write += s.table.slots(n0, n0 + n)
            ctx.append((s.table.blocks, n0 + n))
        return self.prefill_graphs.run([ids for _, ids in items], starts, write, ctx, [s.prefix for s, _ in items])

    def _decode(self, seqs: list[SeqState]) -> torch.Tensor:
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
            logits = self._decode_graphed(seqs, heads)
            if logits is not None:
                return logits
        if len(groups) == 1 or self.model.mixes_prefixes:
            logits = self._prefill([(s, [s.tokens[s.computed]]) for s in seqs], want_logits=True, decode=True)
        else:  # different prefixes on the torch cascade path: one forward per prefix
            out = [None] * len(seqs)
            for idx in groups.values():
                g = [seqs[i] for i in idx]
                lg = self._prefill([(s, [s.tokens[s.computed]]) for s in g], want_logits=True, decode=True)
                self.stats["prefill_calls"] -= 1
                for j, i in enumerate(idx):
                    out[i] = lg[j]
            logits = torch.stack(out)
            self.stats["prefill_calls"] += 1
        self.stats["prefill_tokens"] -= len(seqs)
        self.stats["prefill_calls"] -= 1
        return logits

    def _decode_graphed(self, seqs: list[SeqState], heads: list) -> torch.Tensor | None:
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
            res = self.graphs.run(ids, pos, write, ctx, prefix, self._starts.get(id(prefix), -1) if prefix else -1)
        else:  # several prefixes: a graph of their set, in a fixed order (rows of no prefix: -1)
            order = sorted((p for p in heads if p is not None), key=id)
            where = {id(p): k for k, p in enumerate(order)}
            res = self.graphs.run(ids, pos, write, ctx, [(p, self._starts.get(id(p), -1)) for p in order],
                                  row_prefix=[where.get(id(s.prefix), -1) for s in seqs])
        if res is None:
            return None
        logits, batch = res
        tracked = [b for b, s in enumerate(seqs) if s.amax is not None and s.computed >= s.track_from]
        if tracked:
            self._track([(s, None) for s in seqs], tracked, batch)
        for s in seqs:
            s.table.num_tokens += 1
        return logits

    def _track(self, items, rows: list[int], batch: AttnBatch) -> None:
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
        idx = self._h2d(torch.tensor(rows, dtype=torch.long))
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
                                        self._h2d(torch.tensor(starts, dtype=torch.long)),
                                        lse.float().contiguous(), self.pool.block_size, self.model.scale, amax)
        for (a, b, cap), whole in zip(groups, wholes):
            w = min(cap, width)
            if amax is not whole:
                whole[:, :, :w] = amax[a:b, :, :w]
            torch._foreach_copy_([s.amax for s in seqs[a:b]], list(whole.unbind(0)))
        if self._trace_row is not None:  # (the step trace: host seconds of the tracking, and its capacities)
            row = self._trace_row
            row["track_s"] = row.get("track_s", 0.0) + time.perf_counter() - t0
            row["track_seqs"], row["track_capacities"] = len(seqs), len(groups)

    def _h2d(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the engine's device. On a GPU through pinned memory with non_blocking: a copy from
        pageable memory would wait for the GPU's queue to drain, one host synchronisation per upload; this way
        the step's only synchronisation is the host copy of its signals."""
        return to_device(t, self.device)

    def _batch(self, write, valid, pos, prefix, ctx: list[tuple[list[int], int]]) -> AttnBatch:
        """ctx: per sequence (its blocks, number of context entries after the prefix)."""
        bs = self.pool.block_size
        B = len(ctx)
        ctx_t, lens = block_table_tensor(ctx, bs, B, blocks_needed(ctx, bs))
        d = self.device
        return AttnBatch(
            write_slots=self._h2d(torch.tensor(write, dtype=torch.long)), valid=self._h2d(valid),
            positions=self._h2d(pos), prefix_len=prefix.length if prefix else 0,
            prefix_slots=prefix.slots if prefix else torch.zeros(0, dtype=torch.long, device=d),
            ctx_blocks=self._h2d(ctx_t), ctx_lens=self._h2d(lens), block_size=bs,
            prefix_start=self._starts.get(id(prefix), -1) if prefix else -1, ctx_lens_host=[n for _, n in ctx],
        )

    def _groups(self, seqs: list[SeqState]) -> list[PrefixGroup]:
        rows: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            if s.prefix is not None:
                rows.setdefault(id(s.prefix), []).append(i)
        by_id = {id(s.prefix): s.prefix for s in seqs if s.prefix is not None}
        return [PrefixGroup(self._h2d(torch.tensor(r, dtype=torch.long)), by_id[k].length, by_id[k].slots,
                            self._starts.get(k, -1), host_rows=r) for k, r in rows.items()]

    # ------------------------------------------------------------------ cache-free attention passes
    @torch.inference_mode()
    def attention_passes(self, seqs: list[list[int]], kind: str):
        """Batched last-layer attention over token lists alone (positions from 0, no cache).

        kind "colmax": per list, a_t = mean_h max_{j>=t} A[h, j, t]  -> list of [T_b] float lists
        kind "rows":   per list, the head-mean attention matrix       -> list of [T_b, T_b] tensors
        """
        return self.attention_passes_finish(self.attention_passes_launch(seqs, kind))

    @torch.inference_mode()
    def attention_passes_launch(self, seqs: list[list[int]], kind: str) -> "PendingPasses":
        """`attention_passes`' first half: the forwards and signal kernels, and the non-blocking copies of their
        results to pinned host memory. On a GPU it returns before the device has run them (stream order puts them
        after any step already launched); `attention_passes_finish` waits for the copies."""
        if kind not in ("colmax", "rows"):
            raise ValueError(f"attention pass kind must be 'colmax' or 'rows', got {kind!r}")
        for x in seqs:
            if not x:
                raise ValueError("an attention pass over an empty token sequence")
            if len(x) > self.max_context:
                raise ValueError(f"an attention pass over {len(x)} tokens exceeds the model context of "
                                 f"{self.max_context} tokens")
            self._check_ids(x, "an attention pass's sequence")
        pending = PendingPasses(kind, [len(x) for x in seqs])
        dev0 = self.clock.mark()
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        pg = self.pass_graphs if self.pass_graphs is not None and self.pass_graphs.applies() else None
        i = 0
        while i < len(order):
            if pg is not None and len(seqs[order[i]]) <= pg.buckets[-1]:
                # a graph's call: up to its lists and tokens, and (lengths ascending) within the padded budget of
                # the signal kernels after it
                j, n = i, 0
                while j < len(order) and j - i < pg.max_seqs and n + len(seqs[order[j]]) <= pg.buckets[-1] \
                        and (j - i + 1) * len(seqs[order[j]]) <= self.max_prefill_tokens:
                    n += len(seqs[order[j]])
                    j += 1
            else:  # group similar lengths so padding stays small
                j, T = i, 0
                while j < len(order) and (j - i + 1) * max(T, len(seqs[order[j]])) <= self.max_prefill_tokens:
                    T = max(T, len(seqs[order[j]]))
                    j += 1
            j = max(j, i + 1)
            idx = order[i:j]
            T = max(len(seqs[k]) for k in idx)
            lens_h = torch.tensor([len(seqs[k]) for k in idx])
            lens = self._h2d(lens_h)  # (a plain .to(device) from pageable memory would wait for the device)
            qk = pg.run([seqs[k] for k in idx]) if pg is not None else None
            graphed = qk is not None
            if qk is None:
                ids = torch.zeros(len(idx), T, dtype=torch.long)
                for b, k in enumerate(idx):
                    ids[b, : len(seqs[k])] = torch.tensor(seqs[k])
                # (the host lengths let the paged kernel's path compute only the real rows)
                qk = self.model.last_layer_qk(self._h2d(ids), lens, lens_h.tolist())
            n_tok = sum(len(seqs[k]) for k in idx)
            n_ctx = sum(len(seqs[k]) * (len(seqs[k]) + 1) // 2 for k in idx)
            row = self._trace_row
            if row is not None:  # the step launched last: its passes' forwards, tokens and attention entries
                for key, add in (("pass_calls", 1), ("pass_lists", len(idx)), ("pass_tokens", n_tok),
                                 ("pass_ctx_tokens", n_ctx), ("pass_graphed", int(graphed))):
                    row[key] = row.get(key, 0) + add
            q, k_ = qk
            q, k_ = q.float(), k_.float()
            if kind == "colmax":
                r = self.signals.causal_attn_colmax(q, k_, lens, self.model.scale)
            else:
                r = self.signals.causal_attn_mean_rows(q, k_, lens, self.model.scale)
            pending.groups.append((idx, self._d2h(r)))
            self.stats["prefill_tokens"] += n_tok
            self.stats["prefill_ctx_tokens"] += n_ctx
            i = j
        if self.device.type == "cuda" and pending.groups:
            pending.event = torch.cuda.Event(enable_timing=True)
            pending.event.record()
        self.clock.stop("device_passes_s", dev0, pending.event, self._trace_row)  # (the step launched last)
        return pending

    @torch.inference_mode()
    def attention_passes_finish(self, pending: "PendingPasses") -> list:
        """Wait for launched attention passes; their results in the order of the lists given to the launch."""
        if pending.event is not None:
            pending.event.synchronize()
            self.clock.settle()
        out = [None] * len(pending.lengths)
        for idx, r in pending.groups:
            for b, k in enumerate(idx):
                n = pending.lengths[k]
                out[k] = r[b, :n].tolist() if pending.kind == "colmax" else r[b, :n, :n].double()
        return out

    def _d2h(self, t: torch.Tensor) -> torch.Tensor:
        """A device tensor's host copy; on a GPU into pinned memory without waiting (an event marks it done)."""
        if t.device.type != "cuda":
            return t.cpu()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host
