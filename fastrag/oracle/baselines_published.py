"""Per-question oracle of the DRAGIN paper's baselines as the published code runs them (`fidelity: "published"`).

The parity reference of fastrag.methods.baselines_published on plain transformers, one question at a time, each
generation re-prefilling its whole prompt: the published `BasicRAG` / `SingleRAG` / `FixLengthRAG` / `TokenRAG`
loops, written again here plainly. The text rules they share with the engine (the query round trip, padded
passages, the context block, TokenRAG's modifier) are fastrag.methods.published.
"""

from __future__ import annotations

import math
import time

from fastrag.data.exemplars import case_text, published_demo_text
from fastrag.methods import published as P
from fastrag.methods.common import stop
from fastrag.oracle.baselines import BaselineOracle
from fastrag.text.sentences import split_sentences
from fastrag.trace import QuestionResult, Round


class BaselinePublishedOracle(BaselineOracle):
    """`run(qid, question, gold)` of wo-rag, sr-rag, fl-rag, fs-rag or token-rag with `fidelity: "published"`."""

    keep_end = True  # generations keep the EOS that ends them (GreedyOracle.generate)

    def __init__(self, model, tokenizer, retriever, config, method: str):
        super().__init__(model, tokenizer, retriever, config, method)
        self.demos = published_demo_text(config.dataset, config.fewshot)

    def text(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _passages(self, query: str, rounds: list[Round], **round_fields) -> list[str]:
        cfg = self.config
        docs = self.retriever.search([P.search_query(self.tokenizer, query, cfg.max_query_tokens)],
                                     k=cfg.retrieve_topk)[0]
        rounds.append(Round(query=query, doc_ids=[str(d.id) for d in docs], **round_fields))
        return P.pad_passages([d.text for d in docs], cfg.retrieve_topk)

    def run(self, qid: str, question: str, gold) -> QuestionResult:
        t0 = time.perf_counter()
        self._prefill = self._decode = self._calls = 0
        if not question.strip():
            raise ValueError("empty question")
        cfg = self.config
        case = case_text(question, cfg.dataset)
        rounds: list[Round] = []
        L = cfg.generate_max_length
        if self.method == "wo-rag":
            ids, _ = self.generate(self.demos + case, L)
            rounds.append(Round())
            text = self.text(ids)
        elif self.method == "sr-rag":
            texts = self._passages(question, rounds)
            ids, _ = self.generate(self.demos + P.context_block(texts) + case, L)
            text = self.text(ids)
        elif self.method == "token-rag":
            text = self._token_rag_published(question, case, rounds)
        else:
            text, query = "", question
            while True:
                old_len = len(text)
                texts = self._passages(query, rounds)
                prompt = self.demos + P.context_block(texts, typo=True) + case + " " + text
                if self.method == "fl-rag":
                    ids, _ = self.generate(prompt, cfg.fix_length)
                    new = self.text(ids).strip()
                else:
                    ids, _ = self.generate(prompt, L)
                    sents = split_sentences(self.text(ids).strip())
                    if not sents:
                        break
                    new = sents[0].text
                text, query = text.strip() + " " + new, new
                if stop(text, old_len, len(self.tokenizer.encode(text)), L):
                    break
        prediction = self.answer(case, text)
        return QuestionResult(qid=qid, question=question, gold=list(gold), text=text, prediction=prediction,
                              rounds=rounds, prefill_tokens=self._prefill, decode_tokens=self._decode,
                              llm_calls=self._calls, wall_s=time.perf_counter() - t0)

    def _token_rag_published(self, question: str, case: str, rounds: list[Round]) -> str:
        cfg = self.config
        formulation = cfg.extra.get("query_formulation", "direct")
        text = ""
        while True:
            old_len = len(text)
            ids, p = self.generate(self.demos + case + " " + text, cfg.generate_max_length)
            new = self.text(ids)
            lp = [math.log(x) if x > 0 else -math.inf for x in p]
            found = P.token_modifier([s.text for s in split_sentences(new)], [self.text([t]) for t in ids], lp,
                                     cfg.hallucination_threshold, cfg.sentence_solver)
            if found is None:
                rounds.append(Round())
                text = text.strip() + " " + new.strip()
            else:
                kept, curr = found
                texts = self._passages(P.token_query(formulation, question, text, kept, curr), rounds,
                                       trigger_sentence=curr, kept=kept)
                ids, _ = self.generate(self.demos + P.context_block(texts) + case + " " + text + " " + kept.strip(),
                                       cfg.generate_max_length)
                text = text.strip() + " " + kept.strip() + " " + self.text(ids).strip()
            if stop(text, old_len, len(self.tokenizer.encode(text)), cfg.generate_max_length):
                return text
