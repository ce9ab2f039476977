"""Several runs served by one engine (`fastrag.eval.run_many`): questions of different datasets (different demo
prefixes, settings) share decode batches, and every question's record equals the one a run of its own gives.

Real SmolLM2 and bm25s over the bundled corpus, short generations for CI.
"""

from __future__ import annotations

import json
import os

import pytest

from fastrag.eval import BUNDLED, RunOptions, build_engine, read_results, run, run_many

DATA = BUNDLED / "hotpotqa_dev20.jsonl"
CORPUS = BUNDLED / "wiki_passages.jsonl"


@pytest.fixture(scope="module")
def short_cfg(tmp_path_factory):
    p = tmp_path_factory.mktemp("cfg") / "dragin.json"
    p.write_text(json.dumps({"method": "attn_entropy", "generate_max_length": 24, "retrieve_keep_top_k": 35,
                             "hallucination_threshold": 1.2, "retrieve_topk": 3, "query_formulation": "real_words"}))
    return str(p)


def decisions(path):
    return {r.qid: (r.prediction, [(x.trigger_sentence, x.query, x.doc_ids) for x in r.rounds], r.error)
            for r in read_results(path / "results.jsonl")}


def test_joint_run_equals_separate_runs(tmp_path, short_cfg):
    from fastrag.retrieval.bm25 import BM25Retriever

    # 4 exemplars a prompt (8 by default): each of the four runs below prefills both demo prefixes again and every
    # decode step reads them, while what is tested is which batches the questions share, not how long the demos are
    cfg = tmp_path / "dragin4.json"
    cfg.write_text(json.dumps({**json.loads(open(short_cfg).read()), "fewshot": 4}))
    eng = build_engine("smollm2", batch_size=8, kv_cache_gb=1.0, device="cpu")
    ret = BM25Retriever(str(CORPUS))
    # the same questions under two datasets' prompts (different demos: two shared prefixes in one batch)
    mk = lambda ds, out, **kw: RunOptions(method="dragin", dataset=ds, data=str(DATA), corpus=str(CORPUS),  # noqa: E731
                                          output=str(tmp_path / out), config=str(cfg), limit=3, batch_size=8,
                                          kv_cache_gb=1.0, progress=False, **kw)
    sep = [run(mk("hotpotqa", "sep_h"), engine=eng, retriever=ret),
           run(mk("2wikimultihopqa", "sep_w"), engine=eng, retriever=ret)]
    eng.clear_prefixes()
    steps0 = eng.stats["decode_steps"]
    joint = run_many([mk("hotpotqa", "joint_h"), mk("2wikimultihopqa", "joint_w")], engine=eng, retriever=ret)
    assert len(eng.prefixes) == 2
    for a, b in (("sep_h", "joint_h"), ("sep_w", "joint_w")):
        da, db = decisions(tmp_path / a), decisions(tmp_path / b)
        assert len(da) == 3 and da == db
        assert any(query for _, rounds, _ in da.values() for _, query, _ in rounds), f"{a}: nothing retrieved"
    # the two demo sets really differ (else this would test one prefix twice)
    assert eng.prefixes[0].token_ids != eng.prefixes[1].token_ids
    # one clock for both runs; fewer decode steps than the two runs took one after the other
    assert joint[0]["joint"]["wall_s"] == joint[1]["joint"]["wall_s"]
    assert joint[0]["joint"]["computed_this_run"] == 6
    assert eng.stats["decode_steps"] - steps0 < sep[1]["engine"]["decode_steps"]  # (engine counters: cumulative)
    m = json.loads((tmp_path / "joint_w" / "metrics.json").read_text())
    assert m["n"] == 3 and m["dataset"] == "2wikimultihopqa"
    # a rerun resumes both: nothing computed again
    again = run_many([mk("hotpotqa", "joint_h"), mk("2wikimultihopqa", "joint_w")], engine=eng, retriever=ret)
    assert [m["computed_this_run"] for m in again] == [0, 0]
    # decode steps through (emulated) CUDA graphs, those mixing the two prefixes too, with the scheduler's overlap
    # and DRAGIN's spaCy work on two worker processes (as on a GPU): the same decisions, every step replayed, the
    # counts in metrics.json
    from fastrag.cuda_graphs import DecodeGraphs

    geng = build_engine("smollm2", batch_size=8, kv_cache_gb=1.0, device="cpu")
    geng.graphs = DecodeGraphs(geng.model, geng.pool, geng.max_batch, emulate=True,
                               ctx_blocks=-(-geng.max_context // geng.pool.block_size))  # (as Engine does)
    gm = run_many([mk("hotpotqa", "graph_h", overlap=True, text_workers=2),
                   mk("2wikimultihopqa", "graph_w", overlap=True, text_workers=2)], engine=geng, retriever=ret)
    assert gm[0]["overlap"] is True and joint[0]["overlap"] is False
    assert gm[0]["text_workers"]["workers"] == 2 and gm[0]["text_workers"]["texts"] >= 6  # a split per question
    # (no --text-workers on a CPU engine: the run chooses none; given ones are said to be given)
    assert joint[0]["text_workers"] == {"workers": 0, "texts": 0, "lockstep": False, "chosen": "auto"}
    assert gm[0]["text_workers"]["chosen"] == "given"
    for a, b in (("sep_h", "graph_h"), ("sep_w", "graph_w")):
        assert decisions(tmp_path / a) == decisions(tmp_path / b)
    g = gm[0]["cuda_graphs"]
    assert g["replays"] == gm[0]["engine"]["decode_steps"] > 0 and g["eager_steps"] == 0
    assert any(k[2] is not None and k[2][0] == "mixed" for k in geng.graphs.graphs)
    assert g["graphs"] == len(geng.graphs.graphs) and g["disabled"] is None
    # every graph captured before the clock (each prefix's and the mixed set's, per batch bucket): none by a step
    assert g["captured_ahead"] == 3 * len(geng.graphs.buckets) == g["captures"] and g["capture_ahead_s"] > 0
    assert g["table_width_blocks"] == geng.graphs.width


def test_runs_must_share_the_engine_settings(tmp_path):
    a = RunOptions(method="dragin", dataset="hotpotqa", data=str(DATA), corpus=str(CORPUS), output=str(tmp_path / "a"))
    b = RunOptions(method="dragin", dataset="hotpotqa", data=str(DATA), corpus=str(CORPUS), output=str(tmp_path / "b"),
                   batch_size=4)
    with pytest.raises(ValueError, match="batch-size"):
        run_many([a, b])
    with pytest.raises(ValueError, match="same output"):
        run_many([a, a])
    # one folder spelt two ways (relative and absolute, a "..") is the same folder: said so, not taken for another
    # process's lock
    (tmp_path / "sub").mkdir()
    kw = dict(method="dragin", data=str(DATA), corpus=str(CORPUS))
    for other in (tmp_path / "sub" / ".." / "a", os.path.relpath(tmp_path / "a")):
        with pytest.raises(ValueError, match=r"run_many: two runs write to the same output directory \("):
            run_many([a, RunOptions(**kw, output=str(other), dataset="2wikimultihopqa")])


def test_run_history_totals(tmp_path):
    """runs.jsonl keeps each run's questions and seconds; a killed run's progress.json joins it when the next run
    starts; a torn progress file loses that run's time only. The rate counts answered questions (not the ones that
    failed), as one run's questions_per_s does; a line from before `answered` was recorded counts all its own."""
    from fastrag.eval import close_progress, write_progress

    assert close_progress(tmp_path) == {"runs": 0, "computed": 0, "answered": 0, "wall_s": 0,
                                         "questions_per_s": None}
    write_progress(tmp_path, 3, 3, 30.0)
    write_progress(tmp_path, 5, 5, 50.0)  # the latest state replaces the earlier one
    assert close_progress(tmp_path) == {"runs": 1, "computed": 5, "answered": 5, "wall_s": 50.0,
                                         "questions_per_s": 0.1}
    assert not (tmp_path / "progress.json").exists()
    write_progress(tmp_path, 0, 0, 10.0)  # a run that finished nothing adds no line
    assert close_progress(tmp_path)["runs"] == 1
    (tmp_path / "progress.json").write_text('{"computed": 4, "wall')
    got = close_progress(tmp_path)
    assert got["runs"] == 1 and got["computed"] == 5
    write_progress(tmp_path, 15, 15, 50.0)
    assert close_progress(tmp_path) == {"runs": 2, "computed": 20, "answered": 20, "wall_s": 100.0,
                                         "questions_per_s": 0.2}
    write_progress(tmp_path, 10, 0, 1.0)  # ten questions that all failed at once: no throughput
    assert close_progress(tmp_path) == {"runs": 3, "computed": 30, "answered": 20, "wall_s": 101.0,
                                         "questions_per_s": 20 / 101.0}
    with (tmp_path / "runs.jsonl").open("a") as f:  # written before runs recorded `answered`
        f.write(json.dumps({"computed": 4, "wall_s": 9.0}) + "\n")
    assert close_progress(tmp_path)["questions_per_s"] == 24 / 110.0


def test_run_history_leaves_out_a_torn_or_foreign_line(tmp_path):
    """A line of runs.jsonl torn by a full disk (no newline at its end) is left out with a warning naming the file and
    line, and the next run's line still counts: it starts a line of its own. A line that parses but is no run record
    (hand-edited: text for a number, NaN or infinity, a negative count, a field missing) is left out the same way; a
    blank line is skipped without a word."""
    from fastrag.eval import close_progress, write_progress

    hist = tmp_path / "runs.jsonl"
    hist.write_text(json.dumps({"computed": 2, "answered": 2, "wall_s": 10.0}) + '\n{"computed": 3, "wa')
    write_progress(tmp_path, 4, 3, 30.0)
    with pytest.warns(RuntimeWarning, match=r"runs\.jsonl: line 2 is not a run record \('\{\"computed\": 3, \"wa'\)"):
        got = close_progress(tmp_path)
    assert got == {"runs": 2, "computed": 6, "answered": 5, "wall_s": 40.0, "questions_per_s": 5 / 40.0}
    foreign = ["[1]", "null", '{"wall_s": 1.0}', '{"computed": "3", "wall_s": 1.0}', '{"computed": 1, "wall_s": NaN}',
               '{"computed": 1, "wall_s": Infinity}', '{"computed": -1, "wall_s": 1.0}',
               '{"computed": 1, "wall_s": 1.0, "answered": true}']
    with hist.open("a") as f:
        f.write("\n".join(foreign) + "\n\n")
    with pytest.warns(RuntimeWarning) as caught:
        assert close_progress(tmp_path) == got
    named = [int(str(w.message).split(": line ")[1].split()[0]) for w in caught]
    assert named == [2, *range(4, 4 + len(foreign))]


def test_summary_averages_over_the_answered_questions():
    """metrics.json's figures, worked by hand: a failed question counts in n and errors only. Its retrievals,
    tokens and counters would move every per-question mean here; a counter only it carries is not reported; the
    rates count answered questions and exist only when this run computed something in a positive time."""
    from fastrag.eval import summarize
    from fastrag.trace import QuestionResult, Round

    def rec(qid, metrics, queries, prefill, decode, counters, error=None):
        return QuestionResult(qid, "q", ["a"], metrics=metrics, rounds=[Round(query=q) for q in queries],
                              prefill_tokens=prefill, decode_tokens=decode, counters=counters, error=error)

    a = rec("a", {"em": 1.0, "f1": 1.0}, ["x", None], 100, 20, {"searches": 1, "short_retrievals": 1})
    b = rec("b", {"em": 0.0, "f1": 0.5}, ["y", "z"], 300, 40, {"searches": 2})
    bad = rec("c", {}, ["w"] * 5, 1000, 1000, {"searches": 9, "short_retrievals": 9, "generate_calls": 7}, "boom")
    assert summarize("dragin", "hotpotqa", [a, bad, b], 4.0, 3, 2000, 2) == {
        "method": "dragin", "dataset": "hotpotqa", "n": 3, "errors": 1, "em": 0.5, "f1": 0.75, "accuracy": None,
        "questions_per_s": 0.5, "tokens_per_s": 500.0, "retrievals_per_question": 1.5,
        "prefill_tokens_per_question": 200.0, "decode_tokens_per_question": 30.0, "wall_s": 4.0,
        "computed_this_run": 3, "questions_measured": 2, "searches_per_question": 1.5,
        "short_retrievals_per_question": 0.5}
    for wall, computed in ((4.0, 0), (0.0, 3)):  # nothing computed now, or no time measured: no rate
        got = summarize("dragin", "hotpotqa", [a, b], wall, computed, 2000, 2)
        assert got["questions_per_s"] is None and got["tokens_per_s"] is None and got["f1"] == 0.75
    only_failed = summarize("dragin", "hotpotqa", [bad], 4.0, 1, 2000, 0)
    assert only_failed["errors"] == 1 and only_failed["questions_per_s"] == 0 and only_failed["em"] is None
    assert only_failed["retrievals_per_question"] is None and "searches_per_question" not in only_failed


def test_a_small_kv_pool_evicts_and_fails_only_what_cannot_fit(tmp_path, short_cfg):
    """DRAGIN with a KV pool far too small for its batch: sequences wait for blocks, idle ones are evicted and
    prefilled again, and the decisions equal a roomy pool's. With a pool that cannot hold one question's retrieval
    prompt even alone, that question fails with an error naming the fix; the run goes on and the others match."""
    from fastrag.retrieval.bm25 import BM25Retriever

    ret = BM25Retriever(str(CORPUS))

    def go(gb, out):
        eng = build_engine("smollm2", batch_size=4, kv_cache_gb=gb, device="cpu")
        m = run(RunOptions(method="dragin", dataset="hotpotqa", data=str(DATA), corpus=str(CORPUS),
                           output=str(tmp_path / out), config=short_cfg, limit=3, batch_size=4, kv_cache_gb=gb,
                           progress=False), engine=eng, retriever=ret)
        return m, decisions(tmp_path / out)

    roomy_m, roomy = go(1.0, "roomy")
    assert roomy_m["errors"] == 0 and roomy_m["engine"]["evictions"] == 0 and roomy_m["retrievals_per_question"] > 0
    tight_m, tight = go(0.05, "tight")  # 72 blocks of 16 tokens, 34 of them the demos
    assert tight_m["errors"] == 0 and tight == roomy
    assert tight_m["engine"]["kv_waits"] > 0 and tight_m["engine"]["evictions"] > 0
    small_m, small = go(0.045, "small")  # 65 blocks: 31 for a question's own tokens
    failed = {q for q, d in small.items() if d[2] is not None}
    assert 0 < len(failed) < 3 and small_m["n"] == 3
    assert all("raise --kv-cache-gb" in small[q][2] for q in failed)
    assert all(small[q] == roomy[q] for q in small if q not in failed)
