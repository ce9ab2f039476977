"""Retry-After of `fastrag serve`'s 429s under bounded bursts on loopback, with clients that obey it.

The server runs in-process (uvicorn on a free 127.0.0.1 port) over a tiny random model (benchmarks/
make_random_model.py, seed 0: the same weights every run) and a retriever that returns nothing, with 2 questions in
flight and 2 waiting (`AsyncEngine(max_inflight=2, max_queue=2)`), so that a burst fills it in a second of CPU time.
Each burst sends `--clients` non-streaming wo-rag requests at once; a client that gets a 429 sleeps its Retry-After
and asks again (at most `--max-tries` times, and none after `--deadline` seconds). Between bursts the server idles
`--idle` seconds. Per burst: the Retry-After figures of the 429s, when the burst's first wave (the requests let in
at once) had all been answered ("drained"), and how long after that each rejected client was let in.

    python benchmarks/bench_retry_after.py --before /work/main     # main's code, then this tree's, same bursts

`--before TREE` runs the bursts twice, in child processes importing fastrag from TREE and then from this tree, and
writes both to benchmarks/results/retry_after_cpu.md (+ .json); without it, one run of this tree, printed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


async def _client(url: str, i: int, t0: float, args) -> dict:
    import httpx

    body = {"prompt": f"question number {i}", "max_tokens": args.max_tokens,
            "retrieval": {"method": "wo-rag", "dataset": "nq", "config": {"fewshot": 0}}}
    rec = {"i": i, "retry_after": [], "admitted_at": None, "answered_at": None, "status": None}
    async with httpx.AsyncClient(timeout=args.deadline) as c:
        while True:
            sent = time.perf_counter() - t0
            r = await c.post(url + "/v1/completions", json=body)
            rec["status"] = r.status_code
            if r.status_code != 429:
                rec["admitted_at"], rec["answered_at"] = sent, time.perf_counter() - t0
                return rec
            ra = int(r.headers["retry-after"])
            rec["retry_after"].append(ra)
            if len(rec["retry_after"]) >= args.max_tries or sent + ra > args.deadline:
                return rec  # gave up: counted as not served
            await asyncio.sleep(ra)


async def _burst(url: str, args) -> dict:
    t0 = time.perf_counter()
    recs = await asyncio.gather(*(_client(url, i, t0, args) for i in range(args.clients)))
    first = [r for r in recs if not r["retry_after"] and r["status"] == 200]
    rejected = [r for r in recs if r["retry_after"]]
    drained = max((r["answered_at"] for r in first), default=float("nan"))
    late = [r["admitted_at"] - drained for r in rejected if r["admitted_at"] is not None]
    firsts = [r["retry_after"][0] for r in rejected]
    return {
        "clients": len(recs), "let_in_at_once": len(first), "rejected": len(rejected),
        "served": sum(r["status"] == 200 for r in recs), "gave_up": sum(r["admitted_at"] is None for r in recs),
        "429s": sum(len(r["retry_after"]) for r in recs),
        "retry_after_first_min": min(firsts, default=None), "retry_after_first_median":
            statistics.median(firsts) if firsts else None, "retry_after_first_max": max(firsts, default=None),
        "drained_s": drained,
        "let_in_after_drain_median_s": statistics.median(late) if late else None,
        "let_in_after_drain_max_s": max(late, default=None),
        "burst_s": max(r["answered_at"] or 0.0 for r in recs),
    }


def measure(args) -> dict:
    """The bursts against a server of the fastrag this process imports."""
    import torch
    import uvicorn

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from make_random_model import make

    from fastrag.eval import build_engine
    from fastrag.retrieval.base import Retriever
    from fastrag.serving import AsyncEngine
    from fastrag.serving.server import create_app

    class NoDocs(Retriever):
        def search(self, queries, k):
            return [[] for _ in queries]

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = make("tiny", Path(tmp) / "tiny", dtype=torch.float32, device="cpu")
        engine = AsyncEngine(build_engine(model, 2, kv_cache_gb=0.05, device="cpu"), NoDocs(), max_inflight=2,
                             max_queue=2)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        srv = uvicorn.Server(uvicorn.Config(create_app(engine, timeout_s=args.deadline), host="127.0.0.1",
                                            port=port, log_level="warning"))
        th = threading.Thread(target=srv.run, daemon=True)
        th.start()
        while not srv.started:
            time.sleep(0.05)
        bursts = []
        try:
            for b in range(args.bursts):
                if b:
                    time.sleep(args.idle)
                bursts.append(asyncio.run(_burst(f"http://127.0.0.1:{port}", args)))
                print(f"burst {b + 1}: {json.dumps(bursts[-1])}", file=sys.stderr)
        finally:
            srv.should_exit = True
            th.join(timeout=30)
            engine.close()
    return {"bursts": bursts}


def _git(tree: str) -> str:
    try:
        return subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


COLS = ("code", "burst", "idle_before_s", "clients", "let_in_at_once", "rejected", "served", "gave_up", "429s",
        "retry_after_first_min", "retry_after_first_median", "retry_after_first_max", "drained_s",
        "let_in_after_drain_median_s", "let_in_after_drain_max_s", "burst_s")


def _cell(v) -> str:
    return "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=12, help="requests per burst (4 are let in at once)")
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--idle", type=float, default=20.0, help="seconds the server idles between bursts")
    ap.add_argument("--max-tokens", type=int, default=120, help="tokens a question generates")
    ap.add_argument("--max-tries", type=int, default=20, help="429s a client takes before it gives up")
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds into a burst after which no client retries")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    ap.add_argument("--before", help="a tree of the code to compare with (its fastrag is imported in a child)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    if args.child or not args.before:
        print(json.dumps(measure(args)))
        return
    passed = [a for a in sys.argv[1:] if a != "--before" and a != args.before]
    rows, runs = [], {}
    for label, tree in (("before", args.before), ("after", str(ROOT))):
        env = {**os.environ, "PYTHONPATH": tree}
        p = subprocess.run([sys.executable, __file__, "--child", *passed], env=env, capture_output=True, text=True,
                           timeout=args.bursts * (args.deadline + args.idle) + 300)
        if p.returncode:
            raise SystemExit(f"{label} ({tree}) failed:\n{p.stderr[-3000:]}")
        runs[label] = {"tree": tree, "commit": _git(tree), **json.loads(p.stdout.splitlines()[-1])}
        for b, rec in enumerate(runs[label]["bursts"], 1):
            rows.append({"code": f"{label} ({runs[label]['commit']})", "burst": b,
                         "idle_before_s": args.idle if b > 1 else 0.0, **rec})
    out = Path(args.results)
    setup = {k: getattr(args, k) for k in ("clients", "bursts", "idle", "max_tokens", "max_tries", "deadline",
                                           "threads")}
    (out / "retry_after_cpu.json").write_text(json.dumps({"date": dt.date.today().isoformat(), "setup": setup,
                                                          "runs": runs}, indent=1) + "\n")
    flags = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in setup.items())
    lines = ["# Retry-After of `fastrag serve` under bounded bursts (loopback)", "",
             f"- date: {dt.date.today().isoformat()}; CPU, {os.cpu_count()} cores; tiny random model (seed 0), "
             "no retrieval, wo-rag; server: 2 in flight + 2 waiting",
             f"- command: `python benchmarks/bench_retry_after.py --before {args.before}` "
             f"({flags})",
             "- clients obey Retry-After; `let_in_after_drain`: seconds between the burst's first wave being answered "
             "and a rejected client being let in (negative: before it had all been answered)", "",
             "| " + " | ".join(COLS) + " |", "|" + "---|" * len(COLS)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in COLS) + " |" for r in rows]
    (out / "retry_after_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
