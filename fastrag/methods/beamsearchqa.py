"""BeamSearchQA on the engine: beam search over generated sub-questions (paper 001, Algorithm 1; docs/beamsearchqa.md).

A tuple <q, Q, E, a, s> is a `fastrag.trace.BeamNode`. The beam starts from two seeds (the direct answer, and the
answer with evidence retrieved for the question itself); each depth asks every kept tuple for up to K new
sub-questions, retrieves N documents for each (one batched retriever call per depth), summarises them into evidence,
answers and scores; the B best children form the next beam; the search stops at depth D or as soon as a kept
child scores >= S, and the final answer is the best tuple of the last beam.

One question is a generator over engine requests, stage by stage: every LLM call of one stage (all nodes of the
beam) goes out as one `Parallel` and shares the decode batch with the other questions' calls. All prompts open with
the same stem (chat header, "Given the question: q", the query-evidence pairs), so a prompt placed on the KV branch
whose previous text shares the longest prefix with it (`_Lanes`) prefills only its new suffix: a child's Answer
reuses its parent's pairs, its Score reuses its own Answer prompt. Summary prompts carry retrieved documents that
nothing later extends; they run on one-shot sequences, and one whose documents (in order) equal an earlier summary's
of the same question is answered from it by the scheduler under greedy decoding (about a fifth of the summaries on
NQ-open and WebQuestions: sub-questions close to the question retrieve the same two passages).

The prompts and the parsers (`fastrag.methods.beamsearchqa_text`, importable from here too) and the pure beam rules
(prune, exit, final choice) are module-level functions shared with the per-question oracle
(`fastrag.oracle.beamsearchqa`), which runs Algorithm 1 with plain loops.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

from fastrag.data.datasets import DataError, canonical_dataset
from fastrag.methods.beamsearchqa_text import (  # noqa: F401  (the text's public names, importable from here too)
    ANSWER_CUE, ASK_CUE, SCORE_CUE, Prompts, chat_header, inline_items, parse_answer, parse_evidence, parse_questions,
    parse_score, question_key)
from fastrag.methods.common import open_result
from fastrag.loop.requests import Generate, Parallel, Search
from fastrag.trace import BeamNode, QuestionResult, Round


class BeamConfigError(ValueError):
    """An invalid BeamSearchQA setting; the message names the field (and the file when read from one)."""


@dataclass(slots=True)
class BeamSearchQAConfig:
    dataset: str
    max_questions: int = 2  # K: sub-questions kept per Ask call (paper section 4.2: K=2)
    max_depth: int = 2  # D: expansion depths (D=2)
    num_docs: int = 2  # N: documents retrieved per query (N=2)
    score_threshold: float = 0.8  # S: stop once a kept tuple scores >= S (S=0.8)
    beam_size: int = 2  # B: tuples kept per depth (B=2)
    answer_max_tokens: int = 24  # new tokens per LLM call, per function
    ask_max_tokens: int = 64
    summary_max_tokens: int = 64
    score_max_tokens: int = 8
    max_doc_chars: int = 1500  # a retrieved passage is cut to this many characters in the summary prompt

    def __post_init__(self) -> None:
        try:
            self.dataset = canonical_dataset(self.dataset)
        except DataError as e:
            raise BeamConfigError(f"dataset: {e}") from None
        for name in ("max_questions", "max_depth", "num_docs", "beam_size", "answer_max_tokens", "ask_max_tokens",
                     "summary_max_tokens", "score_max_tokens", "max_doc_chars"):
            v = getattr(self, name)
            lo = 0 if name == "max_depth" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise BeamConfigError(f"{name} must be an int >= {lo}, got {v!r}")
        s = self.score_threshold
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not (0.0 <= s <= 1.0) or math.isnan(s):
            raise BeamConfigError(f"score_threshold must be a number in [0, 1], got {s!r}")
        self.score_threshold = float(s)


# the paper's letters, accepted as config keys
_LETTERS = {"K": "max_questions", "D": "max_depth", "N": "num_docs", "S": "score_threshold", "B": "beam_size"}
_FIELDS = tuple(f.name for f in fields(BeamSearchQAConfig))


def beamsearchqa_config(dataset: str, path: str | os.PathLike | None = None,
                        overrides: dict[str, Any] | None = None) -> BeamSearchQAConfig:
    """The paper's defaults (K=2, D=2, N=2, S=0.8, B=2), then a JSON file's values, then `overrides`.

    Keys are field names or the paper's letters K, D, N, S, B; any other key is an error naming it.
    """
    values: dict[str, Any] = {}
    where = ""
    if path is not None:
        where = f"{path}: "
        from fastrag.config import read_json_object

        raw = read_json_object(path, BeamConfigError)
        pm = raw.pop("method", None)
        if pm is not None and pm not in ("beamsearchqa", "BeamSearchQA"):  # e.g. a published DRAGIN file
            raise BeamConfigError(f"{path}: field 'method' is {pm!r}: a config of another method, not beamsearchqa "
                                  "(see `fastrag methods`)")
        values.update(raw)
    values.update(overrides or {})
    out: dict[str, Any] = {"dataset": dataset}
    given: dict[str, str] = {}  # field -> the key that set it (a letter and its field name both given: refused)
    for k, v in values.items():
        name = _LETTERS.get(k, k)
        if name in given and given[name] != k:
            raise BeamConfigError(f"{where}{given[name]!r} and {k!r} both set {name}: give one")
        given[name] = k
        if name not in _FIELDS or name == "dataset":
            if name == "dataset":
                continue  # the run's --dataset wins over a file's
            raise BeamConfigError(f"{where}unknown config field {k!r}: valid fields are "
                                  f"{', '.join(f for f in _FIELDS if f != 'dataset')} (or K, D, N, S, B)")
        out[name] = v
    try:
        return BeamSearchQAConfig(**out)
    except BeamConfigError as e:
        raise BeamConfigError(f"{where}{e}") from None


# ---------------------------------------------------------------------------------------------------- beam rules

def prune(nodes: list[BeamNode], beam_size: int) -> list[BeamNode]:
    """The beam_size highest-scoring tuples, best first; ties keep generation order (Algorithm 1, line 20)."""
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, i))
    return [nodes[i] for i in order[:beam_size]]


def reached(beam: list[BeamNode], threshold: float) -> bool:
    """The exit test of Algorithm 1, line 21: some kept tuple scores >= S."""
    return any(n.score >= threshold for n in beam)


def best(beam: list[BeamNode]) -> BeamNode:
    """The final tuple (Algorithm 1, line 26): the highest score, the earliest on ties."""
    if not beam:
        raise ValueError("empty beam: no tuple to answer from")
    return prune(beam, 1)[0]


def prediction_text(answer: str) -> str:
    """The scored text: the answer after "the answer is" (fastrag.data.metrics.extract_answer reads it back)."""
    return f"So the answer is {answer}"


# ---------------------------------------------------------------------------------------------------- the policy

class _Lanes:
    """KV-branch planning for one question: each new prompt goes to the free branch whose last text (prompt and
    output) shares the longest prefix with it, so the engine's own-cache reuse (longest common prefix) applies."""

    def __init__(self):
        self.text: list[str] = []  # branch -> its last prompt + generated text

    def assign(self, prompts: list[str]) -> list[int]:
        pairs = sorted(((len(os.path.commonprefix([p, t])), i, b) for i, p in enumerate(prompts)
                        for b, t in enumerate(self.text)), key=lambda x: (-x[0], x[1], x[2]))
        out: list[int | None] = [None] * len(prompts)
        used: set[int] = set()
        for _, i, b in pairs:
            if out[i] is None and b not in used:
                out[i] = b
                used.add(b)
        for i in range(len(prompts)):
            if out[i] is None:
                out[i] = len(self.text)
                self.text.append("")
        for i, b in enumerate(out):
            self.text[b] = prompts[i]
        return out  # type: ignore[return-value]

    def record(self, branch: int, output: str) -> None:
        self.text[branch] += output


@dataclass(slots=True)
class _Child:
    parent: BeamNode
    query: str
    docs: list = field(default_factory=list)


class BeamSearchQA:
    """Policy factory: `policy(example)` returns the generator the scheduler drives."""

    name = "beamsearchqa"

    def __init__(self, cfg: BeamSearchQAConfig, tokenizer):
        self.cfg, self.tok = cfg, tokenizer
        self.prompts = Prompts(tokenizer, cfg)

    @property
    def shared_prefix(self) -> str:
        return self.prompts.header

    def __call__(self, ex):
        return self.run(ex)

    def _stage(self, res: QuestionResult, lanes: _Lanes, calls=(), one_shot=(), queries=()):
        """One Parallel: LLM calls (prompt, max new tokens) on planned KV branches, LLM calls on one-shot
        sequences, and searches (one retriever call). Returns (outputs, one-shot outputs, documents)."""
        calls, one_shot, queries = list(calls), list(one_shot), list(queries)
        branches = lanes.assign([p for p, _ in calls])
        parts = ([Generate(p, n, branch=b) for (p, n), b in zip(calls, branches)]
                 + [Generate(p, n, branch=None) for p, n in one_shot]
                 + [Search(x, self.cfg.num_docs) for x in queries])
        results = (yield Parallel(parts)) if parts else []
        texts = []
        for i, g in enumerate(results[: len(calls) + len(one_shot)]):
            res.llm_calls += 1  # the algorithm's calls, answered by the engine or by an identical earlier one
            res.prefill_tokens += g.prefilled
            res.decode_tokens += 0 if g.reused else len(g.ids)
            if g.reused:
                res.counters["reused_generations"] = res.counters.get("reused_generations", 0) + 1
            texts.append(self.tok.decode(g.ids, skip_special_tokens=True))
            if i < len(calls):
                lanes.record(branches[i], texts[-1])
        docs = results[len(calls) + len(one_shot):]
        for x, d in zip(queries, docs):
            res.rounds.append(Round(query=x, doc_ids=[doc.id for doc in d]))
        return texts[: len(calls)], texts[len(calls):], docs

    def run(self, ex):
        cfg, P = self.cfg, self.prompts
        q = ex.question
        res = open_result(ex)
        lanes = _Lanes()

        # beam initialisation (Algorithm 1, lines 1-8): the direct answer, and the answer with evidence for q
        [a0], _, [docs] = yield from self._stage(res, lanes, calls=[(P.answer(q, [], []), cfg.answer_max_tokens)],
                                                 queries=[q])
        seed0 = BeamNode(answer=parse_answer(a0))
        summary = [(P.summary(q, docs), cfg.summary_max_tokens)] if docs else []
        [s0], e1, _ = yield from self._stage(res, lanes, calls=[(P.score(q, [], [], seed0.answer),
                                                                 cfg.score_max_tokens)], one_shot=summary)
        seed0.score = parse_score(s0)
        beam = [seed0]
        if docs:  # no document for the question: the second seed cannot be built
            seed1 = BeamNode(queries=[q], evidence=[parse_evidence(e1[0])], doc_ids=[[d.id for d in docs]])
            yield from self._answer_and_score(res, lanes, q, [seed1])
            beam.append(seed1)
        res.beams.append(list(beam))

        # expansion (lines 9-25), every tuple of the beam at once, stage by stage
        for depth in range(1, cfg.max_depth + 1):
            asks, _, _ = yield from self._stage(res, lanes, calls=[(P.ask(q, n.queries, n.evidence),
                                                                    cfg.ask_max_tokens) for n in beam])
            children = [_Child(parent=n, query=sq) for n, text in zip(beam, asks)
                        for sq in parse_questions(ASK_CUE + text, cfg.max_questions, q, n.queries)]
            _, _, docs = yield from self._stage(res, lanes, queries=[c.query for c in children])
            for c, d in zip(children, docs):
                c.docs = d
            children = [c for c in children if c.docs]  # a sub-question without documents yields no tuple
            if not children:
                break  # every expansion failed: the beam (and the answer it gives) stays
            _, sums, _ = yield from self._stage(res, lanes, one_shot=[(P.summary(q, c.docs), cfg.summary_max_tokens)
                                                                      for c in children])
            nodes = [BeamNode(queries=c.parent.queries + [c.query], evidence=c.parent.evidence + [parse_evidence(e)],
                              doc_ids=c.parent.doc_ids + [[d.id for d in c.docs]], depth=depth)
                     for c, e in zip(children, sums)]
            yield from self._answer_and_score(res, lanes, q, nodes)
            beam = prune(nodes, cfg.beam_size)
            res.beams.append(list(beam))
            if reached(beam, cfg.score_threshold):
                break

        res.chosen = best(beam)
        res.text = res.chosen.answer
        res.prediction = prediction_text(res.chosen.answer)
        return res

    def _answer_and_score(self, res, lanes, q: str, nodes: list[BeamNode]):
        cfg, P = self.cfg, self.prompts
        answers, _, _ = yield from self._stage(res, lanes, calls=[(P.answer(q, n.queries, n.evidence),
                                                                   cfg.answer_max_tokens) for n in nodes])
        for n, a in zip(nodes, answers):
            n.answer = parse_answer(a)
        scores, _, _ = yield from self._stage(res, lanes, calls=[(P.score(q, n.queries, n.evidence, n.answer),
                                                                  cfg.score_max_tokens) for n in nodes])
        for n, s in zip(nodes, scores):
            n.score = parse_score(s)


def decisions(r: QuestionResult) -> dict:
    """What parity compares for BeamSearchQA: the final answer and the chosen path (its queries, in order)."""
    if r.error is not None:
        return {"answer": f"error: {r.error}", "path": None}
    return {"answer": r.chosen.answer if r.chosen else None,
            "path": list(r.chosen.queries) if r.chosen else None}


def _config(dataset: str, path: str | None):
    return beamsearchqa_config(dataset, path)


def _oracle(hf_model, tokenizer, retriever, cfg):
    from fastrag.oracle.beamsearchqa import BeamSearchQAOracle

    return BeamSearchQAOracle(hf_model, tokenizer, retriever, cfg)


from fastrag.methods.registry import MethodSpec, register  # noqa: E402

register(MethodSpec(
    name="beamsearchqa",
    description="BeamSearchQA: beam search over generated sub-questions (K, D, N, S, B; paper Algorithm 1)",
    make_config=_config, make_policy=BeamSearchQA, make_oracle=_oracle, decisions=decisions))
