"""Per-question Self-Ask oracle (docs/methods.md, "Self-Ask") on plain transformers: every generation re-prefills its
whole prompt, batch 1, greedy, L tokens, and the text is cut at the stop strings afterwards (greedy decoding makes
that the text a generation stopped there would give). The transcript is read with its own string scans, apart from
the engine's policy (fastrag.methods.self_ask), which shares only the exemplars and the prompt's wording."""

from __future__ import annotations

import time

from fastrag.methods.self_ask import EXEMPLARS, exemplar_text
from fastrag.oracle.greedy import GreedyOracle
from fastrag.trace import QuestionResult, Round

MARK_FOLLOW, MARK_FINAL = "Follow up: ", "So the final answer is: "


class SelfAskOracle(GreedyOracle):
    def __init__(self, model, tokenizer, retriever, config):
        super().__init__(model, tokenizer, retriever, config)
        assert config.fewshot <= len(EXEMPLARS)
        self.yes = "No." if config.single_hop else "Yes."
        self.demos = exemplar_text(config.fewshot, self.yes)

    def prompt(self, question: str, docs, so_far: str) -> str:
        ctx = "".join(f"Context{i + 1}: {d.text}\n" for i, d in enumerate(docs))
        return f"{self.demos}{ctx}Question: {question}\nAre follow up questions needed here: {self.yes}\n{so_far}"

    def run(self, qid: str, question: str, gold: list[str]) -> QuestionResult:
        if not question.strip():
            raise ValueError("empty question")
        t0 = time.perf_counter()
        self._prefill = self._decode = self._calls = 0
        cfg = self.config
        rounds: list[Round] = []
        docs = []
        if cfg.retrieve_first:
            query, docs = self.retrieve(question)
            rounds.append(Round(query=query, doc_ids=[str(d.id) for d in docs]))
        so_far = ""
        phase_stop = ["Intermediate answer:", "Follow up:"]
        for it in range(cfg.max_iter):
            ids, _ = self.generate(self.prompt(question, docs, so_far), cfg.generate_max_length)
            raw = self.text(ids)
            end = len(raw)
            for s in ("Context:", "#", phase_stop[it % 2]):
                k = raw.find(s)
                if 0 <= k < end:
                    end = k
            piece = raw[:end]
            so_far = so_far + piece
            if so_far == "":
                break
            so_far = so_far[:-1] if so_far[-1] == "\n" else so_far
            lines = [ln for ln in piece.split("\n") if MARK_FOLLOW in ln]
            if lines:
                fq = lines[0].split(MARK_FOLLOW)[-1]
                query, docs = self.retrieve(fq)
                rounds.append(Round(trigger_sentence=MARK_FOLLOW + fq, query=query, doc_ids=[str(d.id) for d in docs]))
            if MARK_FINAL in piece:
                break
        answer = next((ln.split(MARK_FINAL)[1].strip() for ln in so_far.split("\n") if MARK_FINAL in ln), None)
        if answer is None and cfg.final_answer_generation:
            ids, _ = self.generate(self.prompt(question, docs, so_far) + "\nSo the final answer is:",
                                   cfg.generate_max_length)
            answer = self.text(ids).split("\n")[0].strip()
        return QuestionResult(qid=qid, question=question, gold=list(gold), text=so_far,
                              prediction=f"So the answer is {answer or ''}", rounds=rounds,
                              prefill_tokens=self._prefill, decode_tokens=self._decode,
                              wall_s=time.perf_counter() - t0, llm_calls=self._calls)
