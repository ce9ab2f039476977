"""Reading a corpus file: fastrag's readers (`fastrag.retrieval.corpus.iter_corpus`, every check included: field
types, repeated ids, lone surrogates, the tsv quoting) against the floor and the per-line parsers they replaced.

One generated DPR-shaped corpus (bench_bm25_scale's generator: `--passages` passages of 100 words, most of them
written as DPR writes them, the passage in csv quotes) as tsv, and the same passages as JSON Lines. Per file, each
reading a full pass over it in this process, the median of `--reps` passes (after one warm pass: the page cache):

- `lines`: the decoded lines alone (`corpus._lines`: UTF-8, line numbers), the floor of any reader here;
- `fastrag`: `iter_corpus`, what an index build reads;
- tsv, `csv a line`: the lines split at their tabs, each line with a quote parsed by a csv reader made for it (how
  the tsv reader read them before 2026-12-02: ~5 us a line);
- tsv, `csv stream`: one `csv.reader` over the whole file (the standard library's fastest reading, for scale: it
  lets a stray quote swallow the lines after it, which a corpus reader must not, and the generated corpus has such
  quotes: it reads fewer rows than there are passages);
- jsonl, `json.loads a line`: `json.loads(line, object_pairs_hook=unique_keys)` (how the jsonl reader decoded them
  before 2026-12-02: a decoder made each call) and `json.loads, no hook` (the C decoder's fastest, for scale).

Writes benchmarks/results/corpus_read_cpu.md (+ .json).

    python benchmarks/bench_corpus_read.py                       # 1M passages, 3 passes
    python benchmarks/bench_corpus_read.py --passages 20000 --reps 1 --results /tmp/r
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_args import positive_int  # noqa: E402  (the script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]


def _count(rows) -> int:
    n = 0
    for _ in rows:
        n += 1
    return n


def _csv_a_line(path: Path):
    from fastrag.retrieval import corpus

    for _, raw in corpus._lines(path):
        line = raw.rstrip("\r\n")
        if '"' not in line:
            yield line.split("\t")
            continue
        try:
            yield next(csv.reader([line], delimiter="\t", strict=True))
        except csv.Error:  # (not csv quoting: the text as written)
            yield line.split("\t")


def _csv_stream(path: Path):
    with open(path, encoding="utf-8", newline="") as f:
        yield from csv.reader(f, delimiter="\t")


def _json_a_line(path: Path, hook: bool):
    from fastrag.jsonkeys import unique_keys
    from fastrag.retrieval import corpus

    for _, line in corpus._lines(path):
        yield json.loads(line, object_pairs_hook=unique_keys) if hook else json.loads(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passages", type=positive_int, default=1_000_000)
    ap.add_argument("--reps", type=positive_int, default=3)
    ap.add_argument("--work", help="folder for the generated corpora (default: a temporary one, removed at the end; "
                    "a corpus already there is reused)")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"), help="folder of the result tables")
    args = ap.parse_args()
    from bench_bm25_scale import make_corpus

    from fastrag.provenance import cpu_name, versions
    from fastrag.retrieval import corpus

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="corpus_read_"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        tsv, jsonl = work / f"psgs_{args.passages}.tsv", work / f"psgs_{args.passages}.jsonl"
        if not tsv.is_file():
            make_corpus(tsv, args.passages, 100, 0.08)
        if not jsonl.is_file():
            with open(jsonl, "w", encoding="utf-8") as f:
                for doc_id, title, text in corpus.iter_corpus(tsv):
                    f.write(json.dumps({"id": doc_id, "title": title, "text": text}, ensure_ascii=False) + "\n")
        quoted = sum('"' in line for _, line in corpus._lines(tsv)) - 1  # (the header has none)
        readers = {
            tsv: {"lines": corpus._lines, "fastrag": corpus.iter_corpus,
                  "csv a line": _csv_a_line, "csv stream": _csv_stream},
            jsonl: {"lines": corpus._lines, "fastrag": corpus.iter_corpus,
                    "json.loads a line": lambda p: _json_a_line(p, True),
                    "json.loads, no hook": lambda p: _json_a_line(p, False)},
        }
        for path, kinds in readers.items():
            mib = path.stat().st_size / 2**20
            for kind, read in kinds.items():
                n = _count(read(path))  # (the warm pass: the file in the page cache)
                times = []
                for _ in range(args.reps):
                    t = time.perf_counter()
                    _count(read(path))
                    times.append(time.perf_counter() - t)
                s = statistics.median(times)
                rows.append({"format": path.suffix[1:], "reader": kind, "items": n, "mib": mib, "median_s": s,
                             "times_s": times, "passages_per_s": args.passages / s, "mib_per_s": mib / s})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)

    by = {(r["format"], r["reader"]): r for r in rows}
    for r in rows:
        r["vs_lines"] = r["median_s"] / by[(r["format"], "lines")]["median_s"]
        r["fastrag_speedup"] = r["median_s"] / by[(r["format"], "fastrag")]["median_s"]
    from fastrag.text.pool import usable_cpus

    command = "python " + shlex.join(["benchmarks/bench_corpus_read.py", *sys.argv[1:]])
    md = [f"# Reading a corpus file ({args.passages:,} passages)", "",
          f"- device: {cpu_name()}, {usable_cpus()} usable CPUs; date {dt.date.today().isoformat()}; "
          f"Python {sys.version.split()[0]}, {versions('numpy')}",
          f"- command: `{command}`",
          f"- corpus: bench_bm25_scale's generated DPR-shaped passages (100 words each), {quoted / args.passages:.0%} "
          "of the tsv lines with a quote (the passage in csv quotes, as DPR writes it); the same passages as JSON "
          "Lines {id, title, text}",
          f"- each reading a full pass in one process, the median of {args.reps} passes after a warm one (the file "
          "in the page cache); `lines`: the decoded lines alone, the floor; `fastrag`: `iter_corpus` with every "
          "check; `csv a line` / `json.loads a line`: the per-line parsing the readers did before 2026-12-02; "
          "`csv stream` / `no hook`: the standard library's fastest, for scale (neither is a corpus reader: a stray "
          "quote swallows lines, a repeated key passes); `rows read`: the tsv's counts include its header line, and "
          "`csv stream` reads fewer rows than the file has lines where a quote that opens a passage without closing "
          "it takes the lines after it into one field", "",
          "| format | reader | rows read | MiB | median s | passages/s | MiB/s | / lines | / fastrag |",
          "|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['format']} | {r['reader']} | {r['items']:,} | {r['mib']:.0f} | {r['median_s']:.2f} | "
           f"{r['passages_per_s']:,.0f} | "
           f"{r['mib_per_s']:.0f} | {r['vs_lines']:.2f} | {r['fastrag_speedup']:.2f} |" for r in rows]
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "corpus_read_cpu.md").write_text("\n".join(md) + "\n")
    (out / "corpus_read_cpu.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
