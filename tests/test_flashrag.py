"""FlashRAG's dataset format first-class: hand-written files in the shapes of its benchmarks (NQ, TriviaQA, PopQA,
SQuAD, HotpotQA, 2WikiMultihopQA, MuSiQue, StrategyQA, ASQA, ELI5, BoolQ, MMLU) load under any dataset name with
their metadata; other names run as generic QA; bad lines name file, line and field; `fastrag convert` writes it."""

from __future__ import annotations

import json
import warnings

import pytest

from fastrag.data.datasets import (DataError, canonical_dataset, flashrag_record, load_examples, write_flashrag)
from fastrag.data.evidence import gold_titles

HOTPOT_META = {"type": "bridge", "level": "hard",
               "supporting_facts": {"title": ["Kiss and Tell (1945 film)", "Shirley Temple"], "sent_id": [0, 0]},
               "context": {"title": ["Kiss and Tell (1945 film)", "Shirley Temple"],
                           "sentences": [["Kiss and Tell is a 1945 film."], ["Shirley Temple Black was an actress."]]}}
WIKI2_META = {"type": "compositional",
              "supporting_facts": {"title": ["Charles Mathew", "James Charles Mathew"], "sent_id": [2, 1]},
              "evidences": [["Charles James Mathew", "father", "Sir James Charles Mathew"]]}
MUSIQUE_META = {"answerable": True, "question_decomposition": [{"id": 1, "question": "who?", "answer": "X"}],
                "paragraphs": [{"idx": 0, "title": "Lake Tahoe", "paragraph_text": "...", "is_supporting": True},
                               {"idx": 1, "title": "Reno", "paragraph_text": "...", "is_supporting": False}]}
SHAPES = {
    "nq": [{"id": "test_0", "question": "who got the first nobel prize in physics",
            "golden_answers": ["Wilhelm Conrad Röntgen"]}],
    "triviaqa": [{"id": "test_1", "question": "Which Lloyd Webber musical premiered in 1993?",
                  "golden_answers": ["Sunset Boulevard", "Sunset Blvd", "sunset boulevard"], "metadata": {}}],
    "popqa": [{"id": "test_2", "question": "What is George Rankin's occupation?", "golden_answers": ["politician"],
               "metadata": {"s_wiki_title": "George Rankin", "prop": "occupation", "s_pop": 142}}],
    "squad": [{"id": "dev_3", "question": "Which NFL team represented the AFC at Super Bowl 50?",
               "golden_answers": ["Denver Broncos"], "metadata": {"title": "Super_Bowl_50", "context": "..."}}],
    "hotpotqa": [{"id": "5a8b57f25542995d1e6f1371", "question": "Were Scott Derrickson and Ed Wood of the same "
                  "nationality?", "golden_answers": ["yes"], "metadata": HOTPOT_META}],
    "2wikimultihopqa": [{"id": "a5ec8e7e0bdd11eba7f7acde48001122", "question": "Who is the paternal grandfather "
                         "of Charles Mathew?", "golden_answers": ["Sir James Charles Mathew"], "metadata": WIKI2_META}],
    "musique": [{"id": "2hop__1", "question": "Where is the lake near the city?", "golden_answers": ["Nevada"],
                 "metadata": MUSIQUE_META}],
    "strategyqa": [{"id": "s1", "question": "Could a llama birth twice during the War in Vietnam?",
                    "golden_answers": [False], "metadata": {"facts": ["..."]}},
                   {"id": "s2", "question": "Is water wet?", "golden_answers": ["True"]}],
    "asqa": [{"id": "a1", "question": "Who played the lead in the movie?", "golden_answers": [
        "The lead was played by several actors: in the 1990 version it was A, and in the 2010 remake it was B. " * 3],
        "metadata": {"qa_pairs": [{"question": "1990?", "short_answers": ["A"]}]}}],
    "eli5": [{"id": "e1", "question": "Why is the sky blue?", "golden_answers": [
        "Because air scatters short wavelengths more than long ones.\nSo blue light reaches your eye from every "
        "direction.", "Rayleigh scattering."]}],
    "boolq": [{"id": "b1", "question": "is france the same timezone as the uk", "golden_answers": [True],
               "metadata": {"passage": "..."}}],
    "mmlu": [{"id": "m1", "question": "Which of these is a prime number?", "golden_answers": ["C"],
              "choices": ["4", "6", "7", "9"], "metadata": {"subject": "elementary_mathematics"}},
             {"id": "m2", "question": "2 + 2 =", "golden_answers": [1],
              "metadata": {"choices": {"text": ["3", "4"], "label": ["A", "B"]}}}],
}


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_each_benchmark_shape_loads_with_its_metadata(tmp_path, name):
    rows = SHAPES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (FlashRAG's own names: no warning, and no other-dataset warning)
        got = load_examples(name, _write(tmp_path / f"{name}.jsonl", rows))
    assert [e.qid for e in got] == [r["id"] for r in rows]
    for e, r in zip(got, rows):
        assert e.question == r["question"] and e.meta["format"] == "flashrag"
        assert e.dataset == canonical_dataset(name)
        assert e.meta.get("metadata") == r.get("metadata")
        if "choices" in r:
            assert e.meta["choices"] == r["choices"]
    answers = [e.answers for e in got]
    expected = {"strategyqa": [["no"], ["yes"]], "boolq": [["yes"]], "mmlu": [["C"], ["1"]]}
    assert answers == expected.get(name, [r["golden_answers"] for r in rows])


def test_dataset_names(tmp_path):
    assert [canonical_dataset(n) for n in ("nq", "HotpotQA", "2wikimultihopqa", "web_questions", "StrategyQA")] == \
        ["nq", "hotpotqa", "2wikimultihopqa", "webq", "strategyqa"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert {canonical_dataset(n) for n in ("popqa", "triviaqa", "squad", "musique", "asqa", "mmlu", "qa")} == {"qa"}
    with pytest.warns(UserWarning, match="dataset 'my_set-v2' has no handling of its own: it runs as generic "
                                         "open-domain QA .* 2wikimultihopqa, hotpotqa"):
        assert canonical_dataset("my_set-v2") == "qa"
    for bad in ("", "  ", "no such set", "a/b", None):
        with pytest.raises(DataError, match="unknown dataset .*a dataset name is letters, digits"):
            canonical_dataset(bad)


def test_generic_qa_gets_nq_handling(tmp_path):
    from fastrag.config import dragin_config
    from fastrag.data.exemplars import load_exemplars
    from fastrag.data.metrics import score

    (e,) = load_examples("popqa", _write(tmp_path / "p.jsonl", SHAPES["popqa"]))
    assert score(e, "Politician.")["em"] == 1.0  # (no "the answer is": the whole text, as NQ's)
    assert score(e, "He was a judge. So the answer is politician.")["em"] == 1.0
    assert load_exemplars("popqa") == load_exemplars("hotpotqa")
    assert dragin_config("popqa").dataset == "qa"


def test_a_multihop_file_under_another_name_warns(tmp_path):
    p = _write(tmp_path / "h.jsonl", SHAPES["hotpotqa"])
    with pytest.warns(UserWarning, match="looks like a hotpotqa file .*metadata carries HotpotQA's 'level'"):
        load_examples("2wikimultihopqa", p)
    with pytest.warns(UserWarning, match="looks like a 2wikimultihopqa file"):
        load_examples("hotpotqa", _write(tmp_path / "w.jsonl", SHAPES["2wikimultihopqa"]))


def test_gold_evidence_comes_from_the_metadata(tmp_path):
    got = {name: load_examples(name, _write(tmp_path / f"{name}.jsonl", SHAPES[name]))[0]
           for name in ("hotpotqa", "2wikimultihopqa", "musique", "nq")}
    assert gold_titles(got["hotpotqa"].meta) == ["Kiss and Tell (1945 film)", "Shirley Temple"]
    assert gold_titles(got["2wikimultihopqa"].meta) == ["Charles Mathew", "James Charles Mathew"]
    assert gold_titles(got["musique"].meta) == ["Lake Tahoe"]
    assert gold_titles(got["nq"].meta) is None


GOOD = {"id": "ok", "question": "q?", "golden_answers": ["a"]}


@pytest.mark.parametrize("bad, message", [
    ({"id": "x", "question": "q?"}, r"f\.jsonl:3: record is missing the required field 'golden_answers'"),
    ({"id": "x", "question": "q?", "golden_answers": {"a": 1}},
     r"f\.jsonl:3: field 'golden_answers' must be a string or a list of strings"),
    ({"id": "x", "question": "q?", "golden_answers": [["nested"]]},
     r"f\.jsonl:3: field 'golden_answers' must be a string or a list of strings"),
    ({"id": "x", "question": "q?", "golden_answers": ["a"], "metadata": ["not", "an", "object"]},
     r"f\.jsonl:3: field 'metadata' has type list, expected an object"),
    ({"id": 1.5, "question": "q?", "golden_answers": ["a"]}, r"f\.jsonl:3: field 'id' must be a string or an integer"),
    ({"question": "q?", "golden_answers": ["a"]}, r"f\.jsonl:3: record is missing the required field 'id'"),
    ({"id": "x", "question": 7, "golden_answers": ["a"]}, r"f\.jsonl:3: field 'question' must be a string"),
    ('{"id": "x", "question": "q?", "golden_answers": ["a"]', r"f\.jsonl:3: malformed JSON line"),
])
def test_a_bad_line_names_file_line_and_field(tmp_path, bad, message):
    p = _write(tmp_path / "f.jsonl", [GOOD, {**GOOD, "id": "ok2"}, bad])
    with pytest.raises(DataError, match=message):
        load_examples("popqa", p)


def test_write_and_read_back(tmp_path):
    rows = SHAPES["mmlu"] + SHAPES["hotpotqa"] + SHAPES["eli5"]
    src = load_examples("mmlu", _write(tmp_path / "in.jsonl", rows))
    out = tmp_path / "out.jsonl"
    assert write_flashrag(src, out) == 4
    assert [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()] == \
        [{**r, "golden_answers": [str(a) for a in r["golden_answers"]]} for r in rows]
    again = load_examples("mmlu", out)
    assert [(e.qid, e.question, e.answers, e.meta) for e in again] == [(e.qid, e.question, e.answers, e.meta)
                                                                       for e in src]


def test_another_format_converts_with_its_fields_in_metadata(tmp_path):
    from fastrag.cli import main

    src = _write(tmp_path / "dev.jsonl", [{"_id": "ab" * 16, "type": "compositional", "question": "Who?",
                                           "answer": "Sir James", "supporting_facts": [["Charles Mathew", 2]],
                                           "evidences": [["C", "father", "S"]]}])
    out = tmp_path / "dev.flashrag.jsonl"
    assert main(["convert", "--dataset", "2wikimultihopqa", "--data", str(src), "--output", str(out)]) == 0
    (rec,) = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert rec == {"id": "ab" * 16, "question": "Who?", "golden_answers": ["Sir James"],
                   "metadata": {"type": "compositional", "supporting_facts": [["Charles Mathew", 2]],
                                "evidences": [["C", "father", "S"]], "source_format": "2wiki"}}
    (e,) = load_examples("2wikimultihopqa", out)
    assert gold_titles(e.meta) == ["Charles Mathew"] and e.answers == ["Sir James"]
    assert flashrag_record(e)["metadata"]["source_format"] == "2wiki"
    assert main(["convert", "--dataset", "nq", "--data", str(src), "--output", str(src)]) == 2
    assert main(["convert", "--dataset", "nq", "--data", str(tmp_path / "none.jsonl"), "--output", str(out)]) == 2


def test_a_near_miss_of_a_handled_dataset_is_a_typo_not_generic_qa():
    from fastrag.data.datasets import DataError, canonical_dataset

    for typo, meant in (("hotpotq", "hotpotqa"), ("strategy_qa", "strategyqa"), ("2wikimultihopq", "2wikimultihopqa")):
        with pytest.raises(DataError, match=f"did you mean '{meant}'"):
            canonical_dataset(typo)
    assert canonical_dataset("triviaqa") == "qa"  # (a FlashRAG name is never taken for a typo)
