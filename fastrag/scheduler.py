"""Continuous batching of many questions.

A method writes one question's logic as a plain generator that yields requests (`Generate`, `AttnColmax`,
`AttnRows`, `Search`) and receives their results; the scheduler keeps up to `max_inflight` such generators alive,
gathers their requests, and serves each kind in batches: generations share the engine's decode batch,
attention passes run as one padded forward, retrieval queries go to the retriever together (on a worker thread,
overlapping the decode steps of the other questions).

A question that needs several things at once (BeamSearchQA: every node of a beam) yields `Parallel([...])`: each
part is served as if another question had asked for it (a Generate on its own KV sequence, every Search of the
batch in the same retriever call) and the generator resumes once, with the list of all results in order.
"""

from __future__ import annotations

import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterable

from fastrag.engine import Engine, SeqState
from fastrag.trace import QuestionResult


@dataclass(slots=True)
class Generate:
    prompt: str
    max_new_tokens: int
    # which of the question's KV sequences to reuse: prompts of one family share a branch (an int >= 0);
    # None: a fresh sequence for this generation alone, released as soon as it finishes (a prompt nothing later
    # extends, e.g. one carrying retrieved documents, need not hold KV blocks)
    branch: int | None = 0


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


@dataclass(slots=True)
class Parallel:
    """Several requests of one question in flight at once. Result: the list of their results, in order.

    parts: Generate / Search / AttnColmax / AttnRows (no nested Parallel). Generates with an int branch must name
    distinct branches (one sequence cannot run two generations); branch None parts each get a one-shot sequence.
    Every part joins the batches of its kind with the other questions' requests: all Searches of one Parallel go to
    the retriever in one call. An empty Parallel resumes at once with [].
    """

    parts: list


Request = Generate | AttnColmax | AttnRows | Search | Parallel
Policy = Callable[[object], Generator[Request, object, QuestionResult]]


@dataclass(eq=False)
class _Live:
    example: object
    gen: Generator
    seqs: dict[int, SeqState]  # branch -> KV sequence
    t0: float
    request: Request | None = None
    # requests waiting for a batch (attention passes, searches): (part index or None for a lone request, request)
    queued: list = field(default_factory=list)
    results: list | None = None  # results of the current Parallel's parts
    left: int = 0  # parts of the current Parallel still unanswered
    one_shot: dict = field(default_factory=dict)  # id(seq) -> seq of branch-None generations in flight
    generations: int = 0  # Generate requests served (the result's llm_calls when the policy does not count them)


class Scheduler:
    def __init__(self, engine: Engine, retriever, policy: Policy, max_inflight: int = 64):
        self.engine, self.retriever, self.policy = engine, retriever, policy
        self.max_inflight = max_inflight
        self.search_batches: list[int] = []
        self.search_seconds = 0.0

    def run(self, examples: Iterable, on_result: Callable[[QuestionResult], None]) -> None:
        todo = list(examples)[::-1]
        live: dict[int, _Live] = {}
        by_seq: dict[int, tuple[_Live, int | None]] = {}  # id(seq) -> (question, Parallel part index or None)
        pool = ThreadPoolExecutor(max_workers=1)
        search_future: tuple[Future, list] | None = None

        def drop(seq: SeqState):
            by_seq.pop(id(seq), None)
            if seq in self.engine.waiting:
                self.engine.waiting.remove(seq)
            if seq in self.engine.running:
                self.engine.running.remove(seq)
            self.engine.release(seq)

        def finish(lv: _Live, result: QuestionResult | None, err: str | None = None):
            live.pop(id(lv), None)
            for seq in [*lv.seqs.values(), *lv.one_shot.values()]:
                drop(seq)
            lv.one_shot.clear()
            lv.queued.clear()
            if result is None:
                ex = lv.example
                result = QuestionResult(qid=ex.qid, question=ex.question, gold=list(ex.answers), error=err)
            if not result.llm_calls:
                result.llm_calls = lv.generations
            result.wall_s = time.perf_counter() - lv.t0
            on_result(result)

        def deliver(lv: _Live, idx: int | None, value):
            if id(lv) not in live:  # the question already ended (another part of it failed)
                return
            if idx is None:
                lv.request = None
                advance(lv, value)
                return
            lv.results[idx] = value
            lv.left -= 1
            if lv.left == 0:
                results, lv.results, lv.request = lv.results, None, None
                advance(lv, results)

        def dispatch(lv: _Live, idx: int | None, req):
            if isinstance(req, Generate):
                ids = self.engine.tok.encode(req.prompt)
                if req.branch is None:
                    seq = self.engine.new_sequence()
                    lv.one_shot[id(seq)] = seq
                else:
                    if req.branch not in lv.seqs:
                        lv.seqs[req.branch] = self.engine.new_sequence()
                    seq = lv.seqs[req.branch]
                by_seq[id(seq)] = (lv, idx)
                self.engine.start(seq, ids, req.max_new_tokens)
                lv.generations += 1
            elif isinstance(req, (AttnColmax, AttnRows, Search)):
                lv.queued.append((idx, req))
            else:
                raise TypeError(f"unknown request {type(req).__name__}; expected Generate, AttnColmax, AttnRows, "
                                "Search or Parallel")

        def advance(lv: _Live, value):
            while True:
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
                if isinstance(req, Parallel) and not req.parts:
                    value = []
                    continue
                break
            try:
                if isinstance(req, Parallel):
                    _check_parallel(req)
                    lv.results, lv.left = [None] * len(req.parts), len(req.parts)
                    for i, part in enumerate(req.parts):
                        dispatch(lv, i, part)
                else:
                    dispatch(lv, None, req)
            except (ValueError, TypeError) as e:
                lv.gen.close()
                finish(lv, None, f"{type(e).__name__}: {e}")

        def take(cls) -> list[tuple[_Live, int | None, Request]]:
            """Pop every queued request of one kind, over all questions in flight."""
            items = []
            for lv in list(live.values()):
                if any(isinstance(r, cls) for _, r in lv.queued):
                    items += [(lv, i, r) for i, r in lv.queued if isinstance(r, cls)]
                    lv.queued = [(i, r) for i, r in lv.queued if not isinstance(r, cls)]
            return items

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
                    items = take(cls)
                    if items:
                        res = self.engine.attention_passes([r.ids for _, _, r in items], kind)
                        for (lv, i, _), r in zip(items, res):
                            deliver(lv, i, r)
                        progressed = True
                # retrieval: submit a batch if none is in flight; collect a finished one
                if search_future is None:
                    items = take(Search)
                    if items:
                        search_future = (pool.submit(self._search, [r for _, _, r in items]), items)
                if search_future is not None and (search_future[0].done() or not self.engine.has_work):
                    fut, items = search_future
                    search_future = None
                    docs = fut.result()
                    for (lv, i, _), d in zip(items, docs):
                        deliver(lv, i, d)
                    progressed = True
                if self.engine.has_work:
                    for seq in self.engine.step():
                        hit = by_seq.get(id(seq))
                        if hit is None:  # its question ended while it ran
                            continue
                        lv, i = hit
                        if lv.one_shot.pop(id(seq), None) is not None:
                            by_seq.pop(id(seq), None)
                            self.engine.release(seq)  # one-shot: its KV is never reused
                        deliver(lv, i, seq.out)
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



def _check_parallel(req: Parallel) -> None:
    branches = []
    for i, part in enumerate(req.parts):
        if isinstance(part, Parallel):
            raise ValueError(f"Parallel part {i} is itself a Parallel; flatten it")
        if isinstance(part, Generate) and part.branch is not None:
            if isinstance(part.branch, bool) or not isinstance(part.branch, int) or part.branch < 0:
                raise ValueError(f"Parallel part {i}: branch must be an int >= 0 or None, got {part.branch!r}")
            branches.append(part.branch)
    if len(set(branches)) != len(branches):
        dup = sorted({b for b in branches if branches.count(b) > 1})
        raise ValueError(f"Parallel generations share branch(es) {dup}: each needs its own KV sequence "
                         "(distinct branches, or branch=None for a one-shot sequence)")
