"""The Triton paged decode attention (kernels/paged_attention.py) against the memory roofline, launch settings swept.

At batch 64 and context 1k, a Llama-2-7B decode step reads 34 GB of KV cache against 13.5 GB of weights: the decode
step can only get near its roofline if this kernel streams the cache near the device's copy bandwidth. Per cell
(one layer of the Llama-2-7B shape: 32 query and 32 kv heads of 128, bf16, blocks of 16 tokens scattered over the
pool): the median time of the launcher's default settings and of each variant (block_n, num_splits, num_warps,
num_stages), achieved GB/s of K and V read (each row once) and the fraction of the copy bandwidth measured in the
same run. Several pools rotate so the L2 cache does not serve them.

    python benchmarks/bench_paged_attention.py            # GPU: B 1/16/64/256 x ctx 1k/4k
    TRITON_INTERPRET=1 python benchmarks/bench_paged_attention.py --smoke   # CPU: checks the harness, tiny shapes

Writes benchmarks/results/paged_attention_<gpu|cpu>.md (after every cell, so a run cut short keeps its rows).
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_kernels import device_name, measure_bandwidth, timeit  # noqa: E402

from fastrag.provenance import versions  # noqa: E402

# (label, launcher keyword arguments); {} = the launcher's defaults, what the engine runs
VARIANTS = [("default", {}), ("block_n 32", {"block_n": 32}), ("block_n 128", {"block_n": 128}),
            ("splits 1", {"num_splits": 1}), ("warps 8", {"num_warps": 8}), ("stages 2", {"num_stages": 2}),
            ("stages 4", {"num_stages": 4})]


def cell(op, B: int, ctx: int, H: int, Hkv: int, D: int, bs: int, dtype, dev, reps: int, bw: float, g) -> list[dict]:
    nb = -(-ctx // bs)
    one = 2 * Hkv * B * nb * bs * D * dtype.itemsize  # K + V bytes of one pool
    copies = max(2, min(4, -(-(256 << 20) // one))) if dev.type == "cuda" else 1
    pools = []
    for _ in range(copies):  # made on the device (tens of GB at B=256, ctx 4k)
        kp = torch.randn(Hkv, B * nb * bs, D, generator=g, device=dev, dtype=dtype)
        vp = torch.randn(Hkv, B * nb * bs, D, generator=g, device=dev, dtype=dtype)
        tab = torch.randperm(B * nb).view(B, nb).to(dev)  # each sequence's blocks scattered over the pool
        pools.append((kp, vp, tab))
    q = torch.randn(B, H, D, generator=g, device=dev, dtype=dtype)
    lens = torch.full((B,), ctx, dtype=torch.long, device=dev)
    empty = torch.empty(0, dtype=torch.long, device=dev)
    read = 2 * B * ctx * Hkv * D * dtype.itemsize
    rows, ref = [], None
    for label, kw in VARIANTS:
        i = [0]

        def run():
            kp, vp, tab = pools[i[0] % copies]
            i[0] += 1
            return op(q, kp, vp, empty, tab, lens, bs, D ** -0.5, **kw)

        try:
            out = run()[0]
            t = timeit(run, dev, reps, warmup=2)
        except Exception as e:  # a setting this Triton or device rejects: say so in the table, go on
            rows.append(dict(B=B, ctx=ctx, variant=label, error=f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"))
            continue
        if ref is None:
            ref = out
        err = (out.float() - ref.float()).abs().max().item()  # every variant computes the same attention
        rows.append(dict(B=B, ctx=ctx, variant=label, ms=t * 1e3, GBps=read / t / 1e9, frac=read / t / bw,
                         max_diff=err))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 2 repetitions: checks the harness on CPU")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"), help="folder of the result tables")
    args = ap.parse_args()
    from fastrag.kernels import INTERPRETED
    from fastrag.kernels.paged_attention import paged_decode_attention_lse

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and not INTERPRETED:
        raise SystemExit("no GPU: run with TRITON_INTERPRET=1 (and --smoke) to check the harness")
    H, Hkv, D, bs, dtype = 32, 32, 128, 16, torch.bfloat16 if dev.type == "cuda" else torch.float32
    batches, ctxs, reps = args.batches, args.ctx, args.reps
    if args.smoke:
        H, Hkv, D, batches, ctxs, reps = 4, 2, 32, [2], [40], 2
    bw = measure_bandwidth(dev)
    tag = "gpu" if dev.type == "cuda" else "cpu"
    out = Path(args.results) / f"paged_attention_{tag}{'_smoke' if args.smoke else ''}.md"
    g = torch.Generator(device=dev).manual_seed(0)
    torch.manual_seed(0)
    rows = []

    def write():
        lines = [f"# Triton paged decode attention against the copy bandwidth ({tag})", "",
                 f"- device: {device_name(dev)}; date {dt.date.today().isoformat()}; {versions('torch', 'triton')}",
                 f"- shape: one layer, H={H}, Hkv={Hkv}, D={D}, {str(dtype).split('.')[-1]}, blocks of {bs} "
                 "tokens scattered over the pool; every sequence holds the whole context",
                 f"- measured copy bandwidth {bw / 1e9:.1f} GB/s (read + written); GB/s = K and V bytes read / "
                 f"median time of {reps} calls; max diff = largest difference from the default's output",
                 f"- command: `{'TRITON_INTERPRET=1 ' if INTERPRETED else ''}python benchmarks/bench_paged_attention.py "
                 f"{shlex.join(sys.argv[1:])}`", "",
                 "| B | ctx | variant | ms | GB/s | of copy bandwidth | max diff |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['B']} | {r['ctx']} | {r['variant']} | failed: {r['error']} | | | |")
            else:
                lines.append(f"| {r['B']} | {r['ctx']} | {r['variant']} | {r['ms']:.3f} | {r['GBps']:.0f} | "
                             f"{r['frac']:.2f} | {r['max_diff']:.1e} |")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")

    for ctx in ctxs:
        for B in batches:
            need = 2 * 2 * Hkv * B * ctx * D * dtype.itemsize  # two pools of K and V at least
            if dev.type == "cuda" and need > 0.8 * torch.cuda.mem_get_info(dev)[0]:
                rows.append(dict(B=B, ctx=ctx, variant="all", error=f"not run: needs {need / 2**30:.0f} GiB"))
            else:
                rows += cell(paged_decode_attention_lse, B, ctx, H, Hkv, D, bs, dtype, dev, reps, bw, g)
            write()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
