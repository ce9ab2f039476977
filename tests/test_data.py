"""Dataset loaders (real shared files + synthetic files of every format) and few-shot exemplars."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import pytest

from fastrag.data import DATASETS, DataError, case_text, demo_text, load_examples, load_exemplars
from fastrag.data.metrics import exact_match

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("FASTRAG_SHARED_DATA", REPO.parent / "shared" / "data"))
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"shared data not found at {SHARED} (FASTRAG_SHARED_DATA)")

# (dataset, file, records, detected format) as documented in the shared data README
SHARED_FILES = [
    ("hotpotqa", "hotpotqa/dev_distractor_200.jsonl", 200, "ircot"),
    ("2wikimultihopqa", "2wikimultihopqa/dev_sample_200.jsonl", 200, "2wiki"),
    ("2wikimultihopqa", "2wikimultihopqa/dev_first1000.json", 1000, "2wiki_list"),
    ("strategyqa", "strategyqa/train_first1000.json", 1000, "strategyqa"),
    ("nq", "nq_open/dev_500.jsonl", 500, "nq_open"),
    ("webq", "webquestions/test_500.json", 500, "webq"),
]


def _raw_records(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@needs_shared
@pytest.mark.parametrize("dataset,rel,count,fmt", SHARED_FILES)
def test_shared_files_load(dataset, rel, count, fmt):
    path = SHARED / rel
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ex = load_examples(dataset, path)
    assert len(ex) == count
    no_gold = [e.qid for e in ex if not e.answers]  # (every gold normalised to nothing: left out, and warned)
    if no_gold:
        assert any(f"{len(no_gold)} question(s) have no gold answer (first: {no_gold[0]})" in str(w.message)
                   for w in caught), [str(w.message) for w in caught]
    assert len({e.qid for e in ex}) == count, "qids must be unique"
    # no gold answer of a real QA file is taken for a regular expression (the warning is for CuratedTREC's patterns)
    assert not [str(w.message) for w in caught if "regular expression" in str(w.message)]
    raw = _raw_records(path)
    assert len(raw) == count
    for e, r in zip(ex, raw):
        assert isinstance(e.qid, str) and e.qid
        assert isinstance(e.question, str) and e.question.strip(), e.qid
        assert e.answers and all(isinstance(a, str) and a.strip() for a in e.answers), e.qid
        assert e.dataset == dataset and e.meta["format"] == fmt
        # the question text comes through unchanged from whichever upstream field holds it
        assert e.question == r.get("question", r.get("question_text", r.get("qText")))
    assert len(load_examples(dataset, path, limit=7)) == 7


@needs_shared
def test_shared_field_values():
    hp = load_examples("hotpotqa", SHARED / "hotpotqa/dev_distractor_200.jsonl", limit=1)[0]
    assert hp.qid == "5a8c7595554299585d9e36b6" and hp.answers == ["Chief of Protocol"]
    assert "contexts" in hp.meta  # kept for oracle-retrieval experiments
    sq_raw = json.loads((SHARED / "strategyqa/train_first1000.json").read_text())
    sq = load_examples("strategyqa", SHARED / "strategyqa/train_first1000.json")
    for e, r in zip(sq, sq_raw):
        assert e.answers == (["yes"] if r["answer"] else ["no"]) and e.qid == r["qid"]
    w2 = load_examples("2wikimultihopqa", SHARED / "2wikimultihopqa/dev_first1000.json", limit=3)
    assert w2[0].answers == ["Małgorzata Braunek"]  # list of aliases
    assert w2[2].answers == ["12 June 1516"]  # a bare string answer becomes a one-element list
    nq = load_examples("nq", SHARED / "nq_open/dev_500.jsonl", limit=1)[0]
    assert nq.answers == ["14 December 1972 UTC", "December 1972"]


# ---------------------------------------------------------------- synthetic files, one per format


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj, indent=2), encoding="utf-8")
    return path


def test_ircot(tmp_path):
    p = _jsonl(tmp_path / "a.jsonl", [
        {"question_id": "h1", "question_text": "Q1?", "answers_objects": [{"spans": ["A", "B"]}, {"spans": ["C"]}],
         "contexts": []},
        {"question_id": "h2", "question_text": "Q2?", "answers_objects": [{"spans": ["D"]}]},
    ])
    ex = load_examples("hotpotqa", p)
    assert [(e.qid, e.question, e.answers) for e in ex] == [("h1", "Q1?", ["A", "B", "C"]), ("h2", "Q2?", ["D"])]


def test_2wiki_original_json_list_and_jsonl(tmp_path):
    recs = [{"_id": "x1", "type": "comparison", "question": "Q?", "answer": "yes", "answer_id": "Q1"}]
    for p in (_json(tmp_path / "a.json", recs), _jsonl(tmp_path / "b.jsonl", recs)):
        (e,) = load_examples("2wikimultihopqa", p)
        assert (e.qid, e.question, e.answers, e.meta["answer_id"]) == ("x1", "Q?", ["yes"], "Q1")


def test_2wiki_answer_aliases_as_the_published_evaluation_reads_them(tmp_path):
    """id_aliases.json (one {Q_id, aliases, demonyms} per line): a question's gold answers gain the aliases of its
    answer_id, after its own answer, without repeats, demonyms left out; the {id: [aliases]} form reads alike."""
    recs = [{"_id": "x1", "question": "Q1?", "answer": "United States", "answer_id": "Q30"},
            {"_id": "x2", "question": "Q2?", "answer": "Cork", "answer_id": "Q36647"},
            {"_id": "x3", "question": "Q3?", "answer": "no", "answer_id": ""}]
    data = _jsonl(tmp_path / "d.jsonl", recs)
    lines = _jsonl(tmp_path / "id_aliases.json", [
        {"Q_id": "Q30", "aliases": ["USA", "United States", "U.S."], "demonyms": ["American"]},
        {"Q_id": "Q99", "aliases": ["elsewhere"], "demonyms": []}])
    mapping = _json(tmp_path / "map.json", {"Q30": ["USA", "U.S."], "Q36647": "Corcaigh"})
    ex = load_examples("2wikimultihopqa", data, answer_aliases=lines)
    assert [e.answers for e in ex] == [["United States", "USA", "U.S."], ["Cork"], ["no"]]
    ex = load_examples("2wikimultihopqa", data, answer_aliases=mapping)
    assert [e.answers for e in ex] == [["United States", "USA", "U.S."], ["Cork", "Corcaigh"], ["no"]]
    assert load_examples("2wikimultihopqa", data)[0].answers == ["United States"]  # none asked: none added
    # an id listed again: its last line wins (as the published loader reads the file)
    again = _jsonl(tmp_path / "again.json", [{"Q_id": "Q30", "aliases": ["USA"]}, {"Q_id": "Q30", "aliases": ["U.S."]}])
    assert load_examples("2wikimultihopqa", data, answer_aliases=again)[0].answers == ["United States", "U.S."]
    # a file whose ids match no question (another dataset's?) changes nothing, and says so
    other = _jsonl(tmp_path / "other.json", [{"Q_id": "Q999", "aliases": ["x"]}])
    with pytest.warns(UserWarning, match="no question of .* has an answer_id with aliases there"):
        assert [e.answers for e in load_examples("2wikimultihopqa", data, answer_aliases=other)] == \
            [["United States"], ["Cork"], ["no"]]


@pytest.mark.parametrize("content, pattern", [
    ('{"Q_id": "Q1", "aliases": ["a"]}\n{"Q_id": "Q2"}\n', r"id_aliases.json:2: .*'aliases'"),
    ('{"Q_id": "Q1", "aliases": ["a"]}\n{"Q_id": 7, "aliases": ["b"]}\n', r"id_aliases.json:2: .*'Q_id'.*int"),
    ('{"Q_id": "Q1", "aliases": [{"x": 1}]}\n', r"id_aliases.json:1: field 'aliases'"),
    ('{"id": "Q1", "aliases": ["a"]}\n', r"id_aliases.json:1: .*'Q_id'"),
    ('{"Q1": {"x": 1}}', r"id_aliases.json:1: field 'Q1'"),
    ("", r"id_aliases.json: file is empty"),
])
def test_bad_answer_alias_files_name_line_and_field(tmp_path, content, pattern):
    data = _jsonl(tmp_path / "d.jsonl", [{"_id": "x1", "question": "Q?", "answer": "a", "answer_id": "Q1"}])
    (tmp_path / "id_aliases.json").write_text(content)
    with pytest.raises(DataError, match=pattern):
        load_examples("2wikimultihopqa", data, answer_aliases=tmp_path / "id_aliases.json")


def test_answer_aliases_for_data_without_answer_ids_are_refused(tmp_path):
    data = _json(tmp_path / "a.json", [{"test_id": 0, "question": "Q0", "answer": ["a"]}])
    aliases = _jsonl(tmp_path / "id_aliases.json", [{"Q_id": "Q1", "aliases": ["b"]}])
    with pytest.raises(DataError, match=r"a.json: no question has an 'answer_id'"):
        load_examples("2wikimultihopqa", data, answer_aliases=aliases)


def test_2wiki_list(tmp_path):
    p = _json(tmp_path / "a.json", [{"test_id": 0, "question": "Q0", "answer": ["a", "b"]},
                                    {"test_id": 1, "question": "Q1", "answer": "c"}])
    ex = load_examples("2wikimultihopqa", p)
    assert [(e.qid, e.answers) for e in ex] == [("0", ["a", "b"]), ("1", ["c"])]


def test_strategyqa(tmp_path):
    p = _json(tmp_path / "s.json", [{"qid": "s1", "question": "Q?", "answer": True, "facts": ["f"]},
                                    {"qid": "s2", "question": "Q2?", "answer": False}])
    ex = load_examples("StrategyQA", p)
    assert [e.answers for e in ex] == [["yes"], ["no"]]
    assert ex[0].meta["answer_bool"] is True and ex[0].meta["facts"] == ["f"] and ex[0].dataset == "strategyqa"


def test_a_file_of_another_dataset_is_refused(tmp_path):
    """A file read as a dataset it is not: scored (and prompted) as the wrong dataset, silently, unless refused."""
    s = _json(tmp_path / "s.json", [{"qid": "s1", "question": "Q?", "answer": True}])
    for other in ("hotpotqa", "nq"):
        with pytest.raises(DataError, match=rf"s\.json\[0\]: this is a strategyqa file .* --dataset is {other}"):
            load_examples(other, s)
    passages = [{"title": "P", "questions": [{"qid": "i", "question": "q", "answer": {"type": "value",
                                                                                      "answer_value": "3"}}]}]
    with pytest.raises(DataError, match="this is a iirc file"):
        load_examples("hotpotqa", _json(tmp_path / "i.json", passages))
    h = _jsonl(tmp_path / "h.jsonl", [{"_id": "h1", "question": "Who?", "answer": "yes"},
                                      {"_id": "h2", "question": "Who?", "answer": "Chief of Protocol"}])
    with pytest.raises(DataError, match=r"h\.jsonl:2: --dataset strategyqa scores yes/no answers, but question 'h2'"):
        load_examples("strategyqa", h)
    assert [e.answers for e in load_examples("strategyqa", h, limit=1)] == [["yes"]]  # yes/no golds: fine
    f = _jsonl(tmp_path / "f.jsonl", [{"id": "t", "question": "q?", "golden_answers": ["No"]}])
    assert load_examples("strategyqa", f)[0].answers == ["No"]  # a FlashRAG StrategyQA file


def test_a_qid_file_whose_answer_is_no_yes_no_is_not_called_strategyqa(tmp_path):
    """{qid, question, answer: "Paris"} was detected as StrategyQA (any string answer): read as nq it was refused as
    "a strategyqa file ... pass --dataset strategyqa", which then refused its answer. It is the plain QA format
    (read as nq_open) now, and --dataset strategyqa names its non-yes/no gold; a yes/no answer with a qid still
    makes a StrategyQA file."""
    p = _jsonl(tmp_path / "q.jsonl", [{"qid": "1", "question": "Capital of France?", "answer": "Paris"},
                                      {"qid": "2", "question": "Year?", "answer": 1946}])
    for name in ("nq", "hotpotqa"):
        ex = load_examples(name, p)
        assert [(e.qid, e.question, e.answers, e.meta["format"]) for e in ex] == [
            ("1", "Capital of France?", ["Paris"], "nq_open"), ("2", "Year?", ["1946"], "nq_open")]
    with pytest.raises(DataError, match=r"q\.jsonl:1: --dataset strategyqa scores yes/no answers, but question '1'"):
        load_examples("strategyqa", p)
    plain = _jsonl(tmp_path / "plain.jsonl", [{"id": "a", "question": "Q?", "answer": "Danube"},
                                              {"id": "b", "question": "Q2?", "answer": ["x", "y"]}])
    assert [(e.qid, e.answers) for e in load_examples("hotpotqa", plain)] == [("a", ["Danube"]), ("b", ["x", "y"])]
    for bad in ({"question": "Q?", "answer": True}, {"question": "Q?", "answer": {"text": "x"}}, {"question": "Q?"}):
        with pytest.raises(DataError, match=r"b\.jsonl:1: unknown data format .*NQ-open or plain QA"):
            load_examples("nq", _jsonl(tmp_path / "b.jsonl", [bad]))
    yes = _jsonl(tmp_path / "y.jsonl", [{"qid": "1", "question": "Q?", "answer": " Yes"}])  # a yes/no string: still
    assert load_examples("strategyqa", yes)[0].answers == ["yes"]
    with pytest.raises(DataError, match="this is a strategyqa file"):
        load_examples("nq", yes)


def test_nq_open_ids_are_generated_and_unique(tmp_path):
    p = _jsonl(tmp_path / "nq.jsonl", [{"question": "q", "answer": ["a"]}] * 3)
    ex = load_examples("nq", p)
    assert [e.qid for e in ex] == ["nq-0", "nq-1", "nq-2"]
    assert load_examples("nq", p, limit=0) == []  # (no question asked for: none given, not an error)
    p = _jsonl(tmp_path / "nq_ids.jsonl", [{"id": "x1", "qid": "y1", "question": "q", "answer": ["a"]},
                                           {"qid": "y2", "question": "q", "answer": ["a"]}])
    assert [e.qid for e in load_examples("nq", p)] == ["x1", "y2"]  # "id" wins over "qid"


def test_webq(tmp_path):
    p = _json(tmp_path / "w.json", [{"qId": "wq1", "qText": "what?", "answers": ["x", "y"]}])
    (e,) = load_examples("webq", p)
    assert (e.qid, e.question, e.answers) == ("wq1", "what?", ["x", "y"])


def test_question_answers_json_of_dpr_and_hugging_face_exports(tmp_path):
    """{question, answers} records: DPR's retriever json (no id, the contexts kept), Hugging Face's web_questions
    (url, no id) and squad ({id, answers: {text, answer_start}}); an answers object without text is refused."""
    dpr = _json(tmp_path / "nq-dev.json", [
        {"dataset": "nq_dev_psgs_w100", "question": "who sings does he love me with reba",
         "answers": ["Linda Davis"], "positive_ctxs": [{"title": "Does He Love You", "text": "..."}]},
        {"dataset": "nq_dev_psgs_w100", "question": "how many pages is invisible man",
         "answers": ["581 (second)", 581]}])
    ex = load_examples("nq", dpr)
    assert [(e.qid, e.answers, e.meta["format"]) for e in ex] == [
        ("nq-0", ["Linda Davis"], "qa_answers"), ("nq-1", ["581 (second)", "581"], "qa_answers")]
    assert ex[0].meta["positive_ctxs"][0]["title"] == "Does He Love You" and ex[0].meta["dataset"] == "nq_dev_psgs_w100"
    hf = _jsonl(tmp_path / "wq.jsonl", [{"url": "http://www.freebase.com/view/en/justin_bieber",
                                         "question": "what is the name of justin bieber brother?",
                                         "answers": ["Jazmyn Bieber", "Jaxon Bieber"]}])
    (e,) = load_examples("webq", hf)
    assert (e.qid, e.answers, e.meta["url"]) == ("webq-0", ["Jazmyn Bieber", "Jaxon Bieber"],
                                                 "http://www.freebase.com/view/en/justin_bieber")
    squad = _jsonl(tmp_path / "sq.jsonl", [
        {"id": "56be4db0acb8001400a502ec", "title": "Super_Bowl_50", "context": "...",
         "question": "Which NFL team represented the AFC at Super Bowl 50?",
         "answers": {"text": ["Denver Broncos", "Denver Broncos"], "answer_start": [177, 177]}}])
    (e,) = load_examples("nq", squad)
    assert (e.qid, e.answers, e.meta["title"]) == ("56be4db0acb8001400a502ec", ["Denver Broncos"] * 2, "Super_Bowl_50")
    bad = _jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answers": ["a"]}, {"question": "q", "answers": {"x": 1}}])
    with pytest.raises(DataError, match=r"bad\.jsonl:2: field 'answers' is an object without 'text'"):
        load_examples("nq", bad)
    bad = _jsonl(tmp_path / "bad2.jsonl", [{"question": "q", "answers": [True]}])
    with pytest.raises(DataError, match=r"bad2\.jsonl:1: field 'answers' must be a string or a list of strings"):
        load_examples("nq", bad)


def test_original_webquestions_release(tmp_path):
    """The original release's records {url, targetValue: "(list (description ...) ...)", utterance}: quoted
    descriptions (escapes undone) and bare words are the answers; a targetValue of another shape names its line."""
    p = _json(tmp_path / "webquestions.examples.test.json", [
        {"url": "http://www.freebase.com/view/en/justin_bieber",
         "targetValue": '(list (description "Jazmyn Bieber") (description "Jaxon Bieber"))',
         "utterance": "what is the name of justin bieber brother?"},
        {"url": "http://www.freebase.com/view/en/jamaica", "targetValue": "(list (description Jamaican English) )",
         "utterance": "what language do people in jamaica speak?"},
        {"url": "u", "targetValue": '(list (description "The \\"Boss\\" (song)") (description Canada))',
         "utterance": "q3"}])
    with pytest.raises(DataError, match=r"examples\.test\.json\[1\]: field 'targetValue' is not a \(list"):
        load_examples("webq", p)  # a bare description of two words: not the release's layout
    obj = json.loads(p.read_text())
    obj[1]["targetValue"] = '(list (description "Jamaican English") (description "Jamaican Creole English Language"))'
    p.write_text(json.dumps(obj), encoding="utf-8")
    ex = load_examples("webq", p)
    assert [(e.qid, e.question, e.answers, e.meta["format"]) for e in ex] == [
        ("webq-0", "what is the name of justin bieber brother?", ["Jazmyn Bieber", "Jaxon Bieber"], "webq_original"),
        ("webq-1", "what language do people in jamaica speak?",
         ["Jamaican English", "Jamaican Creole English Language"], "webq_original"),
        ("webq-2", "q3", ['The "Boss" (song)', "Canada"], "webq_original")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (e,) = load_examples("webq", _jsonl(tmp_path / "e.jsonl", [{"utterance": "q", "targetValue": "(list)"}]))
    assert e.answers == [] and any("have no gold answer" in str(w.message) for w in caught)


def test_triviaqa_release_and_hugging_face_layouts(tmp_path):
    """TriviaQA as released (the `Data` list of {QuestionId, Question, Answer: {Value, Aliases, ...}}) and as
    Hugging Face's trivia_qa exports it ({question_id, question, answer: {value, aliases, ...}}): ids kept, gold
    answers the value then its aliases without repeats; an answer with neither, or a Data entry that is not an
    object, names its record."""
    release = {"Data": [
        {"Answer": {"Aliases": ["Sunset Blvd", "Sunset Boulevard", "West Sunset Boulevard"],
                    "NormalizedAliases": ["sunset blvd", "sunset boulevard", "west sunset boulevard"],
                    "NormalizedValue": "sunset boulevard", "Type": "WikipediaEntity", "Value": "Sunset Boulevard"},
         "EntityPages": [{"Filename": "Sunset_Boulevard.txt", "Title": "Sunset Boulevard"}],
         "Question": "Which Lloyd Webber musical premiered in the US on 10th December 1993?",
         "QuestionId": "tc_33", "QuestionSource": "http://www.quiz-zone.co.uk/", "SearchResults": []},
        {"Answer": {"Aliases": ["7"], "Type": "Numerical", "Value": 7},
         "Question": "How many wonders of the ancient world?", "QuestionId": "tc_40"}],
        "Domain": "Web", "Split": "dev", "Version": 1.0, "VerifiedEval": False}
    p = tmp_path / "unfiltered-web-dev.json"
    p.write_text(json.dumps(release), encoding="utf-8")
    ex = load_examples("nq", p)
    assert [(e.qid, e.answers, e.meta["format"]) for e in ex] == [
        ("tc_33", ["Sunset Boulevard", "Sunset Blvd", "West Sunset Boulevard"], "triviaqa"),
        ("tc_40", ["7"], "triviaqa")]
    assert ex[0].question.startswith("Which Lloyd Webber") and ex[0].meta["QuestionSource"].startswith("http")
    hf = _jsonl(tmp_path / "trivia_qa.jsonl", [
        {"question": "Who was the man behind The Chipmunks?", "question_id": "tc_2", "question_source": "src",
         "entity_pages": {"title": [], "wiki_context": []},
         "answer": {"aliases": ["David Seville", "david seville"], "normalized_aliases": ["david seville"],
                    "value": "David Seville", "normalized_value": "david seville", "type": "WikipediaEntity"}}])
    (e,) = load_examples("nq", hf)
    assert (e.qid, e.question, e.answers, e.meta["format"]) == (
        "tc_2", "Who was the man behind The Chipmunks?", ["David Seville", "david seville"], "triviaqa")
    bad = _jsonl(tmp_path / "bad.jsonl", [{"question": "q", "question_id": "x", "answer": {"value": None,
                                                                                         "aliases": None}}])
    with pytest.raises(DataError, match=r"bad\.jsonl:1: field 'answer' has neither 'value' nor 'aliases'"):
        load_examples("nq", bad)
    release["Data"][1] = ["not", "a", "record"]
    p.write_text(json.dumps(release), encoding="utf-8")
    with pytest.raises(DataError, match=r"unfiltered-web-dev\.json\[Data\]\[1\]: record is a list"):
        load_examples("nq", p)


def test_dpr_question_answers_tsv(tmp_path):
    """DPR's `*.qa.csv` files: question<TAB>answers, the answers a Python list literal (DPR writes repr) or JSON; no
    ids; an answers cell that is no list is one answer; a header line is skipped; extra columns are kept; the
    lines of errors are the file's own (a blank line counted)."""
    p = tmp_path / "nq-test.qa.csv"
    p.write_text("question\tanswers\n"
                 "who got the first nobel prize in physics\t['Wilhelm Conrad Röntgen']\n"
                 "\n"
                 'when was the last time anyone was on the moon\t["14 December 1972 UTC", "December 1972"]\n'
                 "what is the capital of france\tParis\n"
                 "who said \"it's me\"\t['a', \"b's\"]\tsrc-7\n", encoding="utf-8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ex = load_examples("nq", p)
    assert [(e.qid, e.question, e.answers) for e in ex] == [
        ("nq-0", "who got the first nobel prize in physics", ["Wilhelm Conrad Röntgen"]),
        ("nq-1", "when was the last time anyone was on the moon", ["14 December 1972 UTC", "December 1972"]),
        ("nq-2", "what is the capital of france", ["Paris"]),
        ("nq-3", 'who said "it\'s me"', ["a", "b's"])]
    assert all(e.meta["format"] == "dpr_qas" for e in ex) and ex[3].meta["column_3"] == "src-7"
    assert not [str(w.message) for w in caught if "regular expression" in str(w.message)]
    assert [e.qid for e in load_examples("nq", p, limit=2)] == ["nq-0", "nq-1"]
    # only a first line is a header: the same words further down are a question
    (tmp_path / "h.tsv").write_text("q1\t['b']\nquestion\tanswers\n", encoding="utf-8")
    assert [(e.question, e.answers) for e in load_examples("nq", tmp_path / "h.tsv")] == \
        [("q1", ["b"]), ("question", ["answers"])]
    for text, pattern in (
        ("q1\t['a']\n\nq2 without a tab\n", r"x\.tsv:3: expected question<TAB>answers"),
        ("q1\t['a']\nq2\t['b', \n", r"x\.tsv:2: the answers column starts a list but is not one"),
        ("q1\t['a']\nq2\t[open('f')]\n", r"x\.tsv:2: the answers column starts a list but is not one"),
        ("q1\t[1, ['nested']]\n", r"x\.tsv:1: field 'answers' must be a string or a list of strings"),
        # (a quoted question over two lines: the error names the row's first line)
        ('q0\t[]\n"a question\nover two lines"\t[\'a\',\n', r"x\.tsv:2: the answers column starts a list"),
        ("plain text, no tab\nq\t['a']\n", r"x\.tsv:1: neither JSON, JSON lines nor a tab-separated"),
    ):
        (tmp_path / "x.tsv").write_text(text, encoding="utf-8")
        with pytest.raises(DataError, match=pattern):
            load_examples("nq", tmp_path / "x.tsv")


def test_gold_answers_written_as_patterns_are_named(tmp_path):
    """CuratedTREC's gold answers (DPR's curatedtrec-test.qa.csv) are regular expressions; scored as text they can
    only match themselves, so the file is warned about. Answer text with slashes, dots, pluses or brackets is not."""
    p = tmp_path / "trec.qa.csv"
    p.write_text("who wrote howl\t['(Allen\\s+)?Ginsberg']\nwhere is it\t['Paris|France']\n", encoding="utf-8")
    with pytest.warns(UserWarning, match=r"2 question\(s\) have a gold answer that looks like a regular expression "
                                         r"\(first: nq-0, '\(Allen\\\\s\+\)\?Ginsberg'"):
        load_examples("nq", p)
    fine = _jsonl(tmp_path / "fine.jsonl", [{"question": "q", "answer": a} for a in (
        ["AC/DC"], ["U.S."], ["C++"], ["Romeo + Juliet"], ["Beyoncé (singer)"], ["[Untitled]"], ["a | b"], ["50%"])])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(load_examples("nq", fine)) == 8
    assert not [str(w.message) for w in caught if "regular expression" in str(w.message)]


def test_flashrag(tmp_path):
    p = _jsonl(tmp_path / "f.jsonl", [{"id": "test_0", "question": "q?", "golden_answers": ["g1", "g2"],
                                       "metadata": {"k": 1}}])
    (e,) = load_examples("nq", p)
    assert (e.qid, e.answers, e.meta["metadata"], e.meta["format"]) == ("test_0", ["g1", "g2"], {"k": 1}, "flashrag")


def test_iirc(tmp_path):
    passages = [
        {"title": "P1", "links": [], "questions": [
            {"qid": "i1", "question": "span q", "context": [],
             "answer": {"type": "span", "answer_spans": [{"text": " Paris ", "passage": "p", "start": 0, "end": 5},
                                                         {"text": "France", "passage": "p", "start": 1, "end": 2}]}},
            {"qid": "i2", "question": "value q", "answer": {"type": "value", "answer_value": "53", "answer_unit": "years"}},
            {"qid": "i3", "question": "none q", "answer": {"type": "none"}},
        ]},
        {"title": "P2", "questions": [{"qid": "i4", "question": "binary q", "answer": {"type": "binary", "answer_value": "yes"}}]},
    ]
    p = _json(tmp_path / "dev.json", passages)
    ex = load_examples("iirc", p)
    # the unanswerable ("none") question is dropped, as the published DRAGIN IIRC loader does
    assert [(e.qid, e.answers) for e in ex] == [("i1", ["Paris", "France"]), ("i2", ["53"]), ("i4", ["yes"])]
    assert ex[0].meta["passage_title"] == "P1" and ex[2].meta["passage_title"] == "P2"
    assert [e.qid for e in load_examples("iirc", p, limit=2)] == ["i1", "i2"]
    bad = _json(tmp_path / "bad.json", [{"title": "P", "questions": [{"qid": "z", "question": "q", "answer": {"type": "odd"}}]}])
    with pytest.raises(DataError, match=r"bad\.json\[0\]\.questions\[0\].*answer\.type"):
        load_examples("iirc", bad)


def test_blank_gold_answers_are_left_out_and_golds_that_normalise_to_nothing_are_named(tmp_path):
    """A blank gold is a missing value: scored, it would credit any answer that normalises to nothing (an empty one,
    "the."). A written gold that normalises to nothing ("A", "---") is scored as the SQuAD rule scores it."""
    rows = [{"id": f"q{i}", "question": "q?", "golden_answers": [b, "Paris"]} for i, b in enumerate(["", " \t"])]
    rows += [{"id": "only-blank", "question": "q?", "golden_answers": [""]},
             {"id": "letter", "question": "q?", "golden_answers": ["A"]}, {"id": "ok", "question": "q?", "golden_answers": ["x"]}]
    p = _jsonl(tmp_path / "blank.jsonl", rows)
    with pytest.warns(UserWarning) as caught:
        ex = load_examples("nq", p)
    msgs = [str(w.message) for w in caught]
    assert any("3 question(s) have a blank gold answer (first: q0); it is left out" in m for m in msgs), msgs
    assert any("1 question(s) have a gold answer that normalises to nothing (first: letter, 'A';" in m for m in msgs), msgs
    assert any("1 question(s) have no gold answer (first: only-blank)" in m for m in msgs), msgs
    assert [e.answers for e in ex] == [["Paris"], ["Paris"], [], ["A"], ["x"]]
    assert exact_match("The.", ex[0].answers) == 0.0 and exact_match("the paris", ex[0].answers) == 1.0
    assert exact_match("", ex[2].answers) == 0.0
    assert exact_match("A", ex[3].answers) == 1.0  # (as published: both sides normalise to "")


def test_answer_aliases_that_gave_a_question_its_gold_end_its_no_gold_warning(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"_id": "a", "question": "q", "answer": " ", "answer_id": "Q1"},
                                      {"_id": "b", "question": "q", "answer": "x", "answer_id": "Q2"}])
    aliases = _jsonl(tmp_path / "id_aliases.jsonl", [{"Q_id": "Q1", "aliases": ["Paris", ""], "demonyms": []}])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ex = load_examples("2wikimultihopqa", p, answer_aliases=aliases)
    assert [e.answers for e in ex] == [["Paris"], ["x"]]  # (the blank alias: left out too)
    msgs = [str(w.message) for w in caught]
    assert any("1 question(s) have a blank gold answer (first: a)" in m for m in msgs), msgs
    assert not any("no gold answer" in m for m in msgs), msgs


@pytest.mark.parametrize("bad", [None, {"x": 1}, 1.5, True, ["a"]])
def test_a_question_id_that_is_not_a_string_or_an_integer_is_refused(tmp_path, bad):
    for dataset, row, key in (("nq", {"id": bad, "question": "q", "golden_answers": ["a"]}, "id"),
                              ("2wikimultihopqa", {"_id": bad, "question": "q", "answer": "a"}, "_id"),
                              ("webq", {"qId": bad, "qText": "q", "answers": ["a"]}, "qId"),
                              ("strategyqa", {"qid": bad, "question": "q", "answer": True}, "qid")):
        p = _jsonl(tmp_path / f"{key}.jsonl", [{**row, **({key: "ok"})}, row])
        with pytest.raises(DataError, match=rf"{key}\.jsonl:2: field '{key}' must be a string or an integer id"):
            load_examples(dataset, p)
    p = _jsonl(tmp_path / "ints.jsonl", [{"id": 7, "question": "q", "golden_answers": ["a"]}])
    assert [e.qid for e in load_examples("nq", p)] == ["7"]
    # NQ-open's id is optional: absent or null, the question is numbered; anything else is checked the same way
    p = _jsonl(tmp_path / "nqo.jsonl", [{"question": "q", "answer": ["x"], "id": None}, {"question": "q", "answer": ["x"]}])
    assert [e.qid for e in load_examples("nq", p)] == ["nq-0", "nq-1"]
    if bad is not None:
        p = _jsonl(tmp_path / "nqo_bad.jsonl", [{"question": "q", "answer": ["x"], "qid": bad}])
        with pytest.raises(DataError, match=r"nqo_bad\.jsonl:1: field 'qid' must be a string or an integer id"):
            load_examples("nq", p)


def test_a_key_given_twice_in_a_record_is_refused(tmp_path):
    """json keeps the last of two equal keys silently: {"question": "q1", "question": "q2"} ran q2."""
    p = tmp_path / "d.jsonl"
    p.write_text('{"id": "1", "question": "q", "golden_answers": ["x"]}\n'
                 '{"id": "2", "question": "q1", "question": "q2", "golden_answers": ["x"]}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"d\.jsonl:2: the key 'question' is given twice in one object"):
        load_examples("nq", p)
    p = tmp_path / "d.json"
    p.write_text('[{"qid": "1", "question": "q", "answer": true, "facts": [{"a": 1, "a": 2}]}]', encoding="utf-8")
    with pytest.raises(DataError, match=r"d\.json: the key 'a' is given twice in one object"):
        load_examples("strategyqa", p)
    p.write_text('[{"qid": "1", "question": "q", "answer": true, "facts": [{"a": 1, "b": 2}]}]', encoding="utf-8")
    assert [e.qid for e in load_examples("strategyqa", p)] == ["1"]


def test_an_iirc_span_without_text_is_refused(tmp_path):
    for text in (None, 3, ["a"]):
        p = _json(tmp_path / "dev.json", [{"title": "P", "questions": [
            {"qid": "i1", "question": "q", "answer": {"type": "span", "answer_spans": [{"text": "ok"}, {"text": text}]}}]}])
        with pytest.raises(DataError, match=r"dev\.json\[0\]\.questions\[0\]: field 'answer\.answer_spans\[1\]\.text' "
                                             "must be a string"):
            load_examples("iirc", p)


def test_empty_question_loads_and_duplicate_ids_are_made_unique(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [
        {"_id": "a", "question": "", "answer": "x"},
        {"_id": "a", "question": "Q", "answer": "y"},
        {"_id": "a", "question": "Q", "answer": "z"},
    ])
    with pytest.warns(UserWarning, match=r"d\.jsonl: 2 question\(s\) repeat an id of an earlier one \(first: 'a', "
                      r"run as 'a#2'\); each runs as a question of its own under the new id"):  # (it was silent)
        ex = load_examples("2wikimultihopqa", p)
    assert ex[0].question == ""
    assert [e.qid for e in ex] == ["a", "a#2", "a#3"] and ex[1].meta["source_qid"] == "a"


HOTPOT_ID, WIKI_ID = "5a8c7595554299585d9e36b6", "100c512a0bde11eba7f7acde48001122"


@pytest.mark.parametrize("record,own", [
    ({"_id": HOTPOT_ID, "question": "q?", "answer": "Paris", "level": "hard", "supporting_facts": []}, "hotpotqa"),
    ({"_id": "x1", "question": "q?", "answer": "Paris", "level": "hard", "supporting_facts": []}, "hotpotqa"),
    ({"_id": WIKI_ID, "question": "q?", "answer": "Paris", "evidences": []}, "2wikimultihopqa"),
    ({"_id": "x1", "question": "q?", "answer": "Paris", "evidences": []}, "2wikimultihopqa"),
    ({"question_id": HOTPOT_ID, "question_text": "q?", "answers_objects": [{"spans": ["Paris"]}]}, "hotpotqa"),
    ({"question_id": WIKI_ID, "question_text": "q?", "answers_objects": [{"spans": ["Paris"]}]}, "2wikimultihopqa"),
])
def test_a_file_of_another_dataset_gets_a_warning_naming_both(tmp_path, record, own):
    """A HotpotQA file run as 2WikiMultihopQA (both come as {_id, question, answer} and as IRCoT files) ran without
    a word, with the other dataset's exemplars; the file's own dataset, from its fields or ids, is named."""
    import warnings

    p = _jsonl(tmp_path / "d.jsonl", [record])
    other = "2wikimultihopqa" if own == "hotpotqa" else "hotpotqa"
    with pytest.warns(UserWarning, match=rf"d\.jsonl: this looks like a {own} file \(.*\) but --dataset is {other}: "
                      rf".*pass --dataset {own} if it is one"):
        load_examples(other, p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its own dataset, or one the file does not tell: no word
        load_examples(own, p)
        load_examples("nq", _jsonl(tmp_path / "n.jsonl", [{"_id": "x1", "question": "q?", "answer": "Paris"}]))


# ---------------------------------------------------------------- errors


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    p = tmp_path / "broken.jsonl"
    p.write_text('{"question": "q", "answer": ["a"]}\n\n{"question": "q2", "answer": [\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"broken\.jsonl:3\b"):
        load_examples("nq", p)


def test_missing_field_names_field_and_location(tmp_path):
    p = _jsonl(tmp_path / "m.jsonl", [{"_id": "a", "question": "q", "answer": "x"}, {"_id": "b", "question": "q"}])
    with pytest.raises(DataError, match=r"m\.jsonl:2.*'answer'"):
        load_examples("2wikimultihopqa", p)
    p = _json(tmp_path / "m.json", [{"qId": "1", "qText": "q", "answers": ["a"]}, {"qId": "2", "answers": ["a"]}])
    with pytest.raises(DataError, match=r"m\.json\[1\].*'qText'"):
        load_examples("webq", p)


def test_file_level_errors(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_examples("nq", tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.json"
    bad.write_text('[{"qid": 1,', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.json: not valid JSON"):
        load_examples("nq", bad)
    unk = _jsonl(tmp_path / "unk.jsonl", [{"foo": 1, "bar": 2}])
    with pytest.raises(DataError, match="unknown data format"):
        load_examples("nq", unk)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(DataError, match="empty"):
        load_examples("nq", empty)
    with pytest.raises(DataError, match="directory"):
        load_examples("nq", tmp_path)
    wrong_type = _json(tmp_path / "t.json", [{"qid": "a", "question": "q", "answer": True}, {"qid": "b", "question": "q", "answer": 3}])
    with pytest.raises(DataError, match=r"t\.json\[1\].*'answer'"):
        load_examples("strategyqa", wrong_type)


def test_a_name_that_is_no_name_lists_valid_names(tmp_path):
    p = _jsonl(tmp_path / "nq.jsonl", [{"question": "q", "answer": ["a"]}])
    with pytest.raises(DataError) as err:
        load_examples("no such set", p)
    for name in DATASETS:
        assert name in str(err.value)
    assert load_examples("squad", p)[0].dataset == "qa"  # (another name: generic QA, tests/test_flashrag.py)


# ---------------------------------------------------------------- exemplars


@pytest.mark.parametrize("dataset,count", [("2wikimultihopqa", 6), ("hotpotqa", 8), ("strategyqa", 6), ("iirc", 8)])
def test_exemplars(dataset, count):
    ex = load_exemplars(dataset)
    assert len(ex) == count
    for q, a in ex:
        assert q.strip() == q and q.endswith("?")
        assert re.search(r"\. So the answer is [^\n]+\.$", a), a
        assert "$" not in a and "  " not in a and " ," not in a  # PDF artefacts removed


def test_exemplar_text_matches_paper():
    q, a = load_exemplars("2wikimultihopqa")[0]
    assert q == "When did the director of film Hypocrite (Film) die?"
    assert a == "The film Hypocrite was directed by Miguel Morayta. Miguel Morayta died on 19 June 2013. So the answer is 19 June 2013."
    assert load_exemplars("strategyqa")[5][1].startswith("The density of a pear is about 0.6g/cm^3, which is less than water.")
    assert "1864 - 1811 = 53 years" in load_exemplars("iirc")[1][1]


def test_nq_webq_reuse_hotpotqa():
    assert load_exemplars("nq") == load_exemplars("webq") == load_exemplars("hotpotqa")


def test_demo_and_case_text():
    (q0, a0), (q1, a1) = load_exemplars("iirc")[:2]
    assert demo_text("iirc", 2) == "Question: " + q0 + "\nAnswer: " + a0 + "\n" + "Question: " + q1 + "\nAnswer: " + a1 + "\n"
    assert demo_text("iirc", 0) == ""
    with pytest.raises(ValueError, match="only 6"):
        demo_text("strategyqa", 8)
    assert case_text("Who?") == "Question: Who?\nAnswer:"
    assert case_text("Who?", "2wikimultihopqa") == case_text("Who?", "iirc") == "Question: Who?\nAnswer:"
    assert case_text("Who?", "strategyqa") == (
        "Following the examples above, answer the question by reasoning step-by-step.\n\nQuestion: Who?\nAnswer:")
    assert case_text("Who?", "hotpotqa") == (
        "Answer the following question by reasoning step-by-step, following the example above.\nQuestion: Who?\nAnswer:")
    # a config's spelling of the name (case, surrounding spaces) selects the same instruction
    assert case_text("Who?", " StrategyQA ") == case_text("Who?", "strategyqa")
