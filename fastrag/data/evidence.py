"""Retrieval metrics: how many of a question's gold supporting passages the retriever brought back.

Gold evidence is a set of Wikipedia titles, read from what the dataset file carries (`gold_titles`):

| source                                   | gold titles                                                     |
|------------------------------------------|-----------------------------------------------------------------|
| HotpotQA / 2Wiki original (`_id` format) | `supporting_facts` [[title, sentence], ...]                     |
| IRCoT processed files                    | `contexts[].title` where `is_supporting`                        |
| FlashRAG (`metadata`)                    | `supporting_facts` as {"title": [...], ...} or [[title, i], ...]; MuSiQue's `paragraphs[].title` where `is_supporting` |

2WikiMultihopQA's `evidences` are (subject, relation, object) triples of entity names, not page titles, so they are
not read: its `supporting_facts` name the pages. A dataset without any of these (NQ, WebQuestions, StrategyQA, most
of FlashRAG's) has no gold evidence, and the run's block says so.

Definitions, per question (a passage counts as gold when its title is one of the gold titles, compared after
Unicode NFC and surrounding whitespace; each gold title counts once however many passages carry it):
- retrieved: the passages of all the question's retrievals in order (round 1's top-k, then round 2's, ...), each
  passage id kept at its first appearance: the union of the rounds, in the order the method saw them.
- recall@k = |gold titles among the titles of the first k retrieved| / |gold titles|
- precision@k = |first k retrieved passages whose title is gold| / k (a question that retrieved fewer than k
  passages is not excused: it had the chance)
- k: `docs_per_retrieval` (the most passages one retrieval returned in the run, the method's top-k) and
  `RETRIEVAL_KS`; "all" is the whole union (precision over its size; 0 when the question retrieved nothing).
The run's figures are means over the answered questions that have gold evidence.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable

RETRIEVAL_KS = (1, 5, 10)


def _title(t) -> str | None:
    return unicodedata.normalize("NFC", t).strip() if isinstance(t, str) and t.strip() else None


def _titles_of_facts(facts) -> list:
    if isinstance(facts, dict):  # FlashRAG's columns: {"title": [...], "sent_id": [...]}
        facts = facts.get("title")
        return list(facts) if isinstance(facts, list) else []
    if isinstance(facts, list):  # [[title, sentence index], ...]
        return [f[0] if isinstance(f, (list, tuple)) and f else f for f in facts]
    return []


def gold_titles(meta: dict) -> list[str] | None:
    """The gold supporting titles of a question's `Example.meta` (see the module docstring), without repeats; None
    when the record carries no gold evidence."""
    found: list | None = None
    for where in (meta, meta.get("metadata") if isinstance(meta.get("metadata"), dict) else None):
        if where is None:
            continue
        if "supporting_facts" in where:
            found = (found or []) + _titles_of_facts(where["supporting_facts"])
        for key in ("contexts", "paragraphs"):  # IRCoT's contexts, MuSiQue's paragraphs
            if isinstance(where.get(key), list) and any(isinstance(c, dict) and "is_supporting" in c
                                                        for c in where[key]):
                found = (found or []) + [c.get("title") for c in where[key]
                                         if isinstance(c, dict) and c.get("is_supporting")]
    if found is None:
        return None
    return list(dict.fromkeys(t for t in map(_title, found) if t is not None))


def retrieved_ids(result) -> list[str]:
    """The passage ids a question's retrievals returned, in order, each at its first appearance (a QuestionResult:
    its rounds; BeamSearchQA's records, whose rounds are empty: the chosen path's retrievals)."""
    ids: list[str] = []
    for r in result.rounds:
        ids += r.doc_ids
    if not ids and getattr(result, "chosen", None) is not None:
        for docs in result.chosen.doc_ids:
            ids += docs
    return list(dict.fromkeys(ids))


def scores(gold: Iterable[str], titles: list[str], k: int | None) -> tuple[float, float]:
    """(recall@k, precision@k) of the retrieved passages' `titles` (in order) against the `gold` titles; k None:
    the whole list (precision 0 for an empty one)."""
    gold = set(gold)
    top = titles if k is None else titles[:k]
    top = [_title(t) for t in top]
    recall = len(gold & set(top)) / len(gold) if gold else 0.0
    denom = len(top) if k is None else k
    precision = sum(t in gold for t in top) / denom if denom else 0.0
    return recall, precision


def corpus_titles(corpus, ids: set[str]) -> dict[str, str]:
    """The titles of the passages `ids` of a corpus file (one pass over it)."""
    from fastrag.retrieval.corpus import iter_corpus

    out: dict[str, str] = {}
    for pid, title, _text in iter_corpus(corpus):
        if pid in ids:
            out[pid] = title
            if len(out) == len(ids):
                break
    return out


def retrieval_quality(examples: dict, results: list, corpus) -> dict:
    """metrics.json's `retrieval_quality` block for the answered `results` (examples: qid -> Example; corpus: the
    passage file the run retrieved from): the means of the module docstring, or {"available": False, "why": ...}."""
    ok = [r for r in results if r.error is None and r.qid in examples]
    gold = {r.qid: g for r in ok if (g := gold_titles(examples[r.qid].meta))}
    if not gold:
        return {"available": False, "why": "the dataset file gives no gold supporting passages (e.g. HotpotQA's or "
                "2WikiMultihopQA's supporting_facts, FlashRAG metadata carrying them)"}
    if corpus is None:
        return {"available": False, "why": "the corpus file is not known (a retriever given built): the retrieved "
                "passages' titles cannot be read"}
    got = {r.qid: retrieved_ids(r) for r in ok if r.qid in gold}
    titles = corpus_titles(corpus, {i for ids in got.values() for i in ids})
    per_round = [len(rd.doc_ids) for r in ok for rd in r.rounds if rd.doc_ids]
    k_round = max(per_round, default=0)
    ks = sorted({k for k in (k_round, *RETRIEVAL_KS) if k > 0})
    sums = {k: [0.0, 0.0] for k in (*ks, None)}
    for qid, ids in got.items():
        named = [titles.get(i, "") for i in ids]
        for k in sums:
            rec, prec = scores(gold[qid], named, k)
            sums[k][0] += rec
            sums[k][1] += prec
    n = len(got)
    return {"available": True, "gold": "titles", "questions": n, "docs_per_retrieval": k_round or None,
            "retrieved_per_question": sum(len(v) for v in got.values()) / n,
            "gold_per_question": sum(len(gold[q]) for q in got) / n,
            "at": {str(k): {"recall": sums[k][0] / n, "precision": sums[k][1] / n} for k in ks},
            "all": {"recall": sums[None][0] / n, "precision": sums[None][1] / n},
            "definition": "per question over the union of its retrievals' passages in order (fastrag/data/"
                          "evidence.py): recall@k = gold titles among the first k / gold titles; precision@k = "
                          "gold passages among the first k / k; means over answered questions with gold evidence"}
