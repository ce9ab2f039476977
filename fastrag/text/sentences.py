"""Sentence splitting with character spans (spaCy `doc.sents`, stripped, empty sentences dropped)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from fastrag.text.nlp import SENTENCES_DISABLE, get_nlp


@dataclass(frozen=True, slots=True)
class Sentence:
    text: str  # the stripped sentence text; always == original[start:end]
    start: int  # character offset of the first non-space character in the original text
    end: int  # character offset one past the last non-space character


def _sentences_of_doc(doc) -> list[Sentence]:
    out: list[Sentence] = []
    for span in doc.sents:
        raw = span.text
        stripped = raw.strip()
        if not stripped:
            continue
        # spaCy spans carry trailing whitespace (and may start with it after "\n\n"); point at the stripped text.
        start = span.start_char + (len(raw) - len(raw.lstrip()))
        out.append(Sentence(stripped, start, start + len(stripped)))
    return out


def split_sentences(text: str) -> list[Sentence]:
    """Sentences of `text` in order: `[s.text for s in ...] == [x.text.strip() for x in nlp(text).sents if ...]`."""
    if not text.strip():
        return []
    return _sentences_of_doc(get_nlp()(text, disable=SENTENCES_DISABLE))


def split_sentences_batch(texts: Iterable[str], batch_size: int = 64) -> list[list[Sentence]]:
    """`[split_sentences(t) for t in texts]`, run through `nlp.pipe` (one batched pass)."""
    return [_sentences_of_doc(doc)
            for doc in get_nlp().pipe(list(texts), batch_size=batch_size, disable=SENTENCES_DISABLE)]


def first_sentence(text: str) -> str:
    """The first non-empty sentence of `text`, stripped; "" when there is none."""
    sents = split_sentences(text)
    return sents[0].text if sents else ""
