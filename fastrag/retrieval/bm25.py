"""Embedded BM25 retriever (bm25s) scoring title and text as two fields, like DRAGIN's Elasticsearch query.

The published DRAGIN code sends Elasticsearch a `multi_match` query of type `best_fields` over `title` and
`text` with `tie_breaker = 0.5`. For two fields that scores a passage d for query q as

    score(d) = max(s_title, s_text) + tie_breaker * min(s_title, s_text)

where each s_f is Lucene BM25 over field f alone (own document frequencies and average field length):

    s_f(d) = sum_{t in q} idf_f(t) * tf / (tf + k1 * (1 - b + b * |d_f| / avgdl_f)),
    idf_f(t) = ln(1 + (N - df_f(t) + 0.5) / (df_f(t) + 0.5)),

with query terms counted with multiplicity. Analysis, the same for passages and queries: lowercase, `\\w+`
tokens, one-character ones included ("Type S", "D-Day", "Route 1"), as Elasticsearch's standard analyzer keeps them
(a Han ideograph or hiragana character is a term of its own, as in Elasticsearch's standard tokenizer), English
stopwords removed (bm25s's list, Lucene's English stop set word for word), Snowball English stemmer (PyStemmer) --
close to Elasticsearch's `english` analyzer. Known differences in the tokens: the standard tokenizer's word breaks
(Unicode UAX #29) keep "john's", "don't", "u.s" and "3.14" whole, where `\\w+` splits them ("john", "s"; "3",
"14"), and `english` drops a possessive "'s" that here is the term "s".
Known difference from Elasticsearch: avgdl_f counts passages with an empty field as length 0 (Lucene leaves
them out of its field statistics); it only matters for corpora with empty titles.

Index layout (`index_dir`, default `<corpus>.bm25s/`, else `$FASTRAG_CACHE/indexes/<hash>/` when the corpus
folder is read-only): `title/` and `text/` (bm25s indexes, loaded with mmap), `docs.bin` + `docs_offsets.npy`
(UTF-8 id/title/text of each passage, mmapped, so loading costs no time for any corpus size) and
`manifest.json` (written last, so a half-built index is never trusted). The build (`fastrag.retrieval.bm25_build`)
reads the corpus once, a chunk of passages at a time, analysed in worker processes on a big corpus
($FASTRAG_INDEX_WORKERS, `index_workers`), and writes bm25s's files with bm25s's scores to the bit in memory that
does not grow with the postings.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import shutil
import sys
import threading
import warnings
from pathlib import Path

import numpy as np

from fastrag.retrieval import bm25_build
from fastrag.retrieval.base import Doc, Retriever
from fastrag.retrieval.corpus import (CorpusError, corpus_format, corpus_fingerprint, iter_corpus,
                                     reader_version)
from fastrag.settings import setting

log = logging.getLogger(__name__)

FIELDS = ("title", "text")
# $FASTRAG_BM25_NATIVE=0 searches with numpy (dense score vectors a query) instead of fastrag._C's postings-driven
# search, and finds a build's tokens with Python's regex engine instead of fastrag._C's scan; the two give the same
# passages, scores and order (tests/test_bm25_native.py, tests/test_bm25_build.py)
NATIVE_ENV = bm25_build.NATIVE_ENV
_EMPTY = "EMPTY"  # marks a field's index folder when no passage has a term in that field
# the analysis an index was built with: a saved index of another format is built again, never searched with queries
# analysed differently. 2: Han ideographs and hiragana are single-character terms; 3: one-character `\w` terms kept
_FORMAT = 3

def cache_root() -> Path:
    return setting("FASTRAG_CACHE")


def _writable(d: Path) -> bool:
    """Whether d (or its nearest existing ancestor) may be written. A folder without any write bit counts as
    read-only even for root, who bypasses permission checks (e.g. the shared data folder, mode 555)."""
    p = d
    while not p.exists() and p != p.parent:
        p = p.parent
    return os.access(p, os.W_OK) and bool(p.stat().st_mode & 0o222)


def _read_manifest(d: Path) -> dict | None:
    """The saved manifest of index folder d without its `n_docs` entry; None when absent or unreadable."""
    try:
        m = json.loads((d / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict):
        return None
    m.pop("n_docs", None)
    return m


@contextlib.contextmanager
def _build_lock(d: Path):
    """Exclusive lock on index folder d (a `.lock` file in it) while one process builds there: two processes that
    open the same corpus at once (two benchmarks started together, ray workers) would otherwise write and delete
    each other's files. Where fcntl is missing (Windows) builds are not serialised."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on Linux/macOS
        yield
        return
    with open(d / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_in_first_writable(candidates: list[Path], index, what: str, manifest: dict | None = None) -> Path:
    """Build an index (`index(folder)`) in the first candidate folder that can be written; returns the folder.
    The build holds the folder's lock. A process that waited for it takes the index another one finished meanwhile
    (its manifest equals `manifest`) instead of building again. A folder's old manifest is removed first, so a
    half-rebuilt index is never trusted."""
    errors = []
    for d in candidates:
        held = contextlib.ExitStack()
        try:
            if not _writable(d):
                raise PermissionError(f"{d} is (inside) a read-only folder")
            made = not d.exists()
            d.mkdir(parents=True, exist_ok=True)
            held.enter_context(_build_lock(d))
        except OSError as e:
            held.close()
            errors.append(f"{d}: {e}")
            continue
        with held:
            if manifest is not None and _read_manifest(d) == manifest:
                return d
            (d / "manifest.json").unlink(missing_ok=True)
            try:
                index(d)
            except BaseException:
                if made:  # a build that failed (a corpus error) leaves no half-written folder of its own behind
                    shutil.rmtree(d, ignore_errors=True)
                raise
        return d
    raise OSError(f"no writable folder for the {what} index: " + "; ".join(errors))


def open_index(candidates: list[Path], manifest: dict, build, load, what: str) -> tuple[Path, bool]:
    """(index folder, built now) of the first candidate whose manifest equals `manifest`, loaded by `load(folder)`,
    else of a new one from `build()`. A saved index that fails to load (a file truncated or damaged after it was
    written) is built again once, with a warning naming the folder and the error; one that fails right after its
    build is a CorpusError naming the folder. A damaged index in a read-only folder stays there untrusted: the
    build (or an index already built in a writable candidate) takes its place."""
    unusable: list[Path] = []
    found = next((d for d in candidates if _read_manifest(d) == manifest), None)
    while True:
        built = found is None
        if built:
            found = build()
        try:
            load(found)
            return found, built
        except Exception as e:  # noqa: BLE001 (numpy, pickle, faiss and OS errors all mean: this folder is unusable)
            if built:
                raise CorpusError(f"{found}: the {what} index just built cannot be read ({type(e).__name__}: {e}); "
                                  "delete the folder and run again") from e
            with contextlib.suppress(OSError):  # (a read-only folder keeps it: the build goes to a writable one)
                (found / "manifest.json").unlink(missing_ok=True)
            unusable.append(found)
            damaged, found = found, next((d for d in candidates if d not in unusable
                                          and _read_manifest(d) == manifest), None)
            warnings.warn(f"{damaged}: saved {what} index unreadable ({type(e).__name__}: {e}); "
                          + ("building it again" if found is None else f"using the one in {found}"),
                          RuntimeWarning, stacklevel=3)


def write_manifest(d: Path, manifest: dict, n_docs: int) -> None:
    """Write the manifest last and atomically: its presence marks the index in d complete."""
    tmp = d / "manifest.json.tmp"
    tmp.write_text(json.dumps({**manifest, "n_docs": n_docs}, indent=1))
    os.replace(tmp, d / "manifest.json")


class DocStore:
    """Passages as one UTF-8 blob; field j of passage i is blob[off[3i + j] : off[3i + j + 1]] (j: id, title, text)."""

    def __init__(self, directory: Path):
        self.offsets = np.load(directory / "docs_offsets.npy", mmap_mode="r")  # [3N + 1] int64
        # the map keeps its own handle on the file: closing ours leaves no descriptor open per retriever
        with open(directory / "docs.bin", "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self._blob = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        if len(self.offsets) % 3 != 1 or int(self.offsets[-1]) != size:  # a file cut short or replaced
            raise ValueError(f"docs.bin holds {size} bytes, docs_offsets.npy ({len(self.offsets)} entries) "
                             f"describes {int(self.offsets[-1]) if len(self.offsets) else 0}")

    def __len__(self) -> int:
        return (len(self.offsets) - 1) // 3

    def get(self, i: int, score: float) -> Doc:
        o = self.offsets[3 * i : 3 * i + 4].tolist()
        f = [self._blob[o[j] : o[j + 1]].decode("utf-8") for j in range(3)]
        return Doc(id=f[0], title=f[1], text=f[2], score=score)

    @staticmethod
    def write(directory: Path, rows) -> tuple[list[str], list[str]]:
        """Write the store from (id, title, text) rows; return the titles and texts (to index them)."""
        titles, texts = [], []
        with _DocStoreWriter(directory) as w:
            for batch in bm25_build.chunks(rows, 10_000):
                w.add(batch)
                titles.extend(r[1] for r in batch)
                texts.extend(r[2] for r in batch)
        return titles, texts


class _DocStoreWriter:
    """Writes a `DocStore` from batches of (id, title, text) rows (`add`) without keeping them: the offsets go
    to a scratch file and become `docs_offsets.npy` on a clean exit. The files are new ones, not the old ones
    rewritten in place: a retriever that maps the store of an earlier build (a server, a run in progress) goes on
    reading that build's passages instead of the new build's bytes at its old offsets."""

    def __init__(self, directory: Path):
        self.directory = directory
        for name in ("docs.bin", "docs_offsets.npy"):
            (directory / name).unlink(missing_ok=True)
        self._blob = open(directory / "docs.bin", "wb")
        self._offsets = open(directory / "docs_offsets.i64.tmp", "wb")
        self.pos = 0
        self.n = 0

    def add(self, rows) -> None:
        offsets = []
        for fields in rows:
            for s in fields:
                b = s.encode("utf-8")
                self._blob.write(b)
                self.pos += len(b)
                offsets.append(self.pos)
            self.n += 1
        np.asarray(offsets, dtype=np.int64).tofile(self._offsets)

    def __enter__(self):
        return self

    def __exit__(self, kind, *_) -> None:
        self._blob.close()
        self._offsets.close()
        raw = self.directory / "docs_offsets.i64.tmp"
        try:
            if kind is None:
                body = np.fromfile(raw, dtype=np.int64, count=0) if not self.n else np.memmap(raw, np.int64, "r")
                out = np.lib.format.open_memmap(self.directory / "docs_offsets.npy", mode="w+", dtype=np.int64,
                                                shape=(3 * self.n + 1,))
                out[0] = 0
                for i in range(0, len(body), 1 << 24):  # (copied in slices: no copy of it all in memory)
                    out[1 + i : 1 + i + (1 << 24)] = body[i : i + (1 << 24)]
                out.flush()
                del out, body
        finally:
            raw.unlink(missing_ok=True)


class BM25Retriever(Retriever):
    """BM25 over a jsonl/tsv corpus with `best_fields` combination of title and text (see module docstring).

    `self.built` is True when this construction (re)indexed the corpus, False when it reloaded a saved index.
    A build reads the corpus once, a chunk at a time, in memory that does not grow with the postings
    (`fastrag.retrieval.bm25_build`); `index_workers` processes analyse the chunks.
    """

    def __init__(
        self,
        corpus_path: str | os.PathLike,
        index_dir: str | os.PathLike | None = None,
        k1: float = 1.2,
        b: float = 0.75,
        tie_breaker: float = 0.5,
        show_progress: bool = True,
        index_workers: int | None = None,
    ):
        # bm25s probes JAX at import (a top-k on a tiny array) when JAX is installed. On a GPU machine that probe
        # would start XLA there, and XLA takes 75% of the GPU's memory up front, leaving the engine's KV cache none.
        # fastrag never uses bm25s' JAX top-k (scores are computed exactly here), so the probe runs on the CPU.
        # A process that already set these variables, or already started JAX, keeps its own settings.
        if "jax" not in sys.modules:
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
            os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        import bm25s
        import Stemmer

        if not k1 >= 0:
            raise ValueError(f"k1 must be >= 0, got {k1}")
        if not 0 <= b <= 1:
            raise ValueError(f"b must lie in [0, 1], got {b}")
        if not 0 <= tie_breaker <= 1:
            raise ValueError(f"tie_breaker must lie in [0, 1], got {tie_breaker}")
        if index_workers is not None and (isinstance(index_workers, bool) or not isinstance(index_workers, int)
                                          or index_workers < 1):
            raise ValueError(f"index_workers must be a number of processes >= 1, got {index_workers!r}")
        # processes that analyse passages when the index is built (None: $FASTRAG_INDEX_WORKERS, else one per usable
        # CPU up to 8 for a corpus of more than two chunks; read now: a bad value fails before any work)
        self.index_workers = index_workers if index_workers is not None else bm25_build.workers_setting()
        self.corpus_path = Path(corpus_path).resolve()
        if not self.corpus_path.is_file():
            raise CorpusError(f"corpus file not found: {self.corpus_path}")
        corpus_format(self.corpus_path)  # an unsupported suffix fails before any index folder is made
        self.k1, self.b, self.tie_breaker = float(k1), float(b), float(tie_breaker)
        self.show_progress = show_progress
        self._bm25s = bm25s
        self._stemmer = Stemmer.Stemmer(bm25_build.STEMMER)
        self._lock = threading.Lock()  # one search at a time (the stemmer is not thread-safe; the native scratch)
        self._native_setting = setting(NATIVE_ENV)  # (read first: a bad value is not an unreadable index)

        manifest = self._manifest()
        candidates = [Path(index_dir)] if index_dir is not None else self._default_dirs()
        self.index_dir, self.built = open_index(candidates, manifest, lambda: self._build(candidates, manifest),
                                                self._open, "BM25")

    def _open(self, found: Path) -> None:
        self._fields = {  # (None: a field in which no passage has a term)
            f: None if (found / f / _EMPTY).exists()
            else self._bm25s.BM25.load(found / f, mmap=True, load_corpus=False, show_progress=False)
            for f in FIELDS
        }
        self._store = DocStore(found)
        self.n_docs = len(self._store)
        self._native = self._native_search()

    def _native_search(self):
        """The postings-driven search of fastrag._C (`bm25_best_fields`) with its operands, or None: the numpy path
        then (no extension built, $FASTRAG_BM25_NATIVE=0, or a bm25s index scored with a non-occurrence term,
        which every passage gets and the postings do not hold; fastrag's own are Lucene BM25, which has none)."""
        if self._native_setting is False:
            return None
        try:
            import torch

            from fastrag import _C
        except ImportError:
            return None
        if not hasattr(_C, "bm25_best_fields") or len(FIELDS) != 2:
            return None
        parts = {"data": [], "indices": [], "indptr": []}
        for model in self._fields.values():
            if model is not None and getattr(model, "nonoccurrence_array", None) is not None:
                return None
            for key, empty in (("data", np.float32), ("indices", np.int32), ("indptr", np.int64)):
                arr = np.zeros(1 if key == "indptr" else 0, dtype=empty) if model is None else model.scores[key]
                if arr.dtype not in ((np.float32,) if key == "data" else (np.int32, np.int64)):
                    return None  # (an index saved with other dtypes: the kernel reads these)
                with warnings.catch_warnings():  # (the index's arrays are read-only maps: nothing writes to them)
                    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                    parts[key].append(torch.from_numpy(np.ascontiguousarray(arr)))
        # 9 bytes a passage (np.zeros leaves the pages unmapped until written: resident as queries touch them, all of
        # it after the first query that sweeps)
        scratch = torch.from_numpy(np.zeros((2, self.n_docs), dtype=np.float32))
        mark = torch.from_numpy(np.zeros(self.n_docs, dtype=np.uint8))
        return _C.bm25_best_fields, parts, scratch, mark

    # ---- index management -------------------------------------------------------------------------------

    def _manifest(self) -> dict:
        st = self.corpus_path.stat()
        return {
            "format": _FORMAT,
            "reader": reader_version(self.corpus_path),
            "bm25s": self._bm25s.__version__,
            "corpus": str(self.corpus_path),
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "fingerprint": corpus_fingerprint(self.corpus_path),
            "k1": self.k1,
            "b": self.b,
            "method": "lucene",
            "stopwords": bm25_build.STOPWORDS,
            "stemmer": bm25_build.STEMMER,
            "fields": list(FIELDS),
        }  # tie_breaker is applied at query time, so it is not part of the index

    def _default_dirs(self) -> list[Path]:
        key = hashlib.sha1(str(self.corpus_path).encode()).hexdigest()[:16]
        return [
            self.corpus_path.with_name(self.corpus_path.name + ".bm25s"),
            cache_root() / "indexes" / f"{self.corpus_path.stem}-{key}",
        ]

    def _build(self, candidates: list[Path], manifest: dict) -> Path:
        return build_in_first_writable(candidates, lambda d: self._index(d, manifest), "BM25", manifest)

    def _index(self, d: Path, manifest: dict) -> None:
        log.info("indexing %s into %s", self.corpus_path, d)
        for name in FIELDS:
            if (d / name).exists():
                shutil.rmtree(d / name)
        with _DocStoreWriter(d) as store:  # (the passages stored as they are read, a chunk at a time)
            n_docs, found = bm25_build.build_fields(iter_corpus(self.corpus_path), d, FIELDS, self.k1, self.b,
                                                    sink=store.add, workers=self.index_workers,
                                                    native=self._native_setting is not False,
                                                    progress=self.show_progress,
                                                    desc=f"indexing {self.corpus_path.name}")
        if not n_docs:
            raise CorpusError(f"{self.corpus_path}: the corpus holds no passages")
        for name in FIELDS:
            if not found[name]:  # no passage has a term in this field (e.g. a corpus without titles): it scores 0
                (d / name).mkdir(parents=True, exist_ok=True)
                (d / name / _EMPTY).write_text("no indexable term in this field\n")
        write_manifest(d, manifest, n_docs)

    # ---- search -------------------------------------------------------------------------------------------

    def field_scores(self, query_tokens: list[str]) -> dict[str, np.ndarray]:
        """Per-field BM25 score vectors `{field: [N] float32}` of one analysed query (terms with multiplicity)."""
        out = {}
        for f, model in self._fields.items():
            if model is None:
                out[f] = np.zeros(self.n_docs, dtype=np.float32)
                continue
            ids = model.get_tokens_ids(query_tokens)
            out[f] = model.get_scores_from_ids(ids) if ids else np.zeros(self.n_docs, dtype=np.float32)
        return out

    def _tokenize(self, texts: list[str], **kw):
        """bm25s analysis of passages or queries (module docstring), CJK characters one term each."""
        return bm25_build.analyse(texts, stemmer=self._stemmer, **kw)

    def analyze(self, queries: list[str]) -> list[list[str]]:
        """Analysed query terms (lowercase, stopwords removed, stemmed), one list per query."""
        return self._tokenize(queries, return_ids=False, show_progress=False)

    def search(self, queries: list[str], k: int) -> list[list[Doc]]:
        """Top-k passages per query by `max(s_title, s_text) + tie_breaker * min(...)` (module docstring).

        Only passages with score > 0 (at least one query term) are returned, so a query gets fewer than k
        when fewer passages match, and [] when it is blank or only stopwords. Ties: corpus order.
        """
        self.check_k(k)
        queries = self.check_queries(queries)
        with self._lock:  # (safe from several threads: calls run one after the other)
            return self._search(queries, k)

    def _search(self, queries: list[str], k: int) -> list[list[Doc]]:
        # Exact scores, every passage that holds a query term scored: fastrag._C's bm25_best_fields adds the
        # postings into a scratch and combines the fields in one pass (over the passages touched, or a sweep when
        # they are many); without it, numpy builds dense [N] vectors per field and per step of the combination.
        # The two agree to the bit; benchmarks/results/bm25_scale_cpu.md times both against the corpus size.
        analysed = self.analyze(queries)
        if self._native is not None:
            return self._search_native(analysed, k)
        return [self._search_one(toks, k) for toks in analysed]

    def _search_native(self, analysed: list[list[str]], k: int) -> list[list[Doc]]:
        """`_search_one` of every query in one call of fastrag._C.bm25_best_fields: the same passages, scores and
        order (csrc/bm25_cpu.cpp adds each field's postings in the same order, in the same dtypes), with one pass
        to combine the fields instead of about ten dense ones, without the GIL."""
        import torch

        fn, parts, scratch, mark = self._native
        terms, offsets = [], []
        for model in self._fields.values():
            ids = [model.get_tokens_ids(toks) if model is not None and toks else [] for toks in analysed]
            terms.append(torch.tensor([t for q in ids for t in q], dtype=torch.long))
            offsets.append(torch.tensor(np.cumsum([0] + [len(q) for q in ids]), dtype=torch.long))
        got_ids, got_scores = fn(parts["data"], parts["indices"], parts["indptr"], terms, offsets, scratch, mark,
                                 self.tie_breaker, k)
        out = []
        for row_ids, row_scores in zip(got_ids.tolist(), got_scores.tolist()):
            out.append([self._store.get(i, s) for i, s in zip(row_ids, row_scores) if i >= 0])
        return out

    def _search_one(self, toks: list[str], k: int) -> list[Doc]:
        if not toks:
            return []
        s = self.field_scores(toks)
        hi = np.maximum(s["title"], s["text"]).astype(np.float64)
        lo = np.minimum(s["title"], s["text"])
        combined = hi + self.tie_breaker * lo  # [N]
        hit = np.flatnonzero(combined > 0)
        if hit.size > k:
            # Keep every passage tied with the k-th score so the corpus-order tie break below is exact.
            kth = np.partition(combined[hit], hit.size - k)[hit.size - k]
            hit = hit[combined[hit] >= kth]
        order = hit[np.lexsort((hit, -combined[hit]))][:k]
        return [self._store.get(int(i), float(combined[i])) for i in order]
