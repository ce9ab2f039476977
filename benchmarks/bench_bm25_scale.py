"""BM25 at corpus scale: index build time and memory, index size, load time and search latency against the number
of passages, and what a linear fit of them says about DPR's 21,015,324-passage Wikipedia (`psgs_w100.tsv`).

The corpora are generated, DPR-shaped: 100 words a passage (`--words`), each drawn from the word frequencies of the
bundled 13.5k-passage Wikipedia sample, except that a share of them (`--rare`) are rare words from a vocabulary that
grows with the corpus (a quarter as many words as passages), as a real corpus's vocabulary does; titles are the
bundled passages' titles. The queries are real: the bundled HotpotQA questions, then the first 15 words of bundled
passages up to `--queries` (DRAGIN's queries are spans of text). Each size builds its index in a fresh process (its
peak resident memory is the build's alone: `ru_maxrss`) and then searches it in another: load seconds, resident
memory after the load, and per query (one query a call, `--reps` passes over the queries, the median) the
milliseconds of the retriever's search (fastrag._C's postings-driven one when the extension is built) and of the
numpy path beside it on the same queries (dense per-field score vectors, then a pass over every passage), whose
answers must agree. Beside each build, the same build in another fresh process with $FASTRAG_BM25_NATIVE=0 (the
passages' tokens found by Python's regex engine instead of fastrag._C's scan; `--no-python-scan` skips it), and
bm25s's own in-memory build, the baseline (`--no-baseline` skips it). Writes benchmarks/results/bm25_scale_cpu.md
(+ .json).

    python benchmarks/bench_bm25_scale.py                          # 100k, 300k and 1M passages
    python benchmarks/bench_bm25_scale.py --sizes 50000 200000 --results /tmp/r
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_args import positive_int  # noqa: E402  (the script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "fastrag" / "data" / "bundled"
DPR_PASSAGES = 21_015_324  # psgs_w100.tsv, the corpus of DPR's and DRAGIN's Wikipedia runs
K = 3  # DRAGIN's retrieve_topk


def _bundled() -> tuple[list[str], list[str], list[str]]:
    """(texts, titles, questions) of the bundled sample corpus and HotpotQA questions."""
    texts, titles = [], []
    with open(BUNDLED / "wiki_passages.jsonl", encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            texts.append(rec["text"])
            titles.append(rec["title"])
    with open(BUNDLED / "hotpotqa_dev20.jsonl", encoding="utf-8") as f:
        questions = [json.loads(line)["question_text"] for line in f if line.strip()]
    return texts, titles, questions


def make_corpus(path: Path, n: int, words: int, rare: float, seed: int = 0) -> None:
    """Write a DPR-format tsv of `n` generated passages (module docstring)."""
    texts, titles, _ = _bundled()
    counts = collections.Counter(w for t in texts for w in t.split())
    vocab = np.array(list(counts), dtype=object)
    p = np.array([counts[w] for w in vocab], dtype=np.float64)
    p /= p.sum()
    rng = np.random.default_rng(seed)
    n_rare = max(1, n // 4)
    syllables = ["ka", "lo", "mi", "ren", "tus", "va", "dor", "ein", "shi", "qu", "bel", "xo", "nar", "pim", "eth"]
    with open(path, "w", encoding="utf-8") as out:
        out.write("id\ttext\ttitle\n")
        for start in range(0, n, 20_000):
            m = min(20_000, n - start)
            idx = rng.choice(len(vocab), size=(m, words), p=p)
            is_rare = rng.random((m, words)) < rare
            rare_ids = rng.integers(0, n_rare, size=(m, words))
            title_ids = rng.integers(0, len(titles), size=m)
            rows = []
            for i in range(m):
                row = vocab[idx[i]]
                for j in np.flatnonzero(is_rare[i]):
                    r = int(rare_ids[i, j])
                    row[j] = "".join(syllables[(r // 15 ** d) % 15] for d in range(5))  # (15^5 > any n / 4)
                rows.append(f"{start + i + 1}\t{' '.join(row)}\t{titles[title_ids[i]]}\n")
            out.writelines(rows)


def queries(n: int) -> list[str]:
    texts, _, questions = _bundled()
    rng = np.random.default_rng(1)
    spans = [" ".join(texts[i].split()[:15]) for i in rng.permutation(len(texts))[: max(0, n - len(questions))]]
    return (questions + spans)[:n]


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # (KiB on Linux)


def _rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


class AnonPeak:
    """The largest RssAnon of this process (allocated memory: resident pages less file maps and shared memory),
    sampled every 20 ms by a thread while the block runs; ru_maxrss also counts the pages of mapped files, which
    the kernel can write back and drop."""

    def __enter__(self):
        import threading

        self.peak_kib, self._stop = 0, threading.Event()

        def sample():
            while not self._stop.wait(0.02):
                self.peak_kib = max(self.peak_kib, _status_kib("RssAnon:"))

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_):
        self._stop.set()
        self._thread.join()
        self.peak_kib = max(self.peak_kib, _status_kib("RssAnon:"))

    @property
    def gib(self) -> float:
        return self.peak_kib / 2**20


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    return 0


def child_build(corpus: Path, index: Path) -> dict:
    from fastrag.retrieval import BM25Retriever, bm25_build

    t = time.perf_counter()
    with AnonPeak() as anon:
        r = BM25Retriever(corpus, index_dir=index, show_progress=False)
    build_s = time.perf_counter() - t
    assert r.built and r.n_docs > 0
    size = sum(f.stat().st_size for f in index.rglob("*") if f.is_file())
    workers = bm25_build.pool_size(-(-r.n_docs // bm25_build.CHUNK), r.index_workers or bm25_build._auto_workers())
    native = r._native_setting is not False and bm25_build.native_tokens() is not None
    return {"build_s": build_s, "build_peak_rss_gib": _peak_rss_gib(), "build_peak_anon_gib": anon.gib,
            "index_mib": size / 2**20, "native_scan": native,
            "n_docs": r.n_docs, "build_workers": workers,
            "worker_peak_rss_gib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20}


def child_build_bm25s(corpus: Path, index: Path) -> dict:
    """The build fastrag had before its chunked one, the baseline: every passage's title and text in lists, then
    bm25s's in-memory tokenize, index and save per field."""
    import bm25s

    from fastrag.retrieval import bm25_build
    from fastrag.retrieval.corpus import iter_corpus

    t = time.perf_counter()
    with AnonPeak() as anon:
        titles, texts = [], []
        for _, title, text in iter_corpus(corpus):
            titles.append(title)
            texts.append(text)
        for name, field in (("title", titles), ("text", texts)):
            model = bm25s.BM25(k1=1.2, b=0.75, method="lucene")
            model.index(bm25_build.analyse(field, show_progress=False), show_progress=False)
            model.save(index / name, show_progress=False)
            del model
    return {"bm25s_build_s": time.perf_counter() - t, "bm25s_build_peak_rss_gib": _peak_rss_gib(),
            "bm25s_build_peak_anon_gib": anon.gib}


def child_search(corpus: Path, index: Path, n_queries: int, reps: int) -> dict:
    import torch  # noqa: F401  (loaded ahead, as in a run: the load time is the index's)

    from fastrag.retrieval import BM25Retriever

    t = time.perf_counter()
    r = BM25Retriever(corpus, index_dir=index, show_progress=False)
    load_s = time.perf_counter() - t
    assert not r.built
    rss = _rss_gib()
    qs = queries(n_queries)
    toks = r.analyze(qs)
    native, dense, scores = [], [], []
    hits = 0
    for rep in range(reps + 1):  # (the first pass warms the maps' pages and is not timed)
        for q, tk in zip(qs, toks):
            t0 = time.perf_counter()
            got = r._search_native([tk], K)[0] if r._native is not None else r._search_one(tk, K)
            t1 = time.perf_counter()
            want = r._search_one(tk, K)
            t2 = time.perf_counter()
            r.field_scores(tk)
            t3 = time.perf_counter()
            if got != want:
                raise AssertionError(f"the two searches disagree on {q!r}: {got} against {want}")
            if rep:
                native.append(t1 - t0)
                dense.append(t2 - t1)
                scores.append(t3 - t2)
            else:
                hits += len(got)
    batch_t = time.perf_counter()
    r.search(qs, K)
    batch_s = time.perf_counter() - batch_t
    analyse_t = time.perf_counter()
    r.analyze(qs)
    analyse_s = time.perf_counter() - analyse_t

    def ms(xs):
        return 1e3 * statistics.median(xs)

    return {"load_s": load_s, "rss_after_load_gib": rss, "native": r._native is not None, "search_ms": ms(native),
            "search_p90_ms": 1e3 * float(np.percentile(native, 90)), "numpy_ms": ms(dense),
            "numpy_p90_ms": 1e3 * float(np.percentile(dense, 90)), "field_scores_ms": ms(scores),
            "batch_ms_per_query": 1e3 * batch_s / len(qs), "analyse_ms_per_query": 1e3 * analyse_s / len(qs),
            "terms_per_query": statistics.mean(len(t) for t in toks), "docs_returned": hits / len(qs)}


def _child(kind: str, *args: str, env: dict | None = None) -> dict:
    p = subprocess.run([sys.executable, __file__, "--child", kind, *args], capture_output=True, text=True,
                       env=None if env is None else {**os.environ, **env})
    if p.returncode != 0:
        sys.exit(f"bench_bm25_scale.py: the {kind} process failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def fit(xs: list[float], ys: list[float], at: float) -> float:
    """The least-squares line through (xs, ys) at `at` (a single point: the line through the origin)."""
    if len(xs) < 2:
        return ys[0] * at / xs[0]
    b, a = np.polyfit(xs, ys, 1)
    return float(a + b * at)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=positive_int, nargs="+", default=[100_000, 300_000, 1_000_000],
                    help="passages in each generated corpus")
    ap.add_argument("--words", type=positive_int, default=100, help="words a passage (DPR's: 100)")
    ap.add_argument("--rare", type=float, default=0.08, help="share of a passage's words drawn from the rare words")
    ap.add_argument("--queries", type=positive_int, default=64)
    ap.add_argument("--reps", type=positive_int, default=3)
    ap.add_argument("--work", help="folder for the generated corpora and indexes (default: a temporary one, "
                    "removed at the end)")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"), help="folder of the result tables")
    ap.add_argument("--no-baseline", action="store_true", help="skip bm25s's in-memory build (the baseline: at 1M "
                    "passages it takes 4.5 GiB and minutes)")
    ap.add_argument("--no-python-scan", action="store_true", help="skip the second chunked build with "
                    "$FASTRAG_BM25_NATIVE=0 (the passages' tokens found by Python's regex engine, not fastrag._C)")
    ap.add_argument("--child", choices=["build", "build-bm25s", "search"], help=argparse.SUPPRESS)
    ap.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "build":
        return print(json.dumps(child_build(Path(args.paths[0]), Path(args.paths[1]))))
    if args.child == "build-bm25s":
        return print(json.dumps(child_build_bm25s(Path(args.paths[0]), Path(args.paths[1]))))
    if args.child == "search":
        return print(json.dumps(child_search(Path(args.paths[0]), Path(args.paths[1]), args.queries, args.reps)))
    if not 0 <= args.rare < 1:
        ap.error(f"--rare must lie in [0, 1), got {args.rare}")
    sizes = sorted(set(args.sizes))
    from fastrag.provenance import cpu_name, versions
    from fastrag.text.pool import usable_cpus

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bm25_scale_"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for n in sizes:
            corpus, index = work / f"psgs_{n}.tsv", work / f"psgs_{n}.bm25s"
            t = time.perf_counter()
            if not corpus.is_file():
                make_corpus(corpus, n, args.words, args.rare)
            gen_s = time.perf_counter() - t
            shutil.rmtree(index, ignore_errors=True)
            row = {"passages": n, "corpus_mib": corpus.stat().st_size / 2**20, "generate_s": gen_s}
            row.update(_child("build", str(corpus), str(index)))
            if not args.no_python_scan:  # (the same build, the tokens found by the regex: the scan's A/B)
                other = work / f"psgs_{n}.bm25s-pyscan"
                shutil.rmtree(other, ignore_errors=True)
                py = _child("build", str(corpus), str(other), env={"FASTRAG_BM25_NATIVE": "0"})
                row.update({"pyscan_build_s": py["build_s"], "pyscan_build_peak_anon_gib": py["build_peak_anon_gib"],
                            "pyscan_native_scan": py["native_scan"]})
                shutil.rmtree(other)
            if not args.no_baseline:
                baseline = work / f"psgs_{n}.bm25s-inmemory"
                shutil.rmtree(baseline, ignore_errors=True)
                row.update(_child("build-bm25s", str(corpus), str(baseline)))
                shutil.rmtree(baseline)
            row.update(_child("search", "--queries", str(args.queries), "--reps", str(args.reps), str(corpus),
                              str(index)))
            rows.append(row)
            print(json.dumps(row), flush=True)
            if not args.work:
                corpus.unlink()
                shutil.rmtree(index)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)

    xs = [float(r["passages"]) for r in rows]
    base = all("bm25s_build_s" in r for r in rows)
    pyscan = all("pyscan_build_s" in r for r in rows)
    keys = ("corpus_mib", "build_s", "build_peak_rss_gib", "build_peak_anon_gib", "worker_peak_rss_gib",
            "index_mib", "load_s", "rss_after_load_gib", "search_ms", "numpy_ms", "field_scores_ms") + (
            ("bm25s_build_s", "bm25s_build_peak_rss_gib", "bm25s_build_peak_anon_gib") if base else ()) + (
            ("pyscan_build_s",) if pyscan else ())
    dpr = {k: fit(xs, [r[k] for r in rows], DPR_PASSAGES) for k in keys}
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    command = "python " + shlex.join(["benchmarks/bench_bm25_scale.py", *sys.argv[1:]])
    device = cpu_name()
    head = [f"# BM25 at corpus scale (bm25s, title/text best_fields, top-{K})", "",
            f"- device: {device}, {usable_cpus()} usable CPUs, {mem_gib:.1f} GiB memory; date "
            f"{dt.date.today().isoformat()}; {versions('bm25s', 'numpy', 'torch')}",
            f"- command: `{command}`",
            f"- corpora: generated DPR-shaped tsv, {args.words} words a passage from the bundled sample's word "
            f"frequencies, {args.rare:.0%} rare words (a vocabulary of passages / 4), bundled titles; queries: "
            f"{args.queries} real ones (bundled HotpotQA questions, then 15-word spans of bundled passages)",
            "- build: fastrag's chunked build (fastrag.retrieval.bm25_build; its analysis processes as chosen "
            "automatically) in a fresh process: seconds, the peak resident memory of the building process (RSS, "
            "`ru_maxrss`, which counts the pages of the files it maps, and anon, its allocated memory alone: "
            "RssAnon sampled every 20 ms) and of its largest analysis process (RSS; a forked one shares the "
            "builder's pages until written), the index's size; the passages' tokens found by "
            + ("fastrag._C's scan (`bm25_tokens`)" if all(r["native_scan"] for r in rows) else "Python's regex engine")
            + ("; `regex scan`: the same build in another fresh process with $FASTRAG_BM25_NATIVE=0, its tokens "
               "found by Python's regex engine (and no torch imported: the native scan's build seconds include "
               "torch's import, ~1 s, which the retriever's native search needs anyway)" if pyscan else "")
            + ("; beside it, in another fresh process, the baseline: bm25s's in-memory build of the same passages "
               "(every title and text in lists, then bm25s tokenize, index and save per field), as fastrag built "
               "before" if base else ""),
            f"- search: another process, one query a call, the median (and 90th percentile) over {args.reps} passes "
            "after a warm pass, of the retriever's search of an analysed query (fastrag._C's postings-driven "
            "`bm25_best_fields` when built) and, on the same queries in the same pass, of the numpy path (dense "
            "per-field score vectors from bm25s, then the combination and top-k over every passage; `field scores` "
            "is its bm25s part); every query's two answers are checked equal; batch: all the queries in one "
            "`search` call, their analysis (tokens, stopwords, stemmer; `analysis` alone) included", "",
            "| passages | corpus MiB | build s | processes | build peak RSS GiB | of it anon GiB | largest worker GiB |"
            " index MiB |" + (" regex scan build s | regex / scan |" if pyscan else "") + (" bm25s build s | bm25s peak RSS GiB | of it anon GiB | bm25s / build, time | "
                              "bm25s / build, RSS | bm25s / build, anon |" if base else ""),
            "|---|---|---|---|---|---|---|---|" + ("---|---|" if pyscan else "")
            + ("---|---|---|---|---|---|" if base else "")]
    body = [f"| {r['passages']:,} | {r['corpus_mib']:.0f} | {r['build_s']:.1f} | {r['build_workers']} | "
            f"{r['build_peak_rss_gib']:.2f} | {r['build_peak_anon_gib']:.2f} | {r['worker_peak_rss_gib']:.2f} | "
            f"{r['index_mib']:.0f} |"
            + (f" {r['pyscan_build_s']:.1f} | {r['pyscan_build_s'] / r['build_s']:.2f} |" if pyscan else "")
            + (f" {r['bm25s_build_s']:.1f} | {r['bm25s_build_peak_rss_gib']:.2f} | "
               f"{r['bm25s_build_peak_anon_gib']:.2f} | {r['bm25s_build_s'] / r['build_s']:.2f} | "
               f"{r['bm25s_build_peak_rss_gib'] / r['build_peak_rss_gib']:.1f} | "
               f"{r['bm25s_build_peak_anon_gib'] / r['build_peak_anon_gib']:.1f} |" if base else "") for r in rows]
    search = ["", "| passages | load s | RSS after load GiB | search ms/query (p90) | numpy ms/query (p90) | "
              "of it field scores ms | numpy / search | batch ms/query | of it analysis | terms/query |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    search += [f"| {r['passages']:,} | {r['load_s']:.2f} | {r['rss_after_load_gib']:.2f} | {r['search_ms']:.2f} "
               f"({r['search_p90_ms']:.2f}) | {r['numpy_ms']:.1f} ({r['numpy_p90_ms']:.1f}) | "
               f"{r['field_scores_ms']:.1f} | {r['numpy_ms'] / r['search_ms']:.1f} | {r['batch_ms_per_query']:.2f} | "
               f"{r['analyse_ms_per_query']:.2f} | {r['terms_per_query']:.1f} |" for r in rows]
    tail = ["", f"Extrapolated to DPR's {DPR_PASSAGES:,} passages (a least-squares line through the rows above; "
            "not measured): corpus "
            f"{dpr['corpus_mib'] / 1024:.1f} GiB, build {dpr['build_s'] / 60:.0f} min with "
            f"{rows[-1]['build_workers']} processes"
            + (f" ({dpr['pyscan_build_s'] / 60:.0f} min with the regex scan)" if pyscan else "")
            + f", the builder at peak {dpr['build_peak_rss_gib']:.1f} GiB resident "
            f"({dpr['build_peak_anon_gib']:.1f} GiB of it allocated) and its largest worker "
            f"{dpr['worker_peak_rss_gib']:.1f} GiB"
            + (f" (bm25s's in-memory build: {dpr['bm25s_build_s'] / 60:.0f} min at peak "
               f"{dpr['bm25s_build_peak_rss_gib']:.0f} GiB, {dpr['bm25s_build_peak_anon_gib']:.0f} GiB allocated)"
               if base else "")
            + f"; this machine has {mem_gib:.0f} GiB; index "
            f"{dpr['index_mib'] / 1024:.1f} GiB, load {dpr['load_s']:.1f} s, {dpr['rss_after_load_gib']:.1f} GiB "
            f"after the load, search {dpr['search_ms']:.1f} ms a query (the numpy path {dpr['numpy_ms']:.0f} ms, of it "
            f"field scores {dpr['field_scores_ms']:.0f})."]
    body = body + search
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    tag = "cpu"
    (out / f"bm25_scale_{tag}.md").write_text("\n".join(head + body + tail) + "\n")
    (out / f"bm25_scale_{tag}.json").write_text(json.dumps(
        {"command": command, "device": device, "date": dt.date.today().isoformat(), "rows": rows,
         "extrapolated_dpr": dpr, "dpr_passages": DPR_PASSAGES}, indent=2) + "\n")
    print("\n".join(head + body + tail))


if __name__ == "__main__":
    main()
