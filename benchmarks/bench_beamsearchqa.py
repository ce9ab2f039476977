"""BeamSearchQA vs wo-RAG vs SR-RAG on NQ-open, WebQuestions and HotpotQA, and the engine vs the per-question
oracle in the same run.

For each dataset: the engine runs BeamSearchQA (paper defaults K=2, D=2, N=2, S=0.8, B=2, or --config) and each
baseline over the first --limit questions; the BeamSearchQA oracle (plain transformers, one `generate` call at a
time) runs over the first --oracle-limit of them, so the questions/s of both come from the same machine and run,
and its decisions are compared with the engine's on those questions. Writes benchmarks/results/beamsearchqa.md
(+ .json) with EM, F1, LLM calls/question, retrievals/question, questions/s.

    python benchmarks/bench_beamsearchqa.py --limit 200 --oracle-limit 20 --batch-size 32

Each run directory under --output is resumable (`fastrag run` semantics): a killed benchmark recomputes only
missing questions; pass --fresh to re-measure the engine rates from scratch.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch

from fastrag.eval import RunOptions, read_results, run
from fastrag.methods.registry import available, get_method
from fastrag.parity import _rate, compare, method_decisions, run_oracle
from fastrag.provenance import cpu_name, versions

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_args import data_paths  # noqa: E402
SHARED = ROOT.parent / "shared" / "data"
FILES = {
    "nq": Path("nq_open") / "dev_500.jsonl",
    "webq": Path("webquestions") / "test_500.json",
    "hotpotqa": Path("hotpotqa") / "dev_distractor_200.jsonl",
}
DATA = {ds: SHARED / f for ds, f in FILES.items()}
CORPUS = SHARED / "corpus" / "wiki_passages.jsonl"


def use_data_dir(data_dir: str, datasets: list[str]) -> None:
    """Point DATA and CORPUS at data_dir (bench_args.data_paths: a missing file ends the script naming it)."""
    global DATA, CORPUS
    DATA, CORPUS = data_paths("bench_beamsearchqa.py", data_dir, FILES, datasets)


METHOD = "beamsearchqa"
NO_CACHE = "beamsearchqa-no-prefix-caching"  # the same method on an engine without prefix caching


def per_q(results, attr: str) -> float | None:
    ok = [r for r in results if r.error is None]
    return sum(getattr(r, attr) for r in ok) / len(ok) if ok else None


def row_for(method: str, ds: str, out: Path, who: str = "engine") -> dict:
    res = read_results(out / "results.jsonl")
    ok = [r for r in res if r.error is None]
    m = json.loads((out / "metrics.json").read_text()) if (out / "metrics.json").exists() else {}
    calls = per_q(res, "llm_calls")
    return {
        "dataset": ds, "method": method, "side": who, "n": len(res), "errors": len(res) - len(ok),
        "em": sum(r.metrics.get("em", 0.0) for r in ok) / len(ok) if ok else None,
        "f1": sum(r.metrics.get("f1", 0.0) for r in ok) / len(ok) if ok else None,
        # methods that do not count their generate calls leave llm_calls at 0 in their records
        "llm_calls_per_q": calls if calls else None,
        "retrievals_per_q": per_q(res, "retrievals"),
        "prefill_tok_per_q": per_q(res, "prefill_tokens"), "decode_tok_per_q": per_q(res, "decode_tokens"),
        # LLM calls answered by an identical earlier one of the question (the engine's reuse; none for the oracle)
        "reused_calls_per_q": sum(r.counters.get("reused_generations", 0) for r in ok) / len(ok) if ok else None,
        # the engine's rate over all runs that computed its results when their history covers them all (a run
        # killed part-way included: fastrag.eval's runs.jsonl), else the last run's
        "questions_per_s": (_all_runs_rate(m, len(res)) or m.get("questions_per_s")) if who == "engine" else _rate(res),
    }


def _all_runs_rate(m: dict, n: int) -> float | None:
    ar = m.get("all_runs") or {}
    return ar.get("questions_per_s") if ar.get("computed") == n else None


def shown(path: str) -> str:
    """`path` relative to the repository when it lies inside it (tables do not name this machine's folders)."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


def fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def table(rows: list[dict], cols: list[str]) -> str:
    s = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    for r in rows:
        s += "| " + " | ".join(fmt(r.get(c)) for c in cols) + " |\n"
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", nargs="+", default=list(DATA), choices=list(DATA))
    ap.add_argument("--data-dir", default=str(SHARED), help="the evaluation data and corpus (default ../shared/data)")
    ap.add_argument("--limit", type=int, default=200, help="questions per dataset (engine runs)")
    ap.add_argument("--oracle-limit", type=int, default=20,
                    help="questions per dataset for the per-question oracle (the first of the --limit ones)")
    ap.add_argument("--baselines", nargs="*", default=["wo-rag", "sr-rag"],
                    help="registered baseline methods to run beside BeamSearchQA (`fastrag methods`)")
    ap.add_argument("--config", help="BeamSearchQA config JSON (K, D, N, S, B, max tokens); default: the paper's")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "raw" / "bench_beamsearchqa"),
                    help="run directories (resumable); the default is tracked by git so that partial runs survive "
                    "a change of machine")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--fresh", action="store_true", help="delete earlier engine results under --output first")
    ap.add_argument("--report-only", action="store_true", help="compute nothing: tables from --output")
    ap.add_argument("--report", default="beamsearchqa",
                    help="name of the tables under --results (NAME.md, NAME.json): e.g. a separate speed run")
    ap.add_argument("--note", default="", help="a paragraph put under the title (how and where it was run)")
    ap.add_argument("--phases", nargs="+", default=["engine", "oracle", "report"],
                    choices=["engine", "oracle", "report"],
                    help="what this invocation does: the engine runs, the oracle runs, the tables; e.g. the engine "
                    "and the oracle in two processes side by side (one core each), then `--phases report`")
    ap.add_argument("--carry", nargs="*", default=[], metavar="DATASET",
                    help="datasets whose rows are taken from the existing tables (--results/--report .json) "
                    "instead of from --output, e.g. when their run directories are not on this machine; the "
                    "tables say which rows were carried")
    ap.add_argument("--without-prefix-caching", action="store_true",
                    help="also run BeamSearchQA on the engine with prefix caching off (same questions, batch): its "
                    "tokens, rate and decisions against the default engine's")
    args = ap.parse_args()
    for b in args.baselines:
        if b not in available():
            sys.exit(f"baseline method {b!r} is not registered (available: {', '.join(available())}); "
                     "pass --baselines with registered names, or none")
    if args.oracle_limit > args.limit:
        sys.exit("--oracle-limit must not exceed --limit")
    if args.report_only:
        args.phases = ["report"]
    if args.phases != ["report"]:  # (a report tabulates the runs already there)
        use_data_dir(args.data_dir, args.datasets)
    previous = {}
    if args.carry:
        prev_path = Path(args.results) / f"{args.report}.json"
        if not prev_path.exists():
            sys.exit(f"--carry needs the earlier tables in {prev_path}, which do not exist")
        previous = json.loads(prev_path.read_text())
        for ds in args.carry:
            if not any(r["dataset"] == ds for r in previous.get("rows", [])):
                sys.exit(f"--carry {ds}: {prev_path} has no rows for that dataset")

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else \
        f"CPU {cpu_name()} x{torch.get_num_threads()} threads"
    t_start = time.perf_counter()
    rows, speed, parity_rows = [], [], []
    timed_now = {}  # dataset -> (engine questions computed, oracle questions computed) by this invocation
    for ds in args.datasets:
        if ds in args.carry:
            rows += [r for r in previous["rows"] if r["dataset"] == ds]
            speed += [r for r in previous.get("speed", []) if r["dataset"] == ds]
            parity_rows += [r for r in previous.get("parity", []) if r["dataset"] == ds]
            continue
        base = Path(args.output) / ds
        variants = [(METHOD, METHOD, True)] + [(b, b, True) for b in args.baselines]
        if args.without_prefix_caching:
            variants.insert(1, (METHOD, NO_CACHE, False))
        for method, label, caching in variants:
            out = base / label
            if args.fresh and not args.report_only:
                shutil.rmtree(out, ignore_errors=True)
            # a run whose results already cover the questions is kept as it is: rerunning would overwrite its
            # metrics.json (and the rate measured there) with a run that computed nothing
            done = len(read_results(out / "results.jsonl")) >= args.limit and (out / "metrics.json").exists()
            if "engine" in args.phases and not done:
                m = run(RunOptions(method=method, dataset=ds, data=str(DATA[ds]), corpus=str(CORPUS), output=str(out),
                               config=args.config if method == METHOD else None, limit=args.limit,
                               batch_size=args.batch_size, prefix_caching=caching))
                if method == METHOD and caching:
                    timed_now[ds] = (m["computed_this_run"], timed_now.get(ds, (0, 0))[1])
            if "report" in args.phases:
                rows.append(row_for(label, ds, out))
        orc_dir = base / "oracle"
        if args.oracle_limit > 0 and "oracle" in args.phases:
            opts = RunOptions(method=METHOD, dataset=ds, data=str(DATA[ds]), corpus=str(CORPUS), output=str(orc_dir),
                              config=args.config, limit=args.oracle_limit, batch_size=args.batch_size)
            timed_now[ds] = (timed_now.get(ds, (0, 0))[0], run_oracle(opts, orc_dir)[2])
        if "report" not in args.phases:
            continue
        if args.oracle_limit > 0:
            orc = read_results(orc_dir / "results.jsonl")
            o_row = row_for(METHOD, ds, orc_dir, who="oracle")
            e_row = next(r for r in rows if r["dataset"] == ds and r["method"] == METHOD)
            e_rate, o_rate = e_row["questions_per_s"], o_row["questions_per_s"]
            speed.append({"dataset": ds, "engine_n": e_row["n"], "oracle_n": o_row["n"], "engine_q_per_s": e_rate,
                          "oracle_q_per_s": o_rate, "speedup": e_rate / o_rate if e_rate and o_rate else None,
                          "engine_prefill_tok_per_q": e_row["prefill_tok_per_q"],
                          "oracle_prefill_tok_per_q": o_row["prefill_tok_per_q"],
                          "engine_llm_calls_per_q": e_row["llm_calls_per_q"],
                          "engine_reused_calls_per_q": e_row["reused_calls_per_q"],
                          "oracle_llm_calls_per_q": o_row["llm_calls_per_q"],
                          "engine_timed_this_run": timed_now.get(ds, (0, 0))[0],
                          "oracle_timed_this_run": timed_now.get(ds, (0, 0))[1]})
            eng = read_results(base / METHOD / "results.jsonl")
            rep = compare(eng, orc, method_decisions(METHOD))
            parity_rows.append({"dataset": ds, "pair": "engine vs oracle", "n": rep["n"],
                                "agreement": rep["agreement"], "answer_agreement": rep.get("answer_agreement"),
                                "path_agreement": rep.get("path_agreement")})
        if args.without_prefix_caching:  # the engine's decisions with and without prefix caching, all questions
            rep = compare(read_results(base / METHOD / "results.jsonl"),
                          read_results(base / NO_CACHE / "results.jsonl"), method_decisions(METHOD))
            parity_rows.append({"dataset": ds, "pair": "engine vs engine without prefix caching", "n": rep["n"],
                                "agreement": rep["agreement"], "answer_agreement": rep.get("answer_agreement"),
                                "path_agreement": rep.get("path_agreement")})

    if "report" not in args.phases:
        return
    timed = [r for r in speed if r.get("engine_q_per_s") and r.get("oracle_q_per_s")]
    if len(timed) > 1:  # every dataset together: all questions over all the seconds they took, on each side
        e_n, o_n = sum(r["engine_n"] for r in timed), sum(r["oracle_n"] for r in timed)
        e_rate = e_n / sum(r["engine_n"] / r["engine_q_per_s"] for r in timed)
        o_rate = o_n / sum(r["oracle_n"] / r["oracle_q_per_s"] for r in timed)
        speed.append({"dataset": "all", "engine_n": e_n, "oracle_n": o_n, "engine_q_per_s": e_rate,
                      "oracle_q_per_s": o_rate, "speedup": e_rate / o_rate})
    oracle_pairs = [r for r in parity_rows if r["pair"] == "engine vs oracle" and r["n"]]
    if len(oracle_pairs) > 1:  # every dataset's questions together: agreements weighted by their counts
        n_all = sum(r["n"] for r in oracle_pairs)

        def pooled(key):
            vals = [(r[key], r["n"]) for r in oracle_pairs if r.get(key) is not None]
            return sum(v * n for v, n in vals) / sum(n for _, n in vals) if vals else None
        parity_rows.append({"dataset": "all", "pair": "engine vs oracle", "n": n_all, "agreement": pooled("agreement"),
                            "answer_agreement": pooled("answer_agreement"), "path_agreement": pooled("path_agreement")})
    cmd = "python " + shlex.join([str(Path(sys.argv[0]).relative_to(ROOT)) if Path(sys.argv[0]).is_absolute()
                                  else sys.argv[0], *sys.argv[1:]])
    cfg = get_method(METHOD).make_config("nq", args.config)
    res = Path(args.results)
    res.mkdir(parents=True, exist_ok=True)
    md = (
        "# BeamSearchQA vs wo-RAG vs SR-RAG, engine vs per-question oracle\n\n"
        + (f"{args.note}\n\n" if args.note else "")
        + f"- date: {dt.date.today().isoformat()}\n- device: {device}\n"
        f"- {versions('torch', 'transformers', 'triton')}\n"
        "- model: SmolLM2-135M-Instruct (embedded GGUF, fp32, greedy); retriever: BM25 (bm25s) over the 13.5k-passage "
        "corpus in ../shared/data/corpus (HotpotQA/2Wiki paragraphs; NQ-open and WebQuestions have no supporting "
        "corpus here, so their accuracy is a pipeline check, not a claim)\n"
        f"- BeamSearchQA: K={cfg.max_questions}, D={cfg.max_depth}, N={cfg.num_docs}, S={cfg.score_threshold}, "
        f"B={cfg.beam_size}; max new tokens answer/ask/summary/score = {cfg.answer_max_tokens}/{cfg.ask_max_tokens}/"
        f"{cfg.summary_max_tokens}/{cfg.score_max_tokens}\n"
        f"- engine batch {args.batch_size}; oracle on the first {args.oracle_limit} questions of each dataset\n"
        + (f"- report only: tables from the results in {shown(args.output)} (datasets: "
           f"{', '.join(d for d in args.datasets if d not in args.carry)})\n"
           if args.phases == ["report"] else f"- wall time of this benchmark: {time.perf_counter() - t_start:.0f} s\n")
        + (f"- rows carried from the earlier tables (`{previous.get('command', '?').split(' --note')[0]}`, on {previous.get('device', '?')}"
           f"{', ' + previous['date'] if previous.get('date') else ''}): {', '.join(args.carry)}\n"
           if args.carry else "")
        + f"- command: `{cmd}`\n\n"
        "## Accuracy and cost (engine)\n\n"
        + table(rows, ["dataset", "method", "n", "errors", "em", "f1", "llm_calls_per_q", "retrievals_per_q",
                       "prefill_tok_per_q", "decode_tok_per_q", "questions_per_s"])
        + "\nllm_calls_per_q shows — for methods whose records do not count their generate calls.\n"
    )
    if speed:
        same = all(r.get("engine_timed_this_run") == r["engine_n"] and r.get("oracle_timed_this_run") == r["oracle_n"]
                   for r in speed if r["dataset"] != "all")
        md += ("\n## BeamSearchQA: engine vs per-question oracle" + (" (both timed in this run)" if same else "")
               + "\n\n" + ("" if same else "Not all of these rates were measured by this invocation: "
                             "`*_timed_this_run` counts the questions each side computed now; the others are "
                             "records (and their seconds) of an earlier run into the same folders.\n\n")
               + table(speed, list(speed[0])))
    if parity_rows:
        md += ("\n## Decisions compared (final answer and chosen path): engine vs oracle on the oracle's questions"
               + (", engine vs engine without prefix caching on all" if args.without_prefix_caching else "")
               + "\n\n" + table(parity_rows, list(parity_rows[0])))
    (res / f"{args.report}.md").write_text(md)
    (res / f"{args.report}.json").write_text(json.dumps({"rows": rows, "speed": speed, "parity": parity_rows,
                                                       "device": device, "command": cmd,
                                                       "date": dt.date.today().isoformat(),
                                                       "carried": {d: previous.get("command") for d in args.carry}},
                                                      indent=2))
    print(md)


if __name__ == "__main__":
    main()
