"""Continuous batching of many questions.

A method writes one question's logic as a plain generator that yields requests (`Generate`, `AttnColmax`,
`AttnRows`, `Search`) and receives their results; the scheduler keeps up to `max_inflight` such generators alive,
gathers their requests, and serves each kind in batches: generations share the engine's decode batch,
attention passes run as one padded forward, retrieval queries go to the retriever together (on a worker thread,
overlapping the decode steps of the other questions; up to `search_concurrency` such batches at once, each with the
queries known when it left, so that one slow search does not hold back the retrievals asked for after it).

A question that needs several things at once (BeamSearchQA: every node of a beam) yields `Parallel([...])`: each
part is served as if another question had asked for it (a Generate on its own KV sequence, every Search of the
batch in the same retriever call) and the generator resumes once, with the list of all results in order.

spaCy work (`Sentences`, `RealWords`) is a request too: answered on the spot when the scheduler has no text workers,
else sent to worker processes (fastrag.text.pool) whose results come back like searches: one by one, or a step's
texts together (`text_lockstep`: the step waits for them; `text_groups`: it does not, and they come back at once).
On a GPU that takes the methods' heaviest host logic off the thread that launches the decode steps.
"""

from __future__ import annotations

import hashlib
import threading
import time
import traceback
import warnings
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Callable, ClassVar, Generator, Iterable

from fastrag.engine import Engine, Generation, SeqState, sampling_key
from fastrag.switches import switch_interval
from fastrag.sync_watch import SyncWatch, sync_watch_requested
from fastrag.text.pool import (BrokenProcessPool, TextPool, compute_text, compute_texts, failure_message, is_failure,
                               text_groups_requested, text_lockstep_requested)
from fastrag.trace import QuestionResult


def _stable_id(example) -> int:
    """A process-independent integer naming a question: its qid, else its question text, else its repr."""
    name = getattr(example, "qid", None) or getattr(example, "question", None) or repr(example)
    return int.from_bytes(hashlib.blake2b(str(name).encode(), digest_size=8).digest(), "little")


@dataclass(slots=True)
class Generate:
    prompt: str
    max_new_tokens: int
    # which of the question's KV sequences to reuse: prompts of one family share a branch (an int >= 0);
    # None: a fresh sequence for this generation alone, released as soon as it finishes (a prompt nothing later
    # extends, e.g. one carrying retrieved documents, need not hold KV blocks)
    branch: int | None = 0
    # token ids appended to the tokenised prompt as they are (a generation resumed exactly where it stopped,
    # with no decode/encode round trip)
    suffix_ids: tuple[int, ...] = ()
    # track the in-context attention each token receives from the suffix on (Generation.attn covers suffix_ids
    # and the new tokens): DRAGIN streaming's a_i from the decode pass itself
    track_attn: bool = False


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
class Sentences:
    """spaCy's sentences of text (fastrag.text.sentences.split_sentences). Result: list[Sentence]."""

    text: str
    kind: ClassVar[str] = "sentences"


@dataclass(slots=True)
class RealWords:
    """Texts of text's spaCy tokens with a content POS (fastrag.text.realwords.real_words). Result: set[str]."""

    text: str
    kind: ClassVar[str] = "real_words"


TEXT_REQUESTS = (Sentences, RealWords)


@dataclass(slots=True)
class Parallel:
    """Several requests of one question in flight at once. Result: the list of their results, in order.

    parts: Generate / Search / AttnColmax / AttnRows / Sentences / RealWords (no nested Parallel). Generates with an
    int branch must name distinct branches (one sequence cannot run two generations); branch None parts each get a
    one-shot sequence.
    Every part joins the batches of its kind with the other questions' requests: all Searches of one Parallel go to
    the retriever in one call. An empty Parallel resumes at once with [].
    """

    parts: list


Request = Generate | AttnColmax | AttnRows | Search | Sentences | RealWords | Parallel
Policy = Callable[[object], Generator[Request, object, QuestionResult]]


@dataclass(eq=False)
class _Live:
    example: object
    gen: Generator
    seqs: dict[int, SeqState]  # branch -> KV sequence
    t0: float
    on_result: Callable[..., None] | None = None
    on_event: Callable[[str, dict], None] | None = None
    request: Request | None = None
    # requests waiting for a batch (attention passes, searches): (part index or None for a lone request, request)
    queued: list = field(default_factory=list)
    results: list | None = None  # results of the current Parallel's parts
    left: int = 0  # parts of the current Parallel still unanswered
    one_shot: dict = field(default_factory=dict)  # id(seq) -> seq of branch-None generations in flight
    generations: int = 0  # Generate requests served (the result's llm_calls when the policy does not count them)
    # prompt tokens prefilled and tokens decoded by the generations the engine finished for it (an error record's
    # counts: the policy's own result, which counts them too, is lost when the question fails)
    prefilled: int = 0
    decoded: int = 0
    # one-shot greedy generations by (prompt ids, max new tokens): the Generation once finished, else the Parallel
    # parts waiting for the one in flight
    memo: dict = field(default_factory=dict)
    memo_key: dict = field(default_factory=dict)  # id(seq) -> its memo key, for one-shot generations in flight


@dataclass(eq=False)
class Ticket:
    """A submitted question (what `Scheduler.submit` returns; `Scheduler.cancel` takes it)."""

    example: object
    policy: Policy
    on_result: Callable[..., None]
    on_event: Callable[[str, dict], None] | None = None
    live: _Live | None = None
    done: bool = False


class Scheduler:
    """Serves questions in batches. Batch use: `run(examples, on_result)`. Online use (a server): `submit` questions
    at any time, call `step()` while `busy`, `cancel` a ticket to drop a question and free its KV blocks.

    on_event(kind, data), when given at submit, streams what a question does as it happens: "token" (the decoded
    text of each new token of a generation: `{"text", "token_id", "branch"}`), "search" (`{"query", "k"}`),
    "documents" (`{"query", "doc_ids", "titles"}`), "generate" (a new generation: `{"prompt_tokens", "branch"}`,
    with `"reused": True` for one answered from an identical earlier generation, which streams no tokens).
    All callbacks run on the thread that calls `step()`.

    Under greedy decoding a one-shot generation (branch None, no attention tracking) whose prompt ids and token
    budget equal those of an earlier one of the same question is not run again: it gets a copy of that result
    (`Generation.reused`, nothing prefilled or decoded; `reused_generations` counts them).
    """

    def __init__(self, engine: Engine, retriever, policy: Policy | None = None, max_inflight: int = 64,
                 overlap: bool | None = None, text_workers: int | TextPool | None = None,
                 wait_for_search: bool = True, search_concurrency: int | None = None,
                 sync_watch: bool | None = None, text_lockstep: bool | None = None,
                 text_groups: bool | None = None):
        self.engine, self.retriever, self.policy = engine, retriever, policy
        # retrieval batches in flight at once, each on its own thread; None: what the retriever says it serves
        # (Retriever.concurrent_searches: 1, one batch at a time, unless the retriever is safe to call from several
        # threads and its backend serves calls in parallel)
        if search_concurrency is None:
            search_concurrency = getattr(retriever, "concurrent_searches", 1)
        if isinstance(search_concurrency, bool) or not isinstance(search_concurrency, int) or search_concurrency < 1:
            raise ValueError(f"search_concurrency must be an int >= 1, got {search_concurrency!r}")
        self.search_concurrency = search_concurrency
        self.max_inflight = max_inflight
        # when nothing but a retrieval is left, step() waits for it (a batch run: nothing else to do); False: it
        # returns at once without progress, so a caller that must stay responsive (the server's worker: new
        # requests, cancellations, timeouts) comes back between its own short waits
        self.wait_for_search = wait_for_search
        # run the methods' host logic while the device decodes (step()); None: on when the engine is on a GPU,
        # where the decode step runs asynchronously (on a CPU nothing overlaps, and results would only come later)
        if overlap is None:
            overlap = getattr(getattr(engine, "device", None), "type", None) == "cuda"
        if overlap and not hasattr(engine, "step_launch"):
            raise ValueError(f"overlap needs an engine with step_launch/step_finish; {type(engine).__name__} has "
                             "only step()")
        self.overlap = overlap
        # count the host calls that synchronise with the device while the overlap window is open (fastrag.sync_watch;
        # None: $FASTRAG_SYNC_WATCH). A diagnosis for GPU runs: off otherwise, with the reason kept for metrics.json
        if sync_watch is None:
            sync_watch = sync_watch_requested()
        self.sync_watch: SyncWatch | None = None
        self.sync_watch_off: str | None = None
        if sync_watch:
            if not overlap:
                self.sync_watch_off = "overlap is off (no window to watch)"
            elif getattr(getattr(engine, "device", None), "type", None) != "cuda":
                self.sync_watch_off = "not a CUDA device"
            else:
                self.sync_watch = SyncWatch()
        # spaCy requests (Sentences, RealWords): 0 answers them on this thread as they come; N > 0 sends them to N
        # worker processes (started at the first request), a TextPool shares one; None: 0. On the H200 (2026-11-25,
        # DRAGIN, 64 + 64 questions, batch 128) 8 workers made the run slower, 41.6 s against 35.3 s: the texts
        # that come back one by one start their prefills in small groups (276 prefill calls against 104), and each
        # prefill call has a large fixed cost (benchmarks/results/gpu_h200_2026-11-25.md)
        if text_workers is None:
            text_workers = 0
        if isinstance(text_workers, TextPool):
            self.text_pool, self._own_pool, self.text_workers = text_workers, False, text_workers.workers
        elif isinstance(text_workers, bool) or not isinstance(text_workers, int) or text_workers < 0:
            raise ValueError(f"text_workers must be an int >= 0 or a TextPool, got {text_workers!r}")
        else:
            self.text_pool, self._own_pool, self.text_workers = None, True, text_workers
        # with workers, lockstep answers each step's texts where the scheduler's own thread would (the same steps,
        # so the same prefill groups and decisions), the step's texts spread over the workers and waited for; off,
        # a text goes to its question whenever it comes back (None: $FASTRAG_TEXT_LOCKSTEP, default off)
        if text_lockstep is None:
            text_lockstep = text_lockstep_requested()
        self.text_lockstep = bool(text_lockstep)
        # with workers, groups: a step's texts are gathered as in lockstep and sent to the workers together, but the
        # step does not wait for them; the group comes back whole (its questions' next requests start in the same
        # step, as in lockstep) at the first step after the last of its texts is done, and meanwhile the device
        # decodes the other questions. None: $FASTRAG_TEXT_GROUPS, and where that is unset groups unless lockstep
        # is on. The default since the H200 of 2026-11-27: 8 workers in groups took 17.05 s against 18.51 s without
        # workers (128 DRAGIN questions), where free-running workers were slower than none on 2026-11-25; False
        # (or $FASTRAG_TEXT_GROUPS=0): free-running, each text back to its question whenever it is done
        if text_groups is None:
            text_groups = text_groups_requested()
            if text_groups is None:
                text_groups = self.text_workers > 0 and not self.text_lockstep
        self.text_groups = bool(text_groups)
        if self.text_groups and self.text_lockstep:
            raise ValueError("text_lockstep and text_groups are two ways to send a step's texts to the workers; "
                             "choose one ($FASTRAG_TEXT_LOCKSTEP, $FASTRAG_TEXT_GROUPS)")
        self._texts: list[tuple[Future, _Live, int | None, Request]] = []  # text requests at the workers
        self._text_groups: list[tuple[Future, list[tuple[_Live, int | None, Request]]]] = []  # (text_groups)
        self.text_group_sizes: list[int] = []  # texts in each group sent (text_groups)
        # without workers, the text requests of a step wait inside it for one nlp.pipe pass a kind (batch_texts;
        # None outside a step: answered at once)
        self._step_texts: list[tuple[_Live, int | None, Request]] | None = None
        self.text_requests = 0
        self._lockstep_wait = 0.0  # host seconds waiting for a step's texts on the workers (lockstep)
        self.search_batches: list[int] = []
        self.search_seconds = 0.0  # summed over the batches (concurrent batches overlap)
        self._search_lock = threading.Lock()
        # host seconds of step() by part: the engine's step, batched attention passes, and the rest (the methods'
        # own logic: sentence splitting, thresholds, query building, prompt assembly)
        self.step_seconds = {"engine": 0.0, "attention_passes": 0.0, "methods_and_other": 0.0,
                             "waiting_text_workers": 0.0}
        self._todo: deque[Ticket] = deque()
        self._live: dict[int, _Live] = {}
        self._by_seq: dict[int, tuple[_Live, int | None]] = {}  # id(seq) -> (question, Parallel part or None)
        self._tickets: dict[int, Ticket] = {}  # id(live) -> ticket
        self._pool: ThreadPoolExecutor | None = None
        self._searches: list[tuple[Future, list]] = []  # retrieval batches in flight, oldest first
        # results to hand over at the next step: reused generations (known at dispatch), and with overlap all
        self._ready: list[tuple[_Live, int | None, object]] = []
        self.reused_generations = 0

    # ------------------------------------------------------------------ batch use
    def run(self, examples: Iterable, on_result: Callable[..., None], pass_example: bool = False) -> None:
        """Answer every example; on_result(result) (or on_result(result, example) with pass_example) is called
        as each question finishes."""
        for ex in examples:
            cb = (lambda r, ex=ex: on_result(r, ex)) if pass_example else on_result
            self.submit(ex, cb)
        try:
            with switch_interval():  # ($FASTRAG_SWITCH_INTERVAL: how long a launch may wait for the GIL per call)
                while self.busy:
                    self.step()
        except BaseException:  # (Ctrl-C, an on_result that raised, an engine error): the engine is left clean
            self.abort()
            raise
        finally:
            self.close()

    def abort(self) -> int:
        """Cancel every question queued or in flight: their sequences leave the engine and their KV blocks go back
        to the pool, so that an engine shared with later runs starts them with nothing left over. run() does this
        when it is interrupted. Returns how many questions were cancelled."""
        n = sum(self.cancel(t) for t in [*self._tickets.values(), *self._todo])
        self._ready.clear()
        return n

    # ------------------------------------------------------------------ online use
    def submit(self, example, on_result: Callable[[QuestionResult], None], policy: Policy | None = None,
               on_event: Callable[[str, dict], None] | None = None) -> Ticket:
        policy = policy or self.policy
        if policy is None:
            raise ValueError("no policy: pass one to Scheduler(...) or to submit()")
        t = Ticket(example, policy, on_result, on_event)
        self._todo.append(t)
        return t

    def cancel(self, ticket: Ticket) -> bool:
        """Drop a question (queued or in flight) without calling its on_result; False when it already ended."""
        if ticket.done:
            return False
        ticket.done = True
        if ticket.live is None:
            try:
                self._todo.remove(ticket)
            except ValueError:
                pass
            return True
        lv = ticket.live
        self._live.pop(id(lv), None)
        self._tickets.pop(id(lv), None)
        self._release(lv)
        lv.gen.close()
        return True

    @property
    def busy(self) -> bool:
        return bool(self._todo or self._live)

    @property
    def inflight(self) -> int:
        return len(self._live)

    @property
    def queued(self) -> int:
        return len(self._todo)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._searches = []
        out = self._texts + [(fut, lv, i, r) for fut, items in self._text_groups for lv, i, r in items]
        for fut, lv, i, r in out:  # texts still out: asked again by the next step, if there is one
            fut.cancel()
            if id(lv) in self._live:
                lv.queued.append((i, r))
        self._texts, self._text_groups = [], []
        if self.text_pool is not None and self._own_pool:
            self.text_pool.shutdown()
            self.text_pool = None  # (a later text request starts workers again)

    # without text workers, the spaCy texts that questions ask for in one step go through one nlp.pipe pass a kind
    # (fastrag.text.pool.compute_texts), each answered within the step at the point where it was asked
    batch_texts = True

    def step(self) -> bool:
        """Admit questions up to max_inflight, serve one round of batched requests (attention passes, a retrieval
        batch, spaCy texts, one engine step). Returns whether anything progressed.

        With `overlap`, the engine step is launched first and the results known from earlier (finished
        generations, attention passes, searches) are handed to their questions while the device runs it: the
        methods' own logic (sentence splitting, POS tagging, thresholds, prompt building) then takes no time of its
        own on a GPU. The attention passes this asks for are launched behind the step, and until the device has
        run both, the texts the workers send back go to their questions at once. Each other result reaches its
        question one step later than without overlap; what every question decides is the same either way.
        """
        try:
            return self._step_batched()
        finally:
            if self.sync_watch is not None:
                self.sync_watch.stop()  # (a step that raised in the window leaves the debug mode off too)

    def _step_batched(self) -> bool:
        if not self.batch_texts or not self._texts_in_step or self._step_texts is not None:
            return self._step()
        self._step_texts = []
        try:
            return self._step()
        finally:
            left, self._step_texts = self._step_texts, None
            for lv, i, r in left:  # (only when the step raised: answered one by one, delivered next step)
                if id(lv) in self._live:
                    value = compute_text(r.kind, r.text)
                    if is_failure(value):
                        self._fail(lv, failure_message(value))
                    else:
                        self._ready.append((lv, i, value))

    @property
    def _texts_in_step(self) -> bool:
        """Whether text requests are gathered by the step that asks for them (no workers, lockstep, groups)."""
        return not self.text_workers or self.text_lockstep or self.text_groups

    @property
    def _texts_out(self) -> bool:
        """Whether texts are at the workers (one by one, or in groups)."""
        return bool(self._texts or self._text_groups)

    def _text_futures(self) -> list[Future]:
        return [f for f, _, _, _ in self._texts] + [f for f, _ in self._text_groups]

    def _answer_step_texts(self) -> bool:
        """Answer the text requests of this step so far in one pass a kind (and those their answers lead to); with
        text_groups, send them to the workers as one group instead (answered when the whole group is back)."""
        any_ = False
        while self._step_texts:
            items, self._step_texts = self._step_texts, []
            if self._send_group(items):
                return True
            for (lv, i, r), value in zip(items, self._compute_texts([(r.kind, r.text) for _, _, r in items])):
                if id(lv) in self._live:
                    self._hand_text(lv, i, value, now=True)
            any_ = True
        return any_

    def _send_group(self, items: list[tuple[_Live, int | None, Request]]) -> bool:
        """text_groups: items to the workers as one group, unless no worker has loaded its pipeline yet (then the
        caller computes them here: a step never waits for workers to start). Returns whether they went."""
        if not (self.text_groups and self.text_workers) or self._ready_pool() is None:
            return False
        try:
            fut = self.text_pool.submit_texts([(r.kind, r.text) for _, _, r in items])
        except (BrokenProcessPool, RuntimeError) as e:  # the pool died: this step's texts run here
            self._lose_pool(e)
            return False
        self._text_groups.append((fut, items))
        self.text_requests += len(items)
        self.text_group_sizes.append(len(items))
        return True

    def _compute_texts(self, items: list[tuple[str, str]]) -> list:
        """compute_texts(items): in lockstep on the workers (all of them sent, then all waited for), else here. The
        workers start at the first text and load their pipelines meanwhile; until one has, and for a lone text
        (nothing to spread), the texts are computed here: a step never waits for a worker to start."""
        # (the pool starts at the first text, a lone one too)
        if self.text_lockstep and self.text_workers and self._ready_pool() is not None and len(items) > 1:
            tw = time.perf_counter()
            try:
                values = self.text_pool.compute_texts(items)
            except (BrokenProcessPool, RuntimeError) as e:  # the pool died: this step's texts run here
                self._lose_pool(e)
            else:
                self.text_requests += len(items)
                self._lockstep_wait += time.perf_counter() - tw
                return values
        return compute_texts(items)

    def _ready_pool(self) -> TextPool | None:
        """The worker pool (started now if it was not), when a worker of it has loaded its pipeline; else None. A
        pool whose workers all died is given up here (the texts run on this thread from then on)."""
        self._start_pool()
        if self.text_pool is not None and self.text_pool.broken is not None:  # every worker died meanwhile
            self._lose_pool(BrokenProcessPool(self.text_pool.broken))
        return self.text_pool if self.text_pool is not None and self.text_pool.ready else None

    def _step(self) -> bool:
        t0 = time.perf_counter()
        t_eng = t_attn = t_wait = 0.0
        progressed = False
        launched = None
        if self.overlap and self.engine.has_work:
            te = time.perf_counter()
            launched = self.engine.step_launch()
            t_eng += time.perf_counter() - te
            t_window = time.perf_counter()
            progressed = True
            if self.sync_watch is not None:
                self.sync_watch.start()  # (until step_finish, which waits by design)
        while self._todo and len(self._live) < self.max_inflight:
            t = self._todo.popleft()
            lv = _Live(t.example, t.policy(t.example), {}, time.perf_counter(), t.on_result, t.on_event)
            t.live = lv
            self._live[id(lv)] = lv
            self._tickets[id(lv)] = t
            self._advance(lv, None)
            progressed = True
        if self._ready:  # results held back for this step: reused generations, and with overlap every result
            ready, self._ready = self._ready, []
            for lv, i, g in ready:
                self._deliver(lv, i, g)
            progressed = True
        self._answer_step_texts()  # (before the passes are taken: a text's answer may ask for one)
        # attention passes: one batched forward per kind, launched behind the step (collected below)
        passes = []
        pass_row = None  # (the step trace's row of a step that launches passes and no engine step)
        for kind, cls in (("colmax", AttnColmax), ("rows", AttnRows)):
            items = self._take(cls)
            if items:
                ta = time.perf_counter()
                if launched is None and self.overlap and not passes and hasattr(self.engine, "trace_passes_step"):
                    pass_row = self.engine.trace_passes_step()
                    t_window = ta
                passes.append((items, self._passes_launch([r.ids for _, _, r in items], kind)))
                t_attn += time.perf_counter() - ta
                progressed = True
        self._submit_texts()  # (texts queued for workers that have since failed run here)
        if launched is not None:  # retrieval: a batch of what is known now runs beside the device's step
            self._submit_search()
        # while the device still runs: hand the texts the workers finish to their questions at once (what those
        # questions ask for next joins this step where it can: generations start, texts go out)
        def device_busy() -> bool:
            return (launched is not None and not self.engine.step_done(launched)) \
                or any(not p.done() for _, p in passes)

        if self._texts_out and (launched is not None or passes):
            while self._texts_out and device_busy():
                if self._collect_texts(now=True):
                    progressed = True
                    self._submit_texts()
                    self._answer_step_texts()  # (text_groups: the texts those answers ask for, as a new group)
                else:
                    tw = time.perf_counter()
                    wait(self._text_futures(), timeout=0.0005, return_when=FIRST_COMPLETED)
                    t_wait += time.perf_counter() - tw
        if pass_row is not None:  # the host's time between the passes' launch and their wait
            pass_row["window_s"] = time.perf_counter() - t_window
        for items, pending in passes:
            ta = time.perf_counter()
            res = pending.results if isinstance(pending, _DonePasses) else self.engine.attention_passes_finish(pending)
            t_attn += time.perf_counter() - ta
            for (lv, i, _), r in zip(items, res):
                self._result(lv, i, r)
        # retrieval: submit a batch if fewer than search_concurrency are in flight (without overlap, with the
        # queries the attention passes just led to); collect the finished ones (when nothing else can move, wait
        # for the first to finish)
        self._submit_search()
        if self._searches and self.wait_for_search and not any(f.done() for f, _ in self._searches) \
                and not (self.engine.has_work or launched or self._ready or self._texts_out):
            wait([f for f, _ in self._searches], return_when=FIRST_COMPLETED)
        ended = [x[0].done() for x in self._searches]  # (read once: a batch may finish meanwhile)
        done = [x for x, e in zip(self._searches, ended) if e]
        if done:
            self._searches = [x for x, e in zip(self._searches, ended) if not e]
            progressed = True
        for fut, items in done:  # (in the order they were submitted)
            for (lv, i, r), d in zip(items, fut.result()):
                if isinstance(d, SearchFailure):  # this query's retrieval raised: its question ends, not the run
                    self._fail(lv, f"retrieval of {r.query!r} failed: {d.message}")
                    continue
                if id(lv) in self._live:
                    self._emit(lv, "documents", {"query": r.query, "doc_ids": [x.id for x in d],
                                                 "titles": [x.title for x in d]})
                self._result(lv, i, d)
        finished = []
        if launched is None and not self.overlap:
            self._answer_step_texts()  # (the generations their answers start join this step's engine step)
        row = getattr(launched, "trace_row", None)
        if pass_row is not None:
            row, pass_row["passes_s"] = pass_row, t_attn
        if launched is not None:
            if self.sync_watch is not None:
                self.sync_watch.stop()
            te = time.perf_counter()
            if row is not None:  # the host's time between the launch and the wait (the passes' wait included)
                row["window_s"], row["passes_s"] = te - t_window, t_attn
            finished = self.engine.step_finish(launched)
            t_eng += time.perf_counter() - te
        elif not self.overlap and self.engine.has_work:
            te = time.perf_counter()
            finished = self.engine.step()
            t_eng += time.perf_counter() - te
            progressed = True
        for seq in finished:
            hit = self._by_seq.get(id(seq))
            if hit is None:  # its question ended while it ran
                continue
            lv, i = hit
            lv.prefilled += seq.out.prefilled
            lv.decoded += len(seq.out.ids)
            if seq.out.error is not None:  # the engine could not finish it (NaN logits): its question ends
                self._fail(lv, seq.out.error)
                continue
            waiting = []
            if lv.one_shot.pop(id(seq), None) is not None:
                self._by_seq.pop(id(seq), None)
                self.engine.release(seq)  # one-shot: its KV is never reused
                key = lv.memo_key.pop(id(seq), None)
                if key is not None:
                    # kept as a copy: the policy owns the Generation it is handed and may change it
                    waiting, lv.memo[key] = lv.memo[key], _reused(seq.out)
            out = seq.out
            self._result(lv, i, out)
            for j in waiting:
                self._result(lv, j, _reused(out))
        if self._texts_out:
            # texts back since: to their questions (with overlap at the next step). When nothing else can move,
            # wait for the first text or the search in flight
            if not (progressed or finished or self.engine.has_work or self._ready):
                tw = time.perf_counter()
                wait(self._text_futures() + [f for f, _ in self._searches],
                     timeout=None if self.wait_for_search else 0.05, return_when=FIRST_COMPLETED)
                t_wait += time.perf_counter() - tw
                progressed = True
            if self._collect_texts(now=False):
                progressed = True
        if self._answer_step_texts():
            progressed = True
        sec = self.step_seconds
        sec["engine"] += t_eng
        sec["attention_passes"] += t_attn
        t_wait += self._lockstep_wait  # (the step's texts on the workers in lockstep: this thread only waited)
        self._lockstep_wait = 0.0
        sec["waiting_text_workers"] += t_wait
        t_end = time.perf_counter()
        sec["methods_and_other"] += t_end - t0 - t_eng - t_attn - t_wait
        if row is not None:
            row["step_s"] = t_end - t0
        if not progressed and self._live and not self._searches and not self._texts_out:
            stuck = [type(lv.request).__name__ for lv in self._live.values()]
            raise RuntimeError(f"scheduler made no progress; pending requests: {stuck}")
        return progressed

    def _submit_search(self) -> None:
        if len(self._searches) >= self.search_concurrency:
            return
        items = self._take(Search)
        if items:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.search_concurrency)
            for lv, _, r in items:
                self._emit(lv, "search", {"query": r.query, "k": r.k})
            self._searches.append((self._pool.submit(self._run_search, [r for _, _, r in items]), items))

    def _passes_launch(self, seqs: list[list[int]], kind: str):
        launch = getattr(self.engine, "attention_passes_launch", None)
        if launch is None:  # an engine with the one-call form only
            return _DonePasses(self.engine.attention_passes(seqs, kind))
        return launch(seqs, kind)

    # ------------------------------------------------------------------ spaCy texts on the workers
    def _submit_texts(self) -> None:
        items = self._take(TEXT_REQUESTS)
        if items and self.text_workers:
            self._start_pool()
        for lv, i, r in items:
            if self.text_pool is not None:
                try:
                    self._texts.append((self.text_pool.submit(r.kind, r.text), lv, i, r))
                    self.text_requests += 1
                    continue
                except (BrokenProcessPool, RuntimeError) as e:  # the pool died (or was shut down)
                    self._lose_pool(e)
            self._hand_text(lv, i, compute_text(r.kind, r.text), now=False)

    def _start_pool(self) -> None:
        """The worker pool, started at the first text that needs it (none where processes cannot start: the texts
        are answered on this thread from then on)."""
        if self.text_pool is None:
            try:
                self.text_pool = TextPool(self.text_workers)
            except (OSError, RuntimeError) as e:
                self._lose_pool(e)

    def _collect_texts(self, now: bool) -> bool:
        """Hand the finished text requests to their questions: `now` at once (a question may then ask for more),
        else through _result; a group only once all its texts are back (a group back is not held for one sent
        before it; those back together go in the order they were sent). Returns whether any had finished."""
        groups = [x for x in self._text_groups if x[0].done()]
        if groups:
            ids = {id(x) for x in groups}
            self._text_groups = [x for x in self._text_groups if id(x) not in ids]
            for fut, items in groups:
                try:
                    values = fut.result()
                except BrokenProcessPool as e:  # a worker died (submit_texts says so for any lost share): here
                    self._lose_pool(e)
                    values = compute_texts([(r.kind, r.text) for _, _, r in items])
                for (lv, i, _), value in zip(items, values):
                    self._hand_text(lv, i, value, now)
        done = [x for x in self._texts if x[0].done()]
        if not done:
            return bool(groups)
        ids = {id(x) for x in done}
        self._texts = [x for x in self._texts if id(x) not in ids]
        for fut, lv, i, r in done:
            try:
                value = fut.result()
            except BrokenProcessPool as e:  # a worker died (killed, out of memory): this and the rest run here
                self._lose_pool(e)
                value = compute_text(r.kind, r.text)
            self._hand_text(lv, i, value, now)
        return True

    def _hand_text(self, lv: _Live, i: int | None, value, now: bool) -> None:
        """A text request's result to its question (`now`: at once, else through _result); a failure ends it."""
        if is_failure(value):
            self._fail(lv, failure_message(value))
        else:
            (self._deliver if now else self._result)(lv, i, value)

    def _fail(self, lv: _Live, message: str) -> None:
        """End a question in flight with an error (nothing if it already ended)."""
        if id(lv) in self._live:
            lv.gen.close()
            self._finish(lv, None, message)

    def _lose_pool(self, err: Exception) -> None:
        if not self.text_workers:
            return
        warnings.warn(f"the spaCy worker pool failed ({type(err).__name__}: {err}); the methods' text work runs "
                      "on the scheduler's thread from now on", RuntimeWarning, stacklevel=3)
        if self._own_pool and self.text_pool is not None:
            self.text_pool.shutdown()
        self.text_pool, self.text_workers = None, 0

    def _result(self, lv: _Live, idx: int | None, value) -> None:
        """A request's result: handed to its question now, or with overlap at the start of the next step (while
        the device runs that step's decode)."""
        if self.overlap:
            self._ready.append((lv, idx, value))
        else:
            self._deliver(lv, idx, value)

    # ------------------------------------------------------------------ internals
    def _emit(self, lv: _Live, kind: str, data: dict) -> None:
        if lv.on_event is not None:
            lv.on_event(kind, data)

    def _drop(self, seq: SeqState) -> None:
        self._by_seq.pop(id(seq), None)
        if seq in self.engine.waiting:
            self.engine.waiting.remove(seq)
        if seq in self.engine.running:
            self.engine.running.remove(seq)
        self.engine.release(seq)

    def _release(self, lv: _Live) -> None:
        for seq in [*lv.seqs.values(), *lv.one_shot.values()]:
            self._drop(seq)
        lv.one_shot.clear()
        lv.queued.clear()

    def _finish(self, lv: _Live, result: QuestionResult | None, err: str | None = None) -> None:
        self._live.pop(id(lv), None)
        t = self._tickets.pop(id(lv), None)
        if t is not None:
            t.done = True
        self._release(lv)
        if result is None:
            ex = lv.example
            result = QuestionResult(qid=ex.qid, question=ex.question, gold=list(ex.answers), error=err,
                                    prefill_tokens=lv.prefilled, decode_tokens=lv.decoded)
        if not result.llm_calls:
            result.llm_calls = lv.generations
        result.wall_s = time.perf_counter() - lv.t0
        lv.on_result(result)

    def _deliver(self, lv: _Live, idx: int | None, value) -> None:
        if id(lv) not in self._live:  # the question already ended (another part of it failed, or cancelled)
            return
        if idx is None:
            lv.request = None
            self._advance(lv, value)
            return
        lv.results[idx] = value
        lv.left -= 1
        if lv.left == 0:
            results, lv.results, lv.request = lv.results, None, None
            self._advance(lv, results)

    def _dispatch(self, lv: _Live, idx: int | None, req) -> None:
        if isinstance(req, Generate):
            ids = self.engine.tok.encode(req.prompt)
            track_from = len(ids) if req.track_attn else None
            ids += list(req.suffix_ids)
            sp = getattr(self.engine, "sampling", None)
            greedy = sp is None or sp.temperature <= 0
            key = None
            if req.branch is None and greedy and not req.track_attn:
                # greedy decoding is a function of the prompt: a one-shot generation identical to one this question
                # already made (BeamSearchQA summarising the same documents for two sub-questions) is answered from
                # it, nothing prefilled or decoded
                key = (tuple(ids), req.max_new_tokens)
                known = lv.memo.get(key)
                if known is not None:
                    lv.generations += 1
                    self.reused_generations += 1
                    self._emit(lv, "generate", {"prompt_tokens": len(ids), "branch": None, "reused": True})
                    if isinstance(known, list):  # the same generation is in flight: answered when it finishes
                        known.append(idx)
                    else:
                        self._ready.append((lv, idx, _reused(known)))
                    return
            if req.branch is None:
                seq = self.engine.new_sequence()
                lv.one_shot[id(seq)] = seq
                if key is not None:
                    lv.memo[key] = []
                    lv.memo_key[id(seq)] = key
            else:
                if req.branch not in lv.seqs:
                    lv.seqs[req.branch] = self.engine.new_sequence()
                seq = lv.seqs[req.branch]
            self._by_seq[id(seq)] = (lv, idx)
            kw = {} if track_from is None else {"track_from": track_from}
            if not greedy:
                # the generation's sampling key names the question and its call number, so a seeded run draws
                # the same tokens whatever shares the batch and whenever retrieval returns
                kw["sample_key"] = sampling_key(_stable_id(lv.example), lv.generations)
            self.engine.start(seq, ids, req.max_new_tokens, **kw)
            seq.on_token = self._token_hook(lv, req.branch) if lv.on_event is not None else None
            self._emit(lv, "generate", {"prompt_tokens": len(ids), "branch": req.branch})
            lv.generations += 1
        elif isinstance(req, TEXT_REQUESTS) and self._texts_in_step and self._step_texts is not None:
            self._step_texts.append((lv, idx, req))  # a Parallel's part, answered with the step's other texts
        elif isinstance(req, TEXT_REQUESTS) and self._texts_in_step:  # a Parallel's part, answered here
            value = compute_text(req.kind, req.text)
            if is_failure(value):
                self._fail(lv, failure_message(value))
            else:
                lv.results[idx] = value
                lv.left -= 1
        elif isinstance(req, (AttnColmax, AttnRows, Search, *TEXT_REQUESTS)):
            limit = getattr(self.engine, "max_context", None)
            if isinstance(req, (AttnColmax, AttnRows)) and limit is not None and len(req.ids) > limit:
                # (refused here, not in the batched pass, which would fail every question that shares it)
                raise ValueError(f"an attention pass over {len(req.ids)} tokens exceeds the model context of "
                                 f"{limit} tokens")
            lv.queued.append((idx, req))
        else:
            raise TypeError(f"unknown request {type(req).__name__}; expected Generate, AttnColmax, AttnRows, "
                            "Search, Sentences, RealWords or Parallel")

    def _token_hook(self, lv: _Live, branch):
        """Per generation: turn each new token id into the text it adds (decoding the generation so far, so
        multi-token characters and word-initial spaces come out right)."""
        tok, ids, shown = self.engine.tok, [], [""]

        def on_token(t: int) -> None:
            ids.append(t)
            text = tok.decode(ids, skip_special_tokens=True)
            if text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for the next token
                return
            new = text[len(shown[0]):] if text.startswith(shown[0]) else text
            shown[0] = text
            self._emit(lv, "token", {"text": new, "token_id": t, "branch": branch})

        return on_token

    def _advance(self, lv: _Live, value) -> None:
        while True:
            try:
                req = lv.gen.send(value)
            except StopIteration as stop:
                self._finish(lv, stop.value)
                return
            except Exception as e:  # a per-question failure is recorded; the run goes on
                self._finish(lv, None, f"{type(e).__name__}: {e}")
                if not isinstance(e, (ValueError, KeyError)):
                    traceback.print_exc()
                return
            lv.request = req
            if isinstance(req, Parallel) and not req.parts:
                value = []
                continue
            if isinstance(req, TEXT_REQUESTS) and self._texts_in_step:  # answered here and now
                if self._step_texts is not None:  # (within a step: with the step's other texts)
                    self._step_texts.append((lv, None, req))
                    return
                value = compute_text(req.kind, req.text)
                if is_failure(value):
                    self._fail(lv, failure_message(value))
                    return
                continue
            try:
                if isinstance(req, Parallel):
                    _check_parallel(req)
                    lv.results, lv.left = [None] * len(req.parts), len(req.parts)
                    for i, part in enumerate(req.parts):
                        self._dispatch(lv, i, part)
                        if id(lv) not in self._live:  # a part failed and ended the question
                            return
                    if lv.left == 0:  # every part answered at dispatch (texts computed here)
                        value, lv.results, lv.request = lv.results, None, None
                        continue
                else:
                    self._dispatch(lv, None, req)
            except (ValueError, TypeError) as e:
                self._fail(lv, f"{type(e).__name__}: {e}")
            return

    def _take(self, cls) -> list[tuple[_Live, int | None, Request]]:
        """Pop every queued request of one kind (a class or a tuple of classes), over all questions in flight."""
        items = []
        for lv in list(self._live.values()):
            if any(isinstance(r, cls) for _, r in lv.queued):
                items += [(lv, i, r) for i, r in lv.queued if isinstance(r, cls)]
                lv.queued = [(i, r) for i, r in lv.queued if not isinstance(r, cls)]
        return items

    def _run_search(self, reqs: list[Search]):
        """One batched retrieval. If the batch raises, each query is asked alone, so that only the queries whose
        retrieval fails (a SearchFailure in their place) end their questions."""
        t = time.perf_counter()
        try:
            out = _result_lists(self.retriever.search([r.query for r in reqs], max(r.k for r in reqs)), len(reqs))
        except Exception:
            out = None
        if out is None or any(isinstance(d, SearchFailure) for d in out):
            # the batch raised, or returned something unusable for some query: each query alone, so that only
            # those whose retrieval really fails (a SearchFailure in their place) end their questions
            out = []
            for r in reqs:
                try:
                    out += _result_lists(self.retriever.search([r.query], r.k), 1, strict=True)
                except Exception as e:
                    out.append(SearchFailure(f"{type(e).__name__}: {e}"))
            failed = [d for d in out if isinstance(d, SearchFailure)]
            if failed:
                warnings.warn(f"retrieval failed for {len(failed)} of {len(reqs)} queries ({failed[0].message}); "
                              "their questions end with an error, the others go on", RuntimeWarning, stacklevel=2)
        out = [d if isinstance(d, SearchFailure) else d[: r.k] for d, r in zip(out, reqs)]
        with self._search_lock:  # (concurrent batches finish on several threads)
            self.search_seconds += time.perf_counter() - t
            self.search_batches.append(len(reqs))
        return out


@dataclass(slots=True)
class SearchFailure:
    """In place of a query's documents: its retrieval raised (the message says how)."""

    message: str


def _result_lists(out, n: int, strict: bool = False) -> list:
    """A retriever's answer to n queries, checked: n lists of documents (objects with str id, title and text),
    each as a list; a query whose list is not one gets a SearchFailure naming what came back. A wrong number of
    lists (or no sequence at all) raises, naming it (strict: a bad list raises too)."""
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__") or not hasattr(out, "__getitem__"):
        raise TypeError(f"the retriever returned {type(out).__name__}, not a list of result lists (one per query)")
    if len(out) != n:
        raise RuntimeError(f"the retriever returned {len(out)} result lists for {n} quer{'y' if n == 1 else 'ies'}")
    checked = []
    for docs in out:
        why = None
        if not isinstance(docs, (list, tuple)):
            why = f"a {type(docs).__name__}, not a list of documents"
        else:
            for j, d in enumerate(docs):
                bad = [f for f in ("id", "title", "text") if not isinstance(getattr(d, f, None), str)]
                if bad:
                    why = (f"a list whose document {j} is a {type(d).__name__} with no str {', '.join(bad)} "
                           "(a Doc(id, title, text) is expected)")
                    break
        if why is not None:
            if strict:
                raise TypeError(f"the retriever returned {why}")
            checked.append(SearchFailure(f"the retriever returned {why}"))
        else:
            checked.append(list(docs))
    return checked


@dataclass(slots=True)
class _DonePasses:
    """Attention passes of an engine without attention_passes_launch: computed at once."""

    results: list

    def done(self) -> bool:
        return True


def _reused(g: Generation) -> Generation:
    """A copy of g for an identical generation answered from it (its token lists are copied too)."""
    return replace(g, ids=list(g.ids), entropy=list(g.entropy), logprob=list(g.logprob), prefilled=0,
                   attn=None if g.attn is None else list(g.attn), reused=True)


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
