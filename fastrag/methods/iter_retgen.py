"""Iter-RetGen on the engine (Shao et al., Findings of EMNLP 2023, "Enhancing Retrieval-Augmented Large Language
Models with Iterative Retrieval-Generation Synergy").

`iterations` rounds; each retrieves, then generates a whole answer (L tokens) from demos + that round's documents +
case. Round 1 retrieves with the question; round t > 1 with the question followed by round t-1's answer
(generation-augmented retrieval: the answer's words find the passages the question alone misses). Each round's
documents replace the previous round's; the last round's generation is the answer text (docs/methods.md,
`iter-retgen`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastrag.config import CONFIG_DEFAULTS, RagConfig, check_int, method_config, rag_defaults
from fastrag.data.metrics import clean_prediction
from fastrag.methods.common import FewShotMethod, finish_answer, generate, join, rag_prompt, search, truncate_query
from fastrag.methods.ircot import decisions
from fastrag.methods.registry import MethodSpec, register
from fastrag.trace import Round

# queries are cut to their last N tokens: the question and a whole L-token answer fit (FlashRAG does not cut them);
# the DRAGIN methods' 64 would cut the question off a long answer
QUERY_TOKENS = 256


@dataclass(slots=True)
class IterRetGenConfig(RagConfig):
    """Iter-RetGen: the shared RagConfig fields (L = generate_max_length tokens per round's answer) and the rounds."""

    iterations: int = 3  # T, retrieval-generation rounds (the paper's and FlashRAG's default)

    def __post_init__(self) -> None:
        RagConfig.__post_init__(self)
        check_int(self, "iterations", 1)


def next_query(question: str, answer: str) -> str:
    """The query of the round after one that generated `answer`: the question, a space, the answer as the evaluator
    reads it (cut before a next "Question:" the model goes on to imagine, `clean_prediction`), stripped."""
    return join(question, clean_prediction(answer).strip())


class IterRetGen(FewShotMethod):
    name = "iter-retgen"
    cfg: IterRetGenConfig

    def __call__(self, ex):
        cfg, tok = self.cfg, self.tok
        res, case = self.open(ex)
        text = ""
        for t in range(cfg.iterations):
            query = truncate_query(tok, ex.question if t == 0 else next_query(ex.question, text),
                                   cfg.max_query_tokens)
            docs = yield from search(res, query, cfg.retrieve_topk)
            res.rounds.append(Round(query=query, doc_ids=[str(d.id) for d in docs]))
            g = yield from generate(res, rag_prompt(self.demos, docs, case), cfg.generate_max_length)
            text = tok.decode(g.ids, skip_special_tokens=True).strip()
        return (yield from finish_answer(res, tok, self.demos, case, text))


def _oracle(hf_model, tokenizer, retriever, cfg):
    from fastrag.oracle.iterative import IterRetGenOracle

    return IterRetGenOracle(hf_model, tokenizer, retriever, cfg)


CONFIG_DEFAULTS["iter-retgen"] = lambda dataset: (IterRetGenConfig,
                                                  {**rag_defaults(dataset), "max_query_tokens": QUERY_TOKENS})
register(MethodSpec(
    name="iter-retgen", description="Iter-RetGen: T rounds, each retrieving with the question + the last answer",
    make_config=lambda dataset, path: method_config("iter-retgen", dataset, path),
    make_policy=IterRetGen, make_oracle=_oracle, decisions=decisions))
