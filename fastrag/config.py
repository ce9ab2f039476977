"""DRAGIN run configuration: one validated dataclass, the paper's defaults, and the published config files.

`DRAGIN_DEFAULTS` are the paper's Table 9 values for Llama2-13b-chat (generate length L, threshold theta,
top n tokens) with the exemplar counts of its Table 8 / appendix F. NQ and WebQuestions are not in the paper;
they take HotpotQA's values. StrategyQA uses 6 exemplars, not Table 8's 8: the paper's Prompt 5 prints 6, the
published code holds 6 and the published StrategyQA configs set `fewshot: 6` (8 would fail there).
Note the published config files do not all match Table 9 (e.g. config/Llama2-13b-chat/HotpotQA/DRAGIN.json has
hallucination_threshold 1.4 where the table says 1.2; 2Wiki's has 0.9 vs 0.6): `load_dragin_config` takes the
file's values; `dragin_config` takes the table's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fastrag.data.datasets import DataError, canonical_dataset

MODES = ("reference", "streaming")
QUERY_FORMULATIONS = ("real_words",)
# `method` values of the published code that select DRAGIN (AttnWeightRAG): configs say "attn_entropy",
# later main.py revisions also accept "dragin" and "attn_prob".
DRAGIN_METHODS = ("attn_entropy", "dragin", "attn_prob")


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field (and the file when loaded from one)."""


def _defaults(length: int, theta: float, top_n: int, fewshot: int) -> dict[str, Any]:
    return {"generate_max_length": length, "hallucination_threshold": theta, "retrieve_keep_top_k": top_n,
            "fewshot": fewshot}


_HOTPOT = _defaults(100, 1.2, 35, 8)
DRAGIN_DEFAULTS: dict[str, dict[str, Any]] = {
    "2wikimultihopqa": _defaults(64, 0.6, 25, 6),
    "hotpotqa": dict(_HOTPOT),
    "iirc": _defaults(128, 1.25, 25, 8),
    "strategyqa": _defaults(100, 1.0, 25, 6),
    "nq": dict(_HOTPOT),
    "webq": dict(_HOTPOT),
}


@dataclass(slots=True)
class DraginConfig:
    dataset: str  # one of DATASETS (aliases such as "2wikimultihop", "StrategyQA" are canonicalised)
    generate_max_length: int  # L: tokens generated per round, and the answer-length stop rule
    hallucination_threshold: float  # theta: a word hits when (a_i / sum a) * H_i * len(sentence) > theta
    retrieve_keep_top_k: int  # top n words kept in the QFS query
    fewshot: int  # exemplars in the prompt (>= 0)
    retrieve_topk: int = 3  # documents per retrieval
    query_formulation: str = "real_words"  # only the paper's QFS is implemented
    check_real_words: bool = True  # clear hits on words that are not spaCy real words (NOUN/ADJ/VERB/PROPN/NUM)
    max_query_tokens: int = 64  # the query is left-truncated to its last N tokens
    mode: str = "reference"  # "reference" (decision-compatible with the published code) | "streaming"
    stop_case_insensitive: bool = False  # published stop rule matches lowercase "the answer is" only
    qfs_skip_first: bool = True  # published QFS renormalisation skips column 0 (assumed BOS)
    extra: dict = field(default_factory=dict)  # published keys we do not use (paths, model, retriever, ...)

    def __post_init__(self) -> None:
        try:
            self.dataset = canonical_dataset(self.dataset)
        except DataError as e:
            raise ConfigError(f"dataset: {e}") from None
        _int(self, "generate_max_length", 1)
        _int(self, "retrieve_keep_top_k", 1)
        _int(self, "retrieve_topk", 1)
        _int(self, "fewshot", 0)
        _int(self, "max_query_tokens", 1)
        t = self.hallucination_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise ConfigError(f"hallucination_threshold must be a finite number, got {t!r}")
        self.hallucination_threshold = float(t)
        for name in ("check_real_words", "stop_case_insensitive", "qfs_skip_first"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.query_formulation not in QUERY_FORMULATIONS:
            raise ConfigError(
                f"query_formulation must be one of {', '.join(QUERY_FORMULATIONS)}, got {self.query_formulation!r}"
            )
        if not isinstance(self.extra, dict):
            raise ConfigError(f"extra must be a dict, got {type(self.extra).__name__}")


def _int(cfg: DraginConfig, name: str, minimum: int) -> None:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {v!r}")


_FIELDS = tuple(f.name for f in fields(DraginConfig) if f.name != "extra")


def dragin_config(dataset: str, overrides: dict[str, Any] | None = None) -> DraginConfig:
    """The paper's defaults for `dataset` (DRAGIN_DEFAULTS), with `overrides` (field name -> value) applied."""
    try:
        name = canonical_dataset(dataset)
    except DataError as e:
        raise ConfigError(f"dataset: {e}") from None
    values: dict[str, Any] = {"dataset": name, **DRAGIN_DEFAULTS[name]}
    for k, v in (overrides or {}).items():
        if k not in _FIELDS and k != "extra":
            raise ConfigError(f"unknown config field {k!r}: valid fields are {', '.join(_FIELDS)}")
        values[k] = v
    return DraginConfig(**values)


def load_dragin_config(path: str | Path, dataset: str | None = None) -> DraginConfig:
    """Read a published DRAGIN config JSON (e.g. config/Llama2-13b-chat/HotpotQA/DRAGIN.json).

    Known keys map onto DraginConfig fields (fastrag's own field names are accepted too); keys the file lacks
    come from DRAGIN_DEFAULTS; every other key (model_name_or_path, data_path, retriever, es_index_name, ...)
    goes to `extra`. `dataset` overrides the file's "dataset". `method`, when present, must select DRAGIN.
    """
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    method = raw.get("method")
    if method is not None and method not in DRAGIN_METHODS:
        raise ConfigError(
            f"{path}: field 'method' is {method!r}, which is not DRAGIN (expected one of {', '.join(DRAGIN_METHODS)})"
        )
    ds = dataset if dataset is not None else raw.get("dataset")
    if ds is None:
        raise ConfigError(f"{path}: field 'dataset' is missing (or pass dataset=...)")
    try:
        name = canonical_dataset(ds)
    except DataError as e:
        raise ConfigError(f"{path}: field 'dataset': {e}") from None
    values: dict[str, Any] = {"dataset": name, **DRAGIN_DEFAULTS[name]}
    extra: dict[str, Any] = {}
    for k, v in raw.items():
        if k == "dataset":
            extra["source_dataset"] = v
        elif k in _FIELDS:
            values[k] = v
        else:
            extra[k] = v
    try:
        return DraginConfig(**values, extra=extra)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
