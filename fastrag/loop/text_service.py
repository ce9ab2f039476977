"""The question loop's spaCy work (`Sentences`, `RealWords` requests) on worker processes (fastrag.text.pool).

With no workers the loop answers text requests on its own thread, a step's texts in one nlp.pipe pass a kind. With
N workers (started at the first text) they go out in one of three modes:
- free-running: each text to the workers as it is asked for, back to its question whenever it is done;
- lockstep: a step's texts gathered as without workers, spread over the workers and waited for (the same steps,
  so the same prefill groups and decisions as without workers);
- groups: a step's texts gathered as in lockstep and sent together, but the step does not wait; the group comes
  back whole at the first step after the last of its texts is done, and meanwhile the device decodes the others.
A pool that fails (a worker killed, processes that cannot start) is given up: the texts run on the loop's thread
from then on.
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Callable

from fastrag.text.pool import (BrokenProcessPool, TextPool, compute_text, compute_texts, text_groups_requested,
                               text_lockstep_requested)

# hand(question, part index or None, value, now): the loop's way to give a text's result to its question
Hand = Callable[[object, "int | None", object, bool], None]


class TextService:
    """The text-worker pool of one question loop and the texts out at it (items are (question, part, request))."""

    def __init__(self, workers: int | TextPool | None = None, lockstep: bool | None = None,
                 groups: bool | None = None):
        # 0 answers text requests on the loop's thread as they come; N > 0 sends them to N worker processes
        # (started at the first request), a TextPool shares one; None: 0. Free-running workers made DRAGIN slower
        # than none: the texts that come back one by one start their prefills in small groups, and each prefill
        # call has a large fixed cost (the first H200 session in benchmarks/results/README.md)
        if workers is None:
            workers = 0
        if isinstance(workers, TextPool):
            self.pool, self.own_pool, self.workers = workers, False, workers.workers
        elif isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"text_workers must be an int >= 0 or a TextPool, got {workers!r}")
        else:
            self.pool, self.own_pool, self.workers = None, True, workers
        # with workers, lockstep answers each step's texts where the loop's own thread would (the same steps,
        # so the same prefill groups and decisions), the step's texts spread over the workers and waited for; off,
        # a text goes to its question whenever it comes back (None: $FASTRAG_TEXT_LOCKSTEP, default off)
        if lockstep is None:
            lockstep = text_lockstep_requested()
        self.lockstep = bool(lockstep)
        # with workers, groups: a step's texts are gathered as in lockstep and sent to the workers together, but the
        # step does not wait for them; the group comes back whole (its questions' next requests start in the same
        # step, as in lockstep) at the first step after the last of its texts is done, and meanwhile the device
        # decodes the other questions. None: $FASTRAG_TEXT_GROUPS, and where that is unset groups unless lockstep
        # is on: groups of workers beat no workers on DRAGIN, where free-running workers lost to none; False
        # (or $FASTRAG_TEXT_GROUPS=0): free-running, each text back to its question whenever it is done
        if groups is None:
            groups = text_groups_requested()
            if groups is None:
                groups = self.workers > 0 and not self.lockstep
        self.groups = bool(groups)
        if self.groups and self.lockstep:
            raise ValueError("text_lockstep and text_groups are two ways to send a step's texts to the workers; "
                             "choose one ($FASTRAG_TEXT_LOCKSTEP, $FASTRAG_TEXT_GROUPS)")
        self.singles: list[tuple[Future, object, int | None, object]] = []  # texts at the workers one by one
        self.sent_groups: list[tuple[Future, list]] = []  # groups at the workers (groups mode)
        self.group_sizes: list[int] = []  # texts in each group sent (groups mode)
        self.requests = 0  # texts answered by the workers
        self.lockstep_wait = 0.0  # host seconds waiting for a step's texts on the workers (lockstep)

    @property
    def in_step(self) -> bool:
        """Whether text requests are gathered by the step that asks for them (no workers, lockstep, groups)."""
        return not self.workers or self.lockstep or self.groups

    @property
    def out(self) -> bool:
        """Whether texts are at the workers (one by one, or in groups)."""
        return bool(self.singles or self.sent_groups)

    def futures(self) -> list[Future]:
        return [f for f, _, _, _ in self.singles] + [f for f, _ in self.sent_groups]

    def wait_briefly(self) -> float:
        """Wait up to half a millisecond for a text at the workers; returns the seconds waited."""
        tw = time.perf_counter()
        wait(self.futures(), timeout=0.0005, return_when=FIRST_COMPLETED)
        return time.perf_counter() - tw

    def take_lockstep_wait(self) -> float:
        """The seconds waited for lockstep texts since the last call."""
        t, self.lockstep_wait = self.lockstep_wait, 0.0
        return t

    def lose_pool(self, err: Exception) -> None:
        if not self.workers:
            return
        warnings.warn(f"the spaCy worker pool failed ({type(err).__name__}: {err}); the methods' text work runs "
                      "on the scheduler's thread from now on", RuntimeWarning, stacklevel=3)
        if self.own_pool and self.pool is not None:
            self.pool.shutdown()
        self.pool, self.workers = None, 0

    def start_pool(self) -> None:
        """The worker pool, started at the first text that needs it (none where processes cannot start: the texts
        are answered on this thread from then on)."""
        if self.pool is None:
            try:
                self.pool = TextPool(self.workers)
            except (OSError, RuntimeError) as e:
                self.lose_pool(e)

    def ready_pool(self) -> TextPool | None:
        """The worker pool (started now if it was not), when a worker of it has loaded its pipeline; else None. A
        pool whose workers all died is given up here (the texts run on this thread from then on)."""
        self.start_pool()
        if self.pool is not None and self.pool.broken is not None:  # every worker died meanwhile
            self.lose_pool(BrokenProcessPool(self.pool.broken))
        return self.pool if self.pool is not None and self.pool.ready else None

    def send_group(self, items: list) -> bool:
        """groups mode: items to the workers as one group, unless no worker has loaded its pipeline yet (then the
        caller computes them here: a step never waits for workers to start). Returns whether they went."""
        if not (self.groups and self.workers) or self.ready_pool() is None:
            return False
        try:
            fut = self.pool.submit_texts([(r.kind, r.text) for _, _, r in items])
        except (BrokenProcessPool, RuntimeError) as e:  # the pool died: this step's texts run here
            self.lose_pool(e)
            return False
        self.sent_groups.append((fut, items))
        self.requests += len(items)
        self.group_sizes.append(len(items))
        return True

    def compute(self, items: list[tuple[str, str]]) -> list:
        """compute_texts(items): in lockstep on the workers (all of them sent, then all waited for), else here. The
        workers start at the first text and load their pipelines meanwhile; until one has, and for a lone text
        (nothing to spread), the texts are computed here: a step never waits for a worker to start."""
        # (the pool starts at the first text, a lone one too)
        if self.lockstep and self.workers and self.ready_pool() is not None and len(items) > 1:
            tw = time.perf_counter()
            try:
                values = self.pool.compute_texts(items)
            except (BrokenProcessPool, RuntimeError) as e:  # the pool died: this step's texts run here
                self.lose_pool(e)
            else:
                self.requests += len(items)
                self.lockstep_wait += time.perf_counter() - tw
                return values
        return compute_texts(items)

    def submit(self, items: list, hand: Hand) -> None:
        """Free-running: each text to the workers; one that cannot go (no pool) is computed here and handed over."""
        if items and self.workers:
            self.start_pool()
        for lv, i, r in items:
            if self.pool is not None:
                try:
                    self.singles.append((self.pool.submit(r.kind, r.text), lv, i, r))
                    self.requests += 1
                    continue
                except (BrokenProcessPool, RuntimeError) as e:  # the pool died (or was shut down)
                    self.lose_pool(e)
            hand(lv, i, compute_text(r.kind, r.text), False)

    def collect(self, now: bool, hand: Hand) -> bool:
        """Hand the finished text requests to their questions (hand(..., now)); a group only once all its texts
        are back (a group back is not held for one sent before it; those back together go in the order they were
        sent). Returns whether any had finished."""
        groups = [x for x in self.sent_groups if x[0].done()]
        if groups:
            ids = {id(x) for x in groups}
            self.sent_groups = [x for x in self.sent_groups if id(x) not in ids]
            for fut, items in groups:
                try:
                    values = fut.result()
                except BrokenProcessPool as e:  # a worker died (submit_texts says so for any lost share): here
                    self.lose_pool(e)
                    values = compute_texts([(r.kind, r.text) for _, _, r in items])
                for (lv, i, _), value in zip(items, values):
                    hand(lv, i, value, now)
        done = [x for x in self.singles if x[0].done()]
        if not done:
            return bool(groups)
        ids = {id(x) for x in done}
        self.singles = [x for x in self.singles if id(x) not in ids]
        for fut, lv, i, r in done:
            try:
                value = fut.result()
            except BrokenProcessPool as e:  # a worker died (killed, out of memory): this and the rest run here
                self.lose_pool(e)
                value = compute_text(r.kind, r.text)
            hand(lv, i, value, now)
        return True

    def close(self) -> list:
        """Cancel the texts still out and return them as (question, part, request), to be asked again; shut down
        a pool this service started (a later text request starts workers again)."""
        out = self.singles + [(fut, lv, i, r) for fut, items in self.sent_groups for lv, i, r in items]
        for fut, _, _, _ in out:
            fut.cancel()
        self.singles, self.sent_groups = [], []
        if self.pool is not None and self.own_pool:
            self.pool.shutdown()
            self.pool = None
        return [(lv, i, r) for _, lv, i, r in out]
