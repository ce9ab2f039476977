"""BeamSearchQA's text: the four functions' prompts (Answer, Ask, Summary, Score, after the paper's appendix A.1) and
the parsers of their outputs, shared by the engine policy (`fastrag.methods.beamsearchqa`) and the per-question
oracle (`fastrag.oracle.beamsearchqa`). Both import these names from fastrag.methods.beamsearchqa too."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastrag.methods.beamsearchqa import BeamSearchQAConfig


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
