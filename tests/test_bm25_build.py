"""The chunked BM25 index build (fastrag.retrieval.bm25_build) against bm25s's own in-memory build of the same
analysed passages: every term's postings (passages and float32 scores to the bit) and the saved parameters agree,
on fresh random corpora cut into small chunks and slices so that chunk and slice edges fall everywhere; the build in
worker processes writes the same files as the one in a single process; errors in the corpus or in a worker leave no
index, no scratch files and no processes; and the build does not keep the corpus in memory."""

from __future__ import annotations

import json
import multiprocessing
import random
import tracemalloc
from pathlib import Path

import bm25s
import numpy as np
import pytest

from fastrag.retrieval import BM25Retriever, bm25_build
from fastrag.retrieval.corpus import CorpusError

_STOP = ["the", "of", "and", "a", "in", "is"]
_CJK = ["東", "京", "大", "学", "の", "ひ"]
_ONE = ["s", "D", "1", "é", "ß", "٣"]


def _rows(rng: random.Random, n: int, titles: bool = True) -> list[tuple[str, str, str]]:
    words = ["".join(rng.choices("abcdefghiklmnoprstuy", k=rng.randint(2, 9))) for _ in range(rng.randint(50, 300))]
    # stemmer pairs (several surface forms, one term), stopwords, CJK characters and one-character terms (kept, as
    # Elasticsearch keeps them), frequent and rare words
    words += ["run", "running", "runs", "connect", "connected", "connection"] + _STOP + _CJK + _ONE
    weights = [1.0 / (i + 1) ** 0.8 for i in range(len(words))]
    rows = []
    for i in range(n):
        k = rng.choice([0, 1, 3, rng.randint(5, 80)])  # (empty, all-stopword and long passages)
        text = " ".join(rng.choices(words, weights=weights, k=k))
        if rng.random() < 0.1:
            text = " ".join(rng.choices(_STOP, k=4))
        title = " ".join(rng.choices(words, k=rng.randint(0, 3))) if titles else ""
        rows.append((f"p{i}", title, text))
    return rows


def _postings(folder: Path) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict]:
    """{term: (passages, float32 scores as uint32 bits)} and the parameters of a saved bm25s index folder."""
    vocab = json.loads((folder / "vocab.index.json").read_text())
    arr = {k: np.load(folder / f"{k}.csc.index.npy") for k in ("data", "indices", "indptr")}
    assert arr["data"].dtype == np.float32 and arr["indices"].dtype == np.int32 and arr["indptr"].dtype == np.int64
    out = {}
    for term, i in vocab.items():
        if i + 1 < len(arr["indptr"]):  # (the empty token, past the last column, holds no postings)
            s = slice(arr["indptr"][i], arr["indptr"][i + 1])
            out[term] = (arr["indices"][s].copy(), arr["data"][s].view(np.uint32).copy())
    return out, json.loads((folder / "params.index.json").read_text())


def _bm25s_build(texts: list[str], folder: Path, k1: float, b: float) -> None:
    model = bm25s.BM25(k1=k1, b=b, method="lucene")
    model.index(bm25_build.analyse(texts, show_progress=False), show_progress=False)
    model.save(folder, show_progress=False)


def _assert_same_postings(ours: Path, theirs: Path) -> None:
    (got, got_params), (want, want_params) = _postings(ours), _postings(theirs)
    assert got_params == want_params
    assert set(json.loads((ours / "vocab.index.json").read_text())) == set(
        json.loads((theirs / "vocab.index.json").read_text()))
    assert got.keys() == want.keys()
    for term in want:
        np.testing.assert_array_equal(got[term][0], want[term][0], err_msg=term)
        np.testing.assert_array_equal(got[term][1], want[term][1], err_msg=term)


@pytest.mark.parametrize("native", [True, False], ids=["scan", "regex"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_chunked_build_writes_bm25s_postings_to_the_bit(tmp_path, monkeypatch, seed, native):
    rng = random.Random(seed)
    rows = _rows(rng, rng.randint(150, 500))
    k1, b = [(1.2, 0.75), (0.9, 0.4), (2.0, 1.0), (1.5, 0.0)][seed]
    monkeypatch.setattr(bm25_build, "SLICE", rng.randint(7, 300))  # (postings placed a few at a time)
    chunk = rng.randint(1, 60)
    n, found = bm25_build.build_fields(rows, tmp_path / "ours", ("title", "text"), k1, b, workers=1, chunk=chunk,
                                       native=native)
    assert n == len(rows) and found == {"title": True, "text": True}
    assert not (tmp_path / "ours" / ".build").exists()  # (the scratch files are gone)
    for j, field in enumerate(("title", "text")):
        _bm25s_build([r[1 + j] for r in rows], tmp_path / f"bm25s-{field}", k1, b)
        _assert_same_postings(tmp_path / "ours" / field, tmp_path / f"bm25s-{field}")
        # and bm25s loads the folder and scores a query as its own index does
        ours = bm25s.BM25.load(tmp_path / "ours" / field, mmap=True)
        theirs = bm25s.BM25.load(tmp_path / f"bm25s-{field}")
        q = bm25_build.analyse([rows[rng.randrange(len(rows))][1 + j] + " running connection"], return_ids=False,
                               show_progress=False)[0]
        if q:
            np.testing.assert_array_equal(ours.get_scores(q), theirs.get_scores(q))


def test_worker_processes_write_the_same_files_as_one_process(tmp_path):
    rng = random.Random(11)
    rows = _rows(rng, 400)
    before = multiprocessing.active_children()
    for workers in (1, 3):
        bm25_build.build_fields(rows, tmp_path / f"w{workers}", ("title", "text"), 1.2, 0.75, workers=workers,
                                chunk=37)  # (11 chunks: the pool starts at the third)
    assert multiprocessing.active_children() == before
    for field in ("title", "text"):
        for name in ("data.csc.index.npy", "indices.csc.index.npy", "indptr.csc.index.npy", "vocab.index.json",
                     "params.index.json"):
            one, three = (tmp_path / f"w{w}" / field / name for w in (1, 3))
            assert one.read_bytes() == three.read_bytes(), (field, name)


def test_a_field_without_terms_is_reported_and_writes_nothing(tmp_path):
    rows = _rows(random.Random(5), 120, titles=False)
    n, found = bm25_build.build_fields(rows, tmp_path / "ix", ("title", "text"), 1.2, 0.75, workers=1, chunk=25)
    assert n == 120 and found == {"title": False, "text": True}
    assert not (tmp_path / "ix" / "title").exists()


def _write_jsonl(path: Path, rows, bad_at: int | None = None) -> Path:
    lines = [json.dumps({"id": i, "title": t, "text": x}) for i, t, x in rows]
    if bad_at is not None:
        lines[bad_at] = '{"id": "broken", "text": '
    path.write_text("\n".join(lines) + "\n")
    return path


def test_retriever_build_in_workers_searches_as_the_one_process_build(tmp_path, monkeypatch):
    rng = random.Random(21)
    rows = _rows(rng, 700)
    corpus = _write_jsonl(tmp_path / "c.jsonl", rows)
    monkeypatch.setattr(bm25_build, "CHUNK", 64)  # (11 chunks: workers from the third on)
    one = BM25Retriever(corpus, index_dir=tmp_path / "one", show_progress=False, index_workers=1)
    two = BM25Retriever(corpus, index_dir=tmp_path / "two", show_progress=False, index_workers=2)
    assert one.built and two.built and one.n_docs == two.n_docs == len(rows)
    queries = [" ".join(rng.choice(rows)[2].split()[:6]) for _ in range(40)] + ["running connected 東京"]
    got, want = two.search(queries, 5), one.search(queries, 5)
    assert got == want and sum(map(len, got)) > 100


@pytest.mark.parametrize("workers", [1, 2])
def test_a_bad_line_after_the_first_chunks_fails_the_build_and_leaves_nothing(tmp_path, monkeypatch, workers):
    rows = _rows(random.Random(3), 300)
    corpus = _write_jsonl(tmp_path / "c.jsonl", rows, bad_at=250)
    monkeypatch.setattr(bm25_build, "CHUNK", 40)  # (the bad line in the 7th chunk: the pool is running)
    before = multiprocessing.active_children()
    with pytest.raises(CorpusError, match=r"c\.jsonl:251: malformed JSON"):
        BM25Retriever(corpus, index_dir=tmp_path / "ix", show_progress=False, index_workers=workers)
    assert not (tmp_path / "ix").exists()  # (a folder the build made is removed whole)
    assert multiprocessing.active_children() == before


def _failing_analysis(fields, *args):
    if any("poison" in t for t in fields[1]):
        raise RuntimeError("analysis failed on a poisoned chunk")
    return _real_analysis(fields, *args)


_real_analysis = bm25_build._analyse_chunk


def test_an_error_in_a_worker_reaches_the_caller_and_leaves_no_scratch(tmp_path, monkeypatch):
    rows = _rows(random.Random(4), 200)
    rows[150] = (rows[150][0], "", "poison here")
    (tmp_path / "ix").mkdir()
    monkeypatch.setattr(bm25_build, "_analyse_chunk", _failing_analysis)  # (the forked workers inherit it)
    before = multiprocessing.active_children()
    with pytest.raises(RuntimeError, match="poisoned chunk"):
        bm25_build.build_fields(rows, tmp_path / "ix", ("title", "text"), 1.2, 0.75, workers=2, chunk=20)
    assert list((tmp_path / "ix").iterdir()) == []
    assert multiprocessing.active_children() == before


def test_bad_worker_counts_are_refused_by_name(tmp_path, monkeypatch):
    corpus = _write_jsonl(tmp_path / "c.jsonl", _rows(random.Random(1), 20))
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="index_workers must be a number of processes >= 1"):
            BM25Retriever(corpus, index_dir=tmp_path / "ix", show_progress=False, index_workers=bad)
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(bm25_build.WORKERS_ENV, bad)
        with pytest.raises(ValueError, match=r"\$FASTRAG_INDEX_WORKERS=.*expected a number of processes"):
            BM25Retriever(corpus, index_dir=tmp_path / "ix", show_progress=False)
    assert not (tmp_path / "ix").exists()  # (refused before any work)
    monkeypatch.setenv(bm25_build.WORKERS_ENV, "2")
    assert BM25Retriever(corpus, index_dir=tmp_path / "ix", show_progress=False).index_workers == 2


def test_the_builds_memory_does_not_grow_with_the_corpus(tmp_path, monkeypatch):
    # passages of 100 words over a fixed vocabulary: what bm25s's in-memory build allocates grows with the corpus
    # (measured: 14 MB for the 3,000 passages, 54 MB for the 12,000, 6x the text), what the chunked build allocates
    # is a chunk's and a slice's worth plus 16 bytes a passage (measured: 4 MB for either)
    monkeypatch.setattr(bm25_build, "SLICE", 1 << 15)
    rng = random.Random(8)
    words = ["".join(rng.choices("abcdefghiklmnoprstuy", k=rng.randint(3, 9))) for _ in range(3000)]
    peaks, sizes = [], []
    for n in (3000, 12000):
        rows = [(str(i), " ".join(rng.choices(words, k=3)), " ".join(rng.choices(words, k=100))) for i in range(n)]
        sizes.append(sum(len(t) + len(x) for _, t, x in rows))
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            # (the rows are the caller's, handed over one at a time: only what the build keeps is measured)
            bm25_build.build_fields(iter(rows), tmp_path / f"ix{n}", ("title", "text"), 1.2, 0.75, workers=1,
                                    chunk=500)
            peaks.append(tracemalloc.get_traced_memory()[1] - base)
        finally:
            tracemalloc.stop()
    assert peaks[1] < 1.5 * peaks[0], peaks  # (4x the passages)
    assert peaks[1] < 0.5 * sizes[1], (peaks, sizes)


def test_fastrag_index_takes_a_worker_count_and_refuses_a_bad_one(tmp_path, monkeypatch, capsys):
    from fastrag.cli import main

    rows = _rows(random.Random(9), 200)
    corpus = _write_jsonl(tmp_path / "c.jsonl", rows)
    for bad in ("0", "x"):
        with pytest.raises(SystemExit) as e:
            main(["index", "--corpus", str(corpus), "--index-workers", bad, "--no-progress"])
        assert e.value.code == 2
        assert f"--index-workers: expected a number of processes >= 1, got {bad!r}" in capsys.readouterr().err
    assert not (tmp_path / "c.jsonl.bm25s").exists()
    seen = []
    real = bm25_build.build_fields
    monkeypatch.setattr(bm25_build, "build_fields", lambda *a, **kw: seen.append(kw["workers"]) or real(*a, **kw))
    assert main(["index", "--corpus", str(corpus), "--index-workers", "3", "--no-progress"]) == 0
    assert seen == [3] and "bm25: 200 passages, index built" in capsys.readouterr().out
    r = BM25Retriever(corpus, show_progress=False)
    assert not r.built and r.n_docs == 200  # (the saved index is reused)
