"""The upstream question file formats: one reader per format (record -> qid, question, answers, meta), the
detection of a file's format from its first record (never its name), and the iteration over a file's records.

| format      | record fields read                                         | answers                          |
|-------------|------------------------------------------------------------|----------------------------------|
| `ircot`     | `question_id, question_text, answers_objects[].spans`      | all spans of all answer objects  |
| `2wiki`     | `_id, question, answer` (2Wiki/HotpotQA original format)   | `[answer]`                       |
| `2wiki_list`| `test_id, question, answer` (answer: alias list or string) | the aliases                      |
| `strategyqa`| `qid, question, answer` (bool)                             | `["yes"]` / `["no"]`             |
| `flashrag`  | `id, question, golden_answers[]`                           | `golden_answers`                 |
| `webq`      | `qId, qText, answers[]`                                    | `answers`                        |
| `nq_open`   | `question, answer`; `id`/`qid` optional (none: `"<dataset>-<index>"`) | `answer` (list or string) |
| `qa_answers`| `question, answers`; `id`/`qid` optional (DPR json, HF exports) | `answers` (list, string, `{text}`) |
| `dpr_qas`   | tab-separated `question<TAB>answers`, no ids (DPR's `*.qa.csv`)  | Python/JSON list, or one answer  |
| `webq_original` | `utterance, targetValue` (the original WebQuestions release)   | its `(description ...)` values   |
| `triviaqa`  | `QuestionId, Question, Answer` (the release's `Data` list) or HF's `question_id, question, answer` | the value, then its aliases |
| `iirc`      | passages, each with `questions[{qid, question, answer}]`   | see below                        |

IIRC follows the published DRAGIN loader (src/data.py, `IIRC`), which reads the IIRC release's `dev.json`: answer
type span -> `answer_spans[].text` (stripped), value/binary -> `[answer_value]`, none (unanswerable) -> the
question is dropped; the paper's 954 IIRC questions are what is left.

CuratedTREC's gold answers in DPR's files are regular expressions, which DPR matches as such; fastrag scores every
gold answer as text and warns when a file's answers look like patterns.

Any of these files may be gzip, bzip2 or xz compressed (DPR ships its question files as `.json.gz`): the first bytes
tell, the file is read decompressed, and an error's line counts the decompressed text.

The error policy (`DataError`, raised here and by the loader) is fastrag.data.datasets'.
"""

from __future__ import annotations

import ast
import csv
import io
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastrag import compressed
from fastrag.jsonkeys import RepeatedKey, unique_keys


class DataError(ValueError):
    """A data file (or a dataset name) that cannot be used; the message names the file, line/record and field."""



# A record seen by a format reader: where it came from (for messages) and its JSON object.
@dataclass(slots=True)
class Record:
    where: str  # "file.jsonl:12" (1-based line) or "file.json[3]" (0-based record index)
    obj: dict
    fmt: str | None = None  # the format, when the file's layout says it (a tab-separated file); else detected


def need(rec: Record, key: str, types: type | tuple[type, ...] | None = None) -> Any:
    if key not in rec.obj:
        raise DataError(f"{rec.where}: record is missing the required field {key!r}")
    value = rec.obj[key]
    if types is not None and not isinstance(value, types):
        raise DataError(f"{rec.where}: field {key!r} has type {type(value).__name__}, expected {_tname(types)}")
    return value


def _qid(rec: Record, key: str) -> str:
    """A question id field: a string, or an integer written as its decimal text (a null, a bool, a float or an
    object is refused: an id made of its repr would key the outputs by text no one wrote)."""
    value = need(rec, key)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise DataError(f"{rec.where}: field {key!r} must be a string or an integer id, got {value!r:.80}")
    return str(value)


def _tname(types: type | tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))


def str_list(rec: Record, key: str, value: Any) -> list[str]:
    """An answer field as a list of strings: a string becomes a one-element list; numbers become strings."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [str(value)]
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
        return [str(v) for v in value]
    raise DataError(f"{rec.where}: field {key!r} must be a string or a list of strings, got {value!r:.80}")


def _question(rec: Record, key: str) -> str:
    q = need(rec, key)
    if q is None:
        return ""  # a per-question problem: loaded, reported by the engine
    if not isinstance(q, str):
        raise DataError(f"{rec.where}: field {key!r} must be a string, got {type(q).__name__}")
    return q


def _meta(rec: Record, used: tuple[str, ...], fmt: str) -> dict:
    meta = {k: v for k, v in rec.obj.items() if k not in used}
    meta["format"] = fmt
    return meta


# ---- one reader per format: record -> (qid or None, question, answers, meta); None = skip the record ----

_Row = tuple[str | None, str, list[str], dict] | None


def _read_ircot(rec: Record) -> _Row:
    objs = need(rec, "answers_objects", list)
    answers: list[str] = []
    for i, o in enumerate(objs):
        if not isinstance(o, dict) or "spans" not in o:
            raise DataError(f"{rec.where}: answers_objects[{i}] has no field 'spans'")
        answers += str_list(rec, f"answers_objects[{i}].spans", o["spans"])
    used = ("question_id", "question_text", "answers_objects")
    return _qid(rec, "question_id"), _question(rec, "question_text"), answers, _meta(rec, used, "ircot")


def _read_2wiki(rec: Record) -> _Row:
    answer = str_list(rec, "answer", need(rec, "answer"))
    used = ("_id", "question", "answer")
    return _qid(rec, "_id"), _question(rec, "question"), answer, _meta(rec, used, "2wiki")


def _read_2wiki_list(rec: Record) -> _Row:
    answer = str_list(rec, "answer", need(rec, "answer"))
    used = ("test_id", "question", "answer")
    return _qid(rec, "test_id"), _question(rec, "question"), answer, _meta(rec, used, "2wiki_list")


def _read_strategyqa(rec: Record) -> _Row:
    a = need(rec, "answer")
    if isinstance(a, str) and a.strip().lower() in ("yes", "no"):
        a = a.strip().lower() == "yes"
    if not isinstance(a, bool):
        raise DataError(f"{rec.where}: field 'answer' must be a bool (or 'yes'/'no'), got {a!r:.80}")
    meta = _meta(rec, ("qid", "question", "answer"), "strategyqa")
    meta["answer_bool"] = a
    return _qid(rec, "qid"), _question(rec, "question"), ["yes" if a else "no"], meta


def _read_flashrag(rec: Record) -> _Row:
    """FlashRAG's {id, question, golden_answers, metadata} (its 36 benchmarks' jsonl): `metadata` (an object: e.g.
    HotpotQA's supporting_facts and context, MuSiQue's paragraphs) and any other field (a multiple-choice set's
    `choices`) go to meta as they are; a true/false gold (BoolQ, StrategyQA exports) reads as "yes"/"no"."""
    gold = need(rec, "golden_answers")
    if isinstance(gold, list) and any(isinstance(g, bool) for g in gold):
        gold = [("yes" if g else "no") if isinstance(g, bool) else g for g in gold]
    elif isinstance(gold, bool):
        gold = "yes" if gold else "no"
    answers = str_list(rec, "golden_answers", gold)
    if rec.obj.get("metadata") is not None and not isinstance(rec.obj["metadata"], dict):
        raise DataError(f"{rec.where}: field 'metadata' has type {type(rec.obj['metadata']).__name__}, expected an "
                        "object (FlashRAG's metadata)")
    used = ("id", "question", "golden_answers")
    return _qid(rec, "id"), _question(rec, "question"), answers, _meta(rec, used, "flashrag")


def _read_webq(rec: Record) -> _Row:
    answers = str_list(rec, "answers", need(rec, "answers"))
    return _qid(rec, "qId"), _question(rec, "qText"), answers, _meta(rec, ("qId", "qText", "answers"), "webq")


def _read_nq_open(rec: Record) -> _Row:
    answers = str_list(rec, "answer", need(rec, "answer"))
    used = ("question", "answer", "id", "qid")
    return _optional_qid(rec), _question(rec, "question"), answers, _meta(rec, used, "nq_open")


def _optional_qid(rec: Record, keys: tuple[str, ...] = ("id", "qid")) -> str | None:
    """The first of `keys` the record has (else the last) as a question id; None for no id or a null one (the
    question is then numbered in file order)."""
    key = next((k for k in keys if k in rec.obj), keys[-1])
    return None if rec.obj.get(key) is None else _qid(rec, key)


def _read_qa_answers(rec: Record) -> _Row:
    value = need(rec, "answers")
    key = "answers"
    if isinstance(value, dict):  # SQuAD's {"text": [...], "answer_start": [...]}
        if "text" not in value:
            raise DataError(f"{rec.where}: field 'answers' is an object without 'text' (SQuAD's layout is "
                            f"{{'text': [...], 'answer_start': [...]}}), got {value!r:.80}")
        value, key = value["text"], "answers.text"
    answers = str_list(rec, key, value)
    used = ("question", "answers", "id", "qid")
    return _optional_qid(rec), _question(rec, "question"), answers, _meta(rec, used, rec.fmt or "qa_answers")


# one (description ...) of a WebQuestions targetValue: a quoted string (with \" and \\ escapes) or a bare word
_WEBQ_DESCRIPTION = re.compile(r'\(description\s+(?:"((?:[^"\\]|\\.)*)"|([^\s()"]+))\)')


def _read_webq_original(rec: Record) -> _Row:
    target = need(rec, "targetValue", str)
    whole = re.fullmatch(r"\s*\(list(.*)\)\s*", target, re.S)
    if whole is None or _WEBQ_DESCRIPTION.sub("", whole.group(1)).strip():  # (only descriptions inside the list)
        raise DataError(f"{rec.where}: field 'targetValue' is not a (list (description ...) ...) value: "
                        f"{target!r:.120}")
    answers = [bare or re.sub(r"\\(.)", r"\1", quoted) for quoted, bare in _WEBQ_DESCRIPTION.findall(whole.group(1))]
    return None, _question(rec, "utterance"), answers, _meta(rec, ("utterance", "targetValue"), "webq_original")


def _read_triviaqa(rec: Record) -> _Row:
    """TriviaQA as released ({QuestionId, Question, Answer: {Value, Aliases, ...}, ...}, one of the `Data` list of
    its json) and as Hugging Face's `trivia_qa` exports it ({question_id, question, answer: {value, aliases, ...}}):
    the gold answers are the value, then its aliases (the published evaluation matches any of them)."""
    released = "Answer" in rec.obj
    qkey, akey, idkey, vkey, alkey = (("Question", "Answer", "QuestionId", "Value", "Aliases") if released
                                      else ("question", "answer", "question_id", "value", "aliases"))
    ans = need(rec, akey, dict)
    golds: list[str] = []
    for key in (vkey, alkey):
        if ans.get(key) is not None:
            golds += str_list(rec, f"{akey}.{key}", ans[key])
    if not golds:
        raise DataError(f"{rec.where}: field {akey!r} has neither {vkey!r} nor {alkey!r} (TriviaQA's gold answers), "
                        f"got keys {sorted(ans)!r:.120}")
    return _optional_qid(rec, (idkey,)), _question(rec, qkey), list(dict.fromkeys(golds)), _meta(rec, (qkey, akey, idkey), "triviaqa")


def _read_iirc_question(rec: Record, passage_title: Any) -> _Row:
    ans = need(rec, "answer", dict)
    kind = ans.get("type")
    if kind == "none":
        return None  # unanswerable: skipped, as the published DRAGIN IIRC loader does
    if kind in ("value", "binary"):
        if "answer_value" not in ans:
            raise DataError(f"{rec.where}: answer of type {kind!r} has no field 'answer_value'")
        answers = str_list(rec, "answer.answer_value", ans["answer_value"])
    elif kind == "span":
        spans = ans.get("answer_spans")
        if not isinstance(spans, list) or not all(isinstance(s, dict) and "text" in s for s in spans):
            raise DataError(f"{rec.where}: span answer needs 'answer_spans' as a list of {{'text': ...}}")
        answers = []
        for i, s in enumerate(spans):
            if not isinstance(s["text"], str):
                raise DataError(f"{rec.where}: field 'answer.answer_spans[{i}].text' must be a string, got "
                                f"{s['text']!r:.80}")
            answers.append(s["text"].strip())
    else:
        raise DataError(f"{rec.where}: field 'answer.type' is {kind!r}, expected span, value, binary or none")
    meta = _meta(rec, ("qid", "question"), "iirc")
    meta["passage_title"] = passage_title
    return _qid(rec, "qid"), _question(rec, "question"), answers, meta


_READERS: dict[str, Callable[[Record], _Row]] = {
    "ircot": _read_ircot,
    "flashrag": _read_flashrag,
    "webq": _read_webq,
    "2wiki_list": _read_2wiki_list,
    "2wiki": _read_2wiki,
    "strategyqa": _read_strategyqa,
    "nq_open": _read_nq_open,
    "qa_answers": _read_qa_answers,
    "dpr_qas": _read_qa_answers,
    "webq_original": _read_webq_original,
    "triviaqa": _read_triviaqa,
}


def detect_format(obj: dict) -> str | None:
    """The format of a file from its first record's keys (most specific first); None when unknown."""
    keys = obj.keys()
    for need, name in (
        (("question_id", "question_text"), "ircot"),
        (("questions",), "iirc"),
        (("golden_answers",), "flashrag"),
        (("qId", "qText"), "webq"),
        (("utterance", "targetValue"), "webq_original"),
        (("QuestionId", "Question", "Answer"), "triviaqa"),
        (("test_id",), "2wiki_list"),
        (("_id",), "2wiki"),
    ):
        if all(k in keys for k in need):
            return name
    a = obj.get("answer")
    if "question" in keys and isinstance(a, dict) and ("value" in a or "aliases" in a):
        return "triviaqa"  # (Hugging Face's trivia_qa)
    if "qid" in keys and (isinstance(a, bool) or isinstance(a, str) and a.strip().lower() in ("yes", "no")):
        return "strategyqa"  # (what _read_strategyqa reads: a {qid, question, answer: "Paris"} file is no StrategyQA
        # file, and calling it one sent its user to --dataset strategyqa, which refuses the answer)
    if "question" in keys and (isinstance(a, (list, str, int, float)) and not isinstance(a, bool)):
        return "nq_open"  # (also the plain {id, question, answer: "Paris"} file many QA sets are exported as)
    if "question" in keys and "answers" in keys:
        return "qa_answers"
    return None


# formats that belong to one dataset: a file of one of them read as another dataset would be scored (and
# prompted) as that other dataset without a word
_FORMAT_DATASET = {"strategyqa": "strategyqa", "iirc": "iirc"}


def looks_like(fmt: str, obj: dict) -> tuple[str, str] | None:
    """(dataset, why) when a first record of a format that several datasets share shows which one it comes from:
    HotpotQA and 2WikiMultihopQA both come as {_id, question, answer} (2Wiki's records carry `evidences`, HotpotQA's
    a `level`) and as IRCoT's processed files, whose ids are theirs (HotpotQA: 24 hex digits, 2Wiki: 32)."""
    if fmt == "2wiki":
        if "evidences" in obj or "entity_ids" in obj:
            return "2wikimultihopqa", "its records carry 2WikiMultihopQA's 'evidences'"
        if "level" in obj and "supporting_facts" in obj:
            return "hotpotqa", "its records carry HotpotQA's 'level'"
    meta = obj.get("metadata") if fmt == "flashrag" else None
    if isinstance(meta, dict):  # FlashRAG's exports keep the original fields in metadata
        if "evidences" in meta:
            return "2wikimultihopqa", "its metadata carries 2WikiMultihopQA's 'evidences'"
        if "level" in meta and "supporting_facts" in meta:
            return "hotpotqa", "its metadata carries HotpotQA's 'level'"
    if fmt in ("2wiki", "ircot"):
        qid = obj.get("_id" if fmt == "2wiki" else "question_id")
        if isinstance(qid, str) and re.fullmatch(r"[0-9a-f]{24}", qid):
            return "hotpotqa", f"its ids are HotpotQA's, 24 hex digits: {qid!r}"
        if isinstance(qid, str) and re.fullmatch(r"[0-9a-f]{32}", qid):
            return "2wikimultihopqa", f"its ids are 2WikiMultihopQA's, 32 hex digits: {qid!r}"
    return None


def check_dataset(name: str, fmt: str, rec: Record) -> None:
    own = _FORMAT_DATASET.get(fmt)
    if own is not None and own != name:
        raise DataError(f"{rec.where}: this is a {own} file (format {fmt!r}) but --dataset is {name}; pass "
                        f"--dataset {own} or the {name} file")


def read_text_file(path: Path, error: type[Exception]) -> str:
    """A UTF-8 text file's contents (a byte-order mark dropped; a gzip, bzip2 or xz file decompressed, its lines
    counted in the decompressed text); `error` naming the file, and the line of a byte that is not UTF-8, otherwise."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, expected a file") from None
    except OSError as e:
        raise error(f"{path}: cannot read: {e}") from None
    raw = compressed.decompress(path, raw, error)  # (gzip, bzip2 and xz files are read as they are)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise error(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x}); convert the file to UTF-8") from None


def file_records(path: Path) -> Iterator[Record]:
    """Yield the JSON objects of a json-list or jsonl file, or the rows of a question<TAB>answers file
    (`_qas_records`), with their location; malformed input raises DataError."""
    text = read_text_file(path, DataError)
    head = text.lstrip()[:1]
    if not head:
        raise DataError(f"{path}: file is empty")
    if head == "[" or head == "{":
        try:
            whole = json.loads(text, object_pairs_hook=unique_keys)
        except json.JSONDecodeError as e:
            if head == "[":
                raise DataError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
            whole = None  # several objects: jsonl
        except RepeatedKey as e:
            if head == "[":
                raise DataError(f"{path}: {e}") from None
            whole = None  # (jsonl: the line is named below)
        where = str(path)
        if isinstance(whole, dict) and isinstance(whole.get("Data"), list):  # TriviaQA's release: {"Data": [...],
            whole, where = whole["Data"], f"{path}[Data]"  # "Domain", "Version", "Split", ...}
        if isinstance(whole, list):
            for i, obj in enumerate(whole):
                if not isinstance(obj, dict):
                    raise DataError(f"{where}[{i}]: record is a {type(obj).__name__}, expected a JSON object")
                yield Record(f"{where}[{i}]", obj)
            return
        if isinstance(whole, dict):  # a single-object file (a one-line jsonl or a wrapper we do not know)
            yield Record(f"{path}:1", whole)
            return
    else:
        lineno, first = next((i, line) for i, line in enumerate(text.split("\n"), start=1) if line.strip())
        if "\t" in first:
            yield from _qas_records(path, text)
            return
        raise DataError(f"{path}:{lineno}: neither JSON, JSON lines nor a tab-separated question<TAB>answers file "
                        f"(the line starts {first.strip()[:60]!r})")
    # (split on newlines only: str.splitlines also breaks at U+2028, U+0085, ... which JSON strings may hold raw)
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line, object_pairs_hook=unique_keys)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: malformed JSON line: {e.msg} (column {e.colno})") from None
        except RepeatedKey as e:
            raise DataError(f"{path}:{lineno}: {e}") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{lineno}: line is a {type(obj).__name__}, expected a JSON object")
        yield Record(f"{path}:{lineno}", obj)


def _answer_list(cell: str) -> Any:
    """The answers column of a question-answers TSV written as a list: a JSON list, or a Python list literal (DPR
    writes its files with Python's repr, quotes and all); None when it is neither."""
    try:
        return json.loads(cell)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(cell)  # (literals only: nothing in the file is run)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None


def _qas_records(path: Path, text: str) -> Iterator[Record]:
    """The questions of a tab-separated `question<TAB>answers` file (DPR's `nq-test.qa.csv`, `trivia-test.qa.csv`,
    `webq-test.qa.csv`: read with the csv module's tab dialect, as DPR does), as records of the `dpr_qas` format.
    An answers column that does not start with "[" is one answer, as written. A first line `question<TAB>answer(s)`
    is a header. Columns past the second go to the record as `column_3`, ..."""
    rows = csv.reader(io.StringIO(text, newline=""), delimiter="\t")
    start = 1
    try:
        for row in rows:
            lineno, start = start, rows.line_num + 1
            if not any(cell.strip() for cell in row):
                continue
            where = f"{path}:{lineno}"
            if len(row) < 2:
                raise DataError(f"{where}: expected question<TAB>answers, got {len(row)} field (no tab)")
            if lineno == 1 and row[0].strip().lower() in ("question", "query") \
                    and row[1].strip().lower() in ("answer", "answers"):
                continue
            cell = row[1].strip()
            answers = _answer_list(cell) if cell.startswith("[") else cell  # (else one answer, written as it is)
            if answers is None:
                raise DataError(f"{where}: the answers column starts a list but is not one (a JSON list or "
                                f"['a', 'b']): {cell[:80]!r}")
            obj = {"question": row[0], "answers": answers}
            obj.update({f"column_{i}": extra for i, extra in enumerate(row[2:], start=3)})
            yield Record(where, obj, fmt="dpr_qas")
    except csv.Error as e:
        raise DataError(f"{path}:{start}: not a readable tab-separated line: {e}") from None


def _iirc_questions(rec: Record) -> Iterator[tuple[Record, Any]]:
    qs = need(rec, "questions", list)
    for j, q in enumerate(qs):
        where = f"{rec.where}.questions[{j}]"
        if not isinstance(q, dict):
            raise DataError(f"{where}: question is a {type(q).__name__}, expected a JSON object")
        yield Record(where, q), rec.obj.get("title")


def record_rows(fmt: str, rec: Record) -> list[_Row]:
    """The rows a record of format `fmt` holds: one, or an IIRC passage's questions."""
    if fmt == "iirc":
        return [_read_iirc_question(q, title) for q, title in _iirc_questions(rec)]
    return [_READERS[fmt](rec)]
