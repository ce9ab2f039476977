"""The corpus readers' fast paths read what the slow ones read.

A tsv line is split at its tabs and its quoted fields unquoted from the split where that is the csv reading
(corpus._split_quoted), else parsed (corpus._parse_quoted); both are checked against Python's csv reader
(`excel-tab`, strict, its field limit lifted) on fresh random lines over the characters that matter (quotes, tabs,
NUL, spaces, non-ASCII), and a line the reader refuses keeps its text as written. A quoted passage longer than the
reader's 128 KiB field limit is unquoted like any other (it used to keep its quotes and "" escapes). The JSON Lines
reader's surrogate check runs only on lines with a \\u escape, the only source of a lone surrogate."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import random
import sys

import pytest

from fastrag.retrieval import corpus as corpus_mod
from fastrag.retrieval.corpus import CorpusError, iter_corpus


@contextlib.contextmanager
def _no_field_limit():
    old = csv.field_size_limit(sys.maxsize)
    try:
        yield
    finally:
        csv.field_size_limit(old)


def _csv_fields(line: str) -> list[str] | None:
    """Python's csv reading of one line, None where the strict reader refuses it."""
    try:
        return next(csv.reader([line], delimiter="\t", strict=True))
    except csv.Error:
        return None


def _random_line(rng: random.Random) -> str:
    pieces = ['"', '"', '""', "\t", "a", "bc", " ", "é", "\x00", '"x"', "\t\"", "\"\t", "中"]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(1, rng.choice([4, 12, 40]))))


@pytest.mark.parametrize("trial", range(4))
def test_tsv_fields_are_the_csv_readers_fields_or_the_line_as_written(trial):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    split_hits = parse_hits = refused = 0
    with _no_field_limit():
        for _ in range(20_000):
            line = _random_line(rng)
            want = _csv_fields(line)
            assert corpus_mod._parse_quoted(line) == want, (seed, line)
            if want is None:
                refused += 1
                want = line.split("\t")  # (not csv quoting: the text as written)
            got = corpus_mod._tsv_fields(line)
            assert got == want, (seed, line, got, want)
            fast = corpus_mod._split_quoted(line.split("\t")) if '"' in line else None
            if fast is not None:
                assert fast == want, (seed, line)
                split_hits += 1
            elif '"' in line:
                parse_hits += 1
    # (each path met often enough to mean something)
    assert split_hits > 1000 and parse_hits > 1000 and refused > 1000, (seed, split_hits, parse_hits, refused)


def test_a_quoted_passage_over_the_csv_field_limit_is_unquoted(tmp_path):
    """csv's reader refuses a field over 131,072 characters ("field larger than field limit"), which made such a
    passage keep its quotes and its "" escapes in the index and the passage store."""
    long_text = ("word " * 40_000) + 'a "quoted" phrase'
    tabbed = "left\t" + "x" * 140_000 + "\tright"
    p = tmp_path / "long.tsv"
    with open(p, "w", encoding="utf-8") as f:
        f.write("id\ttext\ttitle\n")
        for i, text in enumerate([long_text, tabbed, "short"]):
            f.write(f'p{i}\t"{text.replace(chr(34), chr(34) * 2)}"\tT{i}\n')
    assert list(iter_corpus(p)) == [("p0", "T0", long_text), ("p1", "T1", tabbed), ("p2", "T2", "short")]


def test_a_refused_long_quoted_line_keeps_its_text(tmp_path):
    """A quote never closed, in a line longer than csv's field limit: the line's text as written, the next line
    read on its own."""
    text = '"' + "y" * 200_000
    p = tmp_path / "open.tsv"
    p.write_text(f"id\ttext\ttitle\np1\t{text}\tT\np2\tnext\tU\n", encoding="utf-8")
    assert list(iter_corpus(p)) == [("p1", "T", text), ("p2", "U", "next")]


@pytest.mark.parametrize("escape", ["\\ud800", "\\uDC00", "x\\uDBFF"])
def test_a_lone_surrogate_escape_is_named_in_any_case(tmp_path, escape):
    p = tmp_path / "c.jsonl"
    p.write_text('{"id": "a", "text": "fine \\u00e9 ok"}\n'  # (an escape that is no surrogate: read)
                 + '{"id": "b", "title": "T", "text": "bad ' + escape + '"}\n', encoding="utf-8")
    with pytest.raises(CorpusError, match=r"c\.jsonl:2: field 'text' holds a lone surrogate \(U\+D[89A-F]"):
        list(iter_corpus(p))


def test_a_byte_order_mark_inside_a_jsonl_file_is_named(tmp_path):
    """The file's own mark is dropped as it is read; one at the start of a later line (files joined whole) is told
    for what it is, not only as "Expecting value"."""
    p = tmp_path / "joined.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + b'{"id": "a", "text": "x"}\n' + b"\xef\xbb\xbf" + b'{"id": "b", "text": "y"}\n')
    with pytest.raises(CorpusError, match=r"joined\.jsonl:2: malformed JSON .*starts with a byte-order mark U\+FEFF"):
        list(iter_corpus(p))


def test_a_tsv_index_of_the_previous_reader_is_built_again(tmp_path):
    """A tsv index whose manifest names reader 2 (before long quoted fields were unquoted) is built again, and
    then holds the unquoted passage; a jsonl index keeps reader 2 (its reading did not change)."""
    from fastrag.retrieval.bm25 import BM25Retriever

    long_text = "needle " + "hay " * 40_000
    p = tmp_path / "c.tsv"
    p.write_text(f'id\ttext\ttitle\np1\t"{long_text}"\tT\np2\tother words\tU\n', encoding="utf-8")
    r = BM25Retriever(p, show_progress=False)
    manifest = r.index_dir / "manifest.json"
    m = json.loads(manifest.read_text())
    assert m["reader"] == corpus_mod.READER_VERSIONS["tsv"] == 3
    m["reader"] = 2
    manifest.write_text(json.dumps(m))
    again = BM25Retriever(p, show_progress=False)
    assert again.built
    hit = again.search(["needle"], 1)[0][0]
    assert hit.id == "p1" and hit.text == long_text
    assert corpus_mod.reader_version(tmp_path / "x.jsonl.gz") == 2
