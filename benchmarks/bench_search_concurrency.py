"""Retrieval batches in flight: DRAGIN throughput against a search backend with a round-trip latency.

A search server (Elasticsearch over the 21M-passage Wikipedia) answers each `_msearch` after a round trip that does
not shrink with the batch. With one retrieval batch in flight, the queries asked for while it runs wait for it and
then for their own batch; with N in flight they leave at once. This times the same DRAGIN run (same engine, same
questions) at each `--concurrency`: BM25 over the bundled corpus behind a fixed `--latency-ms` per call (the
in-process search itself runs one call at a time, under the retriever's lock; the latency is a sleep outside it, as
a server's round trip is), and checks that every setting gives every question the same prediction and retrievals.

    python benchmarks/bench_search_concurrency.py                      # SmolLM2 (embedded), 16 questions
    python benchmarks/bench_search_concurrency.py --model /tmp/random  # any HF directory (make_random_model.py)

Writes benchmarks/results/search_concurrency_<device>[_tail].md (+ .json): questions/s per setting (median of
--reps runs, settings in order then reversed), the ratio to one batch in flight measured in the same process,
retrieval batches and their mean size, the most batches that were in flight at once, the seconds questions spent
waiting for documents, and the questions' own latency (admission to answer: median and max).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from fastrag.eval import BUNDLED, RunOptions, build_engine, read_results, run
from fastrag.provenance import cpu_name, versions
from fastrag.retrieval import make_retriever
from fastrag.retrieval.base import Retriever
from bench_args import positive_int  # noqa: E402  (the script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]


class RoundTrip(Retriever):
    """An in-process retriever behind a round-trip latency per call: `latency_s`, and `slow_s` for every
    `slow_every`-th call (a server's slow tail: a pause, a cold segment). The inner search runs one call at a time
    (the bundled retrievers hold a lock)."""

    def __init__(self, inner: Retriever, latency_s: float, slow_every: int = 0, slow_s: float = 0.0):
        self.inner, self.latency_s, self.slow_every, self.slow_s = inner, latency_s, slow_every, slow_s
        self._lock = threading.Lock()
        self.calls = self.active = self.peak = 0  # peak: the most calls in flight at once (reset per run)

    def search(self, queries, k):
        with self._lock:
            self.calls += 1
            self.active += 1
            self.peak = max(self.peak, self.active)
            n = self.calls
        try:
            time.sleep(self.slow_s if self.slow_every and n % self.slow_every == 0 else self.latency_s)
            return self.inner.search(queries, k)
        finally:
            with self._lock:
                self.active -= 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (embedded) or an HF directory")
    ap.add_argument("--data", default=str(BUNDLED / "hotpotqa_dev20.jsonl"))
    ap.add_argument("--corpus", default=str(BUNDLED / "wiki_passages.jsonl"))
    ap.add_argument("--limit", type=positive_int, default=16)
    ap.add_argument("--batch-size", type=positive_int, default=16)
    ap.add_argument("--latency-ms", type=float, default=100.0, help="round trip of every search call")
    ap.add_argument("--slow-every", type=int, default=0, help="every N-th call takes --slow-ms instead (0: none)")
    ap.add_argument("--slow-ms", type=float, default=2000.0)
    ap.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--reps", type=positive_int, default=1, help="timed runs per setting (settings in order, then reversed)")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--name", default=None,
                    help="file stem of the tables (default: search_concurrency_<device>[_tail])")
    args = ap.parse_args()
    if 1 not in args.concurrency:
        raise SystemExit("--concurrency must include 1 (the baseline the others are compared with)")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = build_engine(args.model, args.batch_size, device=device)
    retriever = RoundTrip(make_retriever("bm25", corpus_path=args.corpus, show_progress=False),
                          args.latency_ms / 1000.0, args.slow_every, args.slow_ms / 1000.0)
    common = dict(method="dragin", dataset="hotpotqa", data=args.data, corpus=args.corpus, model=args.model,
                  limit=args.limit, batch_size=args.batch_size, progress=False)
    per: dict[int, list[dict]] = {c: [] for c in args.concurrency}
    answers: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        # untimed warm-up over a decode batch of questions: first-use costs (spaCy's load, the first prefills, the
        # CPU GEMM's weight packing per batch shape) fall on no setting
        run(RunOptions(**common | {"limit": min(args.limit, args.batch_size)}, output=f"{tmp}/warm"), engine=engine,
            retriever=retriever)
        for rep in range(args.reps):
            # settings in order, then reversed (1 4 4 1 1 4 ...): a drift of the machine falls on each alike
            for c in (args.concurrency if rep % 2 == 0 else args.concurrency[::-1]):
                out = Path(tmp) / f"c{c}_r{rep}"
                retriever.peak = 0
                m = run(RunOptions(**common, output=str(out), search_concurrency=c), engine=engine,
                        retriever=retriever)
                recs = {r.qid: r for r in read_results(out / "results.jsonl")}
                got = {q: (r.prediction, [x.query for x in r.rounds], [x.doc_ids for x in r.rounds])
                       for q, r in recs.items()}
                if c in answers and answers[c] != got:
                    raise SystemExit(f"concurrency {c}: run {rep} answered differently from run 0")
                answers[c] = got
                waits = [r.counters.get("retrieval_wait_s", 0.0) for r in recs.values()]
                per[c].append({"questions_per_s": m["questions_per_s"], "wall_s": m["wall_s"],
                               "batches": m["retrieval"]["batches"], "peak_batches_in_flight": retriever.peak,
                               "mean_batch_size": m["retrieval"]["mean_batch_size"],
                               "retrievals_per_question": m["retrievals_per_question"],
                               "retrieval_wait_s_per_question": sum(waits) / len(waits),
                               "question_latency_s_median": statistics.median(r.wall_s for r in recs.values()),
                               "question_latency_s_max": max(r.wall_s for r in recs.values()), "em": m["em"],
                               "f1": m["f1"]})
                print(f"concurrency {c} run {rep}: {m['questions_per_s']:.3f} q/s, "
                      f"{m['retrieval']['batches']} batches", flush=True)
    same = all(answers[c] == answers[1] for c in args.concurrency)
    base = statistics.median(x["questions_per_s"] for x in per[1])
    rows = []
    for c in args.concurrency:
        med = {k: statistics.median(x[k] for x in per[c]) for k in per[c][0]}
        rows.append({"concurrency": c, **med, "speedup_vs_1": med["questions_per_s"] / base})
    dev_name = (torch.cuda.get_device_name() if device == "cuda"
                else f"CPU {cpu_name()}, {torch.get_num_threads()} threads")
    cmd = "python " + shlex.join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])
    tail = f", every {args.slow_every}th call {args.slow_ms:g} ms" if args.slow_every else ""
    head = (f"# Retrieval batches in flight (DRAGIN, search round trip {args.latency_ms:g} ms{tail})\n\n"
            f"- date: {dt.date.today().isoformat()}\n- device: {dev_name}\n"
            f"- {versions('torch', 'transformers', 'bm25s')}\n"
            f"- model: {args.model}; BM25 (bm25s) over {Path(args.corpus).name} behind a {args.latency_ms:g} ms "
            f"sleep per call{tail} (the search itself one call at a time)\n"
            f"- {args.limit} HotpotQA questions ({Path(args.data).name}), decode batch {args.batch_size}, greedy; "
            f"medians of {args.reps} run(s) per setting (settings in order, then reversed), one "
            f"engine, warmed by an untimed run over {min(args.limit, args.batch_size)} questions\n"
            f"- same predictions, queries and documents at every setting: {'yes' if same else 'NO'}\n"
            f"- command: `{cmd}`\n\n")
    cols = ["concurrency", "questions_per_s", "speedup_vs_1", "wall_s", "batches", "peak_batches_in_flight",
            "mean_batch_size", "retrievals_per_question", "retrieval_wait_s_per_question",
            "question_latency_s_median", "question_latency_s_max", "em", "f1"]
    table = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    for r in rows:
        table += "| " + " | ".join(f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]) for k in cols) + " |\n"
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or ("search_concurrency_" + ("gpu" if device == "cuda" else "cpu")
                         + ("_tail" if args.slow_every else ""))
    (out / f"{name}.md").write_text(head + table)
    (out / f"{name}.json").write_text(json.dumps({"command": cmd, "device": dev_name, "rows": rows, "runs": per,
                                                  "same_answers": same, "latency_ms": args.latency_ms,
                                                  "slow_every": args.slow_every, "slow_ms": args.slow_ms}, indent=1))
    print(head + table)
    if not same:
        raise SystemExit("the settings answered differently (see the table)")


if __name__ == "__main__":
    main()
