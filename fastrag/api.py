"""fastrag's public API: a `RAG` (an engine and a retriever) that answers questions with a dynamic-RAG method.

    from fastrag import RAG, BM25

    rag = RAG(model="smollm2", retriever=BM25(), batch_size=8)
    results = rag.run(["Who was born first, Albert Einstein or Niels Bohr?"], method="dragin", dataset="hotpotqa")
    results[0].prediction, results.metrics["questions_per_s"]

`run` is the batch evaluator (`fastrag run`) with the questions in memory: the same engine, question loop, scoring
and metrics (fastrag.eval), writing results.jsonl / metrics.json only when given `out=`. `stream` and `submit` put
one question at a time through the serving front (fastrag.serving.AsyncEngine), as `fastrag serve` does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, AsyncIterator, Iterable

from fastrag.specs import BM25, Dense, Elasticsearch, EngineConfig, RetrieverSpec, retriever_spec
from fastrag.trace import QuestionResult

__all__ = ["BM25", "Dense", "Elasticsearch", "EngineConfig", "QuestionResult", "RAG", "Results", "methods",
           "retriever_spec"]

QUESTION_KEYS = ("question", "answers", "golden_answers", "id", "answer_id")
DEFAULT_DATASET = "hotpotqa"  # (questions given in memory without a dataset: its exemplars and answer rules)


class Results(list):
    """The records of a `RAG.run`, one `QuestionResult` per question in the order given, and `.metrics`.

    Each record: `.question`, `.prediction` (the extracted answer), `.text` (the whole generation), `.rounds` (the
    method's generate/retrieve rounds: `.query`, `.docs`, ...), `.metrics` ({"em", "f1", ...} when the question
    came with gold answers, else {}), `.error` (None, or why this question failed), token counts and seconds.

    `.metrics` is the dict metrics.json holds (fastrag.eval.summarize and what the engine measured): n, errors,
    em and f1 (means over the questions with gold answers; None when none had any), questions_per_s, tokens_per_s,
    retrievals_per_question, wall_s, engine counters, ...

        for r in results:
            print(r.question, "->", r.prediction, r.metrics.get("f1"))
        results.metrics["em"], results.metrics["questions_per_s"]
    """

    def __init__(self, records: Iterable[QuestionResult] = (), metrics: dict | None = None):
        super().__init__(records)
        self.metrics: dict = dict(metrics or {})

    @property
    def predictions(self) -> list[str]:
        return [r.prediction for r in self]

    @property
    def errors(self) -> list[QuestionResult]:
        return [r for r in self if r.error is not None]

    def __repr__(self) -> str:
        m = self.metrics
        return f"Results({len(self)} questions, em={m.get('em')!r}, f1={m.get('f1')!r})"


def methods() -> dict[str, str]:
    """The registered methods: name -> one line naming its paper and rule (`fastrag methods` prints them)."""
    from fastrag.methods.registry import methods as registered

    return registered()


def as_examples(questions, dataset: str) -> list:
    """The Examples of in-memory questions: strings, dicts {"question", "answers" | "golden_answers", "id",
    "answer_id"} or fastrag.data Example objects (mixed freely); answer_id: the key of the question's answer aliases
    (RAG.run's answer_aliases). Questions without an id get "q<index>"; ids must not repeat. A
    question without gold answers is marked so that it gets no EM/F1. ValueError names a bad entry by its index."""
    from fastrag.data.datasets import Example
    from fastrag.eval.report import NO_GOLD

    if isinstance(questions, (str, bytes, dict)) or not isinstance(questions, Iterable):
        raise ValueError(f"questions must be a list (of strings, dicts or Examples) or a data file's path, got "
                         f"{type(questions).__name__}" + (" (wrap one question in a list)"
                                                          if isinstance(questions, (str, dict)) else ""))
    out = []
    for i, q in enumerate(questions):
        where = f"questions[{i}]"
        if isinstance(q, Example):
            out.append(q)
            continue
        if isinstance(q, str):
            q = {"question": q}
        if not isinstance(q, dict):
            raise ValueError(f"{where}: expected a string, a dict or an Example, got {type(q).__name__}")
        unknown = [k for k in q if k not in QUESTION_KEYS]
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r}; a question dict has {', '.join(QUESTION_KEYS)}")
        if not isinstance(q.get("question"), str):
            raise ValueError(f"{where}: 'question' must be a string, got {q.get('question')!r:.60}")
        if "answers" in q and "golden_answers" in q:
            raise ValueError(f"{where}: give 'answers' or 'golden_answers', not both")
        answers = q.get("answers", q.get("golden_answers", []))
        if isinstance(answers, str):
            answers = [answers]
        if not isinstance(answers, (list, tuple)) or not all(isinstance(a, str) for a in answers):
            raise ValueError(f"{where}: 'answers' must be a list of strings, got {answers!r:.60}")
        qid = q.get("id", f"q{i}")
        if not isinstance(qid, (str, int)) or isinstance(qid, bool):
            raise ValueError(f"{where}: 'id' must be a string or an int, got {qid!r}")
        out.append(Example(qid=str(qid), question=q["question"], answers=list(answers), dataset=dataset,
                           meta={"format": "api", **({NO_GOLD: True} if not answers else {}),
                                 **({"answer_id": str(q["answer_id"])} if q.get("answer_id") is not None else {})}))
    seen: dict[str, int] = {}
    for i, e in enumerate(out):
        if e.qid in seen:
            raise ValueError(f"questions[{i}]: id {e.qid!r} repeats questions[{seen[e.qid]}]'s; ids must be unique")
        seen[e.qid] = i
    return out


def aliased(examples: list, answer_aliases) -> list:
    """Copies of in-memory Examples whose gold answers gain the aliases of their `answer_id` (fastrag.data
    with_answer_aliases; the caller's objects are left as they are)."""
    import copy

    from fastrag.data.datasets import load_answer_aliases, with_answer_aliases
    from fastrag.eval.report import NO_GOLD

    examples = [copy.copy(e) for e in examples]
    for e in examples:
        e.answers, e.meta = list(e.answers), dict(e.meta)
    with_answer_aliases(examples, load_answer_aliases(answer_aliases), where="questions")
    for e in examples:  # (a question given without answers that gained aliases is scored on them)
        if e.answers:
            e.meta.pop(NO_GOLD, None)
    return examples


class RAG:
    """An engine (model, KV cache, decoding) and a retriever, built once and lazily; runs any registered method.

        rag = RAG(model="smollm2", retriever=BM25(), batch_size=8)   # EngineConfig fields as keywords
        rag = RAG(EngineConfig(model="/models/Llama-3.2-1B", batch_size=64), retriever=Dense("passages.jsonl"))

    model: "smollm2" (embedded) or a model folder; retriever: BM25() (the default, over the bundled Wikipedia
    passages), Dense(...), Elasticsearch(...), or a fastrag.retrieval.Retriever already built. The engine and the
    index are built at the first run/stream (or on `.engine` / `.retriever`). One RAG runs one thing at a time:
    `run` refuses while a serving front (`stream`/`submit`) is open; `close()` shuts that front (and its workers).
    """

    def __init__(self, config: EngineConfig | None = None, *, retriever=None, engine=None, **engine_kw):
        if config is not None and not isinstance(config, EngineConfig):
            if isinstance(config, (str, Path)):  # RAG("smollm2"): the model, positionally
                engine_kw = {"model": config, **engine_kw}
                config = None
            else:
                raise TypeError(f"RAG(config): expected an EngineConfig, got {type(config).__name__}")
        unknown = [k for k in engine_kw if k not in EngineConfig.fields()]
        if unknown:
            raise TypeError(f"RAG: unknown engine setting {unknown[0]!r}; EngineConfig has "
                            f"{', '.join(EngineConfig.fields())}")
        self.config = (config or EngineConfig()).replace(**engine_kw) if engine_kw else (config or EngineConfig())
        if retriever is None:
            retriever = BM25()
        self.retriever_spec = retriever if isinstance(retriever, RetrieverSpec) else None
        self._retriever = None if self.retriever_spec is not None else retriever
        if self._retriever is not None and not hasattr(self._retriever, "search"):
            raise TypeError(f"retriever: expected BM25(), Dense(), Elasticsearch() or a Retriever, got "
                            f"{type(retriever).__name__}")
        self._engine = engine  # (an Engine already built: its own settings stand, the config's are not applied)
        self._serving = None

    # ------------------------------------------------------------------ parts, built on first use
    @property
    def engine(self):
        """The fastrag.engine.Engine (built from `config` on first use)."""
        if self._engine is None:
            self._engine = self.config.build()
        return self._engine

    @property
    def retriever(self):
        """The fastrag.retrieval.Retriever (built from the spec on first use)."""
        return self.built_retriever()

    def built_retriever(self, show_progress: bool = True):
        """`retriever`, its index built or loaded with (or without) a progress bar when this is its first use."""
        if self._retriever is None:
            self._retriever = self.retriever_spec.build(show_progress=show_progress)
        return self._retriever

    @property
    def corpus_path(self) -> str | None:
        if self.retriever_spec is not None:
            return self.retriever_spec.corpus_path
        p = getattr(self._retriever, "corpus_path", None)
        return None if p is None else os.fspath(p)

    # ------------------------------------------------------------------ batch
    def run(self, questions, method: str = "dragin", dataset: str | None = None,
            config: dict | str | Path | None = None, out: str | Path | None = None, limit: int | None = None,
            progress: bool = True, *, qids: Iterable[str] | None = None,
            answer_aliases: str | Path | None = None) -> Results:
        """Answer `questions` with `method`; returns a Results (a list of QuestionResult, and `.metrics`).

        questions: a list of strings, dicts {"question", "answers" | "golden_answers", "id", "answer_id"} or
        fastrag.data Example objects; or a data file's path (read as `fastrag run --data` reads it, `dataset`
        then required).
        dataset: whose exemplars and answer rules (hotpotqa, 2wikimultihopqa, strategyqa, iirc, nq, webq; None:
        hotpotqa for questions in memory, an Example's own). config: the method's settings, a dict or a JSON file
        (`fastrag methods`, docs/methods.md; None: the paper's defaults). out: a folder to write results.jsonl and
        metrics.json into as `fastrag run --output` does (resumable: questions already answered there are kept
        and only the others computed, so a run stopped part-way goes on where it was); None writes nothing.
        limit: only the first N questions. progress: a progress bar (and the index build's) on stderr.
        qids: only the questions with these ids (among the first `limit`; an id not there is a ValueError), in
        the questions' order: a data file's ids, or those of questions in memory ("q<index>" when not given).
        answer_aliases: a 2WikiMultihopQA `id_aliases.json` (`fastrag run --answer-aliases`): each question's gold
        answers gain the aliases of its `answer_id`, as the published DRAGIN evaluation scores 2Wiki. It changes
        scoring only, so a rerun into a finished `out` rescores the answers there.

            results = rag.run(["Who wrote Hamlet?", {"question": "Capital of France?", "answers": ["Paris"]}],
                              method="flare", dataset="nq", config={"theta": 0.5})
            rag.run("dev.json", method="dragin", dataset="2wikimultihopqa", out="runs/2wiki", limit=100,
                    qids=["13f5ad2c088c11ebbd6fac1f6bf848b6"], answer_aliases="id_aliases.json", progress=False)
        """
        from fastrag.eval import RunOptions, run_many
        from fastrag.methods.registry import get_method

        if self._serving is not None:
            raise RuntimeError("this RAG's serving front is open (stream/submit): close() it before run()")
        get_method(method)  # (ValueError with the list of methods, before anything loads)
        examples = None
        if isinstance(questions, os.PathLike) or isinstance(questions, str) and (
                Path(questions).suffix in (".json", ".jsonl") or Path(questions).is_file()):
            if dataset is None:
                raise ValueError(f"questions {questions}: a data file needs dataset=... (its format and rules)")
            data = str(questions)
        else:
            from fastrag.data.datasets import Example, canonical_dataset

            data = None
            if dataset is None:  # (the first Example's own, else the default)
                own = [q.dataset for q in questions if isinstance(q, Example)] \
                    if isinstance(questions, (list, tuple)) else []
                dataset = own[0] if own else DEFAULT_DATASET
            dataset = canonical_dataset(dataset)
            examples = as_examples(questions, dataset)
            if answer_aliases is not None:  # (a data file's are added as it is read, fastrag.data.load_examples)
                examples = aliased(examples, answer_aliases)
        if qids is not None and not isinstance(qids, (str, bytes)) and isinstance(qids, Iterable):
            # (ids given as ints, as questions in memory may be: compared as the strings the records hold)
            qids = tuple(str(q) if isinstance(q, int) and not isinstance(q, bool) else q for q in qids)
        corpus = self.corpus_path
        if out is not None and corpus is None:
            raise ValueError("out=: a results folder records its corpus; give a retriever spec (BM25(corpus=...)) "
                             "or a Retriever with a corpus_path")
        c = self.config
        opts = RunOptions(method=method, dataset=dataset, data=data, corpus=corpus, output=None if out is None
                          else str(out), write=out is not None, model=c.model, config=config, limit=limit,
                          batch_size=c.batch_size, signals=c.signals, kv_cache_gb=c.kv_cache_gb,
                          prefix_caching=c.prefix_caching, threads=c.threads, overlap=c.overlap,
                          text_workers=c.text_workers, search_concurrency=c.search_concurrency, progress=progress,
                          retriever=self.retriever_spec.kind if self.retriever_spec is not None else "bm25",
                          temperature=c.temperature, top_p=c.top_p, seed=c.seed, top_k=c.top_k, qids=qids,
                          answer_aliases=None if answer_aliases is None or data is None else str(answer_aliases))
        records: list = []
        # (the engine and the index are built only when some question is to be computed, after the options and the
        # questions were checked; kept for the next run)
        metrics = run_many([opts], engine=self._engine, retriever=self._retriever,
                           examples=None if examples is None else [examples], records=records,
                           make_engine=lambda: self.engine,
                           make_retriever=lambda: self.built_retriever(show_progress=progress))[0]
        return Results(records[0], metrics)

    # ------------------------------------------------------------------ serving
    def serving(self, max_queue: int = 256, max_inflight: int | None = None):
        """The serving front (fastrag.serving.AsyncEngine over this engine and retriever), made on first use:
        questions submitted one by one share the decode batch; at most `max_queue` wait (QueueFull beyond)."""
        if self._serving is None:
            from fastrag.serving.async_engine import AsyncEngine

            self._serving = AsyncEngine(self.engine, self.retriever,
                                        max_inflight=max_inflight or 2 * self.config.batch_size,
                                        max_queue=max_queue, search_concurrency=self.config.search_concurrency)
        return self._serving

    async def submit(self, question: str, method: str = "dragin", dataset: str = DEFAULT_DATASET,
                     config: dict | None = None, qid: str | None = None):
        """Queue one question; returns its event stream (an async iterator of fastrag.serving.Event: "generate"
        when a round starts, "token" per decoded token, "search" and "documents" per retrieval, then "answer" with
        the whole result, or "error"). Raises QueueFull when the queue is full (its retry_after says when to come
        back)."""
        return await self.serving().submit(question, method=method, dataset=dataset, config=config, qid=qid)

    async def stream(self, question: str, method: str = "dragin", dataset: str = DEFAULT_DATASET,
                     config: dict | None = None, qid: str | None = None) -> AsyncIterator[Any]:
        """One question's events as they happen (see `submit`):

            async for event in rag.stream("Who wrote Hamlet?", method="dragin"):
                print(event.kind, event.data)
        """
        events = await self.submit(question, method=method, dataset=dataset, config=config, qid=qid)
        try:
            async for ev in events:
                yield ev
        finally:
            await events.aclose()

    def close(self) -> None:
        """Shut the serving front (its worker thread and text workers); the engine stays for `run`."""
        if self._serving is not None:
            self._serving.close()
            self._serving = None

    def __enter__(self) -> RAG:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RAG({self.config!r}, retriever={self.retriever_spec or self._retriever!r})"
