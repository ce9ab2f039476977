"""BeamSearchQA: config, parsing of malformed outputs, beam rules, the policy on a scripted model (vs the oracle's
loops), and a run through the scheduler on a tiny random-initialised Llama."""

from __future__ import annotations

import json

import pytest

from beamsearchqa_fakes import ListRetriever, ScriptedLLM, TextTok, drive
from fastrag.data.datasets import Example
from fastrag.data.metrics import score
from fastrag.methods.beamsearchqa import (
    BeamConfigError,
    BeamSearchQA,
    beamsearchqa_config,
    best,
    decisions,
    parse_answer,
    parse_questions,
    parse_score,
    prediction_text,
    prune,
    reached,
)
from fastrag.oracle.beamsearchqa import BeamSearchQAOracle
from fastrag.trace import BeamNode, QuestionResult, Round

Q = "Who directed the film that won best picture in 1998?"


# ------------------------------------------------------------------------------------------------ config

def test_defaults_are_the_papers():
    c = beamsearchqa_config("nq")
    assert (c.max_questions, c.max_depth, c.num_docs, c.score_threshold, c.beam_size) == (2, 2, 2, 0.8, 2)


@pytest.mark.parametrize("field, value", [
    ("max_questions", 0), ("beam_size", -1), ("num_docs", 1.5), ("max_depth", True), ("score_threshold", 1.2),
    ("score_threshold", "high"), ("answer_max_tokens", 0), ("score_threshold", float("nan")),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(BeamConfigError, match=field):
        beamsearchqa_config("hotpotqa", overrides={field: value})


def test_config_file_takes_the_papers_letters_and_rejects_unknown_keys(tmp_path):
    p = tmp_path / "b.json"
    p.write_text(json.dumps({"method": "beamsearchqa", "K": 3, "D": 1, "N": 4, "S": 0.5, "B": 1,
                             "summary_max_tokens": 32}))
    c = beamsearchqa_config("webq", p)
    assert (c.max_questions, c.max_depth, c.num_docs, c.score_threshold, c.beam_size, c.summary_max_tokens) == \
        (3, 1, 4, 0.5, 1, 32)
    p.write_text(json.dumps({"K": 2, "beam_width": 3}))
    with pytest.raises(BeamConfigError, match="beam_width") as e:
        beamsearchqa_config("webq", p)
    assert str(p) in str(e.value)
    p.write_text(json.dumps({"B": 0}))
    with pytest.raises(BeamConfigError, match="beam_size"):
        beamsearchqa_config("webq", p)
    for both in ({"K": 2, "max_questions": 3}, {"max_questions": 3, "K": 2}):  # no silent last-one-wins
        p.write_text(json.dumps(both))
        with pytest.raises(BeamConfigError, match="both set max_questions: give one"):
            beamsearchqa_config("webq", p)
    p.write_text(json.dumps({"method": "attn_entropy", "model_name_or_path": "/m", "hallucination_threshold": 1.2}))
    with pytest.raises(BeamConfigError, match=r"b\.json: field 'method' is 'attn_entropy': a config of another"):
        beamsearchqa_config("webq", p)  # (a published DRAGIN file: named as such, not by its first unknown key)


# ------------------------------------------------------------------------------------------------ parsing

@pytest.mark.parametrize("text, expected", [
    (" 0.85", 0.85), ("0.8\nbecause the evidence...", 0.8), (".7", 0.7), (" 1", 1.0), ("0", 0.0),
    ("The probability is 0.65.", 0.65), ("80%", 0.8), ("7/10", 0.7), ("between 0.5 and 0.7", 0.5),
    ("1.5", 1.0), ("-0.3", 0.0), ("42", 1.0),  # out of range: clamped
    ("1e-3", 0.001), ("2.5E-1", 0.25), ("0,9", 0.9), ("yes,0.8", 0.8),  # exponent, decimal comma
    ("1" + "0" * 400, 1.0), ("9e999", 1.0),  # past float range: clamped like any large value
    ("", 0.0), ("no idea", 0.0), ("high", 0.0), ("0/0", 0.0), (None, 0.0),  # unparsable: 0
])
def test_score_parsing(text, expected):
    assert parse_score(text) == pytest.approx(expected)


@pytest.mark.parametrize("text, expected", [
    ("Ranked Questions:\n1. Who is A?\n2. Where is B?\n3. When C?", ["Who is A?", "Where is B?"]),
    ("Ranked Questions:\n1. 1. Who is A?\n2) Where is B?", ["Who is A?", "Where is B?"]),
    ("Sure! Here are some questions:\n- Who is A?\n* Where is B?", ["Who is A?", "Where is B?"]),
    ("Ranked Questions: 1. Who is A? 2. Where is B?", ["Who is A?", "Where is B?"]),
    ("1. [Who is A?]\n2. [Question 2]\n3. ...", ["Who is A?"]),
    ("Q1: Who is A?\nQuestion 2: Where is B?", ["Who is A?", "Where is B?"]),
    ("1. Who is A?\n2. who is a\n3. Who is A ?", ["Who is A?"]),  # repeats (case, punctuation) dropped
    (f"1. {Q}\n2. Who is A?", ["Who is A?"]),  # the question itself is not a sub-question
    ("1. Earlier query\n2. Who is A?", ["Who is A?"]),  # already on the path
    ("Ranked Questions:\n1.\n2.   \n3. **", []), ("", []), ("Ranked Questions:", []), ("\n\n\n", []),
    ("Ranked Questions:\n1. <a question>\n2. <another question>", []),  # the format's slots copied
    ("1. 2022-01-01T00:00:00.00-12:00\n2. 2022-01\n3. Who is A?", ["Who is A?"]),  # no word: not a question
    ("Who is A?\nWhere is B?", ["Who is A?", "Where is B?"]),  # no list markers at all: one question per line
    ("1. **Who is A?**", ["Who is A?"]),
    ("1. Qui est né à Lyon ?\n2. Когда родился Пушкин?", ["Qui est né à Lyon ?", "Когда родился Пушкин?"]),
    ("1. 東京はどこ?\n2. 東京はどこ？", ["東京はどこ?"]),  # any script; repeats still dropped
    ("1. What happened on 4. July 1776?\n2. Who is A?", ["What happened on 4. July 1776?", "Who is A?"]),
    ("1. Who is A? 3. Where is B?", ["Who is A? 3. Where is B?"]),  # items on a line must count on
    ("Sure: 1. Who is A? 2. Where is B?", ["Who is A?", "Where is B?"]),  # preamble on the items' line
])
def test_question_list_parsing(text, expected):
    assert parse_questions(text, 2, Q, ["Earlier query"]) == expected


def test_question_list_respects_k():
    text = "\n".join(f"{i}. Question number {i}?" for i in range(1, 6))
    assert parse_questions(text, 3) == ["Question number 1?", "Question number 2?", "Question number 3?"]
    assert parse_questions(text, 1) == ["Question number 1?"]


@pytest.mark.parametrize("text, expected", [
    (" Paris.", "Paris"), (" Paris\nBecause ...", "Paris"), (": \"Steven Spielberg\".", "Steven Spielberg"),
    ("\n\n **1998**", "1998"), (" The answer is Rome.", "Rome"), ("", ""), ("   \n ", ""), ("...", ""),
    ("The answer  is Rome. The answer is Milan", "Milan"), ("My answer isn't sure", "My answer isn't sure"),
    ("Her answer isolated", "Her answer isolated"),  # "answer is" only as words
])
def test_answer_parsing(text, expected):
    assert parse_answer(text) == expected


@pytest.mark.parametrize("dataset, gold", [("nq", ["December 1972"]), ("webq", ["Jamaican English"]),
                                           ("hotpotqa", ["yes"])])
def test_the_prediction_scores_the_answer_on_every_dataset(dataset, gold):
    ex = Example("q", "question?", gold, dataset)
    s = score(ex, prediction_text(gold[0]))
    assert s["answer"] == gold[0] and s["em"] == 1.0 and s["f1"] == 1.0
    assert score(ex, prediction_text("something else"))["em"] == 0.0
    assert score(ex, prediction_text(""))["answer"] == ""


# ------------------------------------------------------------------------------------------------ beam rules

def _nodes(scores):
    return [BeamNode(answer=f"a{i}", score=s) for i, s in enumerate(scores)]


def test_pruning_keeps_exactly_the_top_b():
    nodes = _nodes([0.2, 0.9, 0.5, 0.9, 0.1, 0.7])
    assert [n.answer for n in prune(nodes, 2)] == ["a1", "a3"]  # ties: generation order
    assert [n.answer for n in prune(nodes, 3)] == ["a1", "a3", "a5"]
    assert [n.answer for n in prune(nodes, 1)] == ["a1"]
    assert [n.answer for n in prune(nodes, 10)] == ["a1", "a3", "a5", "a2", "a0", "a4"]
    assert prune([], 2) == []


def test_exit_test_and_final_choice():
    assert reached(_nodes([0.3, 0.8]), 0.8) and not reached(_nodes([0.3, 0.79]), 0.8)
    assert best(_nodes([0.3, 0.6, 0.6])).answer == "a1"
    with pytest.raises(ValueError, match="empty beam"):
        best([])


# ------------------------------------------------------------------------------------------------ the policy

class ScriptedOracle(BeamSearchQAOracle):
    """The oracle's loops with the scripted LLM in place of `model.generate`."""

    def __init__(self, llm, retriever, cfg):
        self.llm, self.retriever, self.cfg = llm, retriever, cfg
        from fastrag.methods.beamsearchqa import Prompts

        self.prompts = Prompts(TextTok(), cfg)
        self._reset()

    def generate(self, prompt, max_new_tokens):
        self.calls += 1
        return self.llm(prompt)


def run_both(llm_args, cfg_over=None, empty=()):
    """The engine policy (served synchronously) and the oracle on the same script; returns both results."""
    cfg = beamsearchqa_config("hotpotqa", overrides=cfg_over or {})
    tok, ret = TextTok(), ListRetriever(empty)
    llm = ScriptedLLM(**llm_args)
    res, widths = drive(BeamSearchQA(cfg, tok)(Example("1", Q, ["x"], "hotpotqa")), llm, tok, ret)
    ora = ScriptedOracle(ScriptedLLM(**llm_args), ListRetriever(empty), cfg).run("1", Q, ["x"])
    return res, ora, llm, ret, widths


# continuation text after the Ask cue "Ranked Questions:\n1."
TREE = {
    "<root>": " Who is A?\n2. Who is B?",
    Q: " Who is C?\n2. Who is D?",
    "Who is A?": " What is A1?\n2. What is A2?",
    "Who is B?": " What is B1?",
    "Who is C?": " What is C1?",
    "Who is D?": " What is D1?",
}


def test_pruning_in_the_search_keeps_the_top_b_children_and_the_final_answer_is_the_best():
    scores = {"direct": "0.1", f"ans:{Q}": "0.2",
              # depth 1: the four children of the two seeds; B = 2 keeps "Who is C?" and "Who is B?"
              "ans:Who is A?": "0.3", "ans:Who is B?": "0.6", f"ans:{Q}|Who is C?": "0.7", f"ans:{Q}|Who is D?": "0.5",
              # depth 2
              "ans:Who is B?|What is B1?": "0.4", f"ans:{Q}|Who is C?|What is C1?": "0.65"}
    res, ora, llm, ret, widths = run_both({"asks": TREE, "scores": scores})
    assert [n.queries for n in res.beams[1]] == [[Q, "Who is C?"], ["Who is B?"]]
    assert [n.score for n in res.beams[1]] == [0.7, 0.6]
    assert len(res.beams) == 3 and [n.score for n in res.beams[2]] == [0.65, 0.4]
    # Algorithm 1 answers from the last beam even when an earlier one scored higher
    assert res.chosen.queries == [Q, "Who is C?", "What is C1?"] and res.chosen.score == 0.65
    assert res.prediction == prediction_text(f"ans:{Q}|Who is C?|What is C1?")
    assert decisions(res) == decisions(ora) and res.beams == ora.beams
    # calls: S_0 = 2 answers + 2 scores + 1 summary; depth 1 = 2 asks + 4 x (summary, answer, score); depth 2 = 2
    # asks + 2 x 3
    assert res.llm_calls == ora.llm_calls == 5 + 14 + 8 == sum(llm.calls.values())
    assert res.retrievals == ora.retrievals == 1 + 4 + 2
    # one retriever call per depth with all its sub-questions; one Parallel per stage with all nodes
    assert ret.batches == [[Q], ["Who is A?", "Who is B?", "Who is C?", "Who is D?"], ["What is C1?", "What is B1?"]]
    assert max(widths) == 4


@pytest.mark.parametrize("threshold, exits", [(0.8, True), (0.75, True), (0.81, False)])
def test_early_exit_when_a_kept_score_reaches_s(threshold, exits):
    scores = {"direct": "0.1", f"ans:{Q}": "0.2", "ans:Who is B?": "0.8"}
    res, ora, llm, _, _ = run_both({"asks": TREE, "scores": scores}, {"score_threshold": threshold})
    assert llm.calls["ask"] == (2 if exits else 4)  # depth 2 asks only when nothing reached S
    assert len(res.beams) == (2 if exits else 3)
    if exits:
        assert res.chosen.queries == ["Who is B?"] and res.chosen.score == 0.8
    assert decisions(res) == decisions(ora) and res.llm_calls == ora.llm_calls


def test_an_initial_score_above_s_does_not_stop_the_search():
    """Algorithm 1 tests the exit after each expansion depth only (lines 21-24), not on the initial beam."""
    res, ora, llm, _, _ = run_both({"asks": TREE, "scores": {"direct": "0.95"}})
    assert llm.calls["ask"] == 4 and res.chosen.depth == 2
    assert decisions(res) == decisions(ora)


@pytest.mark.parametrize("asks", [
    {},  # empty outputs
    {"<root>": " ...\n2. [Question 2]", Q: f" {Q}\n2. {Q.lower()}"},  # placeholders, the question repeated
    {"<root>": "\n\n", Q: " **"},
])
def test_when_every_expansion_fails_the_initial_beams_best_answer_is_returned(asks):
    res, ora, llm, _, _ = run_both({"asks": asks, "scores": {"direct": "0.2", f"ans:{Q}": "0.6"}})
    assert res.error is None and len(res.beams) == 1
    assert res.chosen.queries == [Q] and res.chosen.answer == f"ans:{Q}" and res.chosen.score == 0.6
    assert llm.calls["ask"] == 2 and llm.calls["summary"] == 1
    assert decisions(res) == decisions(ora)


def test_sub_questions_without_documents_are_failed_expansions():
    empty = {"Who is A?", "Who is B?", "Who is C?", "Who is D?"}
    res, ora, llm, _, _ = run_both({"asks": TREE, "scores": {"direct": "0.7", f"ans:{Q}": "0.6"}}, empty=empty)
    assert res.chosen.answer == "direct" and res.chosen.queries == [] and len(res.beams) == 1
    assert res.retrievals == 5 and ora.retrievals == 5  # the failed searches are recorded all the same
    assert decisions(res) == decisions(ora)


def test_no_document_for_the_question_leaves_one_seed():
    res, ora, llm, _, _ = run_both({"asks": TREE, "scores": {"direct": "0.3"}}, {"max_depth": 0}, empty={Q})
    assert [n.answer for n in res.beams[0]] == ["direct"] and res.chosen.answer == "direct"
    assert llm.calls["summary"] == 0 and decisions(res) == decisions(ora)


def test_empty_question_is_an_error():
    with pytest.raises(ValueError, match="empty question"):
        drive(BeamSearchQA(beamsearchqa_config("nq"), TextTok())(Example("1", "  ", ["x"], "nq")),
              ScriptedLLM(), TextTok(), ListRetriever())


def test_prompts_of_one_question_share_their_stem():
    """Answer, Ask and Score prompts of one node begin with the same text up to the pairs (KV prefix reuse)."""
    from fastrag.methods.beamsearchqa import Prompts

    P = Prompts(TextTok(), beamsearchqa_config("nq"))
    Qs, Es = ["Who is A?"], ["A is a painter."]
    stem = P.stem(Q, Qs, Es)
    for p in (P.answer(Q, Qs, Es), P.ask(Q, Qs, Es), P.score(Q, Qs, Es, "x")):
        assert p.startswith(stem)
    child = P.answer(Q, Qs + ["Who is B?"], Es + ["B is a poet."])
    assert child.startswith(stem[: stem.index("Evidence 1") + len("Evidence 1: A is a painter.")])


def test_the_summary_prompt_cuts_each_document_at_max_doc_chars():
    """A retrieved passage enters the summary prompt cut to max_doc_chars characters, after its title."""
    import dataclasses

    from fastrag.methods.beamsearchqa import Prompts
    from fastrag.retrieval.base import Doc

    P = Prompts(TextTok(), dataclasses.replace(beamsearchqa_config("nq"), max_doc_chars=10))
    p = P.summary(Q, [Doc("a", "Title", "0123456789ABCDEF"), Doc("b", "", "short")])
    assert "[1] Title: 0123456789\n[2] short\n" in p and "A" not in p.split("[1] Title: ")[1].split("\n")[0]


# ------------------------------------------------------------------------------------------------ records, parity

def test_records_round_trip_and_old_records_still_load():
    r = QuestionResult(qid="1", question=Q, gold=["x"], rounds=[Round(query="q", doc_ids=["d"])], llm_calls=7,
                       chosen=BeamNode(queries=["q"], evidence=["e"], doc_ids=[["d"]], answer="a", score=0.5, depth=1),
                       beams=[[BeamNode(answer="b", score=0.1)], [BeamNode(queries=["q"], answer="a", score=0.5)]])
    back = QuestionResult.from_json(json.loads(json.dumps(r.to_json())))
    assert back == r and back.retrievals == 1
    old = {"qid": "1", "question": Q, "gold": ["x"], "text": "t", "prediction": "p", "rounds": [],
           "prefill_tokens": 3, "decode_tokens": 4, "wall_s": 0.5, "error": None, "metrics": {}, "retrievals": 0}
    o = QuestionResult.from_json(old)
    assert o.chosen is None and o.beams == [] and o.llm_calls == 0


def test_parity_compares_the_answer_and_the_path_for_beamsearchqa_and_is_unchanged_for_dragin():
    from fastrag.parity import compare, method_decisions

    def rec(answer, path):
        return QuestionResult(qid="1", question=Q, gold=["x"], chosen=BeamNode(queries=path, answer=answer),
                              rounds=[Round(trigger_sentence="t", query="q")], metrics={"answer": answer})

    beam = method_decisions("beamsearchqa")
    same = compare([rec("a", ["p"])], [rec("a", ["p"])], beam)
    assert same["agreement"] == 1.0 and set(same) >= {"answer_agreement", "path_agreement"}
    other_path = compare([rec("a", ["p"])], [rec("a", ["p2"])], beam)
    assert other_path["agreement"] == 0.0 and other_path["answer_agreement"] == 1.0
    assert other_path["disagreements"][0]["differs"] == ["path"]
    dragin = compare([rec("a", ["p"])], [rec("a", ["p2"])], method_decisions("dragin"))
    assert dragin["agreement"] == 1.0 and set(k for k in dragin if k.endswith("_agreement")) == \
        {"trigger_agreement", "query_agreement", "answer_agreement"}
