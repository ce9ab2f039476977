"""Elasticsearch retrieval against a real server: runs when one answers at $FASTRAG_ES_URL (default
http://localhost:9200), skipped otherwise (no stand-in for the server)."""

from __future__ import annotations

import json
import os
import uuid

import pytest

from fastrag.eval import BUNDLED

URL = os.environ.get("FASTRAG_ES_URL", "http://localhost:9200")


def _reachable() -> bool:
    try:
        import httpx

        return httpx.get(URL, timeout=2).status_code < 500
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _reachable(), reason=f"no Elasticsearch server at {URL}")


@pytest.fixture(scope="module")
def es_index(tmp_path_factory):
    from fastrag.retrieval.elastic import ElasticRetriever

    lines = (BUNDLED / "wiki_passages.jsonl").read_text(encoding="utf-8").splitlines()[:300]
    p = tmp_path_factory.mktemp("es") / "c.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    name = f"fastrag-test-{uuid.uuid4().hex[:8]}"
    r = ElasticRetriever(URL, name, corpus_path=p, show_progress=False)
    yield r, [json.loads(x) for x in lines]
    r.es.indices.delete(index=name)


def test_index_and_search(es_index):
    r, docs = es_index
    assert r.built and r.n_docs == len(docs)
    d = docs[42]
    res = r.search([d["title"] + " " + " ".join(d["text"].split()[:12]), "", "zzqx"], 3)
    assert res[0][0].id == d["id"] and res[0][0].score >= res[0][-1].score
    assert res[1] == []
    with pytest.raises(ValueError):
        r.search(["x"], 0)


def test_missing_index_is_a_clear_error():
    from fastrag.retrieval import CorpusError
    from fastrag.retrieval.elastic import ElasticRetriever

    with pytest.raises(CorpusError, match="no index"):
        ElasticRetriever(URL, f"fastrag-missing-{uuid.uuid4().hex[:8]}")
