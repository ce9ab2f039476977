"""The per-vocabulary non-stopword table s[v] (DRAGIN's s_i), built once per tokenizer and applied in-kernel."""

from __future__ import annotations

import torch

# Word-start markers of byte-level BPE (GPT-2, Llama-3, SmolLM2) and SentencePiece (Llama-2).
WORD_START_MARKERS = ("Ġ", "▁")


def is_word_text(text: str) -> bool:
    """True for normalised piece text that is non-empty and not all punctuation/symbols (has a letter or digit)."""
    return any(ch.isalnum() for ch in text)


def default_stopwords() -> frozenset[str]:
    """spaCy's English stop-word list (lowercase)."""
    from spacy.lang.en.stop_words import STOP_WORDS

    return frozenset(w.lower() for w in STOP_WORDS)


def build_nonstop_table(tokenizer, stopwords: set[str] | frozenset[str] | None = None,
                        vocab_size: int | None = None) -> torch.Tensor:
    """s [vocab_size] bool: True where the piece's text (decoded, markers removed, stripped, lowercased) is a
    word (has a letter or digit) and not a stopword. Special tokens are False.

    `vocab_size` (default len(tokenizer)) pads with False for models whose logits are wider than the tokenizer
    (padded embedding matrices). Decoding the whole vocabulary in one batch call takes well under a second.
    """
    stop = default_stopwords() if stopwords is None else frozenset(stopwords)
    n = len(tokenizer)
    V = n if vocab_size is None else vocab_size
    if V < n:
        raise ValueError(f"vocab_size={V} is smaller than the tokenizer's vocabulary ({n})")
    texts = tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    special = set(tokenizer.all_special_ids)
    flags = []
    for i, text in enumerate(texts):
        for marker in WORD_START_MARKERS:
            text = text.replace(marker, "")
        text = text.strip().lower()
        flags.append(i not in special and is_word_text(text) and text not in stop)
    out = torch.zeros(V, dtype=torch.bool)
    out[:n] = torch.tensor(flags, dtype=torch.bool)
    return out
