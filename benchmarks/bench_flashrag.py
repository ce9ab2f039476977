"""fastrag against FlashRAG (PyPI `flashrag-dev`), side by side: questions/s, EM/F1, answer agreement and
retrieval decisions for standard RAG (fastrag `sr-rag` vs FlashRAG SequentialPipeline), FLARE (`flare` vs
FLAREPipeline), IRCoT (`ircot` vs IRCOTPipeline), Iter-RetGen (`iter-retgen` vs IterativePipeline) and Self-Ask
(`self-ask` vs SelfAskPipeline), same questions, same SmolLM2 weights, same BM25 corpus, same machine, same run.

    nice -n 5 python benchmarks/bench_flashrag.py --limit 50 --methods sr-rag flare ircot
    nice -n 5 python benchmarks/bench_flashrag.py --limit 20 --methods iter-retgen self-ask --name flashrag_decisions_cpu

Decisions: every search each system makes is recorded per question (FlashRAG's by wrapping its retriever,
flashrag_runner.log_searches; fastrag's from its rounds) and compared (compare_decisions); for IRCoT, Iter-RetGen
and Self-Ask, fastrag's rule is also replayed on FlashRAG's own generations (replay), which separates what the rule
decides from what the two prompts make the model write.

FlashRAG is never a fastrag dependency: the script makes a scratch venv (`--venv`, default runs/flashrag-venv,
`--system-site-packages` so torch/transformers are the main environment's), installs flashrag-dev there with
--no-deps plus the few packages its import path needs, and runs each FlashRAG pipeline in a subprocess with that
venv's python (benchmarks/flashrag_runner.py). FlashRAG reads the embedded SmolLM2 as the HF folder fastrag
converts it to (fastrag.model.loading.resolve_model) and a bm25s index of wiki_passages.jsonl converted to
FlashRAG's corpus format ({"id", "contents": "title\\ntext"}), built by the runner in the tokenisation FlashRAG's
BM25Retriever queries with (FlashRAG 0.1.2's own builder indexes characters under bm25s 0.3: see
flashrag_runner.build_index).

Timing: wall clock of answering the questions only (each system's model load and index build are reported on
their own rows), median over --repeats, ratio = fastrag q/s / FlashRAG q/s. Both answers are scored with one rule
(fastrag.data.metrics: SQuAD-style normalised EM / token F1 against the gold aliases) on what each system gives as
its answer: the answer fastrag's scorer extracts from its prediction, FlashRAG's `pred` (after its own IRCoT answer parser; standard RAG and
FLARE preds are the generation as FlashRAG returns it). Prompts differ: each system runs as shipped.

A method fastrag does not register is skipped with a message; a method this script
does not know is refused. If FlashRAG cannot be installed or run, the error is written into the results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_args import positive_int  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"
DEFAULT_DATA = SHARED / "hotpotqa" / "dev_distractor_200.jsonl"
DEFAULT_CORPUS = SHARED / "corpus" / "wiki_passages.jsonl"
RUNNER = ROOT / "benchmarks" / "flashrag_runner.py"
FLASHRAG_VERSION = "0.1.2"
# what `import flashrag.pipeline` and the bm25s retriever need beyond the main environment (which already has
# torch, transformers, faiss, spacy, openai, yaml, bm25s, PyStemmer): installed without touching torch/transformers
FLASHRAG_EXTRA = ["tiktoken", "datasets", "nltk", "numba"]

# fastrag method -> the FlashRAG pipeline class that implements the same paper
PIPELINES = {
    "sr-rag": "SequentialPipeline",
    "flare": "FLAREPipeline",
    "ircot": "IRCOTPipeline",
    "iter-retgen": "IterativePipeline",
    "self-ask": "SelfAskPipeline",
}


class BenchError(ValueError):
    """A bad argument, refused before anything heavy runs."""


# ------------------------------------------------------------------------------------------------ corpus


def to_flashrag_record(rec: dict) -> dict:
    """One wiki_passages.jsonl record {id, title, text} in FlashRAG's corpus format: the title is the first line of
    `contents` (FlashRAG's prompt splits it back off there)."""
    title = rec.get("title") or ""
    if "\n" in title:
        raise BenchError(f"passage {rec.get('id')!r}: a title with a newline cannot round-trip through contents")
    return {"id": str(rec["id"]), "contents": f"{title}\n{rec['text']}"}


def from_flashrag_record(rec: dict) -> dict:
    """The inverse of to_flashrag_record (FlashRAG's own split: first line title, the rest text)."""
    title, _, text = rec["contents"].partition("\n")
    return {"id": rec["id"], "title": title, "text": text}


def convert_corpus(src: Path, dst: Path) -> int:
    """Write src (fastrag's {id, title, text} jsonl) as FlashRAG's corpus jsonl; returns the passage count."""
    n = 0
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    with open(src, encoding="utf-8") as f, open(tmp, "w", encoding="utf-8") as g:
        for line in f:
            if line.strip():
                g.write(json.dumps(to_flashrag_record(json.loads(line)), ensure_ascii=False) + "\n")
                n += 1
    tmp.replace(dst)
    return n


# ------------------------------------------------------------------------------------------------ config


def flashrag_config(*, model_dir: str, index_dir: str, corpus_path: str, save_dir: str, max_new_tokens: int,
                    batch_size: int, topk: int, dataset_name: str = "hotpotqa",
                    max_input_len: int = 4096) -> dict:
    """Every key FlashRAG 0.1.2's Config and the three pipelines read (its wheel has no basic_config.yaml to fill
    the rest): HF generator on the CPU, greedy, bm25s retriever, no reranker / refiner / retrieval cache."""
    return {
        # data (questions are handed over in memory; these only name the save folder)
        "dataset_name": dataset_name, "data_dir": save_dir, "split": ["test"], "test_sample_num": None,
        "random_sample": False, "save_dir": save_dir, "save_note": "bench", "seed": 0, "gpu_id": None,
        "save_intermediate_data": False, "save_metric_score": False,
        # generator
        "framework": "hf", "generator_model": "smollm2-135m-instruct", "generator_model_path": model_dir,
        "generator_max_input_len": max_input_len, "generator_batch_size": batch_size, "generator_lora_path": None,
        "generation_params": {"do_sample": False, "max_new_tokens": max_new_tokens},
        "use_fid": False, "gpu_memory_utilization": 0.5,
        # retriever
        "retrieval_method": "bm25", "bm25_backend": "bm25s", "index_path": index_dir, "corpus_path": corpus_path,
        "retrieval_topk": topk, "retrieval_batch_size": 256, "retrieval_use_fp16": False,
        "retrieval_query_max_length": 128, "retrieval_pooling_method": None, "use_sentence_transformer": False,
        "faiss_gpu": False, "instruction": None,
        "save_retrieval_cache": False, "use_retrieval_cache": False, "retrieval_cache_path": None,
        "use_reranker": False, "rerank_model_name": None, "rerank_model_path": None, "rerank_pooling_method": None,
        "rerank_topk": topk, "rerank_max_length": 512, "rerank_batch_size": 256, "rerank_use_fp16": False,
        "refiner_name": None, "refiner_model_path": None,
        "model2path": {}, "model2pooling": {}, "method2index": {"bm25": index_dir},
        # evaluator: built by every pipeline; the runner passes do_eval=False (scoring is ours, one rule for both)
        "metrics": ["em", "f1"], "metric_setting": {"retrieval_recall_topk": topk, "tokenizer_name": None},
    }


def pipeline_kwargs(method: str, cfg) -> dict:
    """FlashRAG pipeline arguments that carry fastrag's bounds for the method (cfg: its fastrag RagConfig), so
    both do the same amount of work at most; each pipeline's rule itself is FlashRAG's."""
    if method == "flare":
        # look-ahead tokens per sentence and the answer-length stop rule as fastrag's FLARE; FlashRAG's own
        # threshold (0.2) and round cap (5) are kept: that is FLARE as FlashRAG ships it
        return {"look_ahead_steps": cfg.look_ahead_tokens, "max_generation_length": cfg.generate_max_length}
    if method == "ircot":
        return {"max_iter": cfg.max_steps}  # (FlashRAG's default 2)
    if method == "iter-retgen":
        return {"iter_num": cfg.iterations}
    if method == "self-ask":
        return {"max_iter": cfg.max_iter, "single_hop": cfg.single_hop}  # (FlashRAG's default single_hop True)
    return {}


def max_new_tokens(method: str, cfg) -> int:
    """Tokens a FlashRAG generation may write: fastrag's per-generation cap for the method (an IRCoT step writes
    thought_max_tokens; every other method's generations are capped at generate_max_length)."""
    return cfg.thought_max_tokens if method == "ircot" else cfg.generate_max_length


# ------------------------------------------------------------------------------------------------ decisions


def _norm_q(q) -> str:
    return " ".join(str(q or "").split())


def replay(method: str, questions: list[str], fr_searches: list[list[dict]], fr_steps: list[list[str]]) -> dict:
    """fastrag's rule applied to FlashRAG's own generations: for each step FlashRAG took, would fastrag have made
    the same decision from the same text? (The model's text is then the same by construction, so what differs is
    the rule alone.) Counts of steps judged and of agreements, per decision; {} for a method with no replay."""
    if method == "ircot":
        from fastrag.methods.ircot import says_answer, thought_text

        # FlashRAG stops on "So the answer is:" in the thought and otherwise searches the whole thought
        stops = searched_same = searched = 0
        n = 0
        for steps, searches in zip(fr_steps, fr_searches):
            for k, t in enumerate(steps):
                n += 1
                fr_stop = "So the answer is:" in t
                stops += fr_stop == says_answer(thought_text(t))
                if not fr_stop and k + 1 < len(searches):
                    searched += 1
                    searched_same += _norm_q(searches[k + 1]["query"]) == _norm_q(thought_text(t))
        return {"steps": n, "stop_agree": stops, "queries": searched, "query_same": searched_same}
    if method == "iter-retgen":
        from fastrag.methods.iter_retgen import next_query

        n = same = 0
        for q, steps, searches in zip(questions, fr_steps, fr_searches):
            for k in range(1, len(searches)):
                n += 1
                same += _norm_q(searches[k]["query"]) == _norm_q(next_query(q, steps[k - 1]))
        return {"queries": n, "query_same": same}
    if method == "self-ask":
        from fastrag.methods.self_ask import FOLLOW_UP, follow_up_question

        # FlashRAG searches the first line holding "Follow up: " of each continuation that has one
        n = found_agree = found = same = 0
        for steps in fr_steps:
            for t in steps:
                n += 1
                fr_q = [x for x in t.split("\n") if FOLLOW_UP in x]
                fa_q = follow_up_question(t)
                found_agree += bool(fr_q) == (fa_q is not None)
                if fr_q and fa_q is not None:
                    found += 1
                    same += _norm_q(fr_q[0].split(FOLLOW_UP)[-1]) == _norm_q(fa_q)
        return {"steps": n, "search_agree": found_agree, "follow_ups": found, "query_same": same}
    return {}


def compare_decisions(method: str, questions: list[str], fr_searches: list[list[dict]], fr_steps: list[list[str]],
                      fa_rounds: list[list[dict]]) -> dict:
    """Retrieval decisions of the two systems on the same questions: searches a question, questions searched the
    same number of times, first queries equal, the first search's shared passages (both BM25 over one corpus,
    each tokenising its own way) and the replay of fastrag's rule on FlashRAG's text."""
    n = len(questions)
    fr_n = [len(x) for x in fr_searches]
    fa_n = [len(x) for x in fa_rounds]
    both = [(a[0], b[0]) for a, b in zip(fr_searches, fa_rounds) if a and b]
    same_first = [(a, b) for a, b in both if _norm_q(a["query"]) == _norm_q(b["query"])]
    overlap = [len(set(a["doc_ids"]) & set(b["doc_ids"])) / max(1, len(b["doc_ids"])) for a, b in same_first]
    return {"questions": n,
            "flashrag_searches_per_question": sum(fr_n) / n if n else None,
            "fastrag_searches_per_question": sum(fa_n) / n if n else None,
            "same_search_count": sum(a == b for a, b in zip(fr_n, fa_n)),
            "first_query_same": len(same_first),
            "first_search_overlap": sum(overlap) / len(overlap) if overlap else None,
            "replay": replay(method, questions, fr_searches, fr_steps)}


# ------------------------------------------------------------------------------------------------ methods


def check_methods(methods: list[str], registered) -> tuple[list[str], dict[str, str]]:
    """(methods to run, {method: why skipped}). A name with no FlashRAG counterpart here is refused (BenchError);
    one fastrag does not register (yet) is skipped with a message."""
    unknown = [m for m in methods if m not in PIPELINES]
    if unknown:
        raise BenchError(f"unknown method(s) {', '.join(unknown)}: this benchmark pairs "
                         f"{', '.join(f'{m} (FlashRAG {p})' for m, p in PIPELINES.items())}")
    run, skipped = [], {}
    for m in methods:
        if m in registered:
            run.append(m)
        else:
            skipped[m] = f"fastrag does not register method {m!r} on this branch (fastrag.methods()): skipped"
    return run, skipped


# ------------------------------------------------------------------------------------------------ scoring


def compare_answers(fr_preds: list[str], fa_preds: list[str], golds: list[list[str]]) -> dict:
    """EM/F1 of each system under one rule, and how many answers agree after normalisation."""
    from fastrag.data.metrics import exact_match, f1_score, normalize_answer

    if not (len(fr_preds) == len(fa_preds) == len(golds)):
        raise ValueError(f"lengths differ: {len(fr_preds)} FlashRAG, {len(fa_preds)} fastrag, {len(golds)} golds")
    n = len(golds)

    def mean(xs):
        return sum(xs) / n if n else None

    return {
        "n": n,
        "flashrag_em": mean([exact_match(p, g) for p, g in zip(fr_preds, golds)]),
        "flashrag_f1": mean([f1_score(p, g) for p, g in zip(fr_preds, golds)]),
        "fastrag_em": mean([exact_match(p, g) for p, g in zip(fa_preds, golds)]),
        "fastrag_f1": mean([f1_score(p, g) for p, g in zip(fa_preds, golds)]),
        "agree": sum(normalize_answer(a) == normalize_answer(b) for a, b in zip(fr_preds, fa_preds)),
    }


def fastrag_answers(examples: list, predictions: list[str]) -> list[str]:
    """The answers fastrag scores (fastrag.data.metrics.score: extracted after 'the answer is', per dataset rule)
    from its predictions; FlashRAG's are scored on its `pred` as its evaluator would."""
    from fastrag.data.metrics import score

    return [score(ex, p or "")["answer"] for ex, p in zip(examples, predictions)]


def rescore(report: dict, examples: list) -> None:
    """Recompute each row's EM/F1/agreement from the predictions stored in it (the first row['n'] examples)."""
    for row in report["rows"]:
        if not row.get("fastrag_predictions"):
            continue
        ex = examples[:row["n"]]
        fa = fastrag_answers(ex, row["fastrag_predictions"])
        row["fastrag_answers"] = fa
        golds = [list(e.answers) for e in ex]
        if row.get("flashrag_predictions"):
            row.update(compare_answers(row["flashrag_predictions"], fa, golds))


def rate_row(method: str, n: int, flashrag_s: list[float] | None, fastrag_s: list[float] | None) -> dict:
    """q/s of each system from the median wall time of its repeats, and fastrag / FlashRAG."""
    def qps(times):
        return n / statistics.median(times) if times else None

    fr, fa = qps(flashrag_s), qps(fastrag_s)
    return {"method": method, "n": n, "flashrag_wall_s": flashrag_s, "fastrag_wall_s": fastrag_s,
            "flashrag_qps": fr, "fastrag_qps": fa, "ratio": fa / fr if fr and fa else None}


def _f(x, digits=3):
    return "—" if x is None else f"{x:.{digits}f}"


def _work_line(r: dict) -> str:
    """What each system did per question, where recorded (the two FLAREs retrieve on different rules)."""
    parts = []
    if r.get("fastrag_retrievals_per_question") is not None:
        parts.append(f"fastrag {r['fastrag_retrievals_per_question']:.2f} retrievals, "
                     f"{_f(r.get('fastrag_prefill_tokens_per_question'), 0)} prefilled and "
                     f"{_f(r.get('fastrag_decode_tokens_per_question'), 0)} decoded tokens a question")
    rounds = [x for x in (r.get("flashrag_retrieval_rounds") or []) if x is not None]
    if rounds:
        parts.append(f"FlashRAG {sum(rounds) / len(rounds):.2f} retrievals a question (its FLARE retrieves only "
                     "in rounds judged unconfident, none up front)")
    return "; " + "; ".join(parts) if parts else ""


def render_markdown(report: dict) -> str:
    rows = report["rows"]
    lines = ["# fastrag vs FlashRAG, side by side (CPU)", "",
             f"The first N questions (the table's column) of {report['dataset']} (`{report['data']}`), the same "
             "questions for both; "
             f"BM25 over `{report['corpus']}`, top-{report['topk']}; SmolLM2-135M-Instruct (the embedded GGUF, "
             f"dequantised to an HF folder that both load) in fp32 on the CPU, greedy; batch size "
             f"{report['batch_size']} on both; {report['threads']} torch thread(s) each. q/s: questions over the "
             f"median wall time of answering them ({report['repeats']} repeat(s)), model load and index build "
             "excluded (listed below). ratio = fastrag q/s / FlashRAG q/s, measured in the same run. EM / F1: one "
             "rule for both (fastrag.data.metrics, SQuAD-normalised) on each system's answer; agree: answers equal "
             "after normalisation.", "",
             "| method | FlashRAG pipeline | questions | FlashRAG q/s | fastrag q/s | ratio | FlashRAG EM / F1 | "
             "fastrag EM / F1 | agree |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        agree = f"{r['agree']}/{r['n']}" if r.get("agree") is not None else "—"
        lines.append(f"| {r['method']} | {PIPELINES[r['method']]} | {r['n']} | {_f(r.get('flashrag_qps'), 4)} | "
                     f"{_f(r.get('fastrag_qps'), 4)} | {_f(r.get('ratio'), 2)}x | "
                     f"{_f(r.get('flashrag_em'))} / {_f(r.get('flashrag_f1'))} | "
                     f"{_f(r.get('fastrag_em'))} / {_f(r.get('fastrag_f1'))} | {agree} |")
    for m, why in report.get("skipped", {}).items():
        lines.append(f"| {m} | {PIPELINES[m]} | — | — | — | — | — | — | skipped: {why} |")
    lines += ["", "Wall seconds of each repeat, loads and builds:", ""]
    for r in rows:
        lines.append(f"- {r['method']}: FlashRAG {r.get('flashrag_wall_s')} s (pipeline load "
                     f"{_f(r.get('flashrag_load_s'), 1)} s), fastrag {r.get('fastrag_wall_s')} s; fastrag errors "
                     f"{r.get('fastrag_errors', '—')}; FlashRAG config: {r.get('flashrag_pipeline_kwargs')}, "
                     f"max_new_tokens {r.get('max_new_tokens')}" + _work_line(r))
    lines += decisions_markdown(rows)
    s = report.get("setup", {})
    lines += [f"- fastrag engine + BM25 load: {_f(s.get('fastrag_load_s'), 1)} s; FlashRAG corpus conversion "
              f"{_f(s.get('corpus_convert_s'), 1)} s, bm25s index build "
              f"{_f(s.get('flashrag_index_s'), 1)} s; venv setup {_f(s.get('venv_s'), 1)} s (— : done by an "
              "earlier run, reused)", ""]
    if report.get("errors"):
        lines += ["## Errors", ""]
        for e in report["errors"]:
            lines += [f"- **{e['where']}**: `{e['error']}`"]
            if e.get("detail"):
                lines += ["", "```", e["detail"].strip()[-3000:], "```"]
        lines.append("")
    lines += ["## What differs between the two (systems as shipped)", ""] + [f"- {x}" for x in report["notes"]]
    commands = list(dict.fromkeys([report["command"]] + [r["command"] for r in rows if r.get("command")]))
    lines += ["", "## Commands", "", "```"] + commands + report.get("setup_commands", []) + ["```", "",
              "The scratch venv the script makes when it is missing (`--venv`):", "", "```"] + SETUP_COMMANDS + [
              "```", "",
              "## Versions", "", "```", json.dumps(report["versions"], indent=1), "```", ""]
    return "\n".join(lines)


def decisions_markdown(rows: list[dict]) -> list[str]:
    """The retrieval-decision table (rows that carry `decisions`) and the replay lines under it."""
    rows = [r for r in rows if r.get("decisions")]
    if not rows:
        return []
    out = ["", "Retrieval decisions on the same questions (searches: retriever calls a question, the question's "
           "own search included; first search overlap: the share of fastrag's first passages FlashRAG's first "
           "search also returned, where both searched the same first query):", "",
           "| method | searches a question FlashRAG / fastrag | same number of searches | same first query | "
           "first search overlap |", "|---|---|---|---|---|"]
    for r in rows:
        d = r["decisions"]
        out.append(f"| {r['method']} | {_f(d['flashrag_searches_per_question'], 2)} / "
                   f"{_f(d['fastrag_searches_per_question'], 2)} | {d['same_search_count']}/{d['questions']} | "
                   f"{d['first_query_same']}/{d['questions']} | {_f(d['first_search_overlap'], 2)} |")
    out += ["", "fastrag's rule replayed on FlashRAG's own generations (the same text, so only the rule differs):",
            ""]
    for r in rows:
        rp = r["decisions"].get("replay") or {}
        if r["method"] == "ircot" and rp:
            out.append(f"- ircot: {rp['stop_agree']}/{rp['steps']} thoughts get the same stop-or-search decision "
                       "(FlashRAG: \"So the answer is:\" in the thought; fastrag: \"answer is\" in any case, in the "
                       f"thought's first line); {rp['query_same']}/{rp['queries']} searched thoughts give the same "
                       "query (FlashRAG searches the whole thought, fastrag its first line's first sentence)")
        elif r["method"] == "iter-retgen" and rp:
            out.append(f"- iter-retgen: {rp['query_same']}/{rp['queries']} queries of rounds 2.. are the same "
                       "(both `question + previous generation`; fastrag cuts the generation before an imagined "
                       "next \"Question:\")")
        elif r["method"] == "self-ask" and rp:
            out.append(f"- self-ask: {rp['search_agree']}/{rp['steps']} continuations get the same search-or-not "
                       f"decision (a \"Follow up: \" line); {rp['query_same']}/{rp['follow_ups']} follow-ups both "
                       "find give the same question")
    return out + [""]


SETUP_COMMANDS = [
    "python -m venv --system-site-packages runs/flashrag-venv",
    f"runs/flashrag-venv/bin/python -m pip install --no-deps flashrag-dev=={FLASHRAG_VERSION}",
    f"runs/flashrag-venv/bin/python -m pip install {' '.join(FLASHRAG_EXTRA)}",
    "runs/flashrag-venv/bin/python benchmarks/flashrag_runner.py --build-index runs/flashrag/corpus.jsonl "
    "runs/flashrag/index_stemmed/bm25",
]

NOTES = [
    "Prompts: fastrag uses the DRAGIN-paper prompts (the dataset's chain-of-thought exemplars, the answer extracted "
    "after 'the answer is'; Self-Ask its own four exemplars in the paper's format); FlashRAG's SequentialPipeline, "
    "FLAREPipeline and IterativePipeline use its default template (system: 'Answer the question based on the "
    "given document. Only give me the answer...' with the documents, the chat template of the instruct model, no "
    "exemplars), its IRCOTPipeline its one-exemplar IRCoT prompt, its SelfAskPipeline the paper's exemplars. The "
    "answers are therefore of different shapes (a short answer vs a reasoning chain) and EM/F1 compare systems, "
    "not the same prompt.",
    "Decoding: both greedy, the same max new tokens a generation (fastrag's cap for the method: "
    "generate_max_length; an IRCoT step's thought_max_tokens); FlashRAG's HF generator pads a batch on the left and "
    "runs transformers' generate (no paged KV, no prefix sharing); FlashRAG's FLARE, IRCoT and Self-Ask pipelines "
    "answer one question at a time (their run() loops over items), its Sequential and Iterative pipelines batch "
    "generator_batch_size prompts.",
    "Bounds: each FlashRAG pipeline gets fastrag's bounds for the method, its rule is its own. FLARE: FlashRAG's "
    "threshold 0.2 (retrieve when a look-ahead token has p <= 0.2) and at most 5 rounds, with the look-ahead (64) "
    "and total length (fastrag's L) set to fastrag's; fastrag's FLARE uses the paper's theta 0.8 / beta 0.4 on "
    "HotpotQA and retrieves with the question first. IRCoT: max_iter = fastrag's max_steps (5; FlashRAG's default "
    "2). Iter-RetGen: iter_num = 3 (both defaults). Self-Ask: max_iter 5, single_hop false as fastrag's (FlashRAG's "
    "default single_hop is true).",
    "Retrieval: both BM25 over the same 13,509 passages, top 3, each system's own tokenisation (FlashRAG: "
    "bm25s.tokenize with an English stemmer, as its BM25Retriever tokenises queries), so the passages can differ. "
    "FlashRAG's index is not built by its own `flashrag.retriever.index_builder`: in 0.1.2 that hands bm25s 0.3 "
    "the raw strings, which indexes characters (a 1,332-entry vocabulary of single characters); every query then "
    "scores 0 and each question gets the corpus's first 3 passages (seen here: p000002, p000001, p000000 for "
    "every question). The runner builds the index FlashRAG's retriever expects (flashrag_runner.build_index) and "
    "FlashRAG's BM25Retriever loads and queries it unchanged.",
    "FlashRAG setup: flashrag-dev 0.1.2 installed --no-deps into a scratch venv with --system-site-packages, plus "
    f"{', '.join(FLASHRAG_EXTRA)} (its import path / bm25s backend); its wheel lacks "
    "flashrag/config/basic_config.yaml, so the runner builds Config from a complete dict "
    "(bench_flashrag.flashrag_config). Its searches are logged by wrapping its retriever on the instance "
    "(flashrag_runner.log_searches); its code is not changed.",
    "Threads: both systems ran with the same torch thread count (--threads), one system at a time. One thread "
    "each on a 2-core machine: with other jobs on it, 2 OpenMP threads made FlashRAG's HF generate about 10x "
    "slower than 1 (2 SR-RAG questions: 690 s against 65 s, same answers), threads waiting on descheduled peers.",
]


# ------------------------------------------------------------------------------------------------ setup


def _sh(cmd: list[str], log: list[str], timeout: float | None = None) -> subprocess.CompletedProcess:
    log.append(" ".join(shlex.quote(str(c)) for c in cmd))
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)


def ensure_venv(venv: Path, log: list[str]) -> Path:
    """The scratch venv's python, with flashrag-dev importable; raises RuntimeError with pip's output if not."""
    py = venv / "bin" / "python"
    if not py.exists():
        r = _sh([sys.executable, "-m", "venv", "--system-site-packages", venv], log)
        if r.returncode:
            raise RuntimeError(f"venv creation failed: {r.stderr[-2000:]}")
    probe = [py, "-c", "import flashrag.pipeline, flashrag.retriever, numba"]
    if subprocess.run([str(c) for c in probe], capture_output=True).returncode == 0:
        return py
    for cmd in ([py, "-m", "pip", "install", "--no-deps", f"flashrag-dev=={FLASHRAG_VERSION}"],
                [py, "-m", "pip", "install", *FLASHRAG_EXTRA]):
        r = _sh(cmd, log, timeout=1800)
        if r.returncode:
            raise RuntimeError(f"{' '.join(map(str, cmd))} failed (rc {r.returncode}): {r.stderr[-3000:]}")
    r = _sh(probe, log)
    if r.returncode:
        raise RuntimeError(f"flashrag installed but does not import: {r.stderr[-3000:]}")
    return py


def build_flashrag_index(py: Path, corpus: Path, save_dir: Path, log: list[str]) -> Path:
    """The bm25s index under save_dir/bm25, built by the runner in FlashRAG's query tokenisation (why not
    FlashRAG's own index_builder: flashrag_runner.build_index)."""
    index = save_dir / "bm25"
    if (index / "params.index.json").exists():
        return index
    r = _sh([py, RUNNER, "--build-index", corpus, index], log, timeout=3600)
    if r.returncode or not (index / "params.index.json").exists():
        raise RuntimeError(f"FlashRAG index build failed (rc {r.returncode}): {r.stderr[-3000:]}")
    return index


def run_flashrag(py: Path, job: dict, work: Path, timeout: float) -> dict:
    job_path = work / f"job_{job['method']}.json"
    job["result"] = str(work / f"result_{job['method']}.json")
    Path(job["result"]).unlink(missing_ok=True)
    job_path.write_text(json.dumps(job))
    try:
        r = subprocess.run([str(py), str(RUNNER), str(job_path)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"FlashRAG run exceeded --flashrag-timeout {timeout:.0f} s"}
    if not Path(job["result"]).exists():
        return {"error": f"runner exited {r.returncode} without a result", "traceback": r.stderr[-4000:]}
    return json.loads(Path(job["result"]).read_text())


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["sr-rag", "flare", "ircot"])
    p.add_argument("--limit", type=positive_int, default=50, help="questions (the first N of --data)")
    p.add_argument("--dataset", default="hotpotqa")
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--corpus", default=str(DEFAULT_CORPUS))
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--topk", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=2, help="torch threads of each system")
    p.add_argument("--repeats", type=positive_int, default=1)
    p.add_argument("--venv", default=str(ROOT / "runs" / "flashrag-venv"))
    p.add_argument("--work", default=str(ROOT / "runs" / "flashrag"), help="scratch: corpus, index, jobs")
    p.add_argument("--flashrag-timeout", type=float, default=3600)
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--name", default="flashrag_side_by_side_cpu")
    p.add_argument("--note", action="append", default=[],
                   help="a line added to the notes (e.g. why fewer questions); may be given more than once")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite the .md from the results JSON (nothing runs)")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of other methods already in the results JSON (each row names its command)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import fastrag
    from fastrag.config import method_config
    from fastrag.data.datasets import load_examples

    if args.report_only:
        path = Path(args.results) / f"{args.name}.json"
        report = json.loads(path.read_text())
        measured = {r["method"] for r in report["rows"]}
        report["skipped"] = {m: f"fastrag does not register method {m!r} on this branch (fastrag.methods())"
                             for m in PIPELINES if m not in measured and m not in fastrag.methods()}
        report["notes"] = NOTES + args.note
        rescore(report, load_examples(report["dataset"], report["data"], limit=max(r["n"] for r in report["rows"])))
        path.write_text(json.dumps(report, indent=1, default=str) + "\n")
        (path.with_suffix(".md")).write_text(render_markdown(report))
        return 0

    try:
        methods, skipped = check_methods(args.methods, fastrag.methods())
    except BenchError as e:
        sys.exit(f"bench_flashrag.py: error: {e}")
    for m, why in skipped.items():
        print(f"[bench_flashrag] {why}", flush=True)

    import torch

    torch.set_num_threads(args.threads)
    examples = load_examples(args.dataset, args.data, limit=args.limit)
    questions = [{"id": e.qid, "question": e.question, "golden_answers": list(e.answers)} for e in examples]
    golds = [q["golden_answers"] for q in questions]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    report = {"n": len(questions), "dataset": args.dataset, "data": args.data, "corpus": args.corpus,
              "topk": args.topk, "batch_size": args.batch_size, "threads": args.threads, "repeats": args.repeats,
              "command": "nice -n 5 python benchmarks/bench_flashrag.py " + " ".join(
                  shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
              "rows": [], "skipped": skipped, "errors": [], "notes": NOTES + args.note, "setup": {}, "setup_commands": []}
    from importlib.metadata import version as _v

    report["versions"] = {"fastrag": _v("fastrag") if _has_dist("fastrag") else "?", "torch": torch.__version__,
                          "python": platform.python_version(), "machine": platform.processor() or platform.machine(),
                          "cpu_count": os.cpu_count()}
    try:
        from fastrag.provenance import cpu_name

        report["versions"]["cpu"] = cpu_name()
    except Exception:  # only a label
        pass

    # FlashRAG side: venv, corpus, index (each failure recorded; fastrag still runs so the file says what it can)
    py = index = None
    fr_corpus = work / "corpus.jsonl"
    try:
        t0 = time.perf_counter()
        py = ensure_venv(Path(args.venv), report["setup_commands"])
        if report["setup_commands"]:  # (only when this run installed something)
            report["setup"]["venv_s"] = time.perf_counter() - t0
        if not fr_corpus.exists():
            t0 = time.perf_counter()
            convert_corpus(Path(args.corpus), fr_corpus)
            report["setup"]["corpus_convert_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        cached = (work / "index_stemmed" / "bm25" / "params.index.json").exists()
        index = build_flashrag_index(py, fr_corpus, work / "index_stemmed", report["setup_commands"])
        if not cached:  # (a cached index has no build time to report; --merge keeps the run's that built it)
            report["setup"]["flashrag_index_s"] = time.perf_counter() - t0
    except Exception as e:
        report["errors"].append({"where": "FlashRAG setup", "error": f"{type(e).__name__}: {str(e)[:400]}",
                                 "detail": str(e)})
        py = None

    from fastrag.model.loading import resolve_model

    model_dir = resolve_model("smollm2")  # the HF folder fastrag converts its GGUF to (both systems load it)
    rag = fastrag.RAG(model="smollm2", retriever=fastrag.BM25(corpus=args.corpus), batch_size=args.batch_size,
                      device="cpu", threads=args.threads)
    t0 = time.perf_counter()
    rag.engine, rag.retriever  # (built here so the timed runs exclude them)
    report["setup"]["fastrag_load_s"] = time.perf_counter() - t0

    for method in methods:
        cfg = method_config(method, args.dataset)
        row_extra = {"max_new_tokens": max_new_tokens(method, cfg)}
        fr_times = fr_preds = None
        if py is not None:
            kwargs = pipeline_kwargs(method, cfg)
            job = {"method": method, "pipeline": PIPELINES[method], "pipeline_kwargs": kwargs,
                   "threads": args.threads, "repeats": args.repeats, "questions": questions,
                   "config": flashrag_config(model_dir=str(model_dir), index_dir=str(index),
                                             corpus_path=str(fr_corpus), save_dir=str(work / "save"),
                                             max_new_tokens=max_new_tokens(method, cfg), batch_size=args.batch_size,
                                             topk=args.topk, dataset_name=args.dataset)}
            print(f"[bench_flashrag] FlashRAG {PIPELINES[method]} on {len(questions)} questions", flush=True)
            res = run_flashrag(py, job, work, args.flashrag_timeout)
            row_extra["flashrag_pipeline_kwargs"] = kwargs
            if "error" in res:
                report["errors"].append({"where": f"FlashRAG {PIPELINES[method]}", "error": res["error"],
                                         "detail": res.get("traceback")})
            else:
                fr_times, fr_preds = res["run_s"], res["predictions"]
                row_extra.update(flashrag_load_s=res["load_s"], flashrag_predictions=fr_preds,
                                 flashrag_raw_predictions=res["raw_predictions"],
                                 flashrag_retrievals=res["retrievals"], flashrag_prompt_example=res["prompt_example"],
                                 flashrag_retrieval_rounds=res.get("retrieval_rounds"),
                                 flashrag_searches=res.get("searches"), flashrag_steps=res.get("steps"))
                report["versions"].setdefault("flashrag_env", res["versions"])
        print(f"[bench_flashrag] fastrag {method} on {len(questions)} questions", flush=True)
        fa_times, results = [], None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            results = rag.run([{"id": q["id"], "question": q["question"], "answers": q["golden_answers"]}
                               for q in questions], method=method, dataset=args.dataset, progress=False)
            fa_times.append(time.perf_counter() - t0)
        fa_preds = [r.prediction or "" for r in results]
        fa_rounds = [[{"query": x.query, "doc_ids": list(x.doc_ids)} for x in r.rounds if x.query is not None]
                     for r in results]
        fa_answers = fastrag_answers(examples, fa_preds)
        row = rate_row(method, len(questions), fr_times, fa_times)
        row.update(row_extra, fastrag_errors=len(results.errors), fastrag_predictions=fa_preds,
                   fastrag_answers=fa_answers, fastrag_searches=fa_rounds,
                   fastrag_retrievals_per_question=results.metrics.get("retrievals_per_question"),
                   fastrag_decode_tokens_per_question=results.metrics.get("decode_tokens_per_question"),
                   fastrag_prefill_tokens_per_question=results.metrics.get("prefill_tokens_per_question"),
                   fastrag_metrics_em=results.metrics.get("em"), fastrag_metrics_f1=results.metrics.get("f1"))
        if fr_preds is not None:
            row.update(compare_answers(fr_preds, fa_answers, golds))
            if row_extra.get("flashrag_searches") is not None:
                row["decisions"] = compare_decisions(method, [q["question"] for q in questions],
                                                     row_extra["flashrag_searches"], row_extra["flashrag_steps"],
                                                     fa_rounds)
        else:
            row.update(compare_answers(fa_answers, fa_answers, golds), flashrag_em=None, flashrag_f1=None,
                       agree=None)
        row["command"] = report["command"]
        report["rows"].append(row)
        _write(report, args)  # after every method: an interrupted run still leaves what it measured
        print(f"[bench_flashrag] {method}: FlashRAG {_f(row['flashrag_qps'], 4)} q/s, fastrag "
              f"{_f(row['fastrag_qps'], 4)} q/s, ratio {_f(row['ratio'], 2)}", flush=True)
    _write(report, args)
    return 0


def _has_dist(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(name)
        return True
    except PackageNotFoundError:
        return False


def merged_rows(old_rows: list[dict], new_rows: list[dict]) -> list[dict]:
    """Rows of an earlier run for methods this run did not measure, then this run's, in PIPELINES order."""
    mine = {r["method"] for r in new_rows}
    rows = [r for r in old_rows if r["method"] not in mine] + list(new_rows)
    order = list(PIPELINES)
    return sorted(rows, key=lambda r: order.index(r["method"]))


def _write(report: dict, args) -> None:
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    if getattr(args, "merge", False) and (out / f"{args.name}.json").exists():
        old = json.loads((out / f"{args.name}.json").read_text())
        report = {**report, "rows": merged_rows(old.get("rows", []), report["rows"]),
                  "errors": [e for e in old.get("errors", []) if e not in report["errors"] and not any(
                      e["where"].endswith(PIPELINES[r["method"]]) for r in report["rows"])] + report["errors"],
                  "setup": {**old.get("setup", {}), **report["setup"]}}
        report["skipped"] = {m: w for m, w in report["skipped"].items()
                             if m not in {r["method"] for r in report["rows"]}}
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / f"{args.name}.md").write_text(render_markdown(report))


if __name__ == "__main__":
    sys.exit(main())
