"""The DRAGIN paper's baselines as the published code runs them (`fidelity: "published"`, docs/published.md).

The published `BasicRAG`, `SingleRAG`, `FixLengthRAG` (fix-length and fix-sentence) and `TokenRAG` loops: its
exemplars, special tokens and a final EOS kept in the text, the query's round trip through the tokenizer and padded
passages (fastrag.methods.published), the text joined as `text.strip() + " " + new.strip()`, the FL/FS-RAG prompt's
"Answer in t he same format" typo and its `case + " " + text` tail (a trailing space on the first round). wo-RAG and
SR-RAG keep their generation as decoded, unstripped; TokenRAG judges with its own `modifier`.
"""

from __future__ import annotations

from fastrag.data.exemplars import case_text, published_demo_text
from fastrag.data.metrics import ANSWER_MAX_TOKENS, answer_prompt, complete_answer, needs_answer_generation
from fastrag.methods import published as P
from fastrag.methods.common import FewShotMethod, generate, open_result, search, sentences, stop
from fastrag.methods.dragin_published import with_end
from fastrag.trace import Round


class _Published(FewShotMethod):
    def __init__(self, cfg, tokenizer):
        self.cfg, self.tok = cfg, tokenizer
        self.demos = published_demo_text(cfg.dataset, cfg.fewshot)

    def __call__(self, ex):
        res = open_result(ex)
        case = case_text(ex.question, self.cfg.dataset)
        text = yield from self.answer(res, ex.question, case)
        res.text = text
        if needs_answer_generation(text):  # the published evaluator's extra short generation
            g = yield from generate(res, answer_prompt(self.demos, case, text), ANSWER_MAX_TOKENS)
            text = complete_answer(text, self.decode(g))
        res.prediction = text
        return res

    def decode(self, g) -> str:
        return self.tok.decode(with_end(g)[0], skip_special_tokens=False)

    def retrieve(self, res, query: str, **round_fields):
        """The passages' texts for `query`, padded to retrieve_topk; the round records the query as formulated."""
        cfg = self.cfg
        docs = yield from search(res, P.search_query(self.tok, query, cfg.max_query_tokens), cfg.retrieve_topk)
        res.rounds.append(Round(query=query, doc_ids=[str(d.id) for d in docs], **round_fields))
        return P.pad_passages([d.text for d in docs], cfg.retrieve_topk)


class WoRagPublished(_Published):
    def answer(self, res, q, case):
        g = yield from generate(res, self.demos + case, self.cfg.generate_max_length)
        res.rounds.append(Round())
        return self.decode(g)


class SrRagPublished(_Published):
    def answer(self, res, q, case):
        texts = yield from self.retrieve(res, q)
        g = yield from generate(res, self.demos + P.context_block(texts) + case, self.cfg.generate_max_length)
        return self.decode(g)


class FixLengthPublished(_Published):
    """FL-RAG (`sentence=False`: keep each chunk of fix_length tokens) and FS-RAG (keep each generation's first
    sentence; a generation without one ends the answer)."""

    sentence = False

    def answer(self, res, q, case):
        cfg, text, query = self.cfg, "", q
        n = cfg.generate_max_length if self.sentence else cfg.fix_length
        while True:
            old_len = len(text)
            texts = yield from self.retrieve(res, query)
            g = yield from generate(res, self.demos + P.context_block(texts, typo=True) + case + " " + text, n)
            new = self.decode(g).strip()
            if self.sentence:
                sents = yield from sentences(new)
                if not sents:
                    return text
                new = sents[0].text
            text = text.strip() + " " + new
            query = new
            if stop(text, old_len, len(self.tok.encode(text)), cfg.generate_max_length):
                return text


class FsRagPublished(FixLengthPublished):
    sentence = True


class TokenRagPublished(_Published):
    """The published TokenRAG (the paper's "FLARE"): its `modifier` over each generation's tokens decoded one by one
    (fastrag.methods.published.token_modifier), its query, and its raw prompt and text concatenations."""

    def answer(self, res, q, case):
        cfg, tok, text = self.cfg, self.tok, ""
        formulation = cfg.extra.get("query_formulation", "direct")
        while True:
            old_len = len(text)
            g = yield from generate(res, self.demos + case + " " + text, cfg.generate_max_length, 0)
            ids = with_end(g)[0]
            lp = list(g.logprob) + ([g.end_logprob] if len(ids) > len(g.ids) else [])
            new = self.tok.decode(ids, skip_special_tokens=False)
            sents = yield from sentences(new)
            tokens = [tok.decode([t], skip_special_tokens=False) for t in ids]
            found = P.token_modifier([s.text for s in sents], tokens, lp, cfg.hallucination_threshold,
                                     cfg.sentence_solver)
            if found is None:
                res.rounds.append(Round())
                text = P.plain_join(text, new)
            else:
                kept, curr = found
                # (the round's trigger sentence is written as the published code has it: uncertain tokens "[xxx]")
                texts = yield from self.retrieve(res, P.token_query(formulation, q, text, kept, curr),
                                                 trigger_sentence=curr, kept=kept)
                g = yield from generate(res, self.demos + P.context_block(texts) + case + " " + text + " "
                                        + kept.strip(), cfg.generate_max_length, None)
                text = text.strip() + " " + kept.strip() + " " + self.decode(g).strip()
            if stop(text, old_len, len(tok.encode(text)), cfg.generate_max_length):
                return text


PUBLISHED = {"wo-rag": WoRagPublished, "sr-rag": SrRagPublished, "fl-rag": FixLengthPublished,
             "fs-rag": FsRagPublished, "token-rag": TokenRagPublished}
