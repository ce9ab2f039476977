"""The benchmark reports keep earlier measurements honest when their run directories are gone: rows carried from
the committed tables are marked as such, a run directory on disk wins over a carried row, pooled agreement is
weighted by question counts, and a carry that names what the tables do not hold is refused with a message.

No model runs: the scripts are driven in report mode over hand-made tables and run directories.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def metrics(n: int, em: float, f1: float, qps: float) -> dict:
    return {"n": n, "errors": 0, "em": em, "f1": f1, "accuracy": None, "questions_per_s": qps,
            "retrievals_per_question": 1.5, "prefill_tokens_per_question": 400.0, "decode_tokens_per_question": 60.0,
            "computed_this_run": n, "all_runs": {"computed": n, "questions_per_s": qps}}


def test_methods_report_carries_marks_and_prefers_disk(tmp_path, monkeypatch, capsys):
    bm = load("bench_methods")
    monkeypatch.setattr(bm, "wanted", lambda ds, limit: limit)  # no dataset files needed
    res, out = tmp_path / "res", tmp_path / "out"
    res.mkdir()
    prev_runs = {"hotpotqa/wo-rag": metrics(200, 0.25, 0.5, 0.75),
                 "hotpotqa/sr-rag": metrics(200, 0.125, 0.25, 0.5),
                 "hotpotqa/fl-rag": metrics(150, 0.5, 0.5, 0.5)}  # incomplete: never carried
    # the older layout (runs keyed "dataset/method" at the top level) is still read
    (res / "methods.json").write_text(json.dumps(prev_runs))
    disk = out / "hotpotqa" / "sr-rag"
    disk.mkdir(parents=True)
    (disk / "metrics.json").write_text(json.dumps(metrics(200, 0.375, 0.625, 0.25)))
    monkeypatch.setattr(sys, "argv", ["bench_methods.py", "--report-only", "--carry", "--datasets", "hotpotqa",
                                      "--methods", "wo-rag", "sr-rag", "fl-rag", "--output", str(out),
                                      "--results", str(res), "--limit", "200"])
    bm.main()
    md = (res / "methods.md").read_text()
    assert "| hotpotqa | wo-rag † | 200 | 0.250 | 0.500 |" in md
    assert "| hotpotqa | sr-rag | 200 | 0.375 | 0.625 |" in md  # the run directory wins
    assert "fl-rag" not in md.split("## Streaming")[0].split("|---|")[-1]  # incomplete and not on disk: no row
    assert "checkout): hotpotqa/wo-rag." in md
    new = json.loads((res / "methods.json").read_text())
    assert set(new["runs"]) == {"hotpotqa/wo-rag", "hotpotqa/sr-rag"}
    assert new["runs"]["hotpotqa/sr-rag"]["em"] == 0.375


def test_methods_carry_needs_the_earlier_file(tmp_path, monkeypatch):
    bm = load("bench_methods")
    monkeypatch.setattr(sys, "argv", ["bench_methods.py", "--report-only", "--carry", "--results",
                                      str(tmp_path / "none")])
    with pytest.raises(SystemExit, match="methods.json"):
        bm.main()


def bsqa_tables(path: Path) -> None:
    rows = []
    for ds, f1 in (("nq", 0.25), ("webq", 0.5)):
        rows += [{"dataset": ds, "method": m, "side": "engine", "n": 200, "errors": 0, "em": 0.0, "f1": f1,
                  "llm_calls_per_q": 17.0, "retrievals_per_q": 4.0, "prefill_tok_per_q": 3000.0,
                  "decode_tok_per_q": 500.0, "reused_calls_per_q": 0.0, "questions_per_s": 0.05}
                 for m in ("beamsearchqa", "wo-rag")]
    speed = [{"dataset": ds, "engine_n": 200, "oracle_n": n, "engine_q_per_s": e, "oracle_q_per_s": o,
              "speedup": e / o} for ds, n, e, o in (("nq", 30, 0.04, 0.01), ("webq", 10, 0.2 / 3, 0.01))]
    parity = [{"dataset": "nq", "pair": "engine vs oracle", "n": 30, "agreement": 1.0, "answer_agreement": 1.0,
               "path_agreement": 1.0},
              {"dataset": "webq", "pair": "engine vs oracle", "n": 10, "agreement": 0.6, "answer_agreement": 0.8,
               "path_agreement": 0.6}]
    path.write_text(json.dumps({"rows": rows, "speed": speed, "parity": parity, "device": "CPU test",
                                "command": "python benchmarks/bench_beamsearchqa.py --earlier"}))


def test_beamsearchqa_report_carries_and_pools_agreement(tmp_path, monkeypatch):
    bq = load("bench_beamsearchqa")
    res = tmp_path / "res"
    res.mkdir()
    bsqa_tables(res / "beamsearchqa.json")
    monkeypatch.setattr(sys, "argv", ["bench_beamsearchqa.py", "--phases", "report", "--datasets", "nq", "webq",
                                      "--carry", "nq", "webq", "--baselines", "wo-rag", "--oracle-limit", "34",
                                      "--output", str(tmp_path / "out"), "--results", str(res)])
    bq.main()
    md = (res / "beamsearchqa.md").read_text()
    assert "rows carried from the earlier tables (`python benchmarks/bench_beamsearchqa.py --earlier`" in md
    assert md.count("| nq | beamsearchqa | 200 |") == 1 and md.count("| webq | wo-rag | 200 |") == 1
    tables = json.loads((res / "beamsearchqa.json").read_text())
    # 400 engine questions in 200 / 0.04 + 200 / (0.2 / 3) = 8000 s; 40 oracle ones in 4000 s
    speed_all = tables["speed"][-1]
    assert speed_all["dataset"] == "all" and speed_all["oracle_n"] == 40
    assert speed_all["engine_q_per_s"] == pytest.approx(0.05) and speed_all["speedup"] == pytest.approx(5.0)
    pooled = tables["parity"][-1]
    assert pooled["dataset"] == "all" and pooled["n"] == 40
    assert pooled["agreement"] == pytest.approx((30 * 1.0 + 10 * 0.6) / 40)
    assert pooled["answer_agreement"] == pytest.approx((30 * 1.0 + 10 * 0.8) / 40)


def test_beamsearchqa_carry_of_a_dataset_the_tables_lack(tmp_path, monkeypatch):
    bq = load("bench_beamsearchqa")
    res = tmp_path / "res"
    res.mkdir()
    bsqa_tables(res / "beamsearchqa.json")
    monkeypatch.setattr(sys, "argv", ["bench_beamsearchqa.py", "--phases", "report", "--datasets", "hotpotqa",
                                      "--carry", "hotpotqa", "--results", str(res)])
    with pytest.raises(SystemExit, match="hotpotqa"):
        bq.main()


def test_methods_majority_label_floor(tmp_path, monkeypatch):
    """The yes/no floor printed under the methods table: the most common gold label of the first --limit
    questions and the accuracy of always answering it."""
    bm = load("bench_methods")
    bm.examples.cache_clear()
    f = tmp_path / "sqa.json"
    answers = [False, False, True, True, True]
    f.write_text(json.dumps([{"qid": f"q{i}", "question": f"Is {i} odd?", "answer": a} for i, a in enumerate(answers)]))
    monkeypatch.setitem(bm.DATA, "strategyqa", f)
    assert bm.majority("strategyqa", 5) == ("yes", 0.6)
    assert bm.majority("strategyqa", 2) == ("no", 1.0)
    bm.examples.cache_clear()


def test_bench_e2e_floor_rows_one_per_engine():
    """A joint run is one engine: one "all" row on the joint wall clock; separate runs: a row each on their own;
    metrics from before the KV-read counters are left out rather than priced at zero."""
    from fastrag.perf import DeviceFigures

    be = load("bench_e2e")
    costs = {"weight_bytes_per_step": 1000, "matmul_params": 100, "lm_head_params": 30, "kv_bytes_per_token": 10,
             "attn_flops_per_entry": 4, "dtype_bytes": 4}
    st = {"decode_steps": 5, "decode_tokens": 40, "decode_ctx_tokens": 300, "decode_prefix_tokens": 200,
          "prefill_calls": 2, "prefill_tokens": 50, "prefill_ctx_tokens": 900, "prefill_s": 0.5, "decode_s": 2.5,
          "kv_waits": 3, "evictions": 1, "kv_peak_blocks": 30}
    dev = DeviceFigures("test", "float32", copy_bytes_per_s=1e4, matmul_flops_per_s=2e4)
    m = {"wall_s": 9.0, "joint": {"wall_s": 6.0}, "engine": st, "model_costs": costs, "kv_cache_blocks": 120,
         "step_seconds": {"attention_passes": 0.25, "methods_and_other": 1.0}}
    (r,) = be.floor_rows(["hotpotqa", "2wikimultihopqa"], [m, m], True, dev)
    assert r["run"] == "all" and r["engine_wall_s"] == 6.0 and r["floor_s"] == pytest.approx(1.53)
    assert r["wall_over_floor"] == pytest.approx(6.0 / 1.53) and r["prefill_and_passes_s"] == pytest.approx(0.75)
    assert (r["mean_decode_batch"], r["kv_waits"], r["evictions"], r["kv_peak_fraction"]) == (8, 3, 1, 0.25)
    old = {"wall_s": 3.0, "engine": {k: v for k, v in st.items() if k != "decode_ctx_tokens"}, "model_costs": costs}
    rows = be.floor_rows(["hotpotqa", "2wikimultihopqa"], [m | {"joint": None}, old], False, dev)
    assert [(x["run"], x["engine_wall_s"]) for x in rows] == [("hotpotqa", 9.0)]


def test_bench_e2e_decode_steps_against_their_floor_from_the_step_traces(tmp_path):
    """The decode-step table reads the engine folders' step traces: a joint run's first folder only (every folder
    holds the same steps), separate runs' every folder; no trace, no table; a line that is not JSON is named by file
    and line."""
    from fastrag.perf import DeviceFigures

    be = load("bench_e2e")
    costs = {"weight_bytes_per_step": 1000, "matmul_params": 100, "lm_head_params": 30, "kv_bytes_per_token": 10,
             "attn_flops_per_entry": 4, "dtype_bytes": 4}
    dev = DeviceFigures("test", "float32", copy_bytes_per_s=1e4, matmul_flops_per_s=2e4)
    step = {"decode_batch": 4, "decode_ctx_tokens": 80, "decode_prefix_tokens": 20, "device_decode_s": 0.5}
    folders = [tmp_path / "a", tmp_path / "b"]
    for f, n in zip(folders, (3, 2)):
        f.mkdir()
        (f / "step_trace.jsonl").write_text("".join(json.dumps(step) + "\n" for _ in range(n)))
    m = {"model_costs": costs}
    (joint,) = be.decode_floor_rows(be.step_trace_rows(folders, [m, m], True), [m, m], dev)["batch"]
    (separate,) = be.decode_floor_rows(be.step_trace_rows(folders, [m, m], False), [m, m], dev)["batch"]
    assert (joint["steps"], separate["steps"]) == (3, 5) and joint["median_floor_ms"] == pytest.approx(200.0)
    rows = be.step_trace_rows(folders, [m, m], True)
    assert be.decode_floor_rows(rows, [m, m], dev)["prefixes"] == []  # (steps without the count)
    none = be.step_trace_rows([tmp_path / "none"], [m], True)
    assert be.decode_floor_rows(none, [m], dev) == {"batch": [], "prefixes": []}
    (folders[0] / "step_trace.jsonl").write_text(json.dumps(step) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"a/step_trace.jsonl:2: not a JSON step row"):
        be.step_trace_rows(folders, [m, m], True)


def test_bench_e2e_says_what_the_oracle_timings_ran_beside():
    """Per recipe: the records' CPU seconds over their wall seconds and the median load average at their start;
    failed records and records from before the counters are left out; nothing to say, no line."""
    from fastrag.trace import QuestionResult

    be = load("bench_e2e")

    def rec(wall, cpu=None, load=None, error=None):
        c = {} if cpu is None else {"host_cpu_s": cpu} | ({} if load is None else {"load_average_1m": load})
        return QuestionResult(qid="q", question="", gold=[], wall_s=wall, counters=c, error=error)

    pub = [rec(10.0, 9.0, 1.0), rec(30.0, 21.0, 3.0), rec(5.0, 5.0, 2.0), rec(4.0), rec(8.0, 1.0, 9.0, error="x")]
    line = be.oracle_host_line([("published", pub), ("tuned", [rec(2.0, 1.0)]), ("none", [rec(3.0)])])
    assert line == ("- oracle timings beside their host: published 3 questions, 0.78 CPU s per wall s, load average "
                    "2.0 at their start (median); tuned 1 questions, 0.50 CPU s per wall s\n")
    assert be.oracle_host_line([("published", [rec(3.0)])]) == ""


def test_bench_e2e_end_to_end_on_a_tiny_random_model(tmp_path, monkeypatch):
    """The whole script once, as a GPU session runs it but on the CPU with make_random_model's tiny shape and one
    bundled HotpotQA question (its own data folder): the engine with a step trace, both oracles, and a results file
    with every section its header and tables promise (the report's code runs nowhere else before a GPU call)."""
    import torch

    from fastrag.eval import BUNDLED

    sys.path.insert(0, str(BENCH))
    from make_random_model import make

    model = make("tiny", tmp_path / "tiny", dtype=torch.float32, device="cpu")
    data = tmp_path / "data"
    (data / "hotpotqa").mkdir(parents=True)
    (data / "corpus").mkdir()
    (data / "hotpotqa" / "dev_distractor_200.jsonl").write_text(
        (BUNDLED / "hotpotqa_dev20.jsonl").read_text().splitlines()[0] + "\n")
    (data / "corpus" / "wiki_passages.jsonl").symlink_to(BUNDLED / "wiki_passages.jsonl")
    cfg = tmp_path / "short.json"  # (a short generation: the tiny model's random text never stops on its own)
    cfg.write_text(json.dumps({"generate_max_length": 12}))
    monkeypatch.setenv("FASTRAG_STEP_TRACE", "1")
    monkeypatch.setenv("FASTRAG_KERNEL_PROFILE", "2:3")  # (the timed run's steps 2-4; not the warm-up's)
    monkeypatch.setattr(sys, "argv", ["bench_e2e.py", "--datasets", "hotpotqa", "--limit", "1", "--oracle-limit",
                                      "1", "--tuned-oracle-limit", "1", "--model", str(model), "--batch-size", "2",
                                      "--config", str(cfg), "--data-dir", str(data), "--output",
                                      str(tmp_path / "o"), "--results", str(tmp_path / "r"), "--warmup", "1"])
    load("bench_e2e").main()
    md = (tmp_path / "r" / "e2e_cpu.md").read_text()
    for part in (f"- settings: DRAGIN paper Table 9 per dataset with {cfg} over it, greedy; engine batch 2",
                 "- oracle timings beside their host: published 1 questions", "; tuned 1 questions",
                 "## Engine vs the tuned per-question oracle", "## Engine time against its device floor",
                 "## Decode steps against their floor, by batch size (step trace)",
                 "## Decode steps against their floor, by shared prefixes in the step (step trace)",
                 "## Prefill steps against their floor, by tokens in the step (step trace)",
                 "## Attention passes against their floor, by tokens in the step (step trace)",
                 "## The host's launch of the decode steps, by batch size (step trace)",
                 "## Device time by part over engine steps 2-4 (torch.profiler, $FASTRAG_KERNEL_PROFILE)",
                 "| GEMM | ", "FASTRAG_STEP_TRACE=1 ", "FASTRAG_KERNEL_PROFILE=2:3 "):
        assert part in md, (part, md[:3000])
    (warm,) = (tmp_path / "o" / "warmup").rglob("metrics.json")
    assert "kernel_profile" not in json.loads(warm.read_text()) and os.environ["FASTRAG_KERNEL_PROFILE"] == "2:3"
    (engine,) = (tmp_path / "o").glob("*/engine/metrics.json")
    kp = json.loads(engine.read_text())["kernel_profile"]
    assert kp["steps"] == 3 and kp["engine"]["decode_steps"] <= 3 and kp["engine"]["decode_tokens"] > 0
    assert json.loads((engine.parent / "kernel_profile.json").read_text())["window"] == [2, 3]
    rep = json.loads((tmp_path / "r" / "e2e_cpu.json").read_text())
    (batch,) = rep["decode_floor"]  # (one question: every step decodes one sequence)
    assert batch["batch"] == "1-15" and batch["steps"] > 0 and batch["median_device_ms"] > 0
    assert rep["decode_floor_by_prefixes"][0]["prefixes"] == "1"  # (DRAGIN's demos: one shared prefix)
    for key in ("prefill_floor", "passes_floor"):  # (one question's prompt, and its RIND pass of at most 12 tokens)
        assert rep[key][-1]["steps"] > 0 and rep[key][-1]["median_floor_ms"] > 0, rep[key]
    assert rep["passes_floor"][0]["tokens"] == "1-63" and rep["passes_floor"][0]["median_forwards"] >= 1
    launch = [r for r in rep["launch_by_batch"] if r["steps"] == "decode only"]
    assert launch and launch[0]["batch"] == "1-15" and launch[0]["median_launch_ms"] > 0


def test_bench_e2e_oracle_questions_spread_over_the_run_and_their_devices_are_named(tmp_path):
    """The oracles time questions spread over the engine's (not the data file's head), the tuned ones among the
    published recipe's; the devices their timings came from are read from each oracle folder's runs.jsonl."""
    be = load("bench_e2e")
    ids = [f"q{i}" for i in range(10)]
    assert be.spread(ids, 3) == ["q0", "q4", "q9"]  # round(4.5) = 4
    assert be.spread(ids, 2) == ["q0", "q9"] and be.spread(ids, 1) == ["q0"] and be.spread(ids, 0) == []
    assert be.spread(ids, 12) == ids and len(set(be.spread(ids, 7))) == 7
    pub = be.spread(ids, 4)
    assert set(be.spread(pub, 2)) <= set(pub)
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for f in (a, b, c):
        f.mkdir()
    env = lambda d: json.dumps({"recipe": "published", "computed": 1, "wall_s": 1.0, "environment": {"device": d}})
    (a / "runs.jsonl").write_text(env("GPU X") + "\n" + env("GPU Y") + "\n")
    (b / "runs.jsonl").write_text(env("GPU X") + "\n")
    (c / "results.jsonl").write_text("{}\n")  # records from before runs.jsonl
    assert be.oracle_devices([a, b, c, tmp_path / "missing"]) == ["GPU X", "GPU Y", "unrecorded"]


def test_bench_e2e_oracle_rate_without_its_answer_generations():
    """The conservative ratio counts the oracle's per-question answer generations (batched afterwards by the
    published evaluate.py) as free; a record from before their timing leaves it unknown, not priced at zero."""
    from fastrag.trace import QuestionResult

    be = load("bench_e2e")
    rs = [QuestionResult(qid="a", question="", gold=[], wall_s=10.0, counters={"answer_generation_s": 2.0}),
          QuestionResult(qid="b", question="", gold=[], wall_s=6.0, counters={"answer_generation_s": 0.0})]
    assert be.rate_without_answer_generation(rs) == pytest.approx(2 / 14)
    assert be.rate_without_answer_generation(rs + [QuestionResult(qid="c", question="", gold=[], wall_s=5.0)]) is None
    assert be.rate_without_answer_generation([]) is None


def test_bench_e2e_engine_rate_counts_answered_questions():
    """The headline's engine questions/s counts what the oracles' rates count: answered questions. Failed ones were
    computed but are no throughput; a rerun that computed nothing carries its earlier count with its earlier wall;
    metrics from before questions_measured fall back to the questions computed."""
    be = load("bench_e2e")
    ms = [{"computed_this_run": 6, "questions_measured": 4}, {"computed_this_run": 0, "questions_measured": 3},
          {"computed_this_run": 5}]
    assert be.engine_rate(ms, 4.0) == 12 / 4.0
    assert be.engine_rate(ms[:1], 0.0) is None


def test_bench_e2e_says_where_its_cuda_graphs_were_captured():
    be = load("bench_e2e")
    g = {"replays": 800, "captures": 40, "eager_steps": 2, "captured_ahead": 33, "capture_ahead_s": 2.5,
         "table_width_blocks": 256}
    line = be.graphs_line([{"cuda_graphs": g}])
    assert "33 captured before the clock started (2.50 s, not in the wall)" in line
    assert "7 captured by the timed run's steps" in line and "800 steps replayed, 2 decoded eagerly" in line
    assert "256 blocks wide" in line
    older = {k: v for k, v in g.items() if k not in ("captured_ahead", "capture_ahead_s", "table_width_blocks")}
    assert "40 captured by the timed run's steps" in be.graphs_line([{"cuda_graphs": older}])
    assert "power of two" in be.graphs_line([{"cuda_graphs": older}])
    assert be.graphs_line([{}]) == "" and be.graphs_line([]) == ""


def test_bench_e2e_says_how_many_prefills_replayed_graphs():
    be = load("bench_e2e")
    p = {"replays": 1200, "captures": 12, "eager_calls": 130, "captured_ahead": 10, "capture_ahead_s": 1.25,
         "graphs": 12, "disabled": None, "applies": True, "token_buckets": [16, 32, 1024], "max_seqs": 16}
    line = be.prefill_graphs_line([{"prefill_graphs": p}])
    assert line.startswith("- Prefill graphs (calls of up to 16 sequences and 1024 tokens)") and line.count("\n") == 1
    assert "10 captured before the clock started (1.25 s)" in line
    assert "2 by the timed run, 1200 prefills replayed, 130 eager" in line and "turned off" not in line
    both = be.prefill_graphs_line([{"prefill_graphs": p, "pass_graphs": p | {"replays": 7, "max_seqs": 32}}])
    assert both.startswith(line) and "- Attention-pass graphs (calls of up to 32 sequences" in both
    assert "7 pass calls replayed" in both
    off = p | {"disabled": "RuntimeError: capture failed"}
    assert "turned off: RuntimeError: capture failed" in be.prefill_graphs_line([{"prefill_graphs": off}])
    assert "none replayed" in be.prefill_graphs_line([{"prefill_graphs": p | {"applies": False}}])
    assert be.prefill_graphs_line([{}]) == "" and be.prefill_graphs_line([]) == ""
    tr = {"prefill_graphed": {"steps": 900, "device_s": 4.5, "median_tokens": 61.0, "median_device_ms": 4.8},
          "prefill_eager": {"steps": 0, "device_s": 0.0, "median_tokens": None, "median_device_ms": None}}
    traced = be.prefill_graphs_line([{"prefill_graphs": p, "step_trace": tr}])
    assert traced.startswith(line) and traced.count("\n") == 2
    assert "prefill steps in the step trace: graphed 900 (median 61 tokens, 4.8 ms of device time; 4.50 s in all);" \
        " eager 0\n" in traced


def test_the_e2e_header_says_how_prefills_attended():
    """The paged prefill kernel with its self-check when the run used it, else the torch buckets with the
    cascade's (and the paged kernel's failed self-check when it was tried); nothing for a run whose metrics do not
    say."""
    be = load("bench_e2e")
    paged = {"cascade": True, "checks": {"cuda:0 bfloat16": "on"}, "paged_kernel": True,
             "paged_checks": {"cuda:0 bfloat16": "off: CompilationError: x"}}
    assert "paged prefill kernel (self-check cuda:0 bfloat16: off: CompilationError: x)" in \
        be.prefill_line([{"prefill_attention": paged}])
    line = be.prefill_line([{"prefill_attention": paged | {"paged_kernel": False}}])
    assert "torch buckets, prefix as a cascade on (self-check cuda:0 bfloat16: on); the paged prefill kernel not " \
           "used (self-check cuda:0 bfloat16: off: CompilationError: x)" in line
    line = be.prefill_line([{"prefill_attention": paged | {"paged_kernel": False, "paged_checks": {}}}])
    assert line.endswith("(self-check cuda:0 bfloat16: on)\n")  # (a CPU run: the kernel was not tried)
    assert be.prefill_line([{}]) == "" and be.prefill_line([]) == ""


def test_the_text_modes_device_model_keeps_one_timeline():
    """bench_text_modes.DeviceModel: a step is done only once the emulated device has run it (its decode and
    prefill tokens, after whatever was launched before), step_finish waits for it, a prefill call or an attention
    pass blocks the caller for its launch time, and the busy seconds add up."""
    import time
    from types import SimpleNamespace

    mod = load("bench_text_modes")

    class Eng:
        def __init__(self):
            self.stats = {"prefill_calls": 0, "prefill_tokens": 0, "decode_tokens": 0}
            self.plan = []

        def step_launch(self):
            calls, tokens, dec = self.plan.pop(0)
            self.stats["prefill_calls"] += calls
            self.stats["prefill_tokens"] += tokens
            self.stats["decode_tokens"] += dec
            return object()

        def step_finish(self, st):
            return ["finished"]

        def attention_passes_launch(self, seqs, kind):
            return SimpleNamespace(event=None)

    args = SimpleNamespace(decode_ms=40.0, decode_ms_per_seq=1.0, prefill_launch_ms=30.0, prefill_ms_per_token=0.1,
                           pass_launch_ms=20.0, pass_ms=50.0)
    e = Eng()
    dev = mod.DeviceModel(e, args)
    e.plan = [(0, 0, 10), (1, 200, 10)]
    t0 = time.perf_counter()
    a = e.step_launch()  # 40 + 10 = 50 ms of device
    assert time.perf_counter() - t0 < 0.03 and not e.step_done(a)
    b = e.step_launch()  # 30 ms of host launch, then 20 + 50 ms of device after a's 50
    t1 = time.perf_counter()
    assert t1 - t0 >= 0.03 and not e.step_done(b)
    assert e.step_finish(a) == ["finished"] and time.perf_counter() - t0 >= 0.05
    assert e.step_finish(b) == ["finished"] and time.perf_counter() - t0 >= 0.12
    assert e.step_done(b) and abs(dev.busy - 0.12) < 1e-9
    t2 = time.perf_counter()
    p = e.attention_passes_launch([[1, 2]], "colmax")
    assert time.perf_counter() - t2 >= 0.02 and not p.event.query()
    p.event.synchronize()
    assert p.event.query() and time.perf_counter() - t2 >= 0.07 and abs(dev.busy - 0.17) < 1e-9


def test_the_e2e_header_says_where_the_texts_ran():
    be = load("bench_e2e")
    assert "on the scheduler's thread" in be.text_line([{"text_workers": {"workers": 0, "texts": 0}}])
    free = {"workers": 8, "texts": 912, "lockstep": False}
    assert be.text_line([{"text_workers": free}]) == "- spaCy texts: 8 worker processes, free-running, 912 texts sent\n"
    assert "8 worker processes, in lockstep, 912 texts" in be.text_line([{"text_workers": free | {"lockstep": True}}])
    line = be.text_line([{"text_workers": free | {"groups": {"sent": 57, "texts": 912, "largest": 64}}}])
    assert "in groups (57 groups, up to 64 texts), 912 texts sent" in line
    assert be.text_line([{}]) == "" and be.text_line([]) == ""
    auto = be.text_line([{"text_workers": free | {"chosen": "auto"}}])
    assert auto.startswith("- spaCy texts: 8 worker processes (the run's own choice: no --text-workers), free-running")
    assert "own choice" not in be.text_line([{"text_workers": free | {"chosen": "given"}}])


def test_the_compiles_line_names_the_kernels_and_the_steps_they_stopped():
    be = load("bench_e2e")
    assert be.compiles_line([{"triton_compiles": {"hooked": True, "count": 0, "kernels": {}}}]) == \
        "- Triton compiles in the timed run: 0\n"
    m = {"triton_compiles": {"hooked": True, "count": 3, "kernels": {"norm": 1, "paged_prefill": 2}},
         "step_trace": {"steps_with_compiles": [{"step": 10, "kernels": ["paged_prefill"], "step_ms": 1545.5},
                                                {"step": 75, "kernels": ["paged_prefill", "norm"], "step_ms": None}]}}
    assert be.compiles_line([m]) == ("- Triton compiles in the timed run: 3 (paged_prefill x2, norm x1; "
                                     "steps 10 (1546 ms), 75)\n")
    off = be.compiles_line([{"triton_compiles": {"hooked": False, "why_not": "no Triton here", "count": 0}}])
    assert off == "- Triton compiles in the timed run: not recorded (no Triton here)\n"
    assert be.compiles_line([{}]) == "" and be.compiles_line([]) == ""


def _only_fastrag_env(monkeypatch, **settings):
    for k in [k for k in os.environ if k.startswith("FASTRAG_")]:
        monkeypatch.delenv(k)
    for k, v in settings.items():
        monkeypatch.setenv(k, v)


def test_a_tables_command_names_the_switches_in_the_environment(monkeypatch):
    """device.sh's variants differ from the default run by FASTRAG_* settings alone: a table's command line carries
    them (sorted, quoted; FASTRAG_CACHE, a folder, is no setting)."""
    ba = load("bench_args")
    _only_fastrag_env(monkeypatch)
    assert ba.env_prefix() == ""
    _only_fastrag_env(monkeypatch, FASTRAG_PREFILL_HOLD="3", FASTRAG_ASYNC_PREFILL="1", FASTRAG_CACHE="/tmp/c",
                      FASTRAG_NOTE="a b", OTHER="x")
    assert ba.env_prefix() == "FASTRAG_ASYNC_PREFILL=1 FASTRAG_NOTE='a b' FASTRAG_PREFILL_HOLD=3 "


def test_bench_decode_runs_a_named_shape(tmp_path, monkeypatch):
    """bench_decode builds the shape it is given (`--shape`, make_random_model's shapes with their published
    vocabularies), names the table after it when it is not the device's default, and fills every cell; its command
    line carries the FASTRAG_* settings in force."""
    _only_fastrag_env(monkeypatch, FASTRAG_NOTE="decode run")
    bd = load("bench_decode")
    assert bd.hf_shape("llama2-13b") == dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                                             num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                                             max_position_embeddings=4096)
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--cpu-small", "--shape", "tiny", "--batches", "1", "3",
                                      "--ctx", "24", "--reps", "1", "--span", "4", "--results", str(tmp_path)])
    bd.main()
    md = (tmp_path / "decode_cpu_tiny.md").read_text()
    assert "tiny shape (2 layers, hidden 64, 4 / 2 heads, vocabulary 512)" in md, md
    assert "- command: `FASTRAG_NOTE='decode run' python benchmarks/bench_decode.py --cpu-small" in md, md
    rows = [line.split(" | ") for line in md.splitlines() if line.startswith("| 24 |")]
    assert [r[1] for r in rows] == ["1", "3"], md
    for r in rows:  # plain ms, roofline ms and their ratio are measured numbers, not placeholders
        assert float(r[2]) > 0 and float(r[10]) > 0 and float(r[11]) > 0, r


def test_bench_decode_times_every_sequence_of_the_batch_at_its_context():
    """bench_decode's batch is all its sequences, each at the cell's context: when prefilling them takes more engine
    steps than a generation's 32 new tokens (40 sequences, one prefill a step here; on a GPU, SmolLM2 at B 256 with
    4k contexts), the first ones used to decode during the later prefills and finish, so the timed batch held 32
    sequences (a step 0.67x its roofline was the sign)."""
    bd = load("bench_decode")
    shape = bd.hf_shape("tiny")
    ctx, batch = 8, 40
    _model, eng, seqs = bd.build(shape, bd.torch.float32, bd.torch.device("cpu"), batch, ctx, None,
                                 max_prefill_tokens=ctx)
    assert len(seqs) == batch and len({id(s) for s in seqs}) == batch
    assert all(ctx <= s.table.num_tokens <= ctx + 2 for s in seqs), [s.table.num_tokens for s in seqs]
    assert eng.running == seqs and not eng.waiting
    logits = eng.runner.decode(seqs)
    assert logits.shape[0] == batch


def test_bench_decode_deals_shared_prefixes_round_robin_and_counts_each_once(tmp_path, monkeypatch):
    """`--prefixes K`: the batch's sequences start with one of K shared prefixes of --prefix-len tokens, dealt round
    robin, each with ctx tokens of its own; the step decodes them together, and the table's roofline counts each
    prefix once a step (more than without prefixes, less than once per sequence). A prefix length that is not whole
    KV blocks is refused by name."""
    bd = load("bench_decode")
    shape = bd.hf_shape("tiny")
    _model, eng, seqs = bd.build(shape, bd.torch.float32, bd.torch.device("cpu"), 5, 8, None, n_prefixes=2,
                                 prefix_len=32)
    assert [eng.prefixes.index(s.prefix) for s in seqs] == [0, 1, 0, 1, 0]
    assert all(s.prefix.length == 32 and 8 <= s.table.num_tokens <= 10 for s in seqs)
    before = eng.stats["decode_prefix_tokens"]
    assert eng.runner.decode(seqs).shape[0] == 5 and eng.stats["decode_prefix_tokens"] - before == 64  # (each once)
    with pytest.raises(ValueError, match="a shared prefix of 40 tokens is not a whole number of 16-token KV blocks"):
        bd.build(shape, bd.torch.float32, bd.torch.device("cpu"), 2, 8, None, n_prefixes=1, prefix_len=40)
    _only_fastrag_env(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--cpu-small", "--shape", "tiny", "--batches", "4", "--ctx",
                                      "24", "--reps", "1", "--span", "4", "--prefixes", "0", "2", "--prefix-len",
                                      "1024", "--results", str(tmp_path)])
    bd.main()
    rows = [line.strip("| ").split(" | ") for line in (tmp_path / "decode_cpu_tiny.md").read_text().splitlines()
            if line.startswith("| 24 |")]
    assert [r[-1] for r in rows] == ["0", "2 x 1024"]
    # (roofline ms: tiny's KV is 2 layers x 2 kv heads x 16 x 4 bytes x 2 = 512 bytes a token; against the bandwidth
    # in the header. Two values rounded to the table's two decimals differ from their true difference by up to 0.01
    # ms, so the prefixes are long enough that counting each per sequence, not once, would be further off than that)
    bw = float(next(x for x in (tmp_path / "decode_cpu_tiny.md").read_text().splitlines()
                    if "measured copy bandwidth" in x).split("bandwidth ")[1].split(" GB/s")[0]) * 1e9
    extra_ms = 1e3 * 2 * 1024 * 512 / bw
    assert float(rows[1][10]) - float(rows[0][10]) == pytest.approx(extra_ms, abs=0.0101)


def test_bench_prefill_times_single_prefill_calls_against_their_floor(tmp_path, monkeypatch):
    """bench_prefill: every timed step is one prefill call of the cell's sequences after the shared prefix, and the
    engine's counters it reads match the cell (--jitter 0: n x t new tokens, n x (prefix x t + t (t + 1) / 2)
    attention entries, counted here independently); the restricted-backend rows and the profile come too."""
    bp = load("bench_prefill")
    P = 32
    monkeypatch.setattr(sys, "argv", ["bench_prefill.py", "--cpu-small", "--shape", "tiny", "--cells", "1x40", "3x24",
                                      "--prefix", str(P), "--jitter", "0", "--reps", "2", "--warmup", "1",
                                      "--sdpa", "math", "torch", "--profile", "--profile-calls", "1",
                                      "--unfused", "--results", str(tmp_path)])
    bp.main()
    data = json.loads((tmp_path / "prefill_cpu_tiny.json").read_text())
    rows = data["rows"]
    # (no fused kernels on a CPU by default: --unfused adds no row, and every row says so)
    assert {r["fused"] for r in rows} == {"no"}
    assert [(r["seqs"], r["new"], r["sdpa"]) for r in rows] == [
        (1, 40, "default (flash,efficient,math)"), (1, 40, "math"), (1, 40, "torch"),
        (3, 24, "default (flash,efficient,math)"), (3, 24, "math"), (3, 24, "torch")]
    for r in rows:
        n, t = r["seqs"], r["new"]
        assert r["tokens_per_call"] == n * t, r
        assert r["attn_entries_per_call"] == n * (P * t + t * (t + 1) // 2), r
        assert r["wall_ms"] > 0 and r["floor_ms"] > 0 and r["wall_over_floor"] > 0, r
    md = (tmp_path / "prefill_cpu_tiny.md").read_text()
    assert "| 3 x 24 | math |" in md and "host operators, by their own time" in md, md


def test_bench_prefill_times_the_cascade_and_the_masked_call(tmp_path, monkeypatch):
    """bench_prefill --concat: every cell with the prefix attended as a cascade (the default, its self-check named
    in the table) and again in the one masked call, the same counted work in both."""
    bp = load("bench_prefill")
    monkeypatch.delenv("FASTRAG_CASCADE_PREFILL", raising=False)
    monkeypatch.setattr(sys, "argv", ["bench_prefill.py", "--cpu-small", "--shape", "tiny", "--cells", "2x12",
                                      "--prefix", "16", "--jitter", "0", "--reps", "1", "--warmup", "0", "--concat",
                                      "--results", str(tmp_path)])
    bp.main()
    rows = json.loads((tmp_path / "prefill_cpu_tiny.json").read_text())["rows"]
    assert [(r["seqs"], r["new"], r["prefix_attn"]) for r in rows] == [(2, 12, "cascade"), (2, 12, "concat")], rows
    assert rows[0]["attn_entries_per_call"] == rows[1]["attn_entries_per_call"] == 2 * (16 * 12 + 12 * 13 // 2)
    md = (tmp_path / "prefill_cpu_tiny.md").read_text()
    assert "lse_attention against the masked call): cpu float32: on" in md, md
    assert "| 2 x 12 | default (flash,efficient,math) | no | concat |" in md, md


@pytest.mark.parametrize("args, message", [
    (["--cells", "4by300"], "--cells: '4by300' is not SEQSxTOKENS"),
    (["--cells", "0x300"], "needs at least 1 sequence"),
    (["--cells", "1x10", "--jitter", "10"], "would leave a sequence"),
    (["--sdpa", "fastest"], "FASTRAG_SDPA='fastest'"),
])
def test_bench_prefill_bad_cells_are_a_message(args, message, tmp_path, monkeypatch, capsys):
    bp = load("bench_prefill")
    monkeypatch.setattr(sys, "argv", ["bench_prefill.py", "--cpu-small", "--shape", "tiny", *args,
                                      "--results", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        bp.main()
    assert message in str(e.value.code) + capsys.readouterr().err


@pytest.mark.parametrize("script, args", [
    ("bench_prefill", ["--reps", "0"]), ("bench_cpu_gemm", ["--rows", "0"]), ("bench_cpu_gemm", ["--batch", "1", "-2"]),
    ("bench_cpu_gemm", ["--reps", "0"]), ("bench_decode", ["--batches", "0", "--cpu-small"]),
    ("bench_decode", ["--ctx", "0"]), ("bench_cpu_decode_attention", ["--block-size", "0"]),
    ("bench_cpu_decode_attention", ["--batch", "0"]), ("bench_cpu_decode_attention", ["--reps", "0"]),
    ("bench_cpu_decode_step", ["--batch", "0"]), ("bench_host", ["--reps", "0"]), ("bench_host", ["--texts", "-1"]),
    ("bench_search_concurrency", ["--limit", "0"]), ("bench_search_concurrency", ["--concurrency", "1", "0"]),
    ("bench_text_groups", ["--workers", "0"]), ("bench_text_groups", ["--steps", "0"]),
    ("bench_text_groups", ["--reps", "0"]),
])
def test_benchmark_counts_below_one_are_refused_by_name(script, args, monkeypatch, capsys):
    """A zero or negative count is an argparse error naming the option before anything runs (they ended in
    tracebacks from the timing loops: max() of an empty tensor, a modulo by zero, the median of no timings)."""
    monkeypatch.syspath_prepend(str(BENCH))  # (their bench_args import, as when run as scripts: not left to the order)
    mod = load(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *args])
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {args[0]}" in err and "must be a positive integer" in err, err


@pytest.mark.parametrize("script, args, message", [
    ("bench_e2e", ["--limit", "0"], "--limit must be a positive int, got 0"),
    ("bench_e2e", ["--data-dir", "{tmp}/none"], "--data {tmp}/none/hotpotqa/dev_distractor_200.jsonl: no such file"),
    ("bench_e2e", ["--data-dir", "{tmp}", "--datasets", "hotpotqa", "--data-file", "hotpotqa=other/q.jsonl"],
     "--data {tmp}/other/q.jsonl: no such file"),
    ("bench_ray", ["--data", "{tmp}/none.jsonl"], "{tmp}/none.jsonl: no such file"),
    ("bench_retrieval", ["--qrels", "{tmp}/none.tsv"], "--qrels {tmp}/none.tsv: no such file"),
    ("bench_methods", ["--data-dir", "{tmp}/none"],
     "--data-dir {tmp}/none: {tmp}/none/hotpotqa/dev_distractor_200.jsonl not found"),
    ("bench_beamsearchqa", ["--data-dir", "{tmp}/none", "--datasets", "webq"],
     "--data-dir {tmp}/none: {tmp}/none/webquestions/test_500.json not found"),
])
def test_benchmark_bad_data_or_limit_is_a_message(script, args, message, tmp_path, monkeypatch):
    """A data folder or file that is not there, or a --limit below 1, ends the script with one line naming it; they
    ended in a FileNotFoundError / DataError / ValueError traceback before anything ran."""
    mod = load(script)
    out = {"bench_e2e": ["--output", str(tmp_path / "o")], "bench_ray": ["--out", str(tmp_path / "o")]}.get(script, [])
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *(a.format(tmp=tmp_path) for a in args), *out,
                                      "--results", str(tmp_path / "r")])
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert str(e.value) == f"{script}.py: error: {message.format(tmp=tmp_path)}"
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("args, message", [
    (["--data-file", "hotpotqa"], "--data-file 'hotpotqa': expected DATASET=FILE"),
    (["--data-file", "=x.jsonl"], "--data-file '=x.jsonl': expected DATASET=FILE"),
    (["--data-file", "strategyqa=s.json"], "--data-file 'strategyqa=s.json': 'strategyqa' is not among --datasets "
                                           "(hotpotqa 2wikimultihopqa)"),
    (["--data-file", "hotpotqa=a.jsonl", "--data-file", "hotpotqa=b.jsonl"], "--data-file: 'hotpotqa' given twice"),
])
def test_bench_e2e_data_file_pairs_are_checked(args, message, tmp_path, monkeypatch, capsys):
    mod = load("bench_e2e")
    monkeypatch.setattr(sys, "argv", ["bench_e2e.py", *args, "--output", str(tmp_path / "o"),
                                      "--results", str(tmp_path / "r")])
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_bench_e2e_data_file_replaces_a_datasets_file(tmp_path):
    import argparse

    mod = load("bench_e2e")
    ap = argparse.ArgumentParser()
    files = mod.data_files(["2wikimultihopqa=2wikimultihopqa/dev_first1000.json", "hotpotqa=/abs/h.jsonl"],
                           ["hotpotqa", "2wikimultihopqa"], ap)
    assert files["2wikimultihopqa"] == Path("2wikimultihopqa/dev_first1000.json")
    assert Path("/data") / files["hotpotqa"] == Path("/abs/h.jsonl")  # (an absolute file stays itself)
    assert files["strategyqa"] == mod.FILES["strategyqa"] and mod.FILES["hotpotqa"] != files["hotpotqa"]


@pytest.mark.parametrize("script", ["bench_kernels", "bench_host", "bench_paged_attention", "bench_cpu_decode_step",
                                    "bench_prefill_attention", "bench_prefill", "bench_decode", "bench_text_modes",
                                    "bench_pass_padding", "bench_text_groups", "bench_bm25_scale",
                                    "bench_corpus_read", "bench_ann"])
def test_every_table_writing_benchmark_takes_a_results_folder(script):
    """Each script that writes tables has --results (they wrote into benchmarks/results/ whatever the caller
    wanted, so a trial run overwrote the committed tables)."""
    import subprocess

    p = subprocess.run([sys.executable, str(BENCH / f"{script}.py"), "--help"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and "--results" in p.stdout, p.stdout + p.stderr


def test_results_folder_is_where_the_tables_go(tmp_path):
    """Two of them run for real (both take seconds on the CPU): their tables land in --results only."""
    import os
    import subprocess

    before = {p: p.stat().st_mtime_ns for p in (BENCH / "results").glob("*attention*")}
    env = dict(os.environ, TRITON_INTERPRET="1")
    for args, name in ((["bench_prefill_attention.py", "--reps", "1", "--shapes", "smollm2-135m", "--cases",
                         "attention passes"], "prefill_attention_cpu.md"),
                       (["bench_paged_attention.py", "--smoke"], "paged_attention_cpu_smoke.md")):
        out = tmp_path / name.split(".")[0]
        p = subprocess.run([sys.executable, str(BENCH / args[0]), *args[1:], "--results", str(out)],
                           capture_output=True, text=True, env=env, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        assert (out / name).is_file(), list(out.iterdir())
    assert {p: p.stat().st_mtime_ns for p in (BENCH / "results").glob("*attention*")} == before


def test_bench_host_times_the_graphed_calls_host_work_as_replays(monkeypatch):
    """bench_host's graphed prefill and pass preparation: one row per call shape, each a replay (the function raises
    if a call fell back to eager), with a positive median."""
    monkeypatch.syspath_prepend(str(BENCH))  # (its bench_args import, as when run as a script)
    rows = load("bench_host").graph_prep(2)
    assert [r["call"].split(",")[0] for r in rows] == ["prefill"] * 4 + ["attention pass"] * 2
    assert all(r["median_ms"] > 0 for r in rows)


def test_bench_host_tracked_step_counts_fewer_operations_with_shared_capacities(monkeypatch):
    """bench_host's tracked decode step: at each batch the exact-length rule holds a capacity a sequence and
    dispatches more operations the bigger the batch; the engine's power-of-two capacities are a few, whose
    operations hardly grow with the batch."""
    monkeypatch.syspath_prepend(str(BENCH))
    rows = {(r["batch"], r["capacities"]): r for r in load("bench_host").tracked_step(2, batches=(8, 32))}
    assert rows[8, "exact"]["distinct"] == 8 and rows[32, "exact"]["distinct"] == 32
    assert rows[32, "exact"]["ops"] - rows[8, "exact"]["ops"] >= 24 * 4
    assert rows[32, "power of two"]["distinct"] <= 2
    # (a second capacity adds its own dozen operations; 24 more sequences of their own capacities, hundreds)
    assert rows[32, "power of two"]["ops"] - rows[8, "power of two"]["ops"] < 16
    assert all(r["launch_ms"] > 0 and r["finish_ms"] > 0 for r in rows.values())


def test_bench_prefill_times_each_cell_eagerly_and_from_the_prefill_graphs(tmp_path):
    """bench_prefill --graphs on a CPU (emulated graphs, the paged kernel interpreted): each cell eagerly and then
    replayed from its graph, the same counted work, and the table says which rows replayed."""
    import os
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1", FASTRAG_PAGED_PREFILL="1", FASTRAG_FUSED_DECODE="1")
    p = subprocess.run([sys.executable, str(BENCH / "bench_prefill.py"), "--cpu-small", "--shape", "tiny", "--cells",
                        "2x12", "--prefix", "16", "--jitter", "0", "--reps", "1", "--warmup", "0", "--graphs",
                        "--results", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads((tmp_path / "prefill_cpu_tiny.json").read_text())["rows"]
    assert [(r["seqs"], r["new"], r["graphed"]) for r in rows] == [(2, 12, "0/1"), (2, 12, "1/1")], rows
    assert rows[0]["attn_entries_per_call"] == rows[1]["attn_entries_per_call"] == 2 * (16 * 12 + 12 * 13 // 2)
    md = (tmp_path / "prefill_cpu_tiny.md").read_text()
    assert "| 2 x 12 | default (flash,efficient,math) | yes | paged kernel | 24 | 540 | 1/1 |" in md, md


def test_the_pass_padding_count_groups_the_passes_as_the_engine_does():
    """bench_pass_padding.grouped_rows against Engine.attention_passes_launch's own forward calls (their B x T and
    real rows) on random lengths and a small token budget."""
    import random

    from transformers import LlamaConfig

    from engine_fakes import IntTok
    from fastrag.engine import Engine
    from fastrag.model.llama import LlamaModel

    bp = load("bench_pass_padding")
    assert bp.grouped_rows([[3, 5, 10]], 10) == (18, 20, 2)  # [3, 5] padded to 5, then [10]
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    eng = Engine(LlamaModel.from_hf_config(cfg, seed=0), IntTok(), kv_cache_gb=0.01, max_batch=8,
                 max_prefill_tokens=64)
    seen, depth = [], []
    qk = eng.model.last_layer_qk

    def spy(ids, lengths, *a):
        if not depth:  # (last_layer_qk calls itself once inside its SDPA scope)
            seen.append((ids.shape[0] * ids.shape[1], int(lengths.sum())))
        depth.append(1)
        try:
            return qk(ids, lengths, *a)
        finally:
            depth.pop()

    eng.model.last_layer_qk = spy
    rng = random.Random()
    calls = [[rng.randint(1, 40) for _ in range(rng.randint(1, 9))] for _ in range(4)]
    for lens in calls:
        eng.attention_passes([[rng.randrange(1, 60) for _ in range(n)] for n in lens], "colmax")
    real, padded, forwards = bp.grouped_rows(calls, 64)
    assert (real, padded, forwards) == (sum(r for _, r in seen), sum(p for p, _ in seen), len(seen))


def test_bench_text_groups_times_both_splits_on_one_stream(tmp_path, monkeypatch):
    """bench_text_groups on a short stream through one worker: both splits' rows and the cost model's eight rows in
    the table, the runs in the JSON, and the baseline split is the one from before (contiguous equal counts, the
    least-loaded workers first)."""
    mod = load("bench_text_groups")
    assert mod._count_split([5, 1, 1, 9, 2], [7, 0, 3]) == [[3, 4], [0], [1, 2]]
    assert mod._count_split([3], [0, 0]) == [[0], []]
    monkeypatch.setattr(sys, "argv", ["bench_text_groups.py", "--workers", "1", "--steps", "6", "--reps", "1",
                                      "--interval-ms", "5", "--results", str(tmp_path)])
    assert mod.main() == 0
    md = (tmp_path / "text_groups_cpu.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith(("| count |", "| cost |"))]
    assert len(rows) == 2, md
    assert sum(line.startswith(("| sentences |", "| real_words |")) for line in md.splitlines()) == 8, md
    data = json.loads((tmp_path / "text_groups_cpu.json").read_text())
    assert set(data["runs"]) == {"count", "cost"} and all(len(v) == 1 for v in data["runs"].values())
    assert all(r["median_ms"] > 0 for v in data["runs"].values() for r in v)


def test_bench_host_launch_beside_threads_reads_every_setting_and_restores_the_interval(monkeypatch):
    """bench_host's launch beside another thread: a row per (other thread, switch interval), each of the asked steps,
    the interpreter's interval back as it was and no contender thread left. (How long the launch waits depends on
    the machine's load: on an oversubscribed CPU the contender hardly runs, so the effect itself is not asserted.)"""
    monkeypatch.syspath_prepend(str(BENCH))
    mod = load("bench_host")
    old = sys.getswitchinterval()
    rows = mod.launch_beside_threads(4, rounds=1)
    assert sys.getswitchinterval() == old
    assert [(r["contender"], r["switch_interval_ms"]) for r in rows] == [
        (c, iv) for c in mod.CONTENDERS for iv in mod.SWITCH_INTERVALS_MS]
    assert all(r["steps"] == 4 and 0 < r["median_ms"] <= r["p90_ms"] for r in rows)
    assert all(0 < r["cpu_share"] < 1.5 for r in rows), rows
    assert not [t for t in threading.enumerate() if t.name.startswith("bench-contender")]


def test_bench_host_launch_beside_threads_stops_when_a_contender_fails(monkeypatch):
    """A contender thread that dies before its first loop ends the section with an error naming it (it waited for
    that loop forever, which on a GPU machine would spend the stage's whole time limit)."""
    monkeypatch.syspath_prepend(str(BENCH))
    mod = load("bench_host")
    real = mod._contender

    def broken(kind, stop):
        th, done = real(kind, stop)
        if kind != "Python loop":
            return th, done
        return threading.Thread(target=lambda: None, name="bench-contender-broken", daemon=True), done

    monkeypatch.setattr(mod, "_contender", broken)
    old = sys.getswitchinterval()
    with pytest.raises(RuntimeError, match="'Python loop' contender thread stopped before its first loop"):
        mod.launch_beside_threads(2, rounds=1)
    assert sys.getswitchinterval() == old


def test_score_rounding_emulation_separates_the_fused_product(tmp_path):
    """benchmarks/emulate_score_rounding.py: with head dim 64 (scale 1/8, an exact product) the fused and the rounded
    product give the same rows; with 128 at large scores only the fused one leaves the rows off 1, which is what
    the prefill statistics kernels' explicit rounding is for (tests/test_triton_sm90.py, test_kernels_build.py)."""
    emu = load("emulate_score_rounding")
    std64, fused64, rounded64 = emu.worst_deviation(64, 1e3, rows=20, keys=40, seed=1)
    assert fused64 == rounded64 < 1e-6 and std64 > 1e5
    std128, fused128, rounded128 = emu.worst_deviation(128, 1e3, rows=20, keys=40, seed=1)
    assert std128 > 1e5 and rounded128 < 1e-6 < 1e-2 < fused128
    out = tmp_path / "t.md"
    assert emu.main(["--rows", "5", "--out", str(out)]) == 0
    dims = [line.split("|")[1].strip() for line in out.read_text().splitlines() if line.startswith("| ")]
    assert dims[1:] == ["64"] * 3 + ["128"] * 3, dims  # (after the header row)


def test_bench_cpu_processes_times_its_cases_and_refuses_a_bad_one(tmp_path):
    """bench_cpu_processes.py on the real SmolLM2: one case of one process and one of two, each row its own, the
    one-process row's tokens/s its batch over its step; a malformed case is refused by name before any model loads."""
    script = BENCH / "bench_cpu_processes.py"
    bad = subprocess.run([sys.executable, str(script), "--cases", "2:0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "a case is PROCESSES:THREADS or PROCESSES:THREADS:passive, got '2:0'" in bad.stderr
    p = subprocess.run([sys.executable, str(script), "--cases", "1:1", "2:1:passive", "--batch", "2", "--reps", "2",
                        "--rounds", "1", "--results", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads((tmp_path / "cpu_processes.json").read_text())["rows"]
    assert [(r["processes"], r["threads"], r["passive"]) for r in rows] == [(1, 1, False), (2, 1, True)]
    one = rows[0]
    assert one["step_ms"] > 0 and one["tokens_per_s"] == pytest.approx(2 * 1e3 / one["step_ms"])
    md = (tmp_path / "cpu_processes.md").read_text()
    assert "| 2 | 1 | PASSIVE |" in md and "`python benchmarks/bench_cpu_processes.py --cases 1:1 2:1:passive" in md


def test_bench_bm25_scale_builds_and_searches_each_size_and_refuses_a_bad_share(tmp_path):
    """bench_bm25_scale.py on two small generated corpora: a row each, in size order, with the build's and the
    searches' figures, the postings-driven search's answers checked against the numpy path's inside the script
    (it fails on a disagreement); a rare-word share outside [0, 1) is refused by name before any corpus is made."""
    script = BENCH / "bench_bm25_scale.py"
    bad = subprocess.run([sys.executable, str(script), "--rare", "1.5", "--results", str(tmp_path / "bad")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--rare must lie in [0, 1), got 1.5" in bad.stderr
    assert not (tmp_path / "bad").exists()
    p = subprocess.run([sys.executable, str(script), "--sizes", "3000", "1500", "--reps", "1", "--queries", "24",
                        "--results", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads((tmp_path / "bm25_scale_cpu.json").read_text())["rows"]
    assert [r["passages"] for r in rows] == [1500, 3000] and all(r["n_docs"] == r["passages"] for r in rows)
    for r in rows:
        assert r["native"] and r["build_s"] > 0 and r["search_ms"] > 0 and r["numpy_ms"] > 0
        assert r["native_scan"] and not r["pyscan_native_scan"] and r["pyscan_build_s"] > 0  # (the scan's A/B)
        assert r["bm25s_build_s"] > 0 and r["bm25s_build_peak_rss_gib"] > 0 and r["build_peak_rss_gib"] > 0
        assert r["build_workers"] == 1  # (a corpus of at most two chunks is analysed by the builder alone)
        assert r["docs_returned"] > 2 and r["terms_per_query"] > 3  # (real queries: most match 3 passages)
    assert rows[1]["index_mib"] > rows[0]["index_mib"] and rows[1]["corpus_mib"] > 1.5 * rows[0]["corpus_mib"]
    md = (tmp_path / "bm25_scale_cpu.md").read_text()
    assert "| 1,500 |" in md and "| 3,000 |" in md and "Extrapolated to DPR's 21,015,324 passages" in md
    assert "| bm25s build s |" in md and "(bm25s's in-memory build:" in md
    assert "| regex scan build s | regex / scan |" in md and "fastrag._C's scan (`bm25_tokens`)" in md


def test_bench_corpus_read_times_every_reader_on_both_formats(tmp_path):
    """bench_corpus_read.py on a small generated corpus: every reader of both formats read every passage (the
    floor and the csv readers count the tsv header too), the ratios are to the same run's rows."""
    p = subprocess.run([sys.executable, str(BENCH / "bench_corpus_read.py"), "--passages", "3000", "--reps", "2",
                        "--results", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads((tmp_path / "corpus_read_cpu.json").read_text())["rows"]
    got = {(r["format"], r["reader"]): r for r in rows}
    assert sorted(got) == [("jsonl", "fastrag"), ("jsonl", "json.loads a line"), ("jsonl", "json.loads, no hook"),
                           ("jsonl", "lines"), ("tsv", "csv a line"), ("tsv", "csv stream"), ("tsv", "fastrag"),
                           ("tsv", "lines")]
    for (fmt, reader), r in got.items():
        header = fmt == "tsv" and reader != "fastrag"
        if reader == "csv stream":  # (a stray quote takes the lines after it: never more rows than lines)
            assert 0 < r["items"] <= 3001, r["items"]
        else:
            assert r["items"] == 3000 + header, (fmt, reader, r["items"])
        assert len(r["times_s"]) == 2 and r["median_s"] > 0
        base = got[(fmt, "lines")]["median_s"]
        assert abs(r["vs_lines"] - r["median_s"] / base) < 1e-9
    md = (tmp_path / "corpus_read_cpu.md").read_text()
    assert "| tsv | fastrag | " in md and "bench_corpus_read.py --passages 3000 --reps 2" in md


def test_bench_ann_sweep_measures_search_options_on_one_build(tmp_path):
    """--sweep: a row per search-option value of each index type that takes it, all from one build (the same build
    seconds and bytes), recall not falling as the search visits more; a bad sweep is refused by name."""
    import subprocess

    def bench(*args):
        return subprocess.run([sys.executable, str(BENCH / "bench_ann.py"), "--reps", "1", "--queries", "100",
                               "--results", str(tmp_path), *args], capture_output=True, text=True, timeout=600)

    p = bench("--n", "3000", "--clusters", "50", "--nlist", "20", "--types", "ivf", "hnsw",
              "--sweep", "nprobe=1,4,20", "ef-search=10,200")
    assert p.returncode == 0, p.stderr[-2000:]
    (run,) = json.loads((tmp_path / "ann_cpu.json").read_text())["runs"]
    got = [(r["index"], r["options"].get("nprobe", r["options"].get("ef_search"))) for r in run["rows"]]
    assert got == [("flat", None), ("ivf", 1), ("ivf", 4), ("ivf", 20), ("hnsw", 10), ("hnsw", 200)]
    for kind in ("ivf", "hnsw"):
        rows = [r for r in run["rows"] if r["index"] == kind]
        assert len({(r["build_s"], r["index_bytes"]) for r in rows}) == 1
        rec = [r["recall_at_k"] for r in rows]
        assert rec == sorted(rec), rec
    ivf = [r["recall_at_k"] for r in run["rows"] if r["index"] == "ivf"]
    assert ivf[-1] == 1.0  # every list probed: the exact search
    for bad, message in (("nlist=4,8", "expected nprobe="), ("nprobe=4,x", "must be integers"),
                         ("ef_search=0", ">= 1")):
        p = bench("--n", "500", "--sweep", bad)
        assert p.returncode == 2 and message in p.stderr, p.stderr[-500:]


def test_bench_ann_small_run_reports_every_index_against_flat(tmp_path):
    """bench_ann at 3,000 passages: a row per index type after the flat baseline (1.00x, recall 1), recall in
    [0, 1], the index sizes in the right order (ivfpq's codes far under flat's vectors, hnsw's graph over them);
    --append keeps the run of another size."""
    import subprocess

    def bench(*args):
        p = subprocess.run([sys.executable, str(BENCH / "bench_ann.py"), "--reps", "1", "--queries", "100",
                            "--results", str(tmp_path), *args], capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]

    bench("--n", "3000", "--clusters", "50", "--nlist", "20", "--m", "16")
    (run,) = json.loads((tmp_path / "ann_cpu.json").read_text())["runs"]
    rows = {r["index"]: r for r in run["rows"]}
    assert list(rows) == ["flat", "ivf", "hnsw", "ivfpq"] and rows["flat"]["recall_at_k"] == 1.0
    assert all(0.0 <= r["recall_at_k"] <= 1.0 and r["queries_per_s"] > 0 for r in rows.values())
    assert rows["ivfpq"]["index_bytes"] < rows["flat"]["index_bytes"] / 4 < rows["hnsw"]["index_bytes"]
    assert rows["ivf"]["options"] == {"index": "ivf", "nlist": 20, "nprobe": 16}
    md = (tmp_path / "ann_cpu.md").read_text()
    assert "| flat | exact |" in md and "1.00x" in md and "3,000 passages" in md
    bench("--n", "2000", "--types", "ivf", "--append")
    assert [r["n"] for r in json.loads((tmp_path / "ann_cpu.json").read_text())["runs"]] == [3000, 2000]
