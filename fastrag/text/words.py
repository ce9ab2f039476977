"""Token -> word merging (DRAGIN RIND step 1) and word -> sentence assignment.

A generated token starts a new word when (docs/dragin-reference.md, "RIND" step 1):
  - it is the first token, or
  - its token string starts with the word-start marker: "Ġ" (byte-level BPE: GPT-2, Llama-3, SmolLM2, Qwen)
    or "▁" (SentencePiece: Llama-2, Mistral), or
  - it decodes to text starting with "\\n" (the published code tests id 13, Llama-2's "<0x0A>"; decoding
    generalises that to every tokenizer, including merged tokens such as "ĊĊ"), or
  - the previous token is an EOS token.
The per-token test is a lookup in a boolean table `starts_word[V]` built once per tokenizer, so merging a
sequence of T tokens is one vectorised gather: O(T).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Iterable, Sequence

import numpy as np

from fastrag.text.sentences import Sentence

WORD_START_MARKERS = ("Ġ", "▁")


class WordBoundaries:
    """Word-start table of one tokenizer.

    starts_word: [V] bool, True where the token string starts with a marker or the token decodes to "\\n...".
    is_eos:      [V] bool, True for the EOS ids (a token after EOS starts a word).
    Ids >= V (padded model vocabularies) are treated as non-starting, non-EOS tokens.
    """

    def __init__(self, tokenizer, eos_ids: Iterable[int] | None = None, vocab_size: int | None = None):
        self.tokenizer = tokenizer
        n_tok = len(tokenizer)
        V = max(n_tok, vocab_size or 0)
        tokens = tokenizer.convert_ids_to_tokens(list(range(n_tok)))
        ids1 = [[i] for i in range(n_tok)]
        if hasattr(tokenizer, "batch_decode"):
            decoded = tokenizer.batch_decode(ids1)
        else:
            decoded = [tokenizer.decode(x) for x in ids1]
        self.starts_word = np.zeros(V, dtype=bool)
        self.starts_word[:n_tok] = [
            (t is not None and t.startswith(WORD_START_MARKERS)) or d.startswith("\n")
            for t, d in zip(tokens, decoded)
        ]
        if eos_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.is_eos = np.zeros(V, dtype=bool)
        for i in self.eos_ids:
            if 0 <= i < V:
                self.is_eos[i] = True

    def starts(self, ids: Sequence[int]) -> np.ndarray:
        """[T] bool: token i starts a word (i == 0, starts_word[id_i], or id_{i-1} is EOS)."""
        a = np.asarray(ids, dtype=np.int64)
        if a.size == 0:
            return np.zeros(0, dtype=bool)
        if a.min() < 0:
            raise ValueError(f"negative token id {int(a.min())}")
        inside = a < self.starts_word.shape[0]
        safe = np.where(inside, a, 0)
        s = self.starts_word[safe] & inside
        s[0] = True
        s[1:] |= self.is_eos[safe[:-1]] & inside[:-1]
        return s

    def spans(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """Word token spans [l, r), contiguous and covering all T tokens (empty list for T == 0)."""
        b = np.flatnonzero(self.starts(ids)).tolist()
        return list(zip(b, b[1:] + [len(ids)]))

    def texts(self, ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> list[str]:
        """Word texts: `convert_tokens_to_string(tokens[l:r]).strip()` for each span."""
        tokens = self.tokenizer.convert_ids_to_tokens(list(ids))
        return [self.tokenizer.convert_tokens_to_string(tokens[l:r]).strip() for l, r in spans]


_CACHE: dict[int, tuple[object, WordBoundaries]] = {}


def word_boundaries(tokenizer) -> WordBoundaries:
    """Cached `WordBoundaries(tokenizer)` (keyed on id(tokenizer); the tokenizer is held so the id stays valid)."""
    hit = _CACHE.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        hit = (tokenizer, WordBoundaries(tokenizer))
        _CACHE[id(tokenizer)] = hit
    return hit[1]


def assign_words_to_sentences(text: str, words: Sequence[str], sentences: Sequence[Sentence]) -> list[int]:
    """Sentence index of each word: the last sentence whose start <= the word's start character.

    Word starts come from a left-to-right search: `idx = text.find(w, pos)`; found -> start = idx and
    pos = idx + len(w); not found (or w == "") -> start = pos. A word before the first sentence gets 0;
    with no sentences every word gets -1. The result is non-decreasing.
    """
    if not sentences:
        return [-1] * len(words)
    starts = [s.start for s in sentences]
    out: list[int] = []
    pos = 0
    for w in words:
        idx = text.find(w, pos) if w else -1
        if idx >= 0:
            start, pos = idx, idx + len(w)
        else:
            start = pos
        out.append(max(bisect_right(starts, start) - 1, 0))
    return out


def sentence_word_ranges(assign: Sequence[int], n_sentences: int) -> list[tuple[int, int]]:
    """[l, r) word range of each sentence from a non-decreasing assignment; (l, l) for a sentence without words."""
    if any(b < a for a, b in zip(assign, assign[1:])):
        raise ValueError("word-to-sentence assignment must be non-decreasing")
    if assign and (assign[0] < 0 or assign[-1] >= n_sentences):
        raise ValueError(f"sentence indices must lie in [0, {n_sentences}), got {assign[0]}..{assign[-1]}")
    out: list[tuple[int, int]] = []
    i = 0
    for s in range(n_sentences):
        l = i
        while i < len(assign) and assign[i] == s:
            i += 1
        out.append((l, i))
    return out


def word_spans(tokenizer, ids: Sequence[int]) -> list[tuple[int, int]]:
    """Convenience: `word_boundaries(tokenizer).spans(ids)` (the cached table of that tokenizer)."""
    return word_boundaries(tokenizer).spans(ids)
