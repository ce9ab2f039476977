"""BM25's postings-driven search (fastrag._C.bm25_best_fields, csrc/bm25_cpu.cpp) against the numpy path it
replaces (dense per-field score vectors, `BM25Retriever._search_one`): the same passages, scores (to the bit) and
order on fresh random corpora and queries; the scratch it is lent stays all zero; bad operands are refused by name."""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from fastrag.retrieval import BM25Retriever
from fastrag.retrieval.bm25 import NATIVE_ENV

_C = pytest.importorskip("fastrag._C", reason="the C++ extension is not built (scripts/install.sh builds it)")


def _vocab(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choices("abcdefghijklmnoprstuvy", k=rng.randint(3, 8))) for _ in range(n)]


def _corpus(tmp_path: Path, rng: random.Random, n: int, titles: bool,
            name: str = "c.jsonl") -> tuple[Path, list[str]]:
    words = _vocab(rng, 150)
    zipf = [1.0 / (i + 1) for i in range(len(words))]  # (frequent and rare terms, long and short postings)
    rows = []
    for i in range(n):
        text = " ".join(rng.choices(words, weights=zipf, k=rng.randint(1, 40)))
        title = " ".join(rng.choices(words, weights=zipf, k=rng.randint(1, 4))) if titles else ""
        rows.append({"id": f"d{i}", "title": title, "text": text})
    for j in rng.sample(range(n), n // 10):  # exact duplicates: tied scores, broken by corpus order
        rows.append(dict(rows[j], id=f"dup{j}"))
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p, words


def _queries(rng: random.Random, words: list[str], n: int) -> list[str]:
    qs = []
    for _ in range(n):
        q = rng.choices(words, k=rng.randint(1, 12))
        if rng.random() < 0.3:
            q += q[: rng.randint(1, len(q))]  # repeated terms count with multiplicity
        if rng.random() < 0.3:
            q.append("zzzunknownterm")
        qs.append(" ".join(q))
    return qs + ["", "the of and", "zzzunknownterm"]  # blank, stopwords only, no indexed term


def _numpy_search(r: BM25Retriever, queries: list[str], k: int):
    return [r._search_one(t, k) for t in r.analyze(queries)]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("titles", [True, False])
def test_the_native_search_gives_the_numpy_paths_passages_scores_and_order(tmp_path, seed, titles):
    rng = random.Random(seed * 2 + titles)
    path, words = _corpus(tmp_path, rng, rng.randint(200, 600), titles)
    tb = [0.3, 0.5, 0.0][seed] if titles else [1.0, 0.7, 0.3][seed]  # (0.3, 0.7: a float32 product that rounds)
    r = BM25Retriever(path, tie_breaker=tb, show_progress=False)
    assert r._native is not None
    queries = _queries(rng, words, 60) + [w for w in words[-40:]]  # (+ one-word queries of the rarest words)
    # both of the kernel's ways to combine run: a sweep of the scratch for a query whose postings reach an eighth of
    # the corpus, the touched passages alone for a sparser one
    postings = [sum(int(m.scores["indptr"][t + 1] - m.scores["indptr"][t]) for m in r._fields.values()
                    if m is not None for t in m.get_tokens_ids(tk)) for tk in r.analyze(queries)]
    assert sum(8 * n > r.n_docs for n in postings) > 10 and sum(0 < 8 * n <= r.n_docs for n in postings) > 10
    for k in (1, 3, 10, 10_000):
        got = r.search(queries, k)
        want = _numpy_search(r, queries, k)
        assert got == want  # (Doc equality: id, title, text and the float score exactly)
    assert sum(len(g) for g in r.search(queries, 3)) > 100
    _, _, scratch, mark = r._native
    assert not scratch.any() and not mark.any()  # set back after every query


def test_the_switch_turns_the_native_search_off(tmp_path, monkeypatch):
    path, words = _corpus(tmp_path, random.Random(5), 100, True)
    monkeypatch.setenv(NATIVE_ENV, "0")
    assert BM25Retriever(path, show_progress=False)._native is None
    monkeypatch.setenv(NATIVE_ENV, "1")
    r = BM25Retriever(path, show_progress=False)
    assert r._native is not None
    monkeypatch.setenv(NATIVE_ENV, "maybe")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (refused at once: not read as an unreadable index and built again)
        with pytest.raises(ValueError, match=NATIVE_ENV):
            BM25Retriever(path, show_progress=False)


def _operands(n_docs=5):
    data = [torch.tensor([1.0, 2.0, 0.5], dtype=torch.float32), torch.tensor([3.0], dtype=torch.float32)]
    indices = [torch.tensor([0, 2, 4], dtype=torch.int32), torch.tensor([2], dtype=torch.int64)]
    indptr = [torch.tensor([0, 2, 3], dtype=torch.int64), torch.tensor([0, 1], dtype=torch.int32)]
    terms = [torch.tensor([0, 1, 0], dtype=torch.long), torch.tensor([0], dtype=torch.long)]
    offsets = [torch.tensor([0, 2, 3], dtype=torch.long), torch.tensor([0, 1, 1], dtype=torch.long)]
    return data, indices, indptr, terms, offsets, torch.zeros(2, n_docs), torch.zeros(n_docs, dtype=torch.uint8)


def test_a_small_case_by_hand():
    data, indices, indptr, terms, offsets, scratch, mark = _operands()
    ids, scores = _C.bm25_best_fields(data, indices, indptr, terms, offsets, scratch, mark, 0.5, 3)
    # query 0: title terms 0 (d0: 1, d2: 2) and 1 (d4: 0.5), text term 0 (d2: 3): d2 = max(2, 3) + 0.5 * min = 4,
    # d0 = 1, d4 = 0.5
    assert ids[0].tolist() == [2, 0, 4] and scores[0].tolist() == [4.0, 1.0, 0.5]
    # query 1: title term 0 only -> d0: 1, d2: 2; no text term
    assert ids[1].tolist() == [2, 0, -1] and scores[1].tolist() == [2.0, 1.0, 0.0]
    assert not scratch.any() and not mark.any()


@pytest.mark.parametrize("change, match", [
    (lambda o: o[3].__setitem__(0, torch.tensor([0, 7, 0])), r"field 0: term id 7 is outside \[0, 2\)"),
    (lambda o: o[4].__setitem__(1, torch.tensor([0, 1])), r"field 1: offsets describe 1 queries, field 0 2"),
    (lambda o: o[4].__setitem__(0, torch.tensor([0, 3, 2])), r"field 0: offsets must run from 0 to len\(terms\)"),
    (lambda o: o[0].__setitem__(0, o[0][0].double()), r"field 0: data must be float32"),
    (lambda o: o[1].__setitem__(1, torch.tensor([2, 3])), r"field 1: indices \(2\) and data \(1\) must have one"),
])
def test_bad_operands_are_refused_by_name(change, match):
    ops = list(_operands())
    change(ops)
    with pytest.raises(RuntimeError, match=match):
        _C.bm25_best_fields(*ops, 0.5, 3)


def test_a_posting_outside_the_corpus_is_an_error_that_leaves_the_scratch_zero():
    data, indices, indptr, terms, offsets, scratch, mark = _operands()
    indices[0] = torch.tensor([0, 9, 4], dtype=torch.int32)  # passage 9 of 5
    with pytest.raises(RuntimeError, match=r"field 0: a posting names passage 9, outside \[0, 5\)"):
        _C.bm25_best_fields(data, indices, indptr, terms, offsets, scratch, mark, 0.5, 3)
    assert not scratch.any() and not mark.any()


def test_the_native_search_reads_only_the_postings_it_needs(tmp_path):
    """A query for a term one passage holds touches that passage's scratch entries alone: the rest, poisoned with
    NaN, are neither read (a score would turn NaN) nor cleared (a dense pass over the corpus would clear them)."""
    path, _ = _corpus(tmp_path, random.Random(11), 2000, True)
    with open(path, "a") as f:
        f.write(json.dumps({"id": "rare", "title": "", "text": "quixotically"}) + "\n")
    r = BM25Retriever(path, show_progress=False)
    _, _, scratch, _ = r._native
    last = r.n_docs - 1  # (the rare passage: the file's last line)
    scratch[:, :last] = float("nan")
    got = r.search(["quixotically"], 3)
    assert [d.id for d in got[0]] == ["rare"] and np.isfinite(got[0][0].score) and got[0][0].score > 0
    assert torch.isnan(scratch[:, :last]).all() and not scratch[:, last:].any()
    scratch.zero_()


def test_an_index_in_other_dtypes_is_searched_by_the_numpy_path(tmp_path):
    """A bm25s index saved with float64 scores (bm25s' dtype setting) is not what the kernel reads: the retriever
    keeps the numpy path for it, with the same answers, instead of failing each search."""
    path, words = _corpus(tmp_path, random.Random(13), 150, True)
    r = BM25Retriever(path, show_progress=False)
    queries = _queries(random.Random(14), words, 20)
    want = r.search(queries, 5)
    r._fields["text"].scores["data"] = np.asarray(r._fields["text"].scores["data"], dtype=np.float64)
    assert r._native_search() is None
    r._native = None
    got = r.search(queries, 5)  # (float64 sums may order near-ties otherwise: the counts of matches are the same)
    assert [len(q) for q in got] == [len(q) for q in want] and sum(map(len, got)) > 20
