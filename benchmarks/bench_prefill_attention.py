"""Masked prefill attention with grouped-query heads: one SDPA call with `enable_gqa` against keys and values
repeated to every query head (`FASTRAG_PREFILL_GQA=expand`), for the attention shapes of the engine's prefills and
DRAGIN's attention passes.

Why: the engine's prefill and attention-pass attention carries an explicit mask (padding, the shared prefix, causal
order). In torch <= 2.13 the fused CUDA kernels take either an explicit mask (memory-efficient attention) or grouped
heads (flash), not both, so a masked call with grouped heads may run the math kernel, which writes the whole score
matrix to memory. Repeating the keys and values costs a copy of them and lets a fused kernel take the call. Which
is faster depends on the device and the torch build: this measures it, and lists for each form the SDPA backends
that accept the call (each tried alone under `torch.nn.attention.sdpa_kernel`).

    python benchmarks/bench_prefill_attention.py            # writes benchmarks/results/prefill_attention_<device>.md

Shapes: SmolLM2-135M (9 query / 3 kv heads, head dim 64, the embedded model), a Llama-3-8B-like GQA model (32 / 8,
128) and Llama-2-7B (32 / 32, 128; no grouped heads: both forms are the same call, a control). Cases: a prefill
bucket (12 sequences of 300 new tokens after a 1,536-token demo prefix and their own 300), one long prompt (2,048
new tokens after the prefix) and a batch of attention passes (32 generations of 128 tokens, causal, no prefix).
bf16 on a GPU, float32 on the CPU. Medians of `--reps` timed calls after warm-up.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastrag.provenance import cpu_name  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

SHAPES = {"smollm2-135m": (9, 3, 64), "llama3-8b-gqa": (32, 8, 128), "llama2-7b": (32, 32, 128)}
# name: (sequences, new tokens each, keys each = shared prefix + own context, causal over the last T keys)
CASES = {"prefill bucket": (12, 300, 1536 + 300), "long prompt": (1, 2048, 1536 + 2048),
         "attention passes": (32, 128, 128)}


def _inputs(B, H, Hkv, T, S, D, dev, dtype, gen):
    q = torch.randn(B, H, T, D, device=dev, dtype=dtype, generator=gen)
    k = torch.randn(B, Hkv, S, D, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(B, Hkv, S, D, device=dev, dtype=dtype, generator=gen)
    kpos = torch.arange(S, device=dev)
    qpos = torch.arange(T, device=dev) + (S - T)
    mask = (kpos.view(1, S) <= qpos.view(T, 1)).expand(B, 1, T, S)
    return q, k, v, mask


def _accepting(fn, dev) -> list[str]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"] if dev.type == "cuda" \
        else ["FLASH_ATTENTION", "MATH"]
    ok = []
    for n in names:
        b = getattr(SDPBackend, n, None)
        if b is None:
            continue
        try:
            with sdpa_kernel([b]):
                fn()
            ok.append(n.split("_")[0].lower())
        except RuntimeError:
            pass
    return ok


def _time(fn, reps, dev) -> float:
    for _ in range(2):
        fn()
    ts = []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def run(reps: int, shapes: list[str], cases: list[str], on_row=None) -> list[dict]:
    """Every (shape, case) cell; `on_row(rows)` after each, so a crash in a later cell keeps the earlier ones."""
    from fastrag.model.llama import masked_attention

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for sname in shapes:
        H, Hkv, D = SHAPES[sname]
        for cname in cases:
            B, T, S = CASES[cname]
            args = _inputs(B, H, Hkv, T, S, D, dev, dtype, gen)
            native = functools.partial(masked_attention, *args, expand=False)
            expand = functools.partial(masked_attention, *args, expand=True)
            # the same q, k, v without a mask (every query sees every key): what a fused kernel that needs no
            # explicit mask (flash) costs at this shape, the price of the mask beside it
            unmasked = functools.partial(torch.nn.functional.scaled_dot_product_attention, *args[:3],
                                         enable_gqa=H != Hkv)
            with torch.inference_mode():
                a, b = native(), expand()
                err = float((a.float() - b.float()).abs().max())
                tn, te = _time(native, reps, dev), _time(expand, reps, dev)
                tu = _time(unmasked, reps, dev)
                acc_u = _accepting(unmasked, dev)
                acc_n, acc_e = _accepting(native, dev), _accepting(expand, dev)
            flops = 4 * B * H * T * S * D  # both GEMMs over the full (masked) score matrix
            rows.append({"shape": sname, "heads": f"{H}/{Hkv}", "head_dim": D, "case": cname, "B": B, "T": T,
                         "S": S, "native_ms": tn * 1e3, "expand_ms": te * 1e3, "native_over_expand": tn / te,
                         "native_tflops": flops / tn / 1e12, "expand_tflops": flops / te / 1e12,
                         "tokens_per_s_native": B * T / tn, "tokens_per_s_expand": B * T / te,
                         "native_backends": acc_n, "expand_backends": acc_e, "max_abs_diff": err,
                         "unmasked_ms": tu * 1e3, "native_over_unmasked": tn / tu, "unmasked_backends": acc_u})
            del args, native, expand, unmasked
            if on_row is not None:
                on_row(rows)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=None, help="timed calls per cell (default 20 on a GPU, 5 on a CPU)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--note", default="", help="what else ran on the machine")
    ap.add_argument("--results", default=str(RESULTS), help="folder of the result tables")
    args = ap.parse_args()
    results = Path(args.results)
    gpu = torch.cuda.is_available()
    reps = args.reps or (20 if gpu else 5)
    device = torch.cuda.get_device_name() if gpu else \
        f"CPU {cpu_name()} x{torch.get_num_threads()} threads"
    cmd = "python benchmarks/bench_prefill_attention.py " + shlex.join(sys.argv[1:])
    stem = f"prefill_attention_{'gpu' if gpu else 'cpu'}"
    total = len(args.shapes) * len(args.cases)
    rows = run(reps, args.shapes, args.cases,  # the tables are written after every cell: a crash keeps the rest
               on_row=lambda rows: _write(rows, stem, device, gpu, reps, cmd, args.note, partial=len(rows) < total,
                                          results=results))
    print((results / f"{stem}.md").read_text())
    print(f"wrote {results / stem}.md ({len(rows)} of {total} cells)")
    return 0


def _write(rows: list[dict], stem: str, device: str, gpu: bool, reps: int, cmd: str, note: str,
           partial: bool, results: Path = RESULTS) -> None:
    lines = [
        f"# Masked prefill attention with grouped-query heads: SDPA enable_gqa vs repeated keys ({device})", "",
        f"- date: {dt.date.today()}; torch {torch.__version__}; "
        f"{'bf16' if gpu else 'float32'}; {reps} timed calls per cell (median); command: `{cmd.strip()}`",
        f"- other load: {note or 'none stated'}",
        *([f"- PARTIAL: {len(rows)} cells so far (the run was still going, or stopped here)"] if partial else []),
        "- native: one SDPA call with `enable_gqa` (the engine's default on a CPU); expand: keys and values repeated to every "
        "query head (the default on CUDA devices; `FASTRAG_PREFILL_GQA=expand` everywhere). backends: those that accept the call when tried alone. "
        "TFLOP/s counts both GEMMs over the whole masked score matrix. unmasked: the same q, k, v with no mask "
        "(every query sees every key, more work than the masked call): the time of a kernel that needs no explicit "
        "mask; native / unmasked well above 1 means the mask, not the attention, is what costs.", "",
        "| shape (heads q/kv, dim) | case | B x T new, keys | native ms | expand ms | native / expand | "
        "native TFLOP/s | expand TFLOP/s | native backends | expand backends | max abs diff | unmasked ms | "
        "native / unmasked | unmasked backends |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} ({r['heads']}, {r['head_dim']}) | {r['case']} | {r['B']} x {r['T']}, {r['S']} | "
            f"{r['native_ms']:.3f} | {r['expand_ms']:.3f} | {r['native_over_expand']:.2f} | "
            f"{r['native_tflops']:.2f} | {r['expand_tflops']:.2f} | {', '.join(r['native_backends']) or 'none'} | "
            f"{', '.join(r['expand_backends']) or 'none'} | {r['max_abs_diff']:.1e} | {r['unmasked_ms']:.3f} | "
            f"{r['native_over_unmasked']:.2f} | {', '.join(r['unmasked_backends']) or 'none'} |")
    lines.append("")
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{stem}.md").write_text("\n".join(lines))
    (results / f"{stem}.json").write_text(json.dumps({"device": device, "date": str(dt.date.today()),
                                                      "torch": torch.__version__, "command": cmd.strip(),
                                                      "partial": partial, "rows": rows}, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
