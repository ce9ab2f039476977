"""Per-question FLARE-direct oracle (docs/methods.md, "flare"): plain transformers, one question at a time.

The parity reference for `fastrag parity --method flare` (and flare-explicit) and the speed baseline: every
generation re-prefills its whole prompt through `model.generate` (greedy, no stop strings, ends at EOS), batch 1.
It shares the prompt builders with the engine policy (the prompts are the contract) and the text utilities; the
decision rules — which tokens form the look-ahead sentence, the confidence test, the masked query, the spans of the
explicit queries — are written again here, plainly, so that the engine is checked against an independent reading.
"""

from __future__ import annotations

import time

from fastrag.data.exemplars import case_text
from fastrag.methods.common import join, rag_prompt
from fastrag.methods.flare import explicit_question_prompt
from fastrag.oracle.greedy import GreedyOracle
from fastrag.text.sentences import split_sentences
from fastrag.trace import QuestionResult, Round


class FlareOracle(GreedyOracle):
    """`run(qid, question, gold) -> QuestionResult`; config: fastrag.config.FlareConfig."""

    def first_sentence_tokens(self, ids) -> tuple[str, int]:
        """The first sentence of decode(ids) and how many tokens it takes: a token belongs to it when the text
        decoded before that token is shorter than the sentence's end (the token starts inside the sentence)."""
        full = self.text(ids)
        sents = split_sentences(full)
        if not sents:
            return "", 0
        n = 0
        while n < len(ids) and len(self.text(ids[:n])) < sents[0].end:
            n += 1
        return sents[0].text, n

    def implicit(self, ids, p) -> str:
        """The tokens of p > beta, a space for each masked run; "" when every token is masked."""
        pieces, run = [], []
        for t, x in zip(ids, p):
            if x > self.config.beta:
                run.append(t)
            else:
                pieces.append(self.text(run))
                run = []
        pieces.append(self.text(run))
        return " ".join(" ".join(pieces).split())

    def explicit(self, question, case, text, sent, ids, p):
        cfg = self.config
        spans, cur = [], []
        for t, x in zip(ids, p):
            if x <= cfg.beta:
                cur.append(t)
            elif cur:
                spans.append(cur)
                cur = []
        if cur:
            spans.append(cur)
        questions = []
        for span in spans:
            s = self.text(span).strip()
            if not s:
                continue
            gen, _ = self.generate(explicit_question_prompt(case, text, sent, s), cfg.question_max_tokens)
            line = self.text(gen).strip().split("\n", 1)[0].strip() if self.text(gen).strip() else ""
            if line:
                questions.append(line)
        if not questions:
            q = self.implicit(ids, p)
            return self.retrieve(q) if q else (None, None)
        lists, used = [], []
        for qn in questions:
            qq, docs = self.retrieve(qn)
            used.append(qq)
            lists.append(docs)
        merged, seen = [], set()
        for rank in range(cfg.retrieve_topk):
            for docs in lists:
                if rank < len(docs) and docs[rank].id not in seen:
                    seen.add(docs[rank].id)
                    merged.append(docs[rank])
        return " || ".join(used), merged[: cfg.retrieve_topk]

    def run(self, qid: str, question: str, gold) -> QuestionResult:
        cfg = self.config
        t0 = time.perf_counter()
        self._prefill = self._decode = self._calls = 0
        if not question.strip():
            raise ValueError("empty question")
        case = case_text(question, cfg.dataset)
        text, docs, rounds = "", [], []
        if cfg.retrieve_first:
            query, docs = self.retrieve(question)
            rounds.append(Round(query=query, doc_ids=[str(d.id) for d in docs]))
        while True:
            old_len = len(text)
            ids, p = self.generate(rag_prompt(self.demos, docs, case, text), cfg.look_ahead_tokens)
            sent, n = self.first_sentence_tokens(ids)
            if not sent:
                break
            if min(p[:n]) <= cfg.theta:
                if cfg.query_formulation == "implicit":
                    q = self.implicit(ids[:n], p[:n])
                    query, found = self.retrieve(q) if q else (None, None)
                else:
                    query, found = self.explicit(question, case, text, sent, ids[:n], p[:n])
                if query is None:  # every token masked: an empty query, no search; the documents stay
                    rounds.append(Round(trigger_sentence=sent))
                else:
                    docs = found
                    rounds.append(Round(trigger_sentence=sent, query=query, doc_ids=[str(d.id) for d in docs]))
                ids, _ = self.generate(rag_prompt(self.demos, docs, case, text), cfg.look_ahead_tokens)
                sent, _ = self.first_sentence_tokens(ids)
            else:
                rounds.append(Round())
            text = join(text, sent)
            if self.stop(text, old_len):
                break
        prediction = self.answer(case, text)
        return QuestionResult(qid=qid, question=question, gold=list(gold), text=text, prediction=prediction,
                              rounds=rounds, prefill_tokens=self._prefill, decode_tokens=self._decode,
                              llm_calls=self._calls, wall_s=time.perf_counter() - t0)
