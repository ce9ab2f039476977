"""The results store of a batch evaluation: results.jsonl written incrementally, resumed, the run folder's manifest,
lock, progress and metrics files.

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
import hashlib
import json
import math
import os
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from fastrag.data.datasets import Example
from fastrag.eval.report import score_result
from fastrag.trace import QuestionResult, holds_records

if TYPE_CHECKING:
    from fastrag.eval.options import RunOptions


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
             **encoder(), **({"top_k": int(opts.top_k)} if opts.top_k else {}),
             **({"retriever_options": dict(opts.retriever_options)} if opts.retriever_options else {}), **more}
    # (top_k, retriever_options: only when given, so folders written before they existed keep their identity)
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



def write_progress(out: Path, computed: int, answered: int, wall_s: float) -> None:
    """How far the current run got (questions finished, those of them without an error, seconds since it started
    computing): a run killed before its end (a machine taken back) still counts in the rate over all runs of the
    directory."""
    tmp = out / "progress.json.tmp"
    tmp.write_text(json.dumps({"computed": computed, "answered": answered, "wall_s": wall_s}))
    tmp.replace(out / "progress.json")


def close_progress(out: Path) -> dict:
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
        if is_run_record(rec):
            recs.append(rec)
        elif line.strip():
            warnings.warn(f"{hist}: line {n} is not a run record ({line[:60]!r}); its run is left out of all_runs",
                          RuntimeWarning, stacklevel=2)
    computed = sum(r["computed"] for r in recs)
    answered = sum(r.get("answered", r["computed"]) for r in recs)
    wall = sum(r["wall_s"] for r in recs)
    return {"runs": len(recs), "computed": computed, "answered": answered, "wall_s": wall,
            "questions_per_s": answered / wall if wall > 0 else None}


def is_run_record(rec) -> bool:
    """A line of runs.jsonl as close_progress writes it: numbers for computed and wall_s (and answered, which lines
    written before it was recorded lack)."""
    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0

    return isinstance(rec, dict) and number(rec.get("computed")) and number(rec.get("wall_s")) \
        and number(rec.get("answered", 0))



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
                remove_unused(made)
            raise
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def remove_unused(made: list[Path]) -> None:
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



# metrics.json fields measured while computing (not derived from the records): a rerun that computes nothing keeps
# them from the run before it, so `python -m fastrag.perf DIR` and the throughput still describe a real run
MEASURED_FIELDS = ("questions_per_s", "tokens_per_s", "wall_s", "questions_measured", "engine", "kv_cache_gb",
                   "kv_cache_blocks",
                   "model_costs", "prefill_attention", "cuda_graphs", "retrieval", "step_seconds", "overlap",
                   "text_workers", "joint", "environment", "overlap_syncs", "step_trace", "triton_compiles",
                   "kernel_profile", "launch_profile")



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
