"""`fastrag run --ray`: the questions of one run sharded over Ray workers, merged into one result set.

Each worker is one engine (one GPU each where there are GPUs, else one CPU process with its share of the cores)
running `fastrag.eval.run` on its shard, written to `DIR/shards/<k>/results.jsonl` as questions finish (the same
incremental, resumable format). The driver waits for the shards; a shard whose worker died is submitted again and
resumes from its own file, so nothing is computed or written twice. When every shard is complete the driver
appends, in question order, every question not yet in `DIR/results.jsonl`, and writes `DIR/metrics.json` exactly
like a single-process run (with the wall time of the distributed run and a `ray` entry: workers, shard retries).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

from fastrag.eval import (ResultWriter, RunError, RunOptions, close_progress, write_progress, check_manifest,
                          latest_records, measured_fields, method_config, output_lock, read_metrics, resume,
                          run_identity, summarize, write_json)
from fastrag.provenance import environment, source_commit
from fastrag.text.pool import usable_cpus


def cpus_a_gpu(resources: dict) -> int:
    """The CPUs a GPU shard counts its auto text workers from (RunOptions.text_worker_cpus): the cluster's CPUs over
    its GPUs, so that the shards on one node share its cores instead of each starting workers for all of them."""
    return max(1, int(resources.get("CPU", 1)) // max(1, int(resources.get("GPU", 0))))


def cpu_shard_threads(shards: int, cpus: int | None = None) -> int:
    """The torch threads each of `shards` CPU shards on one machine runs with, when --threads does not say: an even
    share of the CPUs this process may run on (`usable_cpus`: its affinity mask, which a batch scheduler's allocation
    or `taskset` narrows, not the machine's count), at least one. Shares that add up to more than the allowed CPUs
    are the costly case: each shard's OpenMP threads spin waiting for work on cores the other shards need. On the
    2-core CI CPU two engines of two threads each decoded 40 tokens/s together, 0.48x one engine alone, and two of
    one thread each 118 tokens/s, 1.41x (docs/performance.md, "Several processes on one CPU")."""
    return max(1, (usable_cpus() if cpus is None else int(cpus)) // max(1, shards))


def _shard_worker(opts: RunOptions, device: str | None) -> dict:
    """Runs inside a Ray worker: the shard's questions through one engine."""
    import torch

    from fastrag.eval import run
    from fastrag.specs import EngineConfig

    if opts.threads:
        torch.set_num_threads(opts.threads)
    Path(opts.output).mkdir(parents=True, exist_ok=True)
    (Path(opts.output) / "worker.pid").write_text(str(os.getpid()))
    engine = EngineConfig.of(opts, device=device).build()
    return run(opts, engine=engine)


def run_ray(opts: RunOptions, num_workers: int = 2, max_retries: int = 3, ray_address: str | None = None) -> dict:
    """The run's questions over Ray workers (module docstring); the output folder is locked while it goes."""
    if num_workers <= 0:
        raise ValueError(f"--num-workers must be positive, got {num_workers}")
    with output_lock(Path(opts.output)):
        return _run_ray(opts, num_workers, max_retries, ray_address)


def _run_ray(opts: RunOptions, num_workers: int, max_retries: int, ray_address: str | None) -> dict:
    import ray

    from fastrag.data.datasets import load_examples

    source_commit()  # the commit of the code this run loaded, read before anything can change it
    out = Path(opts.output)
    out.mkdir(parents=True, exist_ok=True)
    examples = load_examples(opts.dataset, opts.data, limit=opts.limit, answer_aliases=opts.answer_aliases)
    check_manifest(out, run_identity(opts, method_config(opts)))
    done, todo = resume(out / "results.jsonl", examples)
    have = {r.qid for r in done}
    close_progress(out)  # (a driver killed before its end left its progress: it joins the history, runs.jsonl)
    t0 = time.perf_counter()
    retries = 0
    shard_opts: list[RunOptions] = []
    earlier: set[str] = set()
    if todo:
        n = min(num_workers, len(todo))
        # contiguous shards: each worker's questions come from one stretch of the file
        bounds = [round(i * len(todo) / n) for i in range(n + 1)]
        shards = [tuple(e.qid for e in todo[bounds[i]: bounds[i + 1]]) for i in range(n)]
        if not ray.is_initialized():
            if ray_address:
                ray.init(address=ray_address, ignore_reinit_error=True, log_to_driver=False)
            else:
                ray.init(num_cpus=max(n, usable_cpus()), include_dashboard=False, log_to_driver=False,
                         ignore_reinit_error=True)
        gpus = int(ray.cluster_resources().get("GPU", 0))
        per_gpu = gpus >= n
        threads = opts.threads or cpu_shard_threads(n)
        task = ray.remote(num_gpus=1 if per_gpu else 0, num_cpus=0 if per_gpu else 1, max_retries=0)(_shard_worker)
        cpus_per_gpu = cpus_a_gpu(ray.cluster_resources()) if per_gpu else None
        shard_opts = [replace(opts, output=str(out / "shards" / str(i)), qids=shards[i], limit=opts.limit,
                              threads=None if per_gpu else threads, progress=False, text_worker_cpus=cpus_per_gpu)
                      for i in range(n)]
        device = "cuda" if per_gpu else "cpu"
        mine = [[e for e in todo if e.qid in set(shards[i])] for i in range(n)]  # each shard's examples

        def shard_records(i: int) -> list:  # the last record of each of shard i's questions (read-only)
            return latest_records(Path(shard_opts[i].output) / "results.jsonl", mine[i])

        # answers a shard already holds (a run killed before its merge computed them): the shard keeps them, so
        # this run merges them without computing them, and its throughput must not count them
        before = {r.qid: r for i in range(n) for r in shard_records(i)}
        earlier = {q for q, r in before.items() if r.error is None}
        pending = {task.remote(o, device): i for i, o in enumerate(shard_opts)}
        tries = [0] * n
        from tqdm import tqdm

        bar = tqdm(total=len(todo), desc=f"{opts.method}/{opts.dataset} ray x{n}", unit="q",
                   disable=not opts.progress)
        finished = 0
        while pending:
            ready, _ = ray.wait(list(pending), timeout=1.0)
            recs = [r for i in range(n) for r in shard_records(i)]
            bar.update(len(recs) - finished)
            finished = len(recs)
            fresh = [r for r in recs if before.get(r.qid) != r]  # computed by this run so far
            if fresh:  # (as a single-process run keeps it: a killed driver's work still counts in all_runs)
                write_progress(out, len(fresh), sum(r.error is None for r in fresh), time.perf_counter() - t0)
            for ref in ready:
                i = pending.pop(ref)
                try:
                    ray.get(ref)
                except (ray.exceptions.RayError, OSError) as e:  # the worker died: resume its shard elsewhere
                    cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) else None
                    if isinstance(cause, Exception):  # (the shard's own code raised: it would again, anywhere)
                        bar.close()
                        raise cause from e
                    tries[i] += 1
                    retries += 1
                    if tries[i] > max_retries:
                        bar.close()
                        raise RunError(f"shard {i} failed {tries[i]} times; last error: {e}") from e
                    pending[task.remote(shard_opts[i], device)] = i
        bar.close()
        # merge: question order, only what the main file does not have yet; for each question the record of the
        # shard that computed it this time (a shard folder may keep an older record of a question that an earlier
        # run's cut gave it)
        by_id = {r.qid: r for i in range(n) for r in shard_records(i)}
        missing = [e.qid for e in todo if e.qid not in by_id]
        if missing:
            raise RunError(f"{len(missing)} questions missing after all shards finished: {missing[:5]}")
        w = ResultWriter(out / "results.jsonl")
        try:
            for e in todo:
                w.write(by_id[e.qid])
        finally:
            w.close()
    wall = time.perf_counter() - t0
    results = latest_records(out / "results.jsonl", examples)  # (question order, the last record of each)
    new = [r for r in results if r.qid not in have]
    computed = [r for r in new if r.qid not in earlier]  # (new to the main file, and computed by this run)
    metrics = summarize(opts.method, opts.dataset, results, wall, len(computed),
                        sum(r.prefill_tokens + r.decode_tokens for r in computed),
                        sum(r.error is None for r in computed), examples={e.qid: e for e in examples},
                        corpus=opts.corpus)
    # the shard folders of this run (a folder left by an earlier run with more workers is not one of them)
    metrics["ray"] = {"workers": min(num_workers, len(todo)) if todo else 0, "shard_retries": retries,
                      "shards": [Path(o.output).name for o in shard_opts]}
    totals = _engine_totals([Path(o.output) for o in shard_opts])
    if totals:  # (each shard's own figures stay in its metrics.json: fastrag.perf reads them there)
        metrics["engine_total"] = totals
    if computed:
        write_progress(out, len(computed), sum(r.error is None for r in computed), wall)
    metrics["all_runs"] = close_progress(out)  # (every run that computed the folder's records, a killed one too)
    from fastrag.eval import sampling_of

    sp = sampling_of(opts)
    metrics["sampling"] = {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k, "seed": sp.seed}
    # the driver's environment, with the devices the shards computed on (each shard's metrics.json names its own)
    if new:
        env = environment()
        shard_envs = [_read_environment(Path(o.output)) or {} for o in shard_opts]
        devices = sorted({e["device"] for e in shard_envs if e.get("device")})
        if devices:
            env["device"] = "; ".join(devices)
        metrics["environment"] = env
    else:  # nothing computed: the throughput, the worker count and the environment of the run that computed the
        # figures stay (as a single-process rerun keeps them), marked measured_in_an_earlier_run
        metrics |= measured_fields(out / "metrics.json", extra=("ray", "engine_total"))
    write_json(out / "metrics.json", metrics)
    return metrics


_PEAKS = ("kv_peak_blocks",)  # per-engine highs: the shards' largest, not their sum (each has its own pool)


def _engine_totals(folders: list[Path]) -> dict:
    """The engine counters of the shards' metrics.json summed (tokens, steps, seconds of engine work over all
    workers), the peaks in _PEAKS their maximum; {} when no shard has any."""
    out: dict = {}
    for f in folders:
        eng = (read_metrics(f / "metrics.json") or {}).get("engine") or {}
        for k, v in eng.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = max(out.get(k, v), v) if k in _PEAKS else out.get(k, 0) + v
    return out


def _read_environment(folder: Path) -> dict | None:
    """The `environment` of a folder's metrics.json, None when it has none."""
    env = (read_metrics(folder / "metrics.json") or {}).get("environment")
    return env if isinstance(env, dict) else None
