"""Compressed input files: gzip, bzip2 and xz read as they are (DPR ships `psgs_w100.tsv.gz` and its question files
as `.json.gz`; Hugging Face and BEIR exports often come as `.jsonl.gz`).

The compression is told by the file's first bytes, not its name, so a `.gz` name on a plain file and a `.tsv` name on
a gzip file both read right. Formats the standard library cannot read (zstd, zip, 7z) are refused with the command
that unpacks them. A corrupt or truncated stream raises the caller's error naming the file: a passage corpus cut
short must fail its index build, not index the passages before the cut.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import zlib
from pathlib import Path
from typing import BinaryIO

# suffixes a compressed file may carry after its format's own (`corpus.tsv.gz`): dropped to find the format
SUFFIXES = (".gz", ".gzip", ".bz2", ".xz")

_OPEN = {"gzip": gzip.open, "bzip2": bz2.open, "xz": lzma.open}
_DECOMPRESS = {"gzip": gzip.decompress, "bzip2": bz2.decompress, "xz": lzma.decompress}
# what a damaged stream raises while it is read: truncation (EOFError), a bad header or CRC (gzip.BadGzipFile and
# bzip2's "Invalid data stream", both OSError), corrupt deflate data (zlib.error), corrupt xz data (LZMAError)
STREAM_ERRORS = (EOFError, OSError, zlib.error, lzma.LZMAError)
_REFUSED = ((b"\x28\xb5\x2f\xfd", "zstd", "zstd -d FILE"), (b"PK\x03\x04", "zip", "unzip FILE"),
            (b"7z\xbc\xaf\x27\x1c", "7z", "7z x FILE"))
_BZIP2_BLOCK = (b"\x31\x41\x59\x26\x53\x59", b"\x17\x72\x45\x38\x50\x90")  # a block's magic, or an empty stream's end


def sniff(head: bytes) -> str | None:
    """"gzip", "bzip2" or "xz" when `head` (a file's first 10 bytes or more) opens such a stream, else None."""
    if head[:2] == b"\x1f\x8b":
        return "gzip"
    if head[:6] == b"\xfd7zXZ\x00":
        return "xz"
    if head[:3] == b"BZh" and head[3:4].isdigit() and head[4:10] in _BZIP2_BLOCK:  # (not plain text that says "BZh")
        return "bzip2"
    return None


def compression(path: Path, error: type[Exception]) -> str | None:
    """The compression of the file at `path` from its first bytes (None: not compressed); `error` for a compressed
    format that cannot be read here."""
    with open(path, "rb") as f:
        head = f.read(10)
    _refuse(path, head, error)
    return sniff(head)


def _refuse(path: Path, head: bytes, error: type[Exception]) -> None:
    """`error` when `head`, the file's first bytes, opens a compression that is not read here."""
    for magic, name, command in _REFUSED:
        if head.startswith(magic):
            raise error(f"{path}: is {name}-compressed, which is not read here (gzip, bzip2 and xz are); "
                        f"unpack it first ({command.replace('FILE', path.name)})")


def open_binary(path: Path, kind: str | None) -> BinaryIO:
    """The file's bytes, decompressed when `kind` (from `compression`) names a compression."""
    return open(path, "rb") if kind is None else _OPEN[kind](path, "rb")


def open_text(path: Path, kind: str | None, **kw) -> io.TextIOBase:
    """The file as text (`open`'s keyword arguments: encoding, newline), decompressed when `kind` names a
    compression."""
    if kind is None:
        return open(path, "r", **kw)
    return io.TextIOWrapper(_OPEN[kind](path, "rb"), **kw)


def check_stream(path: Path, kind: str, error: type[Exception]) -> None:
    """Read the compressed file at `path` to its end; `error` naming the file when the stream is damaged or cut
    short."""
    try:
        with _OPEN[kind](path, "rb") as f:
            while f.read(1 << 20):
                pass
    except STREAM_ERRORS as e:
        raise error(damaged(path, kind, e)) from None


def decompress(path: Path, raw: bytes, error: type[Exception]) -> bytes:
    """`raw`, the whole file at `path`, decompressed when it is a compressed stream; `error` naming the file when it
    is damaged or in a compression that is not read here."""
    _refuse(path, raw[:10], error)
    kind = sniff(raw[:10])
    if kind is None:
        return raw
    try:
        return _DECOMPRESS[kind](raw)
    except (*STREAM_ERRORS, ValueError) as e:  # (bz2.decompress: ValueError for a stream cut short)
        raise error(damaged(path, kind, e)) from None


def damaged(path: Path, kind: str, e: BaseException, where: str = "") -> str:
    """The message for a `kind` stream that raised `e` while read (`where`: ' after line N', or '')."""
    account = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__  # (OSError's str is empty for some)
    return f"{path}: the {kind} stream is damaged or cut short{where} ({account}); fetch or compress the file again"


def format_suffix(path: Path) -> str:
    """The lower-case suffix that names the file's format, a compression suffix after it dropped: '.tsv' for
    'psgs_w100.tsv.gz'."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in SUFFIXES:
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""
