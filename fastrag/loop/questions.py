"""The questions in flight in a question loop: their state (`Live`, `Ticket`) and the plumbing between a question's
generator and the loop's batches (`QuestionPlumbing`, the base of fastrag.loop.core.QuestionLoop): a request goes
to its batch (dispatch), a result goes back into the generator (deliver, advance), a question ends (finish, fail)
and its sequences leave the engine (release).
"""

from __future__ import annotations

import hashlib
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Callable, Generator

from fastrag.engine import Generation, SeqState, sampling_key
from fastrag.loop.requests import (TEXT_REQUESTS, AttnColmax, AttnRows, Generate, Parallel, Policy, Request, Search,
                                   SearchFailure, check_parallel)
from fastrag.text.pool import compute_text, failure_message, is_failure
from fastrag.trace import QuestionResult


def stable_id(example) -> int:
    """A process-independent integer naming a question: its qid, else its question text, else its repr."""
    name = getattr(example, "qid", None) or getattr(example, "question", None) or repr(example)
    return int.from_bytes(hashlib.blake2b(str(name).encode(), digest_size=8).digest(), "little")


def reused(g: Generation) -> Generation:
    """A copy of g for an identical generation answered from it (its token lists are copied too)."""
    return replace(g, ids=list(g.ids), entropy=list(g.entropy), logprob=list(g.logprob), prefilled=0,
                   attn=None if g.attn is None else list(g.attn), reused=True)


@dataclass(eq=False)
class Live:
    """A question in flight: its generator, its KV sequences and what it waits for."""

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
    """A submitted question (what `QuestionLoop.submit` returns; `QuestionLoop.cancel` takes it)."""

    example: object
    policy: Policy
    on_result: Callable[..., None]
    on_event: Callable[[str, dict], None] | None = None
    live: Live | None = None
    done: bool = False


class QuestionPlumbing:
    """How requests and results move between the questions in flight and the loop's batches. QuestionLoop sets up
    the state this uses (engine, texts, overlap, the question tables, the step's texts)."""

    def _emit(self, lv: Live, kind: str, data: dict) -> None:
        if lv.on_event is not None:
            lv.on_event(kind, data)

    def _drop(self, seq: SeqState) -> None:
        self._by_seq.pop(id(seq), None)
        if seq in self.engine.waiting:
            self.engine.waiting.remove(seq)
        if seq in self.engine.running:
            self.engine.running.remove(seq)
        self.engine.release(seq)

    def _release(self, lv: Live) -> None:
        for seq in [*lv.seqs.values(), *lv.one_shot.values()]:
            self._drop(seq)
        lv.one_shot.clear()
        lv.queued.clear()

    def _finish(self, lv: Live, result: QuestionResult | None, err: str | None = None) -> None:
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

    def _fail(self, lv: Live, message: str) -> None:
        """End a question in flight with an error (nothing if it already ended)."""
        if id(lv) in self._live:
            lv.gen.close()
            self._finish(lv, None, message)

    def _result(self, lv: Live, idx: int | None, value) -> None:
        """A request's result: handed to its question now, or with overlap at the start of the next step (while
        the device runs that step's decode)."""
        if self.overlap:
            self._ready.append((lv, idx, value))
        else:
            self._deliver(lv, idx, value)

    def _hand_text(self, lv: Live, i: int | None, value, now: bool) -> None:
        """A text request's result to its question (`now`: at once, else through _result); a failure ends it."""
        if is_failure(value):
            self._fail(lv, failure_message(value))
        else:
            (self._deliver if now else self._result)(lv, i, value)

    def _deliver(self, lv: Live, idx: int | None, value) -> None:
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

    def _dispatch(self, lv: Live, idx: int | None, req) -> None:
        if isinstance(req, Generate):
            ids = self.engine.tok.encode(req.prompt)
            track_from = len(ids) if req.track_attn else None
            ids += list(req.suffix_ids)
            sp = req.sampling or self.engine.sampling
            greedy = sp is None or sp.temperature <= 0
            key = None
            if req.branch is None and greedy and not req.track_attn and req.hidden_layer is None:
                # greedy decoding is a function of the prompt: a one-shot generation identical to one this question
                # already made (BeamSearchQA summarising the same documents for two sub-questions) is answered from
                # it, nothing prefilled or decoded
                key = (tuple(ids), req.max_new_tokens, req.stop_ids)
                known = lv.memo.get(key)
                if known is not None:
                    lv.generations += 1
                    self.reused_generations += 1
                    self._emit(lv, "generate", {"prompt_tokens": len(ids), "branch": None, "reused": True})
                    if isinstance(known, list):  # the same generation is in flight: answered when it finishes
                        known.append(idx)
                    else:
                        self._ready.append((lv, idx, reused(known)))
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
                # the same tokens whatever shares the batch and whenever retrieval returns (a policy may name
                # the key itself: req.sample_key)
                kw["sample_key"] = req.sample_key if req.sample_key is not None else \
                    sampling_key(stable_id(lv.example), lv.generations)
            for name in ("sampling", "stop_ids", "hidden_layer"):  # (passed only when set: scripted engines)
                if getattr(req, name) is not None:
                    kw[name] = getattr(req, name)
            self.engine.start(seq, ids, req.max_new_tokens, **kw)
            seq.on_token = self._token_hook(lv, req.branch) if lv.on_event is not None else None
            self._emit(lv, "generate", {"prompt_tokens": len(ids), "branch": req.branch})
            lv.generations += 1
        elif isinstance(req, TEXT_REQUESTS) and self.texts.in_step and self._step_texts is not None:
            self._step_texts.append((lv, idx, req))  # a Parallel's part, answered with the step's other texts
        elif isinstance(req, TEXT_REQUESTS) and self.texts.in_step:  # a Parallel's part, answered here
            value = compute_text(req.kind, req.text)
            if is_failure(value):
                self._fail(lv, failure_message(value))
            else:
                lv.results[idx] = value
                lv.left -= 1
        elif isinstance(req, (AttnColmax, AttnRows, Search, *TEXT_REQUESTS)):
            limit = self.engine.max_context
            if isinstance(req, (AttnColmax, AttnRows)) and limit is not None and len(req.ids) > limit:
                # (refused here, not in the batched pass, which would fail every question that shares it)
                raise ValueError(f"an attention pass over {len(req.ids)} tokens exceeds the model context of "
                                 f"{limit} tokens")
            lv.queued.append((idx, req))
        else:
            raise TypeError(f"unknown request {type(req).__name__}; expected Generate, AttnColmax, AttnRows, "
                            "Search, Sentences, RealWords or Parallel")

    def _token_hook(self, lv: Live, branch):
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

    def _advance(self, lv: Live, value) -> None:
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
            if isinstance(req, TEXT_REQUESTS) and self.texts.in_step:  # answered here and now
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
                    check_parallel(req)
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

    def _take(self, cls) -> list[tuple[Live, int | None, Request]]:
        """Pop every queued request of one kind (a class or a tuple of classes), over all questions in flight."""
        items = []
        for lv in list(self._live.values()):
            if any(isinstance(r, cls) for _, r in lv.queued):
                items += [(lv, i, r) for i, r in lv.queued if isinstance(r, cls)]
                lv.queued = [(i, r) for i, r in lv.queued if not isinstance(r, cls)]
        return items

    def _finished(self, seq: SeqState) -> None:
        """A sequence the engine finished: its Generation to its question (and to the identical one-shot
        generations waiting for it); nothing if its question ended while it ran."""
        hit = self._by_seq.get(id(seq))
        if hit is None:
            return
        lv, i = hit
        lv.prefilled += seq.out.prefilled
        lv.decoded += len(seq.out.ids)
        if seq.out.error is not None:  # the engine could not finish it (NaN logits): its question ends
            self._fail(lv, seq.out.error)
            return
        waiting = []
        if lv.one_shot.pop(id(seq), None) is not None:
            self._by_seq.pop(id(seq), None)
            self.engine.release(seq)  # one-shot: its KV is never reused
            key = lv.memo_key.pop(id(seq), None)
            if key is not None:
                # kept as a copy: the policy owns the Generation it is handed and may change it
                waiting, lv.memo[key] = lv.memo[key], reused(seq.out)
        out = seq.out
        self._result(lv, i, out)
        for j in waiting:
            self._result(lv, j, reused(out))

    def _searched(self, done: list) -> None:
        """Finished retrieval batches (in the order they were submitted): each query's documents to its question;
        a query whose retrieval failed ends its question, not the run."""
        for fut, items in done:
            for (lv, i, r), d in zip(items, fut.result()):
                if isinstance(d, SearchFailure):
                    self._fail(lv, f"retrieval of {r.query!r} failed: {d.message}")
                    continue
                if id(lv) in self._live:
                    self._emit(lv, "documents", {"query": r.query, "doc_ids": [x.id for x in d],
                                                 "titles": [x.title for x in d]})
                self._result(lv, i, d)
