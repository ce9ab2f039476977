"""fastrag embedded in a user's own code: one engine shared by several runs, user retrievers that misbehave, and an
AsyncEngine whose clients' event loops come and go. The engine must come out of every failure with its whole KV
pool and no sequence left behind, and a failure must stay with the question it belongs to."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time

import pytest
import torch

from fastrag.eval import BUNDLED, RunOptions, build_engine, read_results, run
from fastrag.retrieval.base import Doc, Retriever

CORPUS = BUNDLED / "wiki_passages.jsonl"
QUESTIONS = [f"who wrote book number {i}?" for i in range(6)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    sys.path.insert(0, str(BUNDLED.parents[2] / "benchmarks"))
    from make_random_model import make

    return make("tiny", tmp_path_factory.mktemp("tiny"), dtype=torch.float32, device="cpu")


class Passages(Retriever):
    """k passages per query; `bad(query)` may replace a query's list (or raise) to play a broken retriever."""

    def __init__(self, bad=None):
        self.bad, self.calls = bad, 0

    def search(self, queries, k):
        self.calls += 1
        out = []
        for q in queries:
            got = self.bad(q, self.calls) if self.bad else None
            out.append(got if got is not None else [Doc(f"d{j}", f"T{j}", f"passage {j} on {q[:16]}")
                                                    for j in range(k)])
        return out


@pytest.fixture
def go(tiny, tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"generate_max_length": 4, "fewshot": 0}))
    data = tmp_path / "nq.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": [f"a{i}"]}) + "\n" for i, q in enumerate(QUESTIONS)))
    engine = build_engine(tiny, 4, kv_cache_gb=0.05, device="cpu")

    def go(out, retriever, method="sr-rag", **kw):
        opts = dict(method=method, dataset="nq", data=str(data), corpus=str(CORPUS), output=str(tmp_path / out),
                    model=tiny, config=str(cfg), batch_size=4, progress=False) | kw
        return run(RunOptions(**opts), engine=engine, retriever=retriever)

    go.engine, go.tmp = engine, tmp_path
    return go


def _held(engine) -> tuple[int, int, int, int]:
    return engine.pool.num_free, len(engine.live), len(engine.running), len(engine.waiting)


def test_an_interrupted_run_leaves_the_shared_engine_as_it_found_it(go):
    """Ctrl-C (or any exception: here the caller's on_result raises at the first answer) in the middle of a run:
    every question in flight is cancelled, so the engine shared with later runs keeps its whole pool and no
    sequence of the dead run decodes in theirs; the next run's answers equal those of an uninterrupted one."""
    from fastrag.data.datasets import load_examples
    from fastrag.eval import make_policy, method_config
    from fastrag.loop import QuestionLoop

    clean = go("clean", Passages())
    held = _held(go.engine)
    assert held[1:] == (0, 0, 0)
    opts = RunOptions(method="sr-rag", dataset="nq", data=str(go.tmp / "nq.jsonl"), corpus=str(CORPUS),
                      output=str(go.tmp / "unused"), config=str(go.tmp / "c.json"))
    policy = make_policy("sr-rag", method_config(opts), go.engine.tok)
    go.engine.set_prefix(policy.shared_prefix)
    examples = load_examples("nq", opts.data)

    def stop(result):
        raise KeyboardInterrupt
    for _ in range(2):
        sched = QuestionLoop(go.engine, Passages(), policy, max_inflight=8)
        with pytest.raises(KeyboardInterrupt):
            sched.run(examples, stop)
        assert not sched.busy
        assert _held(go.engine) == held
    again = go("again", Passages())
    assert _held(go.engine) == held
    assert again["em"] == clean["em"]
    answers = {r.qid: r.text for r in read_results(go.tmp / "clean" / "results.jsonl")}
    assert {r.qid: r.text for r in read_results(go.tmp / "again" / "results.jsonl")} == answers


@pytest.mark.parametrize("bad, says", [
    (lambda q, c: ["not a doc"] * 3, r"document 0 is a str with no str id, title, text"),
    (lambda q, c: [Doc("d", "T", None)], r"document 0 is a Doc with no str text"),
    (lambda q, c: "a string", r"returned a str, not a list of documents"),
    (lambda q, c: (x for x in ()), r"returned a generator, not a list of documents"),
])
def test_a_retriever_answer_that_is_no_list_of_docs_fails_its_question_only(go, bad, says):
    """A user retriever that returns something other than Doc lists for one query: that question ends with an
    error naming what came back; the others are answered; the engine keeps its pool."""
    go("warm", Passages())
    held = _held(go.engine)

    def one_bad(q, calls):
        return bad(q, calls) if "number 1?" in q else None
    with pytest.warns(RuntimeWarning, match="retrieval failed for 1 of"):
        m = go("o", Passages(one_bad))
    recs = {r.qid: r for r in read_results(go.tmp / "o" / "results.jsonl")}
    assert m["errors"] == 1 and recs["nq-1"].error is not None
    assert re.search(says, recs["nq-1"].error), recs["nq-1"].error
    assert all(r.error is None for q, r in recs.items() if q != "nq-1")
    assert _held(go.engine) == held


def test_a_retriever_that_returns_too_few_lists_is_named(go):
    class Short(Retriever):
        def search(self, queries, k):
            return []
    with pytest.warns(RuntimeWarning):
        m = go("o", Short(), limit=2)
    recs = read_results(go.tmp / "o" / "results.jsonl")
    assert m["errors"] == 2
    assert all("the retriever returned 0 result lists for 1 query" in r.error for r in recs), recs[0].error


def test_engine_refuses_token_ids_outside_the_vocabulary_and_a_prefix_longer_than_the_context(go):
    eng = go.engine
    V = eng.model.c.vocab_size
    s = eng.new_sequence()
    with pytest.raises(ValueError, match=rf"prompt_ids holds token id {V}, outside the model's vocabulary \[0, {V}\)"):
        eng.start(s, [1, 2, V], 4)
    with pytest.raises(ValueError, match="token id -1"):
        eng.start(s, [-1, 2], 4)
    with pytest.raises(ValueError, match="token id 2.0"):
        eng.start(s, [1, 2.0], 4)
    assert not eng.waiting and not eng.running
    np = pytest.importorskip("numpy")
    eng.start(s, list(np.array([1, 2, 3])), 2)  # numpy ints are ids like any others
    while eng.has_work:
        eng.step()
    eng.release(s)
    with pytest.raises(ValueError, match="empty token sequence"):
        eng.attention_passes([[]], "colmax")
    with pytest.raises(ValueError, match="leaves no room in the model context"):
        eng.set_prefix("word " * (eng.max_context + 8))


def test_async_engine_survives_a_client_loop_that_closed(go):
    """A client leaves its stream and its event loop closes before the worker hears of it (asyncio.run per
    request): the worker's next event for that stream has nowhere to go. That question is cancelled; the worker
    serves the next client, from another loop."""
    from fastrag.serving.async_engine import AsyncEngine

    ae = AsyncEngine(go.engine, Passages())
    cfg = {"generate_max_length": 4, "fewshot": 0}
    try:
        async def leave():
            async for _ in await ae.submit("who wrote book number 1?", method="sr-rag", dataset="nq", config=cfg):
                break
        asyncio.run(leave())
        time.sleep(0.5)
        assert ae.alive

        async def ask():
            kinds = [ev.kind async for ev in await ae.submit("who wrote book number 2?", method="sr-rag",
                                                            dataset="nq", config=cfg)]
            return kinds
        kinds = asyncio.run(asyncio.wait_for(ask(), 120))
        assert kinds[-1] == "answer"
        deadline = time.time() + 10
        while ae.loop.busy and time.time() < deadline:
            time.sleep(0.05)
        assert not go.engine.running and not go.engine.waiting
    finally:
        ae.close()


def test_async_engine_cancels_a_stream_dropped_unread(go):
    """A caller that submits and lets the returned stream go without reading it (an error of its own between
    submit and the first read, say): the question is cancelled, as one whose reader breaks away, instead of running
    to its end for nobody. aclose() on a stream never read cancels too."""
    import gc

    from fastrag.serving.async_engine import AsyncEngine

    ae = AsyncEngine(go.engine, Passages())
    cfg = {"generate_max_length": 64, "fewshot": 0}
    try:
        async def drop():
            stream = await ae.submit("who wrote book number 3?", method="sr-rag", dataset="nq", config=cfg)
            del stream
            gc.collect()
            closed = await ae.submit("who wrote book number 4?", method="sr-rag", dataset="nq", config=cfg)
            await closed.aclose()
            assert [ev async for ev in closed] == []  # (a closed stream ends at once)
            # (the loop stays open meanwhile: a closed loop would end the questions by another path)
            deadline = time.time() + 60
            while (ae.stats["cancelled"] + ae.stats["finished"] < 2 or ae.loop.busy) and time.time() < deadline:
                await asyncio.sleep(0.02)
            return dict(ae.stats)
        stats = asyncio.run(drop())
        assert stats["cancelled"] == 2 and stats["finished"] == 0
        assert not go.engine.running and not go.engine.waiting and not go.engine.live
    finally:
        ae.close()


@pytest.mark.parametrize("concurrency", [1, 2])
def test_async_engine_a_slow_search_holds_back_later_ones_only_with_one_batch_in_flight(go, concurrency):
    """A search server's slow call (2 s here) for one question: with two retrieval batches in flight, a question
    asked after it gets its documents and its answer at once; with one, it waits behind the slow batch."""
    from fastrag.serving.async_engine import AsyncEngine

    slow_s = 2.0

    class SlowTail(Passages):
        concurrent_searches = 8  # (the loop's search_concurrency below decides)

        def search(self, queries, k):
            if any("number 1?" in q for q in queries):
                time.sleep(slow_s)
            return super().search(queries, k)

    cfg = {"generate_max_length": 4, "fewshot": 0}
    ae = AsyncEngine(go.engine, SlowTail(), search_concurrency=concurrency)
    assert ae.loop.search_concurrency == concurrency
    try:
        async def both():
            searched = asyncio.Event()

            async def ask(q):
                t = time.perf_counter()
                async for ev in await ae.submit(q, method="sr-rag", dataset="nq", config=cfg):
                    if ev.kind == "search":
                        searched.set()
                    last = ev.kind
                return last, time.perf_counter() - t

            slow = asyncio.create_task(ask("who wrote book number 1?"))
            await asyncio.wait_for(searched.wait(), 60)  # its batch has left
            fast = await asyncio.wait_for(ask("who wrote book number 2?"), 60)
            return await slow, fast
        (kind1, _), (kind2, t2) = asyncio.run(both())
    finally:
        ae.close()
    assert kind1 == kind2 == "answer"
    if concurrency == 1:
        assert t2 > slow_s / 2
    else:
        assert t2 < slow_s / 2


def test_async_engine_submit_after_its_worker_died_is_an_error(go):
    from fastrag.serving.async_engine import AsyncEngine

    ae = AsyncEngine(go.engine, Passages())
    ae.close()
    ae._closed = False  # a worker that stopped on its own (not closed by the user)
    with pytest.raises(RuntimeError, match="worker thread has stopped"):
        asyncio.run(ae.submit("q?", method="sr-rag", dataset="nq", config={"generate_max_length": 4, "fewshot": 0}))


def test_a_run_that_fails_before_its_first_record_leaves_no_empty_results_file(go):
    """A run whose every question is still in flight when it dies has written an empty results.jsonl: the folder
    it made goes, as that of a run refused before it started."""
    with pytest.raises(KeyboardInterrupt):
        go("new/o", Passages(lambda q, c: (_ for _ in ()).throw(KeyboardInterrupt)))
    assert not (go.tmp / "new").exists()

