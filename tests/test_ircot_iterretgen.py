"""IRCoT and Iter-RetGen (fastrag/methods/ircot.py, iter_retgen.py; docs/methods.md): their configs' errors, the
pure rules (documents gathered, the stop test, the next query), the policies over the scripted engine of
tests/test_methods.py, and engine-vs-oracle parity on the real SmolLM2 with BM25 over the bundled corpus.

Expected queries, prompts and texts are derived by hand from each script, never from the code under test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastrag.config import ConfigError, method_config
from fastrag.loop import QuestionLoop
from fastrag.methods.ircot import gather, says_answer, thought_text
from fastrag.methods.iter_retgen import next_query
from fastrag.retrieval.base import Doc
from test_methods import HIGH, Ex, Retriever, ScriptEngine, continuation, listed, tok  # noqa: F401  (tok: fixture)

Q = "Where is Paris?"


def run(method, tok, world, ret=None, **over):
    from fastrag.methods.registry import get_method

    cfg = method_config(method, "2wikimultihopqa", overrides={"fewshot": 0, **over})
    eng, ret = ScriptEngine(tok, world), ret or Retriever()
    out = []
    QuestionLoop(eng, ret, get_method(method).make_policy(cfg, tok), max_inflight=2).run([Ex("1", Q)], out.append)
    assert len(out) == 1 and out[0].error is None, out[0].error
    return out[0], eng, ret


def answering(pieces, final=" France."):
    """A world answering from `pieces`, and the evaluator's extra answer prompt with `final`."""
    def world(p):
        return [(final, HIGH, 0.1), None] if p.endswith(" So the answer is ") else continuation(p, pieces)

    return world


# ------------------------------------------------------------------------------------------------ configs


@pytest.mark.parametrize("method, field_, value", [
    ("ircot", "max_steps", 0), ("ircot", "max_steps", True), ("ircot", "max_steps", 2.0),
    ("ircot", "thought_max_tokens", 0), ("ircot", "max_docs", 0), ("ircot", "max_docs", "15"),
    ("iter-retgen", "iterations", 0), ("iter-retgen", "iterations", 1.5), ("iter-retgen", "retrieve_topk", 0)])
def test_bad_values_name_the_field(method, field_, value):
    with pytest.raises(ConfigError, match=rf"{field_} must be an int >= 1, got {value!r}"):
        method_config(method, "hotpotqa", overrides={field_: value})


def test_a_file_s_unknown_field_is_named_with_the_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"max_iter": 2}))  # (FlashRAG's name; ours is max_steps)
    with pytest.raises(ConfigError, match=r"c\.json: unknown config field 'max_iter' for ircot.*max_steps"):
        method_config("ircot", "hotpotqa", str(path))
    path.write_text(json.dumps({"iter_num": 2}))
    with pytest.raises(ConfigError, match=r"unknown config field 'iter_num' for iter-retgen.*iterations"):
        method_config("iter-retgen", "hotpotqa", str(path))


def test_defaults():
    c = method_config("ircot", "2wikimultihopqa")
    assert (c.max_steps, c.thought_max_tokens, c.max_docs, c.retrieve_topk, c.max_query_tokens, c.fewshot) == \
        (5, 32, 15, 3, 64, 6)
    c = method_config("iter-retgen", "hotpotqa")
    assert (c.iterations, c.generate_max_length, c.max_query_tokens, c.fewshot) == (3, 100, 256, 8)


# ------------------------------------------------------------------------------------------------ the rules


def docs(*ids):
    return [Doc(id=i, title="", text=f"text {i}") for i in ids]


def test_gathered_documents_keep_first_retrieval_order_without_duplicates():
    have = docs("a", "b", "c")
    out = gather(have, docs("c", "d", "a", "e"), limit=15)
    assert [d.id for d in out] == ["a", "b", "c", "d", "e"]
    assert [d.id for d in have] == ["a", "b", "c"]  # (the earlier list is not changed)
    assert [d.id for d in gather(have, docs("b", "c"), limit=15)] == ["a", "b", "c"]
    # the cap counts the documents gathered: new ones past it are dropped, duplicates never count
    assert [d.id for d in gather(have, docs("a", "d", "e", "f"), limit=4)] == ["a", "b", "c", "d"]
    assert [d.id for d in gather([], docs("x", "x", "y"), limit=15)] == ["x", "y"]


def test_the_stop_test_and_the_thought_line():
    assert says_answer("So the answer is France.") and says_answer("The Answer Is: no.")
    assert not says_answer("Paris is the answer.") and not says_answer("The answers are many.")
    assert thought_text(" Paris is in France.\nQuestion: Who?") == " Paris is in France."
    assert thought_text("\nQuestion: Who?") == ""


def test_iter_retgen_query_is_the_question_and_the_answer_as_read():
    assert next_query(Q, "Paris is in France. So the answer is France.") == \
        "Where is Paris? Paris is in France. So the answer is France."
    # a next question the model imagines is cut off (the evaluator's split words), whitespace stripped
    assert next_query(Q, "So the answer is France.\nQuestion: Where is Lyon?\nAnswer: ...") == \
        "Where is Paris? So the answer is France."
    assert next_query(Q, "") == Q


# ------------------------------------------------------------------------------------------------ IRCoT policy

COT = [(" Paris is in France.", HIGH, 0.1), (" France is in Europe.", HIGH, 0.1), (" So the answer is France.", HIGH, 0.1),
       None]


def test_ircot_retrieves_with_each_sentence_until_the_answer_sentence(tok):
    r, eng, ret = run("ircot", tok, answering(COT))
    # the question, then each sentence but the one that says "answer is"
    assert ret.queries == [Q, "Paris is in France.", "France is in Europe."]
    assert r.text == "Paris is in France. France is in Europe. So the answer is France." == r.prediction
    assert [n for _, n in eng.prompts] == [32, 32, 32]  # three steps, no extra answer generation
    # the documents accumulate in retrieval order: step 3's context lists all nine
    ctx = "Context:\n" + listed(Q) + "".join(
        f"[{i + 4}] doc {i} about Paris is in France.\n" for i in range(3)) + "".join(
        f"[{i + 7}] doc {i} about France is in Europe.\n" for i in range(3))
    assert eng.prompts[2][0].startswith(ctx + "Answer in the same format as before.\n")
    assert eng.prompts[2][0].endswith(f"Question: {Q}\nAnswer: Paris is in France. France is in Europe.")
    assert [x.query for x in r.rounds] == ret.queries and all(len(x.doc_ids) == 3 for x in r.rounds)


class Overlapping(Retriever):
    """Every query finds "shared" first, then two passages of its own."""

    def search(self, queries, k):
        self.queries += queries
        return [docs("shared", f"{q[:5]}-1", f"{q[:5]}-2")[:k] for q in queries]


def test_ircot_prompt_lists_each_document_once(tok):
    r, eng, _ = run("ircot", tok, answering(COT), ret=Overlapping())
    ctx = eng.prompts[2][0].split("Answer in the same format")[0]
    assert [line.split("] ")[1] for line in ctx.splitlines()[1:]] == \
        ["text shared", "text Where-1", "text Where-2", "text Paris-1", "text Paris-2", "text Franc-1", "text Franc-2"]
    assert r.rounds[1].doc_ids == ["shared", "Paris-1", "Paris-2"]  # (the round records the search as it came)


def test_ircot_stops_after_max_steps_then_generates_the_answer(tok):
    pieces = [(" One.", HIGH, 0.1), (" Two.", HIGH, 0.1), (" Three.", HIGH, 0.1), None]
    r, eng, ret = run("ircot", tok, answering(pieces, " Three."), max_steps=2)
    assert ret.queries == [Q, "One."]  # the last step's sentence is never searched
    assert r.text == "One. Two."
    assert len(eng.prompts) == 3 and eng.prompts[-1][0].endswith("Answer: One. Two. So the answer is ")
    assert r.prediction == "One. Two. So the answer is Three."


def test_ircot_ends_the_cot_at_a_newline_or_an_empty_generation(tok):
    r, eng, ret = run("ircot", tok, answering([(" One.", HIGH, 0.1), ("\nQuestion: Two?", HIGH, 0.1), None]))
    assert r.text == "One." and ret.queries == [Q, "One."] and len(eng.prompts) == 3  # (2 steps + the answer)
    r, eng, ret = run("ircot", tok, answering([None]))
    assert r.text == "" and ret.queries == [Q]


def test_ircot_max_docs_caps_the_context(tok):
    r, eng, ret = run("ircot", tok, answering(COT), max_docs=4)
    assert eng.prompts[2][0].count("\n[") == 4 and "[4] doc 0 about Paris is in France." in eng.prompts[2][0]
    assert "[5]" not in eng.prompts[2][0] and len(ret.queries) == 3  # (searches go on; nothing new is added)


# ------------------------------------------------------------------------------------------------ Iter-RetGen


def test_iter_retgen_rounds_search_with_the_question_and_the_last_answer(tok):
    pieces = [(" Paris is in France.", HIGH, 0.1), (" So the answer is France.", HIGH, 0.1),
              ("\nQuestion: Where is Lyon?", HIGH, 0.1), None]
    r, eng, ret = run("iter-retgen", tok, lambda p: continuation(p, pieces))
    said = "Paris is in France. So the answer is France."
    assert ret.queries == [Q, f"{Q} {said}", f"{Q} {said}"]
    assert [n for _, n in eng.prompts] == [64, 64, 64]  # L = 64 (2Wiki) each round; "the answer is": no extra
    # each round's prompt holds that round's documents only
    assert eng.prompts[1][0].startswith("Context:\n" + listed(f"{Q} {said}") + "Answer in the same format")
    assert listed(Q) not in eng.prompts[1][0]
    assert r.text == said + "\nQuestion: Where is Lyon?" == r.prediction  # (the evaluator cuts it)
    r, eng, ret = run("iter-retgen", tok, lambda p: continuation(p, pieces), iterations=1, max_query_tokens=3)
    assert ret.queries == ["is Paris?"] and len(eng.prompts) == 1


# ------------------------------------------------------------------------------------------------ real model

OWN = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "questions_outside_shared.jsonl"


def _parity(tmp_path, method, config, n=2):
    """`fastrag parity` (CLI) on the real SmolLM2 and BM25 over the bundled corpus, over the first n of the project's
    own questions: every decision agrees and both sides count the same work. Returns {qid: retrievals}."""
    from test_methods_e2e import CORPUS, _same_work, cli

    cfg = tmp_path / "method.json"
    cfg.write_text(json.dumps({"fewshot": 4, **config}))
    out = tmp_path / "p"
    p = cli("parity", "--method", method, "--dataset", "hotpotqa", "--data", OWN, "--corpus", CORPUS, "--config",
            cfg, "--limit", n, "--batch-size", n, "--kv-cache-gb", 0.25, "--output", out, "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads((out / "parity.json").read_text())
    assert {"query_agreement", "docs_agreement", "answer_agreement"} <= set(rep)
    return {q: w[2] for q, w in _same_work(rep, out, n).items()}


def test_ircot_parity_with_the_real_model(tmp_path):
    """One question, two steps: the first step's sentence is searched, the second ends the CoT by max_steps."""
    work = _parity(tmp_path, "ircot", {"max_steps": 2, "thought_max_tokens": 16}, n=1)
    assert max(work.values()) == 2, work  # the question's search and one CoT sentence's


@pytest.mark.slow
def test_ircot_parity_with_the_real_model_at_more_steps(tmp_path):
    work = _parity(tmp_path, "ircot", {"max_steps": 3, "thought_max_tokens": 24})
    assert max(work.values()) >= 2, work


@pytest.mark.slow
def test_iter_retgen_parity_with_the_real_model(tmp_path):
    work = _parity(tmp_path, "iter-retgen", {"iterations": 2, "generate_max_length": 24}, n=1)
    assert set(work.values()) == {2}, work  # one search a round
