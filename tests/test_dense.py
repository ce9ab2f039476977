"""Dense retrieval (faiss + the embedded all-MiniLM-L6-v2): index build/reload, exact top-k, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fastrag.eval import BUNDLED
from fastrag.retrieval import make_retriever
from fastrag.retrieval.dense import DenseRetriever, passage_text


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("dense")
    lines = (BUNDLED / "wiki_passages.jsonl").read_text(encoding="utf-8").splitlines()[:240]
    p = d / "corpus.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p, [json.loads(x) for x in lines]


@pytest.fixture(scope="module")
def retriever(small_corpus):
    return DenseRetriever(small_corpus[0], show_progress=False)


def test_index_is_saved_and_reloaded(small_corpus, retriever):
    assert retriever.built and retriever.n_docs == len(small_corpus[1])
    assert (retriever.index_dir / "manifest.json").is_file() and (retriever.index_dir / "index.faiss").is_file()
    again = make_retriever("dense", corpus_path=small_corpus[0], show_progress=False)
    assert not again.built and again.index_dir == retriever.index_dir
    q = [small_corpus[1][7]["text"][:200]]
    assert [d.id for d in again.search(q, 5)[0]] == [d.id for d in retriever.search(q, 5)[0]]


def test_top_k_equals_brute_force_cosine(small_corpus, retriever):
    docs = small_corpus[1]
    emb = retriever.encode([passage_text(d["title"], d["text"]) for d in docs])
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-4)
    rng = np.random.default_rng(0)
    queries = [docs[i]["title"] + " " + " ".join(docs[i]["text"].split()[:8]) for i in rng.choice(len(docs), 12)]
    got = retriever.search(queries, 3)
    sims = retriever.encode(queries) @ emb.T
    for row, res in zip(sims, got):
        assert len(res) == 3
        order = np.argsort(-row, kind="stable")[:3]
        assert [d.id for d in res] == [docs[i]["id"] for i in order]
        np.testing.assert_allclose([d.score for d in res], row[order], atol=1e-4)


def test_a_passage_finds_itself(small_corpus, retriever):
    docs = small_corpus[1]
    for i in (3, 100, 230):
        top = retriever.search([passage_text(docs[i]["title"], docs[i]["text"])], 1)[0]
        assert top[0].id == docs[i]["id"] and top[0].score > 0.99


def test_blank_queries_and_bad_arguments(small_corpus, retriever):
    res = retriever.search(["", "   ", "Who wrote the novel?"], 2)
    assert res[0] == [] and res[1] == [] and len(res[2]) == 2
    with pytest.raises(ValueError, match="k must be a positive integer"):
        retriever.search(["x"], 0)
    with pytest.raises(TypeError, match="list of strings"):
        retriever.search("a bare string", 2)
    with pytest.raises(FileNotFoundError, match="dense encoder"):
        DenseRetriever(small_corpus[0], encoder="no-such-encoder")


def test_blank_passages_are_never_hits(tmp_path, small_corpus):
    """Passages with neither title nor text (the corpus allows them) are no answer to any query: even a query the
    encoder places nearest to the empty string, and a k larger than the real passages, returns real passages only,
    in brute-force cosine order, k of them when there are k."""
    docs = small_corpus[1][:12]
    rows = [dict(d) for d in docs]
    for i in (2, 5, 9):
        rows[i] = {"id": f"blank{i}", "title": "", "text": "  "}
    p = tmp_path / "with_blanks.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    r = DenseRetriever(p, show_progress=False, index_dir=tmp_path / "idx")
    assert r.n_blank == 3
    real = [x for x in rows if x["title"] or x["text"].strip()]
    emb = r.encode([passage_text(x["title"], x["text"]) for x in real])
    empty_like = ["", "the", "  a  "]  # ("" itself is a blank query: [])
    for k in (20, 8, 4):  # (blank passages, zero vectors, outrank the real ones that a query scores below 0)
        for q, res in zip(empty_like, r.search(empty_like, k)):
            if not q.strip():
                assert res == []
                continue
            assert not any(d.id.startswith("blank") for d in res), [d.id for d in res]
            order = np.argsort(-(r.encode([q])[0] @ emb.T), kind="stable")
            assert [d.id for d in res] == [real[i]["id"] for i in order][:k]
    again = DenseRetriever(p, show_progress=False, index_dir=tmp_path / "idx")  # reloaded: its count saved with the index
    assert not again.built and again.n_blank == 3


def test_changed_corpus_is_reindexed(tmp_path, small_corpus):
    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(json.dumps(d) for d in small_corpus[1][:20]) + "\n", encoding="utf-8")
    a = DenseRetriever(p, show_progress=False)
    assert a.built and a.n_docs == 20
    with open(p, "a", encoding="utf-8") as f:
        f.write(json.dumps({"id": "new1", "title": "Zanzibar", "text": "Zanzibar is an archipelago."}) + "\n")
    b = DenseRetriever(p, show_progress=False)
    assert b.built and b.n_docs == 21
    assert b.search(["Zanzibar is an archipelago."], 1)[0][0].id == "new1"


def test_an_encoder_changed_in_place_reindexes(tmp_path, small_corpus):
    """Weights fine-tuned (or replaced) in the encoder's folder keep its path and config.json: the saved index
    held the old model's embeddings, searched with the new model's queries (a passage's stored vector and its
    fresh encoding had cosine 0.2)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from fastrag.retrieval.dense import resolve_encoder

    enc = tmp_path / "encoder"
    shutil.copytree(resolve_encoder("all-minilm-l6-v2"), enc)
    p = tmp_path / "c.jsonl"
    docs = small_corpus[1][:8]
    p.write_text("\n".join(json.dumps(d) for d in docs) + "\n", encoding="utf-8")
    a = DenseRetriever(p, encoder=str(enc), show_progress=False)
    assert a.built and not DenseRetriever(p, encoder=str(enc), show_progress=False).built
    weights = next(enc.glob("*.safetensors"))
    w = load_file(weights)
    gen = torch.Generator().manual_seed(0)
    for name, t in w.items():
        if t.is_floating_point() and t.dim() == 2:
            w[name] = t + 0.5 * t.std() * torch.randn(t.shape, generator=gen, dtype=t.dtype)
    save_file(w, weights, metadata={"format": "pt"})
    b = DenseRetriever(p, encoder=str(enc), show_progress=False)
    assert b.built and b.index_dir == a.index_dir
    fresh = b.encode([passage_text(d["title"], d["text"]) for d in docs])
    stored = np.stack([b.index.reconstruct(i) for i in range(len(docs))])
    np.testing.assert_allclose(np.sum(fresh * stored, axis=1), 1.0, atol=1e-4)


def test_a_damaged_saved_index_is_built_again(tmp_path, small_corpus):
    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(json.dumps(d) for d in small_corpus[1][:20]) + "\n", encoding="utf-8")
    a = DenseRetriever(p, show_progress=False)
    q = [small_corpus[1][3]["text"][:200]]
    want = [d.id for d in a.search(q, 5)[0]]
    f = a.index_dir / "index.faiss"
    f.write_bytes(f.read_bytes()[:100])  # cut short after the build
    with pytest.warns(RuntimeWarning, match="saved dense index unreadable .*building it again"):
        b = DenseRetriever(p, show_progress=False)
    assert b.built and [d.id for d in b.search(q, 5)[0]] == want


def test_fastrag_index_cli_builds_both(tmp_path, small_corpus, capsys):
    from fastrag.cli import main

    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(json.dumps(d) for d in small_corpus[1][:30]) + "\n", encoding="utf-8")
    assert main(["index", "--corpus", str(p), "--kind", "bm25", "dense", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "Loading" not in err and "it/s" not in err  # --no-progress: no bar, transformers' loading bar included
    assert "bm25: 30 passages, index built" in out and "dense: 30 passages, index built" in out
    assert main(["index", "--corpus", str(p), "--kind", "dense", "--no-progress"]) == 0
    assert "already up to date" in capsys.readouterr().out
    assert main(["index", "--corpus", str(tmp_path / "missing.jsonl"), "--kind", "dense"]) == 2
