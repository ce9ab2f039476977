"""`fastrag run --ray`: sharded over Ray workers, the merged results equal the single-process run's, in question
order; a worker killed mid-run is replaced and its shard resumes (nothing lost, nothing written twice).
Real SmolLM2 and bm25s, short generations, 2 CPU workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from fastrag.eval import BUNDLED

DATA = BUNDLED / "hotpotqa_dev20.jsonl"
CORPUS = BUNDLED / "wiki_passages.jsonl"
N = 6


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    p = tmp_path_factory.mktemp("cfg") / "dragin.json"
    p.write_text(json.dumps({"method": "attn_entropy", "generate_max_length": 20, "hallucination_threshold": 1.2}))
    return p


def cli(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "fastrag", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def records(out):
    return [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]


def decisions(recs):
    """qid -> (prediction, rounds). A single-process file is in finishing order, a merged one in question order."""
    return {r["qid"]: (r["prediction"], [(x["trigger_sentence"], x["query"], x["doc_ids"]) for x in r["rounds"]])
            for r in recs}


def in_question_order(recs):
    from fastrag.data.datasets import load_examples

    order = [e.qid for e in load_examples("hotpotqa", DATA, limit=N)]
    return [r["qid"] for r in recs] == order


@pytest.fixture(scope="module")
def single(tmp_path_factory, cfg):
    out = tmp_path_factory.mktemp("single")
    p = cli("run", "--method", "dragin", "--dataset", "hotpotqa", "--data", DATA, "--corpus", CORPUS, "--config",
            cfg, "--limit", N, "--batch-size", 4, "--output", out, "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    got = decisions(records(out))
    assert any(query for _, rounds in got.values() for _, query, _ in rounds), "nothing retrieved: a weak check"
    return got


def ray_args(cfg, *args) -> list[str]:
    """fastrag's arguments for a 2-worker Ray run of DRAGIN on the first N bundled questions."""
    return ["run", "--ray", "--num-workers", "2", "--method", "dragin", "--dataset", "hotpotqa", "--data", str(DATA),
            "--corpus", str(CORPUS), "--config", str(cfg), "--limit", str(N), *map(str, args), "--no-progress"]


def test_ray_run_with_a_killed_worker_equals_single_process(tmp_path, cfg, single):
    """One Ray run whose shard-0 worker is killed after its first answer: the worker is replaced, the shard resumes
    (no question written twice) and the merged file equals the single-process run's, in question order. A rerun
    adds nothing; a third run recomputes two questions whose latest records are errors, with no retry."""
    out = tmp_path / "ray"
    # (batch size 1: shard 0 writes its answers one by one, so the kill lands between two of them)
    proc = subprocess.Popen([sys.executable, "-m", "fastrag", *ray_args(cfg, "--batch-size", 1, "--output", out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    shard = out / "shards" / "0"
    deadline, killed = time.time() + 600, None
    while time.time() < deadline and proc.poll() is None:
        res = shard / "results.jsonl"
        if (shard / "worker.pid").exists() and res.exists() and res.read_text().count("\n") >= 1:
            killed = int((shard / "worker.pid").read_text())
            os.kill(killed, signal.SIGKILL)
            break
        time.sleep(0.2)
    assert killed is not None, "the shard never wrote a first result"
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    assert decisions(records(out)) == single  # same answers, same traces
    assert in_question_order(records(out)) and len(records(out)) == N
    shard_qids = [json.loads(x)["qid"] for x in (shard / "results.jsonl").read_text().splitlines()]
    assert len(shard_qids) == len(set(shard_qids)) == N // 2  # the resumed shard wrote no question twice
    assert int((shard / "worker.pid").read_text()) != killed  # (its replacement finished the shard)
    m = json.loads((out / "metrics.json").read_text())
    assert m["n"] == N and m["ray"]["workers"] == 2 and m["ray"]["shard_retries"] >= 1
    assert m["ray"]["shards"] == ["0", "1"]
    for k in ("em", "f1", "questions_per_s", "retrievals_per_question", "wall_s"):
        assert k in m
    assert m["sampling"] == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}  # (as a single process)
    # the environment names the device the shards computed on (each shard's own metrics.json), not the driver's
    shard_devices = {json.loads((out / "shards" / str(i) / "metrics.json").read_text())["environment"]["device"]
                     for i in range(2)}
    assert m["environment"]["device"] == "; ".join(sorted(shard_devices)), (m["environment"], shard_devices)
    assert m["environment"]["torch"] == torch.__version__
    again = cli(*ray_args(cfg, "--output", out))
    assert again.returncode == 0 and len(records(out)) == N  # a rerun adds nothing
    kept = json.loads((out / "metrics.json").read_text())
    assert kept["computed_this_run"] == 0 and kept["measured_in_an_earlier_run"] is True
    # nor a new environment, nor throughput figures of a run that computed nothing: those of the run that did stay
    for k in ("environment", "questions_per_s", "tokens_per_s", "wall_s", "ray", "engine_total"):
        assert kept[k] == m[k], (k, kept.get(k), m[k])
    # the last two questions (shard 1's) failed in an earlier run: their error records are the latest in the main
    # file and in shard 1's folder. The rerun cuts [q4, q5] into shard 0 = {q4}, shard 1 = {q5}: q4's fresh answer
    # comes from shard 0, while shard 1's folder still holds q4's old error, which must not win the merge.
    last = [r["qid"] for r in records(out)][-2:]
    for f in (out / "shards" / "1" / "results.jsonl", out / "results.jsonl"):
        errs = [dict(r, error="ConnectionError: search backend unreachable", prediction="", metrics={})
                for r in records(f.parent) if r["qid"] in last]
        assert len(errs) == 2
        with open(f, "a") as fh:
            fh.write("".join(json.dumps(r) + "\n" for r in errs))
    third = cli(*ray_args(cfg, "--output", out))
    assert third.returncode == 0, third.stderr[-3000:]
    m = json.loads((out / "metrics.json").read_text())
    assert m["errors"] == 0 and m["computed_this_run"] == 2, m
    assert m["ray"]["workers"] == 2 and m["ray"]["shard_retries"] == 0  # (no worker died: none was retried)
    latest = {r["qid"]: r for r in records(out)}
    assert decisions(latest.values()) == single
    # the driver's engine_total sums this run's shards' engine counters
    shard_eng = [json.loads((out / "shards" / str(i) / "metrics.json").read_text())["engine"] for i in range(2)]
    for k in ("prefill_tokens", "decode_tokens", "decode_steps"):
        assert m["engine_total"][k] == shard_eng[0][k] + shard_eng[1][k] > 0, k
    # (a peak is each engine's own: the larger of the shards')
    assert m["engine_total"]["kv_peak_blocks"] == max(e["kv_peak_blocks"] for e in shard_eng) > 0


def _tiny_run_files(tmp_path, n: int):
    """(a tiny random model, an NQ file of n questions, a config of 4 new tokens and no demos) under tmp_path."""
    sys.path.insert(0, str(BUNDLED.parents[2] / "benchmarks"))
    from make_random_model import make

    tiny = make("tiny", tmp_path / "tiny", dtype=torch.float32, device="cpu")
    data = tmp_path / "nq.jsonl"
    data.write_text("".join(json.dumps({"question": f"who wrote book number {i}?", "answer": [f"a{i}"]}) + "\n"
                            for i in range(n)))
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"generate_max_length": 4, "fewshot": 0}))
    return tiny, data, cfg


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray session for this module's in-process runs (run_ray joins a session already started, as it
    joins a cluster): each test saves Ray's start-up and its shards may reuse the idle workers of the one before."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_answers_a_killed_run_left_in_a_shard_are_not_counted_as_computed_again(tmp_path, local_ray):
    """A driver killed before its merge leaves answers in the shard folders; the rerun's shards resume from them and
    the driver merges them, but this run did not compute them: computed_this_run and the rates count the others
    only (they counted every question new to the main file, so a rerun that computed 3 claimed 4 in its wall)."""
    from dataclasses import replace

    from fastrag.distributed import run_ray
    from fastrag.eval import RunOptions, run

    tiny, data, cfg = _tiny_run_files(tmp_path, 4)
    corpus = tmp_path / "passages.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"p{i}", "title": f"T{i}", "text": f"book {i} by author {i}"}) + "\n"
                              for i in range(8)))
    out = tmp_path / "ray"
    opts = RunOptions(method="sr-rag", dataset="nq", data=str(data), corpus=str(corpus), output=str(out),
                      model=tiny, config=str(cfg), limit=4, batch_size=2, kv_cache_gb=0.05, progress=False)
    # what the killed run left: shard 1 of the 2-worker cut ([nq-0, nq-1], [nq-2, nq-3]) answered nq-2
    left = run(replace(opts, output=str(out / "shards" / "1"), qids=("nq-2",)))
    assert left["computed_this_run"] == 1 and left["errors"] == 0
    # and the killed driver's progress: one answer 2.5 s into its run (what it writes as the shards go)
    (out / "progress.json").write_text(json.dumps({"computed": 1, "answered": 1, "wall_s": 2.5}))
    m = run_ray(opts, num_workers=2)
    assert m["n"] == 4 and m["errors"] == 0 and len(records(out)) == 4
    assert m["computed_this_run"] == 3 and m["questions_measured"] == 3
    assert m["questions_per_s"] == pytest.approx(3 / m["wall_s"])
    shard1 = [json.loads(x)["qid"] for x in (out / "shards" / "1" / "results.jsonl").read_text().splitlines()]
    assert shard1 == ["nq-2", "nq-3"]  # nq-2 was not computed again
    # all_runs, as a single-process run has it (README): the killed run's answer and seconds, then this run's
    assert m["all_runs"]["runs"] == 2 and m["all_runs"]["computed"] == 4 and m["all_runs"]["answered"] == 4
    assert m["all_runs"]["wall_s"] == pytest.approx(2.5 + m["wall_s"])
    assert m["all_runs"]["questions_per_s"] == pytest.approx(4 / (2.5 + m["wall_s"]))
    assert not (out / "progress.json").exists()
    assert len((out / "runs.jsonl").read_text().splitlines()) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA signals backend can run here")
def test_an_error_raised_by_the_shards_own_code_is_not_retried_as_a_dead_worker(tmp_path, local_ray):
    """A shard whose run raises (here --signals cuda without a GPU) would raise again on any worker: the driver
    raises that error, as a single-process run does, instead of resubmitting the shard until its retries run out
    and ending in 'shard 0 failed 4 times' with Ray's coloured traceback as the message."""
    from fastrag.distributed import run_ray
    from fastrag.eval import RunOptions
    from fastrag.signals import BackendUnavailableError

    tiny, data, cfg = _tiny_run_files(tmp_path, 2)
    opts = RunOptions(method="sr-rag", dataset="nq", data=str(data), corpus=str(CORPUS), output=str(tmp_path / "o"),
                      model=tiny, config=str(cfg), batch_size=2, kv_cache_gb=0.05, signals="cuda", progress=False)
    with pytest.raises(BackendUnavailableError, match="signals backend 'cuda' is not available"):
        run_ray(opts, num_workers=2, max_retries=1)


def test_gpu_shards_count_their_text_workers_from_their_share_of_the_cores():
    """On a node of 16 cores and 2 GPUs each GPU shard counts its auto text workers from 8 CPUs (6 workers), not
    from 16 (8 workers each: 16 spaCy processes beside 2 engines on 16 cores)."""
    from fastrag.distributed import cpus_a_gpu
    from fastrag.text.pool import auto_text_workers

    assert cpus_a_gpu({"CPU": 16.0, "GPU": 2.0}) == 8
    assert auto_text_workers("cuda", cpus=cpus_a_gpu({"CPU": 16.0, "GPU": 2.0})) == 6
    assert cpus_a_gpu({"CPU": 64.0, "GPU": 8.0}) == 8 and cpus_a_gpu({"CPU": 3.0, "GPU": 4.0}) == 1
    assert cpus_a_gpu({"CPU": 16.0}) == 16 and cpus_a_gpu({}) == 1


def test_cpu_shards_share_the_cpus_the_affinity_mask_allows(monkeypatch):
    """CPU shards get an even share of the CPUs this process may run on, not of the machine's: on a 64-core node
    whose job holds 8 of them, 4 shards of 16 threads each would put 64 spinning OpenMP threads on 8 cores."""
    import os

    from fastrag.distributed import cpu_shard_threads

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8, 16)), raising=False)
    assert cpu_shard_threads(4) == 2 and cpu_shard_threads(1) == 8 and cpu_shard_threads(3) == 2
    assert cpu_shard_threads(9) == 1 and cpu_shard_threads(16) == 1  # (more shards than CPUs: one thread each)
    assert cpu_shard_threads(4, cpus=64) == 16  # (the CPUs given: a count, not the mask)
