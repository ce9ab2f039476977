"""benchmarks/bench_flashrag.py without FlashRAG: corpus conversion, the config it hands FlashRAG, the method check
and the table arithmetic (the benchmark itself needs the scratch venv and minutes of CPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_flashrag as bf  # noqa: E402


def test_corpus_conversion_round_trips(tmp_path):
    recs = [{"id": "p000001", "title": "Charlie Partridge", "text": "Charles James Partridge( born 1973) is a coach."},
            {"id": "d7", "title": "Ünïcode: a", "text": "line one\nline two"},  # a newline in the text survives
            {"id": "x", "title": "", "text": "no title"}]
    src = tmp_path / "wiki.jsonl"
    src.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs) + "\n", encoding="utf-8")
    dst = tmp_path / "fr" / "corpus.jsonl"
    assert bf.convert_corpus(src, dst) == 3
    out = [json.loads(line) for line in dst.read_text(encoding="utf-8").splitlines()]
    assert [set(o) for o in out] == [{"id", "contents"}] * 3
    assert out[0]["contents"] == "Charlie Partridge\nCharles James Partridge( born 1973) is a coach."
    assert [bf.from_flashrag_record(o) for o in out] == recs


def test_title_with_newline_is_refused():
    with pytest.raises(bf.BenchError, match="newline"):
        bf.to_flashrag_record({"id": "a", "title": "two\nlines", "text": "t"})


def test_config_has_the_keys_and_paths():
    cfg = bf.flashrag_config(model_dir="/m/smol", index_dir="/w/index/bm25", corpus_path="/w/corpus.jsonl",
                             save_dir="/w/save", max_new_tokens=100, batch_size=32, topk=3)
    assert cfg["framework"] == "hf"
    assert cfg["generator_model_path"] == "/m/smol"
    assert cfg["generation_params"] == {"do_sample": False, "max_new_tokens": 100}  # greedy, fastrag's length
    assert cfg["generator_batch_size"] == 32
    assert (cfg["retrieval_method"], cfg["bm25_backend"], cfg["retrieval_topk"]) == ("bm25", "bm25s", 3)
    assert cfg["index_path"] == "/w/index/bm25" and cfg["method2index"]["bm25"] == "/w/index/bm25"
    assert cfg["corpus_path"] == "/w/corpus.jsonl"
    assert cfg["gpu_id"] is None and not cfg["use_reranker"] and cfg["refiner_name"] is None
    assert not cfg["save_retrieval_cache"] and not cfg["use_retrieval_cache"]
    # the keys FlashRAG 0.1.2's Config reads with [] (its wheel has no basic_config.yaml to supply them)
    for k in ("split", "dataset_name", "data_dir", "model2path", "model2pooling", "generator_model",
              "rerank_model_name", "rerank_pooling_method", "metric_setting", "save_note", "save_dir", "seed",
              "metrics", "use_fid", "generator_max_input_len"):
        assert k in cfg, k
    json.dumps(cfg)  # it travels to the runner as JSON


def test_flare_kwargs_carry_fastrag_lengths():
    from fastrag.config import method_config

    cfg = method_config("flare", "hotpotqa")
    kw = bf.pipeline_kwargs("flare", cfg)
    assert kw == {"look_ahead_steps": cfg.look_ahead_tokens, "max_generation_length": cfg.generate_max_length}
    assert bf.pipeline_kwargs("sr-rag", method_config("sr-rag", "hotpotqa")) == {}


def test_methods_unknown_refused_unregistered_skipped():
    with pytest.raises(bf.BenchError, match="unknown method.*dragin.*sr-rag"):
        bf.check_methods(["sr-rag", "dragin"], {"sr-rag": "", "dragin": ""})
    run, skipped = bf.check_methods(["sr-rag", "flare", "ircot"], {"sr-rag": "", "flare": ""})
    assert run == ["sr-rag", "flare"]
    assert list(skipped) == ["ircot"] and "does not register" in skipped["ircot"]


def test_unknown_method_exits_with_clear_error(capsys):
    with pytest.raises(SystemExit, match="unknown method.*nope"):
        bf.main(["--methods", "nope", "--limit", "1"])


def test_rates_and_ratio():
    row = bf.rate_row("sr-rag", 10, [5.0, 4.0, 100.0], [1.0, 2.0, 1.5])  # medians 5.0 and 1.5
    assert row["flashrag_qps"] == pytest.approx(2.0)
    assert row["fastrag_qps"] == pytest.approx(10 / 1.5)
    assert row["ratio"] == pytest.approx((10 / 1.5) / 2.0)
    missing = bf.rate_row("flare", 10, None, [2.0])
    assert missing["flashrag_qps"] is None and missing["ratio"] is None and missing["fastrag_qps"] == 5.0


def test_compare_answers():
    golds = [["Paris"], ["Niels Bohr", "Bohr"], ["yes"], ["1999"]]
    fr = ["Paris.", "Albert Einstein", "Yes", "in 1999"]
    fa = ["the Paris", "Bohr", "no", "1999"]
    c = bf.compare_answers(fr, fa, golds)
    assert c["n"] == 4
    assert c["flashrag_em"] == pytest.approx(2 / 4)  # "Paris." and "Yes" normalise to gold
    assert c["fastrag_em"] == pytest.approx(3 / 4)  # articles dropped: "the Paris" == "Paris"
    assert c["fastrag_f1"] == pytest.approx(3 / 4)
    assert c["flashrag_f1"] == pytest.approx((1 + 0 + 1 + 2 / 3) / 4)
    assert c["agree"] == 1  # only "Paris." / "the Paris"
    with pytest.raises(ValueError, match="lengths differ"):
        bf.compare_answers(fr[:3], fa, golds)


def test_markdown_table():
    row = bf.rate_row("sr-rag", 4, [8.0], [2.0])
    row.update(bf.compare_answers(["pa", "qb", "rc", "sd"], ["pa", "qb", "xx", "yy"], [["pa"], ["qb"], ["rc"], ["zz"]]))
    report = {"n": 4, "dataset": "hotpotqa", "data": "d.jsonl", "corpus": "c.jsonl", "topk": 3, "batch_size": 32,
              "threads": 2, "repeats": 1, "rows": [row], "skipped": {"ircot": "not registered"},
              "errors": [{"where": "FlashRAG FLAREPipeline", "error": "RuntimeError: boom", "detail": "tb"}],
              "notes": ["prompts differ"], "setup": {}, "command": "python benchmarks/bench_flashrag.py",
              "versions": {"torch": "x"}}
    md = bf.render_markdown(report)
    assert "| sr-rag | SequentialPipeline | 4 | 0.5000 | 2.0000 | 4.00x | 0.750 / 0.750 | 0.500 / 0.500 | 2/4 |" in md
    assert "| ircot | IRCOTPipeline |" in md and "skipped: not registered" in md
    assert "RuntimeError: boom" in md and "prompts differ" in md


def test_merge_keeps_other_methods_rows():
    old = [{"method": "flare", "n": 5}, {"method": "sr-rag", "n": 20}]
    new = [{"method": "sr-rag", "n": 10}, {"method": "ircot", "n": 10}]
    rows = bf.merged_rows(old, new)
    assert [(r["method"], r["n"]) for r in rows] == [("sr-rag", 10), ("flare", 5), ("ircot", 10)]


def test_fastrag_answers_use_fastrags_scoring_rule():
    from fastrag.data.datasets import Example

    ex = [Example("q0", "Capital of France?", ["Paris"], "hotpotqa"),
          Example("q1", "Who?", ["Bohr"], "hotpotqa")]
    answers = bf.fastrag_answers(ex, ["It is in Europe. So the answer is Paris.", "no marker here"])
    assert answers[0].rstrip(".") == "Paris"
    assert answers[1] == ""  # HotpotQA: no 'the answer is', nothing to score (fastrag's rule)
    c = bf.compare_answers(["Paris", "Bohr"], answers, [e.answers for e in ex])
    assert (c["fastrag_em"], c["flashrag_em"], c["agree"]) == (0.5, 1.0, 1)
