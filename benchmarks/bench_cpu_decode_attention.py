"""The C++ paged decode attention on the CPU against the machine's read bandwidth and a torch baseline.

Each sequence's keys and values sit in blocks of --block-size rows scattered over a pool (a random block
permutation, as after a long serving run). The kernel reads every row of K and V once per call, so its floor is
(K + V bytes) / read bandwidth; the read bandwidth is measured in the same run (`sum` over a 512 MB tensor). The
baseline is the torch path a model without the extension would take: gather each sequence's rows into a dense
tensor, then `scaled_dot_product_attention`. Medians of --reps calls per cell, threads = torch's setting.

    python benchmarks/bench_cpu_decode_attention.py --batch 1 8 32 64 --ctx 512 2048

Writes benchmarks/results/decode_attention_cpu.md (+ .json).
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

from fastrag.provenance import cpu_name  # noqa: E402
from bench_args import positive_int  # noqa: E402  (the script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {  # name: (query heads, kv heads, head dim)
    "smollm2-135m": (9, 3, 64),
    "llama-2-7b": (32, 32, 128),
    "llama-3-8b": (32, 8, 128),
}


def median_s(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def read_bandwidth(reps: int) -> float:
    x = torch.ones(128 * 1024 * 1024)  # 512 MB, far above any cache
    return x.numel() * 4 / median_s(lambda: x.sum(), reps) / 1e9


def torch_baseline(q, kp, vp, blocks, lens, bs, scale):
    B, H, D = q.shape
    Hkv = kp.shape[0]
    out = torch.empty_like(q)
    for b in range(B):
        n = int(lens[b])
        pos = torch.arange(n)
        slots = blocks[b, pos // bs] * bs + pos % bs
        k = kp[:, slots].repeat_interleave(H // Hkv, 0)  # [H, n, D]
        v = vp[:, slots].repeat_interleave(H // Hkv, 0)
        out[b] = torch.nn.functional.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, scale=scale).squeeze(1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="+", default=["smollm2-135m", "llama-3-8b"], choices=list(SHAPES))
    ap.add_argument("--batch", type=positive_int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--ctx", type=positive_int, nargs="+", default=[512, 2048])
    ap.add_argument("--block-size", type=positive_int, default=16)
    ap.add_argument("--reps", type=positive_int, default=15)
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    try:
        import fastrag._C  # noqa: F401 - registers torch.ops.fastrag
    except ImportError:
        sys.exit("fastrag._C is not built: pip install --no-build-isolation --no-deps -e .")
    op = torch.ops.fastrag.paged_decode_attention_lse
    bw = read_bandwidth(args.reps)
    g = torch.Generator().manual_seed(0)
    rows = []
    for name in args.shape:
        H, Hkv, D = SHAPES[name]
        for ctx in args.ctx:
            for B in args.batch:
                bs = args.block_size
                nb = -(-ctx // bs)
                kp = torch.randn(Hkv, B * nb * bs, D, generator=g)
                vp = torch.randn(Hkv, B * nb * bs, D, generator=g)
                blocks = torch.randperm(B * nb, generator=g).view(B, nb)
                lens = torch.full((B,), ctx, dtype=torch.long)
                q = torch.randn(B, H, D, generator=g)
                pre = torch.zeros(0, dtype=torch.long)
                scale = D ** -0.5
                out, _ = op(q, kp, vp, pre, blocks, lens, bs, scale)
                ref = torch_baseline(q, kp, vp, blocks, lens, bs, scale)
                err = (out - ref).abs().max().item()
                if not err < 1e-4:
                    sys.exit(f"{name} B={B} ctx={ctx}: kernel and baseline differ by {err}")
                t_op = median_s(lambda: op(q, kp, vp, pre, blocks, lens, bs, scale), args.reps)
                t_ref = median_s(lambda: torch_baseline(q, kp, vp, blocks, lens, bs, scale), args.reps)
                nbytes = 2 * B * ctx * Hkv * D * 4
                rows.append({"shape": name, "batch": B, "ctx": ctx, "kv_mb": nbytes / 1e6,
                             "kernel_ms": t_op * 1e3, "kernel_gb_s": nbytes / t_op / 1e9,
                             "of_read_bw": nbytes / t_op / 1e9 / bw, "torch_ms": t_ref * 1e3,
                             "speedup_vs_torch": t_ref / t_op})
                r = rows[-1]
                print(f"{name} B={B} ctx={ctx}: {r['kernel_ms']:.2f} ms, {r['kernel_gb_s']:.1f} GB/s "
                      f"({r['of_read_bw']:.2f} of read bw), torch {r['torch_ms']:.2f} ms", flush=True)
    cmd = "python " + shlex.join([str(Path(sys.argv[0]).relative_to(ROOT)) if Path(sys.argv[0]).is_absolute()
                                  else sys.argv[0], *sys.argv[1:]])
    cols = ["shape", "batch", "ctx", "kv_mb", "kernel_ms", "kernel_gb_s", "of_read_bw", "torch_ms",
            "speedup_vs_torch"]
    md = (f"# C++ paged decode attention on the CPU\n\n- date: {dt.date.today().isoformat()}\n"
          f"- device: CPU {cpu_name()}, {torch.get_num_threads()} threads\n"
          f"- torch {torch.__version__}\n- read bandwidth measured in this run: {bw:.1f} GB/s (sum over 512 MB)\n"
          f"- blocks of {args.block_size} rows in random order; fp32; medians of {args.reps} calls\n"
          f"- command: `{cmd}`\n\n"
          "kv_mb: K and V bytes one call reads; of_read_bw: kernel GB/s over the measured read bandwidth "
          "(small cases sit in the L2/L3 and can exceed 1); torch: gather + scaled_dot_product_attention per "
          "sequence.\n\n"
          "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n")
    for r in rows:
        md += "| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |\n"
    res = Path(args.results)
    res.mkdir(parents=True, exist_ok=True)
    (res / "decode_attention_cpu.md").write_text(md)
    (res / "decode_attention_cpu.json").write_text(json.dumps({"read_gb_s": bw, "rows": rows, "command": cmd},
                                                              indent=2))
    print(md)


if __name__ == "__main__":
    main()
