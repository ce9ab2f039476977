"""The engine's prefill hold ($FASTRAG_PREFILL_HOLD / Engine(prefill_hold=...)): while sequences decode, prefills that
arrive in different steps may wait a few steps to go in one call. What a generation computes must not change, the
waits must end (never while nothing decodes, never past the hold, never with a full prefill budget waiting), and
fewer prefill calls must come of it."""

from __future__ import annotations

import random

import pytest
import torch

from fastrag import engine as engine_mod
from fastrag.engine import Engine

from engine_fakes import IntTok as _Tok
from engine_fakes import drive, tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=97, hidden_size=32, intermediate_size=48, num_attention_heads=4)


def _run(model, hold: int, arrivals, max_prefill_tokens: int = 4096, max_batch: int = 16):
    """arrivals: (step, prompt, max_new) - each generation starts before that engine step. Returns the generations'
    (ids, log-probabilities), the engine's stats and, per step, how many sequences waited after it.

    The default batch holds every generation the tests start (at most 9), so a sequence waits only when held: with a
    full batch it would also wait for room, which is no hold (seed 1225157142 at max_batch=8: a generation waited
    one step for room, then was held one step, two steps of waiting under hold=1)."""
    assert len(arrivals) <= max_batch, "a generation could wait for room in the batch, which is no hold"
    eng = Engine(model, _Tok(), kv_cache_gb=0.01, max_batch=max_batch, prefill_hold=hold,
                 max_prefill_tokens=max_prefill_tokens)
    waited = []
    seqs = drive(eng, arrivals, after_step=lambda e: waited.append(len(e.waiting)))
    out = [(s.out.ids, s.out.logprob) for s in seqs]
    return out, dict(eng.stats), waited


def _arrivals(seed: int):
    """A long generation from step 0, then one new generation a step from step 2 to 7 (random prompts and
    budgets), and two more at random steps."""
    r = random.Random(seed)
    arr = [(0, [r.randrange(1, 97) for _ in range(r.randint(5, 30))], 20)]
    arr += [(t, [r.randrange(1, 97) for _ in range(r.randint(3, 40))], r.randint(2, 9)) for t in range(2, 8)]
    arr += [(r.randint(1, 12), [r.randrange(1, 97) for _ in range(r.randint(3, 40))], r.randint(2, 9))
            for _ in range(2)]
    return arr


@pytest.mark.parametrize("hold", [1, 3])
def test_held_prefills_compute_the_same_generations_in_fewer_calls(model, hold):
    seed = random.randrange(2**31)
    arr = _arrivals(seed)
    want, st0, _ = _run(model, 0, arr)
    got, st, waited = _run(model, hold, arr)
    assert [ids for ids, _ in got] == [ids for ids, _ in want], seed
    for (_, la), (_, lb) in zip(got, want):
        torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=1e-4, atol=1e-5)
    assert st0["prefill_holds"] == 0
    assert st["prefill_holds"] > 0, (seed, st)
    assert st["prefill_calls"] < st0["prefill_calls"], (seed, st["prefill_calls"], st0["prefill_calls"])
    assert st["prefill_tokens"] == st0["prefill_tokens"] and st["decode_tokens"] == st0["decode_tokens"]
    # never more than `hold` steps in a row with prefills left waiting
    run = 0
    for w in waited:
        run = run + 1 if w else 0
        assert run <= hold, (seed, waited)


def test_nothing_decoding_means_no_hold(model):
    """A lone generation is prefilled in the first step, whatever the hold."""
    [(ids, _)], st, waited = _run(model, 5, [(0, list(range(1, 20)), 3)])
    assert len(ids) == 3
    assert st["prefill_holds"] == 0 and waited[0] == 0


def test_a_full_prefill_budget_is_not_held(model):
    """What waits reaches one prefill's token budget: it goes at once."""
    arr = [(0, list(range(1, 10)), 10), (1, list(range(20, 60)), 3)]  # 40 new tokens arrive while one decodes
    _, st, waited = _run(model, 4, arr, max_prefill_tokens=32)
    assert st["prefill_holds"] == 0 and not any(waited)
    _, st, _ = _run(model, 4, arr, max_prefill_tokens=64)
    assert st["prefill_holds"] > 0


def test_settings_from_the_environment(model, monkeypatch):
    monkeypatch.setenv(engine_mod.PREFILL_HOLD_ENV, "2")
    monkeypatch.setenv(engine_mod.MIX_PREFILL_ENV, "1")
    eng = Engine(model, _Tok(), kv_cache_gb=0.01)
    assert eng.prefill_hold == 2 and eng.mix_prefill is True
    eng = Engine(model, _Tok(), kv_cache_gb=0.01, prefill_hold=0, mix_prefill=False)  # arguments win
    assert eng.prefill_hold == 0 and eng.mix_prefill is False
    monkeypatch.delenv(engine_mod.PREFILL_HOLD_ENV)
    monkeypatch.delenv(engine_mod.MIX_PREFILL_ENV)
    eng = Engine(model, _Tok(), kv_cache_gb=0.01)
    assert eng.prefill_hold == 0 and eng.mix_prefill is False
    for bad in ("x", "-1", "1.5"):
        monkeypatch.setenv(engine_mod.PREFILL_HOLD_ENV, bad)
        with pytest.raises(ValueError, match=f"FASTRAG_PREFILL_HOLD='{bad}'"):
            Engine(model, _Tok(), kv_cache_gb=0.01)
    monkeypatch.delenv(engine_mod.PREFILL_HOLD_ENV)
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="prefill_hold must be an int >= 0"):
            Engine(model, _Tok(), kv_cache_gb=0.01, prefill_hold=bad)


def test_default_hold_by_device(monkeypatch):
    """Unset: 2 steps on CUDA devices (measured faster on the H200), none elsewhere; the variable wins on both."""
    monkeypatch.delenv(engine_mod.PREFILL_HOLD_ENV, raising=False)
    assert engine_mod.default_prefill_hold(torch.device("cuda")) == engine_mod.DEFAULT_PREFILL_HOLD == 2
    assert engine_mod.default_prefill_hold("cpu") == 0
    monkeypatch.setenv(engine_mod.PREFILL_HOLD_ENV, "0")
    assert engine_mod.default_prefill_hold("cuda") == 0
    monkeypatch.setenv(engine_mod.PREFILL_HOLD_ENV, "5")
    assert engine_mod.default_prefill_hold("cpu") == 5
