"""Dense retrieval at scale: the faiss index types of fastrag.retrieval.ann (flat, ivf, hnsw, ivfpq) on a generated
corpus of `--n` passage embeddings: build seconds, index bytes, queries per second and recall@k against the exact
flat index, the baseline measured in the same run (ratios to it in the table).

The embeddings are synthetic: encoding a million passages with the encoder is out of reach on a 2-core CPU, and the
index work does not depend on where the vectors came from, only on their dimension and how they cluster. They are a
Gaussian mixture, so that approximate search has structure to exploit and still something to miss: `--clusters`
unit-norm centres drawn at random in `--dim` dimensions, each passage a centre plus isotropic noise of norm about
`--spread`, L2-normalised (the retriever's cosine similarity is the inner product of such vectors). The queries are
`--queries` passages drawn at random plus noise of norm about `--query-noise`, normalised: a query near a passage
and its cluster, as a question near its supporting passage.

Each index is built by `fastrag.retrieval.ann.build_index` (the code the retriever runs, with its default options
unless given). Queries per second: one search call of the whole query batch for the top `--k`, `--reps` timed calls
after one untimed, the median. Recall@k: |index top-k & exact top-k| / k, averaged over the queries, the exact top-k
from the flat index. Index bytes: the size faiss writes the index to disk as (its vectors, codes, lists, graph).
Writes benchmarks/results/ann_cpu.md (+ .json) after each index type, so a run stopped part-way keeps what it
measured. `--sweep ef_search=16,64,256` (or `nprobe=...`) measures several search settings on one build of each
index type that takes the option: a row per value, the build's seconds and bytes repeated on each.

    nice -n 10 python benchmarks/bench_ann.py                       # 1,000,000 passages, every index type
    python benchmarks/bench_ann.py --n 20000 --types flat hnsw --results /tmp/r
    python benchmarks/bench_ann.py --types hnsw ivf --sweep ef_search=32,64,128,256,512 nprobe=4,16,64 --append
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_args import positive_int  # noqa: E402  (the script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastrag.retrieval.ann import INDEX_TYPES, AnnOptions, build_index, resolved, set_search_params  # noqa: E402


def normalised(x: np.ndarray) -> np.ndarray:
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def corpus(n: int, dim: int, clusters: int, spread: float, seed: int, chunk: int = 100_000) -> np.ndarray:
    """[n, dim] float32 unit vectors of the Gaussian mixture (module docstring), generated a chunk at a time."""
    rng = np.random.default_rng(seed)
    centres = normalised(rng.standard_normal((clusters, dim), dtype=np.float32))
    out = np.empty((n, dim), dtype=np.float32)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        noise = rng.standard_normal((hi - lo, dim), dtype=np.float32) * np.float32(spread / np.sqrt(dim))
        out[lo:hi] = normalised(centres[rng.integers(clusters, size=hi - lo)] + noise)
    return out


def queries(emb: np.ndarray, count: int, noise: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed + 1)
    base = emb[rng.choice(len(emb), count, replace=False)]
    return normalised(base + rng.standard_normal(base.shape, dtype=np.float32) * np.float32(noise / np.sqrt(emb.shape[1])))


def disk_bytes(index) -> int:
    import faiss

    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "index.faiss")
        faiss.write_index(index, p)
        return os.path.getsize(p)


def time_search(index, q: np.ndarray, k: int, reps: int) -> tuple[float, np.ndarray]:
    """(median seconds of one search of the whole batch, the ids it returned)."""
    _, ids = index.search(q, k)  # (untimed: first-touch of the index's pages)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        index.search(q, k)
        times.append(time.perf_counter() - t)
    return statistics.median(times), ids


def recall(got: np.ndarray, want: np.ndarray) -> float:
    k = want.shape[1]
    return float(np.mean([len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(got, want)]))


def options(kind: str, args, **override) -> AnnOptions:
    given = {"nlist": args.nlist, "nprobe": args.nprobe, "M": args.M, "ef_construction": args.ef_construction,
             "ef_search": args.ef_search, "m": args.m, "nbits": args.nbits, **override}
    takes = {"flat": (), "ivf": ("nlist", "nprobe"), "hnsw": ("M", "ef_construction", "ef_search"),
             "ivfpq": ("nlist", "nprobe", "m", "nbits")}[kind]
    return AnnOptions.of(kind, **{k: v for k, v in given.items() if k in takes and v is not None})


SEARCH_OPTIONS = {"flat": (), "ivf": ("nprobe",), "hnsw": ("ef_search",), "ivfpq": ("nprobe",)}


def search_variants(kind: str, args) -> list[AnnOptions]:
    """The options each search of one built index runs with: one per value of a `--sweep` of this kind's search
    option (nprobe, ef_search), else the index's own options alone. Search options change what a search visits, not
    the index, so a sweep costs one build."""
    sweep = getattr(args, "sweep", None) or {}
    for name in SEARCH_OPTIONS[kind]:
        if name in sweep:
            return [options(kind, args, **{name: v}) for v in sweep[name]]
    return [options(kind, args)]


def parse_sweep(text: str) -> tuple[str, list[int]]:
    """`NAME=V1,V2,...` (NAME a search option) -> (NAME, [values]); a ValueError that names what is wrong."""
    name, sep, values = text.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or name not in ("nprobe", "ef_search"):
        raise ValueError(f"--sweep {text!r}: expected nprobe=V1,V2,... or ef_search=V1,V2,...")
    try:
        vals = [int(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--sweep {text!r}: the values must be integers") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"--sweep {text!r}: give one or more values, each >= 1")
    return name, vals


_WRITTEN: list = []  # the (size, index types) of this process's last write


def write(results: Path, report: dict, append: bool = False) -> None:
    """ann_cpu.json ({"runs": [...]}) and ann_cpu.md (a table a run); with `append`, the runs already there of
    another size or other index types are kept (each table has its own baseline, measured in its own run)."""
    results.mkdir(parents=True, exist_ok=True)
    runs = []
    if append and (results / "ann_cpu.json").is_file():
        old = json.loads((results / "ann_cpu.json").read_text())
        kinds = lambda r: (r["n"], sorted(x["index"] for x in r["rows"]))  # noqa: E731
        mine = (kinds(report), _WRITTEN[0] if _WRITTEN else None)  # (this run's last write held fewer rows)
        runs = [r for r in old.get("runs", [old] if "rows" in old else []) if kinds(r) not in mine]
        _WRITTEN[:] = [kinds(report)]
    runs = sorted(runs + [report], key=lambda r: -r["n"])  # (stable: runs of one size in the order they ran)
    (results / "ann_cpu.json").write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    (results / "ann_cpu.md").write_text("\n\n".join(table(r) for r in runs))


def table(report: dict) -> str:
    rows = report["rows"]
    base = next((r for r in rows if r["index"] == "flat"), None)
    lines = [f"# Dense index types at {report['n']:,} passages (CPU)", "",
             f"Device: {report['device']}. faiss {report['faiss']}, numpy {report['numpy']}, "
             f"{report['threads']} faiss threads.", "",
             f"Synthetic embeddings (benchmarks/bench_ann.py's docstring): {report['n']:,} x {report['dim']} float32, "
             f"{report['clusters']} Gaussian clusters, spread {report['spread']}, unit norm; {report['queries']} "
             f"queries near random passages (noise {report['query_noise']}); top {report['k']}. Queries/s: one "
             f"search call of the {report['queries']} queries, median of {report['reps']} after one untimed. "
             "Recall: against the exact flat index of the same run.", "",
             f"Command: `{report['command']}`", "",
             "| index | options | build s | index MiB | bytes/vector | queries/s | x flat q/s | recall@"
             f"{report['k']} |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['queries_per_s'] / base['queries_per_s']:.2f}x" if base else "-"
        opts = ", ".join(f"{k}={v}" for k, v in r["options"].items() if k != "index") or "exact"
        lines.append(f"| {r['index']} | {opts} | {r['build_s']:.1f} | {r['index_bytes'] / 2**20:.1f} | "
                     f"{r['index_bytes'] / report['n']:.0f} | {r['queries_per_s']:.0f} | {ratio} | "
                     f"{r['recall_at_k']:.4f} |")
    if report.get("note"):
        lines += ["", report["note"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=positive_int, default=1_000_000, help="passages (default 1,000,000)")
    ap.add_argument("--dim", type=positive_int, default=384, help="embedding dimension (all-MiniLM-L6-v2's: 384)")
    ap.add_argument("--clusters", type=positive_int, default=2000)
    ap.add_argument("--spread", type=float, default=1.0, help="noise norm around a cluster centre (centres: 1)")
    ap.add_argument("--queries", type=positive_int, default=1000)
    ap.add_argument("--query-noise", type=float, default=0.5)
    ap.add_argument("--k", type=positive_int, default=10)
    ap.add_argument("--reps", type=positive_int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--types", nargs="+", default=list(INDEX_TYPES), choices=INDEX_TYPES)
    for name in ("nlist", "nprobe", "M", "ef-construction", "ef-search", "m", "nbits"):
        ap.add_argument(f"--{name}", type=positive_int, default=None, help="index option (default: the retriever's)")
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--append", action="store_true", help="keep the runs of other sizes or index types already in "
                    "the results")
    ap.add_argument("--note", default="", help="a line under the table (e.g. what could not be measured)")
    ap.add_argument("--sweep", nargs="+", default=[], metavar="NAME=V1,V2",
                    help="search options to measure on one build of each index type that takes them, e.g. "
                    "ef_search=16,64,256 nprobe=4,16,64 (a row per value)")
    args = ap.parse_args()
    try:
        args.sweep = dict(parse_sweep(x) for x in args.sweep)
    except ValueError as e:
        ap.error(str(e))
    import faiss

    t = time.perf_counter()
    emb = corpus(args.n, args.dim, args.clusters, args.spread, args.seed)
    q = queries(emb, min(args.queries, args.n), args.query_noise, args.seed)
    print(f"generated {args.n} x {args.dim} in {time.perf_counter() - t:.1f}s", flush=True)
    report = {"n": args.n, "dim": args.dim, "clusters": args.clusters, "spread": args.spread, "queries": len(q),
              "query_noise": args.query_noise, "k": args.k, "reps": args.reps, "seed": args.seed,
              "device": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "faiss": faiss.__version__, "numpy": np.__version__, "threads": faiss.omp_get_max_threads(),
              "command": "python benchmarks/bench_ann.py " + shlex.join(sys.argv[1:]), "note": args.note, "rows": []}
    try:
        report["device"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                                 if line.startswith("model name")) + f", {os.cpu_count()} CPUs"
    except (OSError, StopIteration):
        pass
    kinds = ["flat"] + [k for k in args.types if k != "flat"]  # (flat always, first: the truth and the baseline)
    want = None
    for kind in kinds:
        opts = options(kind, args)
        t = time.perf_counter()
        index = build_index(emb, opts, progress=False)
        build_s = time.perf_counter() - t
        size = disk_bytes(index)
        for sopts in search_variants(kind, args):
            set_search_params(index, sopts)
            secs, ids = time_search(index, q, args.k, args.reps)
            if want is None:
                want = ids
            row = {"index": kind, "options": {**resolved(sopts, *emb.shape), **sopts.search_params()},
                   "build_s": build_s, "index_bytes": size, "search_s": secs, "queries_per_s": len(q) / secs,
                   "recall_at_k": recall(ids, want)}
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
            write(args.results, report, args.append)
        del index


if __name__ == "__main__":
    main()
