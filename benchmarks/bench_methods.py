"""Every method on the engine: EM / F1 (accuracy for StrategyQA), retrievals, tokens prefilled and decoded per
question and questions/s, on HotpotQA, 2WikiMultihopQA and StrategyQA from ../shared/data, SmolLM2 on CPU.

One command reproduces `benchmarks/results/methods.md` (+ methods.json):

    python benchmarks/bench_methods.py --limit 200

Each (method, dataset) run is a resumable `fastrag run` directory under --output (results.jsonl + metrics.json), so
an interrupted benchmark continues where it stopped; `--report-only` rebuilds the table from what is on disk.
The table also reports streaming DRAGIN against reference DRAGIN on the same questions: decoded tokens per
question (ratio) and EM/F1 with a paired bootstrap 95% interval of the difference (noise level).
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import random
import shlex
import sys
import time
from pathlib import Path

import torch

from fastrag.eval import RunOptions, build_engine, read_results, run
from fastrag.provenance import cpu_name

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_args import data_paths  # noqa: E402
SHARED = ROOT.parent / "shared" / "data"
FILES = {
    "hotpotqa": Path("hotpotqa") / "dev_distractor_200.jsonl",
    "2wikimultihopqa": Path("2wikimultihopqa") / "dev_sample_200.jsonl",
    "strategyqa": Path("strategyqa") / "train_first1000.json",
}
DATA = {ds: SHARED / f for ds, f in FILES.items()}
CORPUS = SHARED / "corpus" / "wiki_passages.jsonl"


def use_data_dir(data_dir: str, datasets: list[str], check: bool = True) -> None:
    """Point DATA and CORPUS at data_dir (bench_args.data_paths: with `check`, a missing file ends the script naming
    it)."""
    global DATA, CORPUS
    DATA, CORPUS = data_paths("bench_methods.py", data_dir, FILES, datasets, check)


METHODS = ["wo-rag", "sr-rag", "fl-rag", "fs-rag", "token-rag", "flare", "flare-explicit", "flare-instruct",
           "dragin", "dragin-streaming"]


def paired_diff(a: list[float], b: list[float], n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """mean(b - a) and its bootstrap 95% interval over questions."""
    d = [y - x for x, y in zip(a, b)]
    if not d:
        return float("nan"), float("nan"), float("nan")
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(d) for _ in d) / len(d) for _ in range(n_boot))
    return sum(d) / len(d), means[int(0.025 * n_boot)], means[int(0.975 * n_boot)]


def complete(out: Path, ds: str, limit: int) -> bool:
    """The run in `out` already covers every question (its metrics.json is kept: a rerun would time nothing)."""
    m = out / "metrics.json"
    return m.exists() and json.loads(m.read_text())["n"] >= wanted(ds, limit)


@functools.lru_cache(maxsize=None)
def examples(ds: str, limit: int) -> tuple:
    """The dataset's first `limit` questions, read once per report."""
    from fastrag.data.datasets import load_examples

    return tuple(load_examples(ds, DATA[ds], limit=limit))


def wanted(ds: str, limit: int) -> int:
    """How many questions a complete run of `ds` holds (the dataset may have fewer than --limit)."""
    return len(examples(ds, limit))


def majority(ds: str, limit: int) -> tuple[str, float]:
    """The most common gold answer of the dataset's first `limit` questions and the accuracy of always giving it
    (the floor a yes/no dataset's accuracy must be read against)."""
    from collections import Counter

    golds = Counter(ex.answers[0].strip().lower() for ex in examples(ds, limit) if ex.answers)
    label, count = golds.most_common(1)[0]
    return label, count / sum(golds.values())


def rate(mt: dict) -> str:
    """Questions/s over all runs when their history covers every question, else the last run's (and its count)."""
    ar = mt.get("all_runs") or {}
    if ar.get("computed") == mt["n"] and ar.get("questions_per_s"):
        return fmt(ar["questions_per_s"], 3)
    if mt["computed_this_run"] == mt["n"]:  # one run computed them all
        return fmt(mt["questions_per_s"], 3)
    return f"{fmt(mt['questions_per_s'], 3)} ({mt['computed_this_run']} q)"


def fmt(v, nd=3):
    return "—" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    ap.add_argument("--datasets", nargs="+", default=list(DATA), choices=list(DATA))
    ap.add_argument("--data-dir", default=str(SHARED), help="the evaluation data and corpus (default ../shared/data)")
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--kv-cache-gb", type=float, default=2.0, help="KV pool (the engine allocates it up front)")
    ap.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "raw" / "bench_methods"),
                    help="run directories (resumable); the default is tracked by git so that partial runs survive "
                    "a change of machine")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--report-only", action="store_true", help="compute nothing; tabulate what --output holds")
    ap.add_argument("--name", default="methods", help="result file stem under --results (default: methods)")
    ap.add_argument("--note", default="", help="a line added under the table's header (e.g. how it was run)")
    ap.add_argument("--carry", action="store_true",
                    help="runs whose directories are not under --output are taken, complete, from the existing "
                    "--results/--name .json (e.g. measured on another machine or in an earlier checkout) instead of "
                    "being recomputed; the table marks them")
    args = ap.parse_args()
    use_data_dir(args.data_dir, args.datasets, check=not args.report_only)  # (a report reads the runs' folders)
    previous, prev_streaming = {}, []
    if args.carry:
        prev_path = Path(args.results) / f"{args.name}.json"
        if not prev_path.exists():
            sys.exit(f"--carry needs the earlier results in {prev_path}, which do not exist")
        prev = json.loads(prev_path.read_text())
        # the older layout was the runs alone, keyed "dataset/method"
        previous = prev.get("runs", {}) if "runs" in prev else {k: v for k, v in prev.items() if "/" in k}
        prev_streaming = prev.get("streaming", [])

    from fastrag.retrieval.bm25 import BM25Retriever

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else \
        f"CPU {cpu_name()} x{torch.get_num_threads()} threads"
    eng = ret = None
    rows, metrics, carried = [], {}, set()
    for ds in args.datasets:
        for m in args.methods:
            out = Path(args.output) / ds / m
            old = previous.get(f"{ds}/{m}")
            if not (out / "metrics.json").exists() and old and old["n"] >= wanted(ds, args.limit):
                metrics[(ds, m)] = old
                rows.append((ds, m, old))
                carried.add((ds, m))
                continue
            if not args.report_only and not complete(out, ds, args.limit):
                if eng is None:
                    eng = build_engine(args.model, args.batch_size, kv_cache_gb=args.kv_cache_gb)
                    ret = BM25Retriever(str(CORPUS))
                eng.clear_prefixes()  # each method has its own shared prefix; give the last one back
                t = time.perf_counter()
                opts = RunOptions(method=m, dataset=ds, data=str(DATA[ds]), corpus=str(CORPUS), output=str(out),
                                  model=args.model, limit=args.limit, batch_size=args.batch_size, progress=True)
                run(opts, engine=eng, retriever=ret)
                print(f"{ds} {m}: {time.perf_counter() - t:.0f}s", flush=True)
            if not (out / "metrics.json").exists():
                continue
            mt = json.loads((out / "metrics.json").read_text())
            metrics[(ds, m)] = mt
            rows.append((ds, m, mt))

    lines = [f"# Methods on the engine ({args.model}, {device}, {dt.date.today()})", "",
             f"Command: `python benchmarks/bench_methods.py {shlex.join(sys.argv[1:])}`; "
             f"retriever bm25s over {CORPUS.name}; greedy decoding; per-dataset paper defaults (docs/methods.md). "
             "q/s is the rate over every run that computed the results (metrics.json all_runs: questions over the "
             "seconds each run spent computing, a run killed part-way included); where earlier runs left no "
             "record, the rate of the last run alone, with the questions it computed in brackets.",
             *(["", args.note] if args.note else []),
             *(["", "† carried complete from the earlier results file (their run directories are not in this "
                "checkout): " + ", ".join(f"{d}/{m}" for d, m, _ in rows if (d, m) in carried) + "."] if carried else []), "",
             "| dataset | method | n | EM | F1 / acc | retrievals/q | prefilled/q | decoded/q | q/s | errors |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for ds, m, mt in rows:
        score = mt["accuracy"] if ds == "strategyqa" else mt["f1"]
        lines.append(f"| {ds} | {m}{' †' if (ds, m) in carried else ''} | {mt['n']} | {fmt(mt['em'])} | {fmt(score)} | "
                     f"{fmt(mt['retrievals_per_question'], 2)} | {fmt(mt['prefill_tokens_per_question'], 0)} | "
                     f"{fmt(mt['decode_tokens_per_question'], 0)} | {rate(mt)} | {mt['errors']} |")
    if any(ds == "strategyqa" for ds, _, _ in rows):
        label, acc = majority("strategyqa", args.limit)
        lines += ["", f"StrategyQA is yes/no: always answering \"{label}\" (the majority label of these "
                  f"{wanted('strategyqa', args.limit)} questions) scores {acc:.3f}."]
    lines += ["", "## Streaming DRAGIN vs reference DRAGIN (same questions)", "",
              "| dataset | questions | decoded/q reference | decoded/q streaming | ratio | EM diff [95% CI] | "
              "F1 diff [95% CI] |",
              "|---|---|---|---|---|---|---|"]
    streaming = []
    for ds in args.datasets:
        a_dir, b_dir = Path(args.output) / ds / "dragin", Path(args.output) / ds / "dragin-streaming"
        a = {r.qid: r for r in read_results(a_dir / "results.jsonl") if r.error is None}
        b = {r.qid: r for r in read_results(b_dir / "results.jsonl") if r.error is None}
        common = [q for q in a if q in b]
        if not common:
            row = next((r for r in prev_streaming if r["dataset"] == ds), None)
            if row is None or (ds, "dragin") not in carried or (ds, "dragin-streaming") not in carried:
                continue
            mark = " †"
        else:
            da = sum(a[q].decode_tokens for q in common) / len(common)
            db = sum(b[q].decode_tokens for q in common) / len(common)
            key = "accuracy" if ds == "strategyqa" else "f1"
            em = paired_diff([a[q].metrics["em"] for q in common], [b[q].metrics["em"] for q in common])
            f1 = paired_diff([a[q].metrics[key] for q in common], [b[q].metrics[key] for q in common])
            row = {"dataset": ds, "questions": len(common), "decoded_reference": da, "decoded_streaming": db,
                   "ratio": db / da, "em_diff": list(em), "f1_diff": list(f1)}
            mark = ""
        streaming.append(row)
        em, f1 = row["em_diff"], row["f1_diff"]
        lines.append(f"| {ds}{mark} | {row['questions']} | {row['decoded_reference']:.1f} | "
                     f"{row['decoded_streaming']:.1f} | {row['ratio']:.3f} | {em[0]:+.3f} [{em[1]:+.3f}, {em[2]:+.3f}] | "
                     f"{f1[0]:+.3f} [{f1[1]:+.3f}, {f1[2]:+.3f}] |")
    res = Path(args.results)
    res.mkdir(parents=True, exist_ok=True)
    (res / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    (res / f"{args.name}.json").write_text(json.dumps({"runs": {f"{d}/{m}": v for (d, m), v in metrics.items()},
                                                        "streaming": streaming}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
