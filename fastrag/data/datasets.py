"""Question loading: `load_examples` reads a question file of any upstream format (fastrag.data.formats, detected
from the file's content, never its name) as `Example`s of one dataset, with gold-answer aliases where given.

Error policy: a file-level problem (missing, unreadable, not JSON, a malformed jsonl line, a record without a
required field, an unknown format) raises `DataError` naming the file and the 1-based line (jsonl) or 0-based
record index (json). Per-question problems do not: an empty question loads as `""` and the engine records an
error for that question alone. Duplicate ids are made unique (`id`, `id#2`, ...; the original is kept in
`meta["source_qid"]`) so a run's outputs can be keyed by qid, with a warning naming the first. A file whose fields
or ids show it is another dataset's than the one asked for (a HotpotQA file as 2WikiMultihopQA: the two share
formats) gets a warning naming both; StrategyQA and IIRC files, which have formats of their own, are refused.

Dataset names: the six with handling of their own (`DATASETS` less "qa": exemplars, prompts, scoring rules) and
`"qa"`, generic open-domain QA, which any other name runs as: NQ's handling (HotpotQA's exemplars, the answer after
"the answer is", else the whole text, scored against every gold answer). FlashRAG's benchmark names (`FLASHRAG_NAMES`:
popqa, triviaqa, squad, musique, asqa, mmlu, ...) map there silently, or to their own dataset where fastrag has one
(nq, hotpotqa, 2wikimultihopqa, strategyqa, web_questions); another name does too, with a warning naming the
datasets that have handling of their own. Names are letters, digits and `_ . + -`.

Any of these files may be gzip, bzip2 or xz compressed (DPR ships its question files as `.json.gz`): the first bytes
tell, the file is read decompressed, and an error's line counts the decompressed text.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from fastrag.data.formats import (DataError, check_dataset, detect_format, file_records, looks_like, need,
                                  read_text_file, record_rows, str_list)
from fastrag.data.metrics import normalize_answer

__all__ = ["DATASETS", "DataError", "Example", "canonical_dataset", "flashrag_record", "load_answer_aliases",
           "load_examples", "read_text_file", "with_answer_aliases", "write_flashrag"]

DATASETS = ("2wikimultihopqa", "hotpotqa", "strategyqa", "iirc", "nq", "webq", "qa")
GENERIC = "qa"  # the dataset of any other name (module docstring)
# FlashRAG's benchmark folders (RUC-NLPIR/FlashRAG_datasets) without handling of their own here: generic QA, silently
FLASHRAG_NAMES = frozenset({
    "triviaqa", "popqa", "squad", "msmarco-qa", "narrativeqa", "wikiqa", "ambig_qa", "ambigqa", "siqa",
    "commonsenseqa", "boolq", "piqa", "fermi", "musique", "bamboogle", "asqa", "eli5", "wikipassageqa", "wikiasp",
    "mmlu", "truthful_qa", "truthfulqa", "hellaswag", "arc", "openbookqa", "quartz", "fever", "wow", "ay2", "aida",
    "wned", "t-rex", "trex", "zero-shot_re", "zsre", "domainqa", "domainrag", "curatedtrec", "webqa"})
_NAME = re.compile(r"[a-z0-9][a-z0-9_.+-]*")
_WARNED: set[str] = set()  # names warned of (once a process: every module that reads the name asks again)

# Names used by the published DRAGIN configs and by common file/dir names -> our dataset names.
_ALIASES = {
    "2wikimultihop": "2wikimultihopqa",
    "2wiki": "2wikimultihopqa",
    "2wmqa": "2wikimultihopqa",
    "nq_open": "nq",
    "nq-open": "nq",
    "nqopen": "nq",
    "webquestions": "webq",
    "web_questions": "webq",  # (FlashRAG's folder)
}


@dataclass(slots=True)
class Example:
    qid: str  # unique within one loaded file
    question: str  # may be "" (the engine reports that question as an error)
    answers: list[str]  # gold answer aliases; scoring takes the max over them
    dataset: str  # one of DATASETS
    meta: dict = field(default_factory=dict)  # every other upstream field, plus "format" (the detected format)


def canonical_dataset(name: str) -> str:
    """Map a dataset name (case-insensitive; DRAGIN config spellings like "StrategyQA", "2wikimultihop"; FlashRAG's
    folder names) to DATASETS: any other well-formed name is generic QA ("qa"), with a warning unless FlashRAG
    names it (module docstring). A name that is no name (blank, spaces, slashes) raises DataError."""
    key = str(name).strip().lower() if isinstance(name, str) else ""
    key = _ALIASES.get(key, key)
    if key in DATASETS:
        return key
    if not _NAME.fullmatch(key):
        raise DataError(f"unknown dataset {name!r}: a dataset name is letters, digits and _ . + - (those with handling "
                        f"of their own: {', '.join(DATASETS)}; any other name runs as generic QA)")
    if key not in FLASHRAG_NAMES:
        import difflib

        # a near miss of a name with its own handling is a typo, not a new dataset: running it as generic QA would
        # silently change the exemplars and the scoring
        near = difflib.get_close_matches(key, [*DATASETS, *_ALIASES], n=1, cutoff=0.8)
        if near and _ALIASES.get(near[0], near[0]) != GENERIC:
            raise DataError(f"unknown dataset {name!r}: did you mean {_ALIASES.get(near[0], near[0])!r}? (any name "
                            f"not close to one with handling of its own runs as generic QA)")
    if key not in FLASHRAG_NAMES and key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"dataset {name!r} has no handling of its own: it runs as generic open-domain QA ('qa': "
                      f"HotpotQA's exemplars, answers scored as text); the datasets with their own are "
                      f"{', '.join(d for d in DATASETS if d != GENERIC)}", UserWarning, stacklevel=2)
    return GENERIC


_SURROGATE = re.compile("[\ud800-\udfff]")
# what a gold answer written as a regular expression has and answer text does not: a backslash class or escape,
# an alternation, a group with a quantifier or an alternation inside
_PATTERN_LIKE = re.compile(r"\\[sSdDwWb.()\[\]?*+|]|\|\S|\)[?*+]|\(\?|\[[^\]]*\][?*+]")


def load_answer_aliases(path: str | Path) -> dict[str, list[str]]:
    """Gold-answer aliases by entity id, from the 2WikiMultihopQA release's `id_aliases.json` (one JSON object per
    line: `{"Q_id": "Q36647", "aliases": [...], "demonyms": [...]}`; demonyms are not read, as in the published
    DRAGIN evaluation) or from one JSON object mapping ids to alias lists. DataError names the file, line and
    field of what it cannot read."""
    path = Path(path)
    out: dict[str, list[str]] = {}
    recs = list(file_records(path))
    if len(recs) == 1 and "Q_id" not in recs[0].obj and "aliases" not in recs[0].obj:  # the form {id: [alias, ...]}
        return {str(k): str_list(recs[0], k, v) for k, v in recs[0].obj.items()}
    for rec in recs:
        qid = need(rec, "Q_id", str)
        out[qid] = str_list(rec, "aliases", need(rec, "aliases"))  # an id listed again: its last line wins
        # (as the published loader reads the file)
    return out


def with_answer_aliases(examples: list[Example], aliases: dict[str, list[str]], where: str = "") -> int:
    """Add to each example's gold answers the aliases of its `answer_id` (2WikiMultihopQA's Wikidata id of the
    answer), after the dataset's own answers and without repeats; returns how many examples gained one. Data
    without any `answer_id` raises: the aliases could not apply to any question."""
    if examples and not any(isinstance(e.meta.get("answer_id"), str) for e in examples):
        raise DataError(f"{where or 'the data'}: no question has an 'answer_id' field, so answer aliases cannot "
                        "apply (they are keyed by it: 2WikiMultihopQA's original dev.json format carries it)")
    n = 0
    for e in examples:
        extra = [a for a in aliases.get(e.meta.get("answer_id") or "", [])
                 if a not in e.answers and a.strip()]  # (a blank alias: left out, as a blank gold is)
        if extra:
            e.answers = e.answers + extra
            n += 1
    return n


def load_examples(dataset: str, path: str | Path, limit: int | None = None,
                  answer_aliases: str | Path | None = None) -> list[Example]:
    """Load up to `limit` questions of `path` (format detected from content) as `Example`s of `dataset`; with
    `answer_aliases` (an `id_aliases.json`), each question's gold answers gain the aliases of its `answer_id`."""
    name = canonical_dataset(dataset)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise DataError(f"limit must be None or an int >= 0, got {limit!r}")
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: is a directory, expected a .json or .jsonl file")
    out: list[Example] = []
    seen: set[str] = set()
    blank_gold: list[str] = []  # questions with a blank gold answer (left out)
    odd_gold: list[tuple[str, str]] = []  # (question, gold) of golds that normalise to nothing (kept)
    pattern_gold: list[tuple[str, str]] = []  # (question, gold) of golds written as regular expressions
    renamed: list[tuple[str, str]] = []  # (id, its new id) of the questions whose id an earlier one has
    fmt: str | None = None
    index = 0  # running question index, the qid of formats without ids
    for rec in file_records(path):
        if limit is not None and len(out) >= limit:
            break
        if fmt is None:
            fmt = rec.fmt or detect_format(rec.obj)
            if fmt is None:
                raise DataError(
                    f"{rec.where}: unknown data format (fields {sorted(rec.obj)[:12]}); expected one of: IRCoT "
                    "(question_id, question_text, answers_objects), 2Wiki (_id | test_id, question, answer), "
                    "StrategyQA (qid, question, answer: bool), NQ-open or plain QA (question, answer[] or answer: "
                    "str), question + answers (DPR, Hugging Face exports), WebQuestions (qId, qText, answers; or "
                    "utterance, targetValue), TriviaQA (Question, Answer: {Value, Aliases}; or question, answer: {value, "
                    "aliases}), FlashRAG (id, question, golden_answers), IIRC (passages with questions), or a "
                    "question<TAB>answers file"
                )
            check_dataset(name, fmt, rec)
            other = looks_like(fmt, rec.obj)
            if other is not None and other[0] != name:  # (it runs, with the wrong exemplars and answer style)
                warnings.warn(f"{path}: this looks like a {other[0]} file ({other[1]}) but --dataset is {name}: its "
                              f"questions get {name}'s exemplars and prompts; pass --dataset {other[0]} if it is one",
                              UserWarning, stacklevel=2)
        rows = record_rows(fmt, rec)
        for row in rows:
            if row is None or (limit is not None and len(out) >= limit):
                continue
            qid, question, answers, meta = row
            if qid is None:
                qid = f"{name}-{index}"
            index += 1
            if qid in seen:  # duplicate id: keep the question, give it a fresh id
                meta["source_qid"] = qid
                k = 2
                while f"{qid}#{k}" in seen:
                    k += 1
                renamed.append((qid, f"{qid}#{k}"))
                qid = f"{qid}#{k}"
            seen.add(qid)
            for what, text in (("the question", question), *(("an answer", a) for a in answers)):
                if (bad := _SURROGATE.search(text)) is not None:
                    raise DataError(f"{rec.where}: {what} holds a lone surrogate (U+{ord(bad.group()):04X}, e.g. a "
                                    "'\\ud800' escape): not Unicode text a tokenizer can read")
            if name == "strategyqa":  # (FlashRAG's and other exports may write the label as true/false)
                answers = [{"true": "yes", "false": "no"}.get(a.strip().lower(), a) for a in answers]
            if name == "strategyqa" and any(a.strip().lower() not in ("yes", "no") for a in answers):
                raise DataError(f"{rec.where}: --dataset strategyqa scores yes/no answers, but question {qid!r} "
                                f"has gold {answers[:3]}: a file of another dataset?")
            if any(not a.strip() for a in answers):
                # a blank gold is a missing value: scored, it would credit every answer that normalises to nothing
                blank_gold.append(qid)
                answers = [a for a in answers if a.strip()]
            if (odd := [a for a in answers if not normalize_answer(a)]):
                odd_gold.append((qid, odd[0]))  # (written text, e.g. "A" or "---": scored as published)
            if (pat := [a for a in answers if _PATTERN_LIKE.search(a)]):
                pattern_gold.append((qid, pat[0]))
            out.append(Example(qid=qid, question=question, answers=answers, dataset=name, meta=meta))
    if not out and limit != 0:
        raise DataError(f"{path}: no question to run in the file (every record was skipped: e.g. IIRC questions "
                        "without an answer)")
    if answer_aliases is not None and out:
        if with_answer_aliases(out, load_answer_aliases(answer_aliases), where=str(path)) == 0:
            warnings.warn(f"{answer_aliases}: no question of {path} has an answer_id with aliases there (another "
                          "dataset's file?); the gold answers are the data's own", UserWarning, stacklevel=2)
    if renamed:
        warnings.warn(f"{path}: {len(renamed)} question(s) repeat an id of an earlier one (first: {renamed[0][0]!r}, "
                      f"run as {renamed[0][1]!r}); each runs as a question of its own under the new id "
                      "(results.jsonl's qid; the file's id is kept in meta.source_qid)", UserWarning, stacklevel=2)
    if blank_gold:
        warnings.warn(f"{path}: {len(blank_gold)} question(s) have a blank gold answer (first: {blank_gold[0]}); "
                      "it is left out (it would credit every answer that normalises to nothing)", UserWarning,
                      stacklevel=2)
    if odd_gold:
        warnings.warn(f"{path}: {len(odd_gold)} question(s) have a gold answer that normalises to nothing (first: "
                      f"{odd_gold[0][0]}, {odd_gold[0][1]!r}; lowercase, no punctuation or articles): it matches "
                      "only answers that do too, an empty one included, as in the published evaluation",
                      UserWarning, stacklevel=2)
    if pattern_gold:
        warnings.warn(f"{path}: {len(pattern_gold)} question(s) have a gold answer that looks like a regular "
                      f"expression (first: {pattern_gold[0][0]}, {pattern_gold[0][1]!r}; CuratedTREC's are "
                      "patterns): gold answers are scored as text, so such a question can only match its pattern "
                      "written out", UserWarning, stacklevel=2)
    no_gold = [e.qid for e in out if not e.answers]  # (they can only score 0; counted after the aliases)
    if no_gold:
        warnings.warn(f"{path}: {len(no_gold)} question(s) have no gold answer (first: {no_gold[0]}); they score 0",
                      UserWarning, stacklevel=2)
    return out


def flashrag_record(e: Example) -> dict:
    """One question as a FlashRAG record {id, question, golden_answers, metadata}: a file read from FlashRAG's
    format gives back its own fields (metadata, and any other, e.g. `choices`, where they were); another format's
    fields go to `metadata`, with `source_format` naming that format."""
    meta = dict(e.meta)
    fmt = meta.pop("format", None)
    rec: dict = {"id": e.qid, "question": e.question, "golden_answers": list(e.answers)}
    if fmt == "flashrag":
        metadata = meta.pop("metadata", None)
        rec.update(meta)
        if metadata is not None:
            rec["metadata"] = metadata
    else:
        rec["metadata"] = {**meta, "source_format": fmt}
    return rec


def write_flashrag(examples: list[Example], path: str | Path) -> int:
    """Write `examples` as a FlashRAG jsonl file (`flashrag_record` a line, UTF-8), whole or not at all (a
    temporary file renamed); returns the number written."""
    import json
    import os

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for e in examples:
            f.write(json.dumps(flashrag_record(e), ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return len(examples)
