"""Retrieval metrics (fastrag.data.evidence): gold titles of each dataset shape, recall@k / precision@k by hand,
and metrics.json's retrieval_quality block from summarize."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastrag.data.datasets import Example, load_examples
from fastrag.data.evidence import corpus_titles, gold_titles, retrieval_quality, retrieved_ids, scores
from fastrag.eval.report import summarize
from fastrag.trace import BeamNode, QuestionResult, Round

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def test_gold_titles_of_each_shape():
    assert gold_titles({"supporting_facts": [["A", 0], ["B", 2], ["A", 1]]}) == ["A", "B"]
    assert gold_titles({"contexts": [{"title": "X", "is_supporting": False}, {"title": "Y", "is_supporting": True}]}) \
        == ["Y"]
    flash = {"metadata": {"supporting_facts": {"title": ["Paris ", "Seine"], "sent_id": [0, 1]}, "level": "hard"}}
    assert gold_titles(flash) == ["Paris", "Seine"]
    musique = {"metadata": {"paragraphs": [{"idx": 0, "title": "T1", "is_supporting": True},
                                           {"idx": 1, "title": "T2", "is_supporting": False}]}}
    assert gold_titles(musique) == ["T1"]
    assert gold_titles({"answer_id": "Q1", "metadata": {"choices": ["a", "b"]}}) is None
    assert gold_titles({"evidences": [["Subject", "father", "Object"]]}) is None  # (entity names, not pages)


def test_scores_by_hand():
    gold = ["A", "B"]
    titles = ["A", "C", "A", "B", "D"]  # (two passages of page A)
    assert scores(gold, titles, 1) == (0.5, 1.0)
    assert scores(gold, titles, 2) == (0.5, 0.5)
    assert scores(gold, titles, 4) == (1.0, 0.75)
    assert scores(gold, titles, 10) == (1.0, 0.3)  # (fewer than k retrieved: still over k)
    assert scores(gold, titles, None) == (1.0, 0.6)
    assert scores(gold, [], None) == (0.0, 0.0) and scores(gold, [], 3) == (0.0, 0.0)


def test_retrieved_ids_are_the_rounds_union_in_order():
    r = QuestionResult(qid="q", question="?", gold=[], rounds=[Round(query="a", doc_ids=["p1", "p2"]), Round(),
                                                              Round(query="b", doc_ids=["p2", "p3"])])
    assert retrieved_ids(r) == ["p1", "p2", "p3"]
    beam = QuestionResult(qid="q", question="?", gold=[], chosen=BeamNode(doc_ids=[["p4"], ["p5", "p4"]]))
    assert retrieved_ids(beam) == ["p4", "p5"]


@pytest.fixture
def corpus(tmp_path):
    rows = [("p1", "A"), ("p2", "C"), ("p3", "B"), ("p4", "A"), ("p5", "D")]
    p = tmp_path / "c.jsonl"
    p.write_text("".join(json.dumps({"id": i, "title": t, "text": f"text {i}"}) + "\n" for i, t in rows))
    return p


def test_summarize_writes_the_block(corpus):
    ex = {"q1": Example("q1", "?", ["x"], "hotpotqa", {"supporting_facts": [["A", 0], ["B", 0]]}),
          "q2": Example("q2", "?", ["y"], "hotpotqa", {"supporting_facts": [["D", 0]]}),
          "q3": Example("q3", "?", ["z"], "hotpotqa", {}),  # (no gold: not counted)
          "q4": Example("q4", "?", ["w"], "hotpotqa", {"supporting_facts": [["A", 0]]})}
    res = [QuestionResult("q1", "?", ["x"], rounds=[Round(query="a", doc_ids=["p1", "p2"]),
                                                    Round(query="b", doc_ids=["p3", "p1"])]),
           QuestionResult("q2", "?", ["y"], rounds=[Round(query="a", doc_ids=["p4", "p2"])]),
           QuestionResult("q3", "?", ["z"], rounds=[Round(query="a", doc_ids=["p5"])]),
           QuestionResult("q4", "?", ["w"], error="boom")]  # (failed: not counted)
    m = summarize("dragin", "hotpotqa", res, 1.0, 4, 10, 3, examples=ex, corpus=str(corpus))
    q = m["retrieval_quality"]
    assert q["available"] and q["questions"] == 2 and q["docs_per_retrieval"] == 2
    assert q["retrieved_per_question"] == 2.5 and q["gold_per_question"] == 1.5
    # q1: titles A, C, B; q2: A, C (gold D)
    assert q["at"]["1"] == {"recall": (0.5 + 0) / 2, "precision": (1 + 0) / 2}
    assert q["at"]["2"] == {"recall": 0.25, "precision": 0.25}
    assert q["at"]["5"] == {"recall": 0.5, "precision": (2 / 5) / 2}
    assert q["all"] == {"recall": 0.5, "precision": (2 / 3) / 2}
    assert list(q["at"]) == ["1", "2", "5", "10"]


def test_the_block_says_why_it_is_missing(corpus):
    ex = {"q": Example("q", "?", ["x"], "nq", {"format": "nq_open"})}
    res = [QuestionResult("q", "?", ["x"], rounds=[Round(query="a", doc_ids=["p1"])])]
    q = summarize("dragin", "nq", res, 1.0, 1, 1, 1, examples=ex, corpus=str(corpus))["retrieval_quality"]
    assert q["available"] is False and "no gold supporting passages" in q["why"]
    ex = {"q": Example("q", "?", ["x"], "hotpotqa", {"supporting_facts": [["A", 0]]})}
    assert "corpus file is not known" in retrieval_quality(ex, res, None)["why"]
    q = summarize("dragin", "hotpotqa", res, 1.0, 1, 1, 1, examples=ex, corpus=str(corpus.parent / "gone.jsonl"))
    assert q["retrieval_quality"]["available"] is False and "corpus cannot be read" in q["retrieval_quality"]["why"]
    assert "retrieval_quality" not in summarize("dragin", "hotpotqa", res, 1.0, 1, 1, 1)  # (no examples given)


@pytest.mark.skipif(not SHARED.is_dir(), reason="the shared evaluation data is not here")
def test_the_real_files_give_gold_titles_found_in_the_corpus():
    hot = load_examples("hotpotqa", SHARED / "hotpotqa" / "dev_distractor_200.jsonl", limit=20)
    wiki = load_examples("2wikimultihopqa", SHARED / "2wikimultihopqa" / "dev_sample_200.jsonl", limit=20)
    golds = [gold_titles(e.meta) for e in hot + wiki]
    assert all(g and len(g) >= 2 for g in golds), golds[:3]
    titles = set(corpus_titles(SHARED / "corpus" / "wiki_passages.jsonl",
                               {f"p{i:06d}" for i in range(3000)}).values())
    assert sum(t in titles for g in golds for t in g) > len(golds)  # (the corpus holds their pages)


def test_a_run_writes_retrieval_quality_to_metrics_json(tmp_path):
    """Two bundled HotpotQA questions (IRCoT format: gold in contexts[].is_supporting) with the embedded model and
    BM25: metrics.json holds the block, and its figures are those recomputed from results.jsonl by hand."""
    from fastrag.eval import BUNDLED, RunOptions, read_results, run

    cfg = tmp_path / "fl.json"
    cfg.write_text(json.dumps({"generate_max_length": 8, "fix_length": 4, "retrieve_topk": 3, "fewshot": 1}))
    data, corpus = BUNDLED / "hotpotqa_dev20.jsonl", BUNDLED / "wiki_passages.jsonl"
    out = tmp_path / "o"
    run(RunOptions(method="fl-rag", dataset="hotpotqa", data=str(data), corpus=str(corpus), output=str(out),
                   config=str(cfg), limit=2, batch_size=2, kv_cache_gb=0.25, progress=False))
    q = json.loads((out / "metrics.json").read_text())["retrieval_quality"]
    assert q["available"] and q["questions"] == 2 and q["docs_per_retrieval"] == 3
    ex = {e.qid: e for e in load_examples("hotpotqa", data, limit=2)}
    recs = read_results(out / "results.jsonl")
    titles = corpus_titles(corpus, {i for r in recs for i in retrieved_ids(r)})
    want = [scores(gold_titles(ex[r.qid].meta), [titles[i] for i in retrieved_ids(r)], 3) for r in recs]
    assert q["at"]["3"]["recall"] == pytest.approx(sum(w[0] for w in want) / 2)
    assert q["at"]["3"]["precision"] == pytest.approx(sum(w[1] for w in want) / 2)
    assert q["retrieved_per_question"] >= 3
