"""Roofline benchmark of the fused signal kernels: Triton vs CUDA vs torch (vs C++ on the CPU).

Token signals (decode_signals, greedy) over logits [B, V] for B in {1, 16, 64, 256}, V in {32000, 128256}, and
nucleus sampling (top_p 0.9, the radix-select kernels) at V = 128256; the
decode attention statistics (running max over the generated span, and the QFS row) at H = 32, D = 128, contexts
1k-8k, spans 64-512 (Llama-2-7B's last layer). Each row: median time, achieved GB/s (the fewest bytes the op must
move: each input read once, each output written once) and the fraction of the HBM bandwidth measured in the same
run by a large device-to-device copy. Inputs (logits, and the key cache of the attention ops) rotate among enough
copies to exceed twice the cache, so that it does not serve them.
The target (DESIGN.md "Performance model"): token-signal kernel >= 70% of measured bandwidth at B >= 64.

    python benchmarks/bench_kernels.py                 # GPU: the full sweep; CPU: small shapes, torch vs C++
    python benchmarks/bench_kernels.py --quick         # fewer shapes

Writes benchmarks/results/kernels_<device>.md and .csv.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastrag.provenance import cpu_name, versions  # noqa: E402
from fastrag.signals import BackendUnavailableError, get_backend  # noqa: E402
from fastrag.signals.reference import decode_signals_ref  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"CPU {cpu_name()} ({torch.get_num_threads()} threads)"


def timeit(fn, dev: torch.device, reps: int, warmup: int = 3) -> float:
    """Median seconds of fn() over reps calls (CUDA events on the GPU, perf_counter on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    if dev.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    else:
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_bandwidth(dev: torch.device) -> float:
    """Bytes/s of a large copy, counting bytes read plus bytes written."""
    n = (1 << 30) if dev.type == "cuda" else (1 << 27)
    src = torch.randn(n // 4, device=dev)
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), dev, reps=20 if dev.type == "cuda" else 5)
    return 2 * n / t


def rotating(make, total_bytes: int, one_bytes: int, cap: int = 4096):
    """Several input sets whose sum exceeds total_bytes (so repeated calls do not hit in cache)."""
    k = max(2, min(cap, -(-total_bytes // max(one_bytes, 1))))
    return [make() for _ in range(k)]


def backends(dev: torch.device) -> dict:
    names = ["cuda", "triton", "torch"] if dev.type == "cuda" else ["cpp", "torch"]
    out = {}
    for n in names:
        try:
            be = get_backend(n)
        except BackendUnavailableError as e:
            print(f"# {n}: not available ({e})")
            continue
        if dev.type in be.devices:
            out[n] = be
    return out


def bench_token(dev, bes, bw, Bs, Vs, dtype, reps, cache_bytes, top_p: float | None = None) -> list[dict]:
    """Greedy decode signals, or (top_p) nucleus sampling at temperature 1: the nucleus kernels read a row ten
    times (radix select), so their GB/s, counted for one read, is a tenth of the bytes they actually stream."""
    rows = []
    el = torch.tensor([], dtype=dtype).element_size()
    kernel = "token_signals" if top_p is None else f"token_signals_top_p{top_p}"
    for V in Vs:
        for B in Bs:
            one = B * V * el
            sets = rotating(lambda: (torch.randn(B, V, device=dev) * 3).to(dtype), 2 * cache_bytes, one)
            keys = torch.randint(0, 2**32, (B,), device=dev)
            kw = {} if top_p is None else dict(temperature=1.0, rng_keys=keys, top_p=top_p)
            n = min(B, 4)
            ref = decode_signals_ref(sets[0][:n].cpu(), kw.get("temperature", 0.0), keys[:n].cpu(),
                                     top_p=top_p or 1.0)
            moved = one + B * (8 + 4 * 3)  # logits once + outputs
            for name, be in bes.items():
                res = be.decode_signals(sets[0], **kw)  # correctness spot check on the first rows
                if not torch.equal(res.chosen[:n].cpu(), ref["chosen"]):
                    raise AssertionError(f"{name}: chosen token disagrees with the reference at B={B} V={V}")
                it = iter(range(1 << 30))
                t = timeit(lambda: be.decode_signals(sets[next(it) % len(sets)], **kw), dev, reps)
                rows.append(dict(kernel=kernel, backend=name, B=B, V=V, dtype=str(dtype).split(".")[-1],
                                 time_us=t * 1e6, GBps=moved / t / 1e9, frac_bw=moved / t / bw))
                print(f"{kernel} B={B:4d} V={V:6d} {name:7s} {t * 1e6:9.1f} us {moved / t / 1e9:8.1f} GB/s "
                      f"{moved / t / bw:6.1%}", flush=True)
    return rows


def bench_attn(dev, bes, bw, Bs, ctxs, spans, dtype, reps, cache_bytes, H=32, D=128, bs=16) -> list[dict]:
    rows = []
    el = torch.tensor([], dtype=dtype).element_size()
    for B in Bs:
        for ctx in ctxs:
            NB = ctx // bs
            nb_pool = B * NB
            one = H * nb_pool * bs * D * el
            k_caches = rotating(lambda: torch.randn(H, nb_pool * bs, D, device=dev).to(dtype), 2 * cache_bytes, one)
            bt = torch.randperm(nb_pool, device=dev).reshape(B, NB)
            ctx_lens = torch.full((B,), ctx, dtype=torch.int64, device=dev)
            q = torch.randn(B, H, D, device=dev).to(dtype)
            lse = torch.full((B, H), 8.0, device=dev)
            for S in spans:
                start = ctx_lens - S
                amax = torch.rand(B, H, S, device=dev)
                for want_row in (False, True):
                    # keys read once (the span's, or with the row all ctx of them, the span's among them), q, the
                    # running max read and written, and the row written
                    moved = B * H * (ctx if want_row else S) * D * el + 2 * B * H * S * 4 + B * H * D * el
                    if want_row:
                        moved += B * ctx * 4
                    for name, be in bes.items():
                        it = iter(range(1 << 30))

                        def call():
                            be.attn_decode_update(q, k_caches[next(it) % len(k_caches)], bt, ctx_lens, start, lse,
                                                  bs, D**-0.5, amax, want_row=want_row)
                        t = timeit(call, dev, reps)
                        kern = "attn_decode+row" if want_row else "attn_decode"
                        rows.append(dict(kernel=kern, backend=name, B=B, ctx=ctx, span=S,
                                         dtype=str(dtype).split(".")[-1], time_us=t * 1e6, GBps=moved / t / 1e9,
                                         frac_bw=moved / t / bw))
                        print(f"{kern:15s} B={B:3d} ctx={ctx:5d} span={S:4d} {name:7s} {t * 1e6:9.1f} us "
                              f"{moved / t / 1e9:8.1f} GB/s {moved / t / bw:6.1%}", flush=True)
    return rows


def write(rows, dev, bw, args, note: str) -> Path:
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    tag = "gpu" if dev.type == "cuda" else "cpu"
    md = results / f"kernels_{tag}.md"
    lines = [f"# Signal kernels: roofline ({tag})", "",
             f"- device: {device_name(dev)}", f"- date: {dt.date.today().isoformat()}",
             f"- {versions('torch', 'triton')}; measured copy bandwidth: {bw / 1e9:.1f} GB/s (read + write)",
             f"- command: `{shlex.join(['python', 'benchmarks/bench_kernels.py', *sys.argv[1:]])}`", f"- {note}", "",
             "GB/s counts the fewest bytes each op must move (inputs once, outputs once); frac = GB/s / measured "
             "copy bandwidth. Median over repeated calls, inputs rotated through buffers larger than the cache.", ""]
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        sel = [r for r in rows if r["kernel"] == kernel]
        keys = [k for k in sel[0] if k not in ("kernel",)]
        lines += [f"## {kernel}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        for r in sel:
            lines.append("| " + " | ".join(f"{r[k]:.1%}" if k == "frac_bw" else
                                           (f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]))
                                           for k in keys) + " |")
        lines.append("")
    md.write_text("\n".join(lines))
    with open(results / f"kernels_{tag}.csv", "w", newline="") as f:
        keys = sorted({k for r in rows for k in r})
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--note", default="", help="extra line for the results file (e.g. the machine's load)")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"), help="folder of the result tables")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bes = backends(dev)
    bw = measure_bandwidth(dev)
    print(f"# {device_name(dev)}: copy bandwidth {bw / 1e9:.1f} GB/s; backends {list(bes)}")
    if dev.type == "cuda":
        reps = args.reps or 50
        cache = torch.cuda.get_device_properties(dev).L2_cache_size
        Bs, Vs = ([1, 64], [128256]) if args.quick else ([1, 16, 64, 256], [32000, 128256])
        rows = bench_token(dev, bes, bw, Bs, Vs, torch.bfloat16, reps, cache)
        rows += bench_token(dev, bes, bw, [1, 64], [128256], torch.bfloat16, reps, cache, top_p=0.9)
        rows += bench_attn(dev, bes, bw, [1, 16, 64], [1024, 4096, 8192] if not args.quick else [1024],
                           [64, 512], torch.bfloat16, reps, cache)
        note = "GPU run: bf16 logits and keys."
    else:
        reps = args.reps or 5
        Bs, Vs = ([1, 16], [32000]) if args.quick else ([1, 16, 64], [32000, 128256])
        rows = bench_token(dev, bes, bw, Bs, Vs, torch.float32, reps, 64 << 20)
        rows += bench_token(dev, bes, bw, [1, 16], [128256], torch.float32, reps, 64 << 20, top_p=0.9)
        rows += bench_attn(dev, bes, bw, [1, 16], [1024, 4096] if not args.quick else [1024], [64, 512],
                           torch.float32, reps, 64 << 20)
        note = ("CPU run, small shapes (no B=256, no 8k context), fp32; Triton/CUDA need a GPU: GPU not measured. "
                "Torch vs the C++ CPU kernels only.")
    if args.note:
        note += " " + args.note
    print(f"wrote {write(rows, dev, bw, args, note)}")


if __name__ == "__main__":
    main()
