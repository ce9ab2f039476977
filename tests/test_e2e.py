"""End to end through the CLI: real SmolLM2, real bm25s over the bundled Wikipedia corpus, real HotpotQA questions.

Kept short for CI (a small generate length); the full-size runs are the benchmarks and `fastrag parity`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fastrag.eval import BUNDLED

DATA = BUNDLED / "hotpotqa_dev20.jsonl"
CORPUS = BUNDLED / "wiki_passages.jsonl"


def cli(*args, check=True, timeout=900, env=None):
    p = subprocess.run([sys.executable, "-m", "fastrag", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, env=env)
    if check and p.returncode != 0:
        raise AssertionError(f"fastrag {' '.join(map(str, args))} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return p


@pytest.fixture(scope="module")
def small_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "DRAGIN.json"
    # a published-style config (keys as in the DRAGIN repository) with a short generation and 4 exemplars (the
    # published HotpotQA config has 8) for CI: the per-question oracle prefills the whole prompt at each generate call
    path.write_text(json.dumps({
        "model_name_or_path": "smollm2", "method": "attn_entropy", "dataset": "hotpotqa",
        "generate_max_length": 24, "query_formulation": "real_words", "retrieve_keep_top_k": 35,
        "output_dir": "../result/x", "retriever": "BM25", "retrieve_topk": 3, "hallucination_threshold": 1.2,
        "fewshot": 4, "sample": 1000, "shuffle": False, "check_real_words": True, "es_index_name": "34051_wiki",
        "use_counter": True,
    }))
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, small_config):
    out = tmp_path_factory.mktemp("run")
    env = dict(os.environ)
    p = cli("run", "--method", "dragin", "--dataset", "hotpotqa", "--data", DATA, "--corpus", CORPUS,
            "--config", small_config, "--limit", 3, "--batch-size", 3, "--output", out, "--no-progress", env=env)
    return out, p, env


def test_run_writes_results_and_metrics(run_dir):
    out, p, _ = run_dir
    recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    gold = [json.loads(x) for x in DATA.read_text().splitlines()[:3]]
    assert [r["qid"] for r in recs] == [g["question_id"] for g in gold] or \
        sorted(r["qid"] for r in recs) == sorted(g["question_id"] for g in gold)
    corpus_ids = {json.loads(x)["id"] for x in CORPUS.read_text().splitlines()}
    for r in recs:
        assert r["error"] is None, r["error"]
        assert r["prediction"]  # the text itself may be empty: SmolLM2 sometimes answers EOS at once
        assert set(r["metrics"]) >= {"em", "f1", "answer"}
        assert r["decode_tokens"] > 0 and r["prefill_tokens"] > 0
        for rd in r["rounds"]:
            if rd["query"] is not None:
                assert rd["trigger_sentence"] and rd["doc_ids"]
                assert set(rd["doc_ids"]) <= corpus_ids
        # the per-question counters every method keeps (docs/methods.md, "KV reuse and counters")
        c = r["counters"]
        assert c.get("searches", 0) == r["retrievals"] and c["generate_calls"] >= 1 + r["retrievals"]
        assert c["reused_prompt_tokens"] > 0 and c.get("retrieval_wait_s", 0.0) >= 0
    m = json.loads((out / "metrics.json").read_text())
    for k in ("method", "dataset", "n", "em", "f1", "accuracy", "questions_per_s", "tokens_per_s",
              "retrievals_per_question", "wall_s"):
        assert k in m, k
    assert m["n"] == 3 and m["method"] == "dragin" and m["dataset"] == "hotpotqa"
    assert 0.0 <= m["em"] <= m["f1"] + 1e-9 <= 1.0 + 1e-9
    assert m["questions_per_s"] > 0
    # the prompts after DRAGIN's demonstrations were prefilled with the prefix as a cascade, its self-check passed
    pa = m["prefill_attention"]
    assert pa["cascade"] is True and pa["checks"] and set(pa["checks"].values()) == {"on"}, pa
    assert "f1" in p.stdout  # the summary table


def test_rerun_resumes_without_recomputing(run_dir, small_config):
    out, _, env = run_dir
    before = (out / "results.jsonl").read_bytes()
    cli("run", "--method", "dragin", "--dataset", "hotpotqa", "--data", DATA, "--corpus", CORPUS,
        "--config", small_config, "--limit", 3, "--output", out, "--no-progress", env=env)
    assert (out / "results.jsonl").read_bytes() == before
    assert json.loads((out / "metrics.json").read_text())["computed_this_run"] == 0


def test_killed_run_resumes_to_the_complete_set(tmp_path, small_config, run_dir):
    _, _, env = run_dir
    out = tmp_path / "killed"
    args = [sys.executable, "-m", "fastrag", "run", "--method", "dragin", "--dataset", "hotpotqa", "--data", DATA,
            "--corpus", CORPUS, "--config", small_config, "--limit", 4, "--batch-size", 1, "--output", out,
            "--no-progress"]
    proc = subprocess.Popen(list(map(str, args)), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    res = out / "results.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if res.exists() and res.read_text().count("\n") >= 1 and (out / "progress.json").exists():
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = res.read_text().splitlines()
    assert 1 <= len(first) < 4, "the run was expected to be killed part-way"
    cli("run", *map(str, args[4:]), env=env)
    final = res.read_text().splitlines()
    assert final[: len(first)] == first  # nothing already written was recomputed or rewritten
    qids = [json.loads(x)["qid"] for x in final]
    assert len(qids) == 4 and len(set(qids)) == 4
    # the killed run's time still counts: the rate over all runs covers both (up to the killed one's last
    # recorded question)
    m = json.loads((out / "metrics.json").read_text())
    ar = m["all_runs"]
    assert m["computed_this_run"] == 4 - len(first)
    assert ar["runs"] == 2 and m["computed_this_run"] + 1 <= ar["computed"] <= 4
    assert ar["wall_s"] > m["wall_s"] and ar["questions_per_s"] == ar["computed"] / ar["wall_s"]
    assert not (out / "progress.json").exists() and len((out / "runs.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("bad, msg", [
    (["--data", "/nonexistent/q.jsonl"], "no such file"),
    (["--corpus", "/nonexistent/c.jsonl"], "no such file"),
    (["--method", "nosuch"], "unknown method"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--temperature", "-1"], "--temperature must be 0 (greedy) or a finite number >= 1e-30"),
])
def test_bad_arguments_give_clear_errors(tmp_path, bad, msg):
    args = {"--method": "dragin", "--dataset": "hotpotqa", "--data": str(DATA), "--corpus": str(CORPUS),
            "--output": str(tmp_path / "o")}
    args.update(dict(zip(bad[::2], bad[1::2])))
    p = cli("run", *[x for kv in args.items() for x in kv], check=False)
    assert p.returncode == 2 and msg in p.stderr, p.stderr


def test_sampled_run_is_seeded_and_recorded(tmp_path, small_config):
    """--temperature/--top-k/--top-p/--seed: two runs with the same seed give the same answers and retrieval
    decisions (sampling happens inside the fused kernel, keyed by the seeded generator), metrics.json and run.json
    record the settings, and parity refuses sampling (its oracle decodes greedily)."""
    common = ["--method", "dragin", "--dataset", "hotpotqa", "--data", DATA, "--corpus", CORPUS, "--config",
              small_config, "--limit", 2, "--batch-size", 2, "--no-progress", "--temperature", 0.7, "--top-p", 0.9,
              "--top-k", 40, "--seed", 5]
    recs = []
    for name in ("a", "b"):
        cli("run", *common, "--output", tmp_path / name)
        lines = (tmp_path / name / "results.jsonl").read_text().splitlines()
        recs.append({r["qid"]: (r["prediction"], r["rounds"]) for r in map(json.loads, lines)})
    assert len(recs[0]) == 2 and recs[0] == recs[1]
    m = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert m["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 5}
    assert json.loads((tmp_path / "a" / "run.json").read_text())["top_k"] == 40
    p = cli("parity", *common, "--output", tmp_path / "p", check=False)
    assert p.returncode == 2 and "--temperature" in p.stderr, p.stderr


def test_serve_rejects_bad_sampling_before_loading_anything():
    p = cli("serve", "--temperature", "0.5", "--top-p", "2", check=False, timeout=120)
    assert p.returncode == 2 and "top_p must be in (0, 1]" in p.stderr, p.stderr
    p = cli("serve", "--temperature", "0.5", "--seed", str(-2**63 - 1), check=False, timeout=120)
    assert p.returncode == 2 and "seed must be an int of 64 bits" in p.stderr, p.stderr


def test_parity_on_a_random_model_of_another_shape(tmp_path, small_config, tiny_model):
    """benchmarks/make_random_model.py writes an HF directory (random weights, the embedded tokenizer) that both
    the engine (`--model DIR`) and the transformers oracle load; DRAGIN parity holds on it too (the GPU benchmarks
    run random-initialised Llama-2 shapes this way)."""
    model = tiny_model
    cli("parity", "--method", "dragin", "--dataset", "hotpotqa", "--data", DATA, "--corpus", CORPUS, "--config",
        small_config, "--model", model, "--limit", 3, "--batch-size", 3, "--output", tmp_path / "p", "--no-progress")
    rep = json.loads((tmp_path / "p" / "parity.json").read_text())
    recs = [json.loads(x) for x in (tmp_path / "p" / "engine" / "results.jsonl").read_text().splitlines()]
    assert rep["n"] == 3 and rep["agreement"] == 1.0, rep
    assert rep["environment"]["torch"] == torch.__version__ and rep["environment"]["device"], rep["environment"]
    assert sum(1 for r in recs for rd in r["rounds"] if rd["query"]) > 0, "no retrieval happened: a weak check"


def test_parity_on_questions_written_outside_the_datasets(tmp_path, small_config):
    """The project's own questions (benchmarks/data/questions_outside_shared.jsonl): Devanagari, a tab, a newline
    and quotes inside the question, German, an emoji. The real SmolLM2 and bm25s make the same DRAGIN decisions on
    both sides, and each question reaches the results exactly as the file wrote it."""
    src = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "questions_outside_shared.jsonl"
    wanted = {"own-15", "own-17", "own-20", "own-22"}
    picked = [r for r in map(json.loads, src.read_text(encoding="utf-8").splitlines()) if r["id"] in wanted]
    assert len(picked) == len(wanted), f"{src} lacks some of {sorted(wanted)}"
    data = tmp_path / "own.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in picked), encoding="utf-8")
    cli("parity", "--method", "dragin", "--dataset", "hotpotqa", "--data", data, "--corpus", CORPUS, "--config",
        small_config, "--batch-size", 4, "--output", tmp_path / "p", "--no-progress")
    rep = json.loads((tmp_path / "p" / "parity.json").read_text())
    assert rep["n"] == len(wanted) and rep["n_errored"] == 0 and rep["agreement"] == 1.0, rep
    asked = {r["id"]: r["question"] for r in picked}
    by_side = {}
    for side in ("engine", "oracle"):
        recs = [json.loads(x) for x in (tmp_path / "p" / side / "results.jsonl").read_text().splitlines()]
        assert {r["qid"]: r["question"] for r in recs} == asked, side
        by_side[side] = {r["qid"]: (r["decode_tokens"], r["llm_calls"]) for r in recs}
    # the same generations, so the same decoded tokens (a final EOS counted on neither side) and generate calls
    assert by_side["engine"] == by_side["oracle"]
    assert any(rd["query"] for r in recs for rd in r["rounds"]), "no retrieval happened: a weak check"


def test_oracle_times_the_questions_asked_and_records_where(tmp_path, small_config, tiny_model):
    """run_oracle computes only `opts.qids` (what bench_e2e spreads over the engine's questions), after an untimed
    warm-up, and appends the device and versions of each invocation that computed something to runs.jsonl; a
    question id outside the first `limit` is refused by name."""
    from fastrag.data.datasets import load_examples
    from fastrag.eval import RunOptions
    from fastrag.parity import run_oracle
    from fastrag.provenance import device_name

    ids = [e.qid for e in load_examples("hotpotqa", str(DATA), limit=4)]
    opts = RunOptions(method="dragin", dataset="hotpotqa", data=str(DATA), corpus=str(CORPUS), output=str(tmp_path),
                      model=str(tiny_model), config=str(small_config), limit=4, progress=False,
                      qids=(ids[0], ids[3]))
    res, wall, n = run_oracle(opts, tmp_path / "o")
    assert [r.qid for r in res] == [ids[0], ids[3]] and n == 2 and wall > 0
    assert all(r.error is None and r.wall_s > 0 for r in res)
    # (each timing with the process's CPU seconds beside it, all its threads: on a CPU above zero, and the machine's
    # load average where the OS gives one)
    assert all(r.counters["host_cpu_s"] > 0 for r in res)
    assert all(r.counters["load_average_1m"] >= 0 for r in res) or not hasattr(os, "getloadavg")
    lines = [json.loads(x) for x in (tmp_path / "o" / "runs.jsonl").read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["computed"] == 2 and lines[0]["environment"]["device"] == device_name()
    _, _, n = run_oracle(opts, tmp_path / "o")  # nothing to compute: no new line
    assert n == 0 and len((tmp_path / "o" / "runs.jsonl").read_text().splitlines()) == 1
    with pytest.raises(ValueError, match="not among the first 4"):
        run_oracle(replace(opts, qids=("no-such-question",)), tmp_path / "o")


@pytest.mark.parametrize("cmd", ["run", "parity"])
def test_no_progress_silences_the_index_build(tmp_path, small_config, tiny_model, cmd):
    """`--no-progress` reaches the retriever: a corpus indexed for the first time by `run` or `parity` prints no
    bm25s progress bars (they went to stderr before)."""
    corpus = tmp_path / "wiki.jsonl"
    corpus.write_bytes(CORPUS.read_bytes())  # a new path: its index is built by this command
    p = cli(cmd, "--method", "dragin", "--dataset", "hotpotqa", "--data", DATA, "--corpus", corpus, "--config",
            small_config, "--model", tiny_model, "--limit", 1, "--batch-size", 1, "--output", tmp_path / "o",
            "--no-progress")
    assert (tmp_path / "wiki.jsonl.bm25s").is_dir(), "the index was not built next to the corpus: nothing checked"
    assert "BM25S" not in p.stderr and "Split strings" not in p.stderr, p.stderr[-2000:]


def test_malformed_data_line_is_named(tmp_path):
    bad = tmp_path / "q.jsonl"
    lines = DATA.read_text().splitlines()[:2]
    bad.write_text(lines[0] + "\n{not json\n" + lines[1] + "\n")
    p = cli("run", "--method", "dragin", "--dataset", "hotpotqa", "--data", bad, "--corpus", CORPUS,
            "--output", tmp_path / "o", check=False)
    assert p.returncode == 2 and f"{bad}:2" in p.stderr or "line 2" in p.stderr, p.stderr


def test_a_dataset_name_that_is_no_name_is_rejected(tmp_path):
    p = cli("run", "--method", "dragin", "--dataset", "no such set", "--data", DATA, "--output", tmp_path / "o",
            check=False)
    assert p.returncode == 2 and "no such set" in p.stderr


def test_per_question_problems_are_recorded_and_the_run_goes_on(tmp_path, small_config, run_dir):
    """An empty question and a question too long for the model context: recorded as errors, others answered."""
    _, _, env = run_dir
    lines = [json.loads(x) for x in DATA.read_text().splitlines()[:2]]
    empty = dict(lines[0], question_id="empty", question_text="   ")
    huge = dict(lines[0], question_id="huge", question_text="word " * 9000)
    data = tmp_path / "q.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in (empty, huge, lines[1])) + "\n")
    out = tmp_path / "o"
    cli("run", "--method", "dragin", "--dataset", "hotpotqa", "--data", data, "--corpus", CORPUS,
        "--config", small_config, "--output", out, "--no-progress", env=env)
    recs = {r["qid"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert "empty question" in recs["empty"]["error"]
    assert "exceeds the model context" in recs["huge"]["error"]
    assert recs[lines[1]["question_id"]]["error"] is None
    assert json.loads((out / "metrics.json").read_text())["errors"] == 2
