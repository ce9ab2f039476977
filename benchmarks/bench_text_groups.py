"""Text groups over the spaCy workers: how long a group takes to come back, split by count or by cost.

With text workers, the scheduler sends each engine step's spaCy texts (sentence splits, real words) to the workers
as one group (fastrag.text.pool `TextPool.submit_texts`), and the group's questions go on only once its last share
is back. On the H200 of 2026-11-27 (second session) a 1,000-question DRAGIN run waited 18.1 s of its 98.65 s for
them. This measures the two ways of splitting a group, on a stream of groups like a run's:
- `count`: equal numbers of texts, in contiguous shares, to the workers with the least pending work first (the split
  before the cost one);
- `cost` (the pool's split): by estimated cost (`text_cost`: characters plus a fixed part), longest text first, each
  to the worker whose pending work plus share is the least (`balanced_shares`), so that the shares end together.

First the cost model itself: ms a text by kind and length, in this process, 40 texts a pass (one nlp.pipe pass a
kind, as a worker runs a share).

The stream: one group per step, a step every --interval-ms (the main thread sleeps to the next step, as it would
wait on the device); group sizes and text lengths drawn from a fixed seed: most groups of 1-4 texts, some of 5-30,
a few of 60-200, half the texts 30-150 characters and half 300-900, kinds mixed. Both splits run the same stream
on the same warm workers, alternating, --reps times each; every run's values are checked equal to the first's.

    python benchmarks/bench_text_groups.py --workers 2     # writes benchmarks/results/text_groups_cpu.md (.json)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from fastrag.provenance import cpu_name  # noqa: E402
from bench_args import positive_int  # noqa: E402  (the script's folder is on sys.path)


def _passages() -> list[str]:
    from fastrag.eval import BUNDLED

    return [json.loads(x)["text"] for x in (BUNDLED / "wiki_passages.jsonl").read_text().splitlines() if x.strip()]


def _text(rng: random.Random, passages: list[str], lo: int, hi: int) -> str:
    p = rng.choice([x for x in rng.sample(passages, 20) if len(x) >= hi] or passages)
    n = rng.randint(lo, hi)
    a = rng.randint(0, max(0, len(p) - n))
    return p[a: a + n]


def cost_model(passages: list[str], reps: int) -> list[dict]:
    """ms a text, by kind and length: one compute_texts pass over 40 texts of that length, best of reps."""
    from fastrag.text.pool import compute_texts

    rng = random.Random(0)
    compute_texts([("sentences", "Warm up. Now."), ("real_words", "warm up now")])
    rows = []
    for kind in ("sentences", "real_words"):
        for n in (30, 100, 300, 900):
            texts = [_text(rng, passages, n, n) for _ in range(40)]
            ts = []
            for _ in range(reps):
                t = time.perf_counter()
                compute_texts([(kind, x) for x in texts])
                ts.append(time.perf_counter() - t)
            rows.append({"kind": kind, "chars": n, "ms_per_text": min(ts) / len(texts) * 1e3})
    return rows


def stream(passages: list[str], steps: int, seed: int) -> list[list[tuple[str, str]]]:
    rng = random.Random(seed)
    groups = []
    for _ in range(steps):
        u = rng.random()
        size = rng.randint(1, 4) if u < 0.7 else rng.randint(5, 30) if u < 0.96 else rng.randint(60, 200)
        groups.append([(rng.choice(("sentences", "real_words")),
                        _text(rng, passages, *((30, 150) if rng.random() < 0.5 else (300, 900))))
                       for _ in range(size)])
    return groups


def _count_split(costs: list[int], backlogs: list[int]) -> list[list[int]]:
    """The split before the cost one: contiguous shares of equal counts, the least-loaded workers first."""
    n, order = len(costs), sorted(range(len(backlogs)), key=lambda i: (backlogs[i], i))
    k = min(len(backlogs), n)
    bounds = [n * j // k for j in range(k + 1)]
    shares: list[list[int]] = [[] for _ in backlogs]
    for w, a, b in zip(order, bounds, bounds[1:]):
        shares[w] = list(range(a, b))
    return shares


def run_stream(pool, groups, interval: float) -> dict:
    lat, futs = [], []
    t0 = time.perf_counter()
    for i, g in enumerate(groups):
        wake = t0 + i * interval
        while (now := time.perf_counter()) < wake:
            time.sleep(min(0.002, wake - now))
        sent = time.perf_counter()
        f = pool.submit_texts(g)
        f.add_done_callback(lambda _f, s=sent: lat.append(time.perf_counter() - s))
        futs.append(f)
    values = [f.result(timeout=600) for f in futs]
    wall = time.perf_counter() - t0
    while len(lat) < len(groups):  # (the callbacks run on the readers' threads, just after the results)
        time.sleep(0.001)
    lat.sort()
    return {"values": values, "wall_s": wall, "median_ms": statistics.median(lat) * 1e3,
            "p90_ms": lat[int(0.9 * (len(lat) - 1))] * 1e3, "max_ms": lat[-1] * 1e3, "sum_s": sum(lat)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=positive_int, default=2)
    ap.add_argument("--steps", type=positive_int, default=300)
    ap.add_argument("--interval-ms", type=float, default=40.0, help="one group sent every this many ms")
    ap.add_argument("--reps", type=positive_int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default="", help="what else ran on the machine")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"), help="folder of the result tables")
    args = ap.parse_args()
    import fastrag.text.pool as tp

    passages = _passages()
    model = cost_model(passages, args.reps)
    groups = stream(passages, args.steps, args.seed)
    n_texts = sum(len(g) for g in groups)
    pool = tp.TextPool(args.workers)
    real = tp.balanced_shares
    runs: dict[str, list[dict]] = {"count": [], "cost": []}
    try:
        t = time.perf_counter()
        while pool.ready < args.workers:
            if time.perf_counter() - t > 300:
                raise RuntimeError("the text workers did not load their pipelines in 300 s")
            for f in [pool.submit("sentences", "Warm up. Now.") for _ in range(args.workers)]:
                f.result(timeout=300)
        want = None
        for _ in range(args.reps):
            for name, split in (("count", _count_split), ("cost", real)):
                tp.balanced_shares = split
                try:
                    r = run_stream(pool, groups, args.interval_ms / 1e3)
                finally:
                    tp.balanced_shares = real
                values = r.pop("values")
                if want is None:
                    want = values
                elif values != want:
                    raise RuntimeError(f"the {name} split's values differ from the first run's")
                runs[name].append(r)
    finally:
        pool.shutdown()

    def med(name, key):
        return statistics.median(r[key] for r in runs[name])

    summary = {name: {k: med(name, k) for k in ("median_ms", "p90_ms", "max_ms", "sum_s", "wall_s")}
               for name in runs}
    cmd = "python benchmarks/bench_text_groups.py " + shlex.join(sys.argv[1:])
    device = f"CPU {cpu_name()}"
    lines = [
        f"# Text groups over the spaCy workers: split by count or by cost ({device})", "",
        f"- date: {dt.date.today()}; command: `{cmd.strip()}`",
        f"- other load: {args.note or 'none stated'}",
        f"- stream: {args.steps} groups, one every {args.interval_ms:g} ms, {n_texts} texts "
        f"(largest group {max(len(g) for g in groups)}), {args.workers} workers; medians of {args.reps} runs a split, "
        "alternating; every run's values equal", "",
        "## spaCy ms a text, by kind and length (this process, 40 texts a pass, best of the reps)", "",
        "| kind | characters | ms a text |", "|---|---|---|",
        *(f"| {r['kind']} | {r['chars']} | {r['ms_per_text']:.2f} |" for r in model), "",
        "## A group's time from sent to back whole", "",
        "| split | median ms | p90 ms | max ms | sum over groups s | stream wall s |", "|---|---|---|---|---|---|",
        *(f"| {name} | {s['median_ms']:.1f} | {s['p90_ms']:.1f} | {s['max_ms']:.1f} | {s['sum_s']:.2f} | "
          f"{s['wall_s']:.2f} |" for name, s in summary.items()), "",
        f"cost against count: median x{summary['count']['median_ms'] / summary['cost']['median_ms']:.2f}, "
        f"p90 x{summary['count']['p90_ms'] / summary['cost']['p90_ms']:.2f}, "
        f"sum over groups x{summary['count']['sum_s'] / summary['cost']['sum_s']:.2f} (above 1: the cost split is "
        "faster)", "",
    ]
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    out = results / "text_groups_cpu.md"
    out.write_text("\n".join(lines))
    out.with_suffix(".json").write_text(json.dumps({"date": str(dt.date.today()), "command": cmd.strip(),
                                                    "device": device, "cost_model": model, "runs": runs,
                                                    "summary": summary, "texts": n_texts}, indent=1))
    print("\n".join(lines))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
