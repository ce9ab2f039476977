"""`token-rag`: the FLARE variant the DRAGIN paper runs as its "FLARE" baseline (published TokenRAG, method "token").

Per round: generate L tokens from demos + case + text; split the new text into sentences; the first sentence whose
token uncertainty `solver(1 - p_t)` (solver = mean by default) exceeds `hallucination_threshold` triggers. The query
is that sentence with its uncertain tokens (1 - p_t > threshold) removed; the new prompt carries the documents,
the text so far and the sentences before the trigger; its whole L-token generation is appended. Without a
trigger the whole new text is appended. DRAGIN's stop rule ends the loop. Published DRAGIN configs named
FLARE.json ("method": "token") load as this method.
"""

from __future__ import annotations

from fastrag.config import TokenRagConfig, method_config
from fastrag.methods.baselines import baseline_oracle, fidelity_policy
from fastrag.methods.common import (FewShotMethod, finish_answer, generate, join, probs, rag_prompt, search,
                                    sentences, stop, token_char_ends, truncate_query)
from fastrag.methods.registry import MethodSpec, register
from fastrag.trace import Round

# the plain prompts' KV branch; retrieval prompts run on one-shot sequences (branch None), as in methods/dragin.py
PLAIN, RAG = 0, None
_SOLVERS = {"avg": lambda x: sum(x) / len(x), "max": max, "min": min}


def token_spans(ends: list[int], sents) -> list[tuple[int, int]]:
    """Token range [l, r) of each sentence: a token belongs to the last sentence that starts before its end (so
    " It" goes with "It ...", and whitespace-only tokens between two sentences with the earlier one)."""
    owner = []
    for e in ends:
        si = 0
        while si + 1 < len(sents) and sents[si + 1].start < e:
            si += 1
        owner.append(si)
    out, l = [], 0
    for si in range(len(sents)):
        r = l
        while r < len(owner) and owner[r] == si:
            r += 1
        out.append((l, r))
        l = r
    return out


def masked_text(tok, ids, keep: list[bool]) -> str:
    """The text of the kept tokens, whitespace collapsed."""
    return " ".join(tok.decode([t for t, k in zip(ids, keep) if k], skip_special_tokens=True).split())


class TokenRag(FewShotMethod):
    name = "token-rag"
    cfg: TokenRagConfig

    def judge(self, ids, logprob, new_text):
        """`trig = yield from self.judge(...)`: (sentences, index of the trigger sentence, its token range) or
        None."""
        sents = yield from sentences(new_text)
        if not sents:
            return None
        p = probs(logprob)
        spans = token_spans(token_char_ends(self.tok, ids), sents)
        solver = _SOLVERS[self.cfg.sentence_solver]
        for si, (l, r) in enumerate(spans):
            if r > l and solver([1 - x for x in p[l:r]]) > self.cfg.hallucination_threshold:
                return sents, si, (l, r)
        return None

    def __call__(self, ex):
        cfg, tok = self.cfg, self.tok
        res, case = self.open(ex)
        text = ""
        while True:
            old_len = len(text)
            g = yield from generate(res, self.demos + join(case, text), cfg.generate_max_length, PLAIN)
            new_text = tok.decode(g.ids, skip_special_tokens=True)
            trig = yield from self.judge(g.ids, g.logprob, new_text)
            if trig is None:
                res.rounds.append(Round())
                text = join(text, new_text.strip())
            else:
                sents, si, (l, r) = trig
                kept = join(*[s.text for s in sents[:si]])
                p = probs(g.logprob[l:r])
                query = masked_text(tok, g.ids[l:r], [1 - x <= cfg.hallucination_threshold for x in p])
                query = truncate_query(tok, query, cfg.max_query_tokens)
                docs = yield from search(res, query, cfg.retrieve_topk)
                res.rounds.append(Round(trigger_sentence=sents[si].text, query=query,
                                        doc_ids=[str(d.id) for d in docs]))
                g = yield from generate(res, rag_prompt(self.demos, docs, case, text, kept),
                                        cfg.generate_max_length, RAG)
                text = join(text, kept, tok.decode(g.ids, skip_special_tokens=True).strip())
            if stop(text, old_len, len(tok.encode(text)), cfg.generate_max_length, cfg.stop_case_insensitive):
                break
        return (yield from finish_answer(res, tok, self.demos, case, text))


register(MethodSpec(
    name="token-rag", description="DRAGIN paper's FLARE baseline: mean(1-p) of a sentence above a threshold",
    make_config=lambda dataset, path: method_config("token-rag", dataset, path),
    make_policy=fidelity_policy("token-rag", TokenRag),
    make_oracle=baseline_oracle("token-rag")))
