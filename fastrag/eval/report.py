"""The figures of a batch evaluation: each question scored against its gold answers, the run's metrics summarized
from its records, and what the engine and the question loop measured while they ran (`measurements`), all in the
shape metrics.json holds."""

from __future__ import annotations

from dataclasses import dataclass

from fastrag.data.datasets import Example
from fastrag.data.evidence import retrieval_quality
from fastrag.data.metrics import aggregate, score
from fastrag.trace import QuestionResult


# Example.meta key of a question given without gold answers (fastrag.api): it gets no EM/F1, and the run's means
# are over the questions that have them
NO_GOLD = "no_gold"


def score_result(ex: Example, r: QuestionResult) -> None:
    if r.error is None and not ex.meta.get(NO_GOLD):
        r.metrics = score(ex, r.prediction)


def summarize(opts_method: str, dataset: str, results: list[QuestionResult], wall_s: float, computed: int,
              tokens: int, answered: int, examples: dict | None = None, corpus=None) -> dict:
    """The metrics of `results`; `computed` of them were computed in this run's `wall_s`, `answered` of those
    without an error: questions_per_s counts the answered ones (a question that fails at once is no throughput).
    With `examples` (qid -> Example), `retrieval_quality`: recall and precision of the retrieved passages against
    the gold supporting titles the dataset gives, read from `corpus` (fastrag.data.evidence)."""
    ok = [r for r in results if r.error is None]
    agg = aggregate([r.metrics for r in ok]) if ok else {}
    quality = {}
    if examples is not None:
        from fastrag.retrieval.corpus import CorpusError

        try:
            quality = {"retrieval_quality": retrieval_quality(examples, results, corpus)}
        except CorpusError as e:  # (the answers' figures stand without it)
            quality = {"retrieval_quality": {"available": False, "why": f"the corpus cannot be read: {e}"}}
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
        **quality,
    }


def triton_compile_log():
    """fastrag.kernels.compiles.COMPILES with its hook on; None without Triton."""
    try:
        from fastrag.kernels.compiles import COMPILES
    except ImportError:
        return None
    COMPILES.install()
    return COMPILES


@dataclass
class Probes:
    """What a run switched on or measured around the question loop, for `measurements`: the Triton compile log and
    its mark at the clock's start, the graphs captured ahead of the clock, and the optional profiles' summaries
    ($FASTRAG_STEP_TRACE, $FASTRAG_KERNEL_PROFILE, $FASTRAG_LAUNCH_PROFILE). text_workers_given: the run was told
    its text worker count (else it chose it, auto_text_workers)."""
    compile_log: object = None
    compile_mark: int = 0
    captured_ahead: int = 0
    capture_ahead_s: float = 0.0
    step_trace: dict | None = None
    kernel_profile: dict | None = None
    launch_profile: dict | None = None
    text_workers_given: bool = False


def measurements(engine, sched, probes: Probes, all_runs: dict | None = None) -> dict:
    """The metrics.json fields the engine and the question loop measured (engine None: no question was computed, so
    neither ran; sched None likewise for the loop's fields), in metrics.json's order; `all_runs` (the rate over every
    run of the folder) goes between the engine's and the loop's fields, None: left out (an in-memory run)."""
    metrics: dict = {}
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
        log = probes.compile_log
        metrics["triton_compiles"] = log.report(probes.compile_mark) if log is not None else \
            {"hooked": False, "why_not": "no Triton here", "count": 0, "kernels": {}}
        graphs = getattr(engine, "graphs", None)
        if graphs is not None:  # decode steps replayed vs launched eagerly, graphs captured
            # captured_ahead / capture_ahead_s: graphs captured before the run's clock (Engine.capture_graphs);
            # "captures" counts those too (and an engine the caller passed in, its earlier runs' captures), so
            # on an engine built by this run captures - captured_ahead were captured by the run's steps
            metrics["cuda_graphs"] = dict(graphs.stats) | {"graphs": len(graphs.graphs),
                                                           "disabled": graphs.disabled,
                                                           "table_width_blocks": graphs.width,
                                                           "captured_ahead": probes.captured_ahead,
                                                           "capture_ahead_s": probes.capture_ahead_s}
        for name in ("prefill_graphs", "pass_graphs"):  # calls replayed from graphs vs run eagerly
            pg = getattr(engine, name, None)  # (their captures ahead in the stats)
            if pg is not None:
                metrics[name] = dict(pg.stats) | {"graphs": len(pg.graphs), "disabled": pg.disabled,
                                                  "applies": pg.applies(), "token_buckets": pg.buckets,
                                                  "max_seqs": pg.max_seqs}
    if all_runs is not None:
        metrics["all_runs"] = all_runs
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
        if probes.step_trace is not None:
            metrics["step_trace"] = probes.step_trace
        if probes.kernel_profile is not None:  # ($FASTRAG_KERNEL_PROFILE) the profiled steps' time by part
            metrics["kernel_profile"] = probes.kernel_profile
        if probes.launch_profile is not None:  # ($FASTRAG_LAUNCH_PROFILE) the launches' host time by function
            metrics["launch_profile"] = probes.launch_profile
        if sched.sync_watch is not None:  # ($FASTRAG_SYNC_WATCH) host calls that waited for the device in the
            metrics["overlap_syncs"] = sched.sync_watch.summary()  # overlap window, by call site
        elif sched.sync_watch_off is not None:
            metrics["overlap_syncs"] = {"off": sched.sync_watch_off}
        # spaCy texts sent to worker processes (0 workers: all run on the scheduler's thread)
        # (chosen: "auto" when the run chose the count, auto_text_workers; "given" when it was told)
        metrics["text_workers"] = {"workers": sched.text_workers, "texts": sched.text_requests,
                                   "lockstep": sched.text_lockstep,
                                   "chosen": "given" if probes.text_workers_given else "auto"}
        if sched.text_groups:  # ($FASTRAG_TEXT_GROUPS) a step's texts sent together, not waited for
            sizes = sched.text_group_sizes
            metrics["text_workers"]["groups"] = {"sent": len(sizes), "texts": sum(sizes),
                                                 "largest": max(sizes, default=0)}
    return metrics
