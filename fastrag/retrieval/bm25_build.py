"""Building the BM25 index in bounded memory, a chunk of passages at a time.

bm25s builds an index from every passage's token ids held at once as Python lists, then a dense score triple per
(passage, term) and a sorted copy of it: 4.5 GiB resident per million DPR passages (benchmarks/results/
bm25_scale_cpu.md), so DPR's 21M would need about 93 GiB. This module builds the same index files in two passes
whose resident memory does not grow with the postings:

1. The corpus is read once. Each chunk of `CHUNK` passages is analysed into the stems bm25s's tokenizer gives
   (`analyse_passages`: the tokens, stopwords and stemmer the queries get through bm25s in `analyse`, the tokens
   found by fastrag._C's scan where it is built) and counted into (passage, term, tf) triples (`chunk_postings`);
   the main process maps the chunk's terms to corpus-wide ids and appends the triples to scratch files beside the
   index, keeping the document frequencies and passage lengths. The chunks can be analysed by worker processes
   (`workers`) while the main process reads the corpus and merges.
2. With N, avgdl and every document frequency known, each term's postings have a fixed place in the CSC arrays:
   the scratch files are read back in slices and every (passage, term) score is written straight into
   memory-mapped `data`/`indices` files, in passage order within each term.

What stays allocated: the vocabulary, 8 bytes per passage and field (its length and its number of postings) and one
chunk's or slice's working set; the arrays written are file maps, in the page cache, which the kernel may write back
and drop.

The files are bm25s's own format (`bm25s.BM25.load` reads them) and every score is bm25s's to the bit: the same
float32/float64 operations in the same order as `bm25s.scoring._build_scores_and_indices_for_matrix` (Lucene
variant), the idf from `math.log` per term as bm25s computes it, postings in passage order within a term.
Only the numbering of terms differs (bm25s numbers stems in Python set order, which changes with the hash seed;
here a chunk's new stems are numbered in sorted order after those of earlier chunks), and search never depends
on it. tests/test_bm25_build.py checks every score against bm25s's own build.
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from fastrag.settings import setting

# ---- analysis (shared with the queries: fastrag.retrieval.bm25 imports it) -----------------------------------------

# Every `\w+` run is a term, one-character ones included ("Type S", "D-Day", "Route 1"), as Elasticsearch's
# standard tokenizer keeps them (bm25s's default `\w\w+` dropped them, and with them the terms DRAGIN's published
# Elasticsearch retrievals matched on). Han ideographs (with extension A and the compatibility block) and hiragana
# are written without spaces, so each character is a term of its own, as that tokenizer makes them (a `\w+` token
# would be a whole clause); the second branch also takes the hiragana block's code points that are not `\w` (its sound marks).
_CJK = "\u3040-\u309f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_CJK_CHAR = re.compile(f"[{_CJK}]")
TOKEN_PATTERN = f"(?u)\\b\\w+\\b|[{_CJK}]"
STOPWORDS = "en"
STEMMER = "english"

CHUNK = 20_000  # passages analysed at a time (about 60 MiB of Python lists for DPR-sized passages)
SLICE = 1 << 20  # postings scored and placed at a time in the second pass (~80 bytes of temporaries each: 80 MiB)
WORKERS_ENV = "FASTRAG_INDEX_WORKERS"

_stemmers: dict[str, object] = {}


def _stemmer():
    s = _stemmers.get(STEMMER)
    if s is None:
        import Stemmer

        s = _stemmers[STEMMER] = Stemmer.Stemmer(STEMMER)
        # (PyStemmer's own cache of 10,000 words, emptied as it fills, made stemming a chunk's ~175,000 distinct
        # tokens 3.5x slower than without it: 0.20 against 0.06 s)
        s.maxCacheSize = 0
    return s


def analyse(texts: list[str], stemmer=None, **kw):
    """bm25s analysis of passages or queries (lowercase, `\\w+` tokens, one-character ones included, English
    stopwords, Snowball stemmer), a Han ideograph or hiragana character a term of its own; `kw` goes to
    `bm25s.tokenize`."""
    import bm25s

    texts = [_CJK_CHAR.sub(r" \g<0> ", t) if _CJK_CHAR.search(t) else t for t in texts]
    return bm25s.tokenize(texts, token_pattern=TOKEN_PATTERN, stopwords=STOPWORDS,
                          stemmer=_stemmer() if stemmer is None else stemmer, **kw)


# the same tokens as TOKEN_PATTERN on a text whose Han and hiragana characters stand between spaces (as `analyse`
# leaves them): a `\w+` match runs to the end of its word, so the pattern's word boundaries never cut one;
# without them Python's regex engine scans passages faster (tests/test_bm25_tokens.py compares the two)
_PASSAGE_TOKENS = re.compile(f"\\w+|[{_CJK}]")
# $FASTRAG_BM25_NATIVE=0: the Python tokenizer (regex) for the passages and numpy's search for the queries, instead
# of fastrag._C's (the same tokens, passages and scores; tests/test_bm25_tokens.py, tests/test_bm25_native.py)
NATIVE_ENV = "FASTRAG_BM25_NATIVE"


@functools.cache
def native_tokens():
    """fastrag._C.bm25_tokens (csrc/bm25_tokens.cpp), or None where the extension is not built."""
    try:
        import torch  # noqa: F401  (the extension links against torch's libraries)

        from fastrag import _C
    except ImportError:
        return None
    return getattr(_C, "bm25_tokens", None)


def analyse_passages(texts: Iterable[str], native: bool = True) -> tuple[list[str], np.ndarray, np.ndarray]:
    """`analyse` of passages as arrays: (the stems, every passage's stem ids end to end in text order [int32], stems
    per passage [int64]); the same stems, in the same order, as bm25s's tokenize with `analyse`'s settings.

    bm25s matches the tokens with Python's regex engine, makes a str of each and looks every one up three times in
    bytecode, then stems the chunk's distinct tokens. Here fastrag._C's scan (`native`, where built) finds and
    numbers the tokens in one pass over the code points (else the regex and two C-level passes, `dict.fromkeys` and
    `map`); only the distinct tokens meet the stopwords and the stemmer, and the stopwords are dropped with numpy."""
    scan = native_tokens() if native else None
    if scan is not None:  # (the Han and hiragana spaced and each text lowered in the scan)
        distinct, numbers, per_text = scan(texts if isinstance(texts, (list, tuple)) else list(texts))
        numbers, per_text = numbers.numpy(), per_text.numpy()
    else:
        cjk, find = _CJK_CHAR, _PASSAGE_TOKENS.findall
        split = [find((cjk.sub(r" \g<0> ", t) if cjk.search(t) else t).lower()) for t in texts]
        per_text = np.fromiter(map(len, split), dtype=np.int64, count=len(split))
        tokens = list(itertools.chain.from_iterable(split))
        del split
        index = dict(zip(dict.fromkeys(tokens), itertools.count()))  # (distinct tokens, numbered as first seen)
        distinct = list(index)
        numbers = np.fromiter(map(index.__getitem__, tokens), dtype=np.int32, count=len(tokens))
        del tokens, index
    n = len(per_text)
    is_stop = np.fromiter(map(_stopword_set().__contains__, distinct), dtype=bool, count=len(distinct))
    stems = _stemmer().stemWords(list(itertools.compress(distinct, ~is_stop)))  # (the distinct non-stopwords)
    stem_ids = dict(zip(dict.fromkeys(stems), itertools.count()))  # (the stems numbered as first seen)
    token_stem = np.full(len(distinct), -1, dtype=np.int32)  # (each distinct token's stem id; -1: a stopword)
    token_stem[~is_stop] = np.fromiter(map(stem_ids.__getitem__, stems), dtype=np.int32, count=len(stems))
    ids = token_stem[numbers]
    kept = ids >= 0
    lengths = np.bincount(np.repeat(np.arange(n, dtype=np.int64), per_text)[kept], minlength=n).astype(np.int64)
    return list(stem_ids), ids[kept], lengths


@functools.cache
def _stopword_set() -> frozenset:
    """bm25s's English stopwords (what `analyse`'s `stopwords="en"` removes)."""
    from bm25s.stopwords import STOPWORDS_EN

    return frozenset(STOPWORDS_EN)


def _analyse_chunk(fields: tuple[list[str], ...], native: bool = True) -> list[tuple]:
    """Per field of one chunk: `chunk_postings(*analyse_passages(texts))`. Runs in a worker process or in the
    builder's own."""
    return [chunk_postings(*analyse_passages(texts, native)) for texts in fields]


def chunk_postings(stems: list[str], flat: np.ndarray, lengths: np.ndarray) -> tuple:
    """One chunk's postings from `analyse_passages`: (its stems, each posting's term in the chunk's numbering
    [int32] and its term frequency [int32], postings per passage [int32], terms per passage with repeats [int32]),
    the postings in passage order (within a passage in term order)."""
    m = len(lengths)
    doc = np.repeat(np.arange(m, dtype=np.int64), lengths)
    key, tf = np.unique((doc << 32) | flat.astype(np.int64), return_counts=True)  # (by passage, then term)
    return (stems, (key & 0xFFFFFFFF).astype(np.int32), tf.astype(np.int32),
            np.bincount(key >> 32, minlength=m).astype(np.int32), lengths.astype(np.int32))


# ---- one field ---------------------------------------------------------------------------------------------------

class FieldBuilder:
    """The postings of one field, a chunk at a time (`add`), then the bm25s index files (`finish`)."""

    def __init__(self, scratch: Path):
        self.scratch = scratch
        scratch.mkdir(parents=True, exist_ok=True)
        self.vocab: dict[str, int] = {}
        self.df = np.zeros(0, dtype=np.int64)
        self.lengths: list[np.ndarray] = []  # terms per passage (with repeats), for the length normalisation
        self.pairs: list[np.ndarray] = []  # distinct terms per passage: its postings
        self._terms = open(scratch / "terms.i32", "wb")
        self._tfs = open(scratch / "tfs.i32", "wb")

    def add(self, stems: list[str], terms: np.ndarray, tfs: np.ndarray, pairs: np.ndarray,
            lengths: np.ndarray) -> None:
        """One chunk's `chunk_postings`, its terms numbered in this field's vocabulary."""
        vocab = self.vocab
        known = list(map(vocab.get, stems))
        new = [i for i, g in enumerate(known) if g is None]
        for i in sorted(new, key=stems.__getitem__):  # (numbered in sorted order: the same ids on every run)
            known[i] = vocab[stems[i]] = len(vocab)
        terms = np.array(known, dtype=np.int32)[terms]
        if len(self.df) < len(vocab):
            self.df = np.concatenate([self.df, np.zeros(len(vocab) - len(self.df), dtype=np.int64)])
        self.df += np.bincount(terms, minlength=len(vocab))
        self.lengths.append(lengths)  # (int32: 8 bytes a passage for the two; see finish)
        self.pairs.append(pairs)
        terms.tofile(self._terms)
        tfs.tofile(self._tfs)

    def finish(self, out: Path, k1: float, b: float) -> bool:
        """Write the bm25s index of the field into `out` (made or emptied); False, writing nothing, when no
        passage has a term in it."""
        self._terms.close()
        self._tfs.close()
        if not self.vocab:
            return False
        import bm25s

        lengths = np.concatenate(self.lengths)
        pairs = np.concatenate(self.pairs)
        self.lengths = self.pairs = []
        n_docs, n_vocab = len(lengths), len(self.vocab)
        # np.float64, as bm25s takes it from an int64 array: an integer array's mean adds its values as float64
        avgdl = lengths.mean()
        idf = np.array([math.log(1 + (n_docs - d + 0.5) / (d + 0.5)) for d in self.df.tolist()], dtype=np.float32)
        indptr = np.zeros(n_vocab + 1, dtype=np.int64)
        np.cumsum(self.df, out=indptr[1:])
        nnz = int(indptr[-1])
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        # bm25s.BM25.save's parameters and vocabulary (a model with no postings saved aside; its arrays dropped), so
        # the folder is what bm25s writes and reads; the arrays are written in place below
        model = bm25s.BM25(k1=k1, b=b, method="lucene")
        model.scores = {"data": np.zeros(0, dtype=np.float32), "indices": np.zeros(0, dtype=np.int32),
                        "indptr": np.zeros(1, dtype=np.int64), "num_docs": n_docs}
        vocab = self.vocab
        vocab[""] = n_vocab  # (bm25s's index() adds the empty token after the last term id, outside the postings)
        model.vocab_dict = vocab
        model.nonoccurrence_array = None  # (Lucene BM25 has none)
        with tempfile.TemporaryDirectory(dir=self.scratch) as aside:
            model.save(aside, show_progress=False)
            for name in ("params.index.json", "vocab.index.json"):
                os.replace(Path(aside) / name, out / name)
        self.vocab = {}
        np.save(out / "indptr.csc.index.npy", indptr)
        data = np.lib.format.open_memmap(out / "data.csc.index.npy", mode="w+", dtype=np.float32, shape=(nnz,))
        indices = np.lib.format.open_memmap(out / "indices.csc.index.npy", mode="w+", dtype=np.int32, shape=(nnz,))
        cursor = indptr[:-1].copy()  # where each term's next posting goes
        ends = np.cumsum(pairs, dtype=np.int64)  # the postings of passages [0, d] end at ends[d]
        with open(self.scratch / "terms.i32", "rb") as terms, open(self.scratch / "tfs.i32", "rb") as tfs:
            d0 = p0 = 0
            while d0 < n_docs:  # (whole passages a slice, up to SLICE postings; the files read in order)
                d1 = min(n_docs, max(d0 + 1, int(np.searchsorted(ends, p0 + SLICE, side="right"))))
                p1 = int(ends[d1 - 1])
                if p1 == p0:  # (passages without a term in this field)
                    d0 = d1
                    continue
                t = np.fromfile(terms, dtype=np.int32, count=p1 - p0)
                tf = np.fromfile(tfs, dtype=np.int32, count=p1 - p0).astype(np.float32)
                doc = np.repeat(np.arange(d0, d1, dtype=np.int64), pairs[d0:d1])
                l_d = lengths[doc]  # (int32: `b * l_d` is float64 all the same, its values exact)
                # bm25s's Lucene term-frequency part, operation for operation (float64 from the np.float64 avgdl)
                tfc = tf / (k1 * ((1 - b) + b * l_d / avgdl) + tf)
                score = (idf[t] * tfc).astype(np.float32)
                # the postings in (term, passage) order: a sort of term << 32 | place in the slice, which numpy does
                # ~6x faster than a stable argsort of the terms (its SIMD sort of 64-bit values); the place keeps the
                # passage order within a term and is the argsort
                key = np.sort((t.astype(np.int64) << 32) | np.arange(len(t), dtype=np.int64))
                order = key & 0xFFFFFFFF
                ts = (key >> 32).astype(np.int32)
                del key
                starts = np.flatnonzero(np.r_[True, ts[1:] != ts[:-1]])
                counts = np.diff(np.r_[starts, len(ts)])
                dest = cursor[ts] + (np.arange(len(ts)) - np.repeat(starts, counts))
                cursor[ts[starts]] += counts
                data[dest] = score[order]
                indices[dest] = doc[order].astype(np.int32)
                d0, p0 = d1, p1
        if not np.array_equal(cursor, indptr[1:]):  # (every term's postings filled exactly)
            raise RuntimeError(f"{out}: BM25 build placed postings inconsistently with the document frequencies")
        data.flush()
        indices.flush()
        del data, indices
        return True


# ---- the build -----------------------------------------------------------------------------------------------------

def workers_setting() -> int | None:
    """$FASTRAG_INDEX_WORKERS: processes that analyse passages during a BM25 build (1: the building process
    alone); None when unset (one per usable CPU, up to 8, once the corpus is bigger than two chunks)."""
    return setting(WORKERS_ENV)


def _auto_workers() -> int:
    from fastrag.text.pool import usable_cpus

    return max(1, min(8, usable_cpus()))


def pool_size(n_chunks: int, workers: int) -> int:
    """Analysis processes a build of `n_chunks` chunks runs with `workers` asked for: a pool from the third chunk on
    where processes can be forked, else 1 (the builder alone)."""
    return workers if n_chunks > 2 and workers > 1 and _can_fork() else 1


def chunks(rows: Iterable[tuple[str, ...]], size: int) -> Iterator[list[tuple[str, ...]]]:
    """Lists of `size` rows (the last one shorter), read from `rows` one list at a time."""
    it = iter(rows)
    while batch := list(itertools.islice(it, size)):
        yield batch


def build_fields(rows: Iterable[tuple[str, str, str]], out: Path, fields: tuple[str, ...], k1: float, b: float,
                 sink=None, workers: int | None = None, progress: bool = False, chunk: int = CHUNK,
                 desc: str = "indexing", native: bool = True) -> tuple[int, dict[str, bool]]:
    """Index `(id, title, text)` rows field by field (`fields` name the title and text, in that order) into
    `out/<field>/` as bm25s indexes; `sink(rows)` gets each chunk first (the passage store). Returns (passages,
    {field: whether any passage has a term in it}); a field without any writes nothing (the caller marks it).
    `native`: the passages' tokens found by fastrag._C where it is built (`analyse_passages`; the same tokens).
    Scratch files go to `out/.build/`, removed at the end whether the build succeeds or fails."""
    scratch = out / ".build"
    if scratch.exists():
        shutil.rmtree(scratch)
    builders = {f: FieldBuilder(scratch / f) for f in fields}
    nproc = workers if workers is not None else (workers_setting() or _auto_workers())
    n = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(desc=desc, unit=" passages", unit_scale=True, file=sys.stderr)
    try:
        pool = None
        pending: collections.deque = collections.deque()

        def merge(parts):
            for f, postings in zip(fields, parts):
                builders[f].add(*postings)
            if bar is not None:
                bar.update(len(parts[0][4]))

        try:
            for i, batch in enumerate(chunks(rows, chunk)):
                if sink is not None:
                    sink(batch)
                texts = (tuple(r[1] for r in batch), tuple(r[2] for r in batch))
                n += len(batch)
                if pool is None and pool_size(i + 1, nproc) > 1:
                    # (a corpus of more than two chunks: worth the processes; smaller ones stay in this one)
                    pool = multiprocessing.get_context("fork").Pool(nproc)
                if pool is None:
                    merge(_analyse_chunk(texts, native))
                else:
                    pending.append(pool.apply_async(_analyse_chunk, (texts, native)))
                    while len(pending) > 2 * nproc:  # (bounded: the corpus is not read ahead whole)
                        merge(pending.popleft().get())
            while pending:
                merge(pending.popleft().get())
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
        if bar is not None:
            bar.set_postfix_str("writing the postings")
            bar.refresh()
        found = {f: builders[f].finish(out / f, k1, b) for f in fields}
    finally:
        for fb in builders.values():
            fb._terms.close()
            fb._tfs.close()
        shutil.rmtree(scratch, ignore_errors=True)
        if bar is not None:
            bar.close()
    return n, found


def _can_fork() -> bool:
    """Worker processes are forked (the analysis needs no state of the parent but its imports): only on Linux,
    where fork is safe for processes that run no threads' code; elsewhere the build stays in one process."""
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()
