"""Per-question BeamSearchQA oracle: paper 001's Algorithm 1 on plain transformers, one LLM call at a time.

The parity reference and speed baseline for `fastrag/methods/beamsearchqa.py`: the nested loops of Algorithm 1 in
their written order (for each tuple of the beam, for each generated sub-question: retrieve, answer, score), every
call a greedy `model.generate` over its whole prompt (no cache reuse, batch size 1), one retriever call per query.
It shares with the engine only the tokenizer, the retriever, and the method's prompt builders, output parsers and
beam rules (pure functions: they are the method's definition, not its execution).
"""

from __future__ import annotations

import time

import torch

from fastrag.methods.beamsearchqa import (
    ASK_CUE,
    BeamSearchQAConfig,
    Prompts,
    best,
    parse_answer,
    parse_evidence,
    parse_questions,
    parse_score,
    prediction_text,
    prune,
    reached,
)
from fastrag.oracle.context import check_context, eos_ids
from fastrag.trace import BeamNode, QuestionResult, Round


class BeamSearchQAOracle:
    """`run(qid, question, gold) -> QuestionResult` (chosen tuple, kept beams, retrievals, LLM calls, tokens).

    model: a transformers causal LM; tokenizer: its HF tokenizer; retriever: `fastrag.retrieval.base.Retriever`;
    config: `BeamSearchQAConfig`.
    """

    def __init__(self, model, tokenizer, retriever, config: BeamSearchQAConfig):
        self.model, self.tokenizer, self.retriever, self.cfg = model, tokenizer, retriever, config
        self.prompts = Prompts(tokenizer, config)
        self.eos_ids = eos_ids(tokenizer, model)
        self._pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else min(self.eos_ids)
        self._reset()

    def _reset(self):
        self.calls = self.prefill = self.decode = 0
        self.rounds: list[Round] = []

    @torch.no_grad()
    def generate(self, prompt: str, max_new_tokens: int) -> str:
        """Greedy `model.generate` over the whole prompt; the decoded new text (a final EOS dropped)."""
        ids = self.tokenizer.encode(prompt)
        check_context(self.model, len(ids), max_new_tokens)
        input_ids = torch.tensor([ids], device=self.model.device)  # [1, P]
        out = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                  max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self._pad_id,
                                  eos_token_id=sorted(self.eos_ids))
        new = out[0, len(ids):].tolist()
        if new and new[-1] in self.eos_ids:
            new = new[:-1]
        self.calls += 1
        self.prefill += len(ids)
        self.decode += len(new)
        return self.tokenizer.decode(new, skip_special_tokens=True)

    # ------------------------------------------------------------------ the four functions (paper section 3.2)
    def answer(self, q: str, Q: list[str], E: list[str]) -> str:
        return parse_answer(self.generate(self.prompts.answer(q, Q, E), self.cfg.answer_max_tokens))

    def ask(self, q: str, Q: list[str], E: list[str]) -> list[str]:
        text = self.generate(self.prompts.ask(q, Q, E), self.cfg.ask_max_tokens)
        return parse_questions(ASK_CUE + text, self.cfg.max_questions, q, Q)

    def retrieve(self, q_ori: str, query: str) -> tuple[str, list[str]] | None:
        """(summarised evidence, doc ids) of the top-N documents for `query`; None when there is no document."""
        docs = self.retriever.search([query], self.cfg.num_docs)[0]
        self.rounds.append(Round(query=query, doc_ids=[d.id for d in docs]))
        if not docs:
            return None
        text = self.generate(self.prompts.summary(q_ori, docs), self.cfg.summary_max_tokens)
        return parse_evidence(text), [d.id for d in docs]

    def score(self, q: str, Q: list[str], E: list[str], a: str) -> float:
        return parse_score(self.generate(self.prompts.score(q, Q, E, a), self.cfg.score_max_tokens))

    # ------------------------------------------------------------------ Algorithm 1
    def run(self, qid: str, question: str, gold: list[str]) -> QuestionResult:
        t0 = time.perf_counter()
        self._reset()
        cfg, q = self.cfg, question
        if not q.strip():
            raise ValueError("empty question")
        beam: list[BeamNode] = []  # S_0
        a0 = self.answer(q, [], [])
        beam.append(BeamNode(answer=a0, score=self.score(q, [], [], a0)))
        found = self.retrieve(q, q)
        if found is not None:
            e1, ids = found
            a1 = self.answer(q, [q], [e1])
            beam.append(BeamNode(queries=[q], evidence=[e1], doc_ids=[ids], answer=a1,
                                 score=self.score(q, [q], [e1], a1)))
        beams = [list(beam)]
        for depth in range(1, cfg.max_depth + 1):
            level: list[BeamNode] = []  # S_d
            for t in beam:
                for sub in self.ask(q, t.queries, t.evidence):
                    found = self.retrieve(q, sub)
                    if found is None:
                        continue
                    e, ids = found
                    Q, E = t.queries + [sub], t.evidence + [e]
                    a = self.answer(q, Q, E)
                    level.append(BeamNode(queries=Q, evidence=E, doc_ids=t.doc_ids + [ids], answer=a,
                                          score=self.score(q, Q, E, a), depth=depth))
            if not level:
                break  # no tuple could be extended: answer from the last beam
            beam = prune(level, cfg.beam_size)
            beams.append(list(beam))
            if reached(beam, cfg.score_threshold):
                break
        chosen = best(beam)
        return QuestionResult(
            qid=qid, question=question, gold=list(gold), text=chosen.answer, prediction=prediction_text(chosen.answer),
            rounds=list(self.rounds), prefill_tokens=self.prefill, decode_tokens=self.decode,
            wall_s=time.perf_counter() - t0, llm_calls=self.calls, chosen=chosen, beams=beams)
