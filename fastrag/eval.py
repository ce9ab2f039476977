"""Batch evaluation: run a method over a dataset, write results.jsonl incrementally, resume, score.

`DIR/results.jsonl` gets one line per finished question (flushed and fsynced as it finishes), so a killed run loses
at most the questions in flight; a rerun reads the file, skips every question already answered there and computes
the rest (questions whose record is an error are computed again, the error record replaced). `DIR/run.json` names
what the answers depend on (method, config, model, retriever, corpus, decoding): a rerun of anything else into the
folder is refused, and a record whose question differs from the data's question of that id too. `DIR/metrics.json`
is rewritten at the end from all records (a rerun that computes nothing keeps the throughput and engine figures of
the run before it: MEASURED_FIELDS). `DIR/runs.jsonl` keeps each run's questions computed, answered (without an
error) and seconds (a killed run's too, from `DIR/progress.json`), so `all_runs` in metrics.json is the rate of
answered questions over every run that produced the results, not only the last one.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from fastrag.cache.kv import OutOfBlocks
from fastrag.data.datasets import Example, load_examples
from fastrag.data.metrics import aggregate, score
from fastrag.kernel_parts import StepWindow, kernel_profile_window
from fastrag.launch_profile import LAUNCH_PROFILE_ENV, LaunchProfile
from fastrag.model.loading import control_token_strings, find_control_token
from fastrag.perf import STEP_TRACE_ENV, trace_summary
from fastrag.provenance import environment, source_commit
from fastrag.switches import env_switch, switch_interval_setting
from fastrag.trace import QuestionResult, holds_records

BUNDLED = Path(__file__).resolve().parent / "data" / "bundled"


@dataclass(slots=True)
class RunOptions:
    method: str
    dataset: str
    data: str
    corpus: str
    output: str
    model: str = "smollm2"
    config: str | None = None
    limit: int | None = None
    batch_size: int = 32
    signals: str | None = None
    kv_cache_gb: float | None = None  # None: 8 GiB on a CPU, sized from the device's memory on a GPU (auto_kv_cache_gb)
    # share the KV of full prompt blocks any sequence already computed (fastrag/cache/kv.py); off: every prompt
    # prefills all but the shared demos and its own sequence's cached tokens
    prefix_caching: bool = True
    threads: int | None = None
    # the methods' host logic runs while the device decodes the next step (Scheduler.overlap); None: on a GPU
    overlap: bool | None = None
    # processes for the methods' spaCy work (Scheduler.text_workers; 0: on the scheduler's thread); None: chosen by
    # the run (fastrag.text.pool.auto_text_workers: on a GPU the host's cores beyond two, at most 8; on a CPU 0)
    text_workers: int | None = None
    # the host CPUs that auto text workers are counted from; None: this process's (a Ray run's GPU shard: the
    # cluster's CPUs a GPU, as its siblings on the node share the cores)
    text_worker_cpus: int | None = None
    # retrieval batches in flight at once (Scheduler.search_concurrency); None: what the retriever serves
    # (Retriever.concurrent_searches: 1 for the bundled ones)
    search_concurrency: int | None = None
    progress: bool = True
    retriever: str = "bm25"  # bm25 | dense | elasticsearch (fastrag.retrieval.RETRIEVERS)
    qids: tuple[str, ...] | None = None  # only these questions of the file (a shard of a distributed run)
    # decoding: greedy by default (parity and the committed tables); temperature > 0 samples inside the fused
    # signal kernel, from the top-p nucleus when top_p < 1 (the published DRAGIN runs sampled with T = 0.6,
    # top-p 0.9). Keys derive from (seed, question id, call number, token index), so a resumed or sharded run
    # draws what one uninterrupted run would.
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    # with temperature > 0: only the k most likely tokens (ties kept) before top-p, transformers' order (its
    # generation default is 50: the published DRAGIN runs sampled with T 0.6, top-k 50, top-p 0.9); 0: off
    top_k: int = 0
    # gold-answer aliases keyed by each question's answer_id (2WikiMultihopQA's id_aliases.json, as the published
    # DRAGIN evaluation reads it): scoring only, so a rerun into a finished folder rescores its answers with them
    answer_aliases: str | None = None

    def __post_init__(self):
        from fastrag.methods.registry import get_method

        from fastrag.retrieval import RETRIEVERS

        get_method(self.method)  # raises with the list of available methods
        if self.retriever not in RETRIEVERS:
            raise ValueError(f"--retriever {self.retriever!r}: expected one of {', '.join(RETRIEVERS)}")
        from fastrag.engine import as_int, check_seed

        # (any integer type, numpy's included, kept as a Python int; floats, bools and strings refused by name)
        for name, flag in (("batch_size", "--batch-size"), ("limit", "--limit")):
            value = getattr(self, name)
            if value is None and name == "limit":
                continue
            if as_int(value) is None or value <= 0:
                raise ValueError(f"{flag} must be a positive int, got {value!r}")
            setattr(self, name, as_int(value))
        if not isinstance(self.output, (str, os.PathLike)) or not str(self.output).strip():
            raise ValueError(f"--output must name a folder, got {self.output!r} (an empty path would write into "
                             "the current directory)")
        from fastrag.signals.checks import MIN_TEMPERATURE

        t = self.temperature
        if not (isinstance(t, (int, float)) and math.isfinite(t) and (t == 0 or t >= MIN_TEMPERATURE)):
            raise ValueError(f"--temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got {t!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"--top-p must be in (0, 1] (1: no nucleus filtering), got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"--top-k must be an int >= 0 (0: no top-k filtering), got {self.top_k!r}")
        if self.top_k and self.temperature == 0:
            raise ValueError(f"--top-k {self.top_k} applies only when sampling: give --temperature > 0 too "
                             "(greedy decoding takes the most likely token whatever k is)")
        if self.top_p < 1 and self.temperature == 0:
            raise ValueError(f"--top-p {self.top_p} applies only when sampling: give --temperature > 0 too "
                             "(greedy decoding has no nucleus)")
        self.seed = check_seed(self.seed, "--seed")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ValueError(f"--threads must be an int >= 1, got {self.threads!r}")
        if self.text_workers is not None and (isinstance(self.text_workers, bool)
                                              or not isinstance(self.text_workers, int) or self.text_workers < 0):
            raise ValueError(f"--text-workers must be an int >= 0 (0: no worker processes), got {self.text_workers!r}")
        if self.search_concurrency is not None and (isinstance(self.search_concurrency, bool)
                                                    or not isinstance(self.search_concurrency, int)
                                                    or self.search_concurrency < 1):
            raise ValueError(f"--search-concurrency must be an int >= 1, got {self.search_concurrency!r}")
        if self.qids is not None:
            if isinstance(self.qids, (str, bytes)) or not isinstance(self.qids, (list, tuple, set, frozenset)) \
                    or not all(isinstance(q, str) for q in self.qids):
                raise ValueError(f"qids must be a list or tuple of question ids (strings), got {self.qids!r:.80}")
            self.qids = tuple(self.qids)
        for name in ("data", "corpus", "answer_aliases"):
            if getattr(self, name) is None and name == "answer_aliases":
                continue
            p, flag = Path(getattr(self, name)), "--" + name.replace("_", "-")
            try:
                p.stat()
            except FileNotFoundError:
                pass  # (said below, by name)
            except OSError as e:  # (a folder on its path that cannot be entered: [Errno 13] alone named nothing)
                raise type(e)(f"{flag} {p}: {path_problem(e)}") from None
            if p.is_dir():
                raise ValueError(f"{flag} {p}: is a directory, expected a file")
            if not p.exists():
                raise FileNotFoundError(f"{flag} {p}: no such file")
            if not p.is_file():
                raise ValueError(f"{flag} {p}: not a regular file (a pipe or a device?): give a file on disk")
            if not os.access(p, os.R_OK):
                raise PermissionError(f"{flag} {p}: not readable")


def path_problem(e: OSError) -> str:
    """What an OSError on a path given as an option means to its user, and what to do."""
    if e.errno == errno.EACCES:
        return (f"cannot be reached ({e.strerror}): this user may not enter a folder on its path (or use the file "
                "itself); fix the permissions, or give a path under a folder this user can use")
    return f"cannot be reached ({e.strerror or e})"


def select_qids(examples: list, opts: RunOptions, what: str = "question") -> list:
    """The examples `opts.qids` names (all with qids None); an id not among them is a ValueError naming it (a run
    of none of the file's questions used to end as a success with nothing written)."""
    if opts.qids is None:
        return examples
    wanted = set(opts.qids)
    missing = wanted - {e.qid for e in examples}
    if missing:
        among = f"the first {opts.limit} questions" if opts.limit is not None else "the questions"
        raise ValueError(f"{len(missing)} {what} id(s) of qids are not among {among} of {opts.data}: "
                         f"{sorted(missing)[:3]}")
    return [e for e in examples if e.qid in wanted]


def method_config(opts: RunOptions):
    from fastrag.methods.registry import get_method

    return get_method(opts.method).make_config(opts.dataset, opts.config)


def read_results(path: Path, repair: bool = False) -> list[QuestionResult]:
    """Records already written, in file order (one per question since a resume leaves one; where a file holds
    several, the last one counts). A last line without its newline is a record being written (or torn by a killed
    run): it is not read. Reading never changes the file, so it is safe beside a writer (a progress count);
    `repair` (a resume, under the folder's lock) cuts a torn tail from the file, and gives a whole last record
    without its newline one, so that the next record starts a line of its own."""
    if not path.exists():
        return []
    out, good_bytes, last = [], 0, b"\n"
    with open(path, "rb") as f:
        for raw in f:
            try:
                obj = json.loads(raw)
                if not isinstance(obj, dict):
                    raise TypeError
                rec = QuestionResult.from_json(obj)
            except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError, ValueError):
                if raw.endswith(b"\n"):
                    raise ValueError(f"{path}: line {len(out) + 1} is not a result record; "
                                     "remove it or use another --output") from None
                break  # torn tail
            if not raw.endswith(b"\n") and not repair:
                break  # (may be a record still being written: only a repair under the lock keeps it)
            out.append(rec)
            good_bytes += len(raw)
            last = raw
    if not repair:
        return out
    if good_bytes != path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good_bytes)
    elif not last.endswith(b"\n"):
        with open(path, "ab") as f:
            f.write(b"\n")
    return out


class RunError(RuntimeError):
    """A run that cannot finish as asked (e.g. a Ray shard that failed every retry): the CLI prints it as an error;
    the answers already written stay for a rerun."""


MANIFEST = "run.json"  # what decides the answers of the records in an output folder (check_manifest)
# identity fields added after manifests were first written: an older run.json without one is completed, not refused
LATER_KEYS = frozenset({"corpus_fingerprint", "model_fingerprint", "encoder_fingerprint"})


def path_fingerprint(p: str) -> str | None:
    """Content fingerprint of a file, or of a folder's top-level files (name, size and fingerprint of each, sorted;
    an HF model folder is flat; hidden files left out), for the
    run identity: a corpus or a model replaced at the same path is another run. None for what is no local path
    (an embedded model's name is resolved first; an Elasticsearch index has none)."""
    from fastrag.retrieval.corpus import corpus_fingerprint

    q = Path(p)
    if q.is_file():
        return corpus_fingerprint(q)
    if q.is_dir():
        h = hashlib.sha256()
        for f in sorted(x for x in q.iterdir() if x.is_file() and not x.name.startswith(".")):
            h.update(f"{f.name}\0{f.stat().st_size}\0{corpus_fingerprint(f)}\n".encode())
        return "tree:" + h.hexdigest()
    return None


def run_identity(opts: "RunOptions", cfg, **more) -> dict:
    """What a run's answers depend on: method, its whole config, model, retriever, corpus and decoding (not the
    batch size, backends or other engine settings, which change no decision). `more`: further fields (the
    parity oracle's recipe)."""
    from dataclasses import asdict, is_dataclass

    c = asdict(cfg) if is_dataclass(cfg) else dict(vars(cfg))
    c.pop("extra", None)  # the published files' bookkeeping keys (paths, notes): no rule

    def where(p: str) -> str:
        q = Path(p)
        return str(q.resolve()) if q.exists() else p

    def model_file(m: str) -> str:  # the embedded model's GGUF; any other name is its path
        from fastrag.model.loading import EMBEDDED, embedded_gguf

        if m != EMBEDDED:
            return m
        try:
            return str(embedded_gguf())
        except Exception:  # (not installed: the run fails where the model loads, with its own message)
            return m

    def encoder() -> dict:  # dense retrieval: the embedded encoder's files decide the hits as much as the corpus
        if opts.retriever != "dense":
            return {}
        try:
            from fastrag.retrieval.dense import DEFAULT_ENCODER, encoder_fingerprint, resolve_encoder

            return {"encoder_fingerprint": encoder_fingerprint(resolve_encoder(DEFAULT_ENCODER))}
        except (ImportError, OSError):  # (not installed: the run fails where the retriever loads, with its message)
            return {}

    ident = {"method": opts.method, "config": c, "model": where(opts.model), "retriever": opts.retriever,
             "corpus": where(opts.corpus), "temperature": float(opts.temperature), "top_p": float(opts.top_p),
             "seed": int(opts.seed), "corpus_fingerprint": path_fingerprint(opts.corpus),
             "model_fingerprint": path_fingerprint(model_file(opts.model)),
             **encoder(), **({"top_k": int(opts.top_k)} if opts.top_k else {}), **more}
    # (top_k: only when on, so folders written before it existed keep their identity)
    return json.loads(json.dumps(ident))  # (as it reads back from the file)


def check_manifest(out: Path, identity: dict) -> None:
    """Write `out/run.json` for a new output folder; for one that has it, refuse a run of another identity (its
    records would be reused as this run's answers) unless the folder holds no records yet (the run that wrote it
    failed before computing anything). A folder from before manifests (results, no run.json) gets one."""
    path = out / MANIFEST
    if path.exists():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(old, dict):
                raise ValueError(f"a JSON {type(old).__name__}, not an object")
        except (json.JSONDecodeError, UnicodeDecodeError, OSError, ValueError) as e:
            raise ValueError(f"{path}: unreadable ({e}); delete it to go on writing to {out}") from None
        diffs, added = [], False
        # (what the run is first: method, model, retriever, corpus, decoding; the config's fields after them)
        keys = [k for k in identity if k != "config"] + sorted(set(old) - set(identity) - {"config"}) + ["config"]
        for k in keys:
            a, b = old.get(k), identity.get(k)
            if a == b:
                continue
            if k == "seed" and not old.get("temperature") and not identity.get("temperature"):
                continue  # greedy decoding draws nothing: its answers do not depend on the seed
            if k in LATER_KEYS and k not in old:  # a manifest written before the key existed: it gets it below
                added = True
                continue
            if k == "config" and isinstance(a, dict) and isinstance(b, dict):
                diffs += [f"config.{f}: {a.get(f)!r} there, {b.get(f)!r} now"
                          for f in sorted(set(a) | set(b)) if a.get(f) != b.get(f)]
            else:
                diffs.append(f"{k}: {a!r} there, {b!r} now")
        if diffs and not holds_records(out):  # a run that stopped before computing anything (a bad model path,
            # corpus or config): the corrected run takes the folder over
            added = True
        elif diffs:
            more = f"; and {len(diffs) - 4} more" if len(diffs) > 4 else ""
            raise ValueError(f"{out} holds the results of another run ({'; '.join(diffs[:4])}{more}): use another "
                             f"--output (or delete {path} to add this run's records to that folder anyway)")
        if not added:
            return
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(identity, indent=2))
    tmp.replace(path)


def _where_they_differ(a: str, b: str, before: int = 30, after: int = 50) -> tuple[str, str]:
    """Excerpts of two different texts around their first difference ("..." where cut), so that an error shows
    what differs even in long texts with a common start."""
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    start = max(0, i - before)

    def cut(t: str) -> str:
        return ("..." if start else "") + t[start:i + after] + ("..." if len(t) > i + after else "")

    return cut(a), cut(b)


def latest_records(path: Path, examples: list[Example], repair: bool = False,
                   records: list[QuestionResult] | None = None) -> list[QuestionResult]:
    """The last record of each of `examples` in a results file, in the examples' order (records of other questions
    are left out). An answer whose question is not the example's of that id raises: the folder holds answers to
    other data (e.g. an NQ file whose position-derived ids shifted when a question was added). An error record
    holds no answer: when its question has changed since (an empty question filled in), it is only computed again,
    and records that a later one of the same question replaced are not checked. `records`: the file's records
    when the caller has read them already."""
    by_id = {e.qid: e for e in examples}
    latest: dict[str, tuple[int, QuestionResult]] = {}
    for line, r in enumerate(read_results(path, repair=repair) if records is None else records, 1):
        if r.qid in by_id:
            latest[r.qid] = (line, r)
    for qid, (line, r) in latest.items():
        e = by_id[qid]
        if r.error is None and r.question != e.question:
            there, here = _where_they_differ(r.question, e.question)
            raise ValueError(f"{path}: line {line}: question {r.qid!r} reads {there!r} there but {here!r} in the "
                             "data: these results come from other data; use another --output")
    return [latest[e.qid][1] for e in examples if e.qid in latest]


def resume(path: Path, examples: list[Example]) -> tuple[list[QuestionResult], list[Example]]:
    """(records to keep, examples to compute) for a rerun into a results file (under the folder's lock: a torn
    tail is cut): a question is computed again when it has no record or its last record is an error (a retriever
    down, a pool too small: the cause may be gone). Kept records are scored again against the examples' current
    gold answers (a corrected data file changes the metrics of answers already computed). The file is left with
    one record per question: the error records of the questions computed again, and records replaced by a later
    one of their question (written by older versions), are removed (the file is rewritten only then)."""
    records = read_results(path, repair=True)
    latest = latest_records(path, examples, records=records)
    kept = [r for r in latest if r.error is None]
    by_id = {e.qid: e for e in examples}
    rescored = {}
    for r in kept:
        before = (r.gold, r.metrics)
        r.gold = list(by_id[r.qid].answers)
        score_result(by_id[r.qid], r)
        if (r.gold, r.metrics) != before:
            rescored[r.qid] = r
    drop = {r.qid for r in latest if r.error is not None}
    if rescored or drop or len({r.qid for r in records}) != len(records):  # (else the file stays as it is)
        _rewrite_records(path, rescored, drop)
    have = {r.qid for r in kept}
    return kept, [e for e in examples if e.qid not in have]


def _record_line(r: QuestionResult) -> str:
    line = json.dumps(r.to_json(), ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" in the data): JSON escapes carry it exactly
        line = json.dumps(r.to_json(), ensure_ascii=True)
    return line


def _rewrite_records(path: Path, records: dict[str, QuestionResult], drop: set[str]) -> None:
    """Keep the last record of each question, replaced by `records[qid]` where given (a resume rescored it against
    new gold answers, so that results.jsonl agrees with metrics.json) and removed for the questions in `drop`; the
    file is replaced whole (a crash leaves the old one)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    qids = [json.loads(line)["qid"] if line.strip() else None for line in lines]
    last = {qid: i for i, qid in enumerate(qids) if qid is not None}
    out = []
    for i, (line, qid) in enumerate(zip(lines, qids)):
        if qid is None:
            out.append(line)  # (the empty string after the last newline)
        elif last[qid] == i and qid not in drop:
            out.append(_record_line(records[qid]) if qid in records else line)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(out))
        f.flush()
        os.fsync(f.fileno())
    shutil.copymode(path, tmp)  # (a group-writable results file in a shared folder stays so)
    os.replace(tmp, path)


class ResultWriter:
    def __init__(self, path: Path):
        self.f = open(path, "a", encoding="utf-8")

    def write(self, r: QuestionResult) -> None:
        self.f.write(_record_line(r) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self):
        self.f.close()


def sampling_of(opts: RunOptions):
    """The engine's SamplingParams for a run's --temperature / --top-k / --top-p / --seed."""
    from fastrag.engine import SamplingParams

    return SamplingParams(temperature=opts.temperature, top_p=opts.top_p, seed=opts.seed, top_k=opts.top_k)


def build_engine(model: str, batch_size: int, signals: str | None = None, kv_cache_gb: float | None = None,
                 device: str | None = None, dtype: torch.dtype | None = None, sampling=None,
                 prefix_caching: bool = True):
    """sampling: fastrag.engine.SamplingParams (None: greedy)."""
    from fastrag.engine import Engine
    from fastrag.model.llama import LlamaModel
    from fastrag.model.loading import load_tokenizer, resolve_model

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    tok = load_tokenizer(model)
    m = LlamaModel.from_pretrained(resolve_model(model), dtype=dtype, device=device)
    if kv_cache_gb is None and torch.device(device).type == "cpu":
        kv_cache_gb = 8.0
    return Engine(m, tok, max_batch=batch_size, kv_cache_gb=kv_cache_gb, signals=signals, sampling=sampling,
                  prefix_caching=prefix_caching)


def make_policy(method: str, cfg, tokenizer):
    from fastrag.methods.registry import get_method

    return get_method(method).make_policy(cfg, tokenizer)


def score_result(ex: Example, r: QuestionResult) -> None:
    if r.error is None:
        r.metrics = score(ex, r.prediction)


def summarize(opts_method: str, dataset: str, results: list[QuestionResult], wall_s: float, computed: int,
              tokens: int, answered: int) -> dict:
    """The metrics of `results`; `computed` of them were computed in this run's `wall_s`, `answered` of those
    without an error: questions_per_s counts the answered ones (a question that fails at once is no throughput)."""
    ok = [r for r in results if r.error is None]
    agg = aggregate([r.metrics for r in ok]) if ok else {}
    return {
        "method": opts_method, "dataset": dataset, "n": len(results), "errors": len(results) - len(ok),
        "em": agg.get("em"), "f1": agg.get("f1"), "accuracy": agg.get("accuracy"),
        # (None when this run computed nothing: no rate was measured; a rerun keeps the earlier run's figures)
        "questions_per_s": answered / wall_s if computed and wall_s > 0 else None,
        "tokens_per_s": tokens / wall_s if computed and wall_s > 0 else None,
        "retrievals_per_question": sum(r.retrievals for r in ok) / len(ok) if ok else None,
        "prefill_tokens_per_question": sum(r.prefill_tokens for r in ok) / len(ok) if ok else None,
        "decode_tokens_per_question": sum(r.decode_tokens for r in ok) / len(ok) if ok else None,
        "wall_s": wall_s, "computed_this_run": computed,
        "questions_measured": answered,  # (the questions behind the rates; carried over with them by a rerun)
        # per-question counters of the policies (QuestionResult.counters), averaged over answered questions
        # (only counters some record carries: a method that keeps none must not report zeros)
        **{f"{k}_per_question": sum(r.counters.get(k, 0) for r in ok) / len(ok)
           for k in ("reused_prompt_tokens", "reused_generations", "generate_calls", "searches", "retrieval_wait_s",
                     "short_retrievals")
           if any(k in r.counters for r in ok)},
    }


def _write_progress(out: Path, computed: int, answered: int, wall_s: float) -> None:
    """How far the current run got (questions finished, those of them without an error, seconds since it started
    computing): a run killed before its end (a machine taken back) still counts in the rate over all runs of the
    directory."""
    tmp = out / "progress.json.tmp"
    tmp.write_text(json.dumps({"computed": computed, "answered": answered, "wall_s": wall_s}))
    tmp.replace(out / "progress.json")


def _close_progress(out: Path) -> dict:
    """Move the last run's progress into DIR/runs.jsonl (one line per run that computed something) and return the
    totals over all runs: {"runs", "computed", "answered", "wall_s", "questions_per_s"}. The rate counts answered
    questions, as `questions_per_s` of one run does (a line written before runs recorded `answered` counts all its
    computed ones). A killed run counts up to its last finished question (the work in flight when it died is not
    counted, and neither is its lost time)."""
    prog, hist = out / "progress.json", out / "runs.jsonl"
    text = hist.read_text() if hist.exists() else ""
    if prog.exists():
        try:
            rec = json.loads(prog.read_text())
            if rec.get("computed", 0) > 0:
                # (a line torn by a full disk must not swallow this one: it starts a line of its own)
                row = "\n" * (text[-1:] not in ("", "\n")) + json.dumps(rec) + "\n"
                with hist.open("a") as f:
                    f.write(row)
                text += row
        except (json.JSONDecodeError, OSError):
            pass  # a torn progress file: that run's time is lost, its results are not
        prog.unlink(missing_ok=True)
    recs = []
    for n, line in enumerate(text.splitlines(), 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            rec = None
        if _is_run_record(rec):
            recs.append(rec)
        elif line.strip():
            warnings.warn(f"{hist}: line {n} is not a run record ({line[:60]!r}); its run is left out of all_runs",
                          RuntimeWarning, stacklevel=2)
    computed = sum(r["computed"] for r in recs)
    answered = sum(r.get("answered", r["computed"]) for r in recs)
    wall = sum(r["wall_s"] for r in recs)
    return {"runs": len(recs), "computed": computed, "answered": answered, "wall_s": wall,
            "questions_per_s": answered / wall if wall > 0 else None}


def _is_run_record(rec) -> bool:
    """A line of runs.jsonl as _close_progress writes it: numbers for computed and wall_s (and answered, which lines
    written before it was recorded lack)."""
    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0

    return isinstance(rec, dict) and number(rec.get("computed")) and number(rec.get("wall_s")) \
        and number(rec.get("answered", 0))


def run(opts: RunOptions, engine=None, retriever=None) -> dict:
    """Run a method over a dataset; returns the metrics dict (also written to DIR/metrics.json)."""
    return run_many([opts], engine=engine, retriever=retriever)[0]


@contextlib.contextmanager
def output_lock(out: Path):
    """Hold `out/.lock` for the length of a run: a second process writing the same folder at once would append
    every question again. It fails at once, naming the folder. (Where fcntl is missing, nothing is locked.)

    A run that fails before its first record (a refused config, a missing model) leaves no folder it created
    behind: the folders made here are removed again when they hold nothing but the lock, `run.json` and an empty
    `results.jsonl`."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on Linux/macOS
        yield
        return
    try:
        made = [d for d in (out, *out.parents) if not d.exists()]  # created here, deepest first
        out.mkdir(parents=True, exist_ok=True)
        lock = open(out / ".lock", "a")
    except OSError as e:  # ([Errno 2] No such file or directory, for --output /proc/x, named neither)
        raise OSError(f"--output {out}: cannot make or write the folder ({e.strerror or e}); give --output a folder "
                      "this user can create and write, e.g. under the current directory") from None
    with lock as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"another process is writing to {out}: wait for it to finish, or use another "
                             "--output") from None
        try:
            yield
        except BaseException:
            if made:  # (still holding the lock: a process that opened it meanwhile is refused, not let in)
                _remove_unused(made)
            raise
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_unused(made: list[Path]) -> None:
    """Remove the run folder made[0] if it holds only the lock, run.json and an empty results.jsonl, then each
    parent in `made` left empty; stop at the first that holds anything else."""
    out = made[0]
    try:
        names = {p.name for p in out.iterdir()}
        if not names <= {".lock", "run.json", "results.jsonl"} or (
                "results.jsonl" in names and (out / "results.jsonl").stat().st_size):
            return
        for name in ("results.jsonl", "run.json", ".lock"):
            (out / name).unlink(missing_ok=True)
        for d in made:
            d.rmdir()
    except OSError:  # something appeared meanwhile (another process's lock or records): it stays
        return


def run_many(runs: list[RunOptions], engine=None, retriever=None) -> list[dict]:
    """Several (method, dataset) runs served together by one engine: their questions share the decode batch.

    Each run keeps its own output directory (results.jsonl written as questions finish, resumable; metrics.json
    at the end). A question's decode steps no longer wait for questions of its own run alone: when one run would
    leave the batch mostly empty (its last, longest questions), the others fill it. The runs must share model,
    corpus and engine settings (taken from the first). Each metrics.json carries the joint figures under
    `joint`: all runs' questions over the one wall clock. Each output directory is locked while the runs go.
    """
    if not runs:
        raise ValueError("run_many: no runs given")
    outs = [Path(o.output) for o in runs]
    same = [(a, b) for i, a in enumerate(outs) for b in outs[i + 1:] if a.resolve() == b.resolve()]
    if same:
        raise ValueError(f"run_many: two runs write to the same output directory ({same[0][0]} and {same[0][1]})")
    for out in outs:
        try:
            out.stat()
        except FileNotFoundError:
            continue  # (made below)
        except OSError as e:
            raise OSError(f"--output {out}: {path_problem(e)}") from None
        if not out.is_dir():
            raise ValueError(f"--output {out}: is a file, expected a directory")
    with contextlib.ExitStack() as held:
        for out in outs:
            held.enter_context(output_lock(out))
        return _run_many(runs, engine, retriever)


def _run_many(runs: list[RunOptions], engine=None, retriever=None) -> list[dict]:
    from tqdm import tqdm

    from fastrag.retrieval import make_retriever
    from fastrag.loop import QuestionLoop
    from fastrag.text.pool import auto_text_workers

    source_commit()  # the commit of the code this run loaded (fastrag.provenance), before anything can change it
    switch_interval_setting()  # (a bad $FASTRAG_SWITCH_INTERVAL fails here, before the model loads)
    first = runs[0]
    for o in runs[1:]:
        for f in ("model", "corpus", "retriever", "batch_size", "signals", "kv_cache_gb", "prefix_caching",
                  "temperature", "top_p", "top_k", "seed", "overlap", "text_workers", "search_concurrency"):
            if getattr(o, f) != getattr(first, f):
                raise ValueError(f"run_many: runs must share --{f.replace('_', '-')}: {getattr(first, f)!r} "
                                 f"({first.dataset}) vs {getattr(o, f)!r} ({o.dataset})")
    outs = [Path(o.output) for o in runs]
    if first.threads:
        torch.set_num_threads(first.threads)
    plans = []  # per run: (opts, cfg, examples by id, done, todo)
    for o, out in zip(runs, outs):
        cfg = method_config(o)
        examples = load_examples(o.dataset, o.data, limit=o.limit, answer_aliases=o.answer_aliases)
        examples = select_qids(examples, o)
        out.mkdir(parents=True, exist_ok=True)
        check_manifest(out, run_identity(o, cfg))
        done, todo = resume(out / "results.jsonl", examples)
        plans.append((o, cfg, {e.qid: e for e in examples}, done, todo))

    for out in outs:  # a run interrupted before its end left its progress: it joins the history
        _close_progress(out)
    t0 = time.perf_counter()
    news: list[list[QuestionResult]] = [[] for _ in runs]
    answered = [0] * len(runs)
    sched = None
    step_trace = None
    kernel_profile = None
    launch_profile = None
    tok0 = 0
    captured_ahead, capture_ahead_s = 0, 0.0
    compile_log, compile_mark = None, 0
    if any(p[4] for p in plans):
        engine = engine or build_engine(first.model, first.batch_size, first.signals, first.kv_cache_gb,
                                        sampling=sampling_of(first), prefix_caching=first.prefix_caching)
        retriever = retriever or make_retriever(first.retriever, corpus_path=first.corpus,
                                                show_progress=first.progress)
        policies = [make_policy(o.method, cfg, engine.tok) for o, cfg, *_ in plans]
        _warn_control_tokens(plans, engine.tok)
        t0 = time.perf_counter()  # (the shared demo prefixes are part of the run's work and of its clock)
        for pol in policies:
            try:
                engine.set_prefix(pol.shared_prefix)
            except OutOfBlocks as e:  # its questions compute the demos in their own blocks (or fail one by one)
                warnings.warn(f"no room for a shared demo prefix ({e}); its questions run without one",
                              RuntimeWarning, stacklevel=2)
        # the decode graphs of these prefixes, captured once per engine like its loading and outside the clock (a
        # step that captures one inside the run waits tens of milliseconds: 36-43 of them took 5.3-7.3 s of a
        # 20-26 s DRAGIN run of 128 questions on the H200 of 2026-11-26c)
        t_cap = time.perf_counter()
        captured_ahead = engine.capture_graphs() if hasattr(engine, "capture_graphs") else 0
        capture_ahead_s = time.perf_counter() - t_cap
        t0 += capture_ahead_s
        tok0 = engine.stats["prefill_tokens"] + engine.stats["decode_tokens"]
        compile_log = triton_compile_log()  # Triton compiles inside the clock (metrics.json `triton_compiles`)
        compile_mark = compile_log.mark() if compile_log is not None else 0
        writers = [ResultWriter(out / "results.jsonl") for out in outs]
        which: dict[int, int] = {}  # id(example) -> run index
        todo = []
        for i, p in enumerate(plans):
            for e in p[4]:
                which[id(e)] = i
                todo.append(e)
        desc = runs[0].method + "/" + "+".join(o.dataset for o in runs)
        bar = tqdm(total=len(todo), desc=desc, unit="q", disable=not first.progress)

        def on_result(r: QuestionResult, ex):
            i = which[id(ex)]
            score_result(ex, r)
            writers[i].write(r)
            news[i].append(r)
            answered[i] += r.error is None
            _write_progress(outs[i], len(news[i]), answered[i], time.perf_counter() - t0)
            bar.update(1)

        trace = env_switch(STEP_TRACE_ENV)
        if trace:  # the engine's per-step rows ($FASTRAG_STEP_TRACE=1), written beside the results below
            engine.trace = []
        launch_prof = env_switch(LAUNCH_PROFILE_ENV) and hasattr(engine, "step_launch")
        if launch_prof:  # ($FASTRAG_LAUNCH_PROFILE=1) cProfile over every step launch (fastrag.launch_profile)
            engine.launch_profile = LaunchProfile()
        window = kernel_profile_window()
        if window is not None:  # ($FASTRAG_KERNEL_PROFILE=FIRST:COUNT) torch.profiler over those engine steps
            engine.kernel_window = StepWindow(*window, getattr(engine, "device", "cpu"))
        try:
            # text workers not given: as many as the host's cores spare on a GPU, none on a CPU
            text_workers = first.text_workers
            if text_workers is None:
                text_workers = auto_text_workers(getattr(engine, "device", "cpu"), cpus=first.text_worker_cpus)
            # twice the decode batch in flight: questions waiting on attention passes or retrieval do not
            # leave holes in the decode batch
            sched = QuestionLoop(engine, retriever, lambda ex: policies[which[id(ex)]](ex),
                              max_inflight=2 * first.batch_size, overlap=first.overlap,
                              text_workers=text_workers, search_concurrency=first.search_concurrency)
            sched.run(todo, on_result, pass_example=True)
        finally:
            bar.close()
            for w in writers:
                w.close()
            if compile_log is not None:
                compile_log.row = None
            if window is not None:
                kernel_profile = engine.kernel_window.finish(engine.stats)
                engine.kernel_window = None
                for out in outs:
                    write_json(out / "kernel_profile.json", {"window": list(window), "profile": kernel_profile})
            if launch_prof:
                lp, engine.launch_profile = engine.launch_profile, None
                launch_profile = lp.summary() | {"folder": "launch_profile"}
                for out in outs:  # (each kind's full statistics: python -m pstats FILE)
                    lp.dump(out / "launch_profile")
            if trace:
                rows, engine.trace = engine.trace or [], None
                for out in outs:  # (one engine ran every run's questions: each run's folder gets the steps)
                    with open(out / "step_trace.jsonl", "w") as f:
                        f.writelines(json.dumps(r) + "\n" for r in rows)
                step_trace = trace_summary(rows) | {"file": "step_trace.jsonl"}
        tokens = engine.stats["prefill_tokens"] + engine.stats["decode_tokens"] - tok0
    else:
        tokens = 0
    wall = time.perf_counter() - t0
    computed = sum(len(n) for n in news)
    out_metrics = []
    for (o, _cfg, _ex, done, _todo), new, out in zip(plans, news, outs):
        # tokens are counted by the engine for all runs together: each run gets its own records' share
        own_tokens = sum(r.prefill_tokens + r.decode_tokens for r in new)
        metrics = summarize(o.method, o.dataset, done + new, wall, len(new),
                            tokens if len(runs) == 1 else own_tokens, sum(r.error is None for r in new))
        if len(runs) > 1:
            metrics["joint"] = {"runs": [f"{x.method}/{x.dataset}" for x in runs], "wall_s": wall,
                                "computed_this_run": computed,
                                # (answered ones, as each run's questions_per_s: a failed question is no throughput)
                                "questions_per_s": sum(answered) / wall if wall > 0 else None,
                                "tokens_per_s": tokens / wall if wall > 0 else None}
        sp = engine.sampling if engine is not None else sampling_of(o)  # what really decoded (a caller's engine)
        metrics["sampling"] = {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k, "seed": sp.seed}
        if engine is not None:
            metrics["engine"] = dict(engine.stats)
            metrics["kv_cache_gb"] = engine.kv_cache_gb
            metrics["kv_cache_blocks"] = engine.pool.num_blocks  # (engine.kv_peak_blocks: the most held at once)
            from fastrag.model.llama import LlamaModel
            from fastrag.perf import model_costs

            if isinstance(getattr(engine, "model", None), LlamaModel):  # for the device floor (fastrag.perf)
                metrics["model_costs"] = model_costs(engine.model)
                # how prefills attended to the shared prefix: the cascade's switch, and per device and dtype its
                # self-check ("on", or "off: why"); the paged prefill kernel's switch and self-checks likewise
                metrics["prefill_attention"] = {"cascade": engine.model.cascade_prefill,
                                                "checks": dict(engine.model.cascade_checks),
                                                "paged_kernel": engine.model.uses_paged_prefill(engine.device,
                                                                                                engine.dtype),
                                                "paged_checks": dict(engine.model.paged_prefill_checks)}
            # Triton compiles (JIT cache misses) between the clock's start and the end of the run, by kernel: each
            # stops the host for about a second (fastrag.kernels.compiles)
            if compile_log is None:  # (no question computed: nothing ran inside the clock)
                compile_log = triton_compile_log()
                compile_mark = compile_log.mark() if compile_log is not None else 0
            metrics["triton_compiles"] = compile_log.report(compile_mark) if compile_log is not None else \
                {"hooked": False, "why_not": "no Triton here", "count": 0, "kernels": {}}
            graphs = getattr(engine, "graphs", None)
            if graphs is not None:  # decode steps replayed vs launched eagerly, graphs captured
                # captured_ahead / capture_ahead_s: graphs captured before the run's clock (Engine.capture_graphs);
                # "captures" counts those too (and an engine the caller passed in, its earlier runs' captures), so
                # on an engine built by this run captures - captured_ahead were captured by the run's steps
                metrics["cuda_graphs"] = dict(graphs.stats) | {"graphs": len(graphs.graphs),
                                                               "disabled": graphs.disabled,
                                                               "table_width_blocks": graphs.width,
                                                               "captured_ahead": captured_ahead,
                                                               "capture_ahead_s": capture_ahead_s}
            for name in ("prefill_graphs", "pass_graphs"):  # calls replayed from graphs vs run eagerly
                pg = getattr(engine, name, None)  # (their captures ahead in the stats)
                if pg is not None:
                    metrics[name] = dict(pg.stats) | {"graphs": len(pg.graphs), "disabled": pg.disabled,
                                                      "applies": pg.applies(), "token_buckets": pg.buckets,
                                                      "max_seqs": pg.max_seqs}
        metrics["all_runs"] = _close_progress(out)
        if sched is not None:  # retrieval batches of this run: how many queries went to the retriever together
            b = sched.search_batches
            metrics["retrieval"] = {"batches": len(b), "queries": sum(b), "max_batch_size": max(b, default=0),
                                    "mean_batch_size": sum(b) / len(b) if b else None,
                                    "seconds": sched.search_seconds, "concurrency": sched.search_concurrency,
                                    "seconds_per_batch": sched.search_seconds / len(b) if b else None}
            # where the wall time went (host seconds; engine = prefill_s + decode_s of "engine" above, plus the
            # step's bookkeeping); retrieval runs in a worker thread, beside these
            metrics["step_seconds"] = dict(sched.step_seconds)
            metrics["overlap"] = sched.overlap
            if step_trace is not None:
                metrics["step_trace"] = step_trace
            if kernel_profile is not None:  # ($FASTRAG_KERNEL_PROFILE) the profiled steps' time by part
                metrics["kernel_profile"] = kernel_profile
            if launch_profile is not None:  # ($FASTRAG_LAUNCH_PROFILE) the launches' host time by function
                metrics["launch_profile"] = launch_profile
            if sched.sync_watch is not None:  # ($FASTRAG_SYNC_WATCH) host calls that waited for the device in the
                metrics["overlap_syncs"] = sched.sync_watch.summary()  # overlap window, by call site
            elif sched.sync_watch_off is not None:
                metrics["overlap_syncs"] = {"off": sched.sync_watch_off}
            # spaCy texts sent to worker processes (0 workers: all run on the scheduler's thread)
            # (chosen: "auto" when the run chose the count, auto_text_workers; "given" when it was told)
            metrics["text_workers"] = {"workers": sched.text_workers, "texts": sched.text_requests,
                                       "lockstep": sched.text_lockstep,
                                       "chosen": "auto" if first.text_workers is None else "given"}
            if sched.text_groups:  # ($FASTRAG_TEXT_GROUPS) a step's texts sent together, not waited for
                sizes = sched.text_group_sizes
                metrics["text_workers"]["groups"] = {"sent": len(sizes), "texts": sum(sizes),
                                                     "largest": max(sizes, default=0)}
        if new:  # where and with what the figures were measured (fastrag.provenance)
            metrics["environment"] = environment(getattr(engine, "device", None))
        else:  # nothing computed now: the throughput and engine figures (and their environment) stay those of the
            # last run that did
            metrics |= measured_fields(out / "metrics.json")
        write_json(out / "metrics.json", metrics)
        out_metrics.append(metrics)
    return out_metrics


# metrics.json fields measured while computing (not derived from the records): a rerun that computes nothing keeps
# them from the run before it, so `python -m fastrag.perf DIR` and the throughput still describe a real run
MEASURED_FIELDS = ("questions_per_s", "tokens_per_s", "wall_s", "questions_measured", "engine", "kv_cache_gb",
                   "kv_cache_blocks",
                   "model_costs", "prefill_attention", "cuda_graphs", "retrieval", "step_seconds", "overlap",
                   "text_workers", "joint", "environment", "overlap_syncs", "step_trace", "triton_compiles",
                   "kernel_profile", "launch_profile")


def triton_compile_log():
    """fastrag.kernels.compiles.COMPILES with its hook on; None without Triton."""
    try:
        from fastrag.kernels.compiles import COMPILES
    except ImportError:
        return None
    COMPILES.install()
    return COMPILES


def _warn_control_tokens(plans, tok) -> None:
    """Warn, per data file, of questions to run that hold one of the model's control-token strings.

    Batch runs tokenize prompts as the published code does, which reads e.g. "<|im_end|>" in a question as that
    token (it can end or restructure the method's prompt); `fastrag serve` refuses such a question instead."""
    specials = control_token_strings(tok)
    for o, _cfg, _examples, _done, todo in plans:
        held = [(e.qid, hit) for e in todo if (hit := find_control_token(e.question, specials)) is not None]
        if held:
            qid, (t, at) = held[0]
            warnings.warn(f"{o.data}: {len(held)} question(s) hold a control-token string of the model (first: "
                          f"{qid!r} holds {t!r} at character {at}); they are tokenized as the published code "
                          "tokenizes them, which reads the string as that token, not as text", UserWarning,
                          stacklevel=3)


def write_json(path: Path, obj: dict, **kw) -> None:
    """Write a JSON file through a temporary file and a rename: a run killed while writing leaves the old file
    whole (a torn metrics.json would lose the figures that a rerun computing nothing carries over)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, **kw), encoding="utf-8")
    tmp.replace(path)


def read_metrics(path: Path) -> dict | None:
    """A metrics.json as a dict; None when it is missing, unreadable or not a JSON object."""
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return old if isinstance(old, dict) else None


def measured_fields(path: Path, extra: tuple[str, ...] = ()) -> dict:
    """The MEASURED_FIELDS (and `extra`) of the metrics.json at `path`, marked measured_in_an_earlier_run, for a
    rerun that computes nothing; {} when that file describes no run that computed something."""
    old = read_metrics(path)
    if old is None or not (old.get("computed_this_run") or old.get("measured_in_an_earlier_run")):
        return {}
    return {k: old[k] for k in MEASURED_FIELDS + extra if k in old} | {"measured_in_an_earlier_run": True}
