"""Decode-step time of the real SmolLM2 on the CPU: C++ paged decode attention vs the torch cascade path.

Each sequence holds a shared prefix of ~1k tokens (read once per step by the torch path) and ~600 own tokens,
like a DRAGIN retrieval round. Both paths are timed alternately in one process (medians of `--reps` steps).
Writes benchmarks/results/decode_step_cpu.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from fastrag.engine import Engine
from fastrag.model.llama import LlamaModel
from fastrag.model.loading import load_tokenizer, resolve_model
from fastrag.provenance import cpu_name
from bench_args import positive_int  # noqa: E402  (the script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=positive_int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--reps", type=positive_int, default=8)
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"), help="folder of the result tables")
    args = ap.parse_args()
    hf = resolve_model("smollm2")
    tok = load_tokenizer(hf)
    model = LlamaModel.from_pretrained(hf).eval()
    native = model.native_decode
    if native is None:
        raise SystemExit("fastrag._C is not built: pip install --no-build-isolation -e .")
    prefix = " ".join(["The river flows past the old mill and under the stone bridge."] * 70)
    rows = []
    for B in args.batch:
        eng = Engine(model, tok, kv_cache_gb=1.0, max_batch=B)
        eng.set_prefix(prefix)
        own = tok.encode(prefix) + tok.encode(" Question: where is the bridge? " + "Evidence passage words. " * 120)
        seqs = [eng.new_sequence() for _ in range(B)]
        for s in seqs:
            eng.start(s, own, 2 * args.reps + 66)
        while eng.waiting:  # prefill every sequence first (in groups bounded by max_prefill_tokens)
            eng.step()
        times = {"torch": [], "native": []}
        for name in ("torch", "native"):  # one untimed step per path: first-call costs stay out of the medians
            model.native_decode = native if name == "native" else None
            eng.step()
        for _ in range(args.reps):
            for name in ("torch", "native"):
                model.native_decode = native if name == "native" else None
                t = time.perf_counter()
                eng.step()
                times[name].append(time.perf_counter() - t)
        model.native_decode = native
        ctx = len(seqs[0].tokens)
        t_t, t_n = statistics.median(times["torch"]), statistics.median(times["native"])
        rows.append((B, ctx, t_t * 1e3, t_n * 1e3, t_t / t_n, B / t_n))
        print(f"B={B} ctx={ctx}: torch {t_t*1e3:.1f} ms  native {t_n*1e3:.1f} ms  x{t_t/t_n:.2f}", flush=True)
    head = (f"# CPU decode step: C++ paged decode attention vs torch cascade (SmolLM2-135M fp32)\n\n"
            f"- date: {dt.date.today().isoformat()}\n- device: CPU {cpu_name()} x{torch.get_num_threads()} "
            f"threads, torch {torch.__version__}\n"
            f"- command: `python benchmarks/bench_cpu_decode_step.py {shlex.join(sys.argv[1:])}`\n"
            f"- context per sequence: shared prefix {eng.prefix.length} tokens + own tokens; medians of "
            f"{args.reps} steps per path (after one untimed step each), paths alternated in one process\n\n")
    table = "| batch | context tokens | torch step ms | native step ms | speed-up | native tokens/s |\n|---|---|---|---|---|---|\n"
    table += "".join(f"| {b} | {c} | {a:.1f} | {n:.1f} | {r:.2f} | {tps:.1f} |\n" for b, c, a, n, r, tps in rows)
    out = Path(args.results) / "decode_step_cpu.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(head + table)
    print(head + table)


if __name__ == "__main__":
    main()
