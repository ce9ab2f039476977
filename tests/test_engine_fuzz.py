"""The engine core under randomised load, differentially (tests/fuzz/engine_fuzz.py, tests/fuzz/sched_fuzz.py):
each seed's workload (shared prefixes set and dropped mid-run, multi-round questions with continuations, attention
tracking, retrieval-style rebuilds, releases, attention passes) runs on a tight KV pool (kv_waits, evictions,
recompute; random batch size, CUDA-graph emulation, mixed prefill, prefix caching on or off, launch/finish overlap)
and on a large pool at batch 1, and every generation is compared with a full-recompute transformers forward; the
pool's invariants (refcounts, free lists, no sequence lost or duplicated, hit counters) are checked after every step.
A few seeds run here, more under `-m slow`; the scripts take any seed range. Then the problems the fuzz found, each
reduced to its smallest case."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz"))

import engine_fuzz as F  # noqa: E402
from backend_cases import one_thread  # noqa: E402,F401 (autouse)
import sched_fuzz as S  # noqa: E402

from fastrag.engine import Engine  # noqa: E402


def _engine_seed(seed: int) -> None:
    problems, info, tight, _ = F.run_seed(seed, "torch")
    assert tight is not None and problems == [], (seed, problems[:8], info)


@pytest.mark.parametrize("seed", [119, 323, 349, *range(12)])  # 119, 323, 349 drop a prefix an idle sequence holds
def test_engine_differential(seed):
    _engine_seed(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12, 200))
def test_engine_differential_more_seeds(seed):
    _engine_seed(seed)


@pytest.mark.parametrize("seed", range(8))
def test_scheduler_differential(seed):
    problems, info = S.run_seed(seed)
    assert problems == [], (seed, problems[:8], info)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(8, 60))
def test_scheduler_differential_more_seeds(seed):
    problems, info = S.run_seed(seed)
    assert problems == [], (seed, problems[:8], info)


def _engine(blocks: int | None = None) -> Engine:
    _, m, _ = F.models()
    bs = 4
    gb = 0.01
    if blocks is not None:
        per_block = 2 * m.c.num_layers * bs * m.c.num_kv_heads * m.c.head_dim * 4
        gb = (blocks + 0.5) * per_block / 2**30
    return Engine(m, F.IdTok(96, 95), block_size=bs, kv_cache_gb=gb, max_batch=4, cuda_graphs=False)


def _drain(eng: Engine, steps: int = 200) -> None:
    for _ in range(steps):
        if not eng.has_work:
            return
        eng.step()
    raise AssertionError("the engine did not finish its work")


def test_a_dropped_prefix_that_an_idle_sequence_holds_gives_its_blocks_back():
    """A sequence between two generations (its question waits on a retrieval) holds a share of a prefix that is then
    dropped; a new sequence sized to the whole pool (start() no longer counts the dropped prefix as pinned) must get
    those blocks: the idle sequence lets go of its share (it once kept it, and the step raised OutOfBlocks for the
    whole engine)."""
    eng = _engine(blocks=10)
    pre = eng.set_prefix(" ".join(["7"] * 8))  # 2 blocks
    a = eng.new_sequence()
    eng.start(a, [7] * 8 + [1, 2, 3], 2)
    _drain(eng)
    eng.drop_prefix(pre)
    b = eng.new_sequence()
    eng.start(b, list(range(10, 40)), 6)  # 36 tokens: 9 of the 10 blocks
    _drain(eng)
    assert b.out.error is None and (len(b.out.ids) == 6 or b.out.ended_by_eos), b.out
    eng.start(a, [7] * 8 + [1, 2, 3, 4], 2)  # the idle one goes on, its prefix gone: all its tokens its own
    _drain(eng)
    assert a.prefix is None and a.out.error is None and (len(a.out.ids) == 2 or a.out.ended_by_eos), a.out


def test_a_prefix_set_after_a_large_sequence_was_accepted_does_not_fail_the_engine():
    """A sequence accepted when no prefix was held needs the whole pool; a prefix set later (a server's new prompt
    family) is used by a sequence that then idles: the prefix gives its blocks back once nobody runs on it, and the
    large sequence runs (it used to raise OutOfBlocks for the whole engine)."""
    eng = _engine(blocks=10)
    r = eng.new_sequence()
    eng.start(r, [3, 4, 5], 3)
    eng.step()
    s = eng.new_sequence()
    eng.start(s, list(range(10, 44)), 6)  # 40 tokens: the whole pool
    eng.set_prefix("7 7 7 7")
    q = eng.new_sequence()
    eng.start(q, [7, 7, 7, 7, 1, 2], 2)
    _drain(eng)
    for x, n in ((s, 6), (q, 2), (r, 3)):
        assert x.out.error is None and (len(x.out.ids) == n or x.out.ended_by_eos and x.out.ids), x.out


def test_hit_counters_count_each_reused_token_once():
    """own_hit_tokens (the sequence's own cache) and cached_hit_tokens (the prefix cache's blocks that replaced it)
    never count one token twice: with prefilled, they add up to the prompt (a partial own block was counted in
    both)."""
    eng = _engine()
    P = list(range(1, 14))  # 3 full blocks and one token
    x, b = eng.new_sequence(), eng.new_sequence()
    eng.start(x, P, 1)
    eng.start(b, P[:2] + [90], 1)
    _drain(eng)
    before = dict(eng.stats)
    eng.start(b, P, 1)  # 2 tokens in common with its own cache; the prefix cache holds P's 3 blocks
    d = {k: eng.stats[k] - before[k] for k in ("own_hit_tokens", "cached_hit_tokens", "prefix_hit_tokens")}
    assert sum(d.values()) + b.out.prefilled == len(P), (d, b.out.prefilled)
    assert d["own_hit_tokens"] + d["cached_hit_tokens"] == b.table.num_tokens == 12


def test_step_finish_drops_a_sequence_released_after_the_launch():
    """A generation that ends in the launch's prefill (one token) and is released before step_finish is not handed
    back as finished (a decode-batch sequence released the same way never was)."""
    eng = _engine()
    a, b = eng.new_sequence(), eng.new_sequence()
    eng.start(a, [1, 2, 3, 4, 5], 1, track_from=5)
    eng.start(b, [6, 7, 8, 9], 5)
    st = eng.step_launch()
    eng.release(a)
    eng.release(b)
    assert eng.step_finish(st) == []
    assert not eng.has_work
