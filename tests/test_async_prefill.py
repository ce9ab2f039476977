"""The engine's asynchronous prefill ($FASTRAG_ASYNC_PREFILL / Engine(async_prefill=...)): a step's prefill samples the
first tokens of its sequences on the device and hands them over in step_finish, so step_launch waits for nothing;
the prefilled sequences decode from the next step on. What a generation computes must not change, a generation that
ends at its first token must still end with the step that prefilled it, and a sequence released while its first
token is on its way must leave no trace."""

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


def _engine(model, async_prefill: bool, **kw) -> Engine:
    # (prefill_hold=0: every step prefills what waits, whatever $FASTRAG_PREFILL_HOLD says; the steps counted here
    # assume it)
    return Engine(model, _Tok(), kv_cache_gb=0.01, async_prefill=async_prefill,
                  **({"max_batch": 16, "prefill_hold": 0} | kw))


def _run(model, async_prefill: bool, arrivals, **kw):
    """arrivals: (step, prompt, max_new), each started before that engine step. Returns the generations' (ids,
    log-probabilities) and the engine's stats."""
    eng = _engine(model, async_prefill, **kw)
    seqs = drive(eng, arrivals)
    assert not eng.running and not eng.waiting
    return [(s.out.ids, s.out.logprob) for s in seqs], dict(eng.stats)


def _arrivals(r: random.Random, n: int = 10):
    return [(r.randint(0, 10), [r.randrange(1, 97) for _ in range(r.randint(3, 40))], r.randint(1, 12))
            for _ in range(n)]


@pytest.mark.parametrize("hold", [0, 2])
@pytest.mark.parametrize("max_batch", [3, 16])
def test_the_same_generations_as_a_synchronous_prefill(model, hold, max_batch):
    seed = random.randrange(2**31)
    arr = _arrivals(random.Random(seed))
    want, st0 = _run(model, False, arr, max_batch=max_batch, prefill_hold=hold)
    got, st = _run(model, True, arr, max_batch=max_batch, prefill_hold=hold)
    assert [ids for ids, _ in got] == [ids for ids, _ in want], seed
    for (_, la), (_, lb) in zip(got, want):
        torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=1e-4, atol=1e-5)
    assert st["prefill_tokens"] == st0["prefill_tokens"] and st["decode_tokens"] == st0["decode_tokens"], seed


def _step_with_a_prefill(model, async_prefill: bool, new_max: int = 5):
    """One sequence decoding, then a second one started: the step that prefills it, launched (not finished)."""
    eng = _engine(model, async_prefill)
    a, b = eng.new_sequence(), eng.new_sequence()
    eng.start(a, [5, 6, 7, 8, 9], 10)
    eng.step()  # a prefilled (and, without async_prefill, one decode step)
    eng.step()
    eng.start(b, [11, 12, 13, 14], new_max)
    return eng, a, b, eng.step_launch()


def test_prefilled_sequences_decode_from_the_next_step(model):
    eng, a, b, st = _step_with_a_prefill(model, True)
    assert st.batch == [a] and st.joining == [b] and not b.out.ids  # b's first token is still on the device
    assert b in eng.running  # (it holds its place: a start on it now is refused)
    with pytest.raises(ValueError, match="queued or running"):
        eng.start(b, [1, 2], 3)
    assert eng.step_finish(st) == []
    assert len(b.out.ids) == 1 and b.tokens[-1] == b.out.ids[0]
    st = eng.step_launch()
    assert st.batch == [a, b] and not st.joining
    eng.step_finish(st)
    assert len(b.out.ids) == 2
    # without it, the prefilled sequence decodes in the step that prefilled it
    eng, a, b, st = _step_with_a_prefill(model, False)
    assert st.batch == [a, b] and not st.joining and len(b.out.ids) == 1
    eng.step_finish(st)
    assert len(b.out.ids) == 2


def test_a_one_token_generation_ends_with_the_step_that_prefilled_it(model):
    eng, a, b, st = _step_with_a_prefill(model, True, new_max=1)
    assert st.joining == [b]
    assert eng.step_finish(st) == [b]
    assert len(b.out.ids) == 1 and b not in eng.running and a in eng.running


def test_a_first_token_that_is_eos_ends_the_generation(model):
    _, _, b, _ = _step_with_a_prefill(model, False, new_max=4)  # b's first token, prefilled synchronously
    first = b.out.ids[0]
    eng = _engine(model, True)
    eng.eos_ids = {first}
    s = eng.new_sequence()
    eng.start(s, [11, 12, 13, 14], 4)
    st = eng.step_launch()
    assert st.joining == [s] and not st.batch  # nothing else decodes: the step is the prefill alone
    assert eng.step_finish(st) == [s]
    assert s.out.ended_by_eos and s.out.ids == [] and not eng.has_work


def test_a_sequence_released_while_its_first_token_is_in_flight(model):
    eng, a, b, st = _step_with_a_prefill(model, True)
    free = eng.pool.num_free
    eng.release(b)
    assert eng.pool.num_free > free  # (its blocks back at once: stream order keeps them safe on a GPU)
    assert eng.step_finish(st) == [] and b not in eng.running and id(b) not in eng.live
    while eng.has_work:
        eng.step()
    assert len(a.out.ids) == 10


def test_launch_and_done_without_a_decode_batch(model):
    """A step that only prefills (nothing decoding) reports done once its first tokens are on the host."""
    eng = _engine(model, True)
    s = eng.new_sequence()
    eng.start(s, [3, 4, 5], 3)
    st = eng.step_launch()
    assert not st.batch and st.joining == [s]
    assert Engine.step_done(st)  # (a CPU computes as it launches)
    eng.step_finish(st)
    assert len(s.out.ids) == 1
    while eng.has_work:
        eng.step()
    assert len(s.out.ids) == 3


def test_settings_from_the_environment(model, monkeypatch):
    monkeypatch.setenv(engine_mod.ASYNC_PREFILL_ENV, "1")
    assert _engine(model, None).async_prefill is True
    assert _engine(model, False).async_prefill is False  # (an explicit value wins)
    monkeypatch.setenv(engine_mod.ASYNC_PREFILL_ENV, "0")
    assert _engine(model, None).async_prefill is False
    monkeypatch.delenv(engine_mod.ASYNC_PREFILL_ENV)
    # the default: on for CUDA devices (less device idle on the H200), off on a CPU
    eng = _engine(model, None)
    assert eng.async_prefill is (eng.device.type == "cuda")
    assert engine_mod.default_async_prefill(torch.device("cuda")) is True
    assert engine_mod.default_async_prefill(torch.device("cpu")) is False
    monkeypatch.setenv(engine_mod.ASYNC_PREFILL_ENV, "0")
    assert engine_mod.default_async_prefill(torch.device("cuda")) is False
    monkeypatch.setenv(engine_mod.ASYNC_PREFILL_ENV, "1")
    assert engine_mod.default_async_prefill(torch.device("cpu")) is True
    for bad in ("2", "yes"):
        monkeypatch.setenv(engine_mod.ASYNC_PREFILL_ENV, bad)
        with pytest.raises(ValueError, match=engine_mod.ASYNC_PREFILL_ENV):
            _engine(model, None)
    monkeypatch.delenv(engine_mod.ASYNC_PREFILL_ENV)
    with pytest.raises(ValueError, match="async_prefill must be a bool"):
        _engine(model, 1)
