"""`fastrag run --ray` against the single-process run on the same questions: identical results, also after a
worker is SIGKILLed mid-run.

Three runs of the same command line (method, dataset, questions, batch size, config), each through the CLI as a
user would start it:
  1. single process (`fastrag run`), the reference;
  2. `fastrag run --ray --num-workers N`, nothing disturbed;
  3. the same, with shard 0's worker process killed (SIGKILL) once its shard has written `--kill-after` answers.
Each Ray result set is compared question by question with the reference: prediction, and every retrieval round's
trigger sentence, query and retrieved passage ids; the merged file must hold every question exactly once, in the
dataset's order, and the killed shard's file no question twice. Writes `benchmarks/results/ray_<device>.md` (+ .json).

    python benchmarks/bench_ray.py --dataset hotpotqa --limit 100 --batch-size 32 --num-workers 2

Runs already complete in `--out` are reused (delete the folder to start over); `--skip-plain` leaves out run 2.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
DATA = {
    "hotpotqa": SHARED / "hotpotqa" / "dev_distractor_200.jsonl",
    "2wikimultihopqa": SHARED / "2wikimultihopqa" / "dev_sample_200.jsonl",
}
CORPUS = SHARED / "corpus" / "wiki_passages.jsonl"


def records(out: Path) -> list[dict]:
    p = out / "results.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def decisions(recs: list[dict]) -> dict:
    return {r["qid"]: (r["prediction"], [(x["trigger_sentence"], x["query"], x["doc_ids"]) for x in r["rounds"]])
            for r in recs}


def complete(out: Path, n: int) -> bool:
    return (out / "metrics.json").exists() and len(records(out)) == n


def base_args(a, out: Path) -> list[str]:
    args = [sys.executable, "-m", "fastrag", "run", "--method", a.method, "--dataset", a.dataset,
            "--data", str(a.data), "--corpus", str(a.corpus), "--limit", str(a.limit),
            "--batch-size", str(a.batch_size), "--output", str(out), "--no-progress"]
    if a.config:
        args += ["--config", str(a.config)]
    return args


def run_cli(args: list[str], label: str) -> float:
    print(f"[{label}] {' '.join(args[2:])}", flush=True)
    t0 = time.perf_counter()
    p = subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise SystemExit(f"[{label}] exit {p.returncode}:\n{p.stderr[-4000:]}")
    return time.perf_counter() - t0


def run_killed(args: list[str], out: Path, kill_after: int) -> tuple[float, dict]:
    """Starts the Ray run, SIGKILLs shard 0's worker once that shard wrote `kill_after` answers."""
    print(f"[ray+kill] {' '.join(args[2:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    shard = out / "shards" / "0"
    killed: dict = {}
    while proc.poll() is None and not killed:
        res = shard / "results.jsonl"
        n = res.read_text().count("\n") if res.exists() else 0
        if (shard / "worker.pid").exists() and n >= kill_after:
            pid = int((shard / "worker.pid").read_text())
            os.kill(pid, signal.SIGKILL)
            killed = {"pid": pid, "shard": 0, "answers_in_shard_when_killed": n,
                      "seconds_into_run": round(time.perf_counter() - t0, 1)}
            print(f"[ray+kill] killed worker {pid} after {n} answers of shard 0", flush=True)
        time.sleep(0.2)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"[ray+kill] exit {proc.returncode}:\n{err[-4000:]}")
    if not killed:
        raise SystemExit("[ray+kill] the run finished before shard 0 wrote enough answers to kill its worker; "
                         "lower --kill-after")
    return time.perf_counter() - t0, killed


def check(ref: dict, out: Path, order: list[str]) -> dict:
    recs = records(out)
    got = decisions(recs)
    diff = sorted(q for q in ref if got.get(q) != ref[q])
    metrics = json.loads((out / "metrics.json").read_text())
    shard_dups = {}
    for sh in sorted((out / "shards").glob("*")):
        ids = [r["qid"] for r in records(sh)]
        shard_dups[sh.name] = len(ids) - len(set(ids))
    return {"n": len(recs), "identical": len(ref) - len(diff), "differing_qids": diff,
            "question_order": [r["qid"] for r in recs] == order, "duplicates_in_merged": len(recs) - len(got),
            "duplicates_in_shards": shard_dups, "missing": sorted(set(ref) - set(got)),
            "em": metrics["em"], "f1": metrics["f1"], "wall_s": metrics["wall_s"], "ray": metrics.get("ray")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="dragin")
    ap.add_argument("--dataset", default="hotpotqa", choices=sorted(DATA))
    ap.add_argument("--data", type=Path, default=None)
    ap.add_argument("--corpus", type=Path, default=CORPUS)
    ap.add_argument("--config", type=Path, default=None)
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--kill-after", type=int, default=10, help="answers written by shard 0 before its worker dies")
    ap.add_argument("--skip-plain", action="store_true", help="leave out the undisturbed Ray run")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_ray")
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args()
    a.data = a.data or DATA[a.dataset]

    from fastrag.data.datasets import load_examples

    try:
        order = [e.qid for e in load_examples(a.dataset, a.data, limit=a.limit)]
    except (ValueError, OSError) as e:  # (DataError: a missing or unreadable data file)
        sys.exit(f"bench_ray.py: error: {e}")
    n = len(order)
    single, plain, killed_out = a.out / "single", a.out / "ray", a.out / "ray_killed"
    walls = {}
    if not complete(single, n):
        walls["single"] = run_cli(base_args(a, single), "single")
    ref = decisions(records(single))
    if len(ref) != n:
        raise SystemExit(f"single-process run has {len(ref)} of {n} questions")
    ray_args = ["--ray", "--num-workers", str(a.num_workers)]
    rows = {}
    if not a.skip_plain:
        if not complete(plain, n):
            walls["ray"] = run_cli(base_args(a, plain) + ray_args, "ray")
        rows["ray"] = check(ref, plain, order)
    kill_info = None
    info_file = killed_out / "kill.json"
    if not complete(killed_out, n):
        if killed_out.exists() and any(killed_out.iterdir()):
            raise SystemExit(f"{killed_out} holds an unfinished killed run; delete it to measure the kill again")
        walls["ray_killed"], kill_info = run_killed(base_args(a, killed_out) + ray_args, killed_out, a.kill_after)
        info_file.write_text(json.dumps(kill_info))
    elif info_file.exists():
        kill_info = json.loads(info_file.read_text())
    rows["ray_killed"] = check(ref, killed_out, order)
    rows["ray_killed"]["kill"] = kill_info
    sm = json.loads((single / "metrics.json").read_text())

    import ray
    import torch

    from fastrag.provenance import cpu_name

    device = "cpu"
    cmd = "python benchmarks/bench_ray.py " + shlex.join(sys.argv[1:])
    report = {"date": dt.date.today().isoformat(), "device": device, "machine": cpu_name(), "cpus": os.cpu_count(),
              "torch": torch.__version__, "ray": ray.__version__,
              "command": cmd, "method": a.method, "dataset": a.dataset, "n": n, "batch_size": a.batch_size,
              "num_workers": a.num_workers, "single": {"em": sm["em"], "f1": sm["f1"], "wall_s": sm["wall_s"]},
              "runs": rows}
    a.results.mkdir(parents=True, exist_ok=True)
    (a.results / f"ray_{device}.json").write_text(json.dumps(report, indent=2))
    lines = [f"# `fastrag run --ray` vs single process ({a.method}, {a.dataset}, {n} questions)", "",
             f"Date {report['date']}, {report['cpus']}-core CPU VM, torch {torch.__version__}, ray {ray.__version__},"
             f" SmolLM2-135M fp32, BM25 (bm25s) over `{a.corpus.name}`, batch size {a.batch_size} per engine.", "",
             f"Command: `{cmd}`", "",
             "Compared per question: prediction and every retrieval round's trigger sentence, query and retrieved "
             "passage ids.", "",
             "| run | questions | identical to single process | missing | in question order | duplicates (merged / "
             "per shard) | EM | F1 | shard retries | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|",
             f"| single process | {n} | (reference) | 0 | - | - | {sm['em']:.3f} | {sm['f1']:.3f} | - | "
             f"{sm['wall_s']:.0f} |"]
    names = {"ray": f"ray, {a.num_workers} workers", "ray_killed": f"ray, {a.num_workers} workers, shard 0's worker "
             "SIGKILLed"}
    for k, r in rows.items():
        dups = f"{r['duplicates_in_merged']} / " + ", ".join(str(v) for v in r["duplicates_in_shards"].values())
        lines.append(f"| {names[k]} | {r['n']} | {r['identical']}/{n} | {len(r['missing'])} | "
                     f"{'yes' if r['question_order'] else 'NO'} | {dups} | {r['em']:.3f} | {r['f1']:.3f} | "
                     f"{(r['ray'] or {}).get('shard_retries')} | {r['wall_s']:.0f} |")
    if kill_info:
        lines += ["", f"Kill: worker pid {kill_info['pid']} of shard 0 SIGKILLed "
                  f"{kill_info['seconds_into_run']} s into the run, after its shard had written "
                  f"{kill_info['answers_in_shard_when_killed']} answers; the driver resubmitted the shard, which "
                  "resumed from its own results file."]
    for k, r in rows.items():
        if r["differing_qids"]:
            lines += ["", f"{names[k]}: questions that differ: {', '.join(r['differing_qids'])}"]
    lines += ["", "Wall times: the two Ray workers share the machine's 2 cores (one thread each; the single process "
              "uses both), and the runs may overlap other jobs: Ray here shows correctness, not speed-up. A run "
              "already complete in --out is reused, not re-timed."]
    (a.results / f"ray_{device}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    bad = [k for k, r in rows.items() if r["identical"] != n or r["missing"] or not r["question_order"]
           or r["duplicates_in_merged"] or any(r["duplicates_in_shards"].values())]
    if bad:
        raise SystemExit(f"not identical: {bad}")


if __name__ == "__main__":
    main()
