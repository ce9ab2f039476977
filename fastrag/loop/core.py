"""Continuous batching of many questions: the question loop.

A method writes one question's logic as a plain generator that yields requests (fastrag.loop.requests: `Generate`,
`AttnColmax`, `AttnRows`, `Search`, ...) and receives their results; the loop keeps up to `max_inflight` such
generators alive, gathers their requests, and serves each kind in batches: generations share the engine's decode
batch, attention passes run as one padded forward, retrieval queries go to the retriever together (on a worker
thread, overlapping the decode steps of the other questions; up to `search_concurrency` such batches at once, each
with the queries known when it left, so that one slow search does not hold back the retrievals asked for after it:
fastrag.loop.search_service).

A question that needs several things at once (BeamSearchQA: every node of a beam) yields `Parallel([...])`: each
part is served as if another question had asked for it (a Generate on its own KV sequence, every Search of the
batch in the same retriever call) and the generator resumes once, with the list of all results in order.

spaCy work (`Sentences`, `RealWords`) is a request too: answered on the spot when the loop has no text workers,
else sent to worker processes (fastrag.loop.text_service) whose results come back like searches: one by one, or a
step's texts together (`text_lockstep`: the step waits for them; `text_groups`: it does not, and they come back at
once). On a GPU that takes the methods' heaviest host logic off the thread that launches the decode steps.

The loop talks to its engine through fastrag.loop.protocol.LoopEngine.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Callable, Iterable

from fastrag.loop.config import LoopConfig
from fastrag.loop.protocol import LoopEngine, SyncEngineBase
from fastrag.loop.questions import Live, QuestionPlumbing, Ticket
from fastrag.loop.requests import TEXT_REQUESTS, AttnColmax, AttnRows, Policy, Search
from fastrag.loop.search_service import SearchService
from fastrag.loop.text_service import TextService
from fastrag.settings import switch_interval
from fastrag.sync_watch import SyncWatch, sync_watch_requested
from fastrag.text.pool import compute_text, failure_message, is_failure
from fastrag.trace import QuestionResult


def _delegate(service: str, name: str, doc: str) -> property:
    """A loop attribute kept by one of its services (the names eval and the server read)."""
    return property(lambda self: getattr(getattr(self, service), name),
                    lambda self, value: setattr(getattr(self, service), name, value), doc=doc)


def _on_cuda(engine: LoopEngine) -> bool:
    return engine.device is not None and engine.device.type == "cuda"


class QuestionLoop(QuestionPlumbing):
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

    search_concurrency = _delegate("search", "concurrency", "retrieval batches in flight at once")
    search_batches = _delegate("search", "batches", "queries in each retrieval batch")
    search_seconds = _delegate("search", "seconds", "seconds of retrieval, summed over the batches")
    text_pool = _delegate("texts", "pool", "the spaCy worker pool (None: not started, or given up)")
    text_workers = _delegate("texts", "workers", "spaCy worker processes (0: texts on this thread)")
    text_lockstep = _delegate("texts", "lockstep", "a step's texts spread over the workers and waited for")
    text_groups = _delegate("texts", "groups", "a step's texts sent together, back whole, not waited for")
    text_group_sizes = _delegate("texts", "group_sizes", "texts in each group sent (text_groups)")
    text_requests = _delegate("texts", "requests", "texts answered by the workers")

    def __init__(self, engine: LoopEngine, retriever, policy: Policy | None = None, config: LoopConfig | None = None,
                 **settings):
        """config: the loop's settings (fastrag.loop.config.LoopConfig; None: its defaults); `settings`: any of its
        fields given by name, which win over `config`'s (`QuestionLoop(eng, ret, policy, max_inflight=64)`)."""
        cfg = (config or LoopConfig()).replace(**settings) if settings else (config or LoopConfig())
        self.config = cfg
        max_inflight, overlap, text_workers = cfg.max_inflight, cfg.overlap, cfg.text_workers
        wait_for_search, search_concurrency, sync_watch = cfg.wait_for_search, cfg.search_concurrency, cfg.sync_watch
        text_lockstep, text_groups = cfg.text_lockstep, cfg.text_groups
        self.engine, self.retriever, self.policy = engine, retriever, policy
        self.search = SearchService(retriever, search_concurrency)
        self.max_inflight = max_inflight
        # when nothing but a retrieval is left, step() waits for it (a batch run: nothing else to do); False: it
        # returns at once without progress, so a caller that must stay responsive (the server's worker: new
        # requests, cancellations, timeouts) comes back between its own short waits
        self.wait_for_search = wait_for_search
        # run the methods' host logic while the device decodes (step()); None: on when the engine is on a GPU,
        # where the decode step runs asynchronously (on a CPU nothing overlaps, and results would only come later)
        if overlap is None:
            overlap = _on_cuda(engine)
        if overlap and isinstance(engine, SyncEngineBase):
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
            elif not _on_cuda(engine):
                self.sync_watch_off = "not a CUDA device"
            else:
                self.sync_watch = SyncWatch()
        # spaCy requests (Sentences, RealWords): on this thread, or on worker processes (fastrag.loop.text_service)
        self.texts = TextService(text_workers, text_lockstep, text_groups)
        # without workers, the text requests of a step wait inside it for one nlp.pipe pass a kind (batch_texts;
        # None outside a step: answered at once)
        self._step_texts: list[tuple[Live, int | None, object]] | None = None
        # host seconds of step() by part: the engine's step, batched attention passes, and the rest (the methods'
        # own logic: sentence splitting, thresholds, query building, prompt assembly)
        self.step_seconds = {"engine": 0.0, "attention_passes": 0.0, "methods_and_other": 0.0,
                             "waiting_text_workers": 0.0}
        self._todo: deque[Ticket] = deque()
        self._live: dict[int, Live] = {}
        self._by_seq: dict[int, tuple[Live, int | None]] = {}  # id(seq) -> (question, Parallel part or None)
        self._tickets: dict[int, Ticket] = {}  # id(live) -> ticket
        # results to hand over at the next step: reused generations (known at dispatch), and with overlap all
        self._ready: list[tuple[Live, int | None, object]] = []
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
            raise ValueError("no policy: pass one to QuestionLoop(...) or to submit()")
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
        self.search.close()
        for lv, i, r in self.texts.close():  # texts still out: asked again by the next step, if there is one
            if id(lv) in self._live:
                lv.queued.append((i, r))

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
        if not self.batch_texts or not self.texts.in_step or self._step_texts is not None:
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

    def _answer_step_texts(self) -> bool:
        """Answer the text requests of this step so far in one pass a kind (and those their answers lead to); with
        text_groups, send them to the workers as one group instead (answered when the whole group is back)."""
        any_ = False
        while self._step_texts:
            items, self._step_texts = self._step_texts, []
            if self.texts.send_group(items):
                return True
            for (lv, i, r), value in zip(items, self.texts.compute([(r.kind, r.text) for _, _, r in items])):
                if id(lv) in self._live:
                    self._hand_text(lv, i, value, now=True)
            any_ = True
        return any_


    def _step(self) -> bool:
        t0 = time.perf_counter()
        t_eng = t_attn = t_wait = 0.0
        progressed = False
        launched = None
        txt, srch, eng = self.texts, self.search, self.engine
        if self.overlap and eng.has_work:
            te = time.perf_counter()
            launched = eng.step_launch()
            t_eng += time.perf_counter() - te
            t_window = time.perf_counter()
            progressed = True
            if self.sync_watch is not None:
                self.sync_watch.start()  # (until step_finish, which waits by design)
        while self._todo and len(self._live) < self.max_inflight:
            t = self._todo.popleft()
            lv = Live(t.example, t.policy(t.example), {}, time.perf_counter(), t.on_result, t.on_event)
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
                if launched is None and self.overlap and not passes:
                    pass_row = eng.trace_passes_step()
                    t_window = ta
                passes.append((items, eng.attention_passes_launch([r.ids for _, _, r in items], kind)))
                t_attn += time.perf_counter() - ta
                progressed = True
        self._submit_texts()  # (texts queued for workers that have since failed run here)
        if launched is not None:  # retrieval: a batch of what is known now runs beside the device's step
            self._submit_search()
        # while the device still runs: hand the texts the workers finish to their questions at once (what those
        # questions ask for next joins this step where it can: generations start, texts go out)
        def device_busy() -> bool:
            return (launched is not None and not eng.step_done(launched)) or any(not p.done() for _, p in passes)

        if txt.out and (launched is not None or passes):
            while txt.out and device_busy():
                if txt.collect(True, self._hand_text):
                    progressed = True
                    self._submit_texts()
                    self._answer_step_texts()  # (text_groups: the texts those answers ask for, as a new group)
                else:
                    t_wait += txt.wait_briefly()
        if pass_row is not None:  # the host's time between the passes' launch and their wait
            pass_row["window_s"] = time.perf_counter() - t_window
        for items, pending in passes:
            ta = time.perf_counter()
            res = eng.attention_passes_finish(pending)
            t_attn += time.perf_counter() - ta
            for (lv, i, _), r in zip(items, res):
                self._result(lv, i, r)
        # retrieval: submit a batch if fewer than search_concurrency are in flight (without overlap, with the
        # queries the attention passes just led to); collect the finished ones (when nothing else can move, wait
        # for the first to finish)
        self._submit_search()
        if srch.in_flight and self.wait_for_search and not srch.any_done() \
                and not (eng.has_work or launched or self._ready or txt.out):
            srch.wait_first()
        done = srch.collect()
        if done:
            progressed = True
        self._searched(done)
        finished = []
        if launched is None and not self.overlap:
            self._answer_step_texts()  # (the generations their answers start join this step's engine step)
        row = None if launched is None else launched.trace_row
        if pass_row is not None:
            row, pass_row["passes_s"] = pass_row, t_attn
        if launched is not None:
            if self.sync_watch is not None:
                self.sync_watch.stop()
            te = time.perf_counter()
            if row is not None:  # the host's time between the launch and the wait (the passes' wait included)
                row["window_s"], row["passes_s"] = te - t_window, t_attn
            finished = eng.step_finish(launched)
            t_eng += time.perf_counter() - te
        elif not self.overlap and eng.has_work:
            te = time.perf_counter()
            finished = eng.step()
            t_eng += time.perf_counter() - te
            progressed = True
        for seq in finished:
            self._finished(seq)
        if txt.out:
            # texts back since: to their questions (with overlap at the next step). When nothing else can move,
            # wait for the first text or the search in flight
            if not (progressed or finished or eng.has_work or self._ready):
                tw = time.perf_counter()
                wait(txt.futures() + srch.futures(), timeout=None if self.wait_for_search else 0.05,
                     return_when=FIRST_COMPLETED)
                t_wait += time.perf_counter() - tw
                progressed = True
            if txt.collect(False, self._hand_text):
                progressed = True
        if self._answer_step_texts():
            progressed = True
        sec = self.step_seconds
        sec["engine"] += t_eng
        sec["attention_passes"] += t_attn
        t_wait += txt.take_lockstep_wait()  # (the step's texts on the workers in lockstep: this thread only waited)
        sec["waiting_text_workers"] += t_wait
        t_end = time.perf_counter()
        sec["methods_and_other"] += t_end - t0 - t_eng - t_attn - t_wait
        if row is not None:
            row["step_s"] = t_end - t0
        if not progressed and self._live and not srch.in_flight and not txt.out:
            stuck = [type(lv.request).__name__ for lv in self._live.values()]
            raise RuntimeError(f"scheduler made no progress; pending requests: {stuck}")
        return progressed

    def _submit_search(self) -> None:
        if self.search.full:
            return
        items = self._take(Search)
        if items:
            for lv, _, r in items:
                self._emit(lv, "search", {"query": r.query, "k": r.k})
            self.search.submit(items)

    def _submit_texts(self) -> None:
        self.texts.submit(self._take(TEXT_REQUESTS), self._hand_text)
