"""Pieces every method policy shares: prompt construction, the stop rule, the final answer, per-question counters.

The prompt builders are the contract of docs/methods.md; the per-question oracles (fastrag/oracle/) build their
prompts with the same functions, so engine and oracle feed the model byte-identical text.

KV reuse comes from how prompts are built, not from the policies: every prompt starts with the demos (the shared
prefix, computed once per run) and a prompt that continues an earlier generation of the same branch is that
earlier prompt plus the kept text, so the engine's longest-common-prefix match prefills only the new suffix.
"""

from __future__ import annotations

import math
import time

from fastrag.data.exemplars import case_text, demo_text
from fastrag.data.metrics import ANSWER_MAX_TOKENS, answer_prompt, complete_answer, needs_answer_generation
from fastrag.loop.requests import Generate, RealWords, Search, Sentences
from fastrag.trace import QuestionResult

STOP_PHRASE = "the answer is"
INSTRUCTION = "Answer in the same format as before.\n"
INSTRUCTION_TYPO = "Answer in t he same format as before.\n"  # the paper-era FL/FS-RAG prompt


def open_result(ex) -> QuestionResult:
    """The result record of question `ex`, which is used as given (trailing spaces included, as the published code
    and the oracles use it). A question that is empty or only whitespace raises ValueError("empty question"): the
    run records it as that question's error and answers the others."""
    if not ex.question.strip():
        raise ValueError("empty question")
    return QuestionResult(qid=ex.qid, question=ex.question, gold=list(ex.answers))


class FewShotMethod:
    """Base of the policies whose prompts start with their dataset's few-shot demonstrations (`demos`), which are
    the run's shared prefix: computed once and read once a decode step for the whole batch."""

    name = ""

    def __init__(self, cfg, tokenizer):
        self.cfg, self.tok = cfg, tokenizer
        self.demos = demo_text(cfg.dataset, cfg.fewshot)

    @property
    def shared_prefix(self) -> str:
        return self.demos

    def open(self, ex) -> tuple[QuestionResult, str]:
        """(`open_result(ex)`, the question's case text: what follows the demos in every prompt)."""
        return open_result(ex), case_text(ex.question, self.cfg.dataset)


def join(*parts: str) -> str:
    """The non-empty strings among `parts`, joined with one space."""
    return " ".join(p for p in parts if p)


def context_block(docs, typo: bool = False) -> str:
    """`"Context:\\n[1] text\\n...[k] text\\n" + instruction`; "" when there are no documents."""
    if not docs:
        return ""
    return ("Context:\n" + "".join(f"[{i}] {d.text}\n" for i, d in enumerate(docs, 1))
            + (INSTRUCTION_TYPO if typo else INSTRUCTION))


def rag_prompt(demos: str, docs, case: str, *text: str, typo: bool = False) -> str:
    """`demos + context_block(docs) + join(case, *text)` (no documents: the plain prompt)."""
    return demos + context_block(docs, typo) + join(case, *text)


def stop(text: str, old_len: int, n_tokens: int, max_len: int, case_insensitive: bool = False) -> bool:
    """Published stop rule: the answer exceeds L tokens, stopped growing, or contains "the answer is"."""
    has = STOP_PHRASE in (text.lower() if case_insensitive else text)
    return n_tokens > max_len or len(text) <= old_len or has


def truncate_query(tok, query: str, max_tokens: int) -> str:
    """Left-truncate a query to its last `max_tokens` tokens (the published retriever's rule: the query's own
    tokens, without the BOS a Llama tokenizer adds, which would take one of the 64 places)."""
    ids = tok.encode(query, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return query
    return tok.decode(ids[-max_tokens:], skip_special_tokens=True).strip()


def token_char_ends(tok, ids) -> list[int]:
    """`ends[i] = len(decode(ids[:i+1]))`: where each generated token's text ends in `decode(ids)`."""
    return [len(tok.decode(ids[: i + 1], skip_special_tokens=True)) for i in range(len(ids))]


def tokens_before(ends: list[int], char_end: int) -> int:
    """Number of leading tokens that start before `char_end` (a token belongs to the text it starts in)."""
    n, start = 0, 0
    for e in ends:
        if start >= char_end:
            break
        n += 1
        start = e
    return n


# spaCy work as scheduler requests (run on its text workers when it has them): `x = yield from f(text)`. A blank
# text asks for nothing (both functions give nothing for it).
def sentences(text: str):
    """spaCy's sentences of text (fastrag.text.sentences.split_sentences)."""
    if not text.strip():
        return []
    return (yield Sentences(text))


def first_sentence(text: str):
    """The first sentence of text, stripped; "" when there is none (fastrag.text.sentences.first_sentence)."""
    sents = yield from sentences(text)
    return sents[0].text if sents else ""


def real_words(text: str):
    """Texts of text's spaCy tokens with a content POS (fastrag.text.realwords.real_words)."""
    if not text.strip():
        return set()
    return (yield RealWords(text))


def probs(logprobs) -> list[float]:
    return [math.exp(lp) for lp in logprobs]


# ------------------------------------------------------------------ per-question accounting


def account(res: QuestionResult, g) -> None:
    """Add one engine Generation to the question's counters."""
    res.prefill_tokens += g.prefilled
    res.decode_tokens += 0 if g.reused else len(g.ids)
    c = res.counters
    c["generate_calls"] = c.get("generate_calls", 0) + 1
    if g.reused:
        c["reused_generations"] = c.get("reused_generations", 0) + 1
    c["reused_prompt_tokens"] = c.get("reused_prompt_tokens", 0) + (g.prompt_tokens - g.prefilled)


def search(res: QuestionResult, query: str, k: int):
    """`docs = yield from search(res, query, k)`: one retrieval, its wait and shortfalls counted."""
    t = time.perf_counter()
    docs = yield Search(query, k)
    c = res.counters
    c["retrieval_wait_s"] = c.get("retrieval_wait_s", 0.0) + time.perf_counter() - t
    c["searches"] = c.get("searches", 0) + 1
    if len(docs) < k:  # defined behaviour: the prompt carries what came back (none: no context block)
        c["short_retrievals"] = c.get("short_retrievals", 0) + 1
    return list(docs)


def generate(res: QuestionResult, prompt: str, n: int, branch: int | None = 0, **kw):
    """`g = yield from generate(res, prompt, n, branch)`: one generation, counted (kw: Generate's other fields)."""
    g = yield Generate(prompt, n, branch, **kw)
    account(res, g)
    return g


def finish_answer(res: QuestionResult, tok, demos: str, case: str, text: str, branch: int = 0):
    """`yield from finish_answer(...)`: the evaluator's one extra short generation when "the answer is" is absent
    (fastrag.data.metrics), then `res.text` / `res.prediction`."""
    res.text = text
    if needs_answer_generation(text):
        g = yield from generate(res, answer_prompt(demos, case, text), ANSWER_MAX_TOKENS, branch)
        text = complete_answer(text, tok.decode(g.ids, skip_special_tokens=True))
    res.prediction = text
    return res
