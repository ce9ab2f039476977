"""Batch evaluation: run a method over a dataset, write results.jsonl incrementally, resume, score.

`DIR/results.jsonl` gets one line per finished question (flushed and fsynced as it finishes), so a killed run
loses at most the questions in flight; a rerun reads the file, skips every question already there and computes
only the rest. `DIR/metrics.json` is rewritten at the end from all records.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fastrag.data.datasets import Example, load_examples
from fastrag.data.metrics import aggregate, score
from fastrag.trace import QuestionResult

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
    kv_cache_gb: float = 8.0
    threads: int | None = None
    progress: bool = True

    def __post_init__(self):
        from fastrag.methods.registry import get_method

        get_method(self.method)  # raises with the list of available methods
        if self.batch_size <= 0:
            raise ValueError(f"--batch-size must be positive, got {self.batch_size}")
        if self.limit is not None and self.limit <= 0:
            raise ValueError(f"--limit must be positive, got {self.limit}")
        for name in ("data", "corpus"):
            p = Path(getattr(self, name))
            if not p.is_file():
                raise FileNotFoundError(f"--{name} {p}: no such file")
            if not os.access(p, os.R_OK):
                raise PermissionError(f"--{name} {p}: not readable")


def method_config(opts: RunOptions):
    from fastrag.methods.registry import get_method

    return get_method(opts.method).make_config(opts.dataset, opts.config)


def read_results(path: Path) -> list[QuestionResult]:
    """Records already written; a torn last line (the run was killed mid-write) is dropped from the file."""
    if not path.exists():
        return []
    out, good_bytes = [], 0
    with open(path, "rb") as f:
        for raw in f:
            try:
                rec = QuestionResult.from_json(json.loads(raw))
            except (json.JSONDecodeError, TypeError, KeyError):
                if raw.endswith(b"\n"):
                    raise ValueError(f"{path}: line {len(out) + 1} is not a result record; "
                                     "remove it or use another --output") from None
                break  # torn tail
            out.append(rec)
            good_bytes += len(raw)
    if good_bytes != path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good_bytes)
    return out


class ResultWriter:
    def __init__(self, path: Path):
        self.f = open(path, "a", encoding="utf-8")

    def write(self, r: QuestionResult) -> None:
        self.f.write(json.dumps(r.to_json(), ensure_ascii=False) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self):
        self.f.close()


def build_engine(model: str, batch_size: int, signals: str | None = None, kv_cache_gb: float = 8.0,
                 device: str | None = None, dtype: torch.dtype | None = None):
    from fastrag.engine import Engine
    from fastrag.model.llama import LlamaModel
    from fastrag.model.loading import load_tokenizer, resolve_model

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    tok = load_tokenizer(model)
    m = LlamaModel.from_pretrained(resolve_model(model), dtype=dtype, device=device)
    return Engine(m, tok, max_batch=batch_size, kv_cache_gb=kv_cache_gb, signals=signals)


def make_policy(method: str, cfg, tokenizer):
    from fastrag.methods.registry import get_method

    return get_method(method).make_policy(cfg, tokenizer)


def score_result(ex: Example, r: QuestionResult) -> None:
    if r.error is None:
        r.metrics = score(ex, r.prediction)


def summarize(opts_method: str, dataset: str, results: list[QuestionResult], wall_s: float, computed: int,
              tokens: int) -> dict:
    ok = [r for r in results if r.error is None]
    agg = aggregate([r.metrics for r in ok]) if ok else {}
    return {
        "method": opts_method, "dataset": dataset, "n": len(results), "errors": len(results) - len(ok),
        "em": agg.get("em"), "f1": agg.get("f1"), "accuracy": agg.get("accuracy"),
        "questions_per_s": computed / wall_s if wall_s > 0 else None,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "retrievals_per_question": sum(r.retrievals for r in ok) / len(ok) if ok else None,
        "prefill_tokens_per_question": sum(r.prefill_tokens for r in ok) / len(ok) if ok else None,
        "decode_tokens_per_question": sum(r.decode_tokens for r in ok) / len(ok) if ok else None,
        "wall_s": wall_s, "computed_this_run": computed,
        # per-question counters of the policies (QuestionResult.counters), averaged over answered questions
        # (only counters some record carries: a method that keeps none must not report zeros)
        **{f"{k}_per_question": sum(r.counters.get(k, 0) for r in ok) / len(ok)
           for k in ("reused_prompt_tokens", "generate_calls", "retrieval_wait_s", "short_retrievals")
           if any(k in r.counters for r in ok)},
    }


def run(opts: RunOptions, engine=None, retriever=None) -> dict:
    """Run a method over a dataset; returns the metrics dict (also written to DIR/metrics.json)."""
    from tqdm import tqdm

    from fastrag.retrieval.bm25 import BM25Retriever
    from fastrag.scheduler import Scheduler

    if opts.threads:
        torch.set_num_threads(opts.threads)
    out = Path(opts.output)
    out.mkdir(parents=True, exist_ok=True)
    cfg = method_config(opts)
    examples = load_examples(opts.dataset, opts.data, limit=opts.limit)
    res_path = out / "results.jsonl"
    done = read_results(res_path)
    done_ids = {r.qid for r in done}
    todo = [e for e in examples if e.qid not in done_ids]
    by_id = {e.qid: e for e in examples}

    t0 = time.perf_counter()
    new: list[QuestionResult] = []
    sched = None
    if todo:
        engine = engine or build_engine(opts.model, opts.batch_size, opts.signals, opts.kv_cache_gb)
        retriever = retriever or BM25Retriever(opts.corpus)
        policy = make_policy(opts.method, cfg, engine.tok)
        engine.set_prefix(policy.shared_prefix)
        tok0 = engine.stats["prefill_tokens"] + engine.stats["decode_tokens"]
        writer = ResultWriter(res_path)
        bar = tqdm(total=len(todo), desc=f"{opts.method}/{opts.dataset}", unit="q", disable=not opts.progress)
        t0 = time.perf_counter()

        def on_result(r: QuestionResult):
            score_result(by_id[r.qid], r)
            writer.write(r)
            new.append(r)
            bar.update(1)

        try:
            # twice the decode batch in flight: questions waiting on attention passes or retrieval do not
            # leave holes in the decode batch
            sched = Scheduler(engine, retriever, policy, max_inflight=2 * opts.batch_size)
            sched.run(todo, on_result)
        finally:
            bar.close()
            writer.close()
        tokens = engine.stats["prefill_tokens"] + engine.stats["decode_tokens"] - tok0
    else:
        tokens = 0
    wall = time.perf_counter() - t0
    metrics = summarize(opts.method, opts.dataset, done + new, wall, len(new), tokens)
    if engine is not None:
        metrics["engine"] = dict(engine.stats)
    if sched is not None:  # retrieval batches of this run: how many queries went to the retriever together
        b = sched.search_batches
        metrics["retrieval"] = {"batches": len(b), "queries": sum(b), "max_batch_size": max(b, default=0),
                                "mean_batch_size": sum(b) / len(b) if b else None, "seconds": sched.search_seconds,
                                "seconds_per_batch": sched.search_seconds / len(b) if b else None}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics
