"""The methods' spaCy work on worker processes (fastrag.text.pool, `QuestionLoop(text_workers=N)`).

A text request's result must not depend on where it runs: the workers' sentences and real words equal the calls in
this process on real texts, and a run whose spaCy work goes to workers decides every question as a run that does it
on the scheduler's thread, with overlap and without. A worker that dies, or a text spaCy rejects, costs no work.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import warnings

import pytest
import torch

from fastrag.engine import Engine
from fastrag.eval import BUNDLED
from fastrag.loop import Generate, Parallel, QuestionLoop, RealWords, Search, Sentences
from fastrag.model.llama import LlamaModel
from fastrag.retrieval.base import Doc
from fastrag.text.pool import AUTO_TEXT_WORKERS_MAX, TextPool, auto_text_workers, failure_message, is_failure
from fastrag.text.realwords import real_words
from fastrag.text.sentences import split_sentences
from fastrag.trace import QuestionResult, Round

from engine_fakes import Ex, tiny_dragin_run
from engine_fakes import IntTok as Tok


def _real_texts(n: int, seed: int) -> list[str]:
    """Random passages of the bundled corpus, cut at random points, and some joined: real prose of all lengths."""
    rows = [json.loads(x) for x in (BUNDLED / "wiki_passages.jsonl").read_text().splitlines() if x.strip()]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        t = rng.choice(rows)["text"]
        a = rng.randrange(len(t))
        t = t[a: a + rng.randrange(20, 600)]
        if rng.random() < 0.3:
            t += " " + rng.choice(rows)["text"][:200]
        out.append(t)
    return out + ["", "   ", "No. 5 St. Louis, Mo. was it? Yes.\n\nIt was."]


@pytest.fixture(scope="module")
def pool():
    p = TextPool(2)
    yield p
    p.shutdown()


def test_workers_give_what_the_calls_here_give(pool):
    texts = _real_texts(40, seed=int.from_bytes(os.urandom(2), "little"))
    futs = [(pool.submit("sentences", t), pool.submit("real_words", t)) for t in texts]
    for t, (fs, fr) in zip(texts, futs):
        assert fs.result(timeout=120) == split_sentences(t)
        assert fr.result(timeout=120) == real_words(t)
    assert any(len(split_sentences(t)) > 1 for t in texts)  # (the texts do have several sentences)


def test_a_text_spacy_rejects_comes_back_as_its_failure(pool):
    from fastrag.text.nlp import get_nlp

    too_long = "word " * (get_nlp().max_length // 5 + 10)
    r = pool.submit("sentences", too_long).result(timeout=120)
    assert is_failure(r) and ("E088" in failure_message(r) or "max_length" in failure_message(r))
    with pytest.raises(ValueError, match="unknown text request kind 'pos'"):
        pool.submit("pos", "x")
    with pytest.raises(ValueError, match="workers must be an int >= 1"):
        TextPool(0)


def test_a_reader_that_fails_fails_what_waits_instead_of_hanging(monkeypatch):
    """Whatever stops a worker's reader thread (here a frame it cannot read), the worker is stopped and every text
    waiting on it fails with BrokenProcessPool, saying why: nothing waits forever."""
    from concurrent.futures.process import BrokenProcessPool

    import fastrag.text.pool as pool_mod

    def unreadable(f):
        raise RuntimeError("a frame that cannot be read")

    monkeypatch.setattr(pool_mod, "_read_frame", unreadable)
    p = TextPool(1)
    try:
        with pytest.raises(BrokenProcessPool, match="reader failed: RuntimeError: a frame that cannot be read"):
            p.submit("sentences", "One. Two.").result(timeout=60)
        with pytest.raises(BrokenProcessPool):
            p.compute_texts([("sentences", "One."), ("real_words", "Two.")])
        with pytest.raises(BrokenProcessPool, match="reader failed"):  # (a text handed to it as it died)
            p._workers[0].submit(99, "sentences", "Three.", 26)
    finally:
        p.shutdown()


# ---------------------------------------------------------------------------------------------- scheduler level


TEXTS = _real_texts(30, seed=7)


class Retriever:
    def search(self, queries, k):
        return [[Doc(id=f"{q}/{i}", title="", text=" ".join(str(1 + (len(q) * 7 + i * 13 + j) % 90)
                                                          for j in range(6))) for i in range(k)] for q in queries]


def policy(ex):
    """Generations whose tokens choose which real texts to split and tag; what spaCy says chooses the next search
    and prompt (so a wrong or misrouted text result changes the answer). Lone requests and Parallel parts."""
    res = QuestionResult(qid=ex.qid, question=ex.question, gold=ex.answers)
    text = ex.question
    for rnd in range(3):
        g = yield Generate(text, 3 + (int(ex.qid) + rnd) % 4)
        t = TEXTS[sum(g.ids) % len(TEXTS)]
        sents = yield Sentences(t)
        if rnd == 1:
            real, sents2, docs = yield Parallel([RealWords(t), Sentences(TEXTS[len(sents) % len(TEXTS)]),
                                                 Search(str(len(sents)), 2)])
        else:
            real, sents2, docs = (yield RealWords(t)), [], []
        key = f"{len(sents)}.{len(sents2)}.{sorted(real)[:2]}"
        res.rounds.append(Round(trigger_sentence=sents[0].text if sents else "", query=key,
                                doc_ids=[d.id for d in docs]))
        text += " " + " ".join(map(str, g.ids)) + f" {1 + len(real) % 90}"
    res.text = res.prediction = text
    return res


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig

    m = LlamaModel.from_hf_config(LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=6, num_key_value_heads=2, eos_token_id=None),
                                  dtype=torch.float64, seed=3, device="cpu")
    return m


class _Inline:
    """An executor that runs each search as it is submitted: the steps at which results come back no longer depend
    on a thread's timing (for comparing the engine steps of two runs)."""

    def submit(self, fn, *a):
        from concurrent.futures import Future

        f = Future()
        f.set_result(fn(*a))
        return f

    def shutdown(self, wait=True):
        pass


def _schedule(model, text_workers, overlap=False, n=8, pol=policy, inline_search=False, **kw):
    eng = Engine(model, Tok(), kv_cache_gb=0.02, max_batch=4)
    out = []
    sched = QuestionLoop(eng, Retriever(), pol, max_inflight=6, overlap=overlap, text_workers=text_workers, **kw)
    if inline_search:
        sched.search.executor = _Inline()
    sched.run([Ex(str(i), f"{1 + i} {2 + 3 * i} {5 + i % 7}") for i in range(n)], out.append)
    return {r.qid: r for r in out}, sched


def _decisions(res):
    return {q: (r.prediction, [(x.trigger_sentence, x.query, x.doc_ids) for x in r.rounds], r.error)
            for q, r in res.items()}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("groups", [None, False])
def test_a_run_with_text_workers_decides_as_one_without(model, pool, overlap, groups):
    """Workers in their default mode (groups) and free-running: the same decisions as without workers."""
    here, s0 = _schedule(model, 0)
    there, s1 = _schedule(model, pool, overlap=overlap, text_groups=groups)
    assert s1.text_groups == (groups is None)
    assert len(here) == 8 and all(r.error is None for r in here.values())
    assert _decisions(here) == _decisions(there)
    assert s0.text_requests == 0 and s1.text_requests > 3 * 8  # every text went to the workers
    assert len({x.query for r in here.values() for x in r.rounds}) > 3  # the texts chosen really vary


@pytest.mark.parametrize("mode", ["free", "lockstep", "groups"])
def test_a_worker_that_dies_costs_no_work(model, mode):
    """Kill the workers mid-run: the texts they held and all later ones run on the scheduler's thread, with a
    warning, and every question decides as before (free-running workers, in lockstep, and in groups)."""
    here, _ = _schedule(model, 0)
    killed = []

    def killer(ex):
        gen = policy(ex)
        value = None
        while True:
            try:
                req = gen.send(value)
            except StopIteration as stop:
                return stop.value
            if isinstance(req, Sentences) and not killed and sched_ref and sched_ref[0].text_pool is not None:
                for pid in sched_ref[0].text_pool.pids():
                    os.kill(pid, signal.SIGKILL)
                killed.append(True)
            value = yield req

    sched_ref = []
    eng = Engine(model, Tok(), kv_cache_gb=0.02, max_batch=4)
    sched = QuestionLoop(eng, Retriever(), killer, max_inflight=6, text_workers=2, text_lockstep=mode == "lockstep",
                      text_groups=mode == "groups")
    if mode != "free":  # (workers still loading get no texts in lockstep or groups: these are ready before the run)
        sched.text_pool = TextPool(2)
        _wait_ready(sched.text_pool)
    sched_ref.append(sched)
    out = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        sched.run([Ex(str(i), f"{1 + i} {2 + 3 * i} {5 + i % 7}") for i in range(8)], out.append)
    assert killed and sched.text_workers == 0  # the pool is gone; the run finished on this thread
    assert any("spaCy worker pool failed" in str(x.message) for x in w)
    assert _decisions({r.qid: r for r in out}) == _decisions(here)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_text_spacy_rejects_fails_its_question_only(model, workers):
    from fastrag.text.nlp import get_nlp

    huge = "word " * (get_nlp().max_length // 5 + 10)

    def pol(ex):
        if ex.qid == "3":
            yield Sentences(huge)
        return (yield from policy(ex))

    res, _ = _schedule(model, workers, pol=pol)
    assert len(res) == 8
    assert "E088" in (res["3"].error or "") or "max_length" in (res["3"].error or "")
    assert all(r.error is None for q, r in res.items() if q != "3")


def test_text_workers_argument_is_checked(model):
    eng = Engine(model, Tok(), kv_cache_gb=0.02, max_batch=4)
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="text_workers must be an int >= 0 or a TextPool"):
            QuestionLoop(eng, Retriever(), policy, text_workers=bad)
    assert QuestionLoop(eng, Retriever(), policy).text_workers == 0  # no workers by default, with overlap or without
    assert QuestionLoop(eng, Retriever(), policy, overlap=True).text_workers == 0
    assert QuestionLoop(eng, Retriever(), policy, overlap=True, text_workers=2).text_workers == 2


@pytest.mark.parametrize("groups", [False, True])
def test_closing_with_texts_at_the_workers(model, groups):
    """close() while texts are out (free-running, or a group: the default): the workers stop, nothing raises, and
    a later run starts them again and finishes the question that was waiting."""

    def pol(ex):
        sents = yield Sentences(" ".join(TEXTS[:6]))
        res = QuestionResult(qid=ex.qid, question=ex.question, gold=ex.answers)
        res.prediction = str(len(sents))
        return res

    eng = Engine(model, Tok(), kv_cache_gb=0.02, max_batch=4)
    sched = QuestionLoop(eng, Retriever(), pol, text_workers=1, text_groups=None if groups else False)
    assert sched.text_groups == groups
    deadline = time.monotonic() + 120
    while groups and sched.texts.ready_pool() is None:  # (a group goes out once a worker has loaded its pipeline)
        assert time.monotonic() < deadline, "the text worker did not load its pipeline in 120 s"
        time.sleep(0.05)
    out = []
    sched.submit(Ex("0", "1 2"), out.append)
    sched.step()
    assert (sched.texts.sent_groups if groups else sched.texts.singles) and sched.text_pool is not None
    pids = sched.text_pool.pids()
    sched.close()
    assert sched.text_pool is None and not sched.texts.singles and not sched.texts.sent_groups
    for pid in pids:  # the worker processes are gone (reaped)
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    sched.run([Ex("1", "3 4")], out.append)  # the question that was in flight at close() finishes too
    want = str(len(split_sentences(" ".join(TEXTS[:6]))))
    assert sorted((r.qid, r.prediction, r.error) for r in out) == [("0", want, None), ("1", want, None)]


# ---------------------------------------------------------------------------------------------- a step's texts together


def test_texts_computed_together_equal_the_calls_one_by_one(monkeypatch):
    """compute_texts: each kind's texts in one nlp.pipe pass give what one call each gives, blank texts included,
    and a text spaCy rejects fails alone (the pass is done again text by text), whatever the pass raised."""
    from fastrag.text.nlp import get_nlp
    from fastrag.text.pool import compute_text, compute_texts

    texts = _real_texts(24, seed=int.from_bytes(os.urandom(2), "little"))
    huge = "word " * (get_nlp().max_length // 5 + 10)
    items = [(k, t) for t in texts for k in ("sentences", "real_words")] + [("sentences", huge)]
    random.Random(3).shuffle(items)
    got = compute_texts(items)
    for (k, t), v in zip(items, got):
        if t is huge:
            assert is_failure(v) and not is_failure(compute_texts([(k, texts[0])])[0])
        else:
            assert v == compute_text(k, t), (k, t)
    assert compute_texts([]) == []

    import fastrag.text.sentences

    def broken_pass(texts):
        raise RuntimeError("a pass that fails in another way")

    monkeypatch.setattr(fastrag.text.sentences, "split_sentences_batch", broken_pass)
    some = [("sentences", t) for t in texts[:4]] + [("real_words", texts[0])]
    assert compute_texts(some) == [compute_text(k, t) for k, t in some]


def test_a_step_s_texts_go_through_one_pass_and_decide_the_same(model, monkeypatch):
    """Without workers, the texts the questions of a step ask for are computed together (several in one call of
    compute_texts), and every question decides as when each text is computed on its own, with overlap or without."""
    import fastrag.loop.text_service as sched_mod

    sizes = []
    real = sched_mod.compute_texts

    def spy(items):
        sizes.append(len(items))
        return real(items)

    monkeypatch.setattr(sched_mod, "compute_texts", spy)
    for overlap in (False, True):
        sizes.clear()
        batched, _ = _schedule(model, 0, overlap=overlap)
        assert sizes and max(sizes) > 1, sizes  # some step had several texts in one pass
        monkeypatch.setattr(QuestionLoop, "batch_texts", False)
        sizes.clear()
        alone, _ = _schedule(model, 0, overlap=overlap)
        monkeypatch.setattr(QuestionLoop, "batch_texts", True)
        assert not sizes  # (switched off: one text at a time, not through compute_texts)
        assert all(r.error is None for r in batched.values())
        assert _decisions(batched) == _decisions(alone)


# ---------------------------------------------------------------------------------------------- lockstep


def test_the_pool_computes_a_step_s_texts_as_this_process_does(pool):
    """TextPool.compute_texts: the items split over the workers, each share through one nlp.pipe pass a kind, come
    back in order, equal to compute_texts here; a text spaCy rejects fails alone."""
    from fastrag.text.nlp import get_nlp
    from fastrag.text.pool import compute_texts

    texts = _real_texts(13, seed=int.from_bytes(os.urandom(2), "little"))
    huge = "word " * (get_nlp().max_length // 5 + 10)
    items = [(k, t) for t in texts for k in ("sentences", "real_words")] + [("real_words", huge)]
    random.Random(5).shuffle(items)
    got = pool.compute_texts(items)
    want = compute_texts(items)
    assert len(got) == len(items)
    for (k, t), g, w in zip(items, got, want):
        if t is huge:
            assert is_failure(g) and is_failure(w)
        else:
            assert g == w, (k, t)
    assert pool.compute_texts(items[:1]) == want[:1]  # (one item: one worker)
    assert pool.compute_texts([]) == []
    with pytest.raises(ValueError, match="unknown text request kind 'pos'"):
        pool.compute_texts([("sentences", "a"), ("pos", "b")])


@pytest.mark.parametrize("overlap", [False, True])
def test_lockstep_workers_run_the_steps_of_a_run_without_workers(model, pool, overlap, monkeypatch):
    """In lockstep a step's texts are answered where the scheduler's thread answers them without workers: the run
    makes the same engine steps (prefill calls, decode steps, tokens) and every question decides the same; the
    steps with several texts went to the workers. (Searches are answered inline in both runs: a search thread's
    timing moves a prefill call in any two runs.)"""
    from fastrag.text.pool import TextPool as Pool

    shares = []
    real = Pool.compute_texts

    def spy(self, items):
        shares.append(len(items))
        return real(self, items)

    monkeypatch.setattr(Pool, "compute_texts", spy)
    _wait_ready(pool)  # (a step never waits for workers still loading: it computes its texts itself meanwhile)
    here, s0 = _schedule(model, 0, overlap=overlap, inline_search=True)
    there, s1 = _schedule(model, pool, overlap=overlap, text_lockstep=True, inline_search=True)
    assert all(r.error is None for r in here.values())
    assert _decisions(here) == _decisions(there)
    keys = ("prefill_calls", "decode_steps", "prefill_tokens", "decode_tokens")
    assert {k: s1.engine.stats[k] for k in keys} == {k: s0.engine.stats[k] for k in keys}
    assert shares and min(shares) > 1 and s1.text_requests == sum(shares)  # (single texts stay on this thread)
    assert s1.text_lockstep and not s1.texts.singles  # nothing was left to come back later


def _wait_ready(pool, timeout: float = 120.0) -> None:
    import time

    t = time.monotonic()
    while pool.ready < pool.workers:
        assert time.monotonic() - t < timeout, "text workers did not load their pipelines"
        time.sleep(0.05)


def test_lockstep_never_waits_for_workers_still_loading(model, monkeypatch):
    """Until a worker has loaded its pipeline (or for a lone text), a lockstep step computes its texts itself; once
    one has, several texts go to the pool. The same decisions either way."""
    from fastrag.text.pool import compute_texts

    class Loading:
        """A pool whose workers are still starting, then ready after `after` texts were asked for."""

        workers, texts, broken = 2, 0, None

        def __init__(self, after):
            self.after, self.asked, self.sent = after, 0, []

        @property
        def ready(self):
            return 2 if self.asked >= self.after else 0

        def compute_texts(self, items):
            self.sent.append(len(items))
            return compute_texts(items)

        def shutdown(self):
            pass

    here, _ = _schedule(model, 0)
    for after in (10**9, 4):
        eng = Engine(model, Tok(), kv_cache_gb=0.02, max_batch=4)
        sched = QuestionLoop(eng, Retriever(), policy, max_inflight=6, text_workers=2, text_lockstep=True)
        fake = sched.text_pool = Loading(after)
        real = sched.texts.compute

        def counting(items, real=real, fake=fake):
            fake.asked += len(items)
            return real(items)

        sched.texts.compute = counting
        out = []
        sched.run([Ex(str(i), f"{1 + i} {2 + 3 * i} {5 + i % 7}") for i in range(8)], out.append)
        assert _decisions({r.qid: r for r in out}) == _decisions(here)
        if after > 10**6:
            assert fake.sent == [] and sched.text_requests == 0  # never ready: all here, nothing waited for
        else:
            assert fake.sent and min(fake.sent) > 1 and sched.text_requests == sum(fake.sent)


def test_a_worker_says_when_its_pipeline_is_loaded():
    p = TextPool(1)
    try:
        _wait_ready(p)
        assert p.ready == 1
        assert p.compute_texts([("sentences", "One. Two."), ("real_words", "Paris is big.")]) == \
            [split_sentences("One. Two."), real_words("Paris is big.")]
    finally:
        p.shutdown()
    assert p.ready == 0  # (stopped workers are not ready)


def test_the_lockstep_switch(model, monkeypatch):
    from fastrag.text.pool import TEXT_LOCKSTEP_ENV

    eng = Engine(model, Tok(), kv_cache_gb=0.02, max_batch=4)
    monkeypatch.delenv(TEXT_LOCKSTEP_ENV, raising=False)
    assert not QuestionLoop(eng, Retriever(), policy, text_workers=2).text_lockstep
    monkeypatch.setenv(TEXT_LOCKSTEP_ENV, "1")
    assert QuestionLoop(eng, Retriever(), policy, text_workers=2).text_lockstep
    assert not QuestionLoop(eng, Retriever(), policy, text_workers=2, text_lockstep=False).text_lockstep
    monkeypatch.setenv(TEXT_LOCKSTEP_ENV, "sometimes")
    with pytest.raises(ValueError, match=TEXT_LOCKSTEP_ENV):
        QuestionLoop(eng, Retriever(), policy, text_workers=2)


# ---------------------------------------------------------------------------------------------- groups


def test_the_pool_sends_a_group_without_waiting_and_settles_it_whole(pool):
    """TextPool.submit_texts returns at once; its Future holds every item's value, in order and equal to
    compute_texts here, only once every share is back (a text spaCy rejects fails alone)."""
    from concurrent.futures import Future

    from fastrag.text.nlp import get_nlp
    from fastrag.text.pool import BrokenProcessPool, _Worker, compute_texts

    _wait_ready(pool)
    texts = _real_texts(11, seed=int.from_bytes(os.urandom(2), "little"))
    huge = "word " * (get_nlp().max_length // 5 + 10)
    items = [(k, t) for t in texts for k in ("sentences", "real_words")] + [("sentences", huge)]
    random.Random(9).shuffle(items)
    got = pool.submit_texts(items).result(timeout=120)
    want = compute_texts(items)
    assert len(got) == len(items)
    for (k, t), g, w in zip(items, got, want):
        assert (is_failure(g) and is_failure(w)) if t is huge else g == w, (k, t)
    assert pool.submit_texts([]).result(timeout=1) == []

    # the group stays unsettled while any share is out: hold the second worker's share back
    held, real_submit = [], _Worker.submit

    def submit(self, rid, kind, text, cost):
        fut = real_submit(self, rid, kind, text, cost)
        if self is pool._workers[1]:
            gate = Future()
            fut.add_done_callback(lambda f: held.append((gate, f)))
            return gate
        return fut

    _Worker.submit = submit
    try:
        fut = pool.submit_texts(items)
    finally:
        _Worker.submit = real_submit
    import time

    t0 = time.monotonic()
    while not held:  # (the second share is back from its worker, not yet passed on)
        assert time.monotonic() - t0 < 120
        time.sleep(0.01)
    time.sleep(0.05)
    assert not fut.done()
    gate, inner = held[0]
    gate.set_result(inner.result())
    got = fut.result(timeout=60)
    for (k, t), g, w in zip(items, got, want):
        assert (is_failure(g) and is_failure(w)) if t is huge else g == w, (k, t)
    assert [w.backlog() for w in pool._workers] == [0, 0]  # (every answered share's cost is off its worker)
    # a share lost otherwise than by its worker's death (cancelled) loses the group as a dead worker does: the
    # scheduler computes such a group itself on BrokenProcessPool
    _Worker.submit = submit
    try:
        fut = pool.submit_texts(items)
    finally:
        _Worker.submit = real_submit
    while len(held) < 2:
        assert time.monotonic() - t0 < 240
        time.sleep(0.01)
    held[1][0].cancel()
    with pytest.raises(BrokenProcessPool, match="a share of the texts was lost"):
        fut.result(timeout=60)


def test_balanced_shares_end_together_and_keep_every_item_once():
    """The group's shares: every item in exactly one, each share in the items' order, and the greedy bound of
    the longest-first split: a worker's total (its backlog plus its share) less its smallest item is at most the
    least total of any worker. A worker whose backlog is larger than the whole group gets nothing."""
    from fastrag.text.pool import balanced_shares

    rng = random.Random(int.from_bytes(os.urandom(2), "little"))
    for _ in range(200):
        costs = [rng.choice([rng.randint(150, 300), rng.randint(150, 3000)]) for _ in range(rng.randint(1, 60))]
        backlogs = [rng.choice([0, 0, rng.randint(0, 4000)]) for _ in range(rng.randint(1, 9))]
        shares = balanced_shares(costs, backlogs)
        assert len(shares) == len(backlogs)
        assert sorted(j for sh in shares for j in sh) == list(range(len(costs)))
        assert all(sh == sorted(sh) for sh in shares)
        total = [b + sum(costs[j] for j in sh) for b, sh in zip(backlogs, shares)]
        for t, sh in zip(total, shares):
            if sh:
                assert t - min(costs[j] for j in sh) <= min(total)
    assert balanced_shares([200, 200, 200], [10**6, 0]) == [[], [0, 1, 2]]
    assert balanced_shares([1000, 300, 300, 300], [0, 0]) == [[0], [1, 2, 3]]  # (by count: [0, 1] and [2, 3])
    with pytest.raises(ValueError, match="at least one worker"):
        balanced_shares([1], [])


@pytest.mark.parametrize("overlap", [False, True])
def test_groups_decide_as_a_run_without_workers(model, pool, overlap):
    """text_groups: a step's texts go to the workers as one group and the step goes on; every question decides as
    without workers, every text went through a group, and nothing is left out after the run."""
    _wait_ready(pool)
    here, s0 = _schedule(model, 0, overlap=overlap)
    there, s1 = _schedule(model, pool, overlap=overlap, text_groups=True)
    assert all(r.error is None for r in here.values())
    assert _decisions(here) == _decisions(there)
    sizes = s1.text_group_sizes
    assert sizes and max(sizes) > 1 and sum(sizes) == s1.text_requests > 3 * 8
    assert not s1.texts.singles and not s1.texts.sent_groups and not s1.texts.out


def test_a_step_does_not_wait_for_its_group_and_the_group_comes_back_whole(model):
    """A group still out does not hold the engine: steps run until the pool settles it, and then all its texts
    reach their questions in one step (their next generations start together). The decisions stay those of a
    run without workers."""
    import threading
    from collections import defaultdict, deque
    from concurrent.futures import Future

    from fastrag.text.pool import compute_texts

    class Slow:
        """A ready pool that settles each group 50 ms after it was sent, on a timer thread (as a pool's reader
        thread would)."""

        workers, texts, broken, ready = 2, 0, None, 2

        def __init__(self):
            self.sent: list[list[tuple[str, str]]] = []
            self.timers: list[threading.Timer] = []

        def submit_texts(self, items):
            f = Future()
            values = compute_texts(items)
            self.sent.append(items)
            t = threading.Timer(0.05, f.set_result, (values,))
            t.start()
            self.timers.append(t)
            return f

        def shutdown(self):
            for t in self.timers:
                t.join()

    here, _ = _schedule(model, 0)
    eng = Engine(model, Tok(), kv_cache_gb=0.02, max_batch=4)
    sched = QuestionLoop(eng, Retriever(), policy, max_inflight=6, text_workers=2, text_groups=True)
    fake = sched.text_pool = Slow()
    out, stepped_while_out, handed = [], 0, []
    step = [0]
    real_hand = sched._hand_text

    def hand(lv, i, value, now):
        handed.append((step[0], id(lv), i))
        real_hand(lv, i, value, now)

    sched._hand_text = hand
    members = []  # per group sent, in the order they went: its texts' (question, index)
    real_send = sched.texts.send_group

    def send(items):
        went = real_send(items)
        if went:
            members.append([(id(lv), i) for lv, i, _ in items])
        return went

    sched.texts.send_group = send
    for i in range(8):
        sched.submit(Ex(str(i), f"{1 + i} {2 + 3 * i} {5 + i % 7}"), out.append)
    while sched.busy:
        work = eng.stats["prefill_calls"] + eng.stats["decode_steps"]
        was_out = any(not f.done() for f, _ in sched.texts.sent_groups)  # (a group still at the pool)
        sched.step()
        stepped_while_out += was_out and eng.stats["prefill_calls"] + eng.stats["decode_steps"] > work
        step[0] += 1
        assert step[0] < 10_000
    fake.shutdown()
    assert _decisions({r.qid: r for r in out}) == _decisions(here)
    assert stepped_while_out > 0  # the engine ran steps while a group was out
    sizes = sched.text_group_sizes
    assert sizes == [len(g) for g in fake.sent] == [len(g) for g in members] and max(sizes) > 1
    assert len(handed) == sum(sizes)
    # each group came back in one step (a later group may settle first: the timers, like a pool's workers, keep no
    # order); a question's texts reach it in the order its groups went, so its k-th hand is its k-th group's
    steps = defaultdict(deque)
    for st, q, i in handed:
        steps[(q, i)].append(st)
    for g in members:
        assert len({steps[key].popleft() for key in g}) == 1, g


def test_the_groups_switch(model, monkeypatch):
    from fastrag.text.pool import TEXT_GROUPS_ENV, TEXT_LOCKSTEP_ENV

    eng = Engine(model, Tok(), kv_cache_gb=0.02, max_batch=4)
    monkeypatch.delenv(TEXT_GROUPS_ENV, raising=False)
    monkeypatch.delenv(TEXT_LOCKSTEP_ENV, raising=False)
    # unset: groups wherever there are workers and lockstep is not asked for
    assert QuestionLoop(eng, Retriever(), policy, text_workers=2).text_groups
    assert not QuestionLoop(eng, Retriever(), policy, text_workers=0).text_groups
    assert not QuestionLoop(eng, Retriever(), policy).text_groups
    lock = QuestionLoop(eng, Retriever(), policy, text_workers=2, text_lockstep=True)
    assert lock.text_lockstep and not lock.text_groups
    monkeypatch.setenv(TEXT_LOCKSTEP_ENV, "1")
    assert not QuestionLoop(eng, Retriever(), policy, text_workers=2).text_groups
    monkeypatch.delenv(TEXT_LOCKSTEP_ENV)
    for off in ("0", " off "):  # free-running
        monkeypatch.setenv(TEXT_GROUPS_ENV, off)
        free = QuestionLoop(eng, Retriever(), policy, text_workers=2)
        assert not free.text_groups and not free.text_lockstep
    monkeypatch.setenv(TEXT_GROUPS_ENV, "1")
    assert QuestionLoop(eng, Retriever(), policy, text_workers=2).text_groups
    assert not QuestionLoop(eng, Retriever(), policy, text_workers=2, text_groups=False).text_groups
    with pytest.raises(ValueError, match="choose one"):
        QuestionLoop(eng, Retriever(), policy, text_workers=2, text_lockstep=True)
    monkeypatch.setenv(TEXT_GROUPS_ENV, "often")
    with pytest.raises(ValueError, match=TEXT_GROUPS_ENV):
        QuestionLoop(eng, Retriever(), policy, text_workers=2)


def test_auto_text_workers_spare_two_cores_on_a_gpu_and_none_on_a_cpu(monkeypatch):
    import fastrag.text.pool as tp

    for dev in ("cuda", "cuda:1", torch.device("cuda", 0)):
        assert [auto_text_workers(dev, cpus=c) for c in (1, 2, 3, 4, 10, 16, 64)] == [0, 0, 1, 2, 8, 8, 8]
    assert AUTO_TEXT_WORKERS_MAX == 8
    for dev in ("cpu", torch.device("cpu"), "mps", None):
        assert auto_text_workers(dev, cpus=64) == 0
    assert 1 <= tp.usable_cpus() <= (os.cpu_count() or 1)
    monkeypatch.setattr(tp, "usable_cpus", lambda: 7)  # (cpus not given: this process's)
    assert auto_text_workers("cuda") == 5


def test_a_run_not_told_its_text_workers_takes_the_chosen_count(tmp_path, monkeypatch):
    """`run` without text_workers asks auto_text_workers with its engine's device (and the CPUs the options name),
    gives its scheduler that many workers, and says in metrics.json that it chose them; told a count, it does not
    ask. (Whether texts reach the worker depends on its spaCy loading before this short run ends: texts asked for
    while it loads are answered in this process, tests above.)"""
    import dataclasses

    import fastrag.text.pool as tp
    from fastrag.eval import run

    opts = tiny_dragin_run(tmp_path)
    asked = []
    monkeypatch.setattr(tp, "auto_text_workers", lambda device, cpus=None: asked.append((str(device), cpus)) or 1)
    m = run(dataclasses.replace(opts("auto"), text_worker_cpus=6))
    assert asked == [("cpu", 6)]
    assert m["text_workers"]["workers"] == 1 and m["text_workers"]["chosen"] == "auto"
    assert json.loads((tmp_path / "auto" / "metrics.json").read_text())["text_workers"]["chosen"] == "auto"
    m = run(dataclasses.replace(opts("given"), text_workers=0))
    assert asked == [("cpu", 6)] and m["text_workers"]["workers"] == 0 and m["text_workers"]["chosen"] == "given"
