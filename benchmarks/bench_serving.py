"""Load test of `fastrag serve` on loopback: N concurrent streaming clients, bounded in count and time.

Starts `python -m fastrag serve` as a subprocess (SmolLM2, BM25 over the bundled corpus), fires `--clients`
concurrent streaming `/v1/completions` requests (DRAGIN, HotpotQA prompts, `--max-tokens` per round) and checks
that every request gets exactly one complete, well-formed stream (chunks, one final chunk with the answer, then
[DONE]) or a 429 with Retry-After; that no request is lost or answered twice (the server's own counters agree);
and samples the server's resident memory. Reports p50/p99 latency (request to last byte) and time to first token
(the first decoded token's progress chunk, `fastrag.event == "token"`: the answer text itself comes in the last
chunk), throughput, and the memory peak in benchmarks/results/serving.md (+ .json).

    python benchmarks/bench_serving.py --clients 64
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from fastrag.provenance import cpu_name

ROOT = Path(__file__).resolve().parents[1]


def rss_mb(pid: int) -> float:
    try:
        txt = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return float("nan")
    m = re.search(r"VmRSS:\s+(\d+) kB", txt)
    return int(m.group(1)) / 1024 if m else float("nan")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


async def client(url: str, i: int, question: str, max_tokens: int, timeout: float) -> dict:
    body = {"prompt": question, "stream": True, "max_tokens": max_tokens,
            "retrieval": {"method": "dragin", "dataset": "hotpotqa"}}
    t0 = time.perf_counter()
    rec = {"i": i, "status": None, "ok": False, "ttft": None, "latency": None, "tokens": 0, "problem": None}
    try:
        async with httpx.AsyncClient(timeout=timeout) as c:
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                rec["status"] = r.status_code
                if r.status_code == 429:
                    rec["retry_after"] = r.headers.get("retry-after")
                    rec["ok"] = rec["retry_after"] is not None
                    await r.aread()
                    return rec
                finals, done, ids = 0, False, set()
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[6:]
                    if payload == "[DONE]":
                        done = True
                        continue
                    if done:
                        rec["problem"] = "data after [DONE]"
                    ev = json.loads(payload)
                    ids.add(ev.get("id"))
                    if ev.get("object") == "error":
                        rec["problem"] = ev["error"]["message"]
                    elif ev.get("object") == "text_completion":
                        if ev["choices"][0]["finish_reason"] is not None:
                            finals += 1
                            rec["answer"] = ev["choices"][0]["text"]
                        elif (ev.get("fastrag") or {}).get("event") == "token":  # progress: a decoded token
                            rec["tokens"] += 1
                            if rec["ttft"] is None:
                                rec["ttft"] = time.perf_counter() - t0
                rec["latency"] = time.perf_counter() - t0
                if rec["problem"] is None:
                    if not done:
                        rec["problem"] = "stream ended without [DONE]"
                    elif finals != 1:
                        rec["problem"] = f"{finals} final chunks"
                    elif len(ids) != 1:
                        rec["problem"] = f"{len(ids)} response ids in one stream"
                rec["ok"] = r.status_code == 200 and rec["problem"] is None
    except Exception as e:  # a lost request is a failure of the test, recorded
        rec["problem"] = f"{type(e).__name__}: {e}"
    return rec


async def load(url, questions, args, pid):
    mem, stop = [], asyncio.Event()

    async def sample():
        while not stop.is_set():
            mem.append(rss_mb(pid))
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample())
    t0 = time.perf_counter()
    recs = await asyncio.gather(*(client(url, i, questions[i % len(questions)], args.max_tokens, args.timeout)
                                  for i in range(args.clients)))
    wall = time.perf_counter() - t0
    stop.set()
    await sampler
    return recs, wall, mem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16, help="server decode batch (2x in flight)")
    ap.add_argument("--max-queue", type=int, default=16, help="server admission queue beyond those in flight")
    ap.add_argument("--max-tokens", type=int, default=32, help="generation length per DRAGIN round")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()

    from fastrag.data.datasets import load_examples
    from fastrag.eval import BUNDLED

    questions = [e.question for e in load_examples("hotpotqa", BUNDLED / "hotpotqa_dev20.jsonl")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    srv = subprocess.Popen([sys.executable, "-m", "fastrag", "serve", "--port", str(port), "--batch-size",
                            str(args.batch_size), "--max-queue", str(args.max_queue), "--kv-cache-gb", "2",
                            "--timeout", str(args.timeout)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
            if srv.poll() is not None:
                raise SystemExit("server exited: " + srv.stderr.read().decode()[-2000:])
        idle_mb = rss_mb(srv.pid)
        recs, wall, mem = asyncio.run(load(url, questions, args, srv.pid))
        metrics = httpx.get(url + "/metrics", timeout=30).text
    finally:
        srv.terminate()
        srv.wait(timeout=60)

    def counter(name):
        m = re.search(rf"^{name}_total (\S+)$", metrics, re.M)
        return float(m.group(1)) if m else float("nan")

    served = [r for r in recs if r["status"] == 200]
    rejected = [r for r in recs if r["status"] == 429]
    bad = [r for r in recs if not r["ok"]]
    lat = [r["latency"] for r in served if r["ok"]]
    ttft = [r["ttft"] for r in served if r["ok"] and r["ttft"] is not None]
    row = {
        "clients": args.clients, "served_200": len(served), "rejected_429": len(rejected), "failed": len(bad),
        "server_finished": counter("fastrag_finished"), "server_rejected": counter("fastrag_rejected"),
        "server_cancelled": counter("fastrag_cancelled"),
        "p50_latency_s": statistics.median(lat) if lat else None, "p99_latency_s": pct(lat, 0.99),
        "p50_ttft_s": statistics.median(ttft) if ttft else None, "p99_ttft_s": pct(ttft, 0.99),
        "wall_s": wall, "answers_per_s": len(lat) / wall, "streamed_tokens_per_s": sum(r["tokens"] for r in served) / wall,
        "rss_idle_mb": idle_mb, "rss_peak_mb": max(mem) if mem else None,
    }
    ok = (not bad and len(served) + len(rejected) == args.clients and row["server_finished"] == len(served)
          and row["server_rejected"] == len(rejected))
    row["verdict"] = "PASS" if ok else "FAIL"
    cuda = torch.cuda.is_available()  # (the server it starts computes where fastrag's default puts it)
    device = torch.cuda.get_device_name(0) if cuda else f"CPU {cpu_name()} x{os.cpu_count()} cores"
    head = (f"# fastrag serve under load (loopback)\n\n- date: {dt.date.today().isoformat()}\n"
            f"- device: {device}; SmolLM2-135M {'bf16' if cuda else 'fp32'}, BM25 over the bundled "
            f"corpus; DRAGIN, HotpotQA prompts, {args.max_tokens} tokens per round\n"
            f"- server: batch {args.batch_size} ({2 * args.batch_size} in flight), admission queue {args.max_queue}\n"
            f"- command: `python benchmarks/bench_serving.py {shlex.join(sys.argv[1:])}`\n"
            f"- checks: every request gets one complete stream (one final chunk, [DONE], one id) or a 429 with "
            f"Retry-After; the server's finished/rejected counters equal the clients' counts\n\n")
    table = "| " + " | ".join(row) + " |\n|" + "---|" * len(row) + "\n| " + " | ".join(
        f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()) + " |\n"
    if bad:
        table += "\nProblems:\n" + "".join(f"- request {r['i']}: status {r['status']}: {r['problem']}\n" for r in bad)
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving.md").write_text(head + table)
    (out / "serving.json").write_text(json.dumps({"summary": row, "requests": recs}, indent=1))
    print(head + table)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
