"""Engine prefill calls of a Llama-shaped model (random weights) against their device floor, and where their time goes.

Why: in the H200 DRAGIN run of 2026-11-25 (benchmarks/results/gpu_h200_2026-11-25.md) the engine's prefill calls
and attention passes took 8.7x their device floor while decode steps took 1.13x; a prefill call of ~1,700 new tokens
took ~116 ms against a ~30 ms floor, and cProfile put the host inside `scaled_dot_product_attention` for 1.16 ms a
call. This times the same kind of call alone: a few sequences that each prefill a few hundred new tokens after a
shared demo prefix (computed once, as the engine holds it), through `Engine.step()` with max_new_tokens=1 (the
prefill's first token ends each sequence, so no decode step runs). Per cell (sequences per call x new tokens each):
the median wall of one call against the floor of the work the engine counted (fastrag.perf.floor: the weights read
once, 2 FLOPs per matrix weight per new token, the attention entries), at this device's measured copy bandwidth
and matmul rate.

The new tokens of each sequence vary by up to --jitter between calls, as in a real run where no two prefill calls
have the same shapes, so a cost paid per new shape (a kernel plan built, an autotuner run) is in the median;
`--jitter 0` repeats one shape. `--sdpa torch efficient,math` (for example) times every cell again with each of
these $FASTRAG_SDPA settings (the backends the engine's masked attention may use; `torch`: torch's own choice,
cuDNN first on Hopper with CUDA 13 builds): the table gives every setting. `--unfused` times every cell again with
torch's separate small operations instead of the fused kernels (on a GPU the prefill runs its residual adds,
RMSNorms, rotary embedding with the KV write and SiLU product as kernels/fused_decode.py's launches, as the decode
step does; $FASTRAG_FUSED_PREFILL=0 turns that off). `--concat` times every cell again with the prefix attended
in the one masked call over [prefix | context] (its keys copied for every sequence) instead of the cascade
($FASTRAG_CASCADE_PREFILL=0). `--paged` times every cell again through the other of the packed prefill's two
attention paths: the one launch a layer of kernels/paged_prefill.py (every new token over its prefix and its own
paged keys, read in place; the default for CUDA tensors, $FASTRAG_PAGED_PREFILL) and the attention buckets of torch
calls. `--profile` adds torch.profiler's tables
over --profile-calls calls of the last cell: the device kernels by total time, and the host operators by their own
time.

    python benchmarks/bench_prefill.py --profile                 # GPU: Llama-2-7B shape, bf16
    python benchmarks/bench_prefill.py --sdpa torch              # the same, and with torch's own SDPA choice
    python benchmarks/bench_prefill.py --cpu-small               # CPU: SmolLM2-135M shape, fp32

Writes benchmarks/results/prefill_<gpu|cpu>[_SHAPE].md and .json (--results, --name to change). Weights are random
(speed does not depend on their values) and never saved.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_args import env_prefix, positive_int  # noqa: E402  (the script's folder is on sys.path)
from make_random_model import SHAPES, hf_shape  # noqa: E402

from fastrag.engine import Engine  # noqa: E402
from fastrag.model import llama  # noqa: E402
from fastrag.model.llama import LlamaModel  # noqa: E402
from fastrag.perf import floor, measure_device, model_costs  # noqa: E402
from fastrag.provenance import cpu_name, versions  # noqa: E402

COUNTED = ("prefill_calls", "prefill_tokens", "prefill_ctx_tokens", "decode_steps", "decode_tokens",
           "decode_ctx_tokens", "decode_prefix_tokens")


class _Tok:
    """Token ids written as text: the engine tokenizes a shared prefix (`set_prefix`) from text."""

    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]


def _cells(spec: list[str]) -> list[tuple[int, int]]:
    out = []
    for c in spec:
        try:
            n, t = (int(x) for x in c.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--cells: {c!r} is not SEQSxTOKENS (e.g. 4x300)") from None
        if n < 1 or t < 1:
            raise SystemExit(f"--cells: {c!r} needs at least 1 sequence of at least 1 token")
        out.append((n, t))
    return out


@contextlib.contextmanager
def _sdpa_setting(spec: str | None):
    """$FASTRAG_SDPA set to spec (None: as it is) for the block."""
    if spec is None:
        yield
        return
    old = os.environ.get(llama.SDPA_ENV)
    os.environ[llama.SDPA_ENV] = spec
    try:
        llama.sdpa_backends()  # a bad spec fails here, naming the variable
        yield
    finally:
        if old is None:
            os.environ.pop(llama.SDPA_ENV, None)
        else:
            os.environ[llama.SDPA_ENV] = old


def build(shape: dict, dtype, dev, prefix: int, cells: list[tuple[int, int]], jitter: int):
    from transformers import LlamaConfig

    longest = prefix + max(t for _, t in cells) + jitter + 16
    shape = dict(shape, max_position_embeddings=max(shape["max_position_embeddings"], longest))
    cfg = LlamaConfig(**shape, eos_token_id=None, tie_word_embeddings=False)
    model = LlamaModel.from_hf_config(cfg, dtype=dtype, device=str(dev), seed=0)
    kv_per_token = model_costs(model)["kv_bytes_per_token"]
    tokens = prefix + max(n * (t + jitter + 16) for n, t in cells)
    budget = max(n * (t + jitter) for n, t in cells)
    eng = Engine(model, _Tok(), max_batch=max(n for n, _ in cells), kv_cache_gb=kv_per_token * tokens * 1.3 / 2**30
                 + 0.05, max_prefill_tokens=budget)
    g = torch.Generator().manual_seed(1)
    prefix_ids = torch.randint(5, shape["vocab_size"], (prefix,), generator=g).tolist()
    if prefix:
        eng.set_prefix(" ".join(map(str, prefix_ids)))
    eng.capture_graphs()  # (the prefill graphs of every token bucket: no timed call captures one)
    return model, eng, prefix_ids


def prefill_call(eng: Engine, prefix_ids: list[int], lens: list[int], g: torch.Generator, vocab: int) -> dict:
    """One Engine.step() that prefills len(lens) sequences of prefix + lens[i] new tokens; the engine counters it
    moved and its wall seconds."""
    seqs = []
    for n in lens:
        s = eng.new_sequence()
        eng.start(s, prefix_ids + torch.randint(5, vocab, (n,), generator=g).tolist(), 1)
        seqs.append(s)
    before = {k: eng.stats.get(k, 0) for k in COUNTED}
    pg = eng.prefill_graphs
    replays = pg.stats["replays"] if pg is not None else 0
    if eng.device.type == "cuda":
        torch.cuda.synchronize(eng.device)
    t = time.perf_counter()
    eng.step()
    if eng.device.type == "cuda":
        torch.cuda.synchronize(eng.device)
    wall = time.perf_counter() - t
    for s in seqs:
        eng.release(s)
    if eng.waiting or eng.running:
        raise RuntimeError(f"one step left {len(eng.waiting)} waiting and {len(eng.running)} running sequences: "
                           "the cell does not fit one prefill call")
    return {"wall_s": wall, **{k: eng.stats.get(k, 0) - before[k] for k in COUNTED},
            "graph_replays": (pg.stats["replays"] if pg is not None else 0) - replays}


def _lens(n: int, t: int, jitter: int, g: torch.Generator) -> list[int]:
    """New tokens of the n sequences of one call: t each, give or take up to jitter."""
    return [max(1, t + (int(torch.randint(-jitter, jitter + 1, (1,), generator=g)) if jitter else 0))
            for _ in range(n)]


def time_cell(eng, prefix_ids, n, t, jitter, reps, warmup, g, vocab, costs, figures, sdpa=None) -> dict:
    calls = []
    with _sdpa_setting(sdpa):
        for i in range(warmup + reps):
            lens = _lens(n, t, jitter, g)
            c = prefill_call(eng, prefix_ids, lens, g, vocab)
            if i >= warmup:
                calls.append(c)
    for c in calls:
        if c["prefill_calls"] != 1 or c["decode_steps"] != 0:
            raise RuntimeError(f"a timed step made {c['prefill_calls']} prefill calls and {c['decode_steps']} decode "
                               "steps; expected 1 and 0")
    walls = [c["wall_s"] for c in calls]
    floors = [floor(c, costs, figures)["prefill_s"] for c in calls]
    med = statistics.median(walls)
    return {"wall_ms": med * 1e3, "floor_ms": statistics.median(floors) * 1e3,
            "wall_over_floor": statistics.median(w / f for w, f in zip(walls, floors)),
            "tokens_per_call": statistics.median(c["prefill_tokens"] for c in calls),
            "tok_per_s": statistics.median(c["prefill_tokens"] / c["wall_s"] for c in calls),
            "attn_entries_per_call": statistics.median(c["prefill_ctx_tokens"] for c in calls),
            "first_ms": walls[0] * 1e3, "max_ms": max(walls) * 1e3,
            "graphed": f"{sum(c['graph_replays'] > 0 for c in calls)}/{len(calls)}"}


def profile_tables(eng, prefix_ids, n, t, jitter, calls, g, vocab, rows: int = 15) -> dict:
    from torch.profiler import ProfilerActivity, profile

    gpu = eng.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=acts) as prof:
        for _ in range(calls):
            lens = _lens(n, t, jitter, g)
            prefill_call(eng, prefix_ids, lens, g, vocab)
    ka = prof.key_averages()
    out = {"host": ka.table(sort_by="self_cpu_time_total", row_limit=rows)}
    if gpu:
        for key in ("device_time_total", "cuda_time_total"):  # the name changed across torch versions
            try:
                out["device"] = ka.table(sort_by=key, row_limit=rows)
                break
            except (AttributeError, KeyError, ValueError):
                continue
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-small", action="store_true", help="CPU: SmolLM2-135M shape, fp32, smaller cells")
    ap.add_argument("--shape", choices=list(SHAPES), default=None,
                    help="model shape (make_random_model.py's); default: llama2-7b on a GPU, smollm2-135m on the CPU")
    ap.add_argument("--cells", nargs="+", default=None,
                    help="SEQSxTOKENS per prefill call (default GPU: 1x300 4x300 1x1700 4x425 12x300; CPU: 1x64 4x64)")
    ap.add_argument("--prefix", type=int, default=None, help="shared demo prefix tokens (default GPU 1536, CPU 256)")
    ap.add_argument("--jitter", type=int, default=32, help="new tokens vary by up to this between calls (0: fixed)")
    ap.add_argument("--reps", type=positive_int, default=None, help="timed calls per cell (default GPU 15, CPU 3)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--sdpa", nargs="+", default=None,
                    help="also time every cell with each of these $FASTRAG_SDPA settings ('torch', or a comma list "
                         "of flash, efficient, cudnn, math)")
    ap.add_argument("--unfused", action="store_true",
                    help="also time every cell with torch's separate small operations in the prefill (residual "
                         "adds, RMSNorms, rotary embedding, KV write, SiLU product) instead of the fused kernels "
                         "($FASTRAG_FUSED_PREFILL=0); the fused ones run wherever the decode step's do")
    ap.add_argument("--concat", action="store_true",
                    help="also time every cell with the shared prefix in one masked call over [prefix | context] "
                         "instead of the cascade ($FASTRAG_CASCADE_PREFILL=0); the cascade runs wherever its "
                         "self-check passes")
    ap.add_argument("--paged", action="store_true",
                    help="also time every cell through the other prefill attention path: the attention buckets where "
                         "the paged prefill kernel is the default (CUDA), the kernel elsewhere (on a CPU only under "
                         "TRITON_INTERPRET=1)")
    ap.add_argument("--graphs", action="store_true",
                    help="also time every cell the other way round as to CUDA graphs: eagerly where the engine replays "
                         "prefill graphs (the default on CUDA, $FASTRAG_PREFILL_GRAPHS), else from graphs (on a CPU: "
                         "emulated, with the paged kernel under TRITON_INTERPRET=1 and FASTRAG_FUSED_DECODE=1)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler tables over --profile-calls calls")
    ap.add_argument("--profile-calls", type=positive_int, default=3)
    ap.add_argument("--name", default=None, help="result file stem (default prefill_gpu / prefill_cpu[_SHAPE])")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"), help="folder of the result table")
    args = ap.parse_args()
    default_sdpa = os.environ.get(llama.SDPA_ENV) or "default (flash,efficient,math)"
    for spec in args.sdpa or []:
        try:
            with _sdpa_setting(spec):
                pass
        except ValueError as e:
            ap.error(f"--sdpa: {e}")
    if args.jitter < 0 or args.warmup < 0 or (args.prefix is not None and args.prefix < 0):
        ap.error("--jitter, --warmup and --prefix must be >= 0")
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_small else "cpu")
    gpu = dev.type == "cuda"
    default_shape = "llama2-7b" if gpu else "smollm2-135m"
    label = args.shape or default_shape
    shape = hf_shape(label)
    dtype = torch.bfloat16 if gpu else torch.float32
    cells = _cells(args.cells or (["1x300", "4x300", "1x1700", "4x425", "12x300"] if gpu else ["1x64", "4x64"]))
    prefix = args.prefix if args.prefix is not None else (1536 if gpu else 256)
    reps = args.reps or (15 if gpu else 3)
    jitter = args.jitter
    if any(t - jitter < 1 for _, t in cells):
        ap.error(f"--jitter {jitter} would leave a sequence of the cells {args.cells} without new tokens")
    stem = args.name or ("prefill_" + ("gpu" if gpu else "cpu") + ("" if label == default_shape else f"_{label}"))
    out_dir = Path(args.results)
    figures = measure_device(dev, dtype)
    where = figures.device if gpu else f"CPU {cpu_name()}, {torch.get_num_threads()} threads"
    model, eng, prefix_ids = build(shape, dtype, dev, prefix, cells, jitter)
    costs = model_costs(model)
    g = torch.Generator().manual_seed(2)
    rows, prof = [], None
    cmd = env_prefix() + "python benchmarks/bench_prefill.py " + shlex.join(sys.argv[1:])

    def write() -> Path:  # after every cell: a run cut short keeps what it measured
        out_dir.mkdir(parents=True, exist_ok=True)
        lines = [
            f"# Engine prefill calls vs their device floor ({where})", "",
            f"- date: {dt.date.today()}; {versions('torch', 'triton', 'transformers')}",
            f"- model: random weights, {label} shape, {str(dtype).removeprefix('torch.')}; shared demo prefix "
            f"{prefix} tokens (computed once, as the engine holds the demos)",
            f"- device: copy {figures.copy_bytes_per_s / 1e9:.1f} GB/s, matmul {figures.matmul_flops_per_s / 1e12:.2f}"
            f" TFLOP/s ({figures.dtype})",
            f"- {reps} timed calls per cell after {args.warmup} untimed, medians; new tokens per sequence vary by "
            f"up to {jitter} between calls; command: `{cmd.strip()}`",
            "- floor: fastrag.perf.floor of the work the engine counted (weights read once per call, 2 FLOPs per "
            "matrix weight per new token, 4 x layers x heads x head_dim FLOPs per attention entry). "
            "first ms: the first timed call.", "",
            "- fused small ops: whether the prefill ran its residual adds, RMSNorms, rotary embedding with the KV "
            "write and SiLU product as the fused kernels of kernels/fused_decode.py (yes) or as torch's separate "
            "operations (no; `--unfused` adds those rows where the fused ones run by default)",
            f"- the cascade's self-check (lse_attention against the masked call): "
            f"{', '.join(f'{k}: {v}' for k, v in model.cascade_checks.items()) or 'not run'}",
            "- prefix attention: cascade (the prefix once for all the call's tokens, unmasked, merged by log-sum-exp "
            "with each sequence's masked own context) or concat (one masked call over [prefix | context], the "
            "prefix keys copied per sequence; `--concat` adds those rows where the cascade runs by default) or paged "
            "kernel (kernels/paged_prefill.py: one launch a layer for every token's prefix and own keys, read in "
            "place; the default for CUDA tensors, $FASTRAG_PAGED_PREFILL; `--paged` adds the other path's rows)",
            f"- the paged kernel's self-check: "
            f"{', '.join(f'{k}: {v}' for k, v in model.paged_prefill_checks.items()) or 'not run'}",
            "- prefill graph: how many timed calls replayed a CUDA graph of their token bucket (fastrag/cuda_graphs/ "
            "`PrefillGraphs`, captured before the timing; on a CPU emulated); `--graphs` adds the other state's rows",
            "",
            "| sequences x new tokens | $FASTRAG_SDPA | fused small ops | prefix attention | tokens a call | "
            "attention entries a call | prefill graph (timed calls replayed) | wall ms | floor ms | wall / floor | "
            "tokens/s | first ms | max ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['seqs']} x {r['new']} | {r['sdpa']} | {r['fused']} | {r.get('prefix_attn', '-')} | "
                f"{r['tokens_per_call']:.0f} | "
                f"{r['attn_entries_per_call']:.0f} | {r.get('graphed', '-')} | {r['wall_ms']:.2f} | "
                f"{r['floor_ms']:.2f} | "
                f"{r['wall_over_floor']:.2f} | {r['tok_per_s']:.0f} | {r['first_ms']:.2f} | {r['max_ms']:.2f} |")
        if prof:
            n, t = cells[-1]
            lines += ["", f"## torch.profiler: {args.profile_calls} calls of {n} x {t}", ""]
            for key, title in (("device", "device kernels, by total device time"),
                               ("host", "host operators, by their own time")):
                if key in prof:
                    lines += [f"### {title}", "", "```", prof[key].rstrip(), "```", ""]
        path = out_dir / f"{stem}.md"
        path.write_text("\n".join(lines) + "\n")
        (out_dir / f"{stem}.json").write_text(json.dumps(
            {"date": str(dt.date.today()), "device": figures.as_dict(), "shape": label, "prefix": prefix,
             "jitter": jitter, "reps": reps, "command": cmd.strip(),
             "versions": versions("torch", "triton", "transformers"), "rows": rows},
            indent=1))
        return path

    fused_default, cascade_default = model.fused_prefill, model.cascade_prefill
    paged_default, paged_module = model.paged_prefill, model.paged_prefill
    # the default rows take the paged kernel where the model does ($FASTRAG_PAGED_PREFILL, auto: CUDA tensors);
    # --paged adds the other path's rows
    on = model.uses_paged_prefill(dev, dtype)
    if args.paged and not on and (paged_module is None or not gpu):
        from fastrag.kernels import INTERPRETED
        from fastrag.kernels import paged_prefill

        if not gpu and not INTERPRETED:
            ap.error("--paged on a CPU needs TRITON_INTERPRET=1 (the Triton interpreter)")
        paged_module, model._paged_prefill_on_cpu = llama.ModuleRef(paged_prefill), INTERPRETED
    graphs_default = eng.prefill_graphs
    if args.graphs and graphs_default is None:  # (the engine has none: a CPU; they need the paged fused prefill)
        from fastrag.cuda_graphs import PrefillGraphs
        from fastrag.engine import PREFILL_GRAPH_SEQS, prefill_graph_tokens

        if not (model.uses_fused_prefill(dev) and on):
            ap.error("--graphs on a CPU needs the paged prefill kernel and the fused small operations "
                     "(TRITON_INTERPRET=1 FASTRAG_PAGED_PREFILL=1 FASTRAG_FUSED_DECODE=1)")
        graphs_other = PrefillGraphs(model, eng.pool, ctx_blocks=-(-eng.max_context // eng.pool.block_size),
                                     max_tokens=min(prefill_graph_tokens(), eng.max_prefill_tokens),
                                     max_seqs=min(PREFILL_GRAPH_SEQS, eng.max_batch),
                                     emulate=not gpu)
        graphs_other.capture_ahead()
    else:
        graphs_other = None
    g_on = graphs_default is not None
    variants = [(None, True, True, on, g_on), *((s, True, True, on, g_on) for s in args.sdpa or [])]
    if args.unfused and model.uses_fused_prefill(dev):
        variants.append((None, False, True, on, g_on))
    if args.concat and model.uses_cascade_prefill(dev, dtype):
        variants.append((None, True, False, on, g_on))
    if args.paged:
        variants.append((None, True, True, not on, g_on))
    if args.graphs:
        variants.append((None, True, True, on, not g_on))
    with torch.inference_mode():
        for n, t in cells:
            for sdpa, fused, cascade, paged, graphed in variants:
                model.fused_prefill = fused_default and fused
                model.cascade_prefill = cascade_default and cascade
                model.paged_prefill = paged_module if paged else None
                eng.prefill_graphs = (graphs_default or graphs_other) if graphed else None
                try:
                    r = time_cell(eng, prefix_ids, n, t, jitter, reps, args.warmup, g, shape["vocab_size"], costs,
                                  figures, sdpa)
                    r["fused"] = "yes" if model.uses_fused_prefill(dev) else "no"
                    r["prefix_attn"] = ("paged kernel" if model.uses_paged_prefill(dev, dtype)
                                        else "cascade" if prefix and model.uses_cascade_prefill(dev, dtype)
                                        else "concat")
                finally:
                    model.fused_prefill, model.cascade_prefill = fused_default, cascade_default
                    model.paged_prefill = paged_default
                    eng.prefill_graphs = graphs_default
                rows.append({"seqs": n, "new": t, "sdpa": sdpa or default_sdpa, **r})
                print(f"{n} x {t} ({rows[-1]['sdpa']}, fused small ops: {r['fused']}, prefix attention: "
                      f"{r['prefix_attn']}, graph: {r['graphed']}): {r['wall_ms']:.2f} ms, floor {r['floor_ms']:.2f} ms "
                      f"({r['wall_over_floor']:.2f}x)", flush=True)
                write()
        if args.profile:
            n, t = cells[-1]
            prof = profile_tables(eng, prefix_ids, n, t, jitter, args.profile_calls, g, shape["vocab_size"])
    print(write().read_text())


if __name__ == "__main__":
    main()
