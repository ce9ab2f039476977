"""The engine's contract between planning and running: `planner.plan()` returns a `StepPlan` (what the step prefills,
which sequences join the decode batch without a prefill, whether the prefills were held), and launching that plan
computes exactly what `Engine.step` computes."""

from __future__ import annotations

import random

import pytest

from fastrag.engine import Engine, StepPlan

from engine_fakes import IntTok, drive, tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=97, hidden_size=32, intermediate_size=48, num_attention_heads=4)


def _arrivals(seed: int):
    """(step, prompt, max_new): three generations at once, then one a step for a few steps."""
    r = random.Random(seed)
    arr = [(0, [r.randrange(1, 97) for _ in range(r.randint(4, 30))], r.randint(3, 12)) for _ in range(3)]
    arr += [(t, [r.randrange(1, 97) for _ in range(r.randint(3, 30))], r.randint(2, 9)) for t in range(1, 5)]
    return arr


def _run(model, arrivals, planned: bool, **kw):
    """Step an engine to the end; planned: each step as planner.plan() then step_launch(plan) / step_finish, keeping
    the plans. Returns the generations' tokens and log-probabilities, the engine's counters and the plans."""
    eng = Engine(model, IntTok(), kv_cache_gb=0.01, max_batch=4, max_prefill_tokens=48, **kw)
    plans = []

    def by_plan(e):
        plan = e.planner.plan()
        plans.append(plan)
        e.step_finish(e.step_launch(plan))

    seqs = drive(eng, arrivals, max_steps=200, step_fn=by_plan if planned else None)
    return [(s.out.ids, s.out.logprob) for s in seqs], dict(eng.stats), plans


@pytest.mark.parametrize("async_prefill", [False, True], ids=["sync-prefill", "async-prefill"])
def test_a_launched_plan_computes_what_step_computes(model, async_prefill):
    seed = random.randrange(2**31)
    arr = _arrivals(seed)
    want, st0, _ = _run(model, arr, False, async_prefill=async_prefill)
    got, st, plans = _run(model, arr, True, async_prefill=async_prefill)
    assert got == want, seed
    for key in ("prefill_tokens", "decode_tokens", "prefill_calls", "decode_steps", "kv_waits", "prefill_holds"):
        assert st[key] == st0[key], (seed, key)
    assert plans and all(isinstance(p, StepPlan) for p in plans)
    # the first plan prefills what fits the batch and the token budget, one sequence once
    first = plans[0]
    assert first.prefill and not first.held
    assert sum(len(ids) for _, ids in first.prefill) <= 48 or len(first.prefill) == 1
    assert len({id(s) for s in first.group}) == len(first.prefill) <= 4
    # every plan's decode batch was set at its launch, within the batch
    assert all(len(p.decode) <= 4 for p in plans) and any(p.decode for p in plans)


def test_a_plan_is_made_before_any_forward(model):
    """Planning reserves blocks and moves sequences between the queues, but runs no forward."""
    eng = Engine(model, IntTok(), kv_cache_gb=0.01, max_batch=4, max_prefill_tokens=4096, async_prefill=False)
    seqs = [eng.new_sequence() for _ in range(2)]
    for s, n in zip(seqs, (7, 11)):
        eng.start(s, list(range(1, n + 1)), 3)
    plan = eng.planner.plan()
    assert isinstance(plan, StepPlan) and eng.stats["prefill_calls"] == 0
    assert [id(s) for s in plan.group] == [id(s) for s in seqs]  # (shortest first)
    assert [ids for _, ids in plan.prefill] == [list(range(1, 8)), list(range(1, 12))]
    assert not eng.waiting and not plan.decode
    finished = eng.step_finish(eng.step_launch(plan))
    assert not finished and eng.stats["prefill_calls"] == 1
    assert [id(s) for s in plan.decode] == [id(s) for s in seqs]  # (sync prefill: they decode in the same step)
