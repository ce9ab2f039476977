"""Corpus readers: jsonl `{id, title, text}`, jsonl `{id, contents}` (FlashRAG), and the DPR tsv.

All formats yield `(id, title, text)` string triples in file order (the corpus order that breaks score ties).
- jsonl `{id, title, text}`: one JSON object per line; blank lines are skipped. The id may be named `_id` (BEIR's
  `corpus.jsonl`, whose `metadata` is not read); `id` wins when a line has both.
- jsonl `{id, contents}`: FlashRAG style, the first line of `contents` is the title and the rest the text;
  a title in double quotes ('"Title"\\ntext', the wiki-18 dump) is unquoted; `contents` without a line break is
  all text (no title).
- DPR tsv (`psgs_w100.tsv`): a header line `id\\ttext\\ttitle`, then one passage per line (columns in header order);
  csv-quoted fields are unquoted, any other quote is text.
Passage ids must be unique (results, traces and FLARE's merge name passages by id): a repeated one is an error that
names both lines. Any of them may be gzip, bzip2 or xz compressed (`psgs_w100.tsv.gz`): the first bytes tell, and the
format comes from the suffix before the compression's.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Iterator

import numpy as np

from fastrag import compressed
from fastrag.jsonkeys import RepeatedKey, unique_keys


# How the readers turn a file into passages, by format; saved in every index manifest (`reader_version`), so that an
# index built by a reader that read some file differently is built again instead of trusted. 2: tsv quotes that are
# not csv quoting stay text, `contents` without a line break is text; 3 (tsv only): a quoted field over 128 KiB,
# which csv's reader refused and so kept its quotes, is unquoted like any other
READER_VERSIONS = {"jsonl": 2, "tsv": 3}


def reader_version(path: str | os.PathLike) -> int:
    """The reader version of a corpus file's format (READER_VERSIONS), for index manifests."""
    return READER_VERSIONS[corpus_format(path)]


_SURROGATE = re.compile("[\ud800-\udfff]")


class CorpusError(ValueError):
    """A corpus file that cannot be read: names the file, the 1-based line and the field."""


def _split_contents(contents: str) -> tuple[str, str]:
    if "\n" not in contents:  # no title line: all of it is the passage's text
        return "", contents.strip()
    title, _, text = contents.partition("\n")
    title = title.strip()
    if len(title) >= 2 and title[0] == '"' and title[-1] == '"':
        title = title[1:-1]
    return title, text.strip()


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) pairs, each line with its ending as written ("\n", "\r\n", or a lone "\r",
    which ends a line as it does for csv readers); a decoding error names the line that holds the bad byte. A gzip,
    bzip2 or xz file is read decompressed (`fastrag.compressed`); line numbers count the decompressed text."""
    lineno, kind = 0, None
    try:
        kind = compressed.compression(path, CorpusError)
        with compressed.open_text(path, kind, encoding="utf-8-sig", newline="") as f:  # (a byte-order mark is dropped)
            for lineno, line in enumerate(f, 1):
                yield lineno, line
    except UnicodeDecodeError as e:
        # (the text reader decodes blocks of 8 KiB ahead of the lines it has handed out: the line after the last
        # good one can be hundreds of lines before the bad byte, so find it in the bytes)
        if kind is not None:  # (damaged compressed data decodes to bytes that are not UTF-8 long before its CRC)
            compressed.check_stream(path, kind, CorpusError)
        lineno, byte = _bad_utf8_line(path, kind)
        raise CorpusError(f"{path}:{lineno}: not valid UTF-8 ({e.reason}, byte 0x{byte:02x}); convert the file "
                          "to UTF-8") from e
    except compressed.STREAM_ERRORS as e:
        if kind is None and isinstance(e, OSError):
            raise CorpusError(f"{path}: cannot read corpus file ({e.strerror or e})") from e
        where = f" after line {lineno}" if lineno else " before its first line"
        raise CorpusError(compressed.damaged(path, kind, e, where)) from e


def _bad_utf8_line(path: Path, kind: str | None = None) -> tuple[int, int]:
    """(1-based line, value) of the first byte of `path` that is not UTF-8, lines counted as the text reader of
    `_lines` counts them (at "\n", "\r\n" and a lone "\r"; none of these bytes is part of a multi-byte character)."""
    lineno = 0
    with compressed.open_binary(path, kind) as f:
        for raw in f:  # (split at b"\n")
            for part in raw.splitlines() or [raw]:
                lineno += 1
                try:
                    part.decode("utf-8")
                except UnicodeDecodeError as e:
                    return lineno, part[e.start]
    return max(lineno, 1), 0  # (not reached for a file the text reader failed on)


class _UniqueIds:
    """Checks that passage ids do not repeat, in 16 bytes an id instead of a dict of every id (~120 bytes an id:
    2.5 GB for DPR's 21M). The ids of the current block of `BLOCK` passages are kept exactly, in a dict; a full
    block becomes a sorted array of its ids' hashes with their line numbers, merged into levels of doubling size
    (so each id is merged O(log n) times), and each block is checked against the levels before it. A hash found
    again is confirmed by reading the earlier line's id back from the file (`id_at`), so a hash collision is never
    an error. A repeat is reported as before: at the first line, in file order, whose id an earlier line had; one
    across blocks is found when its block is full (or at the end of the file)."""

    BLOCK = 1 << 16

    def __init__(self, path: Path, id_at):
        self.path, self.id_at = path, id_at
        self.block: dict[str, int] = {}
        self.levels: list[tuple[np.ndarray, np.ndarray]] = []  # (sorted id hashes, their 1-based lines) [int64]
        self.n = 0

    def add(self, doc_id: str, lineno: int) -> None:
        first = self.block.setdefault(doc_id, lineno)
        if first != lineno:
            self._check_levels(*self._hashed())  # (a repeat of an earlier block at an earlier line comes first)
            raise self._repeat(doc_id, lineno, first)
        self.n += 1
        if len(self.block) >= self.BLOCK:
            self._flush()

    def finish(self) -> None:
        if self.levels:  # (a corpus of one block was checked whole by its dict)
            self._check_levels(*self._hashed())
        self.block, self.levels = {}, []

    def _repeat(self, doc_id: str, lineno: int, first: int) -> CorpusError:
        return CorpusError(f"{self.path}:{lineno}: field 'id': passage id {doc_id!r} repeats line {first} (ids must "
                           "be unique: results and retrieval merges name passages by id)")

    def _hashed(self) -> tuple[list[str], np.ndarray, np.ndarray]:
        ids = list(self.block)
        h = np.fromiter(map(hash, ids), dtype=np.int64, count=len(ids))
        lines = np.fromiter(self.block.values(), dtype=np.int64, count=len(ids))
        return ids, h, lines

    def _check_levels(self, ids: list[str], h: np.ndarray, lines: np.ndarray) -> None:
        """Raise the first repeat, in file order, of an id of the block (its ids, hashes and lines) in the levels."""
        found = []  # (line, id, earlier line) of each id an earlier block had
        for lh, ll in self.levels:
            pos = np.searchsorted(lh, h)
            for j in np.flatnonzero(lh[np.minimum(pos, len(lh) - 1)] == h):  # (rare: a repeat or a collision)
                k = int(pos[j])
                while k < len(lh) and lh[k] == h[j]:
                    if self.id_at(int(ll[k])) == ids[j]:
                        found.append((int(lines[j]), ids[j], int(ll[k])))
                    k += 1
        if found:
            lineno, doc_id, first = min(found)
            raise self._repeat(doc_id, lineno, first)

    def _flush(self) -> None:
        ids, h, lines = self._hashed()
        self._check_levels(ids, h, lines)
        order = np.argsort(h, kind="stable")
        level = (h[order], lines[order])
        while self.levels and len(self.levels[-1][0]) <= len(level[0]):
            lh, ll = self.levels.pop()
            hh, lo = np.concatenate([lh, level[0]]), np.concatenate([ll, level[1]])
            order = np.argsort(hh, kind="stable")
            level = (hh[order], lo[order])
        self.levels.append(level)
        self.block = {}


def _line_at(path: Path, lineno: int) -> str:
    """Line `lineno` of a corpus already read through it."""
    for n, line in _lines(path):
        if n == lineno:
            return line
    raise CorpusError(f"{path}: line {lineno} is gone: the file changed while it was read")


def _jsonl_id_at(path: Path, lineno: int) -> str:
    """The passage id on line `lineno` of a jsonl corpus already read through it (so the line is a valid record)."""
    rec = json.loads(_line_at(path, lineno))
    return str(rec["id"] if "id" in rec else rec["_id"])


def _tsv_id_at(path: Path, lineno: int, i_id: int) -> str:
    return _tsv_fields(_line_at(path, lineno).rstrip("\r\n"))[i_id]


def _lone_cr(line: str) -> bool:
    return line.endswith("\r")


def _lone_cr_hint(line: str, before: str | None, fix: str) -> str:
    """What to add to the error of a line that does not parse when a lone carriage return ended it or the line
    before it: a "\r" not followed by "\n" inside a passage ends its line there, and then neither half parses."""
    if _lone_cr(line) or (before is not None and _lone_cr(before)):
        at = "this line" if _lone_cr(line) else "the line before"
        return (f" ({at} ends at a carriage return '\\r' not followed by '\\n': one inside a passage ends its "
                f"line there, as csv readers read it; {fix})")
    return ""


def _json_array(path: Path, lineno: int) -> CorpusError:
    """The error for a .json corpus written as one JSON array (pretty-printed or on one line)."""
    return CorpusError(f"{path}:{lineno}: a JSON array; a corpus is JSON Lines: one {{id, title, text}} object per "
                       "line")


def _iter_jsonl(path: Path) -> Iterator[tuple[str, str, str]]:
    seen = _UniqueIds(path, lambda lineno: _jsonl_id_at(path, lineno))
    # (one decoder for the file: json.loads with a hook makes a decoder a call, ~2 us of a line's ~15)
    decode = json.JSONDecoder(object_pairs_hook=unique_keys).decode
    previous = None
    for lineno, line in _lines(path):
        before, previous = previous, line
        if not line.strip():
            continue
        try:
            rec = decode(line)
        except RepeatedKey as e:
            raise CorpusError(f"{path}:{lineno}: {e}") from None
        except json.JSONDecodeError as e:
            if not seen.n and line.lstrip().startswith("["):
                raise _json_array(path, lineno) from e
            hint = _lone_cr_hint(line, before, "in a JSON string, write it as the escape \\r")
            if line.startswith("\ufeff"):  # (the file's first mark is dropped as it is read: files joined whole?)
                hint = " (the line starts with a byte-order mark U+FEFF, e.g. files joined with theirs: remove it)"
            raise CorpusError(f"{path}:{lineno}: malformed JSON ({e.msg}){hint}") from e
        if not seen.n and isinstance(rec, list) and rec and all(isinstance(x, dict) for x in rec):
            raise _json_array(path, lineno)
        if not isinstance(rec, dict):
            raise CorpusError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
        key = "id" if "id" in rec else "_id"  # (BEIR's corpus.jsonl names it _id)
        if key not in rec:
            raise CorpusError(f"{path}:{lineno}: missing field 'id' (or BEIR's '_id')")
        doc_id = rec[key]
        if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):
            raise CorpusError(f"{path}:{lineno}: field {key!r} must be a string or an integer, got "
                              f"{type(doc_id).__name__}")
        doc_id = str(doc_id)
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
        # (a lone surrogate can only come from a \u escape: text read as UTF-8 holds none, so a line without one is
        # not searched)
        for name, v in ((key, doc_id), ("title", title), ("text", text)) if "\\u" in line else ():
            if (bad := _SURROGATE.search(v)) is not None:  # (a "\ud800" escape: no UTF-8 for the index to store)
                raise CorpusError(f"{path}:{lineno}: field {name!r} holds a lone surrogate (U+{ord(bad.group()):04X}, "
                                  "e.g. a '\\ud800' escape): not Unicode text")
        seen.add(doc_id, lineno)
        yield doc_id, title, text
    seen.finish()


def _tsv_fields(line: str) -> list[str]:
    """The tab-separated fields of one tsv line (its ending stripped). A field in double quotes with "" escapes (how
    csv writers, and the official DPR file, write a passage holding quotes or tabs) is unquoted, as Python's csv
    reader reads it (`excel-tab`, strict) but at any length (the reader refuses a field over 128 KiB); a line whose
    quotes do not follow that rule (a field that only starts with a quoted phrase, a quote never closed) keeps its
    text as written, quotes included, so one stray quote can neither eat the lines after it nor drop characters.

    Most of DPR's lines quote their passage; a csv reader made for each line took ~5 us of its ~9 a line to read, so
    a line whose quoted fields hold no tab is unquoted from its split (`_split_quoted`), and only the rest parsed."""
    fields = line.split("\t")
    if '"' not in line:
        return fields
    unquoted = _split_quoted(fields)
    if unquoted is not None:
        return unquoted
    parsed = _parse_quoted(line)
    return fields if parsed is None else parsed


def _split_quoted(fields: list[str]) -> list[str] | None:
    """The fields of a line split at its tabs with each quoted one unquoted, where that is the csv reading: every
    field with a quote either starts with none (csv keeps its quotes as text) or is one quoted field: it starts and
    ends with a quote, and every run of quotes between is of even length (its "" escapes). None where some field is
    neither (a quoted field holding a tab was split; or the line is not csv quoting): `_parse_quoted` decides.

    Why a split piece that passes is the field csv reads: its quotes between the outer two pair up, so the reader
    takes each pair for one quote and the last quote, followed by the tab or the line's end, closes the field there.
    A piece that ends inside a quoted field (the tab was the field's text) ends with a quote run one short of even,
    or does not end with a quote: it never passes."""
    out = fields
    for i, f in enumerate(fields):
        if not f.startswith('"'):
            continue
        if len(f) < 2 or f[-1] != '"':
            return None
        inner = f[1:-1]
        if '"' in inner:
            if '"' in inner.replace('""', ""):
                return None
            inner = inner.replace('""', '"')
        if out is fields:
            out = list(fields)
        out[i] = inner
    return out


def _parse_quoted(line: str) -> list[str] | None:
    """The fields of a line as Python's csv reader reads it (`excel-tab`, strict: "" is a quote inside a quoted
    field, the closing quote must end the field), at any length; None where the reader would refuse the line (a
    quote inside a quoted field not doubled and not closing it, or a quote never closed)."""
    fields, i, n = [], 0, len(line)
    while True:
        if i < n and line[i] == '"':
            parts, j = [], i + 1
            while True:
                k = line.find('"', j)
                if k < 0:
                    return None  # (never closed)
                parts.append(line[j:k])
                if k + 1 < n and line[k + 1] == '"':  # (an escaped quote)
                    parts.append('"')
                    j = k + 2
                    continue
                if k + 1 < n and line[k + 1] != "\t":
                    return None  # (text after the closing quote)
                break
            fields.append("".join(parts))
            i = k + 1
        else:
            k = line.find("\t", i)
            k = n if k < 0 else k
            fields.append(line[i:k])
            i = k
        if i >= n:
            return fields
        i += 1  # (past the tab)
        if i == n:  # (a line that ends with a tab: an empty last field)
            fields.append("")
            return fields


def _iter_tsv_rows(path: Path) -> Iterator[tuple[str, str, str]]:
    # one passage per physical line (psgs_w100.tsv has no line breaks inside a passage)
    lines = _lines(path)
    first = next(lines, None)
    if first is None:
        raise CorpusError(f"{path}:1: empty tsv (expected a header line 'id\\ttext\\ttitle')")
    header = _tsv_fields(first[1].rstrip("\r\n"))
    cols = {name.strip(): i for i, name in enumerate(header)}
    if len(cols) != len(header):
        twice = sorted(n for n, k in collections.Counter(h.strip() for h in header).items() if k > 1)
        raise CorpusError(f"{path}:1: tsv header names a column more than once: {twice} (got {header})")
    for need in ("id", "text", "title"):
        if need not in cols:
            raise CorpusError(f"{path}:1: tsv header lacks column {need!r} (got {header})")
    i_id, i_text, i_title = cols["id"], cols["text"], cols["title"]
    width = len(header)
    seen = _UniqueIds(path, lambda lineno: _tsv_id_at(path, lineno, i_id))
    previous = first[1]
    for lineno, raw in lines:
        before, previous = previous, raw
        line = raw.rstrip("\r\n")
        if not line.strip():
            continue
        row = _tsv_fields(line)
        if len(row) != width:
            raise CorpusError(f"{path}:{lineno}: expected {width} tab-separated fields, got {len(row)}"
                              f"{_lone_cr_hint(raw, before, 'replace it with a space')}")
        seen.add(row[i_id], lineno)
        yield row[i_id], row[i_title], row[i_text]
    seen.finish()


def iter_corpus(path: str | os.PathLike) -> Iterator[tuple[str, str, str]]:
    """Yield `(id, title, text)` for each passage of a .jsonl or .tsv corpus file, in file order."""
    p = Path(path)
    if not p.is_file():
        raise CorpusError(f"corpus file not found: {p}")
    if not os.access(p, os.R_OK):
        raise CorpusError(f"corpus file not readable: {p}")
    return _iter_tsv_rows(p) if corpus_format(p) == "tsv" else _iter_jsonl(p)


def corpus_format(path: str | os.PathLike) -> str:
    """"tsv" or "jsonl", from the file's suffix (a compression suffix after it dropped); CorpusError for any other
    (checked before an index folder is made)."""
    p = Path(path)
    suffix = compressed.format_suffix(p)
    if suffix in (".tsv", ".tab"):
        return "tsv"
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    raise CorpusError(f"unsupported corpus format {suffix!r} for {p}: expected .jsonl or .tsv (either may be "
                      "compressed: .jsonl.gz, .tsv.bz2, .tsv.xz)")


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
