"""The engine package: `Engine` (core.py) and the parts it is wired from.

sequence.py: a sequence's state and the handles of launched work; planner.py: what each step runs (`StepPlan`);
runner.py: running a plan on the device; passes.py: the cache-free attention passes; registry.py: the shared
prefixes and the prefix cache; clock.py: device seconds; sizing.py: settings, defaults and sizes.
"""

from fastrag.engine.clock import DeviceClock, compile_log
from fastrag.engine.core import Engine
from fastrag.engine.passes import AttentionPasses
from fastrag.engine.planner import StepPlan, StepPlanner
from fastrag.engine.registry import PrefixRegistry
from fastrag.engine.runner import ModelRunner, build_graphs
from fastrag.engine.sequence import (Generation, PendingPasses, PendingStep, SamplingParams, SeqState,
                                     check_token_ids)
from fastrag.engine.sizing import (ASYNC_PREFILL_ENV, CPU_KV_CACHE_GB, CUDA_GRAPHS_ENV, DEFAULT_PREFILL_HOLD,
                                   GPU_MEMORY_FRACTION, MIX_PREFILL_ENV, PASS_GRAPH_SEQS, PASS_GRAPH_TOKENS,
                                   PASS_GRAPHS_ENV, PREFILL_GRAPH_SEQS, PREFILL_GRAPH_TOKENS, PREFILL_GRAPH_TOKENS_ENV,
                                   PREFILL_GRAPHS_ENV, PREFILL_HOLD_ENV, TRACK_MIN_CAPACITY, as_int, auto_kv_cache_gb,
                                   check_seed, default_async_prefill, default_mix_prefill, default_prefill_hold,
                                   env_count, kv_room_gb, prefill_graph_tokens, sampling_key, track_capacity)

__all__ = [
    "ASYNC_PREFILL_ENV", "AttentionPasses", "CPU_KV_CACHE_GB", "CUDA_GRAPHS_ENV", "DEFAULT_PREFILL_HOLD", "DeviceClock",
    "Engine", "GPU_MEMORY_FRACTION", "Generation", "MIX_PREFILL_ENV", "ModelRunner", "PASS_GRAPHS_ENV",
    "PASS_GRAPH_SEQS", "PASS_GRAPH_TOKENS", "PREFILL_GRAPHS_ENV", "PREFILL_GRAPH_SEQS", "PREFILL_GRAPH_TOKENS",
    "PREFILL_GRAPH_TOKENS_ENV", "PREFILL_HOLD_ENV", "PendingPasses", "PendingStep", "PrefixRegistry", "SamplingParams",
    "SeqState", "StepPlan", "StepPlanner", "TRACK_MIN_CAPACITY", "as_int", "auto_kv_cache_gb", "build_graphs",
    "check_seed", "check_token_ids", "compile_log", "default_async_prefill", "default_mix_prefill",
    "default_prefill_hold", "env_count", "kv_room_gb", "prefill_graph_tokens", "sampling_key", "track_capacity",
]
