"""The question loop's retrieval: batches of queries to the retriever on worker threads.

Each batch holds the queries known when it left and runs on its own thread, overlapping the decode steps of the
other questions; up to `concurrency` batches are in flight at once, so that one slow search does not hold back the
retrievals asked for after it. A retriever's answer is checked before it reaches a question: a query whose
retrieval fails gets a SearchFailure in place of its documents (its question ends, the others go on).
"""

from __future__ import annotations

import threading
import time
import warnings
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from fastrag.loop.requests import Search, SearchFailure
from fastrag.retrieval.base import Retriever


class SearchService:
    """Retrieval batches in flight for one question loop: `submit` a batch, `collect` the finished ones in order.

    Counters: `batches` (queries in each batch), `seconds` (summed over the batches; concurrent batches overlap).
    """

    def __init__(self, retriever, concurrency: int | None = None):
        self.retriever = retriever
        # retrieval batches in flight at once, each on its own thread; None: what the retriever says it serves
        # (Retriever.concurrent_searches: 1, one batch at a time, unless the retriever is safe to call from several
        # threads and its backend serves calls in parallel). Anything else that answers search() (or None, for
        # policies that never search) gets 1
        if concurrency is None:
            concurrency = retriever.concurrent_searches if isinstance(retriever, Retriever) else 1
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"search_concurrency must be an int >= 1, got {concurrency!r}")
        self.concurrency = concurrency
        self.batches: list[int] = []
        self.seconds = 0.0
        self._lock = threading.Lock()
        self.executor: ThreadPoolExecutor | None = None  # (started at the first batch)
        self.in_flight: list[tuple[Future, list]] = []  # (future, the batch's (question, part, Search)), oldest first

    @property
    def full(self) -> bool:
        """Whether `concurrency` batches are in flight (a new one waits)."""
        return len(self.in_flight) >= self.concurrency

    def submit(self, items: list) -> None:
        """One batch: items are (question, part index, Search); its result lists come back in their order."""
        if self.executor is None:
            self.executor = ThreadPoolExecutor(max_workers=self.concurrency)
        self.in_flight.append((self.executor.submit(self.run, [r for _, _, r in items]), items))

    def futures(self) -> list[Future]:
        return [f for f, _ in self.in_flight]

    def any_done(self) -> bool:
        return any(f.done() for f, _ in self.in_flight)

    def wait_first(self) -> None:
        """Block until a batch in flight finishes."""
        wait(self.futures(), return_when=FIRST_COMPLETED)

    def collect(self) -> list[tuple[Future, list]]:
        """Take the finished batches off the in-flight list, in the order they were submitted."""
        ended = [x[0].done() for x in self.in_flight]  # (read once: a batch may finish meanwhile)
        done = [x for x, e in zip(self.in_flight, ended) if e]
        if done:
            self.in_flight = [x for x, e in zip(self.in_flight, ended) if not e]
        return done

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None
        self.in_flight = []

    def run(self, reqs: list[Search]):
        """One batched retrieval. If the batch raises, each query is asked alone, so that only the queries whose
        retrieval fails (a SearchFailure in their place) end their questions."""
        t = time.perf_counter()
        try:
            out = result_lists(self.retriever.search([r.query for r in reqs], max(r.k for r in reqs)), len(reqs))
        except Exception:
            out = None
        if out is None or any(isinstance(d, SearchFailure) for d in out):
            # the batch raised, or returned something unusable for some query: each query alone, so that only
            # those whose retrieval really fails (a SearchFailure in their place) end their questions
            out = []
            for r in reqs:
                try:
                    out += result_lists(self.retriever.search([r.query], r.k), 1, strict=True)
                except Exception as e:
                    out.append(SearchFailure(f"{type(e).__name__}: {e}"))
            failed = [d for d in out if isinstance(d, SearchFailure)]
            if failed:
                warnings.warn(f"retrieval failed for {len(failed)} of {len(reqs)} queries ({failed[0].message}); "
                              "their questions end with an error, the others go on", RuntimeWarning, stacklevel=2)
        out = [d if isinstance(d, SearchFailure) else d[: r.k] for d, r in zip(out, reqs)]
        with self._lock:  # (concurrent batches finish on several threads)
            self.seconds += time.perf_counter() - t
            self.batches.append(len(reqs))
        return out


def result_lists(out, n: int, strict: bool = False) -> list:
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
