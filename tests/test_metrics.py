"""Answer extraction and EM/F1/accuracy on hand-made cases (expected values derived by hand in the comments)."""

from __future__ import annotations

import pytest

from fastrag.data import Example
from fastrag.data.metrics import (
    ANSWER_MAX_TOKENS,
    ANSWER_PROMPT_SUFFIX,
    aggregate,
    answer_prompt,
    clean_prediction,
    complete_answer,
    exact_match,
    extract_answer,
    f1_precision_recall,
    f1_score,
    needs_answer_generation,
    normalize_answer,
    score,
    strategyqa_accuracy,
    strategyqa_label,
)


def test_normalize():
    assert normalize_answer("  The Cat-sat, on A mat! ") == "catsat on mat"
    assert normalize_answer("An apple") == "apple"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words


def test_exact_match():
    assert exact_match("The Cat!", ["a cat"]) == 1.0
    assert exact_match("cat", ["dog", "Cat."]) == 1.0  # any alias
    assert exact_match("cats", ["cat"]) == 0.0
    assert exact_match("cat", []) == 0.0
    assert exact_match("cat", "cat") == 1.0  # a bare string gold


def test_f1_by_hand():
    # "the cat sat" -> [cat, sat]; "cat sat down" -> [cat, sat, down]; overlap 2: P = 2/2, R = 2/3,
    # F1 = 2 * 1 * (2/3) / (1 + 2/3) = 0.8
    assert f1_score("the cat sat", ["cat sat down"]) == pytest.approx(0.8)
    # multiset overlap: [x, x, y] vs [x, y, y] share one x and one y: P = R = 2/3, F1 = 2/3
    assert f1_score("x x y", ["x y y"]) == pytest.approx(2 / 3)
    assert f1_score("x x", ["x x"]) == 1.0  # (a set overlap, 1, would make it P = R = 1/2)
    # max over aliases: vs "york" P=1/3 R=1 F1=0.5; vs "new york" P=2/3 R=1 F1=0.8
    f1, p, r = f1_precision_recall("new york city", ["york", "new york"])
    assert (f1, p, r) == pytest.approx((0.8, 2 / 3, 1.0))
    assert f1_score("completely different", ["nothing shared"]) == 0.0
    # precision and recall each maxed on their own: vs "x" P=1/2 R=1; vs "x y z w" P=1 R=1/2 (F1 2/3 both)
    assert f1_precision_recall("x y", ["x", "x y z w"]) == pytest.approx((2 / 3, 1.0, 1.0))


def test_f1_yes_no_rule():
    assert f1_score("yes", ["yes it is"]) == 0.0  # pred is yes/no and differs: no partial credit
    assert f1_score("no way", ["no"]) == 0.0  # gold is yes/no and differs
    assert f1_score("No.", ["no"]) == 1.0
    assert f1_score("yes", ["no", "yes"]) == 1.0  # max over aliases still applies
    assert f1_score("noanswer x", ["noanswer"]) == 0.0  # "noanswer" gets no partial credit either (else 2/3)


def test_clean_and_extract():
    assert clean_prediction("abc Note: more") == "abc "
    assert clean_prediction("Question: kept at position 0") == "Question: kept at position 0"
    assert clean_prediction("a #10000000 b") == "a "
    assert clean_prediction("a Note: b Question: c") == "a "  # each split word in turn ("Question:" first)
    assert extract_answer("Thus X. So the answer is Paris.") == "Paris"
    assert extract_answer("So the answer is 1,000.</s>") == "1,000"
    assert extract_answer("so the answer is Rome.\nQuestion: What is next? So the answer is Milan.") == "Rome"
    assert extract_answer("Question: Q? so the answer is bar") == "bar"
    assert extract_answer("The answer is Paris.") is None  # lowercase trigger only, as published
    assert extract_answer("no trigger here") is None
    assert extract_answer("the answer is") == ""


def test_extra_generation_rule():
    assert ANSWER_PROMPT_SUFFIX == " So the answer is " and ANSWER_MAX_TOKENS == 20
    assert needs_answer_generation("He was born in 1950.")
    assert not needs_answer_generation("So the answer is 1950.")
    assert needs_answer_generation("Note: ignore. Then x. Question: so the answer is y")  # cut at "Question:"
    assert answer_prompt("D\n", "Question: q\nAnswer:", "He was born in 1950. Note: junk") == (
        "D\nQuestion: q\nAnswer: He was born in 1950.  So the answer is ")
    assert complete_answer("He was born in 1950.", "  1950.\nQuestion: next") == "He was born in 1950. So the answer is 1950.\n"
    assert extract_answer(complete_answer("He was born in 1950.", " 1950.\nQuestion: next")) == "1950"
    assert complete_answer("Note: x", "y") == ""  # (the cleaning keeps a split word at 0; this cut does not)


def test_strategyqa():
    assert strategyqa_label("Thus no. So the answer is Yes, because") == "yes"
    assert strategyqa_label("So the answer is maybe.") == "no"  # anything not starting with "yes" is "no"
    assert strategyqa_label("So the answer is no, not yes") == "no"
    assert strategyqa_label("I think yes") == ""  # a chain of thought without the trigger is never right
    assert strategyqa_label(" Yes. ") == "yes"  # a bare answer
    assert strategyqa_accuracy("So the answer is yes.", True) == 1.0
    assert strategyqa_accuracy("So the answer is yes.", "no") == 0.0
    assert strategyqa_accuracy("So the answer is no.", ["no"]) == 1.0
    assert strategyqa_accuracy("I think yes", True) == 0.0
    with pytest.raises(ValueError):
        strategyqa_accuracy("So the answer is yes.", "perhaps")


def _ex(dataset, answers):
    return Example(qid="q", question="?", answers=answers, dataset=dataset, meta={})


def test_score():
    s = score(_ex("hotpotqa", ["Scott Glenn"]), "The actor is Scott Glenn. So the answer is Scott Glenn.")
    assert (s["em"], s["f1"], s["accuracy"], s["answer"]) == (1.0, 1.0, None, "Scott Glenn")
    s = score(_ex("hotpotqa", ["Scott Glenn"]), "The actor is Scott Glenn.")  # no trigger: hotpotqa scores ""
    assert (s["em"], s["f1"]) == (0.0, 0.0)
    s = score(_ex("2wikimultihopqa", ["Scott Glenn"]), "Scott Glenn.")  # 2wiki scores the whole text
    assert s["em"] == 1.0
    s = score(_ex("2wikimultihopqa", ["Scott Glenn"]), "Scott Glenn. Question: Who else?")  # cleaned first
    assert (s["answer"], s["em"]) == ("Scott Glenn.", 1.0)
    for dataset in ("nq", "webq"):  # so do NQ and WebQuestions
        assert score(_ex(dataset, ["Paris"]), " Paris.")["em"] == 1.0
    s = score(_ex("iirc", ["15 people"]), "So the answer is 15.")  # P = 1, R = 1/2 -> F1 = 2/3
    assert (s["em"], s["f1"], s["precision"], s["recall"]) == pytest.approx((0.0, 2 / 3, 1.0, 0.5))
    s = score(_ex("strategyqa", ["no"]), "Pears float. So the answer is no.")
    assert (s["em"], s["accuracy"]) == (1.0, 1.0)
    s = score(_ex("strategyqa", ["yes"]), "Pears float. So the answer is no.")
    assert (s["em"], s["f1"], s["accuracy"]) == (0.0, 0.0, 0.0)


def test_aggregate():
    agg = aggregate([{"answer": "a", "em": 1.0, "f1": 0.5, "accuracy": None},
                     {"answer": "b", "em": 0.0, "f1": 1.0, "accuracy": None}])
    assert agg == {"em": 0.5, "f1": 0.75, "accuracy": None, "n": 2}
    agg = aggregate([{"em": 1.0, "accuracy": 1.0}, {"em": 0.0, "accuracy": 0.0}, {"em": 0.0, "accuracy": 0.0}])
    assert agg["accuracy"] == pytest.approx(1 / 3) and agg["n"] == 3
    assert aggregate([]) == {"n": 0}
    agg = aggregate([{"em": 1.0, "ok": True}, {"em": float("nan"), "ok": False}, {"em": 0.0, "ok": True}])
    assert agg["em"] == 0.5 and agg["n"] == 3 and "ok" not in agg  # a NaN is skipped; a bool is no figure
