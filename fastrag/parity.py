"""Parity: the engine and the per-question oracle on the same questions, decision by decision.

Decisions compared per question (DRAGIN, `decisions`): the trigger sentences (one per round, None for a round
without retrieval), the queries, and the final answer (the extracted answer that is scored). A method may name its
own (`MethodSpec.decisions`; BeamSearchQA: the final answer and the chosen path). `agreement` is the fraction of
questions where all of them agree. Both sides' results are kept (`engine/`, `oracle/` under the output directory,
each resumable like `fastrag run`), so a rerun only computes what is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from fastrag.data.datasets import load_examples
from fastrag.eval import (ResultWriter, RunOptions, check_manifest, latest_records, method_config, output_lock,
                          resume, run, run_identity, score_result, select_qids, write_json)
from fastrag.provenance import environment
from fastrag.trace import QuestionResult


def decisions(r: QuestionResult) -> dict:
    return {
        "trigger": [x.trigger_sentence for x in r.rounds],
        "query": [x.query for x in r.rounds if x.query is not None],
        "answer": (r.metrics or {}).get("answer") if r.error is None else f"error: {r.error}",
    }


ORACLE_RECIPES = ("published", "tuned")


def oracle_model(model: str, recipe: str = "published"):
    """The per-question oracle's transformers model, on the GPU when there is one.

    published: as the published code runs it (fp32, eager attention, whose `output_attentions` DRAGIN reads);
    tuned: the best honest per-question configuration (bf16 on a GPU, fp32 on a CPU; SDPA attention without cuDNN,
    see `_recipe_sdpa`; the DRAGIN oracle recomputing only the last layer's probabilities).
    """
    from fastrag.model.loading import load_hf_model

    if recipe not in ORACLE_RECIPES:
        raise ValueError(f"oracle recipe {recipe!r}: expected one of {', '.join(ORACLE_RECIPES)}")
    cuda = torch.cuda.is_available()
    if recipe == "published":
        return load_hf_model(model, dtype=torch.float32, attn_implementation="eager",
                             device="cuda" if cuda else "cpu")
    return load_hf_model(model, dtype=torch.bfloat16 if cuda else torch.float32, attn_implementation="sdpa",
                         device="cuda" if cuda else "cpu")


def run_oracle(opts: RunOptions, out: Path, recipe: str = "published") -> tuple[list[QuestionResult], float, int]:
    """Per-question oracle over the same questions (model per `oracle_model(recipe)`; `opts.qids`: only these of
    the data file's first `opts.limit`, each of which must be there); returns (results, wall seconds, questions
    computed). The folder is locked while it runs. Each invocation that computes something appends its
    environment (device, versions, command), questions and seconds to `out/runs.jsonl`, so timings reused later
    say where they were measured."""
    with output_lock(out), _recipe_sdpa(recipe):
        return _run_oracle(opts, out, recipe)


@contextlib.contextmanager
def _recipe_sdpa(recipe: str):
    """The tuned recipe's SDPA calls may use the engine's backends (`fastrag.model.llama.sdpa_backends`, every one but
    cuDNN unless $FASTRAG_SDPA says otherwise): torch builds a cuDNN graph for every new set of shapes, and every
    step of a generation has a new key length, so left to torch's own choice the tuned recipe spends its time building
    graphs rather than generating. The published recipe's eager attention calls no SDPA."""
    from fastrag.model.llama import sdpa_scope

    with sdpa_scope() if recipe == "tuned" else contextlib.nullcontext():
        yield


def warm_oracle(model, tok, retriever) -> None:
    """Untimed first-use costs, as the engine's clock does not pay them either (its warm-up run, its text workers):
    the spaCy pipeline's load, the device's first forward and generate (CUDA context, cuBLAS handles), a search."""
    from fastrag.text.nlp import get_nlp

    get_nlp()("Warm up the pipeline.")
    ids = torch.tensor([tok.encode("Warm up the model.")], device=model.device)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                       pad_token_id=pad)
    retriever.search(["warm up"], k=1)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def _run_oracle(opts: RunOptions, out: Path, recipe: str) -> tuple[list[QuestionResult], float, int]:
    from tqdm import tqdm

    from fastrag.model.loading import load_tokenizer
    from fastrag.specs import retriever_spec

    spec = _with_oracle(opts.method)
    out.mkdir(parents=True, exist_ok=True)
    examples = load_examples(opts.dataset, opts.data, limit=opts.limit, answer_aliases=opts.answer_aliases)
    examples = select_qids(examples, opts, "oracle question")
    check_manifest(out, run_identity(opts, method_config(opts), oracle=recipe))
    path = out / "results.jsonl"
    done, todo = resume(path, examples)
    n_kept, wall = len(done), 0.0
    if todo:
        tok = load_tokenizer(opts.model)
        model = oracle_model(opts.model, recipe)
        retriever = retriever_spec(opts.retriever, opts.corpus, **(opts.retriever_options or {})).build(
            show_progress=opts.progress)
        oracle = spec.make_oracle(model, tok, retriever, method_config(opts))
        warm_oracle(model, tok, retriever)
        w = ResultWriter(path)
        t0 = time.perf_counter()  # after loading and warming, like the engine's clock
        try:
            for ex in tqdm(todo, desc=f"oracle/{opts.dataset}", unit="q", disable=not opts.progress):
                load, cpu, t = _load_average(), time.process_time(), time.perf_counter()
                try:
                    r = oracle.run(ex.qid, ex.question, list(ex.answers))
                except ValueError as e:
                    r = QuestionResult(qid=ex.qid, question=ex.question, gold=list(ex.answers),
                                       error=f"ValueError: {e}")
                r.wall_s = time.perf_counter() - t
                # what the timing ran beside: this process's CPU seconds (all its threads) against the wall, and
                # the machine's 1-minute load average when it started (a per-question recipe that launches kernel
                # by kernel is bound by its host: a busier or slower host shows up in these, not in the GPU's work)
                r.counters["host_cpu_s"] = time.process_time() - cpu
                if load is not None:
                    r.counters["load_average_1m"] = load
                score_result(ex, r)
                w.write(r)
                done.append(r)
        finally:
            w.close()
            wall = time.perf_counter() - t0
            computed = len(done) - n_kept
            if computed > 0:
                with open(out / "runs.jsonl", "a", encoding="utf-8") as f:
                    f.write(json.dumps({"recipe": recipe, "computed": computed, "wall_s": wall,
                                        "environment": environment(model.device)}) + "\n")
    return latest_records(path, examples), wall, len(todo)


def _load_average() -> float | None:
    """The machine's 1-minute load average (None where the OS does not say)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def method_decisions(method: str):
    """The decisions function of a method (MethodSpec.decisions), DRAGIN's `decisions` when it has none."""
    from fastrag.methods.registry import get_method

    return get_method(method).decisions or decisions


def compare(engine: list[QuestionResult], oracle: list[QuestionResult], decide=decisions) -> dict:
    """Agreement of `decide(result)` (a dict of decision kind -> value) between both sides, per question.

    A question that ended in an error on either side is no evidence of agreement (two identical errors decide
    nothing): it is left out of `n` and the rates and listed in `errored`, with both sides' errors."""
    o_by = {r.qid: r for r in oracle}
    rows, agree, errored = [], 0, []
    common = []
    for r in engine:
        if r.qid not in o_by:
            continue
        if r.error or o_by[r.qid].error:
            errored.append({"qid": r.qid, "question": r.question, "engine_error": r.error,
                            "oracle_error": o_by[r.qid].error})
        else:
            common.append(r)
    per = {k: 0 for k in decide(QuestionResult(qid="", question="", gold=[]))}  # the decision kinds
    for e in common:
        de, do = decide(e), decide(o_by[e.qid])
        same = {k: de[k] == do[k] for k in per}
        for k, v in same.items():
            per[k] += v
        if all(same.values()):
            agree += 1
        else:
            rows.append({"qid": e.qid, "question": e.question, "differs": [k for k, v in same.items() if not v],
                         "engine": de, "oracle": do})
    n = len(common)
    return {"n": n, "agreement": agree / n if n else None,
            **{f"{k}_agreement": v / n if n else None for k, v in per.items()},
            "n_errored": len(errored), "disagreements": rows, "errored": errored}


def _with_oracle(method: str):
    """The method's spec; ValueError when it has no per-question oracle."""
    from fastrag.methods.registry import get_method

    spec = get_method(method)
    if spec.make_oracle is None:
        raise ValueError(f"method {method!r} has no per-question oracle; parity is not available for it")
    return spec


def parity(opts: RunOptions) -> dict:
    out = Path(opts.output)
    _with_oracle(opts.method)  # (refused before the engine run, not after it)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output {out}: is a file, expected a directory")
    m_engine = run(replace(opts, output=str(out / "engine")))
    engine_results = latest_records(out / "engine" / "results.jsonl",
                                    load_examples(opts.dataset, opts.data, limit=opts.limit,
                                                  answer_aliases=opts.answer_aliases))
    oracle_results, wall, computed = run_oracle(opts, out / "oracle")
    report = compare(engine_results, oracle_results, method_decisions(opts.method))
    # the engine's rate and seconds over every run that computed its records (`all_runs`), as the oracle's below
    # are: a rerun that computed only the questions a killed or shorter run left has its own clock for those only
    engine_all = m_engine.get("all_runs") or {}
    report.update({
        "method": opts.method, "dataset": opts.dataset,
        "engine_questions_per_s": engine_all.get("questions_per_s", m_engine.get("questions_per_s")),
        # the oracle answers one question at a time: its rate is n / sum of per-question times, which stays
        # right when a rerun resumes from records written earlier
        "oracle_questions_per_s": _rate(oracle_results),
        "engine_wall_s": engine_all.get("wall_s", m_engine.get("wall_s")),
        "oracle_wall_s": sum(r.wall_s for r in oracle_results),
        "engine_em": m_engine.get("em"),
        "oracle_em": _mean([r.metrics.get("em") for r in oracle_results if r.error is None]),
        # where this report was made (both sides run in this process, on the GPU when there is one; a side resumed
        # from an earlier run's records keeps that run's timings, and engine/metrics.json its environment)
        "environment": environment("cuda" if torch.cuda.is_available() else None),
    })
    write_json(out / "parity.json", report, ensure_ascii=False)
    return report


def _rate(results: list[QuestionResult]) -> float | None:
    """Answered questions per second of the per-question times, as the engine's questions_per_s counts them: a
    question that failed (an empty one, a retrieval that raised) costs its seconds but answers nothing."""
    t = sum(r.wall_s for r in results)
    return sum(r.error is None for r in results) / t if t > 0 else None


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None
