"""The passage analysis of the BM25 build (fastrag.retrieval.bm25_build.analyse_passages, with fastrag._C's token
scan, csrc/bm25_tokens.cpp, and without it) against bm25s's tokenizer with the project's settings (`analyse`, what
the queries get): the same stems in the same order for every passage, on fresh random text drawn from every Unicode
plane, with the characters whose handling differs between engines (final sigma, dotted capital I, combining marks
inside and next to Han and hiragana, digits of other scripts, '_') over-represented; bad input is refused by name."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch
from bm25s.tokenization import _infer_stopwords

from fastrag.retrieval import bm25_build

_C = pytest.importorskip("fastrag._C", reason="the C++ extension is not built (scripts/install.sh builds it)")

_TRICKY = ["Σ", "ΑΣ", "σς", "İ", "ı", "ß", "ǅ", "e\u0301", "\u0307", "_", "__", "x_1", "٣٤", "²", "Ⅻ", "ﬁ", "\u200d",
           "\u00a0", "\u3000", "\u3099", "\u309b", "\u309d", "ゞ", "東京", "ひら", "カタ", "한국", "\U00020000", "\U0001f600",
           "the", "and", "of", "running", "Connections", "THE", "o'neil", "co-op", "3.14", "a1b2"]


def _text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randrange(0, 40)):
        r = rng.random()
        if r < 0.35:
            parts.append(rng.choice("abcdeXYZ019 ,.-'\"\n\t\r"))
        elif r < 0.55:
            parts.append(rng.choice(_TRICKY))
        elif r < 0.65:
            parts.append(chr(rng.randrange(0x80, 0x250)))  # (Latin-1 and Latin Extended: one-byte and two-byte strs)
        elif r < 0.8:
            parts.append(chr(rng.randrange(0x3000, 0xA000)))  # (hiragana, katakana, Han and their neighbours)
        elif r < 0.9:
            parts.append(chr(rng.choice([rng.randrange(0x250, 0xD800), rng.randrange(0xE000, 0x10000)])))
        else:
            parts.append(chr(rng.randrange(0x10000, 0x110000)))  # (the astral planes: four-byte strs)
    return "".join(parts)


def _stems_per_passage(stems: list[str], flat: np.ndarray, lengths: np.ndarray) -> list[list[str]]:
    assert flat.dtype == np.int32 and lengths.dtype == np.int64 and int(lengths.sum()) == len(flat)
    assert len(set(stems)) == len(stems) and (len(flat) == 0 or 0 <= flat.min() <= flat.max() < len(stems))
    ends = np.cumsum(lengths)
    return [[stems[i] for i in flat[e - n:e]] for n, e in zip(lengths.tolist(), ends.tolist())]


@pytest.mark.parametrize("native", [True, False], ids=["scan", "regex"])
def test_passage_analysis_gives_bm25s_stems_on_random_text(native):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    # (the last two: a capital sigma before a mark that spacing cuts off, final only when lowered after spacing)
    texts = [_text(rng) for _ in range(4000)] + ["", "   ", "the of and", "a b c", "東", "Σ.", "ΑΣ\u3099Β", "xΣ\u309dy"]
    want = bm25_build.analyse(texts, show_progress=False, return_ids=False)
    got = _stems_per_passage(*bm25_build.analyse_passages(texts, native=native))
    assert sum(map(len, want)) > 10_000  # (the texts hold many terms: the comparison is not vacuous)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"seed {seed}, passage {i} {texts[i]!r}"
    assert len(got) == len(texts)


def test_the_scan_finds_the_regex_tokens_and_numbers_them_as_first_seen():
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    raw = [_text(rng) for _ in range(3000)]
    spaced = [bm25_build._CJK_CHAR.sub(r" \g<0> ", t).lower() for t in raw]  # (what the scan does before it scans)
    distinct, numbers, counts = _C.bm25_tokens(raw)
    assert numbers.dtype == torch.int32 and counts.dtype == torch.int64 and len(counts) == len(spaced)
    flat = [distinct[i] for i in numbers.tolist()]
    # the project's pattern as bm25s applies it, and the one without word boundaries that the regex path uses
    for pattern in (bm25_build.TOKEN_PATTERN, bm25_build._PASSAGE_TOKENS.pattern):
        find = re.compile(pattern).findall
        want = [find(t) for t in spaced]
        assert counts.tolist() == list(map(len, want)), f"seed {seed}, {pattern}"
        assert flat == [tok for w in want for tok in w], f"seed {seed}, {pattern}"
    assert distinct == list(dict.fromkeys(flat))  # (each token once, in the order first seen)


# one-character terms of several scripts and classes: Latin capitals, a hyphenated and a numbered name, a Latin-1
# letter, a letter that lowers to itself but upper-cases to two ("ß"), an Arabic-Indic digit, a superscript digit
# (numeric, so `\w`), '_' alone, a Greek capital, a one-letter word that is a stopword ("a"), and a Han character
_ONE_CHARACTER = "Type S, D-Day; Route 1 é ß ٣ ² _ Ω a x東y"


def test_one_character_terms_are_kept_by_both_paths():
    """Elasticsearch's standard tokenizer keeps one-character terms, and so does the build's analysis (a `\\w\\w+`
    token pattern drops them); the scan, the regex path and bm25s's tokenizer agree on them, and only the stopword
    "a" goes."""
    distinct, numbers, counts = _C.bm25_tokens([_ONE_CHARACTER])
    tokens = ["type", "s", "d", "day", "route", "1", "é", "ß", "٣", "²", "_", "ω", "a", "x", "東", "y"]
    assert [distinct[i] for i in numbers.tolist()] == tokens and counts.tolist() == [len(tokens)]
    assert bm25_build._PASSAGE_TOKENS.findall(_ONE_CHARACTER.lower().replace("東", " 東 ")) == tokens
    want = bm25_build.analyse([_ONE_CHARACTER], show_progress=False, return_ids=False)[0]
    assert want == ["type", "s", "d", "day", "rout", "1", "é", "ß", "٣", "²", "_", "ω", "x", "東", "y"]
    for native in (True, False):
        assert _stems_per_passage(*bm25_build.analyse_passages([_ONE_CHARACTER], native=native)) == [want], native


# Lucene's EnglishAnalyzer.ENGLISH_STOP_WORDS_SET, the stop filter of Elasticsearch's `english` analyzer (the one
# DRAGIN's and fastrag's Elasticsearch indexes use); of the one-character terms only "a" is in it
_LUCENE_ENGLISH_STOP = frozenset("a an and are as at be but by for if in into is it no not of on or such that the their "
                                 "then there these they this to was will with".split())


def test_the_stopwords_are_bm25s_english_ones():
    assert bm25_build._stopword_set() == frozenset(_infer_stopwords(bm25_build.STOPWORDS))  # (analyse's stopwords)
    assert bm25_build._stopword_set() == _LUCENE_ENGLISH_STOP  # (the docstring of fastrag.retrieval.bm25 says so)
    stems, flat, lengths = bm25_build.analyse_passages(["The running of the connections", "and or but"])
    assert [stems[i] for i in flat] == ["run", "connect"] and lengths.tolist() == [2, 0]


def test_the_scan_refuses_what_is_not_text_by_position():
    with pytest.raises(RuntimeError, match=r"texts\[1\] must be a str, got bytes"):
        _C.bm25_tokens(["fine text", b"bytes"])
    with pytest.raises(RuntimeError, match=r"texts\[0\] must be a str, got NoneType"):
        _C.bm25_tokens([None])
    distinct, numbers, counts = _C.bm25_tokens([])
    assert distinct == [] and numbers.numel() == 0 and counts.numel() == 0
