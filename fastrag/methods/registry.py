"""Method registry: every method reachable as `fastrag run --method NAME` is one `MethodSpec`.

A method module registers itself when imported (`fastrag.methods` imports them all); the evaluator, the CLI and
`fastrag parity` only look names up here, so adding a method never touches them.

    make_config(dataset, config_path_or_None) -> the method's config object (the path may be a
                                                 fastrag.config.InlineConfig: a dict read as the file's object;
                                                 `make_config` below wraps a dict so)
    make_policy(cfg, tokenizer)               -> a policy for the scheduler (callable per example, with a
                                                 `shared_prefix` string computed once per run)
    make_oracle(hf_model, tokenizer, retriever, cfg) -> an object with `.run(qid, question, gold)` returning a
                                                 QuestionResult, the per-question reference (None: no oracle)
    decisions(QuestionResult) -> dict           what `fastrag parity` compares, one entry per decision kind
                                                 (None: fastrag.parity.decisions, DRAGIN's trigger/query/answer)
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class MethodSpec:
    name: str
    description: str
    make_config: Callable[[str, str | None], Any]
    make_policy: Callable[[Any, Any], Any]
    make_oracle: Callable[[Any, Any, Any, Any], Any] | None = None
    decisions: Callable[[Any], dict] | None = None


_REGISTRY: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"method {spec.name!r} is registered twice")
    _REGISTRY[spec.name] = spec
    return spec


def available() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def get_method(name: str) -> MethodSpec:
    _load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(_REGISTRY))}") from None


def make_config(method: str, dataset: str, config=None, name: str = "config"):
    """`method`'s config for `dataset` from `config`: None (the defaults), a JSON file's path, or a dict of the
    same fields (read as the file's object would be; messages name it `name`)."""
    from fastrag.inline_config import config_source

    return get_method(method).make_config(dataset, config_source(config, name))


def methods() -> dict[str, str]:
    """Every registered method's name -> its one-line description (paper and rule), sorted by name."""
    _load_all()
    return {name: _REGISTRY[name].description for name in sorted(_REGISTRY)}


def _load_all() -> None:
    import fastrag.methods  # noqa: F401  (its imports register every method)


class MethodsPackage(types.ModuleType):
    """The fastrag.methods package, callable: `fastrag.methods()` is `methods()` (the public API's listing, where
    `from fastrag import methods` finds the package)."""

    def __call__(self) -> dict[str, str]:
        return methods()


# (this module is imported while fastrag.methods itself loads: every import path reaches it through the package)
if "fastrag.methods" in sys.modules and not isinstance(sys.modules["fastrag.methods"], MethodsPackage):
    sys.modules["fastrag.methods"].__class__ = MethodsPackage
