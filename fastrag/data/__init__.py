"""Datasets (loaders for the upstream formats), few-shot exemplars and answer metrics."""

from fastrag.data.datasets import DATASETS, DataError, Example, canonical_dataset, load_examples
from fastrag.data.exemplars import case_text, demo_text, load_exemplars
from fastrag.data.metrics import (
    ANSWER_MAX_TOKENS,
    ANSWER_PROMPT_SUFFIX,
    aggregate,
    exact_match,
    extract_answer,
    f1_score,
    normalize_answer,
    score,
    strategyqa_accuracy,
)

__all__ = [
    "ANSWER_MAX_TOKENS",
    "ANSWER_PROMPT_SUFFIX",
    "DATASETS",
    "DataError",
    "Example",
    "aggregate",
    "canonical_dataset",
    "case_text",
    "demo_text",
    "exact_match",
    "extract_answer",
    "f1_score",
    "load_examples",
    "load_exemplars",
    "normalize_answer",
    "score",
    "strategyqa_accuracy",
]
