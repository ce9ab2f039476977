"""Compressed corpora and data files (fastrag.compressed): gzip, bzip2 and xz read as the plain file reads; a damaged
or cut stream, and a compression that is not read, are errors that name the file."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import random
import string
from pathlib import Path

import pytest

from fastrag import compressed
from fastrag.data.datasets import DataError, load_examples
from fastrag.retrieval import BM25Retriever, CorpusError, iter_corpus

COMPRESS = {"gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress}


_VOCAB = ["".join(random.Random(i).choices(string.ascii_lowercase + "éß", k=3 + i % 7)) for i in range(300)]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(_VOCAB, k=n))


def _corpus(rng: random.Random, n: int, fmt: str) -> bytes:
    rows = [(f"p{i}", _words(rng, 2).title(), _words(rng, rng.randint(5, 40))) for i in range(n)]
    if fmt == "tsv":
        return ("id\ttext\ttitle\n" + "".join(f"{i}\t{x}\t{t}\n" for i, t, x in rows)).encode()
    return "".join(json.dumps({"id": i, "title": t, "text": x}, ensure_ascii=False) + "\n"
                   for i, t, x in rows).encode()


@pytest.mark.parametrize("fmt", ["jsonl", "tsv"])
@pytest.mark.parametrize("kind", sorted(COMPRESS))
def test_a_compressed_corpus_reads_as_the_plain_file(tmp_path, fmt, kind):
    raw = _corpus(random.Random(f"{fmt}{kind}"), 3000, fmt)
    plain = tmp_path / f"c.{fmt}"
    plain.write_bytes(raw)
    packed = tmp_path / f"c.{fmt}.{kind}"
    packed.write_bytes(COMPRESS[kind](raw))
    misnamed = tmp_path / f"m.{fmt}"  # a compressed file under a plain name: its first bytes tell
    misnamed.write_bytes(COMPRESS[kind](raw))
    want = list(iter_corpus(plain))
    assert len(want) == 3000
    assert list(iter_corpus(packed)) == want
    assert list(iter_corpus(misnamed)) == want


def test_bm25_over_a_gzip_corpus_ranks_as_over_the_plain_one(tmp_path):
    rng = random.Random(7)
    raw = _corpus(rng, 400, "tsv")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = tmp_path / "a" / "psgs.tsv"
    plain.write_bytes(raw)
    packed = tmp_path / "b" / "psgs.tsv.gz"
    packed.write_bytes(gzip.compress(raw))
    r_plain = BM25Retriever(plain, show_progress=False)
    r_packed = BM25Retriever(packed, show_progress=False)
    assert r_packed.built and r_packed.n_docs == r_plain.n_docs == 400
    docs = [x for _, _, x in iter_corpus(plain)]
    queries = [" ".join(rng.sample(docs[rng.randrange(400)].split(), 3)) for _ in range(20)]
    got = r_packed.search(queries, 5)
    want = r_plain.search(queries, 5)
    assert sum(map(len, want)) > 60  # (a small vocabulary: most queries match more than one passage)
    assert got == want  # (ids, titles, texts and scores: the same index either way)
    assert not BM25Retriever(packed, show_progress=False).built  # the saved index is reused


def test_a_gzip_corpus_cut_short_fails_its_index_build(tmp_path):
    raw = _corpus(random.Random(3), 4000, "jsonl")
    blob = gzip.compress(raw)
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CorpusError, match=r"cut\.jsonl\.gz: the gzip stream is damaged or cut short after line "
                                          r"(\d+).*EOFError") as e:
        list(iter_corpus(cut))
    assert 0 < int(e.value.args[0].split("after line ")[1].split()[0]) < 4000
    with pytest.raises(CorpusError, match="cut short"):
        BM25Retriever(cut, show_progress=False)
    assert not (tmp_path / "cut.jsonl.gz.bm25s" / "manifest.json").exists()  # no index of the passages before the cut


@pytest.mark.parametrize("where", ["middle", "crc"])
def test_a_damaged_gzip_corpus_is_called_damaged_not_mis_encoded(tmp_path, where):
    blob = bytearray(gzip.compress(_corpus(random.Random(5), 4000, "jsonl")))
    blob[len(blob) // 2 if where == "middle" else -6] ^= 0xFF  # (deflate data, or the trailer's CRC-32)
    p = tmp_path / "bad.jsonl.gz"
    p.write_bytes(bytes(blob))
    with pytest.raises(CorpusError, match=r"bad\.jsonl\.gz: the gzip stream is damaged or cut short") as e:
        list(iter_corpus(p))
    assert "UTF-8" not in str(e.value)


def test_a_compressed_corpus_with_a_bad_line_names_its_line(tmp_path):
    raw = _corpus(random.Random(9), 50, "jsonl").split(b"\n")
    raw[30] = b'{"id": "x", "title": '
    p = tmp_path / "c.jsonl.xz"
    p.write_bytes(lzma.compress(b"\n".join(raw)))
    with pytest.raises(CorpusError, match=r"c\.jsonl\.xz:31: malformed JSON"):
        list(iter_corpus(p))
    raw[30] = b'{"id": "x", "title": "caf\xe9", "text": "t"}'  # latin-1, not UTF-8
    p.write_bytes(lzma.compress(b"\n".join(raw)))
    with pytest.raises(CorpusError, match=r"c\.jsonl\.xz:31: not valid UTF-8.*byte 0xe9"):
        list(iter_corpus(p))


def test_compressions_that_are_not_read_are_refused_by_name(tmp_path):
    z = tmp_path / "c.jsonl"
    z.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(30))
    with pytest.raises(CorpusError, match=r"c\.jsonl: is zstd-compressed.*unpack it first \(zstd -d c\.jsonl\)"):
        list(iter_corpus(z))
    zip_ = tmp_path / "q.json"
    zip_.write_bytes(b"PK\x03\x04" + bytes(30))
    with pytest.raises(DataError, match=r"q\.json: is zip-compressed.*unzip q\.json"):
        load_examples("nq", zip_)
    zst = tmp_path / "c.jsonl.zst"
    zst.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(30))
    with pytest.raises(CorpusError, match=r"unsupported corpus format '\.zst'"):
        iter_corpus(zst)


def test_the_format_is_the_suffix_before_a_compression_suffix():
    assert compressed.format_suffix(Path("psgs_w100.tsv.gz")) == ".tsv"
    assert compressed.format_suffix(Path("wiki.v2.JSONL.XZ")) == ".jsonl"
    assert compressed.format_suffix(Path("corpus.jsonl")) == ".jsonl"
    assert compressed.format_suffix(Path("corpus.gz")) == ""
    assert compressed.sniff(b"BZh9 is text") is None  # the three letters alone are not a bzip2 stream
    assert compressed.sniff(bz2.compress(b"")) == "bzip2" and compressed.sniff(bz2.compress(b"x" * 99)) == "bzip2"
    assert compressed.sniff(b'{"id": 1}') is None


@pytest.mark.parametrize("kind", sorted(COMPRESS))
def test_a_compressed_data_file_loads_as_the_plain_one(tmp_path, kind):
    rng = random.Random(kind)
    rows = [{"id": f"q{i}", "question": _words(rng, 6) + "?", "answer": [_words(rng, 2)]} for i in range(40)]
    raw = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    plain = tmp_path / "d.jsonl"
    plain.write_bytes(raw)
    packed = tmp_path / f"d.jsonl.{kind}"
    packed.write_bytes(COMPRESS[kind](raw))
    assert load_examples("nq", packed) == load_examples("nq", plain)
    bad = raw.split(b"\n")
    bad[12] = b'{"id": "q12", "question": '
    packed.write_bytes(COMPRESS[kind](b"\n".join(bad)))
    with pytest.raises(DataError, match=rf"d\.jsonl\.{kind}:13"):
        load_examples("nq", packed)
    blob = COMPRESS[kind](raw)
    packed.write_bytes(blob[: len(blob) - 9])
    with pytest.raises(DataError, match=rf"d\.jsonl\.{kind}: the \w+ stream is damaged or cut short"):
        load_examples("nq", packed)
