"""Text utilities shared by the engine and the per-question oracle: sentences, token->word merge, real words."""

from fastrag.text.nlp import get_nlp
from fastrag.text.realwords import REAL_POS, matches_real_word, real_words, real_words_batch
from fastrag.text.sentences import Sentence, first_sentence, split_sentences, split_sentences_batch
from fastrag.text.words import (
    WordBoundaries,
    assign_words_to_sentences,
    sentence_word_ranges,
    word_boundaries,
    word_spans,
)

__all__ = [
    "REAL_POS",
    "Sentence",
    "WordBoundaries",
    "assign_words_to_sentences",
    "first_sentence",
    "get_nlp",
    "matches_real_word",
    "real_words",
    "real_words_batch",
    "sentence_word_ranges",
    "split_sentences",
    "split_sentences_batch",
    "word_boundaries",
    "word_spans",
]
