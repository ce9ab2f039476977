"""End-to-end DRAGIN: the engine vs the per-question oracle on the same questions, same machine, same run.

The engine answers all datasets' questions in one run (`fastrag.eval.run_many`: one batch, each dataset with its
own prompts and settings), the way a user evaluates; `--separate-engine-runs` runs one engine job per dataset
instead. Then, per dataset, the oracle as the published recipe runs it (plain transformers, eager attention, fp32,
batch size 1, the whole prompt re-prefilled by `generate` every round and an extra attention forward per round),
resuming from its earlier records (its rate is n / sum of per-question times), and the decision-by-decision parity;
with --tuned-oracle-limit N also the oracle in its best honest per-question configuration (bf16 on a GPU, SDPA,
batch size 1) on N questions of each dataset. The oracles time --oracle-limit / --tuned-oracle-limit of the engine's
questions spread evenly over them (the tuned ones among the published recipe's), each after an untimed warm-up
(spaCy, a first generate, a search). --model takes an HF directory (e.g. a random-initialised
Llama-2-7B shape from benchmarks/make_random_model.py) for GPU runs; the oracle runs on the GPU when there is one.
Writes `benchmarks/results/e2e_<device>.md` (+ .json): questions/s of both over all questions and their ratio, and
per dataset the tokens prefilled/decoded and retrievals per question, parity and EM.

    python benchmarks/bench_e2e.py --datasets hotpotqa 2wikimultihopqa --limit 50 --batch-size 32
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from fastrag.data.datasets import load_examples
from fastrag.eval import RunOptions, read_results, run, run_many
from fastrag.kernel_parts import KERNEL_PROFILE_ENV, short_name
from fastrag.parity import _rate, compare, method_decisions, run_oracle
from fastrag.provenance import cpu_name, device_name, versions

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
FILES = {
    "hotpotqa": Path("hotpotqa") / "dev_distractor_200.jsonl",
    "2wikimultihopqa": Path("2wikimultihopqa") / "dev_sample_200.jsonl",
    "strategyqa": Path("strategyqa") / "train_first1000.json",
}
DATA = {ds: SHARED / f for ds, f in FILES.items()}
CORPUS = SHARED / "corpus" / "wiki_passages.jsonl"


def data_files(pairs: list[str], datasets: list[str], ap: argparse.ArgumentParser) -> dict[str, Path]:
    """Each dataset's question file (relative to --data-dir unless absolute): FILES, with the --data-file
    DATASET=FILE pairs in its place; a malformed pair, a dataset not run or one given twice is a usage error."""
    files = dict(FILES)
    seen = set()
    for pair in pairs:
        ds, sep, f = pair.partition("=")
        if not sep or not ds or not f:
            ap.error(f"--data-file {pair!r}: expected DATASET=FILE")
        if ds not in datasets:
            ap.error(f"--data-file {pair!r}: {ds!r} is not among --datasets ({' '.join(datasets)})")
        if ds in seen:
            ap.error(f"--data-file: {ds!r} given twice")
        seen.add(ds)
        files[ds] = Path(f)
    return files


def spread(ids: list[str], n: int) -> list[str]:
    """n of `ids` spread evenly over them (the first, the last and equal steps between): the oracle's questions
    sample the engine's whole run, not the head of the data file, whose cost per question may differ."""
    if n >= len(ids):
        return list(ids)
    if n <= 1:
        return list(ids[:n])
    return [ids[round(i * (len(ids) - 1) / (n - 1))] for i in range(n)]


def oracle_devices(folders: list[Path]) -> list[str]:
    """The devices the oracle records in `folders` were timed on (their runs.jsonl lines; 'unrecorded' for a folder
    with records from before these lines were written)."""
    seen = []
    for f in folders:
        lines = (f / "runs.jsonl").read_text(encoding="utf-8").splitlines() if (f / "runs.jsonl").exists() else []
        devs = [json.loads(x)["environment"]["device"] for x in lines if x.strip()]
        if not devs and (f / "results.jsonl").exists():
            devs = ["unrecorded"]
        seen += [d for d in devs if d not in seen]
    return seen


def per_q(results, key):
    ok = [r for r in results if r.error is None]
    return sum(getattr(r, key) for r in ok) / len(ok) if ok else float("nan")


def report_from(out: Path, eng, orc) -> dict:
    """parity.json-like report from results on disk (questions both sides finished)."""
    from fastrag.parity import _mean

    rep = compare(eng, orc, method_decisions("dragin"))
    m = json.loads((out / "engine" / "metrics.json").read_text())
    done = {r.qid for r in orc}
    # a joint run (all datasets in one batch) has one clock: its speed is reported over all questions only
    e_qps = None if "joint" in m else m["questions_per_s"]
    rep.update({"engine_questions_per_s": e_qps, "oracle_questions_per_s": _rate(orc),
                "engine_wall_s": m["wall_s"], "oracle_wall_s": sum(r.wall_s for r in orc),
                "engine_em": _mean([r.metrics.get("em") for r in eng if r.error is None and r.qid in done]),
                "oracle_em": _mean([r.metrics.get("em") for r in orc if r.error is None])})
    (out / "parity.json").write_text(json.dumps(rep, indent=2, ensure_ascii=False))
    return rep


def rate_without_answer_generation(results) -> float | None:
    """The oracle's questions/s with its answer generations counted as free (their seconds are in each record's
    counters; None when a record predates them): a lower bound on what the published code's batched
    evaluate.py pass would cost, so the ratio against it is the conservative one."""
    if not results or any("answer_generation_s" not in r.counters for r in results):
        return None
    t = sum(r.wall_s - r.counters["answer_generation_s"] for r in results)
    return len(results) / t if t > 0 else None


def engine_rate(metrics: list[dict], wall: float) -> float | None:
    """The engine's questions/s over every dataset's run in `wall` seconds: the answered questions (questions_measured,
    which a rerun computing nothing carries over with the wall it was measured in), as each run's questions_per_s and
    the oracles' rates count them; a question that failed is no throughput. Metrics from before questions_measured
    count every question computed."""
    answered = sum(m.get("questions_measured", m["computed_this_run"]) for m in metrics)
    return answered / wall if wall > 0 else None


def tok_rate(qps, results, key):
    """Tokens of one kind per second: questions/s times that kind's tokens per question."""
    return qps * per_q(results, key) if qps and results else None


def row(name, eng, orc, rep) -> dict:
    """One dataset (or all). With random-initialised weights the engine (bf16) and the oracle (fp32) decode different
    tokens, so a question may take more or fewer DRAGIN rounds on one side: the tokens per question and per second
    beside the questions/s say whether both did the same work (speedup_per_decode_token is the ratio of decode
    tokens/s)."""
    e_qps, o_qps = rep["engine_questions_per_s"], rep["oracle_questions_per_s"]
    e_dec, o_dec = tok_rate(e_qps, eng, "decode_tokens"), tok_rate(o_qps, orc, "decode_tokens")
    o_free = rate_without_answer_generation(orc)
    return {
        "dataset": name, "n_engine": len(eng), "n_oracle": len(orc), "n_compared": rep["n"],
        "engine_q_per_s": e_qps, "oracle_q_per_s": o_qps, "speedup": (e_qps / o_qps) if e_qps and o_qps else None,
        # the oracle's per-question answer generations (batched afterwards by the published evaluate.py) as free
        "speedup_oracle_answer_free": e_qps / o_free if e_qps and o_free else None,
        "speedup_per_decode_token": e_dec / o_dec if e_dec and o_dec else None,
        "engine_prefill_tok_per_s": tok_rate(e_qps, eng, "prefill_tokens"),
        "oracle_prefill_tok_per_s": tok_rate(o_qps, orc, "prefill_tokens"),
        "engine_decode_tok_per_s": e_dec, "oracle_decode_tok_per_s": o_dec,
        "engine_prefill_tok_per_q": per_q(eng, "prefill_tokens"), "oracle_prefill_tok_per_q": per_q(orc, "prefill_tokens"),
        "engine_decode_tok_per_q": per_q(eng, "decode_tokens"), "oracle_decode_tok_per_q": per_q(orc, "decode_tokens"),
        "engine_retrievals_per_q": per_q(eng, "retrievals"), "oracle_retrievals_per_q": per_q(orc, "retrievals"),
        "agreement": rep["agreement"], "engine_em": rep["engine_em"], "oracle_em": rep["oracle_em"],
    }


def floor_rows(names: list[str], metrics: list[dict], joint: bool, figures) -> list[dict]:
    """Engine wall and phase seconds against the device floor of its model work (fastrag.perf): one row for a joint
    run (one engine), one per dataset for separate runs. Runs whose metrics predate the counters are left out."""
    from fastrag.perf import floor, missing_field, phases

    items = [("all", metrics[0])] if joint else list(zip(names, metrics))
    rows = []
    for name, m in items:
        if missing_field(m) is not None or not m["engine"].get("decode_steps"):
            continue
        f = floor(m["engine"], m["model_costs"], figures)
        wall = m["joint"]["wall_s"] if joint else m["wall_s"]
        rows.append({"run": name, "engine_wall_s": wall, "floor_s": f["total_s"],
                     "wall_over_floor": wall / f["total_s"] if f["total_s"] > 0 else None} | phases(m, f))
    return rows


def md_table(rows: list[dict]) -> str:
    """A markdown table of rows (dicts of the same keys, in order): floats to 4 significant digits."""
    cols = list(rows[0])
    out = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    for r in rows:
        out += "| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()) + " |\n"
    return out


def oracle_host_line(recipes: list[tuple[str, list]]) -> str:
    """The header line on what the oracles' timings ran beside (fastrag.parity: each record's `host_cpu_s`, its
    process's CPU seconds, and `load_average_1m` when it started): per recipe, CPU seconds over wall seconds and the
    median load average, over the records that carry them; "" when none does (records from before them)."""
    parts = []
    for name, recs in recipes:
        timed = [r for r in recs if r.error is None and "host_cpu_s" in r.counters and r.wall_s > 0]
        if not timed:
            continue
        loads = sorted(r.counters["load_average_1m"] for r in timed if "load_average_1m" in r.counters)
        cpu = sum(r.counters["host_cpu_s"] for r in timed) / sum(r.wall_s for r in timed)
        parts.append(f"{name} {len(timed)} questions, {cpu:.2f} CPU s per wall s"
                     + (f", load average {loads[len(loads) // 2]:.1f} at their start (median)" if loads else ""))
    return f"- oracle timings beside their host: {'; '.join(parts)}\n" if parts else ""


def step_trace_rows(folders: list[Path], metrics: list[dict], joint: bool) -> list[dict]:
    """The rows of the step traces the run wrote ($FASTRAG_STEP_TRACE=1: step_trace.jsonl in each engine folder; a
    joint run wrote the same steps to each, so the first is read), of the folders whose metrics hold the model's
    costs; a line that is not JSON raises, named by file and line."""
    import gzip

    rows = []
    for folder, m in list(zip(folders, metrics))[: 1 if joint else None]:
        path = next((p for p in (folder / "step_trace.jsonl", folder / "step_trace.jsonl.gz") if p.exists()), None)
        if path is None or m.get("model_costs") is None:
            continue
        with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
            for i, line in enumerate(f, 1):
                try:
                    rows.append(json.loads(line))
                except ValueError as e:
                    raise ValueError(f"{path}:{i}: not a JSON step row ({e})") from None
    return rows


def decode_floor_rows(rows: list[dict], metrics: list[dict], figures) -> dict[str, list[dict]]:
    """The engine's decode steps against their floor, {"batch": by batch size, "prefixes": by shared prefixes in the
    step} (fastrag.perf.decode_steps_vs_floor), from the step-trace rows (`step_trace_rows`). Empty lists without a
    trace, or with one from before the steps' KV counts."""
    from fastrag.perf import decode_steps_vs_floor

    return {by: decode_steps_vs_floor(rows, metrics[0]["model_costs"], figures, by=by) if rows else []
            for by in ("batch", "prefixes")}


def forward_floor_rows(rows: list[dict], metrics: list[dict], figures) -> dict[str, list[dict]]:
    """The engine's prefill steps and attention passes against their floor, {"prefill": ..., "passes": ...}, by
    tokens in the step (fastrag.perf.forwards_vs_floor), from the step-trace rows (`step_trace_rows`). Empty lists
    without a trace, or with one from before the forwards' counts."""
    from fastrag.perf import forwards_vs_floor

    return {kind: forwards_vs_floor(rows, metrics[0]["model_costs"], figures, kind=kind) if rows else []
            for kind in ("prefill", "passes")}


def kernel_profile_section(metrics: list[dict]) -> str:
    """The results file's section on the profiled window of engine steps ($FASTRAG_KERNEL_PROFILE=FIRST:COUNT:
    metrics.json `kernel_profile`, fastrag.kernel_parts), or "" without one."""
    k = metrics[0].get("kernel_profile") if metrics else None
    if not k:
        return ""
    e = k["engine"]
    first, last = k["first_step"], k["first_step"] + k["steps"] - 1
    rows = [{"part": r["part"], "launches a step": r["launches_per_step"], "ms a step": r["ms_per_step"],
             "share": f"{r['share']:.1%}",
             "longest (ms a step)": "; ".join(f"`{short_name(n)}` {ms:.3f}" for n, ms in r["top"])}
            for r in k["parts"]]
    clock = e.get("device_prefill_s", 0.0) + e.get("device_decode_s", 0.0) + e.get("device_passes_s", 0.0)
    return (f"\n## Device time by part over engine steps {first}-{last} (torch.profiler, $FASTRAG_KERNEL_PROFILE)\n\n"
            f"Every {k['unit']} recorded from the launch of step {first} to the launch of step {last + 1} "
            f"({k['wall_s']:.2f} s of wall), put in one part by its name (fastrag.kernel_parts): "
            f"{k['launches']} launches, {k['kernel_s']:.3f} s in all, against {clock:.3f} s of the engine's device "
            f"clock in those steps (prefill {e.get('device_prefill_s', 0.0):.3f} s, decode "
            f"{e.get('device_decode_s', 0.0):.3f} s, attention passes {e.get('device_passes_s', 0.0):.3f} s). The "
            f"steps ran {e.get('decode_steps', 0)} decode steps ({e.get('decode_tokens', 0)} tokens) and "
            f"{e.get('prefill_calls', 0)} prefill calls ({e.get('prefill_tokens', 0)} tokens). The profiler slows "
            "the host: this run's throughput is not the engine's.\n\n" + md_table(rows))


def launch_profile_section(metrics: list[dict], top: int = 12) -> str:
    """The results file's section on where the steps' launch spent its host time, function by function
    ($FASTRAG_LAUNCH_PROFILE=1: metrics.json `launch_profile`, fastrag.launch_profile), or "" without one: a line
    per kind of step, the functions of the largest decode bucket by own time, and the functions whose time grows
    with the decode batch (per decode sequence, from the smallest bucket to the largest)."""
    lp = metrics[0].get("launch_profile") if metrics else None
    if not lp or not lp.get("kinds"):
        return ""
    kinds = lp["kinds"]
    out = ("\n## Where the steps' launch spends its host time (cProfile, $FASTRAG_LAUNCH_PROFILE)\n\n"
           "Every `Engine.step_launch` of the run under cProfile (the launching thread; wall-clock: a call that "
           "waits is charged its wait), kept apart by kind of step (fastrag.launch_profile). The profiler slows "
           "every Python call: this run's throughput and the launch's absolute times are not the engine's, the "
           "split is. Full statistics per kind in the run folder's launch_profile/*.pstats.\n\n")
    out += md_table([{"kind": kd, "steps": k["steps"], "mean decode batch": f"{k['mean_decode_batch']:.1f}",
                      "profiled launch us a step": f"{k['wall_us_per_step']:.0f}"} for kd, k in kinds.items()])
    decode = [kd for kd in kinds if kd.startswith("decode ")]
    if decode:
        big = max(decode, key=lambda kd: kinds[kd]["mean_decode_batch"])
        out += (f"\nThe {top} functions with the most own time in the plain decode steps of the largest batches "
                f"({big}, {kinds[big]['steps']} steps):\n\n")
        out += md_table([{"function": f"`{short_name(r['function'], 90)}`",
                          "calls a step": f"{r['calls_per_step']:.1f}", "own us a step": f"{r['own_us_per_step']:.1f}",
                          "cum us a step": f"{r['cum_us_per_step']:.1f}", "own share": f"{r['own_share']:.1%}"}
                         for r in kinds[big]["functions"][:top]])
    per = lp.get("per_sequence")
    if per:
        out += (f"\nWhat grows with the decode batch, from {per['from']} to {per['to']}: the profiled launch "
                f"{per['wall_us_per_seq']:.1f} us a decode sequence; the {top} functions whose own time grows the "
                "most, a decode sequence:\n\n")
        out += md_table([{"function": f"`{short_name(r['function'], 90)}`", "us a sequence": f"{r['us_per_seq']:.2f}",
                          "calls a sequence": f"{r['calls_per_seq']:.2f}"} for r in per["functions"][:top]])
    return out


def graphs_line(metrics: list[dict]) -> str:
    """The header line on the engine's CUDA graphs (one engine ran every dataset: the first metrics.json's
    figures), or "" when it decoded without them."""
    g = metrics[0].get("cuda_graphs") if metrics else None
    if not g:
        return ""
    ahead = g.get("captured_ahead", 0)
    return (f"- CUDA graphs: {ahead} captured before the clock started ({g.get('capture_ahead_s', 0.0):.2f} s, not in "
            f"the wall), {g['captures'] - ahead} captured by the timed run's steps, {g['replays']} steps replayed, "
            f"{g['eager_steps']} decoded eagerly; block tables "
            + (f"{g['table_width_blocks']} blocks wide\n" if g.get("table_width_blocks")
               else "as wide as the step's longest context, rounded up to a power of two\n"))


def prefill_graphs_line(metrics: list[dict]) -> str:
    """The header lines on the prefills and the attention passes replayed from CUDA graphs
    ($FASTRAG_PREFILL_GRAPHS, $FASTRAG_PASS_GRAPHS), or "" without them."""
    out = ""
    for key, title, calls in (("prefill_graphs", "Prefill graphs", "prefills"),
                              ("pass_graphs", "Attention-pass graphs", "pass calls")):
        p = metrics[0].get(key) if metrics else None
        if not p:
            continue
        off = f"; turned off: {p['disabled']}" if p.get("disabled") else ""
        if not p.get("applies"):
            out += (f"- {title}: none replayed (the model does not attend through the paged kernel with the fused "
                    f"small operations here{off})\n")
            continue
        ahead = p.get("captured_ahead", 0)
        out += (f"- {title} (calls of up to {p['max_seqs']} sequences and {p['token_buckets'][-1]} tokens): {ahead} "
                f"captured before the clock started ({p.get('capture_ahead_s', 0.0):.2f} s), "
                f"{p['captures'] - ahead} by the timed run, {p['replays']} {calls} replayed, {p['eager_calls']} "
                f"eager{off}\n")
        tr = metrics[0].get("step_trace") or {}
        if key == "prefill_graphs" and tr.get("prefill_graphed"):  # (the step trace's prefill steps, both ways)
            out += "  - prefill steps in the step trace: " + "; ".join(
                f"{name} {d['steps']} (median {d['median_tokens']:.0f} tokens, {d['median_device_ms']:.1f} ms of "
                f"device time; {d['device_s']:.2f} s in all)" if d["steps"] else f"{name} 0"
                for name, d in (("graphed", tr["prefill_graphed"]), ("eager", tr["prefill_eager"]))) + "\n"
    return out


def prefill_line(metrics: list[dict]) -> str:
    """The header line on how the engine's prefills attended (the first metrics.json's figures): the paged prefill
    kernel ($FASTRAG_PAGED_PREFILL; the default on CUDA) with its self-check, or the torch buckets with the
    cascade's, and then the paged kernel's failed self-check when it was tried; "" when the run does not say."""
    pa = metrics[0].get("prefill_attention") if metrics else None
    if not pa:
        return ""

    def checks(d: dict) -> str:
        return ", ".join(f"{k}: {v}" for k, v in d.items()) or "not run"

    if pa.get("paged_kernel"):
        return f"- prefill attention: the paged prefill kernel (self-check {checks(pa.get('paged_checks', {}))})\n"
    tried = f"; the paged prefill kernel not used (self-check {checks(pa['paged_checks'])})" \
        if pa.get("paged_checks") else ""
    return (f"- prefill attention: torch buckets, prefix as a cascade {'on' if pa.get('cascade') else 'off'} "
            f"(self-check {checks(pa.get('checks', {}))}){tried}\n")


def compiles_line(metrics: list[dict]) -> str:
    """The header line on the Triton compiles inside the engine's clock (the first metrics.json's figures:
    fastrag.kernels.compiles), by kernel with the steps they stopped; "" when the run does not say."""
    tc = metrics[0].get("triton_compiles") if metrics else None
    if not tc:
        return ""
    if not tc.get("hooked"):
        return f"- Triton compiles in the timed run: not recorded ({tc.get('why_not') or 'no hook'})\n"
    kernels = ", ".join(f"{k} x{n}" for k, n in sorted(tc.get("kernels", {}).items(), key=lambda kv: -kv[1]))
    steps = (metrics[0].get("step_trace") or {}).get("steps_with_compiles") or []
    where = "; steps " + ", ".join(f"{x['step']} ({x['step_ms']:.0f} ms)" if x.get("step_ms") is not None
                                   else str(x["step"]) for x in steps[:8]) if steps else ""
    return f"- Triton compiles in the timed run: {tc.get('count', 0)}" + (f" ({kernels}{where})" if kernels else "") \
        + "\n"


def text_line(metrics: list[dict]) -> str:
    """The header line on where the methods' spaCy texts ran (the first metrics.json's figures): the scheduler's
    thread, or N worker processes in groups (their default), free-running ($FASTRAG_TEXT_GROUPS=0) or in lockstep
    ($FASTRAG_TEXT_LOCKSTEP=1); "" when the run does not say."""
    tw = metrics[0].get("text_workers") if metrics else None
    if not tw:
        return ""
    if not tw.get("workers"):
        return "- spaCy texts: on the scheduler's thread (no text workers)\n"
    g = tw.get("groups")
    mode = "in lockstep" if tw.get("lockstep") else (
        f"in groups ({g['sent']} groups, up to {g['largest']} texts)" if g else "free-running")
    chosen = " (the run's own choice: no --text-workers)" if tw.get("chosen") == "auto" else ""
    return f"- spaCy texts: {tw['workers']} worker processes{chosen}, {mode}, {tw.get('texts', 0)} texts sent\n"


def run_engine(args, opts: dict) -> None:
    """The engine's part of the benchmark: the untimed warm-up, then the timed run (cProfile'd with --profile)."""
    if args.warmup:  # (the timed engine frees what this one left before sizing its pool: auto_kv_cache_gb)
        t0 = time.perf_counter()
        warm = [replace(opts[ds], output=str(Path(args.output) / "warmup" / ds), limit=args.warmup)
                for ds in args.datasets]
        for o in warm:
            shutil.rmtree(o.output, ignore_errors=True)
        window = os.environ.pop(KERNEL_PROFILE_ENV, None)  # ($FASTRAG_KERNEL_PROFILE: the timed run's steps only)
        try:
            run_many(warm)
        finally:
            if window is not None:
                os.environ[KERNEL_PROFILE_ENV] = window
        print(f"warm-up: {args.warmup} questions per dataset in {time.perf_counter() - t0:.1f} s (not timed)",
              flush=True)
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    if args.separate_engine_runs:
        for ds in args.datasets:
            run(opts[ds])
    else:
        run_many([opts[ds] for ds in args.datasets])
    if prof is not None:
        import pstats

        prof.disable()
        prof.dump_stats(args.profile)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def print_largest_blocks(n: int = 15) -> None:
    """The n largest live CUDA allocations, with the innermost frames of the code that made each (recorded with
    --memory-history; without it, sizes only)."""
    snap = torch.cuda.memory._snapshot()
    blocks = [b for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"]
    blocks.sort(key=lambda b: -b["size"])
    print(f"largest live blocks ({len(blocks)} live, {sum(b['size'] for b in blocks) / 2**30:.2f} GiB):", flush=True)
    for b in blocks[:n]:
        frames = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in b.get("frames", [])
                  if f["filename"].endswith(".py")][:4]
        print(f"  {b['size'] / 2**20:10.1f} MiB  " + (" <- ".join(frames) or "(no history)"), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", nargs="+", default=["hotpotqa", "2wikimultihopqa"], choices=list(DATA))
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--model", default="smollm2", help="engine and oracle model: smollm2 or an HF directory")
    ap.add_argument("--config", default=None,
                    help="a DRAGIN config file (the published repository's keys) over the paper's settings, for "
                         "engine and oracles alike (e.g. a shorter generate_max_length)")
    ap.add_argument("--data-dir", default=str(SHARED),
                    help="folder holding hotpotqa/, 2wikimultihopqa/, strategyqa/ and corpus/ (default ../shared/data)")
    ap.add_argument("--data-file", action="append", default=[], metavar="DATASET=FILE",
                    help="read DATASET's questions from FILE (relative to --data-dir unless absolute) instead of its "
                         "default file, e.g. 2wikimultihopqa=2wikimultihopqa/dev_first1000.json for a run of more "
                         "than 200 of its questions; repeatable")
    ap.add_argument("--oracle-limit", type=int, default=None,
                    help="questions per dataset for the published-recipe oracle (default: --limit)")
    ap.add_argument("--tuned-oracle-limit", type=int, default=0,
                    help="questions per dataset for the tuned per-question oracle (bf16 on a GPU, SDPA); 0: none")
    ap.add_argument("--output", default=str(ROOT / "runs" / "bench_e2e"))
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--report-only", action="store_true",
                    help="compute nothing: build the tables from the results already in --output (parity on the "
                         "questions both sides finished; the engine's rate from its metrics.json)")
    ap.add_argument("--keep-engine", action="store_true",
                    help="reuse engine results already in --output (default: the engine is always re-measured; "
                         "oracle results are reused, their per-question times give the oracle's rate)")
    ap.add_argument("--separate-engine-runs", action="store_true",
                    help="one engine job per dataset (default: all datasets' questions in one engine run)")
    ap.add_argument("--kv-cache-gb", type=float, default=None,
                    help="the engine's KV pool in GiB (default: the engine's own, sized from the device's memory)")
    ap.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                    help="the scheduler runs the methods' own logic while the device decodes the next step (auto: "
                         "on a GPU); time 'off' beside it to see what the overlap gives")
    ap.add_argument("--text-workers", type=int, default=None,
                    help="processes for DRAGIN's spaCy work (default: the run's own choice, "
                         "fastrag.text.pool.auto_text_workers: on a GPU the host's cores beyond two, at most 8; "
                         "on a CPU none, the scheduler's thread)")
    ap.add_argument("--warmup", type=int, default=0,
                    help="first run the engine on this many questions per dataset (untimed, own output folder): "
                         "the timed run then starts with the Triton kernels compiled, as a long-running job does")
    ap.add_argument("--memory-history", action="store_true",
                    help="GPU: record where every allocation was made, so that an out-of-memory error in the engine "
                         "prints the largest live blocks with the code that allocated them (recording slows the "
                         "allocator: a diagnosis, not the timed figure)")
    ap.add_argument("--profile", default=None,
                    help="write a cProfile of the engine run (host time by function) to this file as soon as the "
                         "engine finishes")
    args = ap.parse_args()

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else \
        f"CPU {cpu_name()} x{torch.get_num_threads()} threads"
    outs = {ds: Path(args.output) / ds for ds in args.datasets}
    data_dir = Path(args.data_dir)
    files = data_files(args.data_file, args.datasets, ap)
    try:  # (the options are checked here: a missing data file or corpus, a --limit below 1)
        opts = {ds: RunOptions(method="dragin", dataset=ds, data=str(data_dir / files[ds]), config=args.config,
                               corpus=str(data_dir / "corpus" / "wiki_passages.jsonl"),
                               output=str(outs[ds] / "engine"), limit=args.limit, batch_size=args.batch_size,
                               model=args.model, kv_cache_gb=args.kv_cache_gb,
                               overlap={"auto": None, "on": True, "off": False}[args.overlap],
                               text_workers=args.text_workers)
                for ds in args.datasets}
    except (ValueError, OSError) as e:
        sys.exit(f"bench_e2e.py: error: {e}")
    from fastrag.perf import measure_device

    # the device's own figures for the floor of the engine's work, measured before anything else runs
    figures = measure_device("cuda" if torch.cuda.is_available() else "cpu",
                             torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print("device figures:", json.dumps(figures.as_dict()), flush=True)
    if not (args.report_only or args.keep_engine):
        for ds in args.datasets:
            shutil.rmtree(outs[ds] / "engine", ignore_errors=True)
        if args.memory_history and torch.cuda.is_available():
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        try:
            run_engine(args, opts)
        except torch.OutOfMemoryError:
            if torch.cuda.is_available():
                print(torch.cuda.memory_summary(abbreviated=True), flush=True)
                print_largest_blocks()
            raise
        for ds in args.datasets:  # in the log at once: a run cut short still says where the engine's time went
            m = json.loads((outs[ds] / "engine" / "metrics.json").read_text())
            keep = ("n", "questions_per_s", "wall_s", "prefill_tokens_per_question", "decode_tokens_per_question",
                    "retrievals_per_question", "joint", "kv_cache_gb", "engine", "step_seconds", "overlap",
                    "text_workers", "retrieval", "cuda_graphs")
            print(f"engine {ds}:", json.dumps({k: m.get(k) for k in keep}), flush=True)
            for r in floor_rows([ds], [m], "joint" in m, figures):
                print(f"engine {ds} vs device floor:", json.dumps(r), flush=True)
    gc.collect()  # the engine (weights and a KV pool sized to the device) goes back before the oracles load
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    rows, reports = [], {}
    eng_all, orc_all = [], []
    oracle_now = {"published": 0, "tuned": 0}  # oracle questions this invocation computed (the rest: earlier records)
    for ds in args.datasets:
        out = outs[ds]
        if not args.report_only:
            ids = [e.qid for e in load_examples(ds, opts[ds].data, limit=args.limit)]
            pub = spread(ids, args.oracle_limit or args.limit)
            oracle_now["published"] += run_oracle(replace(opts[ds], output=str(out), qids=tuple(pub)),
                                                  out / "oracle")[2]
            if args.tuned_oracle_limit:  # the published recipe's questions first: same-question rates below
                n_t = args.tuned_oracle_limit
                tuned = spread(pub, n_t) if n_t <= len(pub) else spread(ids, n_t)
                oracle_now["tuned"] += run_oracle(replace(opts[ds], output=str(out), qids=tuple(tuned)),
                                                  out / "oracle-tuned", recipe="tuned")[2]
        eng = read_results(out / "engine" / "results.jsonl")
        orc = read_results(out / "oracle" / "results.jsonl")
        rep = report_from(out, eng, orc)
        eng_all += eng
        orc_all += orc
        reports[ds] = {k: v for k, v in rep.items() if k != "disagreements"}
        reports[ds]["n_disagreements"] = len(rep["disagreements"])
        rows.append(row(ds, eng, orc, rep))
    # the speed figure: every question of every dataset, engine wall clock (joint run: one clock; separate runs:
    # their sum) against the oracle's per-question times
    metrics = [json.loads((outs[ds] / "engine" / "metrics.json").read_text()) for ds in args.datasets]
    joint = metrics[0].get("joint")
    is_joint = joint is not None and all(m.get("joint", {}).get("wall_s") == joint["wall_s"] for m in metrics)
    if is_joint:
        e_wall = joint["wall_s"]
    else:
        e_wall = sum(m["wall_s"] for m in metrics)
    f_rows = floor_rows(list(args.datasets), metrics, is_joint, figures)
    trace = step_trace_rows([outs[ds] / "engine" for ds in args.datasets], metrics, is_joint)
    d_rows, p_rows = decode_floor_rows(trace, metrics, figures).values()
    from fastrag.perf import launch_by_batch, launch_fit

    l_rows, l_fit = launch_by_batch(trace), launch_fit(trace)
    pre_rows, pass_rows = forward_floor_rows(trace, metrics, figures).values()
    n_e = sum(m["computed_this_run"] for m in metrics)
    rep_all = compare(eng_all, orc_all, method_decisions("dragin"))
    rep_all.update({"engine_questions_per_s": engine_rate(metrics, e_wall),
                    "oracle_questions_per_s": _rate(orc_all),
                    "engine_em": None, "oracle_em": None})
    if len(args.datasets) > 1:
        rows.append(row("all", eng_all, orc_all, rep_all))
    tuned_rows, tuned_all = [], []
    if args.tuned_oracle_limit or any((outs[ds] / "oracle-tuned" / "results.jsonl").exists() for ds in args.datasets):
        for ds in args.datasets:
            tuned_all += read_results(outs[ds] / "oracle-tuned" / "results.jsonl")
        t_rep = compare(eng_all, tuned_all, method_decisions("dragin"))
        e_qps, t_qps, p_qps = rep_all["engine_questions_per_s"], _rate(tuned_all), _rate(orc_all)
        # the published recipe on the tuned recipe's questions: with random weights the two decode different tokens
        # (fp32 vs bf16), so their rounds, and hence their work per question, may differ (2026-11-24: 2 questions,
        # 39.4 s/q tuned vs 12.3 s/q published); the per-token rates say whether either is slower per unit of work
        qids = {r.qid for r in tuned_all}
        same = [r for r in orc_all if r.qid in qids]
        s_qps = _rate(same)
        e_dec, t_dec = tok_rate(e_qps, eng_all, "decode_tokens"), tok_rate(t_qps, tuned_all, "decode_tokens")
        tuned_rows.append({"n_tuned_oracle": len(tuned_all), "tuned_oracle_q_per_s": t_qps,
                           "published_oracle_q_per_s": p_qps, "engine_q_per_s": e_qps,
                           "engine_vs_tuned": e_qps / t_qps if e_qps and t_qps else None,
                           "engine_vs_published": e_qps / p_qps if e_qps and p_qps else None,
                           "engine_vs_tuned_answer_free": (e_qps / rate_without_answer_generation(tuned_all)
                                                           if e_qps and rate_without_answer_generation(tuned_all)
                                                           else None),
                           "engine_vs_tuned_per_decode_token": e_dec / t_dec if e_dec and t_dec else None,
                           "tuned_prefill_tok_per_s": tok_rate(t_qps, tuned_all, "prefill_tokens"),
                           "tuned_decode_tok_per_s": t_dec,
                           "tuned_prefill_tok_per_q": per_q(tuned_all, "prefill_tokens"),
                           "tuned_decode_tok_per_q": per_q(tuned_all, "decode_tokens"),
                           "tuned_retrievals_per_q": per_q(tuned_all, "retrievals"),
                           "n_published_same_questions": len(same), "published_q_per_s_same_questions": s_qps,
                           "published_decode_tok_per_s_same_questions": tok_rate(s_qps, same, "decode_tokens"),
                           "published_decode_tok_per_q_same_questions": per_q(same, "decode_tokens"),
                           "published_retrievals_per_q_same_questions": per_q(same, "retrievals"),
                           "agreement_engine_vs_tuned": t_rep["agreement"]})
        reports["tuned_oracle"] = tuned_rows[0]
    reports["all"] = {k: v for k, v in rep_all.items() if k != "disagreements"} | {
        "engine_wall_s": e_wall, "engine_questions_computed": n_e,
        "engine_mode": "separate" if args.separate_engine_runs or joint is None else "joint"}
    o_devs = oracle_devices([outs[ds] / sub for ds in args.datasets for sub in ("oracle", "oracle-tuned")])
    here = device_name("cuda" if torch.cuda.is_available() else None)  # as the oracles' runs.jsonl name it
    from bench_args import env_prefix  # (the script's folder is on sys.path)

    script = str(Path(sys.argv[0]).relative_to(ROOT)) if Path(sys.argv[0]).is_absolute() else sys.argv[0]
    cmd = env_prefix() + "python " + shlex.join([script, *sys.argv[1:]])
    tag = "cuda" if torch.cuda.is_available() else "cpu"
    res = Path(args.results)
    res.mkdir(parents=True, exist_ok=True)
    head = (f"# DRAGIN end to end: engine vs per-question oracle ({tag})\n\n"
            f"- date: {dt.date.today().isoformat()}\n- device: {device}\n"
            f"- {versions('torch', 'transformers', 'triton')}\n"
            f"- model: {'SmolLM2-135M-Instruct (embedded GGUF)' if args.model == 'smollm2' else args.model} "
            f"({'bf16' if torch.cuda.is_available() else 'fp32'} engine), BM25 (bm25s) over the 13.5k-passage corpus\n"
            + (f"- settings: DRAGIN paper Table 9 per dataset with {args.config} over it" if args.config
               else "- settings: DRAGIN paper Table 9 per dataset")
            + f", greedy; engine batch {args.batch_size}\n"
            f"- questions: the first {args.limit} of each file: "
            + ", ".join(f"{ds} {files[ds].as_posix()}" for ds in args.datasets) + "\n"
            f"- engine: {'one run per dataset' if reports['all']['engine_mode'] == 'separate' else 'one joint run over all datasets (per-dataset speed not separable: see the all row)'}; "
            f"engine wall {e_wall:.0f} s for {n_e} questions\n"
            f"- oracle questions: per dataset, --oracle-limit / --tuned-oracle-limit of the engine's questions spread "
            f"evenly over them (the first, the last, equal steps between); timed by this invocation: published "
            f"recipe {oracle_now['published']} of {len(orc_all)}, tuned {oracle_now['tuned']} (the others' seconds "
            f"are records of an earlier run into the same folders); oracle timings measured on: "
            f"{', '.join(o_devs) or 'none'}"
            + (f" -- NOT ONLY THIS RUN'S DEVICE ({here}): the ratios mix machines\n"
               if any(d != here for d in o_devs) else "\n")
            + f"- scheduler overlap (the methods' host logic run while the device decodes the next step): "
            f"{args.overlap if args.overlap != 'auto' else ('on' if torch.cuda.is_available() else 'off')}\n"
            + (f"- warm-up: before the timed run, an untimed engine run over the first {args.warmup} questions "
               f"of each dataset (Triton kernels compiled)\n" if args.warmup else "")
            + oracle_host_line([("published", orc_all), ("tuned", tuned_all)])
            + graphs_line(metrics) + prefill_graphs_line(metrics) + prefill_line(metrics) + text_line(metrics) + compiles_line(metrics)
            + f"- command: `{cmd}`\n\n")
    table = md_table(rows)
    if tuned_rows:
        table += ("\n## Engine vs the tuned per-question oracle (bf16 on a GPU, fp32 on a CPU; SDPA; batch size 1), "
                  "all datasets\n\n" + md_table(tuned_rows))
    if f_rows:
        table += ("\n## Engine time against its device floor\n\n"
                  f"Floor: the least time the engine's counted model work (decode steps, KV entries read, tokens "
                  f"prefilled) takes at this device's measured copy bandwidth "
                  f"({figures.copy_bytes_per_s / 1e9:.1f} GB/s) and {figures.dtype} matmul rate "
                  f"({figures.matmul_flops_per_s / 1e12:.2f} TFLOP/s) (fastrag/perf.py). prefill_and_passes_s / decode_s: the "
                  "engine's host seconds in each phase (device time included: each ends in a host copy; DRAGIN's "
                  "attention passes count as prefill work). device_busy_s: the device's own seconds in those phases "
                  "(CUDA events around each, fastrag.engine.DeviceClock; on a CPU the launches' host seconds), and "
                  "device_busy_fraction its share of the wall time: the rest the device waited for the host.\n\n"
                  + md_table(f_rows))
    if d_rows:
        table += ("\n## Decode steps against their floor, by batch size (step trace)\n\n"
                  "Per decode step of the engine's step trace: its device milliseconds (CUDA events from its first "
                  "kernel to its sampled tokens: the forward, the signals and the sampling) against its own floor "
                  "(every weight read once plus the KV entries its attention read: each sequence's own context, "
                  "each shared prefix once; fastrag.perf.decode_step_floor). ctx_per_seq: own-context entries per "
                  "sequence; prefix_entries: the shared prefixes' entries the step read.\n\n" + md_table(d_rows))
    if p_rows:
        table += ("\n## Decode steps against their floor, by shared prefixes in the step (step trace)\n\n"
                  "The same steps grouped by how many shared prefixes (the datasets' demos) their sequences start "
                  "with: a step of several prefixes reads each once and merges its part into the rows of its "
                  "sequences.\n\n" + md_table(p_rows))
    if l_rows:
        fit = "" if l_fit is None else (
            f" A least-squares fit over the {l_fit['steps']} steps that decoded (eager prefills left out): launch = "
            f"{l_fit['fixed_ms']:.2f} ms + "
            f"{l_fit['per_decode_seq_us']:.1f} us a decode sequence + {l_fit['per_prefill_seq_us']:.1f} us a prefilled "
            f"sequence + {l_fit['per_prefill_token_us']:.2f} us a prefilled token (fastrag.perf.launch_fit).")
        table += ("\n## The host's launch of the decode steps, by batch size (step trace)\n\n"
                  "launch: the engine step's first half on the host, from building its inputs to its last launch "
                  "(the device mostly waits meanwhile); track: dragin-streaming's attention maxima moved to the "
                  "tracking kernel and back, part of the launch; launch_cpu_share: the launch's thread CPU time over "
                  "its wall (the rest it waited: for the GIL, or in a blocking call) (fastrag.perf.launch_by_batch)."
                  + fit + "\n\n" + md_table(l_rows))
    if pre_rows:
        table += ("\n## Prefill steps against their floor, by tokens in the step (step trace)\n\n"
                  "Per engine step that prefilled: its device milliseconds (CUDA events from its first prefill kernel "
                  "to its first tokens sampled) against its own floor (the weights read once per forward plus the "
                  "tokens' KV written, or 2 FLOPs per weight per token plus the attention's over every context entry "
                  "each token saw, whichever is longer; fastrag.perf.forward_floor). graphed_steps: steps whose "
                  "prefill replayed a CUDA graph.\n\n" + md_table(pre_rows))
    if pass_rows:
        table += ("\n## Attention passes against their floor, by tokens in the step (step trace)\n\n"
                  "DRAGIN's cache-free attention passes launched after each engine step (its RIND and QFS lists), "
                  "the same way: device milliseconds from the passes' first kernel to their last, against the floor "
                  "of their forwards and tokens. graphed_steps: steps with a pass forward replayed from a CUDA "
                  "graph.\n\n" + md_table(pass_rows))
    table += kernel_profile_section(metrics)
    table += launch_profile_section(metrics)
    (res / f"e2e_{tag}.md").write_text(head + table)
    (res / f"e2e_{tag}.json").write_text(json.dumps({"rows": rows, "parity": reports, "device": device,
                                                     "floor": f_rows, "decode_floor": d_rows, "decode_floor_by_prefixes": p_rows,
                                                     "launch_by_batch": l_rows, "launch_fit": l_fit,
                                                     "prefill_floor": pre_rows, "passes_floor": pass_rows,
                                                     "device_figures": figures.as_dict()}, indent=2))
    print(head + table)


if __name__ == "__main__":
    main()
