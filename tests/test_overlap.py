"""The methods' host logic overlapped with the device's decode step (`Engine.step_launch` / `step_finish`,
`QuestionLoop(overlap=True)`).

With overlap a result reaches its question one scheduler step later and the batches are composed differently, so
what can be compared is what each question decides: its generations, attention passes, searches and answer must
equal the run without overlap. On a GPU (DEV) the launched step really runs while the host works; on a CPU the
same protocol runs synchronously.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from fastrag.engine import Engine
from fastrag.loop import AttnColmax, Generate, Parallel, QuestionLoop, Search, SyncEngineBase
from fastrag.model.llama import LlamaModel
from fastrag.retrieval.base import Doc
from fastrag.trace import QuestionResult, Round

DEV = "cuda" if torch.cuda.is_available() else "cpu"


class Tok:
    eos_token_id = None

    def encode(self, s):
        return [int(x) for x in s.split()]


def _config(**kw):  # (transformers imported lazily, as in test_cuda_graphs)
    from transformers import LlamaConfig

    base = dict(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=2, eos_token_id=None)
    return LlamaConfig(**(base | kw))


@pytest.fixture(scope="module")
def model():
    # batches are composed differently with and without overlap: float64 on the CPU, and on a GPU (float32) an LM head
    # scaled up so that the random model's greedy choices are not near-ties a different batch could flip
    dtype = torch.float64 if DEV == "cpu" else torch.float32
    m = LlamaModel.from_hf_config(_config(), dtype=dtype, seed=3, device=DEV)
    with torch.no_grad():
        m.lm_head.weight.mul_(50)
    return m


def _engine(model, **kw) -> Engine:
    return Engine(model, Tok(), kv_cache_gb=kw.pop("kv_cache_gb", 0.02), max_batch=kw.pop("max_batch", 8), **kw)


class Spy:
    """Wraps an engine: counts the sequences started and released while a launched step was in flight."""

    def __init__(self, eng: Engine):
        self.eng, self.in_flight, self.started_in_flight, self.released_in_flight, self.launches = eng, False, 0, 0, 0
        launch, finish, start, release = eng.step_launch, eng.step_finish, eng.start, eng.release

        def step_launch():
            assert not self.in_flight, "a step was launched while another was in flight"
            st = launch()
            self.in_flight, self.launches = True, self.launches + 1
            return st

        def step_finish(st):
            self.in_flight = False
            return finish(st)

        def start_(*a, **k):
            self.started_in_flight += self.in_flight
            return start(*a, **k)

        def release_(s):
            self.released_in_flight += self.in_flight
            return release(s)

        eng.step_launch, eng.step_finish, eng.start, eng.release = step_launch, step_finish, start_, release_


# ---------------------------------------------------------------------------------------------- engine level


def _prompts(n, rng):
    return [" ".join(str(int(x)) for x in torch.randint(1, 96, (int(rng.integers(3, 30)),))) for _ in range(n)]


def test_launch_then_finish_with_host_work_between_equals_step(model):
    """Sequences started while a step is in flight (the scheduler's overlap) join the next step and generate the
    tokens, entropies and log-probabilities they generate when started between plain steps."""
    import numpy as np

    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    first, later = _prompts(5, rng), _prompts(4, rng)
    lens = [int(x) for x in rng.integers(1, 12, 9)]

    def run(launched: bool):
        eng = _engine(model)
        seqs = [eng.new_sequence() for _ in first + later]
        for s, p, n in zip(seqs, first, lens):
            eng.start(s, Tok().encode(p), n)
        steps = 0
        while eng.has_work or steps < 3:
            if launched:
                st = eng.step_launch()
                if steps == 2:  # host work during the step: new generations queue for the next one
                    for s, p, n in zip(seqs[5:], later, lens[5:]):
                        eng.start(s, Tok().encode(p), n)
                eng.step_finish(st)
            else:
                eng.step()
                if steps == 2:
                    for s, p, n in zip(seqs[5:], later, lens[5:]):
                        eng.start(s, Tok().encode(p), n)
            steps += 1
        return [(s.out.ids, s.out.entropy, s.out.logprob) for s in seqs]

    a, b = run(False), run(True)
    for (ia, ea, la), (ib, eb, lb), n in zip(a, b, lens):
        assert ia == ib and len(ia) == n
        assert ea == pytest.approx(eb, rel=1e-9, abs=1e-12) and la == pytest.approx(lb, rel=1e-9, abs=1e-12)


def test_a_sequence_released_while_its_step_runs_leaves_the_batch(model):
    """A question that ends (cancelled, or another part failed) while its sequence is in a launched step: the
    finished step neither puts it back in the running batch nor reports it finished; the others go on."""
    eng = _engine(model)
    seqs = [eng.new_sequence() for _ in range(3)]
    for s in seqs:
        eng.start(s, [5, 6, 7, 8], 6)
    eng.step()  # prefill: all three decode from here on
    st = eng.step_launch()
    victim = seqs[1]
    eng.running.remove(victim)  # what QuestionLoop._drop does
    eng.release(victim)
    assert eng.step_finish(st) == []
    assert victim not in eng.running and len(eng.running) == 2
    done = []
    while eng.has_work:
        done += eng.step()
    assert set(map(id, done)) == {id(seqs[0]), id(seqs[2])}
    assert all(len(s.out.ids) == 6 for s in (seqs[0], seqs[2]))


# ---------------------------------------------------------------------------------------------- scheduler level


@dataclass
class Ex:
    qid: str
    question: str
    answers: list = field(default_factory=lambda: ["x"])


class Retriever:
    def search(self, queries, k):
        return [[Doc(id=f"{q}/{i}", title="", text=" ".join(str(1 + (len(q) * 7 + i * 13 + j) % 90)
                                                          for j in range(6))) for i in range(k)] for q in queries]


def policy(ex):
    """Rounds of generate -> attention pass -> (data-dependent) search -> generate with the documents, a Parallel
    of two one-shot generations in the middle, so that every kind of result travels through the overlap."""
    text = ex.question
    res = QuestionResult(qid=ex.qid, question=ex.question, gold=ex.answers)
    for rnd in range(3):
        g = yield Generate(text, 3 + (int(ex.qid) + rnd) % 5)
        a = (yield AttnColmax(g.ids)) if g.ids else []
        text += " " + " ".join(map(str, g.ids))
        assert len(a) == len(g.ids)
        if a and (sum(g.ids) + (max(a) > 2 * min(a))) % 3:  # "uncertain" (from the tokens and the attention)
            docs = yield Search(" ".join(map(str, g.ids[:2])), 2)
            res.rounds.append(Round(trigger_sentence=str(rnd), query=str(g.ids[:2]), doc_ids=[d.id for d in docs]))
            g2 = yield Generate(docs[0].text + " " + text, 4, branch=1)
            text += " " + " ".join(map(str, g2.ids))
        else:
            res.rounds.append(Round())
        if rnd == 1:
            p = yield Parallel([Generate(text + " 11", 2, branch=None), Generate(text + " 12", 3, branch=None)])
            text += " " + " ".join(str(x) for g in p for x in g.ids)
    res.text = res.prediction = text
    return res


def _schedule(model, overlap: bool, n: int = 9, **kw):
    eng = _engine(model, max_batch=4, **kw)
    eng.set_prefix(" ".join(str(x) for x in range(40, 72)))  # two whole blocks shared by every prompt
    spy = Spy(eng) if overlap else None
    out = []
    # the questions start with the shared prefix so that their decode steps take the prefix path too
    exs = [Ex(str(i), " ".join(str(x) for x in range(40, 72)) + f" {1 + i} {2 + 3 * i} {5 + i % 7}") for i in range(n)]
    QuestionLoop(eng, Retriever(), policy, max_inflight=6, overlap=overlap).run(exs, out.append)
    return {r.qid: r for r in out}, eng, spy


@pytest.mark.parametrize("async_prefill", [False, True])
def test_every_question_decides_the_same_with_overlap(model, async_prefill):
    plain, eng0, _ = _schedule(model, overlap=False)
    over, eng1, spy = _schedule(model, overlap=True, async_prefill=async_prefill)
    assert set(plain) == set(over) and len(plain) == 9
    for q in plain:
        a, b = plain[q], over[q]
        assert a.error is None and b.error is None, (a.error, b.error)
        assert a.prediction == b.prediction
        assert [(r.query, r.doc_ids) for r in a.rounds] == [(r.query, r.doc_ids) for r in b.rounds]
    assert any(r.query for x in plain.values() for r in x.rounds)  # some questions retrieved
    assert any(r.query is None for x in plain.values() for r in x.rounds)  # and some did not
    # the host work really ran while steps were in flight: generations started, one-shot sequences released
    assert spy.started_in_flight > 0 and spy.released_in_flight > 0
    assert eng1.stats["decode_tokens"] == eng0.stats["decode_tokens"]
    assert not eng1.live and not eng1.running and not eng1.waiting  # every sequence was given back


@pytest.mark.parametrize("async_prefill", [False, True])
def test_overlap_under_kv_pressure_waits_and_evicts_but_decides_the_same(model, async_prefill):
    """A pool too small for the batch: admissions wait and idle caches are evicted, with overlap as without (and
    with the asynchronous prefill, whose sequences join the batch a step later)."""
    c = model.c
    per_block = 2 * c.num_layers * 16 * c.num_kv_heads * c.head_dim * next(model.parameters()).element_size()
    gb = 16 * per_block / 2**30  # 16 blocks: the prefix's 2, and room for about two questions' sequences
    plain, _, _ = _schedule(model, overlap=False, kv_cache_gb=gb)
    over, eng, _ = _schedule(model, overlap=True, kv_cache_gb=gb, async_prefill=async_prefill)
    assert eng.pool.num_blocks == 16
    assert eng.stats["kv_waits"] > 0 and eng.stats["evictions"] > 0
    assert {q: r.prediction for q, r in plain.items()} == {q: r.prediction for q, r in over.items()}
    assert all(r.error is None for r in over.values())


def test_overlap_is_on_by_default_only_on_a_gpu(model):
    eng = _engine(model)
    assert QuestionLoop(eng, Retriever(), policy).overlap == (DEV == "cuda")
    assert QuestionLoop(eng, Retriever(), policy, overlap=True).overlap

    class StepOnly(SyncEngineBase):  # an engine with step() alone cannot overlap: said at construction, not mid-run
        device = torch.device("cpu")

        def step(self):
            return []

    with pytest.raises(ValueError, match="step_launch"):
        QuestionLoop(StepOnly(), Retriever(), policy, overlap=True)
    assert QuestionLoop(StepOnly(), Retriever(), policy).overlap is False
