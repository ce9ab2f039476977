"""Where the methods' spaCy texts run, against a device of given latencies: the scheduler's thread, lockstep workers
or text groups, on the CPU with a device emulated in time.

A CPU has no device to hide host work behind: the model's forward runs on the thread that also runs spaCy, so a CPU
run cannot show what the text modes do to a GPU run. This benchmark keeps everything real (the engine and its
tiny random model, the DRAGIN policy, BM25, spaCy and its worker processes) and adds a device timeline: each engine
step's decode and prefill tokens, and each call's launch, cost the time the H200 took for them on 2026-11-26d
(flags below, from benchmarks/results/gpu_h200_2026-11-26d.md's step traces), the launch part blocking the
scheduler's thread as an eager launch does, the device part running beside it until `step_finish` or the attention
passes' wait. Its figures say how the scheduler overlaps host and device under that model, not what a GPU does.

    python benchmarks/bench_text_modes.py --model /tmp/fastrag_model_tiny --limit 64 --workers 2

writes benchmarks/results/text_modes_cpu.md (+ .json): per mode the wall, questions/s, prefill calls, decode steps,
the methods' host seconds, the seconds the scheduler waited for texts, the emulated device's busy fraction, and
whether every question decided as in the first mode.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
MODES = {  # name -> (text workers, environment)
    "main": (0, {}),
    "lockstep": (None, {"FASTRAG_TEXT_LOCKSTEP": "1"}),
    "groups": (None, {"FASTRAG_TEXT_GROUPS": "1"}),
    "free": (None, {"FASTRAG_TEXT_GROUPS": "0"}),
}


class _Event:
    """A device event at a time on the emulated timeline (the attention passes' wait)."""

    def __init__(self, at: float):
        self.at = at

    def query(self) -> bool:
        return time.perf_counter() >= self.at

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.at - time.perf_counter()))


class DeviceModel:
    """Wraps an engine's launch/finish calls with an emulated device: per step `decode_ms + decode_ms_per_seq * B`
    and `prefill_ms_per_token * T` of device time, serial on one timeline; per prefill call `prefill_launch_ms` and
    per attention-pass call `pass_launch_ms` of host time (the scheduler's thread sleeps), then `pass_ms` on the
    device."""

    def __init__(self, engine, args):
        self.e, self.a = engine, args
        self.free_at = 0.0  # when the emulated device has run everything launched so far
        self.busy = 0.0
        self.ready: dict[int, float] = {}
        self._launch, self._finish = engine.step_launch, engine.step_finish
        self._plaunch = engine.attention_passes_launch
        engine.step_launch, engine.step_finish = self.step_launch, self.step_finish
        engine.step_done = self.step_done
        engine.attention_passes_launch = self.passes_launch

    def _run(self, seconds: float) -> float:
        start = max(time.perf_counter(), self.free_at)
        self.free_at = start + seconds
        self.busy += seconds
        return self.free_at

    def step_launch(self):
        s = self.e.stats
        calls, tokens, dec = s["prefill_calls"], s["prefill_tokens"], s["decode_tokens"]
        st = self._launch()
        a = self.a
        calls, tokens, dec = s["prefill_calls"] - calls, s["prefill_tokens"] - tokens, s["decode_tokens"] - dec
        if calls:
            time.sleep(calls * a.prefill_launch_ms / 1e3)
        work = (tokens * a.prefill_ms_per_token + (a.decode_ms + a.decode_ms_per_seq * dec if dec else 0.0)) / 1e3
        self.ready[id(st)] = self._run(work) if work else time.perf_counter()
        return st

    def step_done(self, st) -> bool:
        return time.perf_counter() >= self.ready.get(id(st), 0.0)

    def step_finish(self, st):
        time.sleep(max(0.0, self.ready.pop(id(st), 0.0) - time.perf_counter()))
        return self._finish(st)

    def passes_launch(self, seqs, kind):
        pending = self._plaunch(seqs, kind)
        time.sleep(self.a.pass_launch_ms / 1e3)
        pending.event = _Event(self._run(self.a.pass_ms / 1e3))
        return pending


def run_mode(name: str, args) -> dict:
    from fastrag.eval import RunOptions, build_engine, read_results, run

    workers, env = MODES[name]
    workers = args.workers if workers is None else workers
    saved = {k: os.environ.get(k) for k in ("FASTRAG_TEXT_LOCKSTEP", "FASTRAG_TEXT_GROUPS")}
    for k in saved:
        os.environ.pop(k, None)
    os.environ.update(env)
    out = Path(args.output) / name
    shutil.rmtree(out, ignore_errors=True)
    opts = RunOptions(method="dragin", dataset=args.dataset, data=str(args.data), corpus=args.corpus,
                      output=str(out), model=args.model, limit=args.limit, batch_size=args.batch_size,
                      overlap=True, text_workers=workers, progress=False)
    try:
        engine = build_engine(args.model, args.batch_size, signals=args.signals)
        dev = DeviceModel(engine, args)
        t0 = time.perf_counter()
        m = run(opts, engine=engine)
        wall = time.perf_counter() - t0
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
    decisions = {r.qid: r.prediction for r in read_results(out / "results.jsonl")}
    sec = m.get("step_seconds", {})
    eng = m.get("engine", {})
    return {"mode": name, "text_workers": workers, "env": " ".join(f"{k}={v}" for k, v in env.items()) or "-",
            "wall_s": wall, "q_per_s": m["n"] / wall, "prefill_calls": eng.get("prefill_calls"),
            "decode_steps": eng.get("decode_steps"), "methods_s": sec.get("methods_and_other"),
            "waiting_texts_s": sec.get("waiting_text_workers"), "passes_s": sec.get("attention_passes"),
            "device_busy_s": dev.busy, "device_busy_fraction": dev.busy / wall, "errors": m.get("errors"),
            "_decisions": decisions}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an HF directory (benchmarks/make_random_model.py --shape tiny)")
    p.add_argument("--dataset", default="hotpotqa")
    p.add_argument("--data", type=Path, default=SHARED / "hotpotqa" / "dev_distractor_200.jsonl")
    p.add_argument("--corpus", default=None, help="default: the bundled passage corpus")
    p.add_argument("--limit", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=2, help="text workers of the modes that have them")
    p.add_argument("--signals", default="cpp", help="the engine's signal backend (cpp: the least host time a CPU "
                   "step can take; torch spends ~30 ms a step at batch 128, benchmarks/results/host_cpu.md)")
    p.add_argument("--modes", nargs="+", default=["main", "lockstep", "groups"], choices=list(MODES))
    p.add_argument("--repeats", type=int, default=1, help="runs of each mode, interleaved (the table's median)")
    p.add_argument("--decode-ms", type=float, default=5.5)
    p.add_argument("--decode-ms-per-seq", type=float, default=0.05)
    p.add_argument("--prefill-launch-ms", type=float, default=17.0)
    p.add_argument("--prefill-ms-per-token", type=float, default=0.025)
    p.add_argument("--pass-launch-ms", type=float, default=18.0)
    p.add_argument("--pass-ms", type=float, default=2.0)
    p.add_argument("--output", default="/tmp/fastrag_runs/text_modes")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--name", default="text_modes_cpu")
    args = p.parse_args(argv)
    if args.corpus is None:
        from fastrag.eval import BUNDLED

        args.corpus = str(BUNDLED / "wiki_passages.jsonl")
    if not args.data.exists():
        raise SystemExit(f"--data {args.data}: no such file")
    from tqdm import tqdm

    runs: dict[str, list[dict]] = {m: [] for m in args.modes}
    for _ in tqdm(range(args.repeats), desc="repeats"):
        for mode in args.modes:
            runs[mode].append(run_mode(mode, args))
    rows = []
    first = runs[args.modes[0]][0]["_decisions"]
    for mode in args.modes:
        rs = sorted(runs[mode], key=lambda r: r["wall_s"])
        med = dict(rs[len(rs) // 2])
        med["walls_s"] = ", ".join(f"{r['wall_s']:.2f}" for r in runs[mode])
        med["decides_as_" + args.modes[0]] = all(r["_decisions"] == first for r in runs[mode])
        med.pop("_decisions")
        rows.append(med)
    from fastrag.provenance import cpu_name

    import torch

    cmd = "python benchmarks/bench_text_modes.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    head = (f"# The methods' texts against an emulated device (CPU {cpu_name()}, {os.cpu_count()} threads)\n\n"
            f"- date: {dt.date.today()}; torch {torch.__version__}; command: `{cmd}`\n"
            f"- DRAGIN on {args.limit} {args.dataset} questions ({args.data.name}), model {args.model}, batch "
            f"{args.batch_size}, signals {args.signals}, overlap on, {args.workers} text workers where the mode has "
            f"them\n"
            f"- emulated device (H200, Llama-2-7B shape, 2026-11-26d step traces): decode step {args.decode_ms} ms + "
            f"{args.decode_ms_per_seq} ms a sequence; prefill {args.prefill_launch_ms} ms of host launch a call + "
            f"{args.prefill_ms_per_token} ms of device a token; attention passes {args.pass_launch_ms} ms of host "
            f"launch a call + {args.pass_ms} ms of device. The model's own CPU forward runs too (host time).\n"
            f"- modes: main = spaCy on the scheduler's thread; lockstep = a step's texts on the workers, waited for; "
            f"groups = a step's texts on the workers as one group, not waited for; free = each text on its own\n"
            f"- median of {args.repeats} run(s) a mode, interleaved; walls_s lists every run\n\n")
    cols = [c for c in rows[0]]
    table = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    for r in rows:
        table += "| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()) + " |\n"
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"{args.name}.md").write_text(head + table)
    (args.results / f"{args.name}.json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=1) + "\n")
    print(head + table)


if __name__ == "__main__":
    main()
