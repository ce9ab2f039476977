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
import re
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fastrag.data.datasets import DataError, canonical_dataset
from fastrag.data.exemplars import load_exemplars, published_exemplar_count
from fastrag.inline_config import InlineConfig
from fastrag.jsonkeys import RepeatedKey, unique_keys

MODES = ("reference", "streaming")
# "reference": the paper's rules as docs/dragin-reference.md reads them; "published": what the published code's
# src/generate.py computes, its departures from that reading included (fastrag.methods.published, docs/published.md)
FIDELITIES = ("reference", "published")
QUERY_FORMULATIONS = ("real_words",)
STREAM_ATTENTION = ("in-context", "pass")  # dragin-streaming: where a_i comes from
# `method` values of the published code that select DRAGIN (AttnWeightRAG) with entropy-weighted words: configs say
# "attn_entropy", later main.py revisions also accept "dragin". ("attn_prob", which weights words by -log p instead,
# is not implemented: refused by name.)
DRAGIN_METHODS = ("attn_entropy", "dragin")


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
    "qa": dict(_HOTPOT),
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
    fidelity: str = "reference"  # "reference" | "published" (FIDELITIES)
    extra: dict = field(default_factory=dict)  # published keys we do not use (paths, model, retriever, ...)

    def __post_init__(self) -> None:
        try:
            self.dataset = canonical_dataset(self.dataset)
        except DataError as e:
            raise ConfigError(f"dataset: {e}") from None
        check_int(self, "generate_max_length", 1)
        check_int(self, "retrieve_keep_top_k", 1)
        check_int(self, "retrieve_topk", 1)
        _fewshot(self)
        check_int(self, "max_query_tokens", 1)
        check_number(self, "hallucination_threshold", 0.0)
        check_bools(self, "check_real_words", "stop_case_insensitive", "qfs_skip_first")
        _choice(self, "mode", MODES)
        _choice(self, "fidelity", FIDELITIES)
        if self.fidelity == "published" and self.mode != "reference":
            raise ConfigError("fidelity 'published' runs the published loop (mode 'reference'), got mode "
                              f"{self.mode!r}")
        _choice(self, "query_formulation", QUERY_FORMULATIONS)
        if not isinstance(self.extra, dict):
            raise ConfigError(f"extra must be a dict, got {type(self.extra).__name__}")


def check_int(cfg, name: str, minimum: int) -> None:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {v!r}")


def is_finite_number(v) -> bool:
    """A finite JSON number: an int or a float, not true/false."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def check_number(cfg, name: str, minimum: float) -> None:
    """A finite number >= minimum, stored as a float."""
    v = getattr(cfg, name)
    if not (is_finite_number(v) and v >= minimum):
        raise ConfigError(f"{name} must be a finite number >= {minimum:g}, got {v!r}")
    setattr(cfg, name, float(v))


def check_unit(cfg, name: str) -> None:
    """A number in [0, 1], stored as a float."""
    v = getattr(cfg, name)
    if not (is_finite_number(v) and 0.0 <= v <= 1.0):
        raise ConfigError(f"{name} must be a number in [0, 1], got {v!r}")
    setattr(cfg, name, float(v))


def check_bools(cfg, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(f"{name} must be true or false, got {getattr(cfg, name)!r}")


def _choice(cfg, name: str, choices: tuple[str, ...]) -> None:
    v = getattr(cfg, name)
    if v not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {v!r}")


def _fewshot(cfg) -> None:
    """fewshot: an int >= 0 and at most the exemplars `cfg.dataset` has (checked with the config, before a run
    starts, so that the error names the config file)."""
    check_int(cfg, "fewshot", 0)
    if getattr(cfg, "fidelity", "reference") == "published":
        n, whose = published_exemplar_count(cfg.dataset), "the published code's"
    else:
        n, whose = len(load_exemplars(cfg.dataset)), "fastrag's"
    if cfg.fewshot > n:
        raise ConfigError(f"fewshot is {cfg.fewshot} but {cfg.dataset} has only {n} exemplars ({whose})")


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


def read_json_object(path: str | Path, error: type[Exception] = ConfigError) -> dict[str, Any]:
    """A config file's top-level JSON object; `error` (naming the file, and line/column for bad JSON, the lines of
    a key given twice) otherwise. An InlineConfig is its own object (a copy)."""
    if isinstance(path, InlineConfig):
        return dict(path)
    if not str(path):  # (Path("") is the current folder)
        raise error("the config file's path is empty")
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
        raw = json.loads(text, object_pairs_hook=unique_keys)
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RepeatedKey as e:
        lines = [text.count("\n", 0, m.start()) + 1
                 for m in re.finditer(re.escape(json.dumps(e.key, ensure_ascii=False)) + r"\s*:", text)]
        at = f" (lines {', '.join(map(str, lines))})" if len(lines) > 1 else ""
        raise error(f"{path}: field {e.key!r} is given twice{at}; give it once") from None
    if not isinstance(raw, dict):
        raise error(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def load_dragin_config(path: str | Path, dataset: str | None = None, more_keys: frozenset = frozenset(),
                       raw: dict[str, Any] | None = None) -> DraginConfig:
    """Read a published DRAGIN config JSON (e.g. config/Llama2-13b-chat/HotpotQA/DRAGIN.json).

    Known keys map onto DraginConfig fields (fastrag's own field names are accepted too); keys the file lacks
    come from DRAGIN_DEFAULTS; the published files' bookkeeping keys (model_name_or_path, data_path, retriever,
    es_index_name, ...: PUBLISHED_EXTRA_KEYS) and `more_keys` (a variant's own fields) go to `extra`; any other key
    is an error naming it. `dataset` overrides the file's "dataset". `method`, when present, must select DRAGIN.
    `raw`: the file's object when the caller has read it already (`read_json_object(path)`); errors still name path.
    """
    if raw is None:
        raw = read_json_object(path)
    path = Path(path)
    method = raw.get("method")
    if method == "attn_prob":
        raise ConfigError(f"{path}: field 'method' is 'attn_prob' (words weighted by -log p), which fastrag does not "
                          "implement; DRAGIN here weights words by entropy ('attn_entropy' / 'dragin')")
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
        elif k == "attention_solver":  # how the published code reduces the RIND pass's attention over query rows
            if v != "max":
                raise ConfigError(f"{path}: attention_solver {v!r}: only 'max' (the published configs' value: the "
                                  "largest attention over later rows, then the mean over heads) is implemented")
            extra[k] = v
        elif k in PUBLISHED_EXTRA_KEYS or k in more_keys or k == "try_use_max_weight":
            # (try_use_max_weight only matters to the published "regenerate" query formulation, not real_words)
            extra[k] = v
        else:  # (a misspelt field would otherwise leave its default in force without a word)
            raise ConfigError(f"{path}: unknown config field {k!r}: valid fields are {', '.join(_FIELDS)} (and the "
                              f"published files' bookkeeping keys {', '.join(sorted(PUBLISHED_EXTRA_KEYS))})")
    try:
        cfg = DraginConfig(**values, extra=extra)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    warn_not_applied(path, extra, cfg.dataset)
    return cfg


# ====================================================================================== baselines and FLARE
#
# One validated dataclass per method family. Defaults per dataset come from the published DRAGIN configs
# (config/Llama2-13b-chat/<dataset>/{wo-RAG,SR-RAG,FL-RAG,FS-RAG,FLARE}.json: generate length and exemplars as
# DRAGIN's Table 9 / 8, `fix_length` n = 16 for 2Wiki and 32 elsewhere, the TokenRAG "FLARE" thresholds 0.08 /
# 0.1 / 0.06 / 0.1) and from the FLARE paper (theta 0.8 for 2Wiki, 0.4 for StrategyQA, beta 0.4; the paper gives
# no HotpotQA / IIRC values, they take 2Wiki's multihop 0.8). See docs/methods.md.

# `method` values of published DRAGIN configs accepted by each of our methods
PUBLISHED_METHODS = {
    "wo-rag": ("non-retrieval",),
    "sr-rag": ("single-retrieval",),
    "fl-rag": ("fix-length-retrieval",),
    "fs-rag": ("fix-sentence-retrieval",),
    "token-rag": ("token",),
}
# keys of published config files that carry no rule (paths, bookkeeping): kept in `extra`
PUBLISHED_EXTRA_KEYS = frozenset({
    "model_name_or_path", "method", "data_path", "output_dir", "retriever", "es_index_name", "sample", "shuffle",
    "config_path", "use_counter", "query_formulation", "sgpt_model_name_or_path", "sgpt_encode_file_path",
    "passage_file", "note", "batch_size",
})
# published keys that choose something a run does (which questions, which retriever, model or index): fastrag
# takes those choices from its command line, so a file that sets one gets a warning naming where it goes instead
NOT_APPLIED = {
    "sample": "the first N questions: --limit N",
    "shuffle": "question order: the data file's order is kept (shuffle the file beforehand)",
    "retriever": "--retriever",
    "es_index_name": "$FASTRAG_ES_INDEX",
    "model_name_or_path": "--model",
    "data_path": "--data",
}


def warn_not_applied(path: Path, extra: dict, dataset: str) -> None:
    """One warning listing the keys of a config file that select what a run does but are taken from the command
    line instead (NOT_APPLIED), and a file's "dataset" other than the run's (its values are applied to the run's
    dataset)."""
    notes = [f"{k}={extra[k]!r} ({NOT_APPLIED[k]})" for k in NOT_APPLIED if k in extra]
    src = extra.get("source_dataset")
    if isinstance(src, str):
        try:
            if canonical_dataset(src) != dataset:
                notes.append(f"dataset={src!r} (the run's --dataset {dataset} is used: its exemplars, with this "
                             "file's values)")
        except DataError:
            notes.append(f"dataset={src!r} (not a dataset name; the run's --dataset {dataset} is used)")
    if notes:
        warnings.warn(f"{path}: not applied from the file: {'; '.join(notes)}", UserWarning, stacklevel=3)


FIX_LENGTH_DEFAULTS = {"2wikimultihopqa": 16, "hotpotqa": 32, "iirc": 32, "strategyqa": 32, "nq": 32, "webq": 32,
                       "qa": 32}
TOKEN_RAG_THRESHOLDS = {"2wikimultihopqa": 0.08, "hotpotqa": 0.1, "iirc": 0.1, "strategyqa": 0.06, "nq": 0.1,
                        "webq": 0.1, "qa": 0.1}
FLARE_THETA = {"2wikimultihopqa": 0.8, "hotpotqa": 0.8, "iirc": 0.8, "strategyqa": 0.4, "nq": 0.8, "webq": 0.8,
               "qa": 0.8}
FLARE_BETA = 0.4
SENTENCE_SOLVERS = ("avg", "max", "min")
TOKEN_QUERIES = ("direct", "forward_all")  # the published TokenRAG's query formulations
FLARE_QUERIES = ("implicit", "explicit")


@dataclass(slots=True)
class RagConfig:
    """Fields every method shares: the answer-length stop rule, exemplars, documents per retrieval."""

    dataset: str
    generate_max_length: int  # L: tokens per generation, and the answer-length stop rule
    fewshot: int  # exemplars in the prompt
    retrieve_topk: int = 3  # documents per retrieval (DRAGIN Table 8)
    max_query_tokens: int = 64  # queries are left-truncated to their last N tokens (published retriever)
    stop_case_insensitive: bool = False  # published stop rule matches lowercase "the answer is" only
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            self.dataset = canonical_dataset(self.dataset)
        except DataError as e:
            raise ConfigError(f"dataset: {e}") from None
        check_int(self, "generate_max_length", 1)
        _fewshot(self)
        check_int(self, "retrieve_topk", 1)
        check_int(self, "max_query_tokens", 1)
        check_bools(self, "stop_case_insensitive")
        if not isinstance(self.extra, dict):
            raise ConfigError(f"extra must be a dict, got {type(self.extra).__name__}")


@dataclass(slots=True)
class BaselineConfig(RagConfig):
    """wo-RAG, SR-RAG, FL-RAG, FS-RAG (DRAGIN section 4.3)."""

    fix_length: int = 32  # FL-RAG: n, tokens generated between two retrievals
    flrag_typo: bool = False  # FL/FS-RAG prompts of the paper-era code say "Answer in t he same format as before."
    # "published": the published code's loop and text (special tokens and EOS kept, its exemplars, its joins, the
    # query round trip, padded passages, FL/FS-RAG's typo); docs/published.md
    fidelity: str = "reference"

    def __post_init__(self) -> None:
        RagConfig.__post_init__(self)
        check_int(self, "fix_length", 1)
        check_bools(self, "flrag_typo")
        _choice(self, "fidelity", FIDELITIES)


@dataclass(slots=True)
class TokenRagConfig(RagConfig):
    """The DRAGIN paper's "FLARE" baseline (published TokenRAG, method "token")."""

    hallucination_threshold: float = 0.1  # a sentence triggers when solver(1 - p) over its tokens > threshold
    sentence_solver: str = "avg"  # avg | max | min over the sentence's tokens
    fidelity: str = "reference"  # "published": the published TokenRAG's loop and text (docs/published.md)

    def __post_init__(self) -> None:
        RagConfig.__post_init__(self)
        check_unit(self, "hallucination_threshold")
        _choice(self, "sentence_solver", SENTENCE_SOLVERS)
        _choice(self, "fidelity", FIDELITIES)
        q = self.extra.get("query_formulation", "direct")
        if self.fidelity == "published" and q not in TOKEN_QUERIES:
            raise ConfigError(f"query_formulation {q!r}: the published TokenRAG's are {', '.join(TOKEN_QUERIES)}")


@dataclass(slots=True)
class FlareConfig(RagConfig):
    """FLARE-direct (FLARE paper section 3.2) and FLARE-instruct (section 3.1)."""

    theta: float = 0.8  # retrieve when any look-ahead token has p <= theta (0: never, 1: always)
    beta: float = 0.4  # implicit query masks tokens with p <= beta; explicit asks about those spans
    look_ahead_tokens: int = 64  # tokens generated for the look-ahead sentence (published FLARE: 64)
    query_formulation: str = "implicit"  # implicit | explicit
    retrieve_first: bool = True  # step 1 retrieves with the question (FLARE section 2.3: q_1 = x)
    question_max_tokens: int = 32  # explicit: tokens generated per question
    max_searches: int = 8  # instruct: at most this many "[Search(...)]" calls are served per question

    def __post_init__(self) -> None:
        RagConfig.__post_init__(self)
        check_unit(self, "theta")
        check_unit(self, "beta")
        check_int(self, "look_ahead_tokens", 1)
        check_int(self, "question_max_tokens", 1)
        check_int(self, "max_searches", 0)
        check_bools(self, "retrieve_first")
        _choice(self, "query_formulation", FLARE_QUERIES)


@dataclass(slots=True)
class DraginStreamingConfig(DraginConfig):
    """DRAGIN `streaming` mode: the reference rules judged per sentence as soon as it ends (docs/architecture.md)."""

    stream_chunk_tokens: int = 16  # tokens decoded between two sentence checks
    # where a_i comes from: "in-context" (docs/architecture.md, streaming: the running max of the last layer's attention in
    # the decode pass itself, prompt included in the softmax) or "pass" (reference mode's separate attention pass
    # over the round's tokens alone, one per judged sentence)
    stream_attention: str = "in-context"

    def __post_init__(self) -> None:
        DraginConfig.__post_init__(self)
        check_int(self, "stream_chunk_tokens", 1)
        _choice(self, "stream_attention", STREAM_ATTENTION)
        if self.mode != "streaming":
            raise ConfigError(f"mode must be 'streaming' for dragin-streaming, got {self.mode!r}")


# method name -> (dataset -> (config class, default values)): methods outside this file (a policy module with its own
# RagConfig subclass) register their defaults here, so method_config reads them like the built-in ones
CONFIG_DEFAULTS: dict[str, Any] = {}


def rag_defaults(dataset: str) -> dict[str, Any]:
    """The RagConfig fields every method starts from for `dataset` (DRAGIN's per-dataset L and exemplars)."""
    d = DRAGIN_DEFAULTS[dataset]
    return {"dataset": dataset, "generate_max_length": d["generate_max_length"], "fewshot": d["fewshot"]}


def method_defaults(method: str, dataset: str) -> tuple[type, dict[str, Any]]:
    """(config class, per-dataset default values) of a baseline / FLARE method, or of one registered in
    CONFIG_DEFAULTS."""
    if method in CONFIG_DEFAULTS:
        return CONFIG_DEFAULTS[method](dataset)
    base = rag_defaults(dataset)
    if method in ("wo-rag", "sr-rag", "fs-rag"):
        return BaselineConfig, base
    if method == "fl-rag":
        return BaselineConfig, {**base, "fix_length": FIX_LENGTH_DEFAULTS[dataset]}
    if method == "token-rag":
        return TokenRagConfig, {**base, "hallucination_threshold": TOKEN_RAG_THRESHOLDS[dataset]}
    if method in ("flare", "flare-explicit", "flare-instruct"):
        q = "explicit" if method == "flare-explicit" else "implicit"
        return FlareConfig, {**base, "theta": FLARE_THETA[dataset], "beta": FLARE_BETA, "query_formulation": q}
    raise ConfigError(f"no configuration defaults for method {method!r}")


def method_config(method: str, dataset: str, path: str | Path | None = None,
                  overrides: dict[str, Any] | None = None) -> RagConfig:
    """The config of a baseline / FLARE method: per-dataset defaults, then a JSON file's values, then overrides.

    The file may be a published DRAGIN config (its `method` must match: "fix-length-retrieval" for fl-rag,
    "token" for token-rag, ...) or a plain object of our field names. Bookkeeping keys of the published files
    go to `extra`; any other unknown key is an error naming it.
    """
    try:
        name = canonical_dataset(dataset)
    except DataError as e:
        raise ConfigError(f"dataset: {e}") from None
    raw: dict[str, Any] = {}
    where = ""
    if path is not None:
        raw = read_json_object(path)
        path = Path(path)
        where = f"{path}: "
        pm = raw.get("method")
        if pm is not None:
            ok = PUBLISHED_METHODS.get(method, ()) + (method,)
            if pm not in ok:
                hint = ""
                for ours, theirs in {**PUBLISHED_METHODS, "dragin": DRAGIN_METHODS}.items():
                    if pm in theirs:
                        hint = f" (that is fastrag's --method {ours})"
                raise ConfigError(f"{path}: field 'method' is {pm!r}, which is not {method}{hint}")
    cls, values = method_defaults(method, name)
    names = {f.name for f in fields(cls)} - {"extra"}
    extra: dict[str, Any] = {}
    for k, v in {**raw, **(overrides or {})}.items():
        if k == "dataset":
            extra["source_dataset"] = v
        elif k in names:
            values[k] = v
        elif k in PUBLISHED_EXTRA_KEYS:
            extra[k] = v
        else:
            raise ConfigError(f"{where}unknown config field {k!r} for {method}: valid fields are "
                              f"{', '.join(sorted(names))}")
    try:
        cfg = cls(**values, extra=extra)
    except ConfigError as e:
        raise ConfigError(f"{where}{e}") from None
    except TypeError as e:  # a required field missing
        raise ConfigError(f"{where}{e}") from None
    if path is not None:
        warn_not_applied(path, extra, cfg.dataset)
    return cfg
