"""Retriever interface: batched search returning documents."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Doc:
    id: str  # corpus id of the passage
    title: str  # passage title ("" when the corpus has none)
    text: str  # passage body (what DRAGIN puts in the prompt as "[i] text")
    score: float = 0.0  # retriever score (higher is better); comparable only within one query


class Retriever(ABC):
    """A retriever answers a batch of queries at once.

    `search(queries, k)` returns one list per query, in query order, of at most k documents sorted by score
    descending (ties in corpus order). A query may get fewer than k documents (a corpus with fewer than k
    matching passages) or none (an empty query, or one made only of stopwords).

    `concurrent_searches`: how many retrieval batches the scheduler keeps in flight for this retriever by default,
    each `search` call on its own thread (the scheduler's `search_concurrency`, `--search-concurrency`, overrides it).
    1: one call at a time. More suits a backend that answers calls in parallel (a search server) and a retriever
    that is safe to call from several threads: the bundled BM25, dense and Elasticsearch ones are (the in-process
    two run their calls one after the other), and all three keep 1.
    """

    concurrent_searches: int = 1

    @abstractmethod
    def search(self, queries: list[str], k: int) -> list[list[Doc]]:
        """Batched search: `len(result) == len(queries)`, `len(result[i]) <= k`."""

    @staticmethod
    def check_k(k: int) -> int:
        """Validate k (a positive int) and return it."""
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        return k

    @staticmethod
    def check_queries(queries) -> list[str]:
        """Validate a batch of queries (a list of strings, not a bare string) and return it as a list (an iterator
        is read once, here: checking it first would leave nothing to search)."""
        if isinstance(queries, str) or not hasattr(queries, "__iter__"):
            raise TypeError("queries must be a list of strings")
        queries = list(queries)
        if not all(isinstance(q, str) for q in queries):
            raise TypeError("queries must be a list of strings")
        return queries

    def live_queries(self, queries, k: int) -> tuple[list[str], list[int]]:
        """Validate k and the batch; return (the queries as a list, the indices of the non-blank ones). A blank
        query gets no documents."""
        self.check_k(k)
        queries = self.check_queries(queries)
        return queries, [i for i, q in enumerate(queries) if q.strip()]
