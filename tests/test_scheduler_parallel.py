"""`Parallel` requests: many generations / searches / attention passes of one question in flight at once."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from fastrag.engine import Engine, Generation
from fastrag.loop import AttnColmax, Generate, Parallel, QuestionLoop, Search, SyncEngineBase
from fastrag.retrieval.base import Doc
from fastrag.trace import QuestionResult


@dataclass
class Ex:
    qid: str
    question: str
    answers: list = field(default_factory=lambda: ["x"])


class WordTok:
    """Whitespace tokens -> ids (a fixed vocabulary of 60), for the fake engine and a real tiny Llama alike."""

    eos_token_id = None

    def encode(self, s):
        return [sum(map(ord, w)) % 60 for w in s.split()]


@dataclass(eq=False)
class FakeSeq:
    n: int
    out: Generation | None = None


class FakeEngine(SyncEngineBase):
    """Every generation of n tokens takes n steps and returns ids [seq number] * n; records batches and releases."""

    def __init__(self):
        self.tok = WordTok()
        self.waiting, self.running = [], []
        self.seqs, self.released, self.decode_batches, self.attn_batches = [], [], [], []
        self._left = {}

    def new_sequence(self):
        s = FakeSeq(len(self.seqs))
        self.seqs.append(s)
        return s

    def release(self, s):
        self.released.append(s.n)

    def start(self, s, ids, n):
        assert s not in self.running, "a sequence started while it was still generating"
        s.out = Generation(ids=[s.n] * n, entropy=[0.0] * n, logprob=[0.0] * n, prompt_tokens=len(ids))
        self.running.append(s)
        self._left[id(s)] = n

    @property
    def has_work(self):
        return bool(self.running)

    def step(self):
        self.decode_batches.append(len(self.running))
        for s in self.running:
            self._left[id(s)] -= 1
        done = [s for s in self.running if self._left[id(s)] <= 0]
        self.running = [s for s in self.running if self._left[id(s)] > 0]
        return done

    def attention_passes(self, seqs, kind):
        self.attn_batches.append(len(seqs))
        return [[float(len(x))] * len(x) for x in seqs]


class Retriever:
    def __init__(self):
        self.batches = []

    def search(self, queries, k):
        self.batches.append(list(queries))
        return [[Doc(id=f"{q}/{i}", title="", text=q) for i in range(k)] for q in queries]


def fan_out(ex):
    """Three generations of different lengths on branches 0, 1 and a one-shot, two searches, one attention pass;
    then one more generation on branch 0."""
    outs = yield Parallel([Generate(f"a {ex.question}", 2, branch=0), Search(f"{ex.question} s1", 1),
                           Generate(f"b {ex.question}", 5, branch=1), Generate(f"c {ex.question}", 3, branch=None),
                           Search(f"{ex.question} s2", 2), AttnColmax([1, 2, 3])])
    last = yield Generate(f"d {ex.question}", 1, branch=0)
    return QuestionResult(qid=ex.qid, question=ex.question, gold=ex.answers,
                          text=repr(([len(o.ids) for o in (outs[0], outs[2], outs[3])], [d.id for d in outs[1]],
                                     [d.id for d in outs[4]], outs[5], len(last.ids))))


def test_parallel_results_come_back_in_order_and_share_the_batches():
    eng, ret, out = FakeEngine(), Retriever(), []
    QuestionLoop(eng, ret, fan_out, max_inflight=4).run([Ex(str(i), f"q{i}") for i in range(4)], out.append)
    assert len(out) == 4 and all(r.error is None for r in out), [r.error for r in out]
    for r in out:
        q = r.question
        assert r.text == repr(([2, 5, 3], [f"{q} s1/0"], [f"{q} s2/0", f"{q} s2/1"], [3.0, 3.0, 3.0], 1))
    # 4 questions x 3 generations decoded together in the first step
    assert eng.decode_batches[0] == 12
    assert all(r.llm_calls == 4 for r in out)  # counted by the scheduler: the policy left it at 0
    # every search of every question in one retriever call: 8 queries
    assert [len(b) for b in ret.batches] == [8]
    assert eng.attn_batches == [4]


def test_each_parallel_generation_gets_its_own_sequence_and_one_shots_are_released_early():
    eng, ret, out = FakeEngine(), Retriever(), []
    QuestionLoop(eng, ret, fan_out, max_inflight=1).run([Ex("0", "q")], out.append)
    assert out[0].error is None
    # branches 0 and 1 and one one-shot sequence: three distinct sequences; the follow-up reused branch 0's
    assert len(eng.seqs) == 3
    one_shot = 2  # created third (parts are dispatched in order)
    assert eng.released[0] == one_shot  # released when its generation finished, before the question ended
    assert sorted(eng.released) == [0, 1, 2]


def test_parallel_mistakes_are_per_question_errors():
    def bad(ex):
        if ex.question == "dup":
            yield Parallel([Generate("a", 1, branch=3), Generate("b", 1, branch=3)])
        elif ex.question == "nested":
            yield Parallel([Parallel([Search("x", 1)])])
        elif ex.question == "neg":
            yield Parallel([Generate("a", 1, branch=-1)])
        elif ex.question == "what":
            yield Parallel(["not a request"])
        r = yield Parallel([])
        assert r == []
        return QuestionResult(qid=ex.qid, question=ex.question, gold=ex.answers, text="ok")

    eng, ret, out = FakeEngine(), Retriever(), []
    QuestionLoop(eng, ret, bad, max_inflight=8).run(
        [Ex(q, q) for q in ("dup", "nested", "neg", "what", "fine")], out.append)
    by = {r.qid: r for r in out}
    assert "share branch" in by["dup"].error and "[3]" in by["dup"].error
    assert "itself a Parallel" in by["nested"].error
    assert "branch must be an int >= 0 or None" in by["neg"].error
    assert "unknown request str" in by["what"].error
    assert by["fine"].error is None and by["fine"].text == "ok"


def test_a_failing_part_ends_its_question_and_frees_the_other_parts():
    """The second part's prompt is too long for the context: the first part (already started) is dropped."""
    from transformers import LlamaConfig

    from fastrag.model.llama import LlamaModel

    cfg = LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=None, max_position_embeddings=64)
    eng = Engine(LlamaModel.from_hf_config(cfg, seed=0), WordTok(), kv_cache_gb=0.002)

    def pol(ex):
        g = yield Parallel([Generate("w " * 5, 4, branch=0), Generate("w " * (100 if ex.qid == "bad" else 5), 4,
                                                                        branch=1)])
        return QuestionResult(qid=ex.qid, question=ex.question, gold=ex.answers, text=str([len(x.ids) for x in g]))

    out = []
    QuestionLoop(eng, Retriever(), pol).run([Ex("bad", "b"), Ex("good", "g")], out.append)
    by = {r.qid: r for r in out}
    assert "exceeds the model context" in by["bad"].error
    assert by["good"].error is None and by["good"].text == "[4, 4]"
    assert not eng.live and not eng.waiting and not eng.running  # every sequence was released


def test_parallel_generations_on_a_real_model_equal_the_same_generations_run_one_by_one():
    """A tiny random Llama: four prompts of one question decoded in parallel on four branches (sharing a prompt
    prefix) give the tokens each prompt gives alone; a second round on the same branches reuses their cache."""
    from transformers import LlamaConfig

    from fastrag.model.llama import LlamaModel

    cfg = LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=None)
    model = LlamaModel.from_hf_config(cfg, seed=1)
    stem = " ".join(f"s{i}" for i in range(24))
    prompts = [f"{stem} alpha beta", f"{stem} gamma", f"{stem} delta epsilon zeta", f"{stem} eta"]

    def alone(p, n):
        eng = Engine(model, WordTok(), kv_cache_gb=0.01)
        s = eng.new_sequence()
        eng.start(s, eng.tok.encode(p), n)
        while eng.has_work:
            eng.step()
        return s.out.ids

    def pol(ex):
        g1 = yield Parallel([Generate(p, 6, branch=b) for b, p in enumerate(prompts)])
        g2 = yield Parallel([Generate(p + " more", 4, branch=b) for b, p in enumerate(prompts)])
        return QuestionResult(qid=ex.qid, question=ex.question, gold=ex.answers,
                              text=repr(([g.ids for g in g1], [g.ids for g in g2], [g.prefilled for g in g2])))

    eng = Engine(model, WordTok(), kv_cache_gb=0.01)
    eng.set_prefix(stem)
    out = []
    QuestionLoop(eng, Retriever(), pol).run([Ex("0", "q")], out.append)
    assert out[0].error is None, out[0].error
    first, second, prefilled = eval(out[0].text)  # noqa: S307 - our own repr of int lists
    assert first == [alone(p, 6) for p in prompts]
    assert second == [alone(p + " more", 4) for p in prompts]
    # second round: each branch prefills only the token of " more"; its earlier prompt is cached on that branch
    # (the shared stem's whole block comes from the run-wide prefix, the rest from the branch's own cache)
    assert prefilled == [1, 1, 1, 1], prefilled
    assert eng.stats["prefix_hit_tokens"] >= 8 * 16
    assert torch.is_grad_enabled()  # the engine's inference mode did not leak


@pytest.mark.parametrize("width", [1, 7])
def test_width_of_a_parallel_is_free(width):
    def pol(ex):
        g = yield Parallel([Generate(f"p {i}", 1 + i % 3, branch=i) for i in range(width)])
        return QuestionResult(qid=ex.qid, question=ex.question, gold=ex.answers, text=str([len(x.ids) for x in g]))

    eng, out = FakeEngine(), []
    QuestionLoop(eng, Retriever(), pol).run([Ex("0", "q")], out.append)
    assert out[0].text == str([1 + i % 3 for i in range(width)])


def _repeats(ex):
    """One-shot generations with repeated prompts, in one Parallel and across Parallels."""
    g1 = yield Parallel([Generate("x y", 3, branch=None), Generate("x y", 3, branch=None),
                         Generate("z", 3, branch=None), Search("s", 1)])
    g2 = yield Parallel([Generate("x y", 3, branch=None), Generate("x y", 4, branch=None),
                         Generate("x y", 3, branch=0)])
    g3 = yield Generate("z", 3, branch=None)
    gens = [*g1[:3], *g2, g3]
    return QuestionResult(qid=ex.qid, question=ex.question, gold=ex.answers,
                          text=repr(([g.ids for g in gens], [g.reused for g in gens], [g.prefilled for g in gens])))


def test_identical_one_shot_greedy_generations_of_a_question_run_once():
    eng, out = FakeEngine(), []
    sched = QuestionLoop(eng, Retriever(), _repeats)
    sched.run([Ex("0", "q"), Ex("1", "q")], out.append)
    assert all(r.error is None for r in out), [r.error for r in out]
    ran_per_question = 4  # "x y"/3, "z"/3, "x y"/4 and the branch-0 generation; the rest are copies
    assert len(eng.seqs) == 2 * ran_per_question  # nothing is shared between questions
    assert sched.reused_generations == 2 * 3
    for r in sorted(out, key=lambda r: r.qid):
        ids, reused, prefilled = eval(r.text)  # noqa: S307 - our own repr
        assert reused == [False, True, False, True, False, False, True]
        # a copy carries the tokens of the generation it repeats (the fake engine's ids name the sequence)
        assert ids[1] == ids[0] and ids[3] == ids[0] and ids[6] == ids[2]
        assert len({ids[0][0], ids[2][0], ids[4][0], ids[5][0]}) == 4  # the four that ran had their own sequence
        assert all(p == 0 for p, u in zip(prefilled, reused) if u)
        assert r.llm_calls == 7  # the policy's calls, reused or not
    assert not eng.running


def test_sampled_one_shot_generations_are_never_reused():
    from fastrag.engine import SamplingParams

    keys = []

    class Sampling(FakeEngine):
        sampling = SamplingParams(temperature=0.7, seed=1)

        def start(self, s, ids, n, **kw):
            keys.append(kw["sample_key"])
            super().start(s, ids, n)

    eng, out = Sampling(), []
    sched = QuestionLoop(eng, Retriever(), _repeats)
    sched.run([Ex("0", "q")], out.append)
    assert out[0].error is None, out[0].error
    assert len(eng.seqs) == 7 and sched.reused_generations == 0
    assert len(set(keys)) == 7  # each generation draws its own noise (repeats of one prompt included)
    assert eval(out[0].text)[1] == [False] * 7  # noqa: S307


def test_a_question_that_ends_while_a_repeat_waits_leaves_nothing_behind():
    """The question fails in the same Parallel as a waiting repeat: the copy is never delivered, nothing leaks."""

    def pol(ex):
        yield Parallel([Generate("x y", 3, branch=None), Generate("x y", 3, branch=None),
                        Generate("a b", 2, branch=None)])
        return QuestionResult(qid=ex.qid, question=ex.question, gold=ex.answers, text="ok")

    class Failing(FakeEngine):
        def start(self, s, ids, n):
            if n == 2:
                raise ValueError("prompt exceeds the model context")
            super().start(s, ids, n)

    eng, out = Failing(), []
    sched = QuestionLoop(eng, Retriever(), pol)
    sched.run([Ex("0", "q")], out.append)
    assert len(out) == 1 and "exceeds the model context" in out[0].error
    assert not eng.running and not sched.busy and not sched._ready
    assert sorted(eng.released) == [s.n for s in eng.seqs]
