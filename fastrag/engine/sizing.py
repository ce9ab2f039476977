"""The engine's settings and sizes: environment switches and their defaults, the KV pool's size, tracked-span
capacities, and the checks and keys of sampling seeds."""

from __future__ import annotations

import operator

import torch

from fastrag.settings import setting

_M64 = (1 << 64) - 1
CUDA_GRAPHS_ENV = "FASTRAG_CUDA_GRAPHS"
PREFILL_GRAPHS_ENV = "FASTRAG_PREFILL_GRAPHS"
PASS_GRAPHS_ENV = "FASTRAG_PASS_GRAPHS"
# the largest prefill (new tokens; capped by the engine's max_prefill_tokens) and the most sequences a prefill graph
# takes (fastrag/cuda_graphs/); $FASTRAG_PREFILL_GRAPH_TOKENS overrides the first. Larger prefills run eagerly,
# where each call pays thousands of host launches (benchmarks/results/ has the measurements behind these bounds)
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
CPU_KV_CACHE_GB = 4.0  # the pool on a CPU when none is asked for
# share of the GPU's memory the engine plans to use in all (weights, KV pool, activations) when sizing its pool
GPU_MEMORY_FRACTION = 0.8


def env_count(name: str, default: int) -> int:
    """$name, a count in fastrag.settings.VARIABLES (unset or blank: default)."""
    v = setting(name)
    return default if v is None else v


def prefill_graph_tokens() -> int:
    """The most new tokens a prefill graph takes: $FASTRAG_PREFILL_GRAPH_TOKENS (an integer >= 16) when set, else
    PREFILL_GRAPH_TOKENS."""
    return env_count(PREFILL_GRAPH_TOKENS_ENV, PREFILL_GRAPH_TOKENS)


def default_async_prefill(device: torch.device) -> bool:
    """Engine(async_prefill=None): $FASTRAG_ASYNC_PREFILL (0 or 1) when set, else on for CUDA devices and off elsewhere
    (a CPU computes as it launches: there is nothing to overlap). On a GPU it leaves the device less idle in prefill
    steps and in steps with attention passes (the asynchronous-prefill GPU session in benchmarks/results/README.md).

    async_prefill: a step's prefill samples its sequences' first tokens on the device and copies them to the host
    together with the decode step's results, so step_launch never waits for a prefill (the caller's host work then
    runs while the device computes the prefill and the decode step, not only the decode step); the prefilled
    sequences join the decode batch one step later than without it (their first token is on the host only after
    step_finish). Off: the prefill's first tokens are copied to the host inside step_launch and the sequences decode
    in the same step. What a generation computes is the same either way."""
    return bool(env_count(ASYNC_PREFILL_ENV, int(torch.device(device).type == "cuda")))


def default_prefill_hold(device: torch.device) -> int:
    """Engine(prefill_hold=None): $FASTRAG_PREFILL_HOLD when set, else DEFAULT_PREFILL_HOLD on CUDA devices (where a
    prefill call's fixed cost is large) and 0 elsewhere (every step prefills what waits).

    prefill_hold: while sequences decode, a step may leave the waiting prefills (fewer new tokens than one prefill's
    budget) for up to this many steps, so that more arrive and go in one call. On a GPU a prefill call has a large
    fixed cost (bench_prefill.py's GPU tables), and a DRAGIN run's prefills arrive one or two a step: holding gives
    fewer prefill calls and larger decode batches (the prefill-hold GPU session; both listed in
    benchmarks/results/README.md)."""
    return env_count(PREFILL_HOLD_ENV, DEFAULT_PREFILL_HOLD if torch.device(device).type == "cuda" else 0)


def default_mix_prefill() -> bool:
    """Engine(mix_prefill=None): $FASTRAG_MIX_PREFILL (0 or 1), else off.

    mix_prefill: prefill batches of sequences with different shared prefixes (packed forward, each attends to its
    own). Off by default: it did not pay on the CPU, and on a GPU it gained less than the prefill hold
    (benchmarks/results/e2e_cpu.md and the prefill-hold GPU session in benchmarks/results/README.md)."""
    return bool(env_count(MIX_PREFILL_ENV, 0))


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


def track_capacity(n: int) -> int:
    """The columns held for a tracked span of at most n tokens: the next power of two >= n, at least
    TRACK_MIN_CAPACITY. A decode step moves the tracked sequences' maxima to the kernel and back one capacity at a
    time, a fixed number of operations per capacity (`ModelRunner.track`); spans of exact lengths would almost all
    differ (dragin-streaming's continuations carry their earlier text) and cost operations per sequence instead."""
    return max(TRACK_MIN_CAPACITY, 1 << max(int(n) - 1, 0).bit_length())


def auto_kv_cache_gb(model, max_batch: int, max_prefill_tokens: int) -> float:
    """The KV pool's size (GiB) when none is given. CPU: CPU_KV_CACHE_GB. GPU: GPU_MEMORY_FRACTION of the device's
    memory, less what is allocated now (the weights), the largest prefill chunk's activations and a full decode
    batch's logits (both counted in float32, four times over). A fixed pool held only a few questions at once for a
    Llama-2-7B-shaped model on an 80 GB H100, so the pool grows with the device. The 20% left over is room for what
    the sum does not count: CUDA graphs, the allocator's slack, DRAGIN's attention passes; a float32 model has run
    out of memory in its first prefill with 10 GiB left free (cause not found), so give kv_cache_gb where the
    default does not fit."""
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
