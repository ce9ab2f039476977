"""Per-question oracle of the DRAGIN paper's baselines (docs/methods.md): wo-rag, sr-rag, fl-rag, fs-rag, token-rag.

The parity reference for `fastrag parity --method NAME` of each baseline, and its speed baseline: plain
transformers, one question at a time, every generation re-prefilling its whole prompt (`GreedyOracle`). It shares
the prompt builders with the engine policies (the prompts are the contract) and the text utilities; the rules --
which piece of a generation is kept and searched next, which sentence of a token-rag generation triggers and which
of its tokens form the query -- are written again here, plainly, as an independent reading of docs/methods.md.
"""

from __future__ import annotations

from fastrag.methods.common import join, rag_prompt
from fastrag.oracle.greedy import GreedyOracle
from fastrag.text.sentences import split_sentences
from fastrag.trace import QuestionResult, Round

BASELINES = ("wo-rag", "sr-rag", "fl-rag", "fs-rag", "token-rag")
_SOLVERS = {"avg": lambda xs: sum(xs) / len(xs), "max": max, "min": min}


class BaselineOracle(GreedyOracle):
    """`run(qid, question, gold) -> QuestionResult` for one of BASELINES; config: fastrag.config.BaselineConfig
    (fastrag.config.TokenRagConfig for token-rag)."""

    def __init__(self, model, tokenizer, retriever, config, method: str):
        if method not in BASELINES:
            raise ValueError(f"no baseline oracle for method {method!r}; expected one of {', '.join(BASELINES)}")
        super().__init__(model, tokenizer, retriever, config)
        self.method = method

    def run(self, qid: str, question: str, gold) -> QuestionResult:
        return self.solved(qid, question, gold, {"wo-rag": self._wo_rag, "sr-rag": self._sr_rag,
                                                 "fl-rag": self._fl_rag, "fs-rag": self._fs_rag,
                                                 "token-rag": self._token_rag}[self.method])

    def _search(self, query: str, rounds: list[Round], trigger: str | None = None) -> list:
        """The documents of `query`, the round recorded (the query as searched, after the cut)."""
        query, docs = self.retrieve(query)
        rounds.append(Round(trigger_sentence=trigger, query=query, doc_ids=[str(d.id) for d in docs]))
        return docs

    def _wo_rag(self, question, case, rounds) -> str:
        ids, _ = self.generate(self.demos + case, self.config.generate_max_length)
        rounds.append(Round())
        return self.text(ids).strip()

    def _sr_rag(self, question, case, rounds) -> str:
        docs = self._search(question, rounds)
        ids, _ = self.generate(rag_prompt(self.demos, docs, case), self.config.generate_max_length)
        return self.text(ids).strip()

    def _fl_rag(self, question, case, rounds) -> str:
        # each chunk of fix_length tokens is kept whole and is the next query
        return self._retrieve_each(question, case, rounds, self.config.fix_length, lambda t: t.strip())

    def _fs_rag(self, question, case, rounds) -> str:
        def first(t):  # the generation's first sentence is kept and is the next query; none ends the answer
            sents = split_sentences(t)
            return sents[0].text if sents else None

        return self._retrieve_each(question, case, rounds, self.config.generate_max_length, first)

    def _retrieve_each(self, question, case, rounds, n: int, keep) -> str:
        cfg = self.config
        text, query = "", question
        while True:
            old_len = len(text)
            docs = self._search(query, rounds)
            ids, _ = self.generate(rag_prompt(self.demos, docs, case, text, typo=cfg.flrag_typo), n)
            piece = keep(self.text(ids))
            if piece is None:
                return text
            text, query = join(text, piece), piece
            if self.stop(text, old_len):
                return text

    def _token_rag(self, question, case, rounds) -> str:
        cfg = self.config
        text = ""
        while True:
            old_len = len(text)
            ids, p = self.generate(self.demos + join(case, text), cfg.generate_max_length)
            new = self.text(ids)
            found = self._uncertain_sentence(ids, p, new)
            if found is None:
                rounds.append(Round())
                text = join(text, new.strip())
            else:
                sents, si, members = found
                kept = join(*(s.text for s in sents[:si]))
                sure = [ids[i] for i in members if 1 - p[i] <= cfg.hallucination_threshold]
                docs = self._search(" ".join(self.text(sure).split()), rounds, trigger=sents[si].text)
                ids, _ = self.generate(rag_prompt(self.demos, docs, case, text, kept), cfg.generate_max_length)
                text = join(text, kept, self.text(ids).strip())
            if self.stop(text, old_len):
                return text

    def _uncertain_sentence(self, ids, p, new: str):
        """(sentences of `new`, index of the first whose tokens' solver(1 - p) exceeds the threshold, the indices
        of its tokens), or None."""
        sents = split_sentences(new)
        if not sents:
            return None
        owner = self.token_sentences(ids, sents)
        solver = _SOLVERS[self.config.sentence_solver]
        for si in range(len(sents)):
            members = [i for i, o in enumerate(owner) if o == si]
            if members and solver([1 - p[i] for i in members]) > self.config.hallucination_threshold:
                return sents, si, members
        return None

    def token_sentences(self, ids, sents) -> list[int]:
        """The sentence of each token of `ids`: the last of `sents` that starts before the token's text ends in
        decode(ids) (the first sentence for a token that ends before any starts)."""
        ends = [len(self.text(ids[: i + 1])) for i in range(len(ids))]
        return [max([si for si, s in enumerate(sents) if s.start < e], default=0) for e in ends]
