"""CPU fp32 GEMM of the model's projections: torch's default GEMM vs oneDNN with a prepacked weight.

Two parts, both timed in one process with the two GEMMs alternated:

1. Each projection shape of the model (default: the embedded SmolLM2-135M; `--shape llama-2-7b` for that model's
   shapes) at row counts of decode (1-32 sequences) and of a prefill chunk (512): median time, achieved GB/s of
   weight read (the weight's bytes over the time: at 512 rows the activations outweigh it), GFLOP/s, and the oneDNN speed-up. The machine's read
   bandwidth and square-matrix rate are measured in the same run for scale. Each shape cycles over enough copies
   of its weight (30 for a layer projection, as many as the model has layers) that the caches do not serve them.
2. A whole decode step of the real SmolLM2 in the engine (batch 1, 8 and 32 sequences, each with ~1.4k tokens of
   context), switching the model between the two GEMMs with `fastrag.model.linear.set_cpu_gemm`.

    python benchmarks/bench_cpu_gemm.py             # writes benchmarks/results/cpu_gemm.md and .json
    python benchmarks/bench_cpu_gemm.py --quick     # fewer repetitions, no engine part
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastrag.model.linear import Linear, onednn_available  # noqa: E402
from fastrag.provenance import cpu_name  # noqa: E402
from bench_args import positive_int  # noqa: E402  (the script's folder is on sys.path)

RESULTS = ROOT / "benchmarks" / "results"

# (name, out_features, in_features, copies per timing cycle) of each projection of the two model shapes
SHAPES = {
    "smollm2-135m": [("qkv", 960, 576, 30), ("o", 576, 576, 30), ("gate_up", 3072, 576, 30),
                     ("down", 576, 1536, 30), ("lm_head", 49152, 576, 2)],
    "llama-2-7b": [("qkv", 12288, 4096, 3), ("o", 4096, 4096, 4), ("gate_up", 22016, 4096, 2),
                   ("down", 4096, 11008, 2), ("lm_head", 32000, 4096, 2)],
}


def _median(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return cpu_name()


def machine_figures(reps: int) -> dict:
    src = torch.empty(1 << 26, dtype=torch.float32).uniform_()  # 256 MiB
    read = src.numel() * 4 / _median(lambda: src.sum(), reps)
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    rate = 2 * n ** 3 / _median(lambda: a @ b, reps)
    return {"read_GBps": read / 1e9, "matmul_GFLOPps": rate / 1e9}


def shape_rows(shape: str, rows: list[int], reps: int) -> list[dict]:
    out = []
    for name, n, k, copies in SHAPES[shape]:
        layers = []
        for i in range(copies):
            lin = Linear(k, n, bias=False).requires_grad_(False)
            torch.nn.init.normal_(lin.weight, std=0.02)
            layers.append(lin)
        for m in rows:
            x = torch.randn(m, k)
            with torch.inference_mode():
                t = {}
                for mode in ("torch", "onednn"):
                    for lin in layers:
                        lin.onednn = mode == "onednn"
                    t[mode] = _median(lambda: [lin(x) for lin in layers], reps) / copies
                err = (layers[0](x) - F.linear(x, layers[0].weight)).abs().max().item()
            wbytes = n * k * 4
            row = {"shape": shape, "proj": name, "out": n, "in": k, "rows": m, "torch_ms": t["torch"] * 1e3,
                   "onednn_ms": t["onednn"] * 1e3, "torch_GBps": wbytes / t["torch"] / 1e9,
                   "onednn_GBps": wbytes / t["onednn"] / 1e9, "onednn_GFLOPps": 2 * m * n * k / t["onednn"] / 1e9,
                   "speedup": t["torch"] / t["onednn"], "max_abs_diff": err}
            print(f"{name:8s} {n}x{k} rows {m:4d}: torch {row['torch_ms']:.3f} ms ({row['torch_GBps']:.1f} GB/s)  "
                  f"onednn {row['onednn_ms']:.3f} ms ({row['onednn_GBps']:.1f} GB/s)  x{row['speedup']:.2f}",
                  flush=True)
            out.append(row)
        del layers
    return out


def _use(linears: list, mode: str) -> None:
    for lin in linears:
        lin.onednn = mode == "onednn"


def engine_rows(batches: list[int], reps: int) -> list[dict]:
    from fastrag.engine import Engine
    from fastrag.model.llama import LlamaModel
    from fastrag.model.loading import load_tokenizer, resolve_model

    hf = resolve_model("smollm2")
    tok = load_tokenizer(hf)
    model = LlamaModel.from_pretrained(hf).eval()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    prefix = " ".join(["The river flows past the old mill and under the stone bridge."] * 70)
    # (the prompt starts with the prefix's ids, so the engine attaches the shared prefix to every sequence)
    own = tok.encode(prefix) + tok.encode(" Question: where is the bridge? " + "Evidence passage words. " * 120)
    out = []
    for B in batches:
        eng = Engine(model, tok, kv_cache_gb=1.0, max_batch=B)
        eng.set_prefix(prefix)
        seqs = [eng.new_sequence() for _ in range(B)]
        for s in seqs:
            eng.start(s, own, 2 * reps + 64)
        while eng.waiting:
            eng.step()
        for mode in ("torch", "onednn"):  # warm-up (packs the weights once)
            _use(linears, mode)
            eng.step()
        times = {"torch": [], "onednn": []}
        for _ in range(reps):
            for mode in ("torch", "onednn"):
                _use(linears, mode)  # (keeps the packed copies: set_cpu_gemm("torch") would free them)
                t = time.perf_counter()
                eng.step()
                times[mode].append(time.perf_counter() - t)
        tt, to = statistics.median(times["torch"]), statistics.median(times["onednn"])
        row = {"batch": B, "context": len(seqs[0].tokens), "torch_step_ms": tt * 1e3,
               "onednn_step_ms": to * 1e3, "speedup": tt / to, "onednn_tokens_per_s": B / to}
        print(f"engine B={B}: torch {tt*1e3:.1f} ms  onednn {to*1e3:.1f} ms  x{tt/to:.2f}", flush=True)
        out.append(row)
        del eng, seqs
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--rows", type=positive_int, nargs="+", default=[1, 8, 32, 512])
    ap.add_argument("--batch", type=positive_int, nargs="+", default=[1, 8, 32], help="engine decode batches")
    ap.add_argument("--reps", type=positive_int, default=9)
    ap.add_argument("--quick", action="store_true", help="3 repetitions, no engine part")
    ap.add_argument("--output", type=Path, default=RESULTS / "cpu_gemm.md")
    args = ap.parse_args()
    if not onednn_available():
        raise SystemExit("this torch build has no oneDNN prepacked linear: nothing to compare")
    reps = 3 if args.quick else args.reps
    fig = machine_figures(reps)
    print(f"machine: read {fig['read_GBps']:.1f} GB/s, fp32 matmul {fig['matmul_GFLOPps']:.0f} GFLOP/s", flush=True)
    shapes = shape_rows(args.shape, args.rows, reps)
    steps = [] if args.quick else engine_rows(args.batch, max(3, reps // 2))
    cmd = "python " + shlex.join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])
    head = (f"# CPU fp32 GEMM: torch's default vs oneDNN with a prepacked weight\n\n"
            f"- date: {dt.date.today().isoformat()}\n"
            f"- device: CPU {cpu_name()}, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}\n"
            f"- measured in the same run: read bandwidth {fig['read_GBps']:.1f} GB/s (sum of 256 MiB), fp32 matmul "
            f"{fig['matmul_GFLOPps']:.0f} GFLOP/s (2048 x 2048)\n- command: `{cmd}`\n"
            f"- medians of {reps} timings; the two GEMMs alternate in one process\n\n")
    t1 = ("## Projections\n\n| shape | projection | weight | rows | torch ms | torch GB/s | oneDNN ms | oneDNN GB/s "
          "| oneDNN GFLOP/s | speed-up | max abs diff |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    t1 += "".join(f"| {r['shape']} | {r['proj']} | {r['out']}x{r['in']} | {r['rows']} | {r['torch_ms']:.3f} | "
                  f"{r['torch_GBps']:.1f} | {r['onednn_ms']:.3f} | {r['onednn_GBps']:.1f} | {r['onednn_GFLOPps']:.1f} | "
                  f"{r['speedup']:.2f} | {r['max_abs_diff']:.1e} |\n" for r in shapes)
    t2 = ""
    if steps:
        t2 = ("\n## Engine decode step (SmolLM2-135M fp32, C++ paged decode attention)\n\n"
              "| batch | context tokens | torch GEMM step ms | oneDNN step ms | speed-up | oneDNN tokens/s |\n"
              "|---|---|---|---|---|---|\n")
        t2 += "".join(f"| {r['batch']} | {r['context']} | {r['torch_step_ms']:.1f} | {r['onednn_step_ms']:.1f} | "
                      f"{r['speedup']:.2f} | {r['onednn_tokens_per_s']:.1f} |\n" for r in steps)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(head + t1 + t2)
    args.output.with_suffix(".json").write_text(json.dumps({"machine": fig, "command": cmd, "projections": shapes,
                                                            "engine_steps": steps}, indent=1))
    print(head + t1 + t2)


if __name__ == "__main__":
    main()
