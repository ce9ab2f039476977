"""The scheduler on CPU with a fake model runner and a fake retriever: batching, errors, in-flight bound."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest

from fastrag.engine import Generation
from fastrag.loop import AttnColmax, Generate, QuestionLoop, Search, SyncEngineBase
from fastrag.retrieval.base import Doc, Retriever
from fastrag.trace import QuestionResult, Round


@dataclass
class Ex:
    qid: str
    question: str
    answers: list = field(default_factory=lambda: ["x"])


class FakeTok:
    def encode(self, s):
        if "TOO LONG" in s:
            return [0] * 10_000
        return [ord(c) % 50 for c in s]


@dataclass
class FakeSeq:
    n: int
    out: Generation | None = None


class FakeEngine(SyncEngineBase):
    """Finishes every started generation after `steps` decode steps; counts batch sizes."""

    def __init__(self, steps=3):
        self.tok = FakeTok()
        self.waiting, self.running = [], []
        self.steps, self.seq_count, self.released = steps, 0, 0
        self.decode_batches, self.attn_batches = [], []
        self._age = {}

    def new_sequence(self):
        self.seq_count += 1
        return FakeSeq(self.seq_count)

    def release(self, s):
        self.released += 1

    def start(self, s, ids, n):
        if len(ids) > 4096:
            raise ValueError("prompt exceeds the model context")
        s.out = Generation(ids=list(range(n)), entropy=[0.0] * n, logprob=[0.0] * n, prompt_tokens=len(ids))
        self.running.append(s)
        self._age[id(s)] = 0

    @property
    def has_work(self):
        return bool(self.running)

    def step(self):
        self.decode_batches.append(len(self.running))
        done = []
        for s in self.running:
            self._age[id(s)] += 1
            if self._age[id(s)] >= self.steps:
                done.append(s)
        self.running = [s for s in self.running if s not in done]
        return done

    def attention_passes(self, seqs, kind):
        self.attn_batches.append(len(seqs))
        return [[1.0] * len(x) for x in seqs]


class FakeRetriever(Retriever):
    def __init__(self):
        self.batches = []

    def search(self, queries, k):
        self.batches.append(len(queries))
        return [[Doc(id=f"{q}-{i}", title="", text="t") for i in range(k)] for q in queries]


def policy(ex):
    """generate -> attention pass -> search -> generate; 'bad' questions raise, 'long' ones overflow the context."""
    if ex.question == "bad":
        raise ValueError("empty question")
    g = yield Generate(("TOO LONG " if ex.question == "long" else "") + ex.question, 4)
    a = yield AttnColmax(g.ids)
    assert len(a) == 4
    docs = yield Search(ex.question, 2)
    g2 = yield Generate("again " + ex.question, 2, branch=1)
    return QuestionResult(qid=ex.qid, question=ex.question, gold=ex.answers, text=str(len(g2.ids)),
                          rounds=[Round(trigger_sentence="s", query=ex.question, doc_ids=[d.id for d in docs])])


def test_all_questions_finish_with_batched_passes_and_searches():
    eng, ret = FakeEngine(), FakeRetriever()
    out = []
    exs = [Ex(str(i), f"q{i}") for i in range(10)]
    QuestionLoop(eng, ret, policy, max_inflight=10).run(exs, out.append)
    assert sorted(r.qid for r in out) == sorted(e.qid for e in exs)
    assert all(r.error is None and r.text == "2" for r in out)
    assert [d for r in out for d in r.rounds[0].doc_ids] and all(len(r.rounds[0].doc_ids) == 2 for r in out)
    assert max(eng.decode_batches) == 10  # all ten generations shared the decode batch
    assert max(ret.batches) > 1 and sum(ret.batches) == 10  # queries went to the retriever together
    assert max(eng.attn_batches) > 1
    assert eng.released == 20  # every sequence's KV (two branches per question) was given back


def test_in_flight_bound_is_respected():
    eng, ret = FakeEngine(), FakeRetriever()
    out = []
    QuestionLoop(eng, ret, policy, max_inflight=3).run([Ex(str(i), f"q{i}") for i in range(7)], out.append)
    assert len(out) == 7 and max(eng.decode_batches) <= 3


def test_per_question_errors_are_recorded_and_others_finish():
    eng, ret = FakeEngine(), FakeRetriever()
    out = []
    exs = [Ex("a", "q1"), Ex("b", "bad"), Ex("c", "long"), Ex("d", "q2")]
    QuestionLoop(eng, ret, policy, max_inflight=4).run(exs, out.append)
    by = {r.qid: r for r in out}
    assert set(by) == {"a", "b", "c", "d"}
    assert "empty question" in by["b"].error
    assert "exceeds the model context" in by["c"].error
    assert by["a"].error is None and by["d"].error is None
    assert eng.released == 2 * 2 + 1  # a, d: two branches; c: one (its first prompt failed); b: none


class SlowRetriever(FakeRetriever):
    """Every call takes `delay` seconds (a search server's round trip); records the most calls in flight at once."""

    def __init__(self, delay=0.03, concurrent=None):
        super().__init__()
        self.delay, self.active, self.peak, self.lock = delay, 0, 0, threading.Lock()
        if concurrent is not None:
            self.concurrent_searches = concurrent

    def search(self, queries, k):
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            time.sleep(self.delay)
            with self.lock:
                return super().search(queries, k)
        finally:
            with self.lock:
                self.active -= 1


def staggered(ex):
    """Questions reach their search after 1-4 generations (so searches are asked for at different steps), then
    generate once more with the documents."""
    for j in range(1 + int(ex.qid) % 4):
        yield Generate(f"{ex.question} round {j}", 2)
    docs = yield Search(ex.question, 2)
    g = yield Generate("with " + ",".join(d.id for d in docs), 2, branch=1)
    return QuestionResult(qid=ex.qid, question=ex.question, gold=ex.answers, text=str(len(g.ids)),
                          rounds=[Round(trigger_sentence="s", query=ex.question, doc_ids=[d.id for d in docs])])


def _docs_by_question(out):
    return {r.qid: (r.error, r.rounds[0].doc_ids if r.rounds else None) for r in out}


def test_retrieval_batches_in_flight_are_bounded_by_search_concurrency():
    """One batch at a time by default: the searches asked for while it runs wait for it and go together. With
    search_concurrency 3 they leave at once, in up to three batches in flight; every question gets the same
    documents either way."""
    exs = [Ex(str(i), f"q{i}") for i in range(16)]
    got = {}
    for n in (1, 3):
        eng, ret = FakeEngine(steps=1), SlowRetriever()
        out = []
        sched = QuestionLoop(eng, ret, staggered, max_inflight=16, search_concurrency=n)
        in_flight, submit = [], sched._submit_search

        def counted():  # batches handed to the search threads and not yet collected (those queued there too)
            submit()
            in_flight.append(len(sched.search.in_flight))

        sched._submit_search = counted
        sched.run(exs, out.append)
        assert len(out) == 16 and all(r.error is None for r in out)
        assert 1 <= max(in_flight) <= n
        assert sum(ret.batches) == 16 and sorted(sched.search_batches) == sorted(ret.batches)
        got[n] = (_docs_by_question(out), ret.peak, len(ret.batches))
    assert got[1][1] == 1 and got[3][1] > 1 and got[3][1] <= 3
    assert got[1][0] == got[3][0]


def test_search_concurrency_defaults_to_what_the_retriever_serves():
    eng = FakeEngine(steps=1)
    assert QuestionLoop(eng, FakeRetriever(), staggered).search_concurrency == 1
    ret = SlowRetriever(concurrent=2)
    sched = QuestionLoop(eng, ret, staggered, max_inflight=16)
    assert sched.search_concurrency == 2
    out = []
    sched.run([Ex(str(i), f"q{i}") for i in range(16)], out.append)
    assert len(out) == 16 and ret.peak == 2
    assert QuestionLoop(eng, ret, staggered, search_concurrency=1).search_concurrency == 1  # the caller's word wins
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="search_concurrency must be an int >= 1"):
            QuestionLoop(eng, FakeRetriever(), staggered, search_concurrency=bad)


def test_a_failing_batch_among_concurrent_ones_ends_only_its_questions():
    class Flaky(SlowRetriever):
        def search(self, queries, k):
            if any(q == "q5" for q in queries) and len(queries) == 1:
                raise ConnectionError("server reset")
            if any(q == "q5" for q in queries):
                raise ConnectionError("batch with q5")
            return super().search(queries, k)

    eng, ret = FakeEngine(steps=1), Flaky()
    out = []
    with pytest.warns(RuntimeWarning, match="retrieval failed for 1 of"):
        QuestionLoop(eng, ret, staggered, max_inflight=16, search_concurrency=3).run(
            [Ex(str(i), f"q{i}") for i in range(12)], out.append)
    by = {r.qid: r for r in out}
    assert len(by) == 12 and "server reset" in by["5"].error
    assert all(r.error is None for q, r in by.items() if q != "5")
