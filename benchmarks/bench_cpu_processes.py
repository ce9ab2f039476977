"""Decode steps of several engine processes sharing one CPU: what oversubscribing the cores costs.

Each case starts P processes, each an engine on the real SmolLM2 (fp32) decoding a batch of B sequences with T torch
threads (optionally under OMP_WAIT_POLICY=PASSIVE); all load first, then time their steps at the same moment. A
process whose OpenMP threads outnumber the cores left to it by the others spins waiting for work on cores those
others need: the case P x T against the cores is what `fastrag run --ray` on a CPU, or two runs side by side, does.
The table gives each case's median step (the median over its processes of their median step) and the decode
tokens/s of all processes together (the sum of B / median step), each the median over `--rounds` rounds in which
every case runs once, in turn. Writes benchmarks/results/cpu_processes.md (and .json).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_args import positive_int  # noqa: E402  (the script's folder is on sys.path)
from fastrag.text.pool import usable_cpus

ROOT = Path(__file__).resolve().parents[1]


def case(text: str) -> tuple[int, int, bool]:
    """'P:T' or 'P:T:passive' -> (processes, threads each, passive wait policy)."""
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "passive"):
            raise ValueError
        procs, threads = positive_int(parts[0]), positive_int(parts[1])
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"a case is PROCESSES:THREADS or PROCESSES:THREADS:passive, got {text!r}")
    return procs, threads, len(parts) == 3


def worker(batch: int, reps: int, threads: int) -> None:
    """One process of a case: load, prefill, say 'ready' with its prefix and own token counts, wait for 'go' on
    stdin, time `reps` decode steps, print their seconds as one JSON line."""
    import torch

    from fastrag.engine import Engine
    from fastrag.model.llama import LlamaModel
    from fastrag.model.loading import load_tokenizer, resolve_model

    torch.set_num_threads(threads)
    hf = resolve_model("smollm2")
    tok = load_tokenizer(hf)
    model = LlamaModel.from_pretrained(hf).eval()
    eng = Engine(model, tok, kv_cache_gb=0.5, max_batch=batch)
    prefix = " ".join(["The river flows past the old mill and under the stone bridge."] * 40)
    eng.set_prefix(prefix)
    own = tok.encode(prefix) + tok.encode(" Question: where is the bridge? " + "Evidence passage words. " * 60)
    for _ in range(batch):
        eng.start(eng.new_sequence(), own, reps + 4)
    while eng.waiting:
        eng.step()
    eng.step()  # (first-call costs stay out of the timing)
    print("ready", len(tok.encode(prefix)), len(own), flush=True)
    sys.stdin.readline()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    print(json.dumps(times), flush=True)


def run_case(procs: int, threads: int, passive: bool, batch: int, reps: int) -> tuple[list[float], tuple[int, int]]:
    """The median step seconds of each of the case's processes, and (prefix, own) tokens of a sequence."""
    env = dict(os.environ)
    if passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    cmd = [sys.executable, __file__, "--worker", "--batch", str(batch), "--reps", str(reps), "--threads", str(threads)]
    ps = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
          for _ in range(procs)]
    try:
        for p in ps:
            words = p.stdout.readline().split()
            if words[:1] != ["ready"]:
                raise SystemExit(f"bench_cpu_processes: a worker of case {procs}:{threads} failed to start "
                                 f"(exit {p.wait()})")
            shape = (int(words[1]), int(words[2]))
        for p in ps:  # (all loaded: they start timing together)
            p.stdin.write("go\n")
            p.stdin.flush()
        out = [json.loads(p.stdout.readline()) for p in ps]
        for p in ps:
            p.wait()
    finally:
        for p in ps:  # (a failed case leaves no worker waiting on its stdin)
            if p.poll() is None:
                p.kill()
    return [statistics.median(t) for t in out], shape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # default cases: one process with a thread for every CPU, then for half of them; two processes with a thread for
    # every CPU each (oversubscribed, as two runs at torch's default), two that share the CPUs, and the
    # oversubscribed pair again under a passive wait policy
    cpus = usable_cpus()
    half = max(1, cpus // 2)
    defaults = (f"1:{cpus}", f"1:{half}", f"2:{cpus}", f"2:{half}", f"2:{cpus}:passive")
    ap.add_argument("--cases", type=case, nargs="+", default=[case(c) for c in defaults],
                    help=f"PROCESSES:THREADS[:passive] each (default here: {' '.join(defaults)})")
    ap.add_argument("--batch", type=positive_int, default=8)
    ap.add_argument("--reps", type=positive_int, default=30)
    ap.add_argument("--rounds", type=positive_int, default=2)
    ap.add_argument("--threads", type=positive_int, default=1, help=argparse.SUPPRESS)  # (a worker's)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"), help="folder of the result tables")
    args = ap.parse_args()
    if args.worker:
        return worker(args.batch, args.reps, args.threads)
    args.cases = list(dict.fromkeys(args.cases))  # (a case named twice, or defaults that meet on one CPU, runs once)
    import torch

    from fastrag.provenance import cpu_name

    steps = {c: [] for c in args.cases}  # case -> per round, the median over its processes
    rates = {c: [] for c in args.cases}  # case -> per round, decode tokens/s of its processes together
    for r in range(args.rounds):
        for c in args.cases:
            per, (prefix_n, own_n) = run_case(*c, args.batch, args.reps)
            steps[c].append(statistics.median(per))
            rates[c].append(sum(args.batch / s for s in per))
            print(f"round {r + 1}: {c[0]} x {c[1]} threads{' passive' if c[2] else ''}: "
                  f"{[round(1e3 * s, 1) for s in per]} ms a step", flush=True)
    rows = []
    for c in args.cases:
        procs, threads, passive = c
        rows.append({"processes": procs, "threads": threads, "passive": passive,
                     "threads_per_cpu": procs * threads / cpus, "step_ms": 1e3 * statistics.median(steps[c]),
                     "step_ms_rounds": [1e3 * s for s in steps[c]], "tokens_per_s": statistics.median(rates[c])})
    # the baseline: one process with a thread for every CPU, else the first case
    base = next((x for x in rows if x["processes"] == 1 and x["threads"] >= cpus and not x["passive"]), rows[0])
    command = "python " + shlex.join(["benchmarks/bench_cpu_processes.py", *sys.argv[1:]])
    head = [f"# Engine processes sharing one CPU (decode steps, SmolLM2-135M fp32, batch {args.batch})", "",
            f"- device: {cpu_name()}, {cpus} usable CPUs of {os.cpu_count()}; date {dt.date.today().isoformat()}; "
            f"torch {torch.__version__}",
            f"- command: `{command}`",
            f"- each process: one engine, {args.batch} sequences of {prefix_n} shared-prefix and {own_n} own tokens, "
            f"{args.reps} timed decode steps; all processes of a case time their steps at once",
            "- step ms: the median over the case's processes of their median step, then the median over "
            f"{args.rounds} rounds (each round runs every case once, in turn); tokens/s: the decode tokens a second "
            f"of all the case's processes together; vs base: against {base['processes']} x {base['threads']} threads",
            "", "| processes | threads each | wait policy | threads / CPU | step ms | rounds ms | tokens/s (all) | "
            "tokens/s vs base |", "|---|---|---|---|---|---|---|---|"]
    body = [f"| {x['processes']} | {x['threads']} | {'PASSIVE' if x['passive'] else 'default'} | "
            f"{x['threads_per_cpu']:.1f} | {x['step_ms']:.1f} | "
            f"{' / '.join(f'{s:.0f}' for s in x['step_ms_rounds'])} | {x['tokens_per_s']:.1f} | "
            f"{x['tokens_per_s'] / base['tokens_per_s']:.2f} |" for x in rows]
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_processes.md").write_text("\n".join(head + body) + "\n")
    (out / "cpu_processes.json").write_text(json.dumps({"command": command, "cpus": cpus, "rows": rows}, indent=2)
                                            + "\n")
    print("\n".join(head + body))


if __name__ == "__main__":
    main()
