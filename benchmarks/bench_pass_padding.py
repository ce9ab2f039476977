"""How many rows of DRAGIN's attention passes are padding: the rows the padded pass computes and the packed one
(`last_layer_qk` with host lengths, the engine's call through the paged prefill kernel) does not.

Runs DRAGIN through the engine (a model directory, e.g. the tiny random model of make_random_model.py, on this
machine's device), records the lengths of every `Engine.attention_passes_launch`, and groups them as the engine does
(sorted by length, up to --budget padded tokens a call) to count real and padded rows. Writes
benchmarks/results/pass_padding_<tag>.md.

    python benchmarks/make_random_model.py --shape tiny --out /tmp/fastrag_model_tiny
    python benchmarks/bench_pass_padding.py --model /tmp/fastrag_model_tiny --limit 48
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
FILES = {"hotpotqa": "hotpotqa/dev_distractor_200.jsonl", "2wikimultihopqa": "2wikimultihopqa/dev_first1000.json",
         "strategyqa": "strategyqa/train_first1000.json"}


def grouped_rows(calls: list[list[int]], budget: int) -> tuple[int, int, int]:
    """(real rows, padded rows, forward calls) of passes with these lengths, grouped as the engine groups them."""
    real = padded = forwards = 0
    for lens in calls:
        order = sorted(lens)
        i = 0
        while i < len(order):
            j, t = i, 0
            while j < len(order) and (j - i + 1) * max(t, order[j]) <= budget:
                t = max(t, order[j])
                j += 1
            j = max(j, i + 1)
            t = max(order[i:j])
            real += sum(order[i:j])
            padded += (j - i) * t
            forwards += 1
            i = j
    return real, padded, forwards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="an HF model directory (make_random_model.py)")
    ap.add_argument("--data-dir", default=str(SHARED))
    ap.add_argument("--datasets", nargs="+", default=list(FILES), choices=list(FILES))
    ap.add_argument("--limit", type=int, default=48, help="questions per dataset (also the batch size)")
    ap.add_argument("--budget", type=int, default=4096, help="padded tokens a pass call (the engine's "
                    "max_prefill_tokens)")
    ap.add_argument("--output", default="/tmp/fastrag_pass_padding")
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()

    import fastrag.engine as engine_mod
    from fastrag.eval import RunOptions, run

    calls: list[list[int]] = []
    launch = engine_mod.Engine.attention_passes_launch

    def recording(self, seqs, kind):
        calls.append([len(s) for s in seqs])
        return launch(self, seqs, kind)

    engine_mod.Engine.attention_passes_launch = recording
    data = Path(args.data_dir)
    rows = []
    for ds in args.datasets:
        calls.clear()
        out = Path(args.output) / ds
        shutil.rmtree(out, ignore_errors=True)
        run(RunOptions(method="dragin", dataset=ds, data=str(data / FILES[ds]),
                       corpus=str(data / "corpus" / "wiki_passages.jsonl"), output=str(out), limit=args.limit,
                       batch_size=args.limit, model=args.model))
        real, padded, forwards = grouped_rows(calls, args.budget)
        rows.append((ds, len(calls), sum(map(len, calls)), forwards, real, padded))
        print(f"{ds}: {len(calls)} pass launches, {real} real rows of {padded} padded "
              f"({100 * (padded - real) / max(padded, 1):.1f}% padding)", flush=True)
    res = Path(args.results)
    res.mkdir(parents=True, exist_ok=True)
    lines = [f"# Padding rows in DRAGIN's attention passes ({args.tag})", "",
             f"- date: {dt.date.today().isoformat()}; model: {args.model}; {args.limit} questions per dataset, batch "
             f"{args.limit}; passes grouped as the engine groups them, up to {args.budget} padded tokens a call",
             f"- command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`",
             "- padded rows: what `last_layer_qk` computes without the host lengths (B x T a call); real rows: what "
             "the packed call computes", "",
             "| dataset | pass launches | sequences | forward calls | real rows | padded rows | padding share |",
             "|---|---|---|---|---|---|---|"]
    for ds, launches, seqs, forwards, real, padded in rows:
        lines.append(f"| {ds} | {launches} | {seqs} | {forwards} | {real:,} | {padded:,} | "
                     f"{100 * (padded - real) / max(padded, 1):.1f}% |")
    path = res / f"pass_padding_{args.tag}.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
