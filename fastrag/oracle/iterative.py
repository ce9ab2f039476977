"""Per-question oracles of IRCoT and Iter-RetGen (docs/methods.md, `ircot` and `iter-retgen`).

The parity reference of `fastrag parity --method ircot` / `iter-retgen`: plain transformers, one question at a time,
every generation re-prefilling its whole prompt (`GreedyOracle`). The prompt builders are shared with the engine
policies (the prompts are the contract); the rules -- which sentence a step keeps, when the CoT ends, how documents
accumulate, what a later Iter-RetGen round searches -- are written again here from docs/methods.md.
"""

from __future__ import annotations

from fastrag.data.metrics import clean_prediction
from fastrag.methods.common import rag_prompt
from fastrag.oracle.greedy import GreedyOracle
from fastrag.text.sentences import split_sentences
from fastrag.trace import QuestionResult, Round


class _Oracle(GreedyOracle):
    def run(self, qid: str, question: str, gold) -> QuestionResult:
        return self.solved(qid, question, gold, self.solve)

    def search(self, query: str, rounds: list[Round]) -> list:
        query, docs = self.retrieve(query)
        rounds.append(Round(query=query, doc_ids=[str(d.id) for d in docs]))
        return docs

    def solve(self, question: str, case: str, rounds: list[Round]) -> str:
        raise NotImplementedError


class IrcotOracle(_Oracle):
    """config: fastrag.methods.ircot.IrcotConfig."""

    def solve(self, question, case, rounds) -> str:
        cfg = self.config
        pool: dict[str, object] = {}  # id -> document, in the order first retrieved (dicts keep insertion order)

        def add(docs):
            for d in docs:
                if len(pool) == cfg.max_docs:
                    return
                pool.setdefault(str(d.id), d)

        add(self.search(question, rounds))
        thoughts: list[str] = []
        while len(thoughts) < cfg.max_steps:
            prompt = rag_prompt(self.demos, list(pool.values()), case, " ".join(thoughts))
            ids, _ = self.generate(prompt, cfg.thought_max_tokens)
            line = self.text(ids).split("\n")[0]  # a thought never runs past the line it starts on
            sents = split_sentences(line)
            if not sents:
                break
            thoughts.append(sents[0].text)
            if "answer is" in sents[0].text.lower() or len(thoughts) == cfg.max_steps:
                break
            add(self.search(sents[0].text, rounds))
        return " ".join(thoughts)


class IterRetGenOracle(_Oracle):
    """config: fastrag.methods.iter_retgen.IterRetGenConfig."""

    def solve(self, question, case, rounds) -> str:
        answer = ""
        for t in range(self.config.iterations):
            previous = clean_prediction(answer).strip()
            query = f"{question} {previous}" if t > 0 and previous else question
            docs = self.search(query, rounds)
            ids, _ = self.generate(rag_prompt(self.demos, docs, case), self.config.generate_max_length)
            answer = self.text(ids).strip()
        return answer
