"""fastrag: dynamic RAG (DRAGIN, FLARE, BeamSearchQA and baselines) on a batched PyTorch engine.

    from fastrag import RAG, BM25
    results = RAG(model="smollm2", retriever=BM25()).run(["Who was born first, Einstein or Bohr?"])

The public names (docs/api.md) load on first use: `import fastrag` imports neither torch nor the model code.
"""

from __future__ import annotations

import importlib

_PUBLIC = {"RAG": "fastrag.api", "Results": "fastrag.api", "QuestionResult": "fastrag.api",
           "EngineConfig": "fastrag.specs", "BM25": "fastrag.specs", "Dense": "fastrag.specs",
           "Elasticsearch": "fastrag.specs", "RetrieverSpec": "fastrag.specs"}

__all__ = sorted([*_PUBLIC, "methods"])


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    if name == "methods":  # the fastrag.methods package, callable: fastrag.methods() lists the registered methods
        return importlib.import_module("fastrag.methods")
    raise AttributeError(f"module 'fastrag' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
