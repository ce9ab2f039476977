"""Retrievers: `Retriever.search(queries, k) -> list[list[Doc]]` (batched). Embedded default: BM25 (bm25s)."""

from __future__ import annotations

from fastrag.retrieval.base import Doc, Retriever
from fastrag.retrieval.corpus import CorpusError, iter_corpus


def make_retriever(kind: str = "bm25", **kw) -> Retriever:
    """Build a retriever by name: "bm25" -> `BM25Retriever(**kw)` (needs `corpus_path`)."""
    if kind == "bm25":
        from fastrag.retrieval.bm25 import BM25Retriever

        return BM25Retriever(**kw)
    raise ValueError(f"unknown retriever kind {kind!r}: expected 'bm25'")


def __getattr__(name: str):
    # Lazy so that importing fastrag.retrieval does not import bm25s.
    if name == "BM25Retriever":
        from fastrag.retrieval.bm25 import BM25Retriever

        return BM25Retriever
    raise AttributeError(name)


__all__ = ["BM25Retriever", "CorpusError", "Doc", "Retriever", "iter_corpus", "make_retriever"]
