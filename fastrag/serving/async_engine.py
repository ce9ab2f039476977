"""An asyncio front to the engine: many concurrent requests share one decode batch.

One worker thread owns the engine and the question loop (neither is thread-safe) and loops: admit submitted questions,
apply cancellations, `QuestionLoop.step()`; when idle it blocks on its inbox. Each request gets an asyncio queue the
worker fills through `loop.call_soon_threadsafe`, and `submit` returns an async iterator over its events:

    Event("token", {"text", "token_id", "branch"})       a decoded token of the current generation
    Event("generate", {"prompt_tokens", "branch"})       a generation starts (a new round)
    Event("search", {"query", "k"})                      the method decided to retrieve
    Event("documents", {"query", "doc_ids", "titles"})   what the retriever returned
    Event("answer", {"result": QuestionResult.to_json()})the final answer and the whole trace (always last)
    Event("error", {"message"})                          the question failed (last)

Leaving the iterator early (`break`, `aclose()`, a client that disconnects, `asyncio.timeout`), or dropping it
unread, cancels the question: its sequences leave the batch and their KV blocks go back to the pool.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import queue
import threading
import time
import traceback
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from fastrag.cache.kv import OutOfBlocks


@dataclass(slots=True)
class Event:
    kind: str
    data: dict = field(default_factory=dict)


class EventStream:
    """One question's events (what `AsyncEngine.submit` returns), an async iterator that ends after its answer or
    error event. The question is cancelled when the stream ends before that: `aclose()`, an exception or a
    cancellation (`asyncio.timeout`) while waiting for an event, or the stream dropped by its owner, read or not
    (`break` out of `async for` and let it go)."""

    __slots__ = ("_out", "_ended", "_cancel", "__weakref__")

    def __init__(self, out: asyncio.Queue, handle: dict, cancel: Callable[[dict], None]):
        self._out = out
        self._ended = False
        self._cancel = weakref.finalize(self, cancel, handle)  # (holds the handle, not the stream)
        self._cancel.atexit = False

    def __aiter__(self) -> "EventStream":
        return self

    async def __anext__(self) -> Event:
        if self._ended:
            raise StopAsyncIteration
        try:
            ev = await self._out.get()
        except BaseException:  # cancelled while waiting: the reader is gone
            await self.aclose()
            raise
        if ev.kind in ("answer", "error"):
            self._ended = True
            self._cancel.detach()  # (it has ended: nothing to cancel)
        return ev

    def ready(self) -> bool:
        """Whether the next `__anext__` returns (or ends the stream) without waiting: an event is queued, or the
        stream has ended."""
        return self._ended or not self._out.empty()

    async def aclose(self) -> None:
        """End the stream; a question still running is cancelled."""
        self._ended = True
        self._cancel()  # (once: a finalizer runs at most once)


class QueueFull(RuntimeError):
    """The admission queue is full; retry after `retry_after` seconds (`retry_after_s`: rounded up, as the message
    and the HTTP Retry-After header say it)."""

    def __init__(self, retry_after: float):
        self.retry_after = retry_after
        self.retry_after_s = math.ceil(retry_after)
        super().__init__(f"admission queue full; retry after {self.retry_after_s}s")


class ServiceRate:
    """Questions that left the engine (answered, failed or cancelled: each frees a place) a second while it had work,
    over the last `window_s` seconds of that busy time: the rate a full queue drains at now.

    The clock stops while nothing is pending, so an idle server keeps the rate of its last busy spell instead of
    spreading it over the idle hours (answers / uptime did, and told clients minutes for a queue that drained in
    seconds), and answers older than a window of busy time stop counting, so a slower or faster load shows within a minute.
    """

    __slots__ = ("window_s", "_clock", "_busy_before", "_since", "_done")

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.perf_counter):
        self.window_s = window_s
        self._clock = clock
        self._busy_before = 0.0  # busy seconds of the busy spells that ended
        self._since: float | None = None  # the clock when the current busy spell began (None: idle)
        self._done: deque[float] = deque()  # busy-clock times of the recent answers

    def _busy(self) -> float:
        return self._busy_before + (self._clock() - self._since if self._since is not None else 0.0)

    def _trim(self, busy: float) -> None:
        while self._done and self._done[0] <= busy - self.window_s:
            self._done.popleft()

    def started(self) -> None:
        """A question arrived at an idle engine: the busy clock runs again."""
        if self._since is None:
            self._since = self._clock()

    def finished(self, idle: bool) -> None:
        """A question ended (answered, failed or cancelled); `idle`: none is left, the busy clock stops."""
        busy = self._busy()
        self._done.append(busy)
        self._trim(busy)
        if idle:
            self._busy_before, self._since = busy, None

    def per_s(self) -> float | None:
        """Questions a second over the window (None before the first answer, or none within a window)."""
        busy = self._busy()
        self._trim(busy)
        span = min(self.window_s, busy)
        return len(self._done) / span if self._done and span > 0 else None


@dataclass(slots=True)
class _Question:
    qid: str
    question: str
    answers: list[str] = field(default_factory=list)
    dataset: str = "hotpotqa"
    meta: dict = field(default_factory=dict)


class AsyncEngine:
    """`await AsyncEngine.submit(question, method=..., dataset=..., config=...)` -> async iterator of `Event`.

    engine, retriever: a built `fastrag.engine.Engine` and a `Retriever`. max_inflight: questions served at once
    (the rest wait in the admission queue, at most max_queue of them; beyond that `submit` raises QueueFull).
    search_concurrency: retrieval batches in flight at once (None: the retriever's `concurrent_searches`).
    """

    MAX_POLICIES = 256  # distinct (method, dataset, config) kept ready
    RETRY_AFTER_MAX_S = 60.0  # a longer wait is no more accurate: the client asks again and gets a fresh figure
    RETRY_AFTER_UNKNOWN_S = 5.0  # nothing answered yet to measure a rate by

    def __init__(self, engine, retriever, max_inflight: int = 64, max_queue: int = 256,
                 search_concurrency: int | None = None):
        from fastrag.loop import QuestionLoop

        if max_inflight <= 0 or max_queue < 0:
            raise ValueError("max_inflight must be > 0 and max_queue >= 0")
        self.engine, self.retriever = engine, retriever
        self.max_queue = max_queue
        # (a retrieval in flight never blocks the worker: it admits, cancels and times out requests meanwhile)
        self.loop = QuestionLoop(engine, retriever, max_inflight=max_inflight, wait_for_search=False,
                              search_concurrency=search_concurrency)
        self._inbox: queue.Queue = queue.Queue()
        # (method, dataset, config) -> [policy, its shared prefix in the engine or None]; the least recently used
        # go beyond MAX_POLICIES (a question in flight keeps its own policy)
        self._policies: OrderedDict[tuple, list] = OrderedDict()
        self._ids = itertools.count()
        self._pending = 0  # submitted, not yet finished (admission control)
        self._handles: dict[int, dict] = {}  # requests the worker holds (worker thread only)
        self._lock = threading.Lock()
        self._closed = False
        self.stats = {"submitted": 0, "finished": 0, "failed": 0, "cancelled": 0, "rejected": 0,
                      "tokens": 0, "retrievals": 0}
        self._t0 = time.perf_counter()
        self._rate = ServiceRate()
        self._thread = threading.Thread(target=self._worker, name="fastrag-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API
    def policy(self, method: str, dataset: str, config: dict | None = None):
        """The policy serving (method, dataset, config); validates the names (ValueError names the bad one)."""
        from fastrag.data.datasets import canonical_dataset
        from fastrag.methods.registry import get_method, make_config

        spec = get_method(method)
        dataset = canonical_dataset(dataset)
        if isinstance(config, dict) and "dataset" in config:  # (a published config file's own field)
            try:
                named = canonical_dataset(config["dataset"])
            except (ValueError, TypeError, AttributeError) as e:
                raise ValueError(f"retrieval.config.dataset: {e}") from None
            if named != dataset:
                raise ValueError(f"retrieval.config.dataset is {named!r} but the request's dataset is {dataset!r}")
        key = (method, dataset, json.dumps(config, sort_keys=True) if config else None)
        if key not in self._policies:
            if config and not isinstance(config, dict):
                raise ValueError("retrieval.config must be a JSON object")
            cfg = make_config(method, dataset, config or None, name="retrieval.config")
            self._policies[key] = [spec.make_policy(cfg, self.engine.tok), None]
            while len(self._policies) > self.MAX_POLICIES:
                self._policies.popitem(last=False)
        self._policies.move_to_end(key)
        return key

    async def submit(self, question: str, method: str = "dragin", dataset: str = "hotpotqa",
                     config: dict | None = None, qid: str | None = None) -> EventStream:
        if self._closed:
            raise RuntimeError("the engine is closed")
        if not self.alive:
            raise RuntimeError("the engine's worker thread has stopped (an error it could not recover from: see the "
                               "log); make a new AsyncEngine")
        if not isinstance(question, str) or not question.strip():
            raise ValueError("question must be a non-empty string")
        key = self.policy(method, dataset, config)
        with self._lock:
            if self._pending >= self.max_queue + self.loop.max_inflight:
                self.stats["rejected"] += 1
                raise QueueFull(retry_after=self._eta())
            if self._pending == 0:
                self._rate.started()
            self._pending += 1
            self.stats["submitted"] += 1
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        q = _Question(qid=qid or f"req-{next(self._ids)}", question=question, dataset=key[1])
        handle = {"ticket": None, "finished": False, "policy": self._policies[key][0]}

        def push(ev: Event):
            try:
                loop.call_soon_threadsafe(out.put_nowait, ev)
            except RuntimeError:  # the client's event loop is closed: nobody reads this stream, its question ends
                self._cancel(handle)

        self._inbox.put(("submit", key, q, push, handle))
        return EventStream(out, handle, self._cancel)

    def metrics(self) -> dict:
        s = self.loop
        up = time.perf_counter() - self._t0
        return {**self.stats, "queue_depth": s.queued, "inflight": s.inflight,
                "decode_batch": len(self.engine.running), "pending": self._pending, "uptime_s": up,
                "engine": dict(self.engine.stats)}

    @property
    def alive(self) -> bool:
        """Whether the worker thread serves (False after close, or if it died)."""
        return self._thread.is_alive()

    def close(self) -> None:
        self._closed = True
        self._inbox.put(("stop",))
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ internals
    def _eta(self) -> float:
        """Seconds until the questions pending now have drained at the recent service rate (under self._lock): a
        client that waits this long finds room, one that comes back earlier most likely another 429. At least 1 s
        (the header's unit), at most RETRY_AFTER_MAX_S."""
        rate = self._rate.per_s()
        eta = self.RETRY_AFTER_UNKNOWN_S if rate is None else self._pending / rate
        return min(self.RETRY_AFTER_MAX_S, max(1.0, eta))

    def _cancel(self, handle: dict) -> None:
        """Cancel a question whose stream ended early (any thread: the worker applies it)."""
        if not handle["finished"]:
            self._inbox.put(("cancel", handle))

    def _worker(self) -> None:
        s = self.loop
        msg = None
        while True:
            if msg is None:
                try:
                    msg = self._inbox.get(block=not s.busy, timeout=None)
                except queue.Empty:
                    msg = None
            while msg is not None:
                if msg[0] == "stop":
                    self._close_all()
                    s.close()
                    return
                try:
                    self._handle(msg)
                except Exception as e:  # this request fails; the worker serves on
                    if msg[0] == "submit":
                        handle = msg[4]
                        self._done(handle, "failed")
                        msg[3](Event("error", {"message": f"{type(e).__name__}: {e}"}))
                    else:
                        traceback.print_exc()
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    msg = None
            if s.busy:
                try:
                    progressed = s.step()
                except Exception as e:  # an engine failure: fail every question in flight, keep serving
                    self._fail_all(f"{type(e).__name__}: {e}")
                    continue
                if not progressed:  # only a retrieval in flight: wait a little for a message (handled at the top
                    try:           # of the loop), then look again
                        msg = self._inbox.get(timeout=0.005)
                    except queue.Empty:
                        msg = None

    def _handle(self, msg) -> None:
        if msg[0] == "cancel":
            handle = msg[1]
            t = handle.get("ticket")
            if t is not None and self.loop.cancel(t):
                self._done(handle, "cancelled")
            return
        _, key, q, push, handle = msg
        policy = handle["policy"]
        entry = self._policies.get(key)
        if entry is not None and entry[0] is policy:
            entry[1] = self._shared_prefix(policy, entry[1])
        else:  # its entry went (least recently used): the prefix is looked up again
            self._shared_prefix(policy, None)

        def on_event(kind, data):
            if kind == "token":
                self.stats["tokens"] += 1
            elif kind == "search":
                self.stats["retrievals"] += 1
            push(Event(kind, data))

        def on_result(r):
            if r.error is not None:
                self._done(handle, "failed")
                push(Event("error", {"message": r.error, "result": r.to_json()}))
            else:
                self._done(handle, "finished")
                push(Event("answer", {"result": r.to_json()}))

        handle["push"] = push
        handle["ticket"] = self.loop.submit(q, on_result, policy=policy, on_event=on_event)
        self._handles[id(handle)] = handle

    def _shared_prefix(self, policy, held):
        """The engine's shared prefix for the policy's demos: the one it holds, else computed now. The engine
        drops the prefixes no question uses when it needs their room, so a later request computes it again. If
        the pool has no room for it now, the question runs without one (its prompt's blocks are computed, and
        shared with its family's next questions through the prefix cache)."""
        if held is not None and any(p is held for p in self.engine.prefixes):
            return held
        try:
            return self.engine.set_prefix(policy.shared_prefix)
        except OutOfBlocks:
            return None

    def _done(self, handle: dict, how: str) -> None:
        self._handles.pop(id(handle), None)
        if handle.get("finished"):
            return
        handle["finished"] = True
        with self._lock:
            self._pending -= 1
            self.stats[how] += 1
            self._rate.finished(idle=self._pending == 0)

    def _close_all(self) -> None:
        """The engine is closing: every question it holds or has not yet taken ends with an error event (their
        streams would wait for ever otherwise)."""
        for handle in list(self._handles.values()):
            self.loop.cancel(handle["ticket"])
            self._done(handle, "failed")
            handle["push"](Event("error", {"message": "the engine is closed"}))
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "submit":
                self._done(msg[4], "failed")
                msg[3](Event("error", {"message": "the engine is closed"}))

    def _fail_all(self, message: str) -> None:
        """The engine raised: every question it held ends with an error event; the worker serves on."""
        for handle in list(self._handles.values()):
            self.loop.cancel(handle["ticket"])
            self._done(handle, "failed")
            handle["push"](Event("error", {"message": f"engine failure: {message}"}))
