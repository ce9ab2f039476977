"""Running a batch evaluation: the engine built from the run options, the methods' policies, the question loop over
every run's questions, and the metrics of each run (fastrag.eval.report) kept by its store (fastrag.eval.store) or,
with RunOptions.write False, in memory."""

from __future__ import annotations

import contextlib
import time
import warnings
from pathlib import Path

import torch

from fastrag.cache.kv import OutOfBlocks
from fastrag.data.datasets import load_examples
from fastrag.eval.options import RunOptions, method_config, path_problem, sampling_of, select_qids
from fastrag.eval.report import Probes, measurements, score_result, summarize, triton_compile_log
from fastrag.eval.store import (ResultWriter, check_manifest, close_progress, measured_fields, output_lock, resume,
                                run_identity, write_json, write_progress)
from fastrag.model.loading import control_token_strings, find_control_token
from fastrag.probe import Probe
from fastrag.provenance import environment, source_commit
from fastrag.settings import switch_interval_setting
from fastrag.trace import QuestionResult


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



def run(opts: RunOptions, engine=None, retriever=None) -> dict:
    """Run a method over a dataset; returns the metrics dict (also written to DIR/metrics.json)."""
    return run_many([opts], engine=engine, retriever=retriever)[0]


def run_many(runs: list[RunOptions], engine=None, retriever=None, examples: list[list] | None = None,
             records: list[list[QuestionResult]] | None = None, make_engine=None, make_retriever=None) -> list[dict]:
    """Several (method, dataset) runs served together by one engine: their questions share the decode batch.

    Each run keeps its own output directory (results.jsonl written as questions finish, resumable; metrics.json
    at the end). A question's decode steps no longer wait for questions of its own run alone: when one run would
    leave the batch mostly empty (its last, longest questions), the others fill it. The runs must share model,
    corpus and engine settings (taken from the first). Each metrics.json carries the joint figures under
    `joint`: all runs' questions over the one wall clock. Each output directory is locked while the runs go.

    examples: per run, its questions (fastrag.data Example objects) instead of those of its `data` file.
    records: a list that gets, per run, all its records (those resumed and those computed), in its questions'
    order. Runs with `write` False keep their records in memory only: no folder, lock, manifest or resume.
    make_engine / make_retriever: called (no arguments) for the engine / retriever when none is given and some
    question is to be computed (None: built from the first run's options, fastrag.specs).
    """
    if not runs:
        raise ValueError("run_many: no runs given")
    if examples is not None and len(examples) != len(runs):
        raise ValueError(f"run_many: {len(examples)} example lists for {len(runs)} runs")
    outs = [Path(o.output) for o in runs if o.write]
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
        return _run_many(runs, engine, retriever, examples, records, make_engine, make_retriever)


def _run_many(runs: list[RunOptions], engine=None, retriever=None, given: list[list] | None = None,
              records: list[list[QuestionResult]] | None = None, make_engine=None, make_retriever=None) -> list[dict]:
    from tqdm import tqdm

    from fastrag.loop import QuestionLoop
    from fastrag.specs import EngineConfig, retriever_spec
    from fastrag.text.pool import auto_text_workers

    source_commit()  # the commit of the code this run loaded (fastrag.provenance), before anything can change it
    switch_interval_setting()  # (a bad $FASTRAG_SWITCH_INTERVAL fails here, before the model loads)
    probe = Probe.from_settings()  # (and a bad diagnostic switch)
    first = runs[0]
    for o in runs[1:]:
        for f in ("model", "corpus", "retriever", "retriever_options", "batch_size", "signals", "kv_cache_gb", "prefix_caching",
                  "temperature", "top_p", "top_k", "seed", "overlap", "text_workers", "search_concurrency"):
            if getattr(o, f) != getattr(first, f):
                raise ValueError(f"run_many: runs must share --{f.replace('_', '-')}: {getattr(first, f)!r} "
                                 f"({first.dataset}) vs {getattr(o, f)!r} ({o.dataset})")
    outs = [Path(o.output) if o.write else None for o in runs]  # (None: kept in memory)
    if first.threads:
        torch.set_num_threads(first.threads)
    plans = []  # per run: (opts, cfg, examples by id, done, todo)
    for k, (o, out) in enumerate(zip(runs, outs)):
        cfg = method_config(o)
        if given is not None and given[k] is not None:
            examples = list(given[k])[:o.limit] if o.limit is not None else list(given[k])
        else:
            examples = load_examples(o.dataset, o.data, limit=o.limit, answer_aliases=o.answer_aliases)
        examples = select_qids(examples, o)
        if out is None:
            done, todo = [], examples
        else:
            out.mkdir(parents=True, exist_ok=True)
            check_manifest(out, run_identity(o, cfg))
            done, todo = resume(out / "results.jsonl", examples)
        plans.append((o, cfg, {e.qid: e for e in examples}, done, todo))

    for out in outs:  # a run interrupted before its end left its progress: it joins the history
        if out is not None:
            close_progress(out)
    t0 = time.perf_counter()
    news: list[list[QuestionResult]] = [[] for _ in runs]
    answered = [0] * len(runs)
    sched = None
    probes = Probes(text_workers_given=first.text_workers is not None)
    tok0 = 0
    if any(p[4] for p in plans):
        engine = engine or (make_engine or EngineConfig.of(first).build)()
        retriever = retriever or (make_retriever or (lambda: retriever_spec(
            first.retriever, first.corpus, **(first.retriever_options or {})).build(
            show_progress=first.progress)))()
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
        # step that captures one inside the run waits tens of milliseconds, a large share of a short run)
        t_cap = time.perf_counter()
        probes.captured_ahead = engine.capture_graphs() if hasattr(engine, "capture_graphs") else 0
        probes.capture_ahead_s = time.perf_counter() - t_cap
        t0 += probes.capture_ahead_s
        tok0 = engine.stats["prefill_tokens"] + engine.stats["decode_tokens"]
        # Triton compiles inside the clock (metrics.json `triton_compiles`)
        probes.compile_log = triton_compile_log()
        probes.compile_mark = probes.compile_log.mark() if probes.compile_log is not None else 0
        writers = [ResultWriter(out / "results.jsonl") if out is not None else None for out in outs]
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
            news[i].append(r)
            answered[i] += r.error is None
            if writers[i] is not None:
                writers[i].write(r)
                write_progress(outs[i], len(news[i]), answered[i], time.perf_counter() - t0)
            bar.update(1)

        written = [out for out in outs if out is not None]
        probe.attach(engine)  # (the diagnostics asked for: fastrag.probe; off, nothing is attached)
        try:
            # text workers not given: as many as the host's cores spare on a GPU, none on a CPU
            text_workers = first.text_workers
            if text_workers is None:
                text_workers = auto_text_workers(getattr(engine, "device", "cpu"), cpus=first.text_worker_cpus)
            loop_cfg = EngineConfig.of(first).loop_config(text_workers=text_workers, sync_watch=probe.sync_watch)
            sched = QuestionLoop(engine, retriever, lambda ex: policies[which[id(ex)]](ex), loop_cfg)
            sched.run(todo, on_result, pass_example=True)
        finally:
            bar.close()
            for w in writers:
                if w is not None:
                    w.close()
            if probes.compile_log is not None:
                probes.compile_log.row = None
            blocks = probe.collect(engine, written)
            probes.kernel_profile = blocks.get("kernel_profile")
            probes.launch_profile = blocks.get("launch_profile")
            probes.step_trace = blocks.get("step_trace")
        tokens = engine.stats["prefill_tokens"] + engine.stats["decode_tokens"] - tok0
    else:
        tokens = 0
    wall = time.perf_counter() - t0
    computed = sum(len(n) for n in news)
    if engine is not None and probes.compile_log is None:  # (no question computed: nothing ran inside the clock)
        probes.compile_log = triton_compile_log()
        probes.compile_mark = probes.compile_log.mark() if probes.compile_log is not None else 0
    out_metrics = []
    for (o, _cfg, by_id, done, _todo), new, out in zip(plans, news, outs):
        # tokens are counted by the engine for all runs together: each run gets its own records' share
        own_tokens = sum(r.prefill_tokens + r.decode_tokens for r in new)
        metrics = summarize(o.method, o.dataset, done + new, wall, len(new),
                            tokens if len(runs) == 1 else own_tokens, sum(r.error is None for r in new),
                            examples=by_id, corpus=o.corpus)
        if len(runs) > 1:
            metrics["joint"] = {"runs": [f"{x.method}/{x.dataset}" for x in runs], "wall_s": wall,
                                "computed_this_run": computed,
                                # (answered ones, as each run's questions_per_s: a failed question is no throughput)
                                "questions_per_s": sum(answered) / wall if wall > 0 else None,
                                "tokens_per_s": tokens / wall if wall > 0 else None}
        sp = engine.sampling if engine is not None else sampling_of(o)  # what really decoded (a caller's engine)
        metrics["sampling"] = {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k, "seed": sp.seed}
        metrics |= measurements(engine, sched, probes, close_progress(out) if out is not None else None)
        if new:  # where and with what the figures were measured (fastrag.provenance)
            metrics["environment"] = environment(getattr(engine, "device", None))
        elif out is not None:  # nothing computed now: the throughput and engine figures (and their environment)
            # stay those of the last run that did
            metrics |= measured_fields(out / "metrics.json")
        if out is not None:
            write_json(out / "metrics.json", metrics)
        out_metrics.append(metrics)
        if records is not None:
            order = {qid: k for k, qid in enumerate(by_id)}
            records.append(sorted(done + new, key=lambda r: order.get(r.qid, len(order))))
    return out_metrics


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

