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

The prompts, the parsers and the pure beam rules (prune, exit, final choice) are module-level functions shared with
the per-question oracle (`fastrag.oracle.beamsearchqa`), which runs Algorithm 1 with plain loops.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from fastrag.data.datasets import DataError, canonical_dataset
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


# ---------------------------------------------------------------------------------------------------- prompts
# Written after the paper's appendix A.1. One change of order: every prompt opens with the question and the
# query-evidence pairs (the Score prompt names the candidate answer after them), so the prompts of one question
# share that stem in the KV cache.

def chat_header(tokenizer) -> str:
    """The text every prompt starts with: the chat template up to the user message ("" without a template)."""
    if not getattr(tokenizer, "chat_template", None):
        return ""
    marker = "\x00USER\x00"
    full = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=True)
    return full[: full.index(marker)]


class Prompts:
    """The four functions' prompts for one tokenizer (its chat template wraps each user message)."""

    def __init__(self, tokenizer, cfg: BeamSearchQAConfig):
        self.cfg = cfg
        self.has_chat = bool(getattr(tokenizer, "chat_template", None))
        self.tok = tokenizer
        self.header = chat_header(tokenizer)

    def render(self, user: str, cue: str) -> str:
        """user message -> full prompt, ending with the assistant's opening words `cue`."""
        if self.has_chat:
            text = self.tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                add_generation_prompt=True)
        else:
            text = user + "\n"
        return text + cue

    @staticmethod
    def stem(q: str, Q: list[str], E: list[str]) -> str:
        s = f"Given the question:\n{q.strip()}\n"
        if Q:
            pairs = "\n".join(f"Query {i}: {qi}\nEvidence {i}: {ei}" for i, (qi, ei) in enumerate(zip(Q, E), 1))
            s += f"and the following query-evidence pairs:\n{pairs}\n"
        return s

    def answer(self, q: str, Q: list[str], E: list[str]) -> str:
        """Answer(q, Q, E) (A.1.1): one entity, completed after "The answer is"."""
        ref = "Please refer to the query-evidence pairs above and answer" if Q else "Please answer"
        return self.render(self.stem(q, Q, E) + f"{ref} the question with just one entity.", ANSWER_CUE)

    def ask(self, q: str, Q: list[str], E: list[str]) -> str:
        """Ask(q, Q, E, K) (A.1.2): ranked sub-questions, the list opened by the cue."""
        k = self.cfg.max_questions
        ctx = "the query-evidence pairs above" if Q else "what you know"
        return self.render(
            self.stem(q, Q, E)
            + f"Considering {ctx}, please generate some questions that can help answer the given question, "
            "with the following constraints:\n"
            f"1. You should output no more than {k} question{'s' if k > 1 else ''}.\n"
            "2. You should directly output the ranked sub-questions based on their importance.\n"
            "3. The generated questions should be diverse and focus on different aspects of the given question.\n"
            # A.1.2 shows "1. [Question 1] ...": SmolLM2-135M copies that placeholder verbatim, so the format names
            # its slots in angle brackets (which the parser drops when copied)
            "4. You should output in the following format:\nRanked Questions:\n1. <a question>\n2. <another question>",
            ASK_CUE)

    def summary(self, q_ori: str, docs) -> str:
        """The LLM half of Retrieve(q_ori, q', N) (A.1.3): the relevant facts of the N documents."""
        cut = self.cfg.max_doc_chars
        body = "\n".join(f"[{i}] {(d.title + ': ') if d.title else ''}{d.text[:cut]}" for i, d in enumerate(docs, 1))
        return self.render(self.stem(q_ori, [], []) + f"and the provided documents:\n{body}\n"
                           "Output the factual information from the documents that is relevant to the question.",
                           "")

    def score(self, q: str, Q: list[str], E: list[str], a: str) -> str:
        """Score(q, Q, E, a) (A.1.4): a probability in [0, 1] that a is the true answer."""
        ref = "Refer to the query-evidence pairs above and utilize" if Q else "Utilize"
        return self.render(
            self.stem(q, Q, E) + f"and the candidate answer:\n{a}\n"
            f"{ref} your own reasoning ability to assess the probability that the candidate answer is the true "
            "answer.\nPlease provide a number between 0 and 1 as the output, following the guidelines below:\n"
            "If the probability is between 0 and 0.3, it signifies that the model has substantial evidence to "
            "suggest it is an incorrect answer.\n"
            "If the probability is between 0.3 and 0.5, it suggests that the model leans towards considering it an "
            "incorrect answer, but lacks concrete evidence.\n"
            "If the probability is between 0.5 and 0.7, it indicates that the model leans towards considering it a "
            "correct answer, but lacks concrete evidence.\n"
            "If the probability is greater than 0.7, it signifies that the model has substantial evidence to "
            "suggest it is the correct answer.\n"
            "If the candidate answer doesn't provide a clear solution to the question, the probability should be 0.",
            SCORE_CUE)


ANSWER_CUE = "The answer is"
ASK_CUE = "Ranked Questions:\n1."
SCORE_CUE = "Probability:"


# ---------------------------------------------------------------------------------------------------- parsing

# a number: "0.85", ".7", "1e-3", a decimal comma after 0 or 1 ("0,9"); then "/10" or "%"
_NUM = re.compile(r"(?<![\w.])([-+]?(?:[01],\d+(?![\d,])|\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)"
                  r"(?:\s*/\s*(\d+(?:\.\d*)?))?\s*(%)?")


def parse_score(text: str) -> float:
    """The first number of the model's output as a probability in [0, 1]; 0.0 when there is none.

    "0.85" -> 0.85, ".7" -> 0.7, "1e-3" -> 0.001, "0,9" -> 0.9, "80%" -> 0.8, "7/10" -> 0.7; values outside
    [0, 1] are clamped (the prompt asks for a number between 0 and 1); no number -> 0 (the paper's rule for an
    answer without a clear solution).
    """
    m = _NUM.search(text or "")
    if m is None:
        return 0.0
    v = float(m.group(1).replace(",", "."))
    if m.group(2) is not None:
        den = float(m.group(2))
        if not den > 0:
            return 0.0
        v = v / den if math.isfinite(den) else 0.0
    elif m.group(3):
        v /= 100.0
    if math.isnan(v):
        return 0.0
    return min(1.0, max(0.0, v))  # an overflow (1e999, a 400-digit number) clamps like any other large value


_ANSWER_IS = re.compile(r"\banswer\s+is\b", re.I)


def parse_answer(text: str) -> str:
    """The entity after "The answer is": the first non-empty line, without a repeated "the answer is",
    quotes, markdown emphasis or a final period."""
    line = next((ln.strip() for ln in (text or "").splitlines() if ln.strip()), "")
    last = None
    for last in _ANSWER_IS.finditer(line):
        pass
    if last is not None:
        line = line[last.end():]
    line = line.strip().lstrip(":").strip()
    while True:  # quotes, emphasis and a final period, in any nesting ("**Paris**.", "\"Paris.\"")
        trimmed = line.strip("*_\"'`“”‘’ ").rstrip(".").strip()
        if trimmed == line:
            return line
        line = trimmed


def parse_evidence(text: str) -> str:
    """The summary as one line: whitespace collapsed."""
    return " ".join((text or "").split())


_HEADER = re.compile(r"^\s*(?:\*\*)?\s*ranked\s+(?:sub-?)?questions?\s*(?:\*\*)?\s*:?\s*(?:\*\*)?", re.I)
_MARKER = re.compile(r"^\s*(?:[-*•·]+|\(?\d{1,2}\s*[.):\]]|\[\d{1,2}\]|(?:q|question|sub-?question)\s*\d{1,2}\s*[.:)\]-])\s*",
                     re.I)
# the first numbered item of a line: at its start, or after a preamble ending in ":"
_FIRST_ITEM = re.compile(r"(?:^\s*|:\s+)\(?(\d{1,2})[.)]\s+\S")
_PLACEHOLDER = re.compile(r"^(?:\[?\s*(?:sub-?)?question\s*\d*\s*\]?\s*(?:\.\.\.)?|<[^<>]*>)$", re.I)
_WORD = re.compile(r"[^\W\d_]{2,}")  # a sub-question has at least one word of two letters


def question_key(s: str) -> str:
    """Comparison key of a question: its lowercase words of letters and digits (any script)."""
    return " ".join(re.findall(r"[^\W_]+", s.lower()))


def inline_items(line: str) -> list[str]:
    """A line holding several numbered items, split before each: the items must count on from the line's first
    number ("1. Who? 2. Where?"), so a number inside a question ("on 4. July") is not a marker."""
    m = _FIRST_ITEM.search(line)
    if m is None:
        return [line]
    cuts = [] if not line[:m.start()].strip() else [m.start() + len(m.group(0)) - len(m.group(0).lstrip(": "))]
    k, pos = int(m.group(1)) + 1, m.end()
    while (nxt := re.compile(rf"\s\(?{k}[.)]\s+\S").search(line, pos)) is not None:
        cuts.append(nxt.start() + 1)
        k, pos = k + 1, nxt.end()
    bounds = [0, *cuts, len(line)]
    return [line[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def parse_questions(text: str, k: int, question: str = "", previous: list[str] | tuple = ()) -> list[str]:
    """Up to k sub-questions from the model's ranked list, best first.

    Accepts numbered ("1.", "2)", "(3)", "[1]"), bulleted ("-", "*", "•") and "Q1:" / "Question 2:" lists,
    several numbered items on one line, "[...]" around an item, and a "Ranked Questions:" header. When some line
    has a list marker only marked lines count (a preamble such as "Sure, here are ..." is dropped); otherwise
    every non-empty line is a question. Empty items, template placeholders ("[Question 1]", "..."), repeats,
    items without a word of two letters ("2022-01", "..."), the question itself and the queries already on the path
    (`previous`) are dropped.
    """
    lines: list[str] = []
    for raw in (text or "").splitlines():
        raw = _HEADER.sub("", raw)
        lines += inline_items(raw)
    marked = [bool(_MARKER.match(ln)) for ln in lines]
    if any(marked):
        lines = [ln for ln, m in zip(lines, marked) if m]
    seen = {question_key(question)} | {question_key(p) for p in previous}
    out: list[str] = []
    for ln in lines:
        item = ln
        while _MARKER.match(item):  # "1. 1. Who ..." (the model repeating the cue's number) loses both
            item = _MARKER.sub("", item, count=1)
        item = item.strip("*_ ").strip()
        if item.startswith("[") and item.endswith("]"):
            item = item[1:-1].strip()
        item = item.strip("\"'“” ").strip()
        if not item or _PLACEHOLDER.match(item) or not _WORD.search(item):
            continue
        key = question_key(item)
        if not key or key in seen:
            continue
        seen.add(key)
        out.append(item)
        if len(out) == k:
            break
    return out


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
