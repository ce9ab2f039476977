"""Continuous batching of many questions.

A method writes one question's logic as a plain generator that yields requests (`Generate`, `AttnColmax`,
`AttnRows`, `Search`) and receives their results; the scheduler keeps up to `max_inflight` such generators alive,
gathers their requests, and serves each kind in batches: generations share the engine's decode batch,
attention passes run as one padded forward, retrieval queries go to the retriever together (on a worker thread,
overlapping the decode steps of the other questions).
"""

from __future__ import annotations

import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Generator, Iterable

from fastrag.engine import Engine, SeqState
from fastrag.trace import QuestionResult


@dataclass(slots=True)
class Generate:
    prompt: str
    max_new_tokens: int
    branch: int = 0  # which of the question's KV sequences to reuse: prompts of one family share a branch


@dataclass(slots=True)
class AttnColmax:
    """Last-layer attention each token receives from later tokens (RIND pass). Result: list[float]."""

    ids: list[int]


@dataclass(slots=True)
class AttnRows:
    """Head-mean last-layer attention matrix over ids (QFS pass). Result: tensor [T, T] float64."""

    ids: list[int]


@dataclass(slots=True)
class Search:
    query: str
    k: int


Request = Generate | AttnColmax | AttnRows | Search
Policy = Callable[[object], Generator[Request, object, QuestionResult]]


@dataclass(eq=False)
class _Live:
    example: object
    gen: Generator
    seqs: dict[int, SeqState]  # branch -> KV sequence
    t0: float
    request: Request | None = None


class Scheduler:
    def __init__(self, engine: Engine, retriever, policy: Policy, max_inflight: int = 64):
        self.engine, self.retriever, self.policy = engine, retriever, policy
        self.max_inflight = max_inflight
        self.search_batches: list[int] = []
        self.search_seconds = 0.0

    def run(self, examples: Iterable, on_result: Callable[[QuestionResult], None]) -> None:
        todo = list(examples)[::-1]
        live: dict[int, _Live] = {}
        by_seq: dict[int, _Live] = {}
        pool = ThreadPoolExecutor(max_workers=1)
        search_future: tuple[Future, list[_Live]] | None = None

        def finish(lv: _Live, result: QuestionResult | None, err: str | None = None):
            live.pop(id(lv), None)
            for seq in lv.seqs.values():
                by_seq.pop(id(seq), None)
                if seq in self.engine.waiting:
                    self.engine.waiting.remove(seq)
                if seq in self.engine.running:
                    self.engine.running.remove(seq)
                self.engine.release(seq)
            if result is None:
                ex = lv.example
                result = QuestionResult(qid=ex.qid, question=ex.question, gold=list(ex.answers), error=err)
            result.wall_s = time.perf_counter() - lv.t0
            on_result(result)

        def advance(lv: _Live, value):
            try:
                req = lv.gen.send(value)
            except StopIteration as stop:
                finish(lv, stop.value)
                return
            except Exception as e:  # a per-question failure is recorded; the run goes on
                finish(lv, None, f"{type(e).__name__}: {e}")
                if not isinstance(e, (ValueError, KeyError)):
                    traceback.print_exc()
                return
            lv.request = req
            if isinstance(req, Generate):
                try:
                    ids = self.engine.tok.encode(req.prompt)
                    if req.branch not in lv.seqs:
                        lv.seqs[req.branch] = self.engine.new_sequence()
                        by_seq[id(lv.seqs[req.branch])] = lv
                    self.engine.start(lv.seqs[req.branch], ids, req.max_new_tokens)
                except ValueError as e:
                    lv.gen.close()
                    finish(lv, None, f"ValueError: {e}")

        try:
            while todo or live:
                while todo and len(live) < self.max_inflight:
                    ex = todo.pop()
                    lv = _Live(ex, self.policy(ex), {}, time.perf_counter())
                    live[id(lv)] = lv
                    advance(lv, None)
                progressed = False
                # attention passes: one batched forward per kind
                for kind, cls in (("colmax", AttnColmax), ("rows", AttnRows)):
                    reqs = [lv for lv in list(live.values()) if isinstance(lv.request, cls)]
                    if reqs:
                        res = self.engine.attention_passes([lv.request.ids for lv in reqs], kind)
                        for lv, r in zip(reqs, res):
                            lv.request = None
                            advance(lv, r)
                        progressed = True
                # retrieval: submit a batch if none is in flight; collect a finished one
                if search_future is None:
                    reqs = [lv for lv in live.values() if isinstance(lv.request, Search)]
                    if reqs:
                        searches = [lv.request for lv in reqs]
                        for lv in reqs:
                            lv.request = "searching"
                        search_future = (pool.submit(self._search, searches), reqs)
                if search_future is not None and (search_future[0].done() or not self.engine.has_work):
                    fut, reqs = search_future
                    search_future = None
                    docs = fut.result()
                    for lv, d in zip(reqs, docs):
                        lv.request = None
                        advance(lv, d)
                    progressed = True
                if self.engine.has_work:
                    for seq in self.engine.step():
                        lv = by_seq[id(seq)]
                        lv.request = None
                        advance(lv, seq.out)
                    progressed = True
                if not progressed and live and search_future is None:
                    stuck = [type(lv.request).__name__ for lv in live.values()]
                    raise RuntimeError(f"scheduler made no progress; pending requests: {stuck}")
        finally:
            pool.shutdown(wait=True)

    def _search(self, reqs: list[Search]):
        t = time.perf_counter()
        out = self.retriever.search([r.query for r in reqs], max(r.k for r in reqs))
        out = [docs[: r.k] for docs, r in zip(out, reqs)]
        self.search_seconds += time.perf_counter() - t
        self.search_batches.append(len(reqs))
        return out

