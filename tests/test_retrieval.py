"""fastrag.retrieval: corpus formats, BM25 best_fields scoring vs a brute-force reference, persistence."""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path

import pytest

from fastrag.retrieval import BM25Retriever, CorpusError, Doc, Retriever, iter_corpus, make_retriever
from fastrag.retrieval.bm25 import NATIVE_ENV

DOCS = [
    ("a1", "Paris", "Paris is the capital and largest city of France."),
    ("a2", "France", "France is a country in Western Europe; its capital is Paris."),
    ("a3", "Eiffel Tower", "The Eiffel Tower is a wrought-iron tower in Paris, France, built in 1889."),
    ("a4", "Berlin", "Berlin is the capital of Germany and its largest city."),
    ("a5", "Capital city", "A capital city is the seat of government of a country."),
    ("a6", "Gustave Eiffel", "Gustave Eiffel was a French engineer whose company built the tower."),
    ("a7", "Tower of London", "The Tower of London is a historic castle in London."),
    ("a8", "Paris Paris", "A song title that repeats the city name."),
    ("a9", "Germany", "Germany borders France; Berlin is its capital city, capital of capitals."),
    ("a10", "Towers", "Towers and more towers: a tower, towering over towns."),
    ("a11", "Untitled", "Nothing relevant here at all."),
]
QUERIES = [
    "capital of France",
    "Paris",
    "Eiffel tower built",
    "Berlin capital city Germany",
    "tower tower london",
    "French engineer company",
    "the capital",
]


def _write_jsonl(path: Path, docs) -> Path:
    path.write_text("".join(json.dumps({"id": i, "title": t, "text": x}) + "\n" for i, t, x in docs))
    return path


def _analyze(texts):
    import bm25s
    import Stemmer

    # (every `\w+` run a token, one-character ones included, as Elasticsearch's standard tokenizer makes them)
    return bm25s.tokenize(texts, token_pattern=r"(?u)\b\w+\b", stopwords="en", stemmer=Stemmer.Stemmer("english"),
                          return_ids=False, show_progress=False)


def _bm25_field(docs_tokens, query_tokens, k1=1.2, b=0.75):
    """Brute-force Lucene BM25 of one field: sum over query terms (with multiplicity) of idf * tf-norm."""
    n = len(docs_tokens)
    avgdl = sum(map(len, docs_tokens)) / n
    out = []
    for d in docs_tokens:
        s = 0.0
        for t in query_tokens:
            df = sum(t in e for e in docs_tokens)
            tf = d.count(t)
            if tf == 0:
                continue
            idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
            s += idf * tf / (tf + k1 * (1 - b + b * len(d) / avgdl))
        out.append(s)
    return out


def _brute_search(docs, query, k, tie_breaker=0.5):
    q = _analyze([query])[0]
    title = _bm25_field(_analyze([t for _, t, _ in docs]), q)
    text = _bm25_field(_analyze([x for _, _, x in docs]), q)
    comb = [max(a, c) + tie_breaker * min(a, c) for a, c in zip(title, text)]
    order = sorted((i for i in range(len(docs)) if comb[i] > 0), key=lambda i: (-comb[i], i))[:k]
    return [(docs[i][0], comb[i]) for i in order], dict(zip((d[0] for d in docs), comb))


@pytest.fixture
def corpus(tmp_path):
    return _write_jsonl(tmp_path / "c.jsonl", DOCS)


@pytest.mark.parametrize("tie_breaker", [0.5, 0.0, 1.0])
@pytest.mark.parametrize("k", [1, 3, 20])
def test_bm25_matches_brute_force(tmp_path, corpus, tie_breaker, k):
    r = BM25Retriever(corpus, index_dir=tmp_path / "idx", tie_breaker=tie_breaker, show_progress=False)
    got = r.search(QUERIES, k)
    assert len(got) == len(QUERIES)
    for q, docs in zip(QUERIES, got):
        want, all_scores = _brute_search(DOCS, q, k, tie_breaker)
        msg = f"query {q!r}: got {[(d.id, d.score) for d in docs]}, want {want}"
        assert len(docs) == len(want), msg
        assert [d.score for d in docs] == pytest.approx([s for _, s in want], rel=1e-5), msg
        for d in docs:  # each returned doc's own reference score (robust to float near-ties)
            assert d.score == pytest.approx(all_scores[d.id], rel=1e-5), msg
        assert all(a.score >= b.score for a, b in zip(docs, docs[1:])), msg
        by_id = {i: (t, x) for i, t, x in DOCS}
        assert all((d.title, d.text) == by_id[d.id] for d in docs)


def test_bm25_from_several_threads_answers_as_one_thread(tmp_path, corpus):
    """The scheduler may keep several retrieval batches in flight (search_concurrency): calls from 8 threads at once
    give each query what a lone call gives."""
    from concurrent.futures import ThreadPoolExecutor

    r = BM25Retriever(corpus, index_dir=tmp_path / "idx", show_progress=False)
    want = [[(d.id, d.score) for d in docs] for docs in r.search(QUERIES, 3)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: r.search([QUERIES[i % len(QUERIES)]], 3)[0], range(64)))
    assert [[(d.id, d.score) for d in docs] for docs in got] == [want[i % len(QUERIES)] for i in range(64)]


def test_title_and_text_are_separate_fields(tmp_path, corpus):
    """'Paris Paris' (a8) matches only in its title; 'Paris' (a1) in both: max + 0.5 * other decides."""
    r = BM25Retriever(corpus, index_dir=tmp_path / "idx", show_progress=False)
    _, ref = _brute_search(DOCS, "Paris", 20)
    got = {d.id: d.score for d in r.search(["Paris"], 20)[0]}
    assert got["a8"] == pytest.approx(ref["a8"], rel=1e-5)
    assert got["a1"] == pytest.approx(ref["a1"], rel=1e-5)
    assert "a11" not in got and "a7" not in got


def test_ties_in_corpus_order_and_fewer_than_k(tmp_path):
    docs = [("z", "Same", "identical words here"), ("y", "Other", "unrelated"), ("x", "Same", "identical words here")]
    r = BM25Retriever(_write_jsonl(tmp_path / "t.jsonl", docs), show_progress=False)
    got = r.search(["identical same"], 5)[0]
    assert [d.id for d in got] == ["z", "x"]
    assert got[0].score == got[1].score > 0


def test_a_dropped_retriever_leaves_no_open_file(tmp_path, corpus):
    """The passage store reads through a memory map, which holds its own handle: no file object stays open per
    retriever (a server that rebuilds its retriever would leak one descriptor each time), and passages still read
    after the build's and the reload's files are closed."""
    import gc
    import warnings

    BM25Retriever(corpus, index_dir=tmp_path / "idx", show_progress=False)  # built here, then reloaded below
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = BM25Retriever(corpus, index_dir=tmp_path / "idx", show_progress=False)
        gc.collect()
        assert not r.built and r.search(["Berlin"], 1)[0][0].id == "a4"
        del r
        gc.collect()
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaks, leaks


def test_blank_and_stopword_queries(tmp_path, corpus):
    r = BM25Retriever(corpus, index_dir=tmp_path / "idx", show_progress=False)
    got = r.search(["", "   ", "the of and is", "zzzunknownword", "Berlin"], 3)
    assert got[:4] == [[], [], [], []]
    assert got[4] and got[4][0].id == "a4"
    assert r.search([], 3) == []


def test_bad_search_arguments(tmp_path, corpus):
    r = make_retriever("bm25", corpus_path=corpus, index_dir=tmp_path / "idx", show_progress=False)
    assert isinstance(r, Retriever)
    for k in (0, -1, 2.0, "3", True):
        with pytest.raises(ValueError, match="k must be a positive integer"):
            r.search(["Paris"], k)
    with pytest.raises(TypeError, match="list of strings"):
        r.search("Paris", 3)
    with pytest.raises(ValueError, match="unknown retriever kind"):
        make_retriever("nope")
    with pytest.raises(ValueError, match="tie_breaker"):
        BM25Retriever(corpus, tie_breaker=2.0)


def test_queries_from_an_iterator_are_all_answered(corpus):
    """A generator of queries was consumed by the type check, then searched as an empty batch: [] came back for
    a batch of two (len(result) == len(queries) broken without a word)."""
    r = BM25Retriever(corpus, show_progress=False)
    queries = ["Paris", "capital of Germany"]
    want = r.search(queries, 2)
    assert len(want) == 2 and all(want)
    assert r.search((q for q in queries), 2) == want
    assert r.search(iter(queries), 2) == want
    assert r.search(tuple(queries), 2) == want
    with pytest.raises(TypeError, match="list of strings"):
        r.search(iter(["Paris", 3]), 2)
    with pytest.raises(TypeError, match="list of strings"):
        r.search(7, 2)


# ---- persistence --------------------------------------------------------------------------------------


# passages whose names differ from their neighbours' only by a one-character term; each holds a term the other lacks
# only in that character, so the old two-character analysis scores the pairs alike (the first of a pair wins ties)
_ONE_CHARACTER_DOCS = [
    ("r", "Acura Type R", "The Type R is a sports trim of the Acura."),
    ("s", "Acura Type S", "The Type S is a sports trim of the Acura."),
    ("ve", "V-E Day", "V-E Day marked the end of the war in Europe."),
    ("d", "D-Day", "D-Day marked the Allied landings in Normandy."),
    ("r6", "Route 6", "Route 6 runs across the country."),
    ("r1", "Route 1", "Route 1 runs along the coast."),
    ("x", "Letters", "The letters é and ß, the digit ٣."),
]


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "numpy"])
def test_one_character_terms_are_searched_as_elasticsearch_does(tmp_path, monkeypatch, native):
    """Elasticsearch's standard tokenizer keeps one-character terms ("S", "D", "1"), and DRAGIN's published
    retrievals ranked passages by them; so do passages and queries here, on the native and the numpy path."""
    monkeypatch.setenv(NATIVE_ENV, native)
    r = BM25Retriever(_write_jsonl(tmp_path / "one.jsonl", _ONE_CHARACTER_DOCS), show_progress=False)
    assert r.analyze(["Acura Type S", "D-Day", "Route 1", "é ß ٣", "a"]) == [
        ["acura", "type", "s"], ["d", "day"], ["rout", "1"], ["é", "ß", "٣"], []]  # ("a": a stopword)
    got = r.search(["Acura Type S", "D-Day", "Route 1", "S", "1", "ß"], 3)
    for q, docs, want in zip(["Acura Type S", "D-Day", "Route 1"], got, ["s", "d", "r1"]):
        assert docs[0].id == want and docs[0].score > docs[1].score, (q, [(d.id, d.score) for d in docs])
    assert [[d.id for d in docs] for docs in got[3:]] == [["s"], ["r1"], ["x"]]


def test_an_index_of_the_two_character_analysis_is_built_again(tmp_path, monkeypatch):
    """An index saved before one-character terms were kept (format 2: `\\w\\w+` tokens) lacks them, while the queries
    now hold them: it is built again rather than searched."""
    from fastrag.retrieval import bm25, bm25_build

    corpus = _write_jsonl(tmp_path / "one.jsonl", _ONE_CHARACTER_DOCS)
    with monkeypatch.context() as m:  # (the build of format 2: its regex path, the scan being compiled in)
        m.setattr(bm25, "_FORMAT", 2)
        m.setattr(bm25_build, "_PASSAGE_TOKENS", re.compile(f"\\w\\w+|[{bm25_build._CJK}]"))
        m.setenv(NATIVE_ENV, "0")
        old = BM25Retriever(corpus, show_progress=False)
        assert old.built and old.search(["S"], 3) == [[]]
    del old
    r = BM25Retriever(corpus, show_progress=False)
    assert r.built and r.index_dir == corpus.with_name("one.jsonl.bm25s")
    assert [d.id for d in r.search(["S"], 3)[0]] == ["s"]
    assert json.loads((r.index_dir / "manifest.json").read_text())["format"] == bm25._FORMAT
    assert not BM25Retriever(corpus, show_progress=False).built  # (the new one is kept)


def test_index_persisted_next_to_corpus_and_reloaded(corpus):
    r1 = BM25Retriever(corpus, show_progress=False)
    assert r1.built and r1.index_dir == corpus.with_name("c.jsonl.bm25s")
    manifest = r1.index_dir / "manifest.json"
    m1 = manifest.stat().st_mtime_ns
    r2 = BM25Retriever(corpus, show_progress=False)
    assert not r2.built and manifest.stat().st_mtime_ns == m1
    assert r2.search(QUERIES, 5) == r1.search(QUERIES, 5)
    # a different b, then a different k1, is a different index
    assert BM25Retriever(corpus, b=0.5, show_progress=False).built
    assert BM25Retriever(corpus, b=0.5, k1=0.9, show_progress=False).built


@pytest.mark.parametrize("damaged", ["text/data.csc.index.npy", "docs.bin", "docs_offsets.npy"])
def test_a_damaged_saved_index_is_built_again(corpus, damaged):
    """A saved index whose file was cut short after its build (a full disk, a copy interrupted) is not trusted: a
    warning names the folder and the index is built again, with the same results."""
    r1 = BM25Retriever(corpus, show_progress=False)
    want = r1.search(QUERIES, 5)
    del r1
    f = corpus.with_name("c.jsonl.bm25s") / damaged
    f.write_bytes(f.read_bytes()[: max(1, f.stat().st_size // 2)])
    with pytest.warns(RuntimeWarning, match=r"c\.jsonl\.bm25s: saved BM25 index unreadable .*building it again"):
        r2 = BM25Retriever(corpus, show_progress=False)
    assert r2.built and r2.search(QUERIES, 5) == want
    assert not BM25Retriever(corpus, show_progress=False).built  # the rebuilt one is kept


def test_concurrent_builds_wait_and_reuse(corpus):
    """A second process that finds no index while another builds it waits for the build lock, then takes the
    finished index instead of rebuilding over it (two benchmarks started together once deleted each other's files).
    Here a thread plays the second process while this test holds the lock."""
    import threading

    from fastrag.retrieval.bm25 import _build_lock, build_in_first_writable

    r1 = BM25Retriever(corpus, show_progress=False)
    d = r1.index_dir
    manifest = json.loads((d / "manifest.json").read_text())
    manifest.pop("n_docs")
    saved = (d / "manifest.json").read_text()
    (d / "manifest.json").unlink()  # as if the first process were still building
    calls, out = [], []
    with _build_lock(d):
        t = threading.Thread(target=lambda: out.append(build_in_first_writable([d], calls.append, "BM25", manifest)))
        t.start()
        time.sleep(0.5)
        assert t.is_alive() and not calls  # blocked on the lock, not building
        (d / "manifest.json").write_text(saved)  # the first process finishes
    t.join(10)
    assert out == [d] and not calls  # took the finished index
    assert BM25Retriever(corpus, show_progress=False).search(QUERIES, 5) == r1.search(QUERIES, 5)
    # with no finished index behind the lock, the waiting process builds
    (d / "manifest.json").unlink()
    assert build_in_first_writable([d], calls.append, "BM25", manifest) == d and calls == [d]


def test_corpus_change_reindexes(corpus):
    r1 = BM25Retriever(corpus, show_progress=False)
    assert not any(d.id == "new" for d in r1.search(["zeppelin"], 3)[0])
    _write_jsonl(corpus, DOCS + [("new", "Zeppelin", "A zeppelin is an airship.")])
    r2 = BM25Retriever(corpus, show_progress=False)
    assert r2.built and r2.n_docs == len(DOCS) + 1
    assert r2.search(["zeppelin"], 3)[0][0].id == "new"


def test_a_rebuild_leaves_a_loaded_retriever_its_own_passages(tmp_path):
    """A retriever maps its index's files (a server, a long run); another process that rebuilds the index of the
    changed corpus in the same folder must not rewrite those files under it: it kept returning the new build's
    passages at the old build's offsets (an empty passage past the new end)."""
    path = tmp_path / "c.jsonl"
    old = [(f"d{i}", f"Title {i}", f"passage {i} about topic{i % 7}") for i in range(60)]
    _write_jsonl(path, old)
    r1 = BM25Retriever(path, show_progress=False)
    before = r1.search(["topic3 passage 10", "topic5 passage 54"], 2)
    assert [ds[0].id for ds in before] == ["d10", "d54"]
    _write_jsonl(path, [(f"x{i}", "T", "short") for i in range(5)])
    r2 = BM25Retriever(path, show_progress=False)
    assert r2.built and r2.index_dir == r1.index_dir and r2.n_docs == 5
    assert r1.search(["topic3 passage 10", "topic5 passage 54"], 2) == before


def test_corpus_replaced_with_same_size_and_time_reindexes(corpus):
    """`cp -p` / `rsync -a` of another corpus of the same byte size keeps size and mtime: the content decides."""
    r1 = BM25Retriever(corpus, show_progress=False)
    st = corpus.stat()
    body = corpus.read_text()
    swapped = body.replace("Berlin", "Zurich")  # same length
    assert swapped != body and len(swapped.encode()) == st.st_size
    corpus.write_text(swapped)
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert corpus.stat().st_size == st.st_size and corpus.stat().st_mtime_ns == st.st_mtime_ns
    r2 = BM25Retriever(corpus, show_progress=False)
    assert r2.built and r2.index_dir == r1.index_dir
    assert r2.search(["Zurich"], 1)[0] and "Zurich" in r2.search(["Zurich"], 1)[0][0].text


def test_corpus_fingerprint_samples_large_files(tmp_path):
    from fastrag.retrieval.corpus import corpus_fingerprint

    p = tmp_path / "big.jsonl"
    p.write_bytes(b"a" * 300_000)
    small = corpus_fingerprint(p, whole_below=1 << 20)
    sampled = corpus_fingerprint(p, whole_below=1000, blocks=4, block=1000)
    assert small.startswith("sha256:") and sampled.startswith("sha256-sampled-")
    with open(p, "r+b") as f:  # a change inside a sampled block (block 2 of 4 starts at 2 * 299000 // 4)
        f.seek(2 * 299_000 // 4 + 10)
        f.write(b"b")
    assert corpus_fingerprint(p, whole_below=1000, blocks=4, block=1000) != sampled
    assert corpus_fingerprint(p, whole_below=1 << 20) != small


def test_read_only_corpus_folder_falls_back_to_cache(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    corpus = _write_jsonl(ro / "c.jsonl", DOCS)
    monkeypatch.setenv("FASTRAG_CACHE", str(tmp_path / "cache"))
    os.chmod(ro, 0o555)
    try:
        r = BM25Retriever(corpus, show_progress=False)
        assert r.built and (tmp_path / "cache" / "indexes") in r.index_dir.parents
        assert not (ro / "c.jsonl.bm25s").exists()
        assert not BM25Retriever(corpus, show_progress=False).built
    finally:
        os.chmod(ro, 0o755)


def test_a_damaged_index_in_a_read_only_folder_is_replaced_from_the_cache(tmp_path, monkeypatch):
    """A damaged saved index next to a read-only corpus (a copy cut short on a shared, read-only mount): its
    manifest cannot be removed, and the run failed with "Read-only file system: .../manifest.json" after
    announcing a rebuild. It is built in $FASTRAG_CACHE instead, and later runs use that one."""
    ro = tmp_path / "ro"
    ro.mkdir()
    corpus = _write_jsonl(ro / "c.jsonl", DOCS)
    want = BM25Retriever(corpus, show_progress=False).search(QUERIES, 5)
    saved = ro / "c.jsonl.bm25s"
    (saved / "docs.bin").write_bytes(b"cut")
    monkeypatch.setenv("FASTRAG_CACHE", str(tmp_path / "cache"))
    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):  # (root may remove files from a mode-555 folder; the mount would refuse)
        if saved in self.parents:
            raise OSError(30, "Read-only file system", str(self))
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    os.chmod(saved, 0o555)
    os.chmod(ro, 0o555)
    try:
        with pytest.warns(RuntimeWarning, match=r"c\.jsonl\.bm25s: saved BM25 index unreadable .*building it again"):
            r = BM25Retriever(corpus, show_progress=False)
        assert r.built and (tmp_path / "cache" / "indexes") in r.index_dir.parents
        assert r.search(QUERIES, 5) == want
        with pytest.warns(RuntimeWarning, match=f"using the one in {r.index_dir}"):
            again = BM25Retriever(corpus, show_progress=False)
        assert not again.built and again.index_dir == r.index_dir
    finally:
        os.chmod(ro, 0o755)
        os.chmod(saved, 0o755)


# ---- corpus formats -----------------------------------------------------------------------------------


def test_contents_format(tmp_path):
    p = tmp_path / "f.jsonl"
    p.write_text(json.dumps({"id": "1", "contents": "Title One\nBody of one."}) + "\n\n"
                 + json.dumps({"id": 2, "contents": '"Quoted Title"\nBody two\nsecond line'}) + "\n"
                 + json.dumps({"id": 3, "contents": '"Heroes" (album)\nAn album.'}) + "\n")
    assert list(iter_corpus(p)) == [("1", "Title One", "Body of one."),
                                    ("2", "Quoted Title", "Body two\nsecond line"),
                                    ("3", '"Heroes" (album)', "An album.")]  # (quotes that do not wrap it stay)
    r = BM25Retriever(p, show_progress=False)
    assert r.search(["quoted"], 1)[0][0] == Doc("2", "Quoted Title", "Body two\nsecond line",
                                                r.search(["quoted"], 1)[0][0].score)


def test_beir_corpus_with_underscore_ids(tmp_path):
    """BEIR's corpus.jsonl: {_id, title, text, metadata}; `id` wins when a line has both; a repeated _id and a line
    with neither are named."""
    p = tmp_path / "corpus.jsonl"
    p.write_text(json.dumps({"_id": "doc0", "title": "Berlin", "text": "Berlin is the capital of Germany.",
                             "metadata": {"url": "u"}}) + "\n"
                 + json.dumps({"_id": 7, "title": "", "text": "Paris is the capital of France."}) + "\n"
                 + json.dumps({"id": "x", "_id": "y", "title": "T", "text": "both ids"}) + "\n")
    assert list(iter_corpus(p)) == [("doc0", "Berlin", "Berlin is the capital of Germany."),
                                    ("7", "", "Paris is the capital of France."), ("x", "T", "both ids")]
    r = BM25Retriever(p, show_progress=False)
    assert [d.id for d in r.search(["capital of Germany"], 1)[0]] == ["doc0"]
    for content, match in (
        ('{"_id": "a", "text": "x"}\n{"_id": "a", "text": "y"}\n', r"b\.jsonl:2: field 'id': passage id 'a' repeats "
                                                                   r"line 1"),
        ('{"_id": null, "text": "x"}\n', r"b\.jsonl:1: field '_id' must be a string or an integer, got NoneType"),
        ('{"title": "t", "text": "x"}\n', r"b\.jsonl:1: missing field 'id' \(or BEIR's '_id'\)"),
    ):
        (tmp_path / "b.jsonl").write_text(content)
        with pytest.raises(CorpusError, match=match):
            list(iter_corpus(tmp_path / "b.jsonl"))


def test_dpr_tsv_format(tmp_path):
    p = tmp_path / "psgs.tsv"
    p.write_text('id\ttext\ttitle\n1\t"Aaron ( or ; ""Ahärôn"") is a prophet"\tAaron\n2\tMoses led them.\tMoses\n')
    assert list(iter_corpus(p)) == [("1", "Aaron", 'Aaron ( or ; "Ahärôn") is a prophet'), ("2", "Moses", "Moses led them.")]
    r = BM25Retriever(p, show_progress=False)
    assert [d.id for d in r.search(["prophet", "moses"], 2)[0]] == ["1"]


def test_tsv_quotes_that_are_not_csv_quoting_are_text(tmp_path):
    """One passage per line whatever its quotes: a field that only starts with a quoted phrase keeps its quotes, and
    a quote never closed neither eats the lines after it nor moves their titles; csv quoting (a tab inside, ""
    escapes) is still read."""
    p = tmp_path / "q.tsv"
    p.write_text('id\ttext\ttitle\r\n'
                 'p1\t"To be or not to be" opens a soliloquy.\tHamlet\r\n'
                 'p2\t"Star Wars is a 1977 film.\tStar Wars\n'
                 'p3\tThe Godfather is a 1972 film.\tThe Godfather\n'
                 'p4\tCasablanca is called "the best" film.\t"Casablanca"\n'
                 'p5\t"a\tb ""c"""\tT\n')
    assert list(iter_corpus(p)) == [
        ("p1", "Hamlet", '"To be or not to be" opens a soliloquy.'),
        ("p2", "Star Wars", '"Star Wars is a 1977 film.'),
        ("p3", "The Godfather", "The Godfather is a 1972 film."),
        ("p4", "Casablanca", 'Casablanca is called "the best" film.'),
        ("p5", "T", 'a\tb "c"'),
    ]


def test_contents_without_a_title_line_is_text(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"id": "c1", "contents": "Jaws is a 1975 film by Steven Spielberg."}) + "\n")
    assert list(iter_corpus(p)) == [("c1", "", "Jaws is a 1975 film by Steven Spielberg.")]


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("bad.jsonl", '{"id": "1", "title": "t", "text": "x"}\n{"id": 2, "title": \n', r"bad\.jsonl:2: malformed JSON"),
        ("nf.jsonl", '{"id": "1", "title": "t"}\n', r"nf\.jsonl:1: missing field 'text'"),
        ("ni.jsonl", '\n{"title": "t", "text": "x"}\n', r"ni\.jsonl:2: missing field 'id'"),
        ("ty.jsonl", '{"id": "1", "title": 3, "text": "x"}\n', r"ty\.jsonl:1: field 'title' must be a string"),
        ("arr.jsonl", '[1, 2]\n', r"arr\.jsonl:1: expected a JSON object"),
        ("h.tsv", "id\ttext\n1\tx\n", r"h\.tsv:1: tsv header lacks column 'title'"),
        ("k2.jsonl", '{"id": "1", "text": "a"}\n{"id": "x", "id": "y", "text": "b"}\n',
         r"k2\.jsonl:2: the key 'id' is given twice in one object"),
        ("h2.tsv", "id\ttext\ttitle\t text\n1\tx\tT\ty\n",
         r"h2\.tsv:1: tsv header names a column more than once: \['text'\]"),
        ("w.tsv", "id\ttext\ttitle\n1\tx\tT\n2\ty\n", r"w\.tsv:3: expected 3 tab-separated fields, got 2"),
        ("c.csv", "id,text\n", r"unsupported corpus format"),
        ("d.jsonl", '{"id": "1", "text": "a"}\n\n{"id": 1, "text": "b"}\n',
         r"d\.jsonl:3: field 'id': passage id '1' repeats line 1"),
        ("d.tsv", "id\ttext\ttitle\n7\tx\tT\n8\ty\tU\n7\tz\tV\n", r"d\.tsv:4: field 'id': passage id '7' repeats line 2"),
    ],
)
def test_bad_corpus_files(tmp_path, name, content, match):
    p = tmp_path / name
    p.write_text(content)
    with pytest.raises(CorpusError, match=match):
        list(iter_corpus(p))


def test_missing_empty_and_binary_corpus(tmp_path):
    with pytest.raises(CorpusError, match="corpus file not found"):
        iter_corpus(tmp_path / "nope.jsonl")
    with pytest.raises(CorpusError, match="corpus file not found"):
        BM25Retriever(tmp_path / "nope.jsonl")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(CorpusError, match="no passages"):
        BM25Retriever(tmp_path / "e.jsonl", show_progress=False)
    (tmp_path / "b.jsonl").write_bytes(b'{"id": "1", "text": "ok"}\n\xff\xfe\n')
    with pytest.raises(CorpusError, match="not valid UTF-8"):
        list(iter_corpus(tmp_path / "b.jsonl"))


@pytest.mark.parametrize("suffix,newline", [(".jsonl", b"\n"), (".tsv", b"\r\n")])
def test_a_byte_that_is_not_utf8_is_named_at_its_own_line(tmp_path, suffix, newline):
    """The error names the line that holds the bad byte, not the line after the last one read (the text reader
    decodes 8 KiB ahead of the lines it has handed out: with short lines, hundreds of lines earlier)."""
    if suffix == ".tsv":
        lines = [b"id\ttext\ttitle"] + [b"p%d\tpassage number %d on a topic\tT%d" % (i, i, i) for i in range(499)]
    else:
        lines = [json.dumps({"id": f"p{i}", "title": f"T{i}", "text": f"passage number {i} on a topic"}).encode()
                 for i in range(500)]
    lines[299] = lines[299].replace(b"topic", b"top\xe9c")  # latin-1, line 300
    path = tmp_path / f"c{suffix}"
    path.write_bytes(newline.join(lines) + newline)
    with pytest.raises(CorpusError, match=r"c\.(jsonl|tsv):300: not valid UTF-8 .*byte 0xe9"):
        list(iter_corpus(path))


@pytest.mark.parametrize("field", ["id", "title", "text", "contents"])
def test_a_lone_surrogate_in_a_jsonl_corpus_is_named(tmp_path, field):
    """A "\\ud800" escape decodes to a lone surrogate, which has no UTF-8: the index build died on a bare
    UnicodeEncodeError ("'utf-8' codec can't encode character ...") naming neither the file nor the line."""
    rec = {"id": "p2", "title": "T", "text": "ok"} if field != "contents" else {"id": "p2", "contents": "T\nok"}
    rec[field] += " \ud800"  # (contents: at the end of its text)
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": "p1", "title": "A", "text": "fine"}) + "\n" + json.dumps(rec) + "\n")
    where = "text" if field == "contents" else field
    with pytest.raises(CorpusError, match=rf"c\.jsonl:2: field '{where}' holds a lone surrogate \(U\+D800"):
        list(iter_corpus(path))
    with pytest.raises(CorpusError, match=r"c\.jsonl:2: .*lone surrogate"):
        BM25Retriever(path, show_progress=False)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["c.jsonl"]


@pytest.mark.parametrize("indent", [None, 1])
def test_a_json_array_corpus_is_told_to_be_json_lines(tmp_path, indent):
    """A .json corpus written as one array (a data file may be one) was "malformed JSON (Expecting value)" at line 1
    when pretty-printed, "expected a JSON object, got list" on one line: neither says that a corpus is JSON Lines."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps([{"id": "a", "title": "T", "text": "x"}], indent=indent) + "\n")
    with pytest.raises(CorpusError, match=r"c\.json:1: a JSON array; a corpus is JSON Lines"):
        list(iter_corpus(path))


def test_a_failed_index_build_leaves_no_folder(tmp_path):
    """A corpus error found while the index is built (a repeated id) leaves no half-written index folder that the
    build created; an index folder that was there before stays."""
    bad = tmp_path / "dup.jsonl"
    bad.write_text('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n')
    with pytest.raises(CorpusError, match="repeats line 1"):
        BM25Retriever(bad, show_progress=False)
    assert not (tmp_path / "dup.jsonl.bm25s").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dup.jsonl"]
    (tmp_path / "dup.jsonl.bm25s").mkdir()
    with pytest.raises(CorpusError, match="repeats line 1"):
        BM25Retriever(bad, show_progress=False)
    assert (tmp_path / "dup.jsonl.bm25s").is_dir()


class _FakeES:
    """The few Elasticsearch calls ElasticRetriever makes, over in-memory indexes {name: {id: source}}."""

    def __init__(self):
        self.indexes: dict[str, dict] = {}
        es = self

        class Indices:
            def exists(self, index):
                return index in es.indexes

            def create(self, index, mappings):
                es.indexes[index] = {}

            def refresh(self, index):
                pass

            def delete(self, index, ignore_unavailable=False):
                es.indexes.pop(index, None)

        self.indices = Indices()

    def count(self, index):
        return {"count": len(self.indexes[index])}


def test_a_failed_elasticsearch_load_leaves_no_index(tmp_path, monkeypatch):
    """An Elasticsearch index is found by its name alone: one that a load left half-filled (a corpus error on a
    later line) would be searched as the whole corpus by the next run, so the failed load deletes it, and the run
    after the corpus is corrected loads every passage."""
    pytest.importorskip("elasticsearch")
    from elasticsearch import helpers

    from fastrag.retrieval import elastic

    server = _FakeES()
    monkeypatch.setattr(elastic, "_client", lambda url, timeout: server)

    def bulk(es, actions, chunk_size, raise_on_error):  # (each passage stored as it is read)
        n = 0
        for a in actions:
            es.indexes[a["_index"]][a["_id"]] = a["_source"]
            n += 1
        return n, []

    monkeypatch.setattr(helpers, "bulk", bulk)
    path = tmp_path / "c.jsonl"
    rows = [{"id": str(i), "title": f"T{i}", "text": f"passage {i}"} for i in range(5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + [rows[0]]))  # line 6 repeats line 1's id
    with pytest.raises(CorpusError, match="repeats line 1"):
        elastic.ElasticRetriever("http://es", "wiki", corpus_path=path, show_progress=False)
    assert "wiki" not in server.indexes
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = elastic.ElasticRetriever("http://es", "wiki", corpus_path=path, show_progress=False)
    assert r.built and r.n_docs == len(rows) == len(server.indexes["wiki"])


def test_fastrag_index_interrupted_says_so_and_keeps_no_index(tmp_path, monkeypatch, capsys):
    """Ctrl-C during `fastrag index` printed a traceback of every frame down to the tokenizer; it says what
    happened instead (exit 130, as `fastrag run` does), and no half-built index is left to be trusted."""
    from fastrag.cli import main
    from fastrag.retrieval import bm25

    path = _write_jsonl(tmp_path / "c.jsonl", DOCS)

    def rows(p):
        yield from list(iter_corpus(p))[:3]
        raise KeyboardInterrupt

    monkeypatch.setattr(bm25, "iter_corpus", rows)
    try:
        rc = main(["index", "--corpus", str(path), "--no-progress"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C left `fastrag index` as a traceback")
    assert rc == 130
    assert "interrupted while making the bm25 index" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]
    monkeypatch.undo()
    assert main(["index", "--corpus", str(path), "--no-progress"]) == 0
    assert f"bm25: {len(DOCS)} passages, index built" in capsys.readouterr().out


# ---- the real corpus ----------------------------------------------------------------------------------

DATA = Path("/work/shared/data")


@pytest.mark.skipif(not (DATA / "corpus" / "wiki_passages.jsonl").exists(), reason="shared data absent")
def test_real_corpus_gold_in_top10(tmp_path_factory):
    corpus = DATA / "corpus" / "wiki_passages.jsonl"
    r = BM25Retriever(corpus, index_dir=tmp_path_factory.mktemp("wiki_idx"), show_progress=False)
    assert r.n_docs == sum(1 for _ in iter_corpus(corpus))
    gold: dict[str, set[str]] = {}
    for line in (DATA / "corpus" / "qrels_dev.tsv").read_text().splitlines()[1:]:
        ds, qid, pid = line.split("\t")
        if ds == "hotpotqa":
            gold.setdefault(qid, set()).add(pid)
    questions = []
    with open(DATA / "hotpotqa" / "dev_distractor_200.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            if rec["question_id"] in gold:
                questions.append((rec["question_text"], gold[rec["question_id"]]))
            if len(questions) == 64:
                break
    first_q, first_gold = questions[0]
    top = r.search([first_q], 10)[0]
    assert first_gold & {d.id for d in top}, f"{first_q!r}: gold {first_gold} not in {[d.id for d in top]}"

    t0 = time.perf_counter()
    res = r.search([q for q, _ in questions], 10)
    dt = time.perf_counter() - t0
    hits = sum(bool(g & {d.id for d in docs}) for (_, g), docs in zip(questions, res))
    print(f"\nBM25 {r.n_docs} passages: 64 queries in {dt * 1e3:.1f} ms ({dt / 64 * 1e3:.2f} ms/query); "
          f"any-gold@10 = {hits}/64")
    assert res[0] == top


def test_chinese_text_is_searchable_character_by_character(tmp_path):
    """Han text has no spaces: as Elasticsearch's standard tokenizer does, each ideograph is a term (a `\\w+`
    token would be a whole clause that no query repeats); Latin text is analysed as before beside it."""
    p = tmp_path / "zh.jsonl"
    p.write_text("\n".join(json.dumps(d, ensure_ascii=False) for d in [
        {"id": "z1", "title": "月球", "text": "阿波罗17号是最后一次载人登月任务，于1972年12月。"},
        {"id": "z2", "title": "长城", "text": "长城是中国古代的军事防御工程。"},
        {"id": "e1", "title": "Moon landing", "text": "Apollo 17 was the last crewed mission to the Moon, in 1972."},
    ]) + "\n", encoding="utf-8")
    r = BM25Retriever(p, show_progress=False)
    got = r.search(["阿波罗17号 登月", "长城", "中国的防御", "Apollo Moon mission"], 2)
    assert [d.id for d in got[0]][0] == "z1" and [d.id for d in got[1]] == ["z2"]
    assert got[2][0].id == "z2" and got[3][0].id == "e1"
    assert r.analyze(["登月 Apollo"]) == [["登", "月", "apollo"]]


@pytest.mark.parametrize("where", ["text", "title"])
def test_a_lone_carriage_return_in_a_tsv_passage_is_named(tmp_path, where):
    """A "\\r" not followed by "\\n" ends a line (as csv readers read it): the passage that holds one splits in two
    and the field count is wrong on its line or on the next; the error says why instead of only counting fields."""
    row = "p2\tsecond\rpassage\tSecond" if where == "text" else "p2\tsecond passage\tSec\rond"
    p = tmp_path / "cr.tsv"
    p.write_bytes(f"id\ttext\ttitle\np1\tfirst passage\tFirst\n{row}\np3\tthird\tThird\n".encode())
    line = 3 if where == "text" else 4  # (the half before a "\r" in the title still has its 3 fields)
    with pytest.raises(CorpusError, match=rf"cr\.tsv:{line}: expected 3 tab-separated fields, got \d .*carriage "
                                          r"return '\\r' not followed by '\\n'"):
        list(iter_corpus(p))
    # the same passage with the "\r" replaced reads, and a file whose lines end in "\r\n" gets no such hint
    p.write_bytes(f"id\ttext\ttitle\r\np1\tfirst passage\tFirst\r\n{row.replace(chr(13), ' ')}\r\n".encode())
    assert [doc_id for doc_id, _, _ in iter_corpus(p)] == ["p1", "p2"]
    p.write_bytes(b"id\ttext\ttitle\r\np1\tfirst passage\r\n")
    with pytest.raises(CorpusError, match=r"cr\.tsv:2: expected 3 tab-separated fields, got 2$"):
        list(iter_corpus(p))


def test_a_lone_carriage_return_in_a_jsonl_passage_is_named(tmp_path):
    p = tmp_path / "cr.jsonl"
    p.write_bytes(b'{"id": "p1", "text": "first"}\n{"id": "p2", "text": "sec\rond"}\n')
    with pytest.raises(CorpusError, match=r"cr\.jsonl:2: malformed JSON \(.*\) \(this line ends at "
                                          r"a carriage return .*write it as the escape \\r\)$"):
        list(iter_corpus(p))
    p.write_bytes(b'{"id": "p1", "text": "first"}\n{"id": "p2", "text": "sec\\rond"}\r\n')  # (an escaped \r is text)
    assert [text for _, _, text in iter_corpus(p)] == ["first", "sec\rond"]
