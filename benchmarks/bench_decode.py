"""Decode step of a Llama-shaped model (random weights; Llama-2-7B, Llama-2-13B or SmolLM2) with and without the fused
signals.

Per batch size (GPU: 1, 16, 64, 256) and context (GPU: 1k and 4k tokens): the median time of one engine decode step (batched forward over
the paged KV cache) followed by (a) plain greedy argmax and one host copy of the tokens, or (b) the fused
decode-signals kernel (token, entropy, logprob, FLARE probability) and one host copy of those. Overhead =
(b - a) / a; target <= 3% at batch 64 (DESIGN.md "Performance model"). Roofline step time = (weight bytes +
KV bytes read) / measured copy bandwidth.

    python benchmarks/bench_decode.py                  # GPU: Llama-2-7B shape, bf16, B 1/16/64/256 x ctx 1k/4k
    python benchmarks/bench_decode.py --shape llama2-13b    # GPU: the same cells, Llama-2-13B shape
    python benchmarks/bench_decode.py --shape smollm2-135m  # GPU: the embedded model's shape (GQA, 9 / 3 heads)
    python benchmarks/bench_decode.py --cpu-small      # CPU: SmolLM2-135M shape, fp32, context 256
    python benchmarks/bench_decode.py --batches 128 --ctx 512 --prefixes 0 1 3 --name decode_gpu_prefixes
                                                       # GPU: the step with 0, 1 and 3 shared prefixes of 640 tokens
    python benchmarks/bench_decode.py --batches 64 256 --ctx 64 512 --prefixes 1 --profile --name decode_gpu_parts
                                                       # GPU: + where each step's device time goes (step_profile.py)

A cell whose weights + KV cache do not fit the device's free memory is listed as not run (Llama-2-7B has no GQA:
0.5 MiB of KV per token, so B=256 at 1k or B=64 at 4k needs more than an 80 GB GPU).

`--profile` adds, per cell, torch.profiler's record of a few steps split into the step's parts (GEMMs, own-context
attention, shared-prefix attention, fused layer ops, signals and sampling, copies, other torch kernels),
replayed from graphs and eager, and the eager step's matrix multiplies by weight against their floor
(benchmarks/step_profile.py).

Writes benchmarks/results/decode_<device>.md (decode_<device>_<shape>.md for a shape other than the device's default:
Llama-2-7B on a GPU, SmolLM2-135M on the CPU). Weights are random (speed does not depend on their values) and
never saved.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import shlex
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_kernels import device_name, measure_bandwidth, timeit  # noqa: E402
from make_random_model import SHAPES, hf_shape  # noqa: E402

from fastrag.engine import Engine  # noqa: E402
from fastrag.kernel_parts import parts_table  # noqa: E402
from fastrag.model.llama import LlamaModel  # noqa: E402
from fastrag.perf import measure_device, model_costs  # noqa: E402
from fastrag.provenance import versions  # noqa: E402
from bench_args import env_prefix, positive_int  # noqa: E402  (the script's folder is on sys.path)
import step_profile  # noqa: E402


class _Tok:
    eos_token_id = None

    def encode(self, s):  # (the shared prefixes are set as text of token ids)
        return [int(x) for x in s.split()]


def build(shape: dict, dtype, dev, batch: int, ctx: int, signals: str | None, max_prefill_tokens: int | None = None,
          n_prefixes: int = 0, prefix_len: int = 0):
    """An engine whose `batch` sequences hold `ctx` tokens of their own each; with n_prefixes, after one of that
    many shared prefixes of prefix_len tokens (whole KV blocks), dealt round robin: a decode step of several
    prefixes reads each once and merges its part into its sequences' rows (the mixed batches of a joint run over
    several datasets' demos)."""
    from transformers import LlamaConfig

    # a context of ctx tokens plus the step's new one: the 4k cells run past Llama-2's 4096 positions (the rotary
    # table's length costs nothing per step)
    shape = dict(shape, max_position_embeddings=max(shape["max_position_embeddings"], ctx + 64))
    cfg = LlamaConfig(**shape, eos_token_id=None, tie_word_embeddings=False)
    model = LlamaModel.from_hf_config(cfg, dtype=dtype, device=str(dev), seed=0)
    kv_bytes = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * (
        shape["hidden_size"] // shape["num_attention_heads"]) * dtype.itemsize * ((ctx + 64) * batch
                                                                                 + n_prefixes * (prefix_len + 16))
    eng = Engine(model, _Tok(), max_batch=batch, kv_cache_gb=kv_bytes / 2**30 * 1.2 + 0.05,
                 max_prefill_tokens=max_prefill_tokens or max(4096, ctx), signals=signals)
    g = torch.Generator().manual_seed(0)
    heads = []
    for _ in range(n_prefixes):
        ids = torch.randint(5, shape["vocab_size"], (prefix_len,), generator=g).tolist()
        p = eng.set_prefix(" ".join(map(str, ids)))
        if p is None or p.length != prefix_len:
            raise ValueError(f"bench_decode: a shared prefix of {prefix_len} tokens is not a whole number of "
                             f"{eng.pool.block_size}-token KV blocks")
        heads.append(ids)
    seqs = []
    for i in range(batch):
        s = eng.new_sequence()
        # the timed steps roll their token back, so a few new tokens of room are enough
        head = heads[i % n_prefixes] if n_prefixes else []
        eng.start(s, head + torch.randint(5, shape["vocab_size"], (ctx,), generator=g).tolist(), 32)
        seqs.append(s)
    # prefill everything, then time decode steps only. A step also decodes the running sequences, so those
    # prefilled first would generate (and, past 32 prefill steps, finish and leave the batch) while later ones
    # wait: each step's prefilled sequences are parked off the running list until all are in.
    parked: list = []
    while eng.waiting:
        eng.step()
        parked += eng.running
        eng.running.clear()
    eng.running[:] = parked
    if len(parked) != batch or any(s.table.num_tokens > ctx + 2 for s in parked):
        raise RuntimeError(f"bench_decode: {len(parked)} of {batch} sequences prefilled, contexts "
                           f"{sorted({s.table.num_tokens for s in parked})} (wanted {ctx} + at most 2)")
    return model, eng, parked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-small", action="store_true", help="CPU: SmolLM2-135M shape, fp32, context 256")
    ap.add_argument("--shape", choices=list(SHAPES), default=None,
                    help="model shape (make_random_model.py's, with its published vocabulary); default: llama2-7b "
                         "on a GPU, smollm2-135m on the CPU")
    ap.add_argument("--batches", type=positive_int, nargs="+", default=None, help="default: GPU 1 16 64 256, CPU 1 16 64")
    ap.add_argument("--ctx", type=positive_int, nargs="+", default=None, help="contexts; default: GPU 1024 4096, CPU 256")
    ap.add_argument("--name", default=None,
                    help="result file stem (default decode_gpu / decode_cpu, with _SHAPE for a non-default shape)")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"), help="folder of the result table")
    ap.add_argument("--reps", type=positive_int, default=None)
    ap.add_argument("--span", type=int, default=64, help="tracked tokens per sequence in the signals+attn variant")
    ap.add_argument("--prefixes", type=int, nargs="+", default=[0],
                    help="numbers of shared prefixes the sequences start with, a cell each (dealt round robin; 0: "
                         "none); the context is each sequence's own tokens after its prefix")
    ap.add_argument("--prefix-len", type=positive_int, default=640,
                    help="tokens of each shared prefix (a multiple of the KV block size, 16)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile every cell's plain step (torch.profiler): its device time by part, replayed "
                         "from graphs and eager, and the eager step's matrix multiplies against their floor")
    ap.add_argument("--profile-steps", type=positive_int, default=5, help="steps each profile records")
    args = ap.parse_args()
    if any(k < 0 for k in args.prefixes):
        ap.error(f"--prefixes must be >= 0, got {args.prefixes}")
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_small else "cpu")
    default_shape = "llama2-7b" if dev.type == "cuda" else "smollm2-135m"
    label = args.shape or default_shape
    shape = hf_shape(label)
    if dev.type == "cuda":
        dtype, ctxs, reps = torch.bfloat16, args.ctx or [1024, 4096], args.reps or 30
        batches = args.batches or [1, 16, 64, 256]
    else:
        dtype, ctxs, reps = torch.float32, args.ctx or [256], args.reps or 5
        batches = args.batches or [1, 16, 64]
    stem = args.name or ("decode_" + ("gpu" if dev.type == "cuda" else "cpu")
                         + ("" if label == default_shape else f"_{label}"))
    bw = measure_bandwidth(dev)
    rows = []
    profiles: list[list[str]] = []  # one markdown section per profiled cell
    figures = None  # (--profile) copy bandwidth and matmul rate of the device, for the GEMMs' floors
    hd = shape["hidden_size"] // shape["num_attention_heads"]
    n_weights = (2 * shape["vocab_size"] * shape["hidden_size"] + shape["num_hidden_layers"] * (
        2 * shape["hidden_size"] ** 2 + 2 * shape["hidden_size"] * shape["num_key_value_heads"] * hd
        + 3 * shape["hidden_size"] * shape["intermediate_size"]))

    def write() -> Path:  # after every cell: a run cut short still leaves the cells it measured
        tag = "gpu" if dev.type == "cuda" else "cpu"
        out = Path(args.results) / f"{stem}.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        lines = [f"# Decode step with and without fused signals ({tag})", "",
                 f"- device: {device_name(dev)}; date {dt.date.today().isoformat()}; {versions('torch', 'triton')}",
                 f"- model: {label} shape ({shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
                 f"{shape['num_attention_heads']} / {shape['num_key_value_heads']} heads, vocabulary "
                 f"{shape['vocab_size']}), random {str(dtype).split('.')[-1]} weights; context (tokens per sequence) "
                 "per row",
                 f"- measured copy bandwidth {bw / 1e9:.1f} GB/s; roofline = (weights + KV read) / bandwidth",
                 f"- command: `{env_prefix()}python benchmarks/bench_decode.py {shlex.join(sys.argv[1:])}`",
                 "- plain = forward + argmax + host copy of the tokens; signals = forward + fused decode_signals + one "
                 "host copy of (token, entropy, logprob); plain_again = plain timed a second time (the noise floor); "
                 f"signals+attn = signals plus, for every sequence, the in-context attention statistics of its last "
                 f"{args.span} tokens (last layer's queries and the decode attention's row log-sum-exp through "
                 "the fused attn_decode_update: DRAGIN streaming's a_i)",
                 *([] if dev.type == "cuda" else
                   ["- CPU run (the Llama-2 shapes need a GPU): GPU not measured"]),
                 "- graphs: whether the timed steps replayed CUDA graphs (fastrag/cuda_graphs/; on by default on a GPU); "
                 "eager = the plain step with graphs off, launched kernel by kernel",
                 "- unfused layers = the plain step with each layer's residual adds, RMSNorms, rotary embedding, KV "
                 "write and SiLU product (and each shared prefix's softmax and merge) as "
                 "torch's separate kernels instead of the fused launches of kernels/fused_decode.py "
                 "(FASTRAG_FUSED_DECODE; on by default for CUDA tensors); '-': fused kernels not in use on this device",
                 "- shared prefixes: how many the batch's sequences start with (dealt round robin) x their tokens, "
                 "each read once a step and counted once in the roofline; ctx is each sequence's own context",
                 "- other prefix path: the plain step with the shared prefixes attended the other way than this run's "
                 "($FASTRAG_PREFIX_FLASH): '(flash)' all prefixes in one flash-decoding launch a layer "
                 "(kernels/fused_decode.py prefix_flash_decode), '(GEMMs)' a GEMM, softmax, GEMM and merge per "
                 "prefix over every row; '-': no prefix, or no fused kernels on this device",
                 "", "| ctx | B | plain ms | plain again ms | unfused layers ms | eager ms | signals ms | overhead | "
                 "signals+attn ms | overhead | roofline ms | plain / roofline | graphs | signals backend | "
                 "decode attention | other prefix path ms | shared prefixes |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if "skipped" in r:
                lines.append(f"| {r['ctx']} | {r['B']} | not run: {r['skipped']} |" + " |" * 13 + f" {r['pre']} |")
                continue
            unfused = "-" if r["unfused_ms"] is None else f"{r['unfused_ms']:.2f}"
            other = "-" if r.get("other_prefix_ms") is None else f"{r['other_prefix_ms']:.2f} ({r['other_prefix']})"
            lines.append(f"| {r['ctx']} | {r['B']} | {r['plain_ms']:.2f} | {r['plain_again_ms']:.2f} | {unfused} | "
                         f"{r['eager_ms']:.2f} | {r['signals_ms']:.2f} | {r['overhead']:+.1%} | {r['attn_ms']:.2f} | "
                         f"{r['overhead_attn']:+.1%} | {r['roofline_ms']:.2f} | {r['x_roofline']:.2f} | {r['graphs']} | "
                         f"{r['backend']} | {r['attn']} | {other} | {r['pre']} |")
        if profiles:
            lines += ["", f"## Where a step's time goes (torch.profiler, {args.profile_steps} steps a way)", "",
                      "Each device kernel is put in one part by its name (benchmarks/step_profile.py `PARTS`); on "
                      "a CPU the operators' own times stand in for kernels. 'graphs' = the plain step replayed "
                      "from its CUDA graphs, 'eager' = launched kernel by kernel; the last line compares the sum "
                      "with the step's timed median above (the rest: time between kernels). GEMM floor = "
                      "max(bytes of both inputs and the output / copy bandwidth, FLOPs / matmul rate)"
                      + ("" if figures is None else
                         f", here {figures.copy_bytes_per_s / 1e9:.1f} GB/s and "
                         f"{figures.matmul_flops_per_s / 1e12:.2f} TFLOP/s ({figures.dtype})") + ".", ""]
            for sec in profiles:
                lines += sec
        out.write_text("\n".join(lines) + "\n")
        return out

    for ctx, B, K in [(c, b, k) for c in ctxs for b in batches for k in args.prefixes]:
        P = args.prefix_len if K else 0
        pre = f"{K} x {P}" if K else "0"
        need = (n_weights + 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * hd * (
            (ctx + 64) * B + K * P)) * dtype.itemsize
        free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else None
        if free is not None and need > 0.9 * free:
            rows.append(dict(B=B, ctx=ctx, pre=pre,
                             skipped=f"needs {need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"))
            print(rows[-1], flush=True)
            write()
            continue
        model, eng, seqs = build(shape, dtype, dev, B, ctx, None, n_prefixes=K, prefix_len=P)
        # weights a step streams: all but the embedding table, of which it reads B rows (fastrag.perf.model_costs)
        weight_bytes = model_costs(model)["weight_bytes_per_step"]
        # the KV entries the step reads: every sequence's own context as prefilled (ctx, plus the token or two its
        # prefill step sampled and decoded), and each shared prefix once
        kv_read = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * hd * dtype.itemsize * (
            sum(s.table.num_tokens for s in seqs) + min(K, B) * P)

        def plain():
            logits = eng.runner.decode(seqs)
            logits.argmax(-1).cpu()  # the tokens are needed on the host either way
            for s in seqs:  # keep the context length fixed: roll the step back
                s.table.num_tokens -= 1

        def fused():
            logits = eng.runner.decode(seqs)
            sig = eng.signals.decode_signals(logits)
            torch.stack([sig.chosen.double(), sig.entropy.double(), sig.logprob.double()]).cpu()
            for s in seqs:
                s.table.num_tokens -= 1

        # + attention statistics: every sequence tracks the in-context attention its last `span` tokens receive
        # (DRAGIN streaming's a_i), folded in by the fused attn_decode_update on the decode attention's LSE
        span = min(args.span, ctx)
        H = shape["num_attention_heads"]

        def fused_attn():
            for s in seqs:
                s.track_from = s.computed - span + 1
                s.amax = torch.zeros(H, span, dtype=torch.float32, device=dev)
            logits = eng.runner.decode(seqs)
            sig = eng.signals.decode_signals(logits)
            torch.stack([sig.chosen.double(), sig.entropy.double(), sig.logprob.double()]).cpu()
            for s in seqs:
                s.table.num_tokens -= 1
                s.track_from = s.amax = None

        with torch.inference_mode():
            t_plain = timeit(plain, dev, reps, warmup=2)
            t_fused = timeit(fused, dev, reps, warmup=2)
            t_attn = timeit(fused_attn, dev, reps, warmup=2)
            t_plain2 = timeit(plain, dev, reps, warmup=1)  # timing spread: the same version twice
            # the same step with the per-layer small operations unfused (torch's separate kernels); the graphs
            # captured so far hold the fused kernels, so they are dropped and captured again each way
            fused_layers, t_unfused = model.fused_decode, None
            if model.uses_fused_decode(dev):
                model.fused_decode = None
                if eng.graphs is not None:
                    eng.graphs.reset()
                t_unfused = timeit(plain, dev, reps, warmup=2)
                model.fused_decode = fused_layers
                if eng.graphs is not None:
                    eng.graphs.reset()
            # the same step with the shared prefixes the other way (one flash launch for all / GEMMs per prefix)
            t_other, other = None, None
            if K and model.uses_fused_decode(dev):
                model.prefix_flash = not model.prefix_flash
                other = "flash" if model.prefix_flash else "GEMMs"
                if eng.graphs is not None:
                    eng.graphs.reset()
                t_other = timeit(plain, dev, reps, warmup=2)
                model.prefix_flash = not model.prefix_flash
                if eng.graphs is not None:
                    eng.graphs.reset()
            graphs, eng.graphs = eng.graphs, None  # the same step launched kernel by kernel
            t_eager = timeit(plain, dev, reps, warmup=1)
            eng.graphs = graphs
            if args.profile:
                if figures is None:
                    figures = measure_device(dev, dtype)
                gpu = dev.type == "cuda"
                ways, step_ms = {}, {}
                if graphs is not None:
                    ways["graphs"], step_ms["graphs"] = step_profile.profile_steps(plain, args.profile_steps, gpu), \
                        t_plain * 1e3
                eng.graphs = None
                ways["eager"], step_ms["eager"] = step_profile.profile_steps(plain, args.profile_steps, gpu), \
                    t_eager * 1e3
                eng.graphs = graphs
                parts = {w: parts_table(k, args.profile_steps) for w, (k, _) in ways.items()}
                gemms = step_profile.gemm_table(ways["eager"][1], args.profile_steps, step_profile.weight_names(model),
                                                dtype.itemsize, figures.copy_bytes_per_s, figures.matmul_flops_per_s)
                profiles.append(step_profile.markdown(f"ctx {ctx}, B {B}, shared prefixes {pre}", step_ms, parts,
                                                      gemms, gpu))
        replays = graphs.stats["replays"] if graphs is not None else 0
        roof = (weight_bytes + kv_read) / bw
        op = model.paged_decode_op(dev, dtype)
        attn_impl = "torch" if op is None else ("triton" if op is model.triton_decode else "C++")
        rows.append(dict(B=B, ctx=ctx, pre=pre, plain_ms=t_plain * 1e3, plain_again_ms=t_plain2 * 1e3,
                         signals_ms=t_fused * 1e3,
                         overhead=(t_fused - t_plain) / t_plain, attn_ms=t_attn * 1e3,
                         overhead_attn=(t_attn - t_plain) / t_plain, roofline_ms=roof * 1e3, x_roofline=t_plain / roof,
                         backend=eng.signals.name, attn=attn_impl, eager_ms=t_eager * 1e3,
                         graphs="yes" if replays else "no",
                         unfused_ms=None if t_unfused is None else t_unfused * 1e3,
                         other_prefix_ms=None if t_other is None else t_other * 1e3, other_prefix=other))
        print(rows[-1], flush=True)
        write()
        # the step closures and the graph runner hold the engine (and its KV pool): drop them all before the next cell
        del model, eng, seqs, plain, fused, fused_attn, graphs
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(f"wrote {write()}")


if __name__ == "__main__":
    main()
