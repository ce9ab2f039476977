"""Runs one FlashRAG pipeline on a job file written by bench_flashrag.py; prints nothing the caller needs and
writes the result JSON named in the job.

This file is executed by the scratch venv's python (the one that has `flashrag-dev` installed), never imported by
fastrag: FlashRAG is not a fastrag dependency. It only needs flashrag, torch and transformers.

    runs/flashrag-venv/bin/python benchmarks/flashrag_runner.py JOB.json

The job holds the FlashRAG config dict, the pipeline name and its keyword arguments, the questions and the number
of repeats. The result holds the model/index load time, the wall time of each repeat (pipeline.run over all the
questions, evaluation off), the predictions of the last repeat and the versions; on failure, the error and its
traceback (the caller records them).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def make_config(config_dict: dict):
    """FlashRAG's Config from our dict alone.

    The PyPI wheel (flashrag-dev 0.1.2) does not ship flashrag/config/basic_config.yaml, which Config opens
    unconditionally; the job's dict carries every key the pipelines read, so a missing packaged file is replaced
    by an empty one (a packaged one, where present, is kept and our dict overrides it)."""
    from flashrag.config import Config

    packaged = os.path.join(os.path.dirname(sys.modules["flashrag.config.config"].__file__), "basic_config.yaml")
    if os.path.exists(packaged):
        return Config(config_dict=config_dict)

    class DictOnlyConfig(Config):
        def _get_internal_config(self):
            return {}

    return DictOnlyConfig(config_dict=config_dict)


def build_pipeline(name: str, config, kwargs: dict):
    from flashrag import pipeline

    cls = getattr(pipeline, name)
    return cls(config, **kwargs)


def make_dataset(config, questions: list[dict]):
    from flashrag.dataset import Dataset, Item

    items = [Item({"id": q["id"], "question": q["question"], "golden_answers": q["golden_answers"]})
             for q in questions]
    return Dataset(config=config, data=items)


def _plain(x):
    """JSON-safe copy (bm25s hands back numpy arrays of dicts)."""
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def _doc_ids(docs) -> list:
    """Passage ids of one question's retrieval result (a list, or bm25s's numpy array, of corpus dicts)."""
    if docs is None:
        return []
    return [_plain(d.get("id")) if isinstance(d, dict) else _plain(d) for d in list(docs)]


def log_searches(pipe, n_items: int) -> tuple[list[list[dict]], dict]:
    """Every retrieval the pipeline makes, per question: [{"query", "doc_ids"}] in call order.

    The pipeline's retriever is wrapped on the instance (FlashRAG's code is not touched). `search` (one query) is
    charged to the item whose run_item is running, so run_item is wrapped to say which; `batch_search` is called
    with one query per item of the dataset in order (SequentialPipeline, IterativePipeline's rounds). Returns the
    log and its state: the item run_item is on, and whether logging is on (the caller turns it off after a run)."""
    log: list[list[dict]] = [[] for _ in range(n_items)]
    state = {"item": -1, "on": True}
    retriever = pipe.retriever
    search, batch_search = retriever.search, retriever.batch_search

    def _results(out):
        return out[0] if isinstance(out, tuple) else out

    def logged_search(query, *args, **kwargs):
        no_terms = _no_bm25s_terms(retriever, query)
        if no_terms:
            # bm25s raises on a query with no indexed term (an empty or stopword-only IRCoT thought, which FlashRAG
            # 0.1.2 searches as it is) and the whole run dies; its pyserini backend answers such a query with no
            # documents, and so does this
            out = ([], []) if kwargs.get("return_score") or (len(args) > 1 and args[1]) else []
        else:
            out = search(query, *args, **kwargs)
        if state["on"] and 0 <= state["item"] < n_items:
            log[state["item"]].append({"query": str(query), "doc_ids": _doc_ids(_results(out)),
                                       **({"no_terms": True} if no_terms else {})})
        return out

    def logged_batch_search(queries, *args, **kwargs):
        out = batch_search(queries, *args, **kwargs)
        qs = [queries] if isinstance(queries, str) else list(queries)
        if state["on"] and len(qs) == n_items:
            for i, (q, docs) in enumerate(zip(qs, _results(out))):
                log[i].append({"query": str(q), "doc_ids": _doc_ids(docs)})
        return out

    retriever.search, retriever.batch_search = logged_search, logged_batch_search
    if hasattr(pipe, "run_item"):
        run_item = pipe.run_item

        def counted_run_item(item):
            state["item"] += 1
            return run_item(item)

        pipe.run_item = counted_run_item
    return log, state


def _no_bm25s_terms(retriever, query) -> bool:
    """Whether a bm25s-backed FlashRAG retriever would find no indexed term in `query` (bm25s.retrieve raises then)."""
    if getattr(retriever, "backend", None) != "bm25s":
        return False
    import bm25s

    tokens = bm25s.tokenize([str(query)], stemmer=getattr(retriever, "stemmer", None), show_progress=False)
    return not tokens.vocab


def step_texts(item) -> list[str]:
    """The text each generation step of a multi-step pipeline wrote for one item, in order: IRCoT's thoughts,
    Self-Ask's continuations, Iter-RetGen's round answers (empty for one-step pipelines)."""
    out = item.output
    keys = sorted((k for k in out if k.startswith("intermediate_output_iter") or k.startswith("pred_iter_")),
                  key=lambda k: int(k.rsplit("iter", 1)[1].lstrip("_")))
    texts = []
    for k in keys:
        v = out[k]
        texts.append(str(v.get("new_thought", "")) if isinstance(v, dict) else str(v))
    return texts


def build_index(corpus_path: str, save_dir: str) -> int:
    """The bm25s index FlashRAG's BM25Retriever loads (`bm25s.BM25.load(index_path, load_corpus=True)`), tokenised
    as that retriever tokenises its queries (bm25s.tokenize with an English PyStemmer).

    FlashRAG 0.1.2's own builder (`python -m flashrag.retriever.index_builder --retrieval_method bm25`) hands bm25s
    the raw strings; bm25s 0.3 then indexes each string's characters (a vocabulary of single characters), and every
    stemmed word query scores 0 against it, so each question gets the corpus's first passages. This builds what
    that builder means to build."""
    import bm25s
    import Stemmer

    with open(corpus_path, encoding="utf-8") as f:
        corpus = [json.loads(line) for line in f if line.strip()]
    tokens = bm25s.tokenize([d["contents"] for d in corpus], stemmer=Stemmer.Stemmer("english"), show_progress=False)
    index = bm25s.BM25()
    index.index(tokens, show_progress=False)
    index.save(save_dir, corpus=corpus)
    return len(corpus)


def main(job_path: str) -> int:
    with open(job_path) as f:
        job = json.load(f)
    out: dict = {"method": job["method"], "pipeline": job["pipeline"]}
    try:
        import torch

        torch.set_num_threads(job["threads"])
        import transformers
        from importlib.metadata import version

        out["versions"] = {"flashrag-dev": version("flashrag-dev"), "torch": torch.__version__,
                           "transformers": transformers.__version__, "bm25s": version("bm25s"),
                           "python": sys.version.split()[0]}
        t0 = time.perf_counter()
        config = make_config(job["config"])
        pipe = build_pipeline(job["pipeline"], config, job.get("pipeline_kwargs", {}))
        out["load_s"] = time.perf_counter() - t0
        out["run_s"] = []
        for _ in range(job["repeats"]):
            dataset = make_dataset(config, job["questions"])  # fresh items: a pipeline writes its outputs into them
            searches, state = log_searches(pipe, len(job["questions"])) if "searches" not in out else (None, None)
            t0 = time.perf_counter()
            # do_eval=False: scoring is done by the caller with one rule for both systems; IRCoT's answer parser
            # is its run() default and still applies
            dataset = pipe.run(dataset, do_eval=False)
            out["run_s"].append(time.perf_counter() - t0)
            if searches is not None:  # (the first repeat's log; the wrappers stay on, silent)
                out["searches"] = searches
                state["on"] = False
        out["predictions"] = [str(item.pred) for item in dataset.data]
        out["raw_predictions"] = [str(item.output.get("raw_pred", item.pred)) for item in dataset.data]
        out["retrievals"] = [_doc_ids(item.output.get("retrieval_result")) for item in dataset.data]
        # FLARE: a round retrieves when its look-ahead sentence is judged unconfident (judge_result_iter* False)
        out["retrieval_rounds"] = [sum(1 for k, v in item.output.items() if k.startswith("judge_result_iter") and not v)
                                   if job["pipeline"] == "FLAREPipeline" else None for item in dataset.data]
        out["steps"] = [step_texts(item) for item in dataset.data]
        out["prompt_example"] = _plain(dataset.data[0].output.get("prompt")) if dataset.data else None
    except Exception as e:  # the caller records the error in the results file
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
    with open(job["result"], "w") as f:
        json.dump(out, f, indent=1)
    return 1 if "error" in out else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--build-index":
        print(build_index(sys.argv[2], sys.argv[3]), "passages indexed")
        sys.exit(0)
    if len(sys.argv) != 2:
        sys.exit("usage: flashrag_runner.py JOB.json | flashrag_runner.py --build-index CORPUS.jsonl INDEX_DIR")
    sys.exit(main(sys.argv[1]))
