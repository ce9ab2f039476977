"""Corpus readers: jsonl `{id, title, text}`, jsonl `{id, contents}` (FlashRAG), and the DPR tsv.

All formats yield `(id, title, text)` string triples in file order (the corpus order that breaks score ties).
- jsonl `{id, title, text}`: one JSON object per line; blank lines are skipped.
- jsonl `{id, contents}`: FlashRAG style, the first line of `contents` is the title and the rest the text;
  a title in double quotes ('"Title"\\ntext', the wiki-18 dump) is unquoted.
- DPR tsv (`psgs_w100.tsv`): a header line `id\\ttext\\ttitle`, then one passage per line (columns in header order).
Passage ids must be unique (results, traces and FLARE's merge name passages by id): a repeated one is an error that
names both lines.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
from pathlib import Path
from typing import Iterator


class CorpusError(ValueError):
    """A corpus file that cannot be read: names the file, the 1-based line and the field."""


def _split_contents(contents: str) -> tuple[str, str]:
    title, _, text = contents.partition("\n")
    title = title.strip()
    if len(title) >= 2 and title[0] == '"' and title[-1] == '"':
        title = title[1:-1]
    return title, text.strip()


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) pairs; a decoding error names the line after the last good one."""
    lineno = 0
    try:
        with open(path, encoding="utf-8-sig") as f:  # (a byte-order mark is dropped)
            for lineno, line in enumerate(f, 1):
                yield lineno, line
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path}:{lineno + 1}: not valid UTF-8 ({e.reason})") from e
    except OSError as e:
        raise CorpusError(f"{path}: cannot read corpus file ({e.strerror})") from e


def _check_unique(path: Path, seen: dict[str, int], doc_id: str, lineno: int) -> None:
    first = seen.setdefault(doc_id, lineno)
    if first != lineno:
        raise CorpusError(f"{path}:{lineno}: field 'id': passage id {doc_id!r} repeats line {first} (ids must be "
                          "unique: results and retrieval merges name passages by id)")


def _iter_jsonl(path: Path) -> Iterator[tuple[str, str, str]]:
    seen: dict[str, int] = {}
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise CorpusError(f"{path}:{lineno}: malformed JSON ({e.msg})") from e
        if not isinstance(rec, dict):
            raise CorpusError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
        if "id" not in rec:
            raise CorpusError(f"{path}:{lineno}: missing field 'id'")
        if isinstance(rec["id"], bool) or not isinstance(rec["id"], (str, int)):
            raise CorpusError(f"{path}:{lineno}: field 'id' must be a string or an integer, got "
                              f"{type(rec['id']).__name__}")
        if "text" in rec:
            title, text = rec.get("title"), rec["text"]
            title = "" if title is None else title
        elif "contents" in rec:
            if not isinstance(rec["contents"], str):
                raise CorpusError(f"{path}:{lineno}: field 'contents' must be a string")
            title, text = _split_contents(rec["contents"])
        else:
            raise CorpusError(f"{path}:{lineno}: missing field 'text' (or 'contents')")
        for name, v in (("title", title), ("text", text)):
            if not isinstance(v, str):
                raise CorpusError(f"{path}:{lineno}: field {name!r} must be a string, got {type(v).__name__}")
        _check_unique(path, seen, str(rec["id"]), lineno)
        yield str(rec["id"]), title, text


def _iter_tsv(path: Path) -> Iterator[tuple[str, str, str]]:
    try:
        yield from _iter_tsv_rows(path)
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path}: not valid UTF-8 ({e.reason})") from e
    except OSError as e:
        raise CorpusError(f"{path}: cannot read corpus file ({e.strerror})") from e


def _iter_tsv_rows(path: Path) -> Iterator[tuple[str, str, str]]:
    with open(path, encoding="utf-8-sig", newline="") as f:  # (a byte-order mark is dropped)
        # DPR passages contain double quotes; csv's QUOTE_NONE would keep them, but the official file quotes
        # fields with embedded quotes ("" escaping), so the default dialect reads it correctly.
        reader = csv.reader(f, delimiter="\t")
        header = next(reader, None)
        if header is None:
            raise CorpusError(f"{path}:1: empty tsv (expected a header line 'id\\ttext\\ttitle')")
        cols = {name.strip(): i for i, name in enumerate(header)}
        for need in ("id", "text", "title"):
            if need not in cols:
                raise CorpusError(f"{path}:1: tsv header lacks column {need!r} (got {header})")
        i_id, i_text, i_title = cols["id"], cols["text"], cols["title"]
        width = len(header)
        seen: dict[str, int] = {}
        for row in reader:
            lineno = reader.line_num
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if len(row) != width:
                raise CorpusError(f"{path}:{lineno}: expected {width} tab-separated fields, got {len(row)}")
            _check_unique(path, seen, row[i_id], lineno)
            yield row[i_id], row[i_title], row[i_text]


def iter_corpus(path: str | os.PathLike) -> Iterator[tuple[str, str, str]]:
    """Yield `(id, title, text)` for each passage of a .jsonl or .tsv corpus file, in file order."""
    p = Path(path)
    if not p.is_file():
        raise CorpusError(f"corpus file not found: {p}")
    if not os.access(p, os.R_OK):
        raise CorpusError(f"corpus file not readable: {p}")
    return _iter_tsv(p) if corpus_format(p) == "tsv" else _iter_jsonl(p)


def corpus_format(path: str | os.PathLike) -> str:
    """"tsv" or "jsonl", from the file's suffix; CorpusError for any other (checked before an index folder is made)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in (".tsv", ".tab"):
        return "tsv"
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    raise CorpusError(f"unsupported corpus format {p.suffix!r} for {p}: expected .jsonl or .tsv")


def corpus_fingerprint(path: str | os.PathLike, whole_below: int = 64 << 20, blocks: int = 64,
                       block: int = 1 << 16) -> str:
    """A content fingerprint for index staleness, beside the file's size and modification time: the sha256 of the
    whole file below `whole_below` bytes, else of `blocks` evenly spaced blocks of `block` bytes and the last
    block (a corpus replaced by one of the same size and time, e.g. `cp -p` or `rsync -a`, is caught; reading a
    13 GB DPR file whole on every load is not worth it)."""
    p = Path(path)
    h = hashlib.sha256()
    size = p.stat().st_size
    with open(p, "rb") as f:
        if size <= whole_below:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
            return "sha256:" + h.hexdigest()
        for i in range(blocks + 1):
            f.seek(min(size - block, i * (size - block) // blocks))
            h.update(f.read(block))
    return f"sha256-sampled-{blocks}x{block}:" + h.hexdigest()
