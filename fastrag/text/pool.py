"""The methods' spaCy work (sentence splits, real words) on worker processes.

On a GPU the scheduler runs the methods' host logic while the device decodes the next step (QuestionLoop.overlap);
spaCy is most of that logic (DRAGIN: a sentence split of every generation, POS tags of the triggering sentence and of
the query text), and one Python process runs it one text at a time. A `TextPool` spreads the texts of all questions
over worker processes, each with its own copy of the pipeline, so the host logic of a step shrinks with the number
of workers and stays inside the device's step time.

The results are the ones the calls in this process give (the same model, the same functions: `split_sentences`,
`real_words`); only where they run changes. A worker is `python -m fastrag.text.pool`, fed length-prefixed pickled
frames on its stdin and answering on its stdout. Unlike multiprocessing's spawn and forkserver methods, this never
imports the caller's main module in the worker (a script without an `if __name__ == "__main__"` guard would run
again there), and unlike fork it copies nothing of a process that has initialised CUDA or runs threads. Writes go
through a thread per worker, so `submit` never blocks on a full pipe.
"""

from __future__ import annotations

import importlib
import itertools
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool

from fastrag.settings import setting

# what a worker can compute: kind -> (module, function) of one text
KINDS = {"sentences": ("fastrag.text.sentences", "split_sentences"),
         "real_words": ("fastrag.text.realwords", "real_words")}
# the same through one nlp.pipe pass over several texts (equal results, text for text)
BATCH_KINDS = {"sentences": ("fastrag.text.sentences", "split_sentences_batch"),
               "real_words": ("fastrag.text.realwords", "real_words_batch")}

_BATCH = "__batch__"  # a frame holding several (kind, text) items: answered with compute_texts, in order
# A text's estimated cost on a worker, in characters: its length plus a fixed part. Within a share's nlp.pipe pass
# spaCy's time per text is about linear in its length, splitting into sentences and tagging alike: a time per
# character plus 10-15 characters' worth a text (benchmarks/results/text_groups_cpu.md)
TEXT_COST_FIXED = 20
_READY = -1  # the id of a worker's first frame: its pipeline is loaded (request ids count from 0)
TEXT_LOCKSTEP_ENV = "FASTRAG_TEXT_LOCKSTEP"
TEXT_GROUPS_ENV = "FASTRAG_TEXT_GROUPS"
# the most worker processes a run starts by itself (auto_text_workers): the count the GPU runs were measured with
AUTO_TEXT_WORKERS_MAX = 8

__all__ = ["AUTO_TEXT_WORKERS_MAX", "KINDS", "TEXT_GROUPS_ENV", "TEXT_LOCKSTEP_ENV", "BrokenProcessPool", "TextPool",
           "auto_text_workers", "compute_text", "compute_texts", "failure_message", "is_failure", "run_text",
           "text_groups_requested", "text_lockstep_requested", "usable_cpus"]


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the platform has one, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (macOS, Windows)
        return os.cpu_count() or 1


def auto_text_workers(device, cpus: int | None = None) -> int:
    """The text workers a run starts when it is not told (`fastrag run` without --text-workers): none on a CPU,
    where the workers' spaCy takes its cores from the engine's own threads (on 2 cores, workers gained nothing:
    docs/performance.md); on a GPU, where the engine's steps leave the host's cores idle, one a core beyond two (the
    scheduler's thread and the search thread), at most AUTO_TEXT_WORKERS_MAX (8 workers in groups shortened a DRAGIN
    run on a 16-core GPU host: docs/performance.md). device: a torch.device or its name; cpus: the host's CPUs
    (default: this process's, `usable_cpus`)."""
    kind = device if isinstance(device, str) else getattr(device, "type", None)
    if kind is None or str(kind).split(":")[0] != "cuda":
        return 0
    if cpus is None:
        cpus = usable_cpus()
    return max(0, min(AUTO_TEXT_WORKERS_MAX, int(cpus) - 2))


def text_lockstep_requested() -> bool:
    """$FASTRAG_TEXT_LOCKSTEP (QuestionLoop(text_lockstep=None)), a switch."""
    return setting(TEXT_LOCKSTEP_ENV)


def text_groups_requested() -> bool | None:
    """$FASTRAG_TEXT_GROUPS (QuestionLoop(text_groups=None)): 1 groups, 0 free-running workers, unset None (the
    loop's default: groups unless lockstep is asked for)."""
    return setting(TEXT_GROUPS_ENV)


_HEADER = struct.Struct("<Q")


def run_text(kind: str, text: str):
    """One text request computed here: split_sentences(text) or real_words(text)."""
    try:
        module, name = KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown text request kind {kind!r}; expected one of {sorted(KINDS)}") from None
    return getattr(importlib.import_module(module), name)(text)


def compute_text(kind: str, text: str):
    """run_text(kind, text), or its failure as a value (`is_failure`): the question that asked fails with it and
    the other texts go on, wherever the text ran."""
    try:
        return run_text(kind, text)
    except Exception as e:  # noqa: BLE001  (handed back to the asking question)
        return _Failed(f"{type(e).__name__}: {e}")


def compute_texts(items: list[tuple[str, str]]) -> list:
    """`[compute_text(kind, text) for kind, text in items]`, each kind's texts through one `nlp.pipe` pass: texts split
    and tagged together take less time than one call each, the more so the more texts (benchmarks/gpu/NOTES.md). A
    pass that raises (a text spaCy rejects) is done again text by text, so the failure stays with the text that
    caused it."""
    out: list = [None] * len(items)
    groups: dict[str, list[int]] = {}
    for j, (kind, text) in enumerate(items):
        if kind in BATCH_KINDS and isinstance(text, str) and text.strip():
            groups.setdefault(kind, []).append(j)
        else:  # (blank texts and unknown kinds: what the one-text call says)
            out[j] = compute_text(kind, text)
    for kind, js in groups.items():
        texts = [items[j][1] for j in js]
        values = None
        if len(js) > 1:
            module, name = BATCH_KINDS[kind]
            try:
                values = getattr(importlib.import_module(module), name)(texts)
            except Exception:  # noqa: BLE001  (one text's failure: found again below, text by text)
                values = None
        if values is None:
            values = [compute_text(kind, t) for t in texts]
        for j, v in zip(js, values):
            out[j] = v
    return out


class _Failed:
    """A text request that raised: its message (the asking question fails with it)."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message

    def __reduce__(self):
        return (_Failed, (self.message,))


def is_failure(x) -> bool:
    return isinstance(x, _Failed)


def failure_message(x) -> str:
    return x.message


def _write_frame(f, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_HEADER.pack(len(data)) + data)
    f.flush()


def _read_frame(f):
    """The next frame's object; None at the end of the stream (or a torn frame)."""
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(head)
    data = f.read(n)
    if len(data) < n:
        return None
    return pickle.loads(data)


class _Worker:
    def __init__(self, index: int, env: dict):
        self.proc = subprocess.Popen([sys.executable, "-m", "fastrag.text.pool"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self.pending: dict[int, Future] = {}
        self.costs: dict[int, int] = {}  # the estimated cost of each pending request (text_cost)
        self.lock = threading.Lock()
        self.broken: str | None = None
        self.ready = False  # its pipeline is loaded (the worker says so before its first answer)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.writer = threading.Thread(target=self._write, name=f"fastrag-text-writer-{index}", daemon=True)
        self.reader = threading.Thread(target=self._read, name=f"fastrag-text-reader-{index}", daemon=True)
        self.writer.start()
        self.reader.start()

    def _write(self) -> None:
        try:
            while True:
                frame = self.outbox.get()
                if frame is None:
                    break
                _write_frame(self.proc.stdin, frame)
        except (BrokenPipeError, OSError, ValueError):
            pass  # the worker is gone: the reader sees the end of its output and fails what waits
        finally:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def _read(self) -> None:
        why = None
        try:
            while True:
                msg = _read_frame(self.proc.stdout)
                if msg is None:
                    break
                rid, value = msg
                if rid == _READY:
                    self.ready = True
                    continue
                with self.lock:
                    fut = self.pending.pop(rid, None)
                    self.costs.pop(rid, None)
                if fut is not None and fut.set_running_or_notify_cancel():
                    fut.set_result(value)
        except BaseException as e:  # noqa: BLE001  (whatever stops this reader, nothing may wait on it forever:
            # a worker whose answers cannot be read is stopped, and what waits on it fails below)
            why = f"{type(e).__name__}: {e}"
            self.proc.kill()
        code = self.proc.wait()
        with self.lock:
            self.broken = f"text worker pid {self.proc.pid} exited with code {code}" + \
                (f" (its reader failed: {why})" if why else "")
            left, self.pending = self.pending, {}
            self.costs = {}
        for fut in left.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(BrokenProcessPool(self.broken))

    def submit(self, rid: int, kind: str, text, cost: int) -> Future:
        fut = Future()
        with self.lock:
            if self.broken is not None:
                raise BrokenProcessPool(self.broken)
            self.pending[rid] = fut
            self.costs[rid] = cost
        self.outbox.put((rid, kind, text))
        return fut

    def backlog(self) -> int:
        """The estimated cost of what this worker has not answered yet (text_cost of each text)."""
        with self.lock:
            return sum(self.costs.values())


def text_cost(text) -> int:
    """The estimated cost of one text request on a worker: its characters plus TEXT_COST_FIXED."""
    return (len(text) if isinstance(text, str) else 0) + TEXT_COST_FIXED


def balanced_shares(costs: list[int], backlogs: list[int]) -> list[list[int]]:
    """The items of `costs` split over workers that already hold `backlogs` of work, so that the last worker to
    finish finishes as early as it can: the longest item first, each to the worker whose backlog plus share is the
    least so far (ties to the lower index). Returns each worker's item indices in increasing order (a worker may get
    none)."""
    if not backlogs:
        raise ValueError("balanced_shares needs at least one worker")
    load = list(backlogs)
    shares: list[list[int]] = [[] for _ in backlogs]
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        w = min(range(len(load)), key=lambda i: (load[i], i))
        shares[w].append(j)
        load[w] += costs[j]
    for sh in shares:
        sh.sort()
    return shares


class TextPool:
    """`workers` spaCy processes; `submit(kind, text)` returns a Future of `run_text(kind, text)` (a failure of the
    text comes back as a value: `is_failure`, `failure_message`; a dead worker as BrokenProcessPool)."""

    def __init__(self, workers: int):
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"TextPool: workers must be an int >= 1, got {workers!r}")
        self.workers = workers
        env = dict(os.environ)
        # the workers import this very fastrag, however this process found it (installed, or a checkout on the path)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env.setdefault("OMP_NUM_THREADS", "1")
        self._workers = [_Worker(i, env) for i in range(workers)]
        self._ids = itertools.count()
        self._closed = False
        self.texts = 0

    def _live(self, kinds, call: str) -> list[_Worker]:
        """The workers still alive, once the kinds asked for and the pool's state are checked."""
        for kind in kinds:
            if kind not in KINDS:
                raise ValueError(f"unknown text request kind {kind!r}; expected one of {sorted(KINDS)}")
        if self._closed:
            raise RuntimeError(f"TextPool: {call} after shutdown")
        live = [w for w in self._workers if w.broken is None]
        if not live:
            raise BrokenProcessPool(self._workers[0].broken or "no text worker left")
        return live

    def submit(self, kind: str, text: str) -> Future:
        live = self._live([kind], "submit")
        self.texts += 1
        return min(live, key=_Worker.backlog).submit(next(self._ids), kind, text, text_cost(text))

    @property
    def ready(self) -> int:
        """Workers alive with their pipeline loaded (each takes a few seconds to start)."""
        return sum(w.ready and w.broken is None for w in self._workers)

    @property
    def broken(self) -> str | None:
        """Why the pool can compute nothing more (every worker gone), else None."""
        if self._closed:
            return "the pool was shut down"
        return None if any(w.broken is None for w in self._workers) else self._workers[0].broken

    def compute_texts(self, items: list[tuple[str, str]]) -> list:
        """`compute_texts(items)` (this module's) on the workers: the items split into shares as `submit_texts`
        splits them, each share one frame through one nlp.pipe pass a kind, then all waited for. Raises
        BrokenProcessPool when a worker dies meanwhile (the caller computes the items itself)."""
        return self.submit_texts(items).result()

    def submit_texts(self, items: list[tuple[str, str]]) -> Future:
        """`compute_texts(items)` without waiting: the items split over the workers (those with their pipeline
        loaded, when any is) by their estimated cost (`text_cost`), counting what each worker still has to answer
        from earlier calls (`balanced_shares`: the group is back when its last share is, so the shares are sized to
        end together), one frame a share; the Future returned holds the whole list, in the items' order, once every
        share is back (BrokenProcessPool when a worker died meanwhile). One result for the group: whoever waits on
        it gets all the items' values at once."""
        live = self._live([k for k, _ in items], "submit_texts")
        live = [w for w in live if w.ready] or live
        out: Future = Future()
        n = len(items)
        if n == 0:
            out.set_result([])
            return out
        costs = [text_cost(t) for _, t in items]
        plan = [(w, share) for w, share in zip(live, balanced_shares(costs, [w.backlog() for w in live])) if share]
        futs = [w.submit(next(self._ids), _BATCH, [items[j] for j in share], sum(costs[j] for j in share))
                for w, share in plan]
        order = [j for _, share in plan for j in share]  # (the shares' values, concatenated: items at these places)
        self.texts += n
        left = [len(futs)]
        lock = threading.Lock()

        def share_done(_f) -> None:  # (on a reader thread: the last share back settles the group)
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            if not out.set_running_or_notify_cancel():
                return
            got: list = []
            for f in futs:
                try:
                    got += f.result()
                except BaseException as e:  # noqa: BLE001  (a dead worker, a cancelled share)
                    out.set_exception(e if isinstance(e, BrokenProcessPool) else BrokenProcessPool(
                        f"a share of the texts was lost ({type(e).__name__}: {e})"))
                    return
            values: list = [None] * n
            for j, v in zip(order, got):
                values[j] = v
            out.set_result(values)

        for f in futs:
            f.add_done_callback(share_done)
        return out

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def shutdown(self) -> None:
        """Stop the workers (what they still hold is cancelled)."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            w.outbox.put(None)  # the writer closes the worker's stdin: it exits at the end of its input
        for w in self._workers:
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            w.reader.join(timeout=5)
            with w.lock:
                left, w.pending = w.pending, {}
            for fut in left.values():
                fut.cancel()
            if w.proc.stdout is not None:
                w.proc.stdout.close()

    def __del__(self):  # a pool nobody shut down must not leave processes behind
        try:
            if sys.is_finalizing():  # (its reader threads may hold the pipes' locks: stop the processes only)
                for w in self._workers:
                    w.proc.kill()
                return
            self.shutdown()
        except Exception:  # noqa: BLE001  (interpreter teardown)
            pass


def _worker_main() -> None:
    """A worker: load the pipeline, then answer (id, kind, text) frames until stdin ends."""
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # anything printed goes to stderr, never into the frames
    # spaCy's small English pipeline runs on numpy; thinc would import torch (seconds, ~300 MB) only to offer it
    sys.modules.setdefault("torch", None)
    from fastrag.text.nlp import get_nlp

    get_nlp()
    _write_frame(out, (_READY, None))
    while True:
        msg = _read_frame(inp)
        if msg is None:
            break
        rid, kind, text = msg
        _write_frame(out, (rid, compute_texts(text) if kind == _BATCH else compute_text(kind, text)))


if __name__ == "__main__":
    # run as the package's module, not as __main__, so that what the frames carry (_Failed) unpickles in the caller
    from fastrag.text.pool import _worker_main as main

    main()
