"""Scripted stand-ins for BeamSearchQA tests: a tokenizer, an LLM keyed on the prompt, a retriever, and a driver
that serves a policy's requests synchronously (each Parallel part in order)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from fastrag.engine import Generation
from fastrag.loop.requests import AttnColmax, AttnRows, Generate, Parallel, Search
from fastrag.retrieval.base import Doc


class TextTok:
    """One id per distinct text: encode(text) -> [id], decode(ids) -> the texts joined. No chat template."""

    eos_token_id = None

    def __init__(self):
        self.texts: list[str] = []
        self.ids: dict[str, int] = {}

    def encode(self, text):
        if text not in self.ids:
            self.ids[text] = len(self.texts)
            self.texts.append(text)
        return [self.ids[text]]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.texts[i] for i in ids)


def kind(prompt: str) -> str:
    """Which of the four functions a prompt belongs to (from the instruction text it carries)."""
    if "Ranked Questions" in prompt:
        return "ask"
    if "provided documents" in prompt:
        return "summary"
    if "probability" in prompt:
        return "score"
    if "just one entity" in prompt:
        return "answer"
    raise AssertionError(f"unrecognised prompt: {prompt[-200:]!r}")


def queries_in(prompt: str) -> list[str]:
    return re.findall(r"^Query \d+: (.*)$", prompt, flags=re.M)


def candidate_in(prompt: str) -> str:
    m = re.search(r"and the candidate answer:\n(.*)\n", prompt)
    return m.group(1) if m else ""


@dataclass
class ScriptedLLM:
    """Outputs by function: `asks[last query or "<root>"]` (raw ranked-list text), answers from the path's queries,
    scores from the candidate answer (`scores[answer]`, raw text). Counts calls per function."""

    asks: dict = field(default_factory=dict)
    scores: dict = field(default_factory=dict)
    calls: dict = field(default_factory=lambda: {"ask": 0, "summary": 0, "score": 0, "answer": 0})

    def __call__(self, prompt: str) -> str:
        k = kind(prompt)
        self.calls[k] += 1
        qs = queries_in(prompt)
        if k == "ask":
            return self.asks.get(qs[-1] if qs else "<root>", "")
        if k == "summary":
            return " evidence for the question "
        if k == "answer":
            return " " + ("ans:" + "|".join(qs) if qs else "direct") + "."
        return self.scores.get(candidate_in(prompt), "no idea")


class ListRetriever:
    """Two documents for every query except those in `empty` (none); records each batch."""

    def __init__(self, empty=()):
        self.empty, self.batches = set(empty), []

    def search(self, queries, k):
        self.batches.append(list(queries))
        return [[] if q in self.empty else [Doc(id=f"{q}#{i}", title="T", text=f"text {i} about {q}")
                                          for i in range(k)] for q in queries]


def drive(gen, llm, tok, retriever):
    """Serve a policy generator synchronously; returns (its result, list of Parallel widths)."""
    widths, value = [], None
    while True:
        try:
            req = gen.send(value)
        except StopIteration as stop:
            return stop.value, widths
        parts = req.parts if isinstance(req, Parallel) else [req]
        widths.append(len(parts))
        out = []
        searches = [p for p in parts if isinstance(p, Search)]
        docs = iter(retriever.search([s.query for s in searches], max(s.k for s in searches)) if searches else [])
        for p in parts:
            if isinstance(p, Generate):
                ids = tok.encode(llm(p.prompt))
                out.append(Generation(ids=ids, entropy=[0.0] * len(ids), logprob=[0.0] * len(ids),
                                      prompt_tokens=1, prefilled=1))
            elif isinstance(p, Search):
                out.append(next(docs)[: p.k])
            elif isinstance(p, (AttnColmax, AttnRows)):
                raise AssertionError("BeamSearchQA asks for no attention pass")
        value = out if isinstance(req, Parallel) else out[0]
