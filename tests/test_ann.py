"""Approximate dense indexes (fastrag.retrieval.ann): recall against exact search on a small clustered set, the
options' validation, and the dense retriever's index folders (a changed build option rebuilds, a search option
does not)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fastrag.retrieval.ann import AnnOptions, auto_m, auto_nlist, build_index, parse_option, recall_vs_exact, resolved

faiss = pytest.importorskip("faiss")


def clustered(n=3000, dim=32, clusters=30, spread=0.8, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    x = centres[rng.integers(clusters, size=n)] + rng.standard_normal((n, dim)).astype(np.float32) * spread / dim ** .5
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def data():
    emb = clustered()
    rng = np.random.default_rng(1)
    q = emb[rng.choice(len(emb), 200, replace=False)] + rng.standard_normal((200, emb.shape[1])).astype(np.float32) * .05
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    exact = faiss.IndexFlatIP(emb.shape[1])
    exact.add(emb)
    return emb, np.ascontiguousarray(q, dtype=np.float32), exact.search(q, 10)[1]


def recall(index, q, want):
    got = index.search(q, 10)[1]
    return np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got.tolist(), want.tolist())])


def test_flat_is_exact_and_every_ann_type_recalls_most_of_it(data):
    emb, q, want = data
    assert recall(build_index(emb, AnnOptions()), q, want) == 1.0
    ivf = recall(build_index(emb, AnnOptions.of("ivf", nlist=30, nprobe=8)), q, want)
    hnsw = recall(build_index(emb, AnnOptions.of("hnsw", M=16, ef_search=64)), q, want)
    pq = recall(build_index(emb, AnnOptions.of("ivfpq", nlist=30, nprobe=8, m=8, nbits=6)), q, want)
    assert ivf >= 0.9 and hnsw >= 0.95 and pq >= 0.4, (ivf, hnsw, pq)
    assert pq < 1.0  # (codes lose something: the comparison has teeth)


def test_search_options_trade_recall(data):
    emb, q, want = data
    index = build_index(emb, AnnOptions.of("ivf", nlist=30, nprobe=1))
    one = recall(index, q, want)
    index.nprobe = 30  # every list visited: exact again
    assert one < 0.95 and recall(index, q, want) == 1.0
    h = build_index(emb, AnnOptions.of("hnsw", M=4, ef_construction=8, ef_search=1))
    low = recall(h, q, want)
    h.hnsw.efSearch = 256
    assert low < recall(h, q, want)


def test_recall_vs_exact_of_the_build(data):
    emb = data[0]
    assert recall_vs_exact(build_index(emb, AnnOptions()), emb, k=10, queries=50) == 1.0
    r = recall_vs_exact(build_index(emb, AnnOptions.of("ivf", nlist=30, nprobe=1)), emb, k=10, queries=100)
    assert 0.0 < r < 1.0


def test_defaults_and_resolved_options():
    assert AnnOptions().build_key() == {"index": "flat"} and AnnOptions().search_params() == {}
    o = AnnOptions.of("ivfpq")
    assert (o.nprobe, o.nbits, o.m, o.M, o.ef_search) == (16, 8, None, None, None)
    assert resolved(o, 1_000_000, 384) == {"index": "ivfpq", "nlist": 1000, "m": 48, "nbits": 8}
    assert auto_nlist(100) == 2 and auto_nlist(10) == 1 and auto_m(768) == 96 and auto_m(100) == 10
    assert AnnOptions.of("hnsw").build_key() == {"index": "hnsw", "M": 32, "ef_construction": 40}
    assert AnnOptions.of("hnsw").search_params() == {"ef_search": 64}


@pytest.mark.parametrize("kw, message", [
    ({"index": "annoy"}, "index 'annoy': expected one of flat, ivf, hnsw, ivfpq"),
    ({"index": "ivf", "M": 8}, r"option M=8 does not apply to index 'ivf' \(it takes nlist, nprobe\)"),
    ({"index": "flat", "nprobe": 4}, "option nprobe=4 does not apply to index 'flat' .it takes no options"),
    ({"index": "hnsw", "ef_search": 0}, "option ef_search must be an integer >= 1, got 0"),
    ({"index": "ivf", "nlist": 2.5}, "option nlist must be an integer >= 1, got 2.5"),
    ({"index": "ivf", "nprobe": True}, "option nprobe must be an integer >= 1, got True"),
    ({"index": "ivfpq", "nbits": 17}, "option nbits must be between 1 and 16, got 17"),
    ({"index": "ivf", "nprob": 3}, "unknown dense index option 'nprob'"),
])
def test_bad_options_name_the_option(kw, message):
    with pytest.raises(ValueError, match=message):
        AnnOptions.of(**kw)


def test_options_the_data_cannot_take(data):
    emb = data[0][:500]
    with pytest.raises(ValueError, match="option m=7 must divide the embedding dimension 32"):
        build_index(emb, AnnOptions.of("ivfpq", m=7))
    with pytest.raises(ValueError, match="option nlist=600 exceeds the 500 passages"):
        build_index(emb, AnnOptions.of("ivf", nlist=600))
    with pytest.raises(ValueError, match="option nbits=10: ivfpq trains 1024 centroids .* the 500 passages"):
        build_index(emb, AnnOptions.of("ivfpq", nlist=4, nbits=10, m=8))


def test_command_line_options():
    assert parse_option("nprobe=32") == ("nprobe", 32) and parse_option(" M = 8") == ("M", 8)
    with pytest.raises(ValueError, match="index option 'nprobe': expected NAME=VALUE"):
        parse_option("nprobe")
    with pytest.raises(ValueError, match="index option nprobe: expected an integer, got 'many'"):
        parse_option("nprobe=many")


def test_dense_spec_and_run_options_check_the_options():
    from fastrag.eval import RunOptions
    from fastrag.specs import Dense, retriever_spec

    assert Dense(index="hnsw", M=8) == retriever_spec("dense", None, index="hnsw", M=8)
    assert Dense(index="hnsw", M=8) != Dense(index="hnsw", M=16)
    with pytest.raises(ValueError, match="option nprobe=4 does not apply to index 'hnsw'"):
        Dense(index="hnsw", nprobe=4)
    with pytest.raises(ValueError, match="apply to --retriever dense, not bm25"):
        RunOptions(method="wo-rag", dataset="hotpotqa", data=None, corpus=None, output=None, write=False,
                   retriever_options={"index": "ivf"})
    with pytest.raises(ValueError, match="option ef_search must be an integer >= 1"):
        RunOptions(method="wo-rag", dataset="hotpotqa", data=None, corpus=None, output=None, write=False,
                   retriever="dense", retriever_options={"index": "hnsw", "ef_search": -1})


# ---- the dense retriever's approximate indexes (the embedded encoder) ----

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    pytest.importorskip("sentence_transformers")
    from fastrag.eval import BUNDLED

    d = tmp_path_factory.mktemp("ann")
    lines = (BUNDLED / "wiki_passages.jsonl").read_text(encoding="utf-8").splitlines()[:160]
    p = d / "corpus.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p, [json.loads(x) for x in lines]


def test_a_changed_build_option_rebuilds_and_a_search_option_does_not(corpus):
    from fastrag.retrieval.dense import DenseRetriever

    p, docs = corpus
    flat = DenseRetriever(p, show_progress=False)
    a = DenseRetriever(p, show_progress=False, index="ivf", nlist=4, nprobe=1)
    assert a.built and a.index_dir != flat.index_dir and a.index_dir.name.endswith("-ivf")
    manifest = json.loads((a.index_dir / "manifest.json").read_text())
    assert manifest["kind"] == "dense-ivf-ip" and manifest["ann"] == {"index": "ivf", "nlist": 4}
    assert "ann" not in json.loads((flat.index_dir / "manifest.json").read_text())  # (exact: as before options)
    assert 0.0 < a.ann_recall <= 1.0 and a.index.nprobe == 1
    b = DenseRetriever(p, show_progress=False, index="ivf", nlist=4, nprobe=4)  # search option: same index
    assert not b.built and b.index.nprobe == 4 and b.ann_recall == a.ann_recall
    qs = [d["text"][:120] for d in docs[:10]]
    assert [[d.id for d in r] for r in b.search(qs, 5)] == [[d.id for d in r] for r in flat.search(qs, 5)]
    c = DenseRetriever(p, show_progress=False, index="ivf", nlist=8, nprobe=4)  # build option: built again
    assert c.built and c.index_dir == a.index_dir and c.index.nlist == 8
    assert not DenseRetriever(p, show_progress=False).built  # (the exact index untouched)
    h = DenseRetriever(p, show_progress=False, index="hnsw", M=8, ef_search=200)
    assert h.built and h.index.hnsw.efSearch == 200 and h.ann_recall > 0.9
    assert not DenseRetriever(p, show_progress=False, index="hnsw", M=8, ef_search=16).built
    assert DenseRetriever(p, show_progress=False, index="hnsw", M=12).built


def test_fastrag_index_cli_takes_the_index_options(tmp_path, corpus, capsys):
    from fastrag.cli import main

    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(json.dumps(d) for d in corpus[1][:60]) + "\n", encoding="utf-8")
    args = ["index", "--corpus", str(p), "--kind", "dense", "--no-progress", "--dense-index", "ivf"]
    assert main(args + ["--index-option", "nlist=2"]) == 0
    out = capsys.readouterr().out
    assert "dense: 60 passages, index built" in out and "recall@10 against exact search" in out
    assert main(args + ["--index-option", "nlist=2", "--index-option", "nprobe=2"]) == 0
    assert "already up to date" in capsys.readouterr().out
    assert main(args + ["--index-option", "M=2"]) == 2
    assert "option M=2 does not apply to index 'ivf'" in capsys.readouterr().err
