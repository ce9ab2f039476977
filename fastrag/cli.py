"""`fastrag` command line: `run` (batch evaluation), `parity` (engine vs per-question oracle), `compare-published`
(decisions vs the published DRAGIN code's), `index` (build the retrieval indexes of a corpus), `serve` (HTTP API),
`methods`."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
from pathlib import Path

from fastrag.data.datasets import DATASETS, GENERIC


def _dense_index_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dense-index", choices=("flat", "ivf", "hnsw", "ivfpq"), default=None,
                   help="dense: the faiss index, flat (exact; default), ivf, hnsw or ivfpq (docs/retrieval.md)")
    p.add_argument("--index-option", action="append", default=[], metavar="NAME=VALUE",
                   help="dense: an option of --dense-index, repeatable: ivf nlist, nprobe; hnsw M, ef_construction, "
                        "ef_search; ivfpq nlist, m, nbits, nprobe")


def _dense_options(args) -> dict | None:
    """The dense index options of --dense-index / --index-option (None: neither given); ValueError names a bad one."""
    if args.dense_index is None and not args.index_option:
        return None
    from fastrag.retrieval.ann import AnnOptions, parse_option

    opts = {"index": args.dense_index or "flat", **dict(parse_option(o) for o in args.index_option)}
    AnnOptions.of(**opts)
    return opts


def _common(p: argparse.ArgumentParser, method: str | None = None) -> None:
    p.add_argument("--method", required=method is None, default=method,
                   help="dynamic-RAG method (see `fastrag methods`)" + (f"; default {method}" if method else ""))
    p.add_argument("--dataset", required=True, help=f"{', '.join(d for d in DATASETS if d != GENERIC)}; any other name "
                   "(e.g. FlashRAG's popqa, triviaqa, musique) runs as generic QA")
    p.add_argument("--data", help="dataset file (formats: see fastrag.data.datasets; may be .gz/.bz2/.xz); "
                   "default for hotpotqa: the 20 bundled dev questions")
    p.add_argument("--corpus", help="passage corpus: jsonl {id,title,text} / {id,contents} or DPR tsv, "
                   "plain or .gz/.bz2/.xz; "
                   "default: the bundled 13.5k-passage Wikipedia corpus")
    p.add_argument("--retriever", default="bm25", choices=["bm25", "dense", "elasticsearch"],
                   help="bm25 (bm25s, title/text best_fields), dense (faiss + all-MiniLM-L6-v2; fastrag[dense]) "
                   "or elasticsearch ($FASTRAG_ES_URL, index $FASTRAG_ES_INDEX)")
    _dense_index_flags(p)
    p.add_argument("--model", default="smollm2", help="'smollm2' (embedded), an HF directory or a .gguf file")
    p.add_argument("--config", help="the method's config JSON (DRAGIN: the published format; see docs/methods.md, "
                   "docs/beamsearchqa.md); default: the papers' per-dataset values")
    p.add_argument("--limit", type=int, help="first N questions")
    p.add_argument("--batch-size", type=int, default=32, help="decode batch (2x this many questions in flight)")
    p.add_argument("--signals", help="signal backend: auto (cuda > triton > torch on a GPU, torch on a CPU) | torch | "
                   "cpp | triton | cuda; default $FASTRAG_SIGNALS_BACKEND, else auto")
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="KV cache pool size in GiB (default: 8 on a CPU; on a GPU 80%% of the device's memory less "
                        "the model and room for activations)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="do not share the KV of prompt blocks another sequence already computed")
    p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                   help="run the methods' own logic while the device decodes the next step (auto: on a GPU)")
    p.add_argument("--text-workers", type=int, default=None,
                   help="processes for the methods' spaCy work (0: in the main process; default: on a GPU one a "
                        "host core beyond two, at most 8, on a CPU 0). Each step's "
                        "texts go to them as one group the step does not wait for; "
                        "$FASTRAG_TEXT_LOCKSTEP=1: the step waits for its texts; $FASTRAG_TEXT_GROUPS=0: each text "
                        "back to its question as it comes (slower, docs/performance.md)")
    p.add_argument("--search-concurrency", type=int, default=None,
                   help="retrieval batches in flight at once (default: what the retriever serves: 1 for bm25, "
                        "dense and elasticsearch)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy; > 0: sample inside the fused signal kernel (run only; parity is greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --temperature > 0 (e.g. 0.9)")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature > 0: the k most likely tokens only, before "
                   "top-p (transformers' order; its generation default, which the published DRAGIN runs used, is "
                   "50); 0 (default): off")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling keys")
    p.add_argument("--answer-aliases", help="gold-answer aliases keyed by each question's answer_id (2WikiMultihopQA's "
                   "id_aliases.json, as the published DRAGIN evaluation scores 2Wiki); scoring only: a rerun into a "
                   "finished --output rescores its answers")
    p.add_argument("--output", required=True, help="output directory (run: results.jsonl, metrics.json, run.json; "
                   "parity: parity.json and the engine/ and oracle/ run folders)")
    p.add_argument("--no-progress", action="store_true")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, so that a run stops as on Ctrl-C: the answers written so far kept and
    its folder left ready to resume (the default action ended the process at once, exit status 143, without a
    word)."""


def _on_sigterm(signum, frame):
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    """The command line; Ctrl-C or SIGTERM at any point (importing torch, loading the model, mid-run) ends it with
    a line saying what was kept and how to go on, exit status 130 or 143."""
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    seen: dict = {}
    try:
        with _one_line_warnings():
            return _main(argv, seen)
    except KeyboardInterrupt as e:
        return _interrupted(seen.get("args"), e)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, before)


def _interrupted(args, e: KeyboardInterrupt) -> int:
    """The line of a command stopped by Ctrl-C (exit status 130) or SIGTERM (143): what it kept, how to go on."""
    how = "stopped by SIGTERM" if isinstance(e, Terminated) else "interrupted"
    cmd = getattr(args, "cmd", None)
    if cmd in ("run", "parity"):
        from fastrag.trace import holds_records

        out = args.output
        if holds_records(out):
            msg = f"{how}; the answers written so far are in {out}: rerun the same command to go on from there"
        else:  # (stopped before its first answer: a folder the run made is removed again, so none is there)
            msg = (f"{how} before any answer was written ({out} holds none); rerun the same command to start "
                   "again")
    elif cmd == "index":
        msg = (f"{how} while making the {_index_kind(args)} index of {args.corpus}; it was not saved: rerun the same "
               "command to build it")
    elif cmd == "serve":
        msg = f"{how}; the server keeps nothing between runs: run the same command to start it again"
    else:
        msg = f"{how} while starting; nothing was written: run the same command again"
    print(f"fastrag: {msg}", file=sys.stderr)
    return 143 if isinstance(e, Terminated) else 130


def _index_kind(args) -> str:
    """The index kind `fastrag index` was making (the first asked for, before it began)."""
    return getattr(args, "making", None) or args.kind[0]


@contextlib.contextmanager
def _one_line_warnings():
    """fastrag's own warnings (a config key not applied, odd gold answers, ...) print as one line, "fastrag:
    warning: ...", not in Python's "FILE:LINE: UserWarning: ..." format with a source line under it; other
    packages' warnings keep theirs."""
    import os
    import warnings

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if os.path.abspath(filename).startswith(package):
            print(f"fastrag: warning: {message}", file=file or sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        if warnings.showwarning is show:
            warnings.showwarning = shown


def _main(argv: list[str] | None, seen: dict) -> int:
    ap = argparse.ArgumentParser(prog="fastrag", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    rp = sub.add_parser("run", help="run a method over a dataset; results.jsonl + metrics.json")
    _common(rp)
    rp.add_argument("--ray", action="store_true", help="shard the questions over Ray workers (fastrag[ray])")
    rp.add_argument("--num-workers", type=int, default=None, help="--ray: workers (one engine each; default 2)")
    pp = sub.add_parser("parity", help="engine vs per-question oracle on the same questions; parity.json")
    _common(pp)
    cp = sub.add_parser("compare-published", help="a method's decisions vs the published DRAGIN code's own "
                        "(a decisions file, and optionally its trace replayed round by round); compare.md")
    _common(cp, method="dragin-published")
    cp.add_argument("--decisions", required=True, help="the published code's decisions jsonl (one record a question)")
    cp.add_argument("--trace", help="the published code's trace jsonl: replay every round's decisions from it")
    cp.add_argument("--results", help="compare this results.jsonl instead of running the questions")
    sub.add_parser("methods", help="list the available methods")
    cv = sub.add_parser("convert", help="write a question file (any format fastrag reads) as FlashRAG jsonl "
                        "{id, question, golden_answers, metadata}")
    cv.add_argument("--dataset", required=True, help="as for run (it decides e.g. StrategyQA's yes/no answers)")
    cv.add_argument("--data", required=True, help="the question file to read")
    cv.add_argument("--output", required=True, help="the .jsonl file to write")
    cv.add_argument("--limit", type=int, help="first N questions")
    cv.add_argument("--answer-aliases", help="2WikiMultihopQA's id_aliases.json: aliases join the gold answers")
    ip = sub.add_parser("index", help="build and save the retrieval indexes of a corpus (reused by later runs)")
    ip.add_argument("--corpus", required=True,
                    help="jsonl {id,title,text} / {id,contents} or DPR tsv, plain or .gz/.bz2/.xz")
    ip.add_argument("--kind", nargs="+", default=["bm25"], choices=["bm25", "dense", "elasticsearch"],
                    help="indexes to build (elasticsearch: into $FASTRAG_ES_URL, index $FASTRAG_ES_INDEX)")
    ip.add_argument("--encoder", default="all-minilm-l6-v2", help="dense: sentence-transformers folder or the "
                    "embedded all-minilm-l6-v2")
    _dense_index_flags(ip)
    ip.add_argument("--index-workers", type=_processes, default=None, metavar="N",
                    help="bm25: processes that analyse the passages (default: $FASTRAG_INDEX_WORKERS, else one per "
                    "usable CPU up to 8 for a corpus over 40,000 passages)")
    ip.add_argument("--no-progress", action="store_true")
    sp = sub.add_parser("serve", help="HTTP server: OpenAI-style /v1/completions with streaming retrieval events")
    sp.add_argument("--model", default="smollm2")
    sp.add_argument("--corpus", help="passage corpus (default: the bundled 13.5k-passage Wikipedia corpus)")
    sp.add_argument("--retriever", default="bm25", choices=["bm25", "dense", "elasticsearch"])
    sp.add_argument("--host", default="127.0.0.1")
    sp.add_argument("--port", type=int, default=8000)
    sp.add_argument("--batch-size", type=int, default=32, help="decode batch (2x this many questions in flight)")
    sp.add_argument("--max-queue", type=int, default=256, help="questions waiting beyond those in flight; then 429")
    sp.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    sp.add_argument("--kv-cache-gb", type=float, default=None, help="as for run")
    sp.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sampled answers")
    sp.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --temperature > 0")
    sp.add_argument("--top-k", type=int, default=0, help="with --temperature > 0: the k most likely tokens only, "
                    "before top-p; 0 (default): off")
    sp.add_argument("--served-model-name", help="the model id clients send and GET /v1/models lists (default: "
                    "--model as given); a request naming another model gets 404")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--search-concurrency", type=int, default=None,
                    help="retrieval batches in flight at once, so that a slow search holds back no other (default: "
                         "what the retriever serves: 1)")
    sp.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="on SIGINT/SIGTERM: seconds the requests in flight get to finish before they are cancelled "
                         "(default 30; new connections are refused at once)")
    args = ap.parse_args(argv)
    seen["args"] = args
    if args.cmd == "index":
        return _index(args)
    if args.cmd == "convert":
        return _convert(args)
    if args.cmd == "serve":
        from fastrag.serving.server import serve

        try:
            serve(model=args.model, corpus=args.corpus, retriever=args.retriever, host=args.host, port=args.port,
                  batch_size=args.batch_size, max_queue=args.max_queue, timeout_s=args.timeout,
                  kv_cache_gb=args.kv_cache_gb, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                  top_k=args.top_k, served_model_name=args.served_model_name,
                  search_concurrency=args.search_concurrency, shutdown_timeout_s=args.shutdown_timeout)
        except ValueError as e:
            print(f"fastrag: error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.cmd == "methods":
        from fastrag.api import methods

        for name, description in methods().items():
            print(f"{name:18s} {description}")
        return 0

    from fastrag.eval import BUNDLED, RunError, RunOptions
    from fastrag.signals import BackendUnavailableError

    try:
        if args.data is None:
            if args.dataset != "hotpotqa":
                raise ValueError(f"--data is required for --dataset {args.dataset} (only hotpotqa has bundled questions)")
            args.data = str(BUNDLED / "hotpotqa_dev20.jsonl")
        args.corpus = args.corpus or str(BUNDLED / "wiki_passages.jsonl")
        opts = RunOptions(method=args.method, dataset=args.dataset, data=args.data, corpus=args.corpus,
                          output=args.output, model=args.model, config=args.config, limit=args.limit,
                          batch_size=args.batch_size, signals=args.signals, kv_cache_gb=args.kv_cache_gb,
                          prefix_caching=not args.no_prefix_caching, threads=args.threads, progress=not args.no_progress, retriever=args.retriever,
                          overlap={"auto": None, "on": True, "off": False}[args.overlap],
                          text_workers=args.text_workers, search_concurrency=args.search_concurrency,
                          temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                          top_k=args.top_k, answer_aliases=args.answer_aliases,
                          retriever_options=_dense_options(args))
        if args.cmd == "parity" and args.temperature > 0:
            raise ValueError("--temperature: parity compares greedy decoding with the per-question oracle; "
                             "drop --temperature/--top-k/--top-p for `fastrag parity`")
        if args.cmd == "run" and args.num_workers is not None and not args.ray:
            raise ValueError("--num-workers shards the questions over Ray workers: add --ray (or drop it)")
        if args.cmd == "compare-published":
            from fastrag.compare_published import run_compare

            report = run_compare(opts, args.decisions, args.trace, args.results)
            print((Path(args.output) / "compare.md").read_text(encoding="utf-8"))
            print(f"compare-published: {report['questions_agree']} of {report['n']} questions agree, decisions "
                  f"{_fmt(report['decision_agreement'], '.3f')}"
                  + (f", replayed rounds {_fmt(report['replay']['decision_agreement'], '.3f')}" if "replay" in report
                     else "") + f" (details: {args.output}/compare.json)")
            return 0
        if args.cmd == "run" and args.ray:
            from fastrag.distributed import run_ray

            metrics = run_ray(opts, num_workers=2 if args.num_workers is None else args.num_workers)
            _print_table("fastrag run --ray", metrics)
            print(_run_summary(metrics, args.output))
            _print_failures(metrics, args.output)
            return _all_failed(metrics, args.output)
        elif args.cmd == "run":
            metrics = _run(opts)
            _print_table("fastrag run", metrics)
            print(_run_summary(metrics, args.output))
            _print_failures(metrics, args.output)
            return _all_failed(metrics, args.output)
        else:
            from fastrag.parity import parity

            report = parity(opts)
            _print_table("fastrag parity", {k: v for k, v in report.items() if k not in ("disagreements", "errored")})
            print(_parity_summary(report, args.output))
    # (OSError: files and folders, e.g. no writable index; BackendUnavailableError: --signals cuda/triton where
    # they cannot run)
    except (ValueError, OSError, ImportError, RunError, BackendUnavailableError) as e:
        print(f"fastrag: error: {e}", file=sys.stderr)
        return 2
    return 0


def _run(opts) -> dict:
    """`fastrag run` through the public API: a RAG of the run's engine settings and retriever, its run() into the
    output folder (resumed there); the metrics as metrics.json holds them. The options were checked when built,
    with the flags' names, before anything loads."""
    from fastrag.api import RAG
    from fastrag.specs import EngineConfig, retriever_spec

    rag = RAG(EngineConfig.of(opts), retriever=retriever_spec(opts.retriever, opts.corpus))
    results = rag.run(opts.data, method=opts.method, dataset=opts.dataset, config=opts.config, out=opts.output,
                      limit=opts.limit, progress=opts.progress, qids=opts.qids, answer_aliases=opts.answer_aliases)
    return results.metrics


def _processes(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number of processes >= 1, got {text!r}")
    return n


def _convert(args) -> int:
    from fastrag.data.datasets import DataError, load_examples, write_flashrag

    try:
        if Path(args.output).resolve() == Path(args.data).resolve():
            raise DataError(f"--output {args.output} is the --data file: write elsewhere")
        n = write_flashrag(load_examples(args.dataset, args.data, limit=args.limit,
                                         answer_aliases=args.answer_aliases), args.output)
    except (DataError, OSError) as e:
        print(f"fastrag: error: {e}", file=sys.stderr)
        return 2
    print(f"convert: {n} questions of {args.data} -> {args.output} (FlashRAG jsonl)")
    return 0


def _index(args) -> int:
    import time

    from fastrag.retrieval import CorpusError, make_retriever

    try:
        for kind in args.kind:
            args.making = kind
            t = time.perf_counter()
            kw = {"encoder": args.encoder, **(_dense_options(args) or {})} if kind == "dense" else {}
            if kind == "bm25" and args.index_workers is not None:
                kw["index_workers"] = args.index_workers
            r = make_retriever(kind, corpus_path=args.corpus, show_progress=not args.no_progress, **kw)
            what = "built" if r.built else "already up to date"
            recall = getattr(r, "ann_recall", None)
            print(f"{kind}: {r.n_docs} passages, index {what} in {time.perf_counter() - t:.1f}s -> {r.index_dir}"
                  + (f" (recall@10 against exact search: {recall:.3f})" if recall is not None else ""))
    except (FileNotFoundError, PermissionError, ValueError, CorpusError, ImportError, OSError) as e:
        print(f"fastrag: error: {e}", file=sys.stderr)
        return 2
    # (Ctrl-C, SIGTERM: main says so; a build stopped part-way leaves no index that a later call would trust)
    return 0


def _print_table(title: str, d: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    t.add_column("metric")
    t.add_column("value", justify="right")
    env = d.get("environment")
    if isinstance(env, dict) and "resolved" in env:
        # (every setting with its default is metrics.json's record, too long for a summary: the table keeps the
        # settings that were set, environment.settings)
        d = {**d, "environment": {k: v for k, v in env.items() if k != "resolved"}}
    for k, v in _flat_rows(d):
        t.add_row(k, v)
    Console().print(t)


def _fmt(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def _run_summary(m: dict, output: str) -> str:
    """The headline of a run in one line, printed under the (long) table so that it is the last thing seen."""
    score = f"EM {_fmt(m.get('em'), '.3f')}, F1 {_fmt(m.get('f1'), '.3f')}"
    if m.get("accuracy") is not None:
        score += f", accuracy {m['accuracy']:.3f}"
    return (f"{m.get('method')} on {m.get('dataset')}: {m.get('n')} questions, {m.get('errors', 0)} failed (scores over "
            "the others); "
            f"{score}; {_fmt(m.get('questions_per_s'), '.3g')} questions/s, {_fmt(m.get('tokens_per_s'), '.4g')} "
            f"tokens/s, {_fmt(m.get('retrievals_per_question'), '.2f')} retrievals/question "
            f"(all figures: {output}/metrics.json)")


def _print_failures(m: dict, output: str, most: int = 5) -> None:
    """The failed questions of a run, each with its id and error on a line (the first `most`; all of them are in
    results.jsonl), under the summary line that counts them: "2 failed" alone said neither which nor why."""
    if not m.get("errors"):
        return
    from fastrag.eval import read_results

    try:
        records = read_results(Path(output) / "results.jsonl")
    except (OSError, ValueError):  # (the count above stands; the file's own problem is the next run's error)
        return
    failed = {r.qid: r.error for r in records}  # (the last record of a question counts)
    failed = [(q, e) for q, e in failed.items() if e is not None]
    if not failed:
        return
    print(f"failed questions ({len(failed)}; each one's error is in {output}/results.jsonl, a rerun computes them "
          "again):")
    for qid, error in failed[:most]:
        line = " ".join(str(error).split())
        print(f"  {qid}: {line[:200] + '...' if len(line) > 200 else line}")
    if len(failed) > most:
        print(f"  ... and {len(failed) - most} more")


def _all_failed(m: dict, output: str) -> int:
    """The exit status of a run: 1, with a line saying so, when it computed questions and every one of them failed
    (a retriever down for the whole run: a script must not take it for results), else 0."""
    computed = m.get("computed_this_run") or 0
    if computed and not m.get("questions_measured"):
        print(f"fastrag: error: all {computed} questions computed in this run failed; their errors are in "
              f"{output}/results.jsonl (a rerun computes them again)", file=sys.stderr)
        return 1
    return 0


def _parity_summary(r: dict, output: str) -> str:
    return (f"parity {r.get('method')} on {r.get('dataset')}: agreement {_fmt(r.get('agreement'), '.2f')} over "
            f"{r.get('n')} questions, {len(r.get('disagreements') or [])} disagreements"
            + (f", {r['n_errored']} questions left out for an error on either side" if r.get("n_errored") else "")
            + f" (listed in {output}/parity.json); EM engine {_fmt(r.get('engine_em'), '.3f')}, "
            f"oracle {_fmt(r.get('oracle_em'), '.3f')}")


def _flat_rows(d: dict, prefix: str = "") -> list[tuple[str, str]]:
    """(name, text) rows of a metrics dict: a nested dict's entries become rows of their own under dotted names
    ("environment.device", "engine.decode_steps") instead of one wrapped JSON cell; floats to 4 significant digits,
    lists as JSON."""
    rows = []
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            rows.extend(_flat_rows(v, name + ".") if v else [(name, "{}")])
        elif isinstance(v, float):
            rows.append((name, f"{v:.4g}"))
        elif isinstance(v, (list, tuple)):
            rows.append((name, json.dumps(v)))
        else:
            rows.append((name, str(v)))
    return rows


if __name__ == "__main__":
    sys.exit(main())
