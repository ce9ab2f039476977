"""What a `fastrag.RAG` is built from: the engine's settings (`EngineConfig`) and the retriever (`BM25`, `Dense`,
`Elasticsearch`), as small frozen values. Nothing heavy is imported here: a spec becomes an engine or a retriever
only when `build()` is called (by RAG, the command line, the server or a Ray shard).

    EngineConfig(model="smollm2", batch_size=8).build()    -> fastrag.engine.Engine
    BM25().build()                                        -> BM25Retriever over the bundled passages
    retriever_spec("dense", "passages.jsonl")             -> Dense(corpus="passages.jsonl")
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the passages shipped with fastrag (a Wikipedia sample): the corpus of a spec given none
BUNDLED_CORPUS = Path(__file__).resolve().parent / "data" / "bundled" / "wiki_passages.jsonl"


@dataclass(frozen=True)
class EngineConfig:
    """The engine's knobs (fastrag.eval.build_engine's arguments) and the question loop's.

    model: "smollm2" (the embedded SmolLM2 GGUF) or a Hugging Face model folder. batch_size: sequences decoded
    together. signals: the signal backend (None: the engine's choice). kv_cache_gb: the paged KV pool (None: 8 GiB on
    a CPU, sized from the device's free memory on a GPU). device / dtype: None picks cuda + bfloat16 when a GPU is
    there, else cpu + float32 (dtype may be a torch.dtype or its name, "bfloat16"). temperature / top_p / top_k /
    seed: decoding (greedy by default; temperature > 0 samples, keyed by question id, so reruns draw the same).
    prefix_caching: share the KV of prompt blocks already computed. overlap / text_workers / search_concurrency /
    threads: the question loop's host work (None: chosen by the run, as `fastrag run` chooses them).
    """

    model: str = "smollm2"
    batch_size: int = 32
    signals: str | None = None
    kv_cache_gb: float | None = None
    device: str | None = None
    dtype: Any = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    prefix_caching: bool = True
    overlap: bool | None = None
    text_workers: int | None = None
    search_concurrency: int | None = None
    threads: int | None = None

    def __post_init__(self):
        if not isinstance(self.model, (str, Path)) or not str(self.model).strip():
            raise ValueError(f"model must name the embedded model ('smollm2') or a model folder, got {self.model!r}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {self.batch_size!r}")
        if isinstance(self.dtype, str):
            import torch

            dt = getattr(torch, self.dtype, None)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"dtype {self.dtype!r} is no torch dtype (e.g. 'bfloat16', 'float32')")
            object.__setattr__(self, "dtype", dt)
        object.__setattr__(self, "model", str(self.model))
        self.sampling()  # (a bad temperature, top_p, top_k or seed fails here, naming it)

    @classmethod
    def of(cls, opts, **more) -> EngineConfig:
        """The engine settings of a batch run's options (fastrag.eval.RunOptions: `fastrag run`'s flags)."""
        return cls(model=opts.model, batch_size=opts.batch_size, signals=opts.signals, kv_cache_gb=opts.kv_cache_gb,
                   temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k, seed=opts.seed,
                   prefix_caching=opts.prefix_caching, overlap=opts.overlap, text_workers=opts.text_workers,
                   search_concurrency=opts.search_concurrency, threads=opts.threads, **more)

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    def sampling(self):
        """The engine's SamplingParams for these decoding settings."""
        from fastrag.engine import SamplingParams

        return SamplingParams(temperature=self.temperature, top_p=self.top_p, seed=self.seed, top_k=self.top_k)

    def loop_config(self, device=None, **more):
        """The question loop's settings (fastrag.loop.LoopConfig) for an engine of this config on `device`: twice
        the decode batch in flight, so questions waiting on attention passes or retrieval leave no holes in it, and
        text workers where none were given as a run chooses them (none on a CPU; on a GPU one per core beyond two,
        fastrag.text.pool.auto_text_workers). `more`: any LoopConfig field, which wins."""
        from fastrag.loop.config import LoopConfig

        workers = self.text_workers
        if workers is None and device is not None:
            from fastrag.text.pool import auto_text_workers

            workers = auto_text_workers(device)
        base = LoopConfig(max_inflight=2 * self.batch_size, overlap=self.overlap, text_workers=workers,
                          search_concurrency=self.search_concurrency)
        return base.replace(**more) if more else base

    def build(self):
        """The engine: the model loaded on its device, its KV pool allocated (seconds to minutes)."""
        from fastrag.eval import build_engine

        return build_engine(self.model, self.batch_size, self.signals, self.kv_cache_gb, device=self.device,
                            dtype=self.dtype, sampling=self.sampling(), prefix_caching=self.prefix_caching)


class RetrieverSpec:
    """A retriever to build: its kind (fastrag.retrieval.RETRIEVERS), corpus (None: the bundled passages) and the
    retriever class's other keyword arguments. Frozen, comparable and hashable."""

    kind = ""

    def __init__(self, corpus: str | Path | None = None, **options):
        if corpus is not None and (not isinstance(corpus, (str, Path)) or not str(corpus).strip()):
            raise ValueError(f"{type(self).__name__}: corpus must be a passage file's path or None (the bundled "
                             f"passages), got {corpus!r}")
        if "corpus_path" in options:
            raise ValueError(f"{type(self).__name__}: give the corpus as corpus=..., not corpus_path")
        object.__setattr__(self, "corpus", None if corpus is None else str(corpus))
        object.__setattr__(self, "options", dict(options))

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"{type(self).__name__} is frozen: make another")

    def _key(self):
        return (type(self), self.corpus, tuple(sorted(self.options.items(), key=lambda kv: kv[0])))

    def __eq__(self, other):
        return isinstance(other, RetrieverSpec) and self._key() == other._key()

    def __hash__(self):
        return hash(repr(self._key()))

    def __repr__(self):
        args = ([f"corpus={self.corpus!r}"] if self.corpus is not None else []) + \
            [f"{k}={v!r}" for k, v in self.options.items()]
        return f"{type(self).__name__}({', '.join(args)})"

    @property
    def corpus_path(self) -> str | None:
        """The corpus file the retriever reads (None: it has none, an Elasticsearch index given without one)."""
        return self.corpus if self.corpus is not None else str(BUNDLED_CORPUS)

    def build(self, show_progress: bool = True):
        """The retriever (an index built or loaded: seconds on the bundled corpus, longer on a large one)."""
        from fastrag.retrieval import make_retriever

        return make_retriever(self.kind, corpus_path=self.corpus_path, show_progress=show_progress, **self.options)


class BM25(RetrieverSpec):
    """BM25 over a passage file (fastrag.retrieval.bm25.BM25Retriever; options: index_dir, k1, b, ...)."""

    kind = "bm25"


class Dense(RetrieverSpec):
    """Dense retrieval (faiss + sentence-transformers, `fastrag[dense]`; options: encoder, index_dir, and the faiss
    index: index="flat" (exact, the default) | "ivf" (nlist, nprobe) | "hnsw" (M, ef_construction, ef_search) |
    "ivfpq" (nlist, m, nbits, nprobe); docs/retrieval.md). A bad index option fails here, naming it."""

    kind = "dense"

    def __init__(self, corpus: str | Path | None = None, **options):
        from fastrag.retrieval.ann import AnnOptions

        ann = {k: v for k, v in options.items() if k not in ("encoder", "index_dir", "batch_size", "device")}
        AnnOptions.of(**ann)  # (light: faiss is imported only when the index is built)
        super().__init__(corpus, **options)


class Elasticsearch(RetrieverSpec):
    """An Elasticsearch index (url None: $FASTRAG_ES_URL; index None: $FASTRAG_ES_INDEX), built from `corpus`
    when missing."""

    kind = "elasticsearch"

    def __init__(self, url: str | None = None, index: str | None = None, corpus: str | Path | None = None,
                 **options):
        super().__init__(corpus, **({"url": url} if url is not None else {}),
                         **({"index": index} if index is not None else {}), **options)


SPECS = {cls.kind: cls for cls in (BM25, Dense, Elasticsearch)}


def retriever_spec(kind: str, corpus: str | Path | None = None, **options) -> RetrieverSpec:
    """The spec of a retriever named on the command line (--retriever KIND --corpus PATH, and for dense the index
    options of --dense-index / --index-option)."""
    try:
        cls = SPECS[kind]
    except KeyError:
        raise ValueError(f"unknown retriever kind {kind!r}: expected one of {', '.join(SPECS)}") from None
    return cls(corpus=corpus, **options)
