"""The corpus readers' check that passage ids do not repeat (`fastrag.retrieval.corpus._UniqueIds`): the first
repeat in file order is reported with its line and the earlier line, whichever blocks the two fall in, on fresh
random corpora against a plain dict of every id; hash collisions are never errors; and the check keeps about 16
bytes an id, not the ids."""

from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from fastrag.retrieval import corpus as corpus_mod
from fastrag.retrieval.corpus import CorpusError, iter_corpus


def _write(path: Path, ids: list[str]) -> Path:
    if path.suffix == ".tsv":
        path.write_text("id\ttext\ttitle\n" + "".join(f"{i}\tsome text {n}\tT\n" for n, i in enumerate(ids)))
    else:
        path.write_text("".join(json.dumps({"id": i, "title": "T", "text": f"some text {n}"}) + "\n"
                                for n, i in enumerate(ids)))
    return path


def _first_repeat(ids: list[str], header: int) -> tuple[int, int, str] | None:
    """(line, earlier line, id) of the first id that repeats, by a dict of every id (the reference)."""
    seen: dict[str, int] = {}
    for n, i in enumerate(ids):
        line = n + 1 + header
        if i in seen:
            return line, seen[i], i
        seen[i] = line
    return None


@pytest.mark.parametrize("suffix", [".jsonl", ".tsv"])
@pytest.mark.parametrize("seed", range(6))
def test_the_first_repeat_is_found_across_blocks(tmp_path, monkeypatch, suffix, seed):
    rng = random.Random(seed)
    monkeypatch.setattr(corpus_mod._UniqueIds, "BLOCK", rng.choice([1, 2, 3, 5, 8, 16]))
    n = rng.randint(20, 200)
    ids = [f"doc{rng.randrange(10**9)}" for _ in range(n)]
    if seed % 3 != 2:  # (one corpus in three has no repeat)
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(n - 1)
            ids[rng.randrange(a + 1, n)] = ids[a]
    want = _first_repeat(ids, header=int(suffix == ".tsv"))
    path = _write(tmp_path / f"c{suffix}", ids)
    if want is None:
        assert [r[0] for r in iter_corpus(path)] == ids
        return
    line, first, doc_id = want
    with pytest.raises(CorpusError) as e:
        list(iter_corpus(path))
    assert str(e.value).startswith(f"{path}:{line}: field 'id': passage id {doc_id!r} repeats line {first} ")


def test_an_earlier_blocks_repeat_is_reported_before_a_later_one_in_the_block(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_mod._UniqueIds, "BLOCK", 4)
    # lines 1-4 fill the first block; line 6 repeats line 2 (across blocks), line 7 repeats line 5 (in its block)
    ids = ["a", "b", "c", "d", "e", "b", "e", "f"]
    path = _write(tmp_path / "c.jsonl", ids)
    with pytest.raises(CorpusError, match=r"c\.jsonl:6: field 'id': passage id 'b' repeats line 2"):
        list(iter_corpus(path))


def test_hash_collisions_are_confirmed_against_the_file_and_never_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_mod._UniqueIds, "BLOCK", 3)
    real = corpus_mod._UniqueIds._hashed

    def colliding(self):  # every id hashes alike: each block's every id looks like a repeat
        ids, h, lines = real(self)
        return ids, np.zeros_like(h), lines

    monkeypatch.setattr(corpus_mod._UniqueIds, "_hashed", colliding)
    ids = [f"p{i}" for i in range(40)]
    for suffix in (".jsonl", ".tsv"):
        path = _write(tmp_path / f"ok{suffix}", ids)
        assert [r[0] for r in iter_corpus(path)] == ids
        bad = _write(tmp_path / f"bad{suffix}", ids + ["p7"])
        line = 41 + int(suffix == ".tsv")
        with pytest.raises(CorpusError, match=f"{line}: field 'id': passage id 'p7' repeats line "
                                              f"{8 + int(suffix == '.tsv')}"):
            list(iter_corpus(bad))


def test_the_check_keeps_hashes_not_ids(tmp_path, monkeypatch):
    # 200,000 distinct ids of 40 characters: a dict of them would hold ~150 bytes an id (30 MB); the check keeps
    # 16 bytes an id plus one block's dict and a merge's temporaries
    monkeypatch.setattr(corpus_mod._UniqueIds, "BLOCK", 4096)
    n = 200_000
    path = tmp_path / "c.tsv"
    with open(path, "w") as f:
        f.write("id\ttext\ttitle\n")
        for i in range(n):
            f.write(f"{i:040d}\tx\t\n")
    tracemalloc.start()
    try:
        count = sum(1 for _ in iter_corpus(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert count == n
    assert peak < 60 * n, peak
