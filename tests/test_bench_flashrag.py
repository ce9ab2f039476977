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


def test_bounds_passed_to_each_pipeline():
    from fastrag.config import method_config

    ircot = method_config("ircot", "hotpotqa")
    assert bf.pipeline_kwargs("ircot", ircot) == {"max_iter": ircot.max_steps}
    assert bf.max_new_tokens("ircot", ircot) == ircot.thought_max_tokens
    it = method_config("iter-retgen", "hotpotqa")
    assert bf.pipeline_kwargs("iter-retgen", it) == {"iter_num": it.iterations}
    assert bf.max_new_tokens("iter-retgen", it) == it.generate_max_length
    sa = method_config("self-ask", "hotpotqa")
    assert bf.pipeline_kwargs("self-ask", sa) == {"max_iter": sa.max_iter, "single_hop": sa.single_hop}


def _s(q, *ids):
    return {"query": q, "doc_ids": list(ids)}


def test_compare_decisions_counts_and_overlap():
    qs = ["Who?", "Where?", "When?"]
    fr = [[_s("Who?", "a", "b", "c"), _s("x", "d")], [_s("Where?", "e", "f", "g")], []]
    fa = [[_s("Who? ", "a", "z", "c")], [_s("Where?", "e", "f", "g")], [_s("When?", "h")]]
    d = bf.compare_decisions("sr-rag", qs, fr, [[], [], []], fa)
    assert d["questions"] == 3
    assert d["flashrag_searches_per_question"] == pytest.approx(1.0)
    assert d["fastrag_searches_per_question"] == pytest.approx(1.0)
    assert d["same_search_count"] == 1  # only "Where?" (2 vs 1, 1 vs 1, 0 vs 1)
    assert d["first_query_same"] == 2  # whitespace aside
    assert d["first_search_overlap"] == pytest.approx((2 / 3 + 1) / 2)
    assert d["replay"] == {}


def test_ircot_replay_rule_differences():
    # thought 1: no answer phrase, searched whole (FlashRAG) vs first line (fastrag): queries differ;
    # thought 2: "the answer is x" has fastrag's phrase but not FlashRAG's ("So the answer is:"): stop disagrees
    steps = [["Paris is in France.\nWikipedia Title: X", "So the answer is: Paris."],
             ["Bohr was Danish.", "the answer is Bohr"]]
    searches = [[_s("q1"), _s("Paris is in France.\nWikipedia Title: X")],
                [_s("q2"), _s("Bohr was Danish."), _s("the answer is Bohr")]]
    rp = bf.replay("ircot", ["q1", "q2"], searches, steps)
    assert rp["steps"] == 4
    assert rp["stop_agree"] == 3
    # searched: thoughts 1 of both and thought 2 of q2; only q1's thought 1 has more than its first line
    assert rp["queries"] == 3 and rp["query_same"] == 2


def test_iter_retgen_and_self_ask_replays():
    steps = [["Paris. So the answer is Paris.\n\nQuestion: next?", "Paris again"]]
    searches = [[_s("Q"), _s("Q Paris. So the answer is Paris.\n\nQuestion: next?"), _s("Q Paris again")]]
    rp = bf.replay("iter-retgen", ["Q"], searches, steps)
    assert rp == {"queries": 2, "query_same": 1}  # the first carries an imagined next question fastrag cuts
    sa = bf.replay("self-ask", ["Q"], [[]], [["Yes.\nFollow up: Who is X?\n", "Intermediate", ""]])
    assert sa == {"steps": 3, "search_agree": 3, "follow_ups": 1, "query_same": 1}


def test_decisions_table_rendered():
    row = bf.rate_row("ircot", 2, [8.0], [2.0])
    row.update(bf.compare_answers(["a", "b"], ["a", "c"], [["a"], ["b"]]))
    row["decisions"] = {"questions": 2, "flashrag_searches_per_question": 3.0, "fastrag_searches_per_question": 1.5,
                        "same_search_count": 1, "first_query_same": 2, "first_search_overlap": 0.5,
                        "replay": {"steps": 4, "stop_agree": 3, "queries": 2, "query_same": 1}}
    md = "\n".join(bf.decisions_markdown([row]))
    assert "| ircot | 3.00 / 1.50 | 1/2 | 2/2 | 0.50 |" in md
    assert "3/4 thoughts get the same stop-or-search decision" in md and "1/2 searched thoughts" in md
    assert bf.decisions_markdown([bf.rate_row("sr-rag", 1, [1.0], [1.0])]) == []


def test_runner_logs_each_items_searches_and_steps():
    import flashrag_runner as fr

    class Retriever:
        def search(self, q, return_score=False):
            docs = [{"id": f"{q}-1"}, {"id": f"{q}-2"}]
            return (docs, [1.0, 0.5]) if return_score else docs

        def batch_search(self, qs):
            return [[{"id": f"{q}-b"}] for q in qs]

    class Item:
        def __init__(self):
            self.output = {}

    class Pipe:  # FLARE/IRCoT-like: run_item a question at a time; Iterative-like: batch_search over all
        def __init__(self):
            self.retriever = Retriever()

        def run_item(self, item):
            self.retriever.search(f"q{id(item) % 7}", return_score=True)
            self.retriever.search("again")

    pipe, items = Pipe(), [Item(), Item()]
    log, state = fr.log_searches(pipe, 2)
    for it in items:
        pipe.run_item(it)
    pipe.retriever.batch_search(["a", "b"])
    pipe.retriever.batch_search(["only one"])  # not one query an item: charged to none
    assert [len(x) for x in log] == [3, 3]
    assert log[0][1] == {"query": "again", "doc_ids": ["again-1", "again-2"]}
    assert log[1][2] == {"query": "b", "doc_ids": ["b-b"]}
    state["on"] = False
    pipe.run_item(items[0])
    assert [len(x) for x in log] == [3, 3]

    it = Item()
    it.output = {"intermediate_output_iter2": {"new_thought": "second"}, "intermediate_output_iter1":
                 {"new_thought": "first"}, "pred_iter_10": "ten", "pred_iter_9": "nine", "pred": "x"}
    assert fr.step_texts(it) == ["first", "second", "nine", "ten"]


def test_runner_answers_a_query_without_terms_with_no_documents():
    # bm25s's numba scorer raises on a query with no indexed term; FlashRAG 0.1.2's IRCoT searches every thought
    import flashrag_runner as fr

    pytest.importorskip("bm25s")
    Stemmer = pytest.importorskip("Stemmer")
    calls = []

    class Retriever:
        backend = "bm25s"
        stemmer = Stemmer.Stemmer("english")

        def search(self, q, return_score=False):
            calls.append(q)
            return ([{"id": "p1"}], [1.0]) if return_score else [{"id": "p1"}]

        def batch_search(self, qs):
            raise AssertionError("not called here")

    class Pipe:
        retriever = Retriever()

        def run_item(self, item):
            return [self.retriever.search(q, return_score=True) for q in ("Paris", "the of", "")]

    pipe = Pipe()
    log, _ = fr.log_searches(pipe, 1)
    out = pipe.run_item(object())
    assert out == [([{"id": "p1"}], [1.0]), ([], []), ([], [])]
    assert calls == ["Paris"]  # the two term-less queries never reach the scorer
    assert log[0] == [{"query": "Paris", "doc_ids": ["p1"]}, {"query": "the of", "doc_ids": [], "no_terms": True},
                      {"query": "", "doc_ids": [], "no_terms": True}]
    assert pipe.retriever.search("the") == []  # without scores asked: the documents alone
