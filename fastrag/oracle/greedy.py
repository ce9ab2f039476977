"""What the FLARE and baseline oracles share: greedy `model.generate` over a whole prompt, one question at a time.

Every call re-prefills its prompt (no prefix reuse), batch 1, no stop strings, and ends at EOS, as the published
per-question code runs; it returns each generated token's probability, which the confidence rules read. The
retriever's query is cut as the published retriever cuts it, and the DRAGIN stop rule and the evaluator's answer
generation are written here once for both oracles.
"""

from __future__ import annotations

import time

import torch

from fastrag.data.exemplars import case_text, demo_text
from fastrag.data.metrics import ANSWER_MAX_TOKENS, answer_prompt, complete_answer, needs_answer_generation
from fastrag.methods.common import STOP_PHRASE
from fastrag.oracle.context import check_context, eos_ids
from fastrag.trace import QuestionResult, Round


class GreedyOracle:
    """The model calls of a per-question oracle; config: a fastrag.config.RagConfig (dataset, fewshot,
    generate_max_length, retrieve_topk, max_query_tokens, stop_case_insensitive)."""

    # keep the EOS that ends a generation in its ids and probabilities (the published code's text keeps it); it is
    # never counted as a decoded token
    keep_end = False

    def __init__(self, model, tokenizer, retriever, config):
        self.model, self.tokenizer, self.retriever, self.config = model, tokenizer, retriever, config
        self.demos = demo_text(config.dataset, config.fewshot)
        self.eos_ids = eos_ids(tokenizer, model)
        self._pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else min(self.eos_ids)
        self._prefill = self._decode = 0
        self._calls = 0  # generate calls of the current question (the record's llm_calls, as the engine counts)

    @torch.no_grad()
    def solved(self, qid: str, question: str, gold, solve) -> QuestionResult:
        """The record of one question whose rule is `solve(question, case, rounds) -> text` (the rounds it appends are
        the record's), the answer read from the text as the evaluator reads it; the model calls counted afresh."""
        t0 = time.perf_counter()
        self._prefill = self._decode = self._calls = 0
        if not question.strip():
            raise ValueError("empty question")
        case = case_text(question, self.config.dataset)
        rounds: list[Round] = []
        text = solve(question, case, rounds)
        prediction = self.answer(case, text)
        return QuestionResult(qid=qid, question=question, gold=list(gold), text=text, prediction=prediction,
                              rounds=rounds, prefill_tokens=self._prefill, decode_tokens=self._decode,
                              llm_calls=self._calls, wall_s=time.perf_counter() - t0)

    def generate(self, prompt: str, n: int) -> tuple[list[int], list[float]]:
        """Greedy continuation of `prompt`: (token ids, their probabilities), a final EOS dropped (kept with
        `keep_end`)."""
        ids = self.tokenizer.encode(prompt)
        check_context(self.model, len(ids), n)
        x = torch.tensor([ids], device=self.model.device)
        out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                  output_scores=True, return_dict_in_generate=True, pad_token_id=self._pad)
        new = out.sequences[0, len(ids):].tolist()
        p = []
        for t, s in zip(new, out.scores):
            p.append(float(torch.log_softmax(s[0].float(), -1)[t].exp()))
        self._prefill += len(ids)
        self._calls += 1
        ended = bool(new) and new[-1] in self.eos_ids
        if ended and not self.keep_end:
            new, p = new[:-1], p[:-1]
        self._decode += len(new) - (ended and self.keep_end)  # (a final EOS not counted, as the engine counts)
        return new, p

    def text(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def retrieve(self, query: str) -> tuple[str, list]:
        """(the query as searched, its documents): the query cut to its last max_query_tokens tokens."""
        ids = self.tokenizer.encode(query, add_special_tokens=False)  # (a BOS is no query token)
        if len(ids) > self.config.max_query_tokens:
            query = self.tokenizer.decode(ids[-self.config.max_query_tokens:], skip_special_tokens=True).strip()
        return query, self.retriever.search([query], k=self.config.retrieve_topk)[0]

    def stop(self, text: str, old_len: int) -> bool:
        """The DRAGIN stop rule: the text is past L tokens, did not grow, or says "the answer is"."""
        cfg = self.config
        has = STOP_PHRASE in (text.lower() if cfg.stop_case_insensitive else text)
        return len(self.tokenizer.encode(text)) > cfg.generate_max_length or len(text) <= old_len or has

    def answer(self, case: str, text: str) -> str:
        """The text scored: `text`, completed by the evaluator's short answer generation when it lacks "the
        answer is"."""
        if not needs_answer_generation(text):
            return text
        gen, _ = self.generate(answer_prompt(self.demos, case, text), ANSWER_MAX_TOKENS)
        return complete_answer(text, self.text(gen))
