"""DRAGIN's "real word" filter: content words by spaCy coarse POS.

The published code (`check_real_words`, query formulation `real_words`) keeps a word when one of the spaCy
tokens of the text with POS in REAL_POS is a *substring* of it (`any(r in word for r in real_words)`), so a
model word like "Paris," matches the spaCy token "Paris".
"""

from __future__ import annotations

from typing import Iterable

from fastrag.text.nlp import get_nlp

REAL_POS = frozenset({"NOUN", "ADJ", "VERB", "PROPN", "NUM"})


def _real_of_doc(doc) -> set[str]:
    return {tok.text for tok in doc if tok.pos_ in REAL_POS}


def real_words(text: str) -> set[str]:
    """Texts of the spaCy tokens of `text` whose POS is in REAL_POS."""
    if not text.strip():
        return set()
    return _real_of_doc(get_nlp()(text))


def real_words_batch(texts: Iterable[str], batch_size: int = 64) -> list[set[str]]:
    """`[real_words(t) for t in texts]` through one `nlp.pipe` pass."""
    return [_real_of_doc(doc) for doc in get_nlp().pipe(list(texts), batch_size=batch_size)]


def matches_real_word(word: str, real: set[str]) -> bool:
    """True when some real word is a substring of `word` (the published DRAGIN rule)."""
    return any(r in word for r in real)
