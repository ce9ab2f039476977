"""Elasticsearch / OpenSearch (Elasticsearch-compatible API) retrieval with the query the published DRAGIN setup
sends: `multi_match` of type `best_fields` over the title and text fields with `tie_breaker` 0.5, one `_msearch`
round trip per batch of queries.

For corpora too large for the embedded BM25 (the 21M-passage DPR Wikipedia split): index once with
`ElasticRetriever.index_corpus(corpus, url, index)` (bulk, progress bar), then `--retriever elasticsearch`
with `FASTRAG_ES_URL` / `FASTRAG_ES_INDEX`. Documents are stored as `{id, title, text}`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from fastrag.retrieval.base import Doc, Retriever
from fastrag.settings import setting
from fastrag.retrieval.corpus import CorpusError, iter_corpus


def _client(url: str, timeout: float):
    try:
        from elasticsearch import Elasticsearch
    except ImportError:
        raise ImportError("the Elasticsearch retriever needs the package elasticsearch: "
                          "pip install 'fastrag[elastic]'") from None
    return Elasticsearch(url, request_timeout=timeout)


class ElasticRetriever(Retriever):
    def __init__(self, url: str | None = None, index: str | None = None, fields: tuple[str, str] = ("title", "text"),
                 tie_breaker: float = 0.5, timeout: float = 30.0, corpus_path=None, show_progress: bool = True):
        self.url = url or setting("FASTRAG_ES_URL")
        self.index = index or setting("FASTRAG_ES_INDEX")
        if not 0 <= tie_breaker <= 1:
            raise ValueError(f"tie_breaker must lie in [0, 1], got {tie_breaker}")
        self.fields, self.tie_breaker = list(fields), float(tie_breaker)
        self.es = _client(self.url, timeout)
        try:
            exists = bool(self.es.indices.exists(index=self.index))
        except Exception as e:  # connection refused, TLS, auth: name the server
            raise CorpusError(f"Elasticsearch at {self.url}: {type(e).__name__}: {e}") from None
        self.built = False
        if not exists:
            if corpus_path is None:
                raise CorpusError(f"Elasticsearch at {self.url} has no index {self.index!r}; build it with "
                                  "ElasticRetriever.index_corpus(corpus, url, index) or pass corpus_path")
            self.index_corpus(corpus_path, self.url, self.index, show_progress=show_progress)
            self.built = True
        self.index_dir = f"{self.url}/{self.index}"
        self.n_docs = int(self.es.count(index=self.index)["count"])

    @staticmethod
    def index_corpus(corpus_path, url: str, index: str, batch: int = 2000, show_progress: bool = True) -> int:
        """Create `index` (title/text as English-analysed text) and bulk-load a corpus file into it. A load that
        fails part-way (a corpus error on some line, a server error, Ctrl-C) deletes the index again: a run finds
        an index by its name alone, so one left half-filled would be searched as if it held the whole corpus."""
        from elasticsearch import helpers
        from tqdm import tqdm

        es = _client(url, 120.0)
        path = Path(corpus_path)
        if not path.is_file():
            raise CorpusError(f"corpus file not found: {path}")
        es.indices.create(index=index, mappings={"properties": {
            "id": {"type": "keyword"}, "title": {"type": "text", "analyzer": "english"},
            "text": {"type": "text", "analyzer": "english"}}})
        actions = ({"_index": index, "_id": doc_id, "_source": {"id": doc_id, "title": title, "text": text}}
                   for doc_id, title, text in tqdm(iter_corpus(path), desc=f"indexing {path.name}", unit="doc",
                                                   disable=not show_progress))
        try:
            n, _ = helpers.bulk(es, actions, chunk_size=batch, raise_on_error=True)
            es.indices.refresh(index=index)
        except BaseException:
            with contextlib.suppress(Exception):  # (a server that went away: its own error is the one to report)
                es.indices.delete(index=index, ignore_unavailable=True)
            raise
        return n

    def search(self, queries: list[str], k: int) -> list[list[Doc]]:
        queries, live = self.live_queries(queries, k)
        out: list[list[Doc]] = [[] for _ in queries]
        if not live:
            return out
        body = []
        for i in live:
            body += [{"index": self.index}, {"size": k, "query": {"multi_match": {
                "query": queries[i], "type": "best_fields", "fields": self.fields, "tie_breaker": self.tie_breaker}}}]
        resp = self.es.msearch(searches=body)
        for i, r in zip(live, resp["responses"]):
            if "error" in r:
                raise CorpusError(f"Elasticsearch at {self.url}, index {self.index!r}: {r['error']}")
            out[i] = [Doc(id=str(h["_source"].get("id", h["_id"])), title=h["_source"].get("title", ""),
                          text=h["_source"].get("text", ""), score=float(h["_score"])) for h in r["hits"]["hits"]]
        return out
