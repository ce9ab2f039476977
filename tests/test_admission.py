"""Admission control of `AsyncEngine` (`fastrag serve`'s 429s): the Retry-After a full queue gives is the time the
questions pending now take to drain at the recent service rate, so a client that obeys it is let in when the queue
has drained, neither long after (answers / uptime counted the idle hours: 218 s for a queue that drained in 7 s)
nor long before. A tiny random model keeps a question to a fraction of a second."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from fastrag.retrieval.base import Retriever
from fastrag.serving import AsyncEngine, QueueFull
from fastrag.serving.async_engine import ServiceRate


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_the_service_rate_leaves_out_idle_time_and_forgets_old_answers():
    clock = Clock()
    r = ServiceRate(window_s=60.0, clock=clock)
    assert r.per_s() is None  # nothing answered yet
    r.started()
    for i in range(4):  # 4 answers in 2 s of work
        clock.t += 0.5
        r.finished(idle=i == 3)
    assert r.per_s() == pytest.approx(2.0)
    clock.t += 3600  # an idle hour changes nothing
    assert r.per_s() == pytest.approx(2.0)
    r.started()
    clock.t += 1.0  # a second of work without an answer: 4 answers over 3 s of work
    assert r.per_s() == pytest.approx(4 / 3)
    for _ in range(30):  # then a slow load: one answer every 10 s; after a window, only its answers count
        clock.t += 10.0
        r.finished(idle=False)
    assert r.per_s() == pytest.approx(6 / 60)


class NoDocs(Retriever):
    def search(self, queries, k):
        return [[] for _ in queries]


@pytest.fixture(scope="module")
def engine_parts(tiny_model):
    from fastrag.eval import build_engine

    return build_engine(tiny_model, 2, kv_cache_gb=0.05, device="cpu"), NoDocs()


CFG = {"fewshot": 0, "generate_max_length": 120}  # (a few ms a token: about half a second a question)


async def _answer(stream) -> tuple[str, float]:
    """The stream's last event kind, and when it came."""
    kind = [ev async for ev in stream][-1].kind
    return kind, time.perf_counter()


def test_a_client_that_obeys_retry_after_is_let_in_once_the_queue_has_drained(engine_parts):
    """A burst, an idle spell, a second burst that fills the queue: the rejected client is told about the second
    burst's drain time (at the first burst's rate), not the idle spell's length; obeying it, it is let in soon
    after the burst's questions have been answered."""
    idle_s = 5.0

    async def go():
        engine = AsyncEngine(*engine_parts, max_inflight=2, max_queue=2)
        try:
            async def burst():
                streams = [await engine.submit(f"question number {i}", "wo-rag", "nq", CFG) for i in range(4)]
                return asyncio.gather(*map(_answer, streams))

            t = time.perf_counter()
            answers = await (await burst())
            assert [k for k, _ in answers] == ["answer"] * 4
            first_drain = max(at for _, at in answers) - t
            await asyncio.sleep(idle_s)  # the server idles: no question pending
            answers = await burst()
            told = []
            for _ in range(10):  # the client obeys Retry-After (a bounded number of times)
                try:
                    late = await engine.submit("one too many", "wo-rag", "nq", CFG)
                    break
                except QueueFull as e:
                    told.append(e.retry_after_s)
                    await asyncio.sleep(e.retry_after_s)
            let_in = time.perf_counter()
            answers = await answers
            assert [k for k, _ in answers] == ["answer"] * 4
            drained = max(at for _, at in answers)
            return first_drain, told, let_in - drained, (await _answer(late))[0], engine.metrics()
        finally:
            engine.close()

    first_drain, told, after_drain, late, m = asyncio.run(go())
    assert late == "answer" and m["finished"] == 9 and m["rejected"] == len(told) >= 1, m
    # let in within a second or two of the queue's drain (answers / uptime told it the idle spell's length too, and
    # it came back seconds after the queue had drained)
    assert after_drain < 2.0 and told[0] < idle_s, (told, after_drain, first_drain)


def test_retry_after_is_capped():
    clock = Clock()
    r = ServiceRate(clock=clock)
    r.started()
    clock.t += 100.0
    r.finished(idle=False)  # one answer in 100 s: a thousand pending would take a day
    engine = AsyncEngine.__new__(AsyncEngine)
    engine._rate, engine._pending = r, 1000
    assert engine._eta() == AsyncEngine.RETRY_AFTER_MAX_S
