"""`fastrag` command line: `run` (batch evaluation) and `parity` (engine vs per-question oracle)."""

from __future__ import annotations

import argparse
import json
import sys

from fastrag.data.datasets import DATASETS


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", required=True, help="dynamic-RAG method (see `fastrag methods`)")
    p.add_argument("--dataset", required=True, choices=DATASETS)
    p.add_argument("--data", help="dataset file (formats: see fastrag.data.datasets); "
                   "default for hotpotqa: the 20 bundled dev questions")
    p.add_argument("--corpus", help="passage corpus: jsonl {id,title,text} / {id,contents} or DPR tsv; "
                   "default: the bundled 13.5k-passage Wikipedia corpus")
    p.add_argument("--model", default="smollm2", help="'smollm2' (embedded), an HF directory or a .gguf file")
    p.add_argument("--config", help="the method's config JSON (DRAGIN: the published format; see docs/methods.md, "
                   "docs/beamsearchqa.md); default: the papers' per-dataset values")
    p.add_argument("--limit", type=int, help="first N questions")
    p.add_argument("--batch-size", type=int, default=32, help="questions in flight (decode batch)")
    p.add_argument("--signals", help="signal backend (torch | cpp); default env FASTRAG_SIGNALS_BACKEND or torch")
    p.add_argument("--kv-cache-gb", type=float, default=8.0, help="KV cache pool size")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--output", required=True, help="output directory (results.jsonl, metrics.json)")
    p.add_argument("--no-progress", action="store_true")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fastrag", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    _common(sub.add_parser("run", help="run a method over a dataset; results.jsonl + metrics.json"))
    pp = sub.add_parser("parity", help="engine vs per-question oracle on the same questions; parity.json")
    _common(pp)
    sub.add_parser("methods", help="list the available methods")
    args = ap.parse_args(argv)
    if args.cmd == "methods":
        from fastrag.methods.registry import available, get_method

        for name in available():
            print(f"{name:18s} {get_method(name).description}")
        return 0

    from fastrag.eval import BUNDLED, RunOptions

    try:
        if args.data is None:
            if args.dataset != "hotpotqa":
                raise ValueError(f"--data is required for --dataset {args.dataset} (only hotpotqa has bundled questions)")
            args.data = str(BUNDLED / "hotpotqa_dev20.jsonl")
        args.corpus = args.corpus or str(BUNDLED / "wiki_passages.jsonl")
        opts = RunOptions(method=args.method, dataset=args.dataset, data=args.data, corpus=args.corpus,
                          output=args.output, model=args.model, config=args.config, limit=args.limit,
                          batch_size=args.batch_size, signals=args.signals, kv_cache_gb=args.kv_cache_gb,
                          threads=args.threads, progress=not args.no_progress)
        if args.cmd == "run":
            from fastrag.eval import run

            metrics = run(opts)
            _print_table("fastrag run", metrics)
        else:
            from fastrag.parity import parity

            report = parity(opts)
            _print_table("fastrag parity", {k: v for k, v in report.items() if k != "disagreements"})
    except (FileNotFoundError, PermissionError, ValueError) as e:
        print(f"fastrag: error: {e}", file=sys.stderr)
        return 2
    return 0


def _print_table(title: str, d: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, v in d.items():
        if isinstance(v, dict):
            v = json.dumps(v)
        elif isinstance(v, float):
            v = f"{v:.4g}"
        t.add_row(k, str(v))
    Console().print(t)


if __name__ == "__main__":
    sys.exit(main())
