"""Retrievers: `Retriever.search(queries, k) -> list[list[Doc]]` (batched). Embedded default: BM25 (bm25s)."""

from __future__ import annotations

from fastrag.retrieval.base import Doc, Retriever
from fastrag.retrieval.corpus import CorpusError, iter_corpus


RETRIEVERS = ("bm25", "dense", "elasticsearch")


def make_retriever(kind: str = "bm25", **kw) -> Retriever:
    """Build a retriever by name (keyword arguments go to its constructor; both need `corpus_path`):
    "bm25" -> `BM25Retriever`, "dense" -> `DenseRetriever` (faiss + sentence-transformers, `fastrag[dense]`),
    "elasticsearch" -> `ElasticRetriever` (a server at $FASTRAG_ES_URL, index $FASTRAG_ES_INDEX; built from the
    corpus when missing)."""
    if kind == "bm25":
        from fastrag.retrieval.bm25 import BM25Retriever

        return BM25Retriever(**kw)
    if kind == "dense":
        from fastrag.retrieval.dense import DenseRetriever

        return DenseRetriever(**kw)
    if kind == "elasticsearch":
        from fastrag.retrieval.elastic import ElasticRetriever

        return ElasticRetriever(**kw)
    raise ValueError(f"unknown retriever kind {kind!r}: expected one of {', '.join(RETRIEVERS)}")


def __getattr__(name: str):
    # Lazy so that importing fastrag.retrieval does not import bm25s.
    if name == "BM25Retriever":
        from fastrag.retrieval.bm25 import BM25Retriever

        return BM25Retriever
    if name == "DenseRetriever":
        from fastrag.retrieval.dense import DenseRetriever

        return DenseRetriever
    raise AttributeError(name)


__all__ = ["BM25Retriever", "CorpusError", "DenseRetriever", "Doc", "RETRIEVERS", "Retriever", "iter_corpus",
           "make_retriever"]
