"""FLARE on the engine (FLARE paper section 3): `flare` / `flare-explicit` (FLARE-direct) and `flare-instruct`.

FLARE-direct, per step (docs/methods.md has the exact rules):
1. look-ahead: generate `look_ahead_tokens` from demos + [documents] + case + text, keep its first sentence s^;
2. if every token of s^ has p > theta, accept s^ (the documents in the prompt stay);
3. else retrieve with a query built from s^ — implicit: s^ without its tokens of p <= beta; explicit: one question
   per low-probability span, asked by the same model, results interleaved and de-duplicated — the new documents
   replace the old ones, and the sentence is regenerated from the new prompt (its first sentence is accepted).
Step 1 of the question retrieves with the question itself (FLARE section 2.3, `retrieve_first`).

FLARE-instruct: the prompt teaches the "[Search(query)]" call; when the model writes one, the generation is cut
after it, the query is retrieved, and generation resumes from a prompt with the new documents.
"""

from __future__ import annotations

from fastrag.config import FlareConfig, method_config
from fastrag.methods.common import (FewShotMethod, finish_answer, generate, join, probs, rag_prompt, search,
                                    sentences, stop, token_char_ends, tokens_before, truncate_query)
from fastrag.methods.registry import MethodSpec, register
from fastrag.trace import Round

MAIN, QGEN = 0, 2  # KV branches: the answer prompts; the explicit-query question prompts


def explicit_question_prompt(case: str, text: str, sentence: str, span: str) -> str:
    """Prompt asking the model for a question whose answer is `span` (FLARE section 3.2, explicit queries)."""
    return join(case, text, sentence) + f'\n\nAsk a question to which the answer is "{span}".\nQuestion:'


def first_line(s: str) -> str:
    s = s.strip()
    return s.split("\n", 1)[0].strip() if s else ""


def low_spans(ids, p: list[float], beta: float) -> list[tuple[int, int]]:
    """Maximal runs [l, r) of tokens with p <= beta."""
    out, l = [], None
    for i, x in enumerate(p):
        if x <= beta and l is None:
            l = i
        elif x > beta and l is not None:
            out.append((l, i))
            l = None
    if l is not None:
        out.append((l, len(p)))
    return out


def interleave(lists, k: int) -> list:
    """Round-robin over ranked lists (rank 1 of each, then rank 2, ...), first occurrence of each id, top k."""
    out, seen = [], set()
    for rank in range(max((len(x) for x in lists), default=0)):
        for docs in lists:
            if rank < len(docs) and docs[rank].id not in seen:
                seen.add(docs[rank].id)
                out.append(docs[rank])
    return out[:k]


class FlareDirect(FewShotMethod):
    name = "flare"
    cfg: FlareConfig

    def look_ahead(self, g):
        """`sent, n = yield from self.look_ahead(g)`: (first sentence text, its token count) of a look-ahead
        generation; ("", 0) when it has none. s^'s tokens are those that start before its last character ends
        (published FLARE's rule): the token holding that character even when it runs into the next sentence
        (SmolLM2's `._` or `)).`), and no whitespace token after it."""
        new = self.tok.decode(g.ids, skip_special_tokens=True)
        sents = yield from sentences(new)
        if not sents:
            return "", 0
        return sents[0].text, tokens_before(token_char_ends(self.tok, g.ids), sents[0].end)

    def __call__(self, ex):
        cfg, tok = self.cfg, self.tok
        q = ex.question
        res, case = self.open(ex)
        text, docs = "", []
        if cfg.retrieve_first:
            query = truncate_query(tok, q, cfg.max_query_tokens)
            docs = yield from search(res, query, cfg.retrieve_topk)
            res.rounds.append(Round(query=query, doc_ids=[str(d.id) for d in docs]))
        while True:
            old_len = len(text)
            g = yield from generate(res, rag_prompt(self.demos, docs, case, text), cfg.look_ahead_tokens, MAIN)
            sent, r = yield from self.look_ahead(g)
            if not sent:
                break
            p = probs(g.logprob[:r])
            if any(x <= cfg.theta for x in p):
                query, found = yield from self.retrieve(res, case, text, sent, g.ids[:r], p)
                if query is None:  # every token of s^ masked: no search (an empty query); the documents stay
                    res.rounds.append(Round(trigger_sentence=sent))
                else:
                    docs = found
                    res.rounds.append(Round(trigger_sentence=sent, query=query, doc_ids=[str(d.id) for d in docs]))
                g = yield from generate(res, rag_prompt(self.demos, docs, case, text), cfg.look_ahead_tokens, MAIN)
                sent, _ = yield from self.look_ahead(g)
            else:
                res.rounds.append(Round())
            text = join(text, sent)
            if stop(text, old_len, len(tok.encode(text)), cfg.generate_max_length, cfg.stop_case_insensitive):
                break
        return (yield from finish_answer(res, tok, self.demos, case, text))

    def implicit_query(self, ids, p: list[float]) -> str:
        """s^ with its tokens of p <= beta masked: each masked run becomes a space (published FLARE's rule: the
        pieces on either side stay apart), spaces collapsed; "" when nothing is left."""
        runs, cur = [], []
        for t, x in zip(ids, p):
            if x > self.cfg.beta:
                cur.append(t)
            elif cur:
                runs.append(cur)
                cur = []
        runs.append(cur)
        query = " ".join(" ".join(self.tok.decode(r, skip_special_tokens=True) for r in runs if r).split())
        return truncate_query(self.tok, query, self.cfg.max_query_tokens) if query else ""

    def retrieve(self, res, case, text, sent, ids, p):
        """`query, docs = yield from self.retrieve(...)`; (None, None) when the query is empty (no search)."""
        cfg, tok = self.cfg, self.tok
        questions = []
        for l, r in (low_spans(ids, p, cfg.beta) if cfg.query_formulation == "explicit" else []):
            span = tok.decode(ids[l:r], skip_special_tokens=True).strip()
            if not span:
                continue
            g = yield from generate(res, explicit_question_prompt(case, text, sent, span), cfg.question_max_tokens,
                                    QGEN)
            qn = first_line(tok.decode(g.ids, skip_special_tokens=True))
            if qn:
                questions.append(truncate_query(tok, qn, cfg.max_query_tokens))
        # the implicit query: its formulation's, or explicit's when no low-probability span (theta > p > beta) or
        # no question came out
        if not questions:
            query = self.implicit_query(ids, p)
            if not query:
                return None, None
            return query, (yield from search(res, query, cfg.retrieve_topk))
        ranked = []
        for qn in questions:
            ranked.append((yield from search(res, qn, cfg.retrieve_topk)))
        return " || ".join(questions), interleave(ranked, cfg.retrieve_topk)


# ---------------------------------------------------------------------------------------------- instruct

# Our own wording of the FLARE paper's "Prompt 3.1" structure: skill 1 (search calls), skill 2 (the dataset's
# step-by-step exemplars), then an instruction combining them for the test case.
SEARCH_SKILL = (
    "Skill 1. Use the Search API to look up information by writing \"[Search(term)]\", where \"term\" is what you "
    "want to look up. For example:\n"
    "Question: Which river flows through the capital of Hungary?\n"
    "Answer (with Search): [Search(capital of Hungary)] The capital of Hungary is Budapest. "
    "[Search(river through Budapest)] The Danube flows through Budapest.\n"
    "Question: What year was the author of The Old Man and the Sea born?\n"
    "Answer (with Search): [Search(author of The Old Man and the Sea)] The Old Man and the Sea was written by "
    "Ernest Hemingway. [Search(Ernest Hemingway birth year)] Ernest Hemingway was born in 1899.\n\n"
    "Skill 2. Answer questions by thinking step-by-step. First, write out the reasoning steps, then draw the "
    "conclusion. For example:\n"
)
COMBINE = ("\nNow, combine the two skills: write out the reasoning steps, using the Search API \"[Search(term)]\" "
           "whenever a step needs information, then draw the conclusion.\n\n")
OPEN_CALL, CLOSE_CALL = "[Search(", ")]"


def scan_calls(text: str) -> tuple[list[tuple[int, int]], int]:
    """The complete "[Search(...)]" calls of `text` as [start, end) ranges, in order, and the start of a call left
    open at the end (-1: none). Calls nest: "[Search(capital of [Search(France)])]" is one call, closed by the
    ")]" that balances its opener."""
    calls, i = [], 0
    while True:
        start = text.find(OPEN_CALL, i)
        if start < 0:
            return calls, -1
        depth, j = 1, start + len(OPEN_CALL)
        while depth:
            o, c = text.find(OPEN_CALL, j), text.find(CLOSE_CALL, j)
            if c < 0:
                return calls, start
            if 0 <= o < c:
                depth, j = depth + 1, o + len(OPEN_CALL)
            else:
                depth, j = depth - 1, c + len(CLOSE_CALL)
        calls.append((start, j))
        i = j


def call_query(call: str) -> str:
    """The query of one call's text: between its outer brackets, nested call brackets removed, spaces collapsed."""
    inner = call[len(OPEN_CALL):-len(CLOSE_CALL)]
    return " ".join(inner.replace(OPEN_CALL, " ").replace(CLOSE_CALL, " ").split())


def strip_search_calls(text: str) -> str:
    """The answer text without its "[Search(...)]" calls, and without an opener left unclosed (what is scored)."""
    calls, open_at = scan_calls(text)
    if open_at >= 0:
        text = text[:open_at] + text[open_at + len(OPEN_CALL):]
        return strip_search_calls(text)
    out, i = [], 0
    for a, b in calls:
        out.append(text[i:a])
        i = b
    out.append(text[i:])
    return " ".join(" ".join(out).split())


class FlareInstruct(FewShotMethod):
    """The shared prefix is the search-skill exemplars, the demos and the combining instruction."""

    name = "flare-instruct"
    cfg: FlareConfig

    def __init__(self, cfg: FlareConfig, tokenizer):
        super().__init__(cfg, tokenizer)
        self.head = SEARCH_SKILL + self.demos + COMBINE

    @property
    def shared_prefix(self) -> str:
        return self.head

    def __call__(self, ex):
        cfg, tok = self.cfg, self.tok
        q = ex.question
        res, case = self.open(ex)
        text, docs, served = "", [], 0
        while True:
            old_len = len(text)
            g = yield from generate(res, rag_prompt(self.head, docs, case, text), cfg.look_ahead_tokens, MAIN)
            new = tok.decode(g.ids, skip_special_tokens=True)
            ended = g.ended_by_eos or len(g.ids) < cfg.look_ahead_tokens  # on its own, not by the token budget
            while True:
                calls, open_at = scan_calls(new)
                if (calls and served < cfg.max_searches) or open_at < 0:
                    break
                # a call left open: a look-ahead cut by its token budget resumes before it (the next one writes the
                # call whole); one that ended on its own, or holds nothing before the call, can never close it:
                # the opener is dropped and the text read again
                if not ended and new[:open_at].strip():
                    break
                new = new[:open_at] + new[open_at + len(OPEN_CALL):]
            if calls and served < cfg.max_searches:
                # generation pauses at the call: keep the text through it, retrieve, resume with the documents
                a, b = calls[0]
                text = join(text, new[:b].strip())
                query = truncate_query(tok, call_query(new[a:b]) or q, cfg.max_query_tokens)
                docs = yield from search(res, query, cfg.retrieve_topk)
                served += 1
                res.rounds.append(Round(trigger_sentence=new[a:b], query=query, doc_ids=[str(d.id) for d in docs]))
            else:
                if open_at >= 0:  # cut by the budget inside a call: resume before it
                    new = new[:open_at]
                text = join(text, new.strip())
                res.rounds.append(Round())
            # the stop rule reads the text without the calls (a call's own words are no answer); growth counts them
            scored = strip_search_calls(text)
            if len(text) <= old_len or stop(scored, -1, len(tok.encode(scored)), cfg.generate_max_length,
                                            cfg.stop_case_insensitive):
                break
        # the answer is read from the text without the search calls, on the plain few-shot prompt
        return (yield from finish_answer(res, tok, self.demos, case, strip_search_calls(text), branch=1))


def _config(method: str):
    return lambda dataset, path: method_config(method, dataset, path)


def _flare_oracle(hf_model, tokenizer, retriever, cfg):
    from fastrag.oracle.flare import FlareOracle

    return FlareOracle(hf_model, tokenizer, retriever, cfg)


register(MethodSpec(name="flare", description="FLARE-direct: look-ahead sentence, retrieve if a token has "
                    "p <= theta, implicit query (tokens p <= beta masked)", make_config=_config("flare"),
                    make_policy=FlareDirect, make_oracle=_flare_oracle))
register(MethodSpec(name="flare-explicit", description="FLARE-direct with explicit queries: model-generated "
                    "questions about the low-probability spans", make_config=_config("flare-explicit"),
                    make_policy=FlareDirect, make_oracle=_flare_oracle))
register(MethodSpec(name="flare-instruct", description="FLARE-instruct: the model writes [Search(query)], "
                    "generation pauses, retrieves and resumes", make_config=_config("flare-instruct"),
                    make_policy=FlareInstruct))
