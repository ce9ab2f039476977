"""The DRAGIN paper's fixed-rule baselines (section 4.3, Table 1) on the engine: wo-RAG, SR-RAG, FL-RAG, FS-RAG.

Rules follow the published DRAGIN code (docs/methods.md): SR-RAG retrieves once with the question; FL-RAG
retrieves before every chunk of n tokens (first with the question, then with the last chunk); FS-RAG retrieves
before every sentence (first with the question, then with the last sentence) and keeps the first sentence of each
L-token generation. All of them stop by the DRAGIN stop rule and finish with the evaluator's answer generation.
"""

from __future__ import annotations

from fastrag.config import BaselineConfig, method_config
from fastrag.methods.common import (FewShotMethod, finish_answer, generate, join, rag_prompt, search, sentences, stop,
                                    truncate_query)
from fastrag.methods.registry import MethodSpec, register
from fastrag.trace import Round


class _Baseline(FewShotMethod):
    cfg: BaselineConfig

    def __call__(self, ex):
        res, case = self.open(ex)
        text = yield from self.answer(res, ex.question, case)
        return (yield from finish_answer(res, self.tok, self.demos, case, text))

    def retrieve(self, res, query: str, trigger: str | None = None):
        query = truncate_query(self.tok, query, self.cfg.max_query_tokens)
        docs = yield from search(res, query, self.cfg.retrieve_topk)
        res.rounds.append(Round(trigger_sentence=trigger, query=query, doc_ids=[str(d.id) for d in docs]))
        return docs

    def decode(self, g) -> str:
        return self.tok.decode(g.ids, skip_special_tokens=True)


class WoRag(_Baseline):
    """No retrieval: one L-token generation from demos + case."""

    def answer(self, res, q, case):
        g = yield from generate(res, self.demos + case, self.cfg.generate_max_length)
        res.rounds.append(Round())
        return self.decode(g).strip()


class SrRag(_Baseline):
    """Single retrieval with the question, then one L-token generation with the documents."""

    def answer(self, res, q, case):
        docs = yield from self.retrieve(res, q)
        g = yield from generate(res, rag_prompt(self.demos, docs, case), self.cfg.generate_max_length)
        return self.decode(g).strip()


class _RetrieveEachPiece(_Baseline):
    """Retrieve, generate, keep a piece of the generation, and repeat with that piece as the next query (the first
    query is the question) until the DRAGIN stop rule holds. `piece` says which piece, `piece_tokens` how many
    tokens each generation may take."""

    piece_tokens: int

    def piece(self, g):
        """The part of generation `g` the answer keeps (a generator, as it may ask for sentences), or None to
        stop with the answer so far."""
        raise NotImplementedError

    def answer(self, res, q, case):
        cfg, text, query = self.cfg, "", q
        while True:
            old_len = len(text)
            docs = yield from self.retrieve(res, query)
            g = yield from generate(res, rag_prompt(self.demos, docs, case, text, typo=cfg.flrag_typo),
                                    self.piece_tokens)
            piece = yield from self.piece(g)
            if piece is None:
                return text
            text = join(text, piece)
            query = piece
            if stop(text, old_len, len(self.tok.encode(text)), cfg.generate_max_length, cfg.stop_case_insensitive):
                return text


class FlRag(_RetrieveEachPiece):
    """Retrieve, generate n tokens, repeat with the chunk just generated as the next query."""

    @property
    def piece_tokens(self) -> int:
        return self.cfg.fix_length

    def piece(self, g):
        yield from ()
        return self.decode(g).strip()


class FsRag(_RetrieveEachPiece):
    """Retrieve, generate L tokens and keep the first sentence, repeat with that sentence as the next query."""

    @property
    def piece_tokens(self) -> int:
        return self.cfg.generate_max_length

    def piece(self, g):
        sents = yield from sentences(self.decode(g))
        return sents[0].text if sents else None


def baseline_oracle(name: str):
    """The MethodSpec.make_oracle of baseline `name`: its per-question oracle (fastrag.oracle.baselines)."""
    def make(hf_model, tokenizer, retriever, cfg):
        if getattr(cfg, "fidelity", "reference") == "published":
            from fastrag.oracle.baselines_published import BaselinePublishedOracle

            return BaselinePublishedOracle(hf_model, tokenizer, retriever, cfg, name)
        from fastrag.oracle.baselines import BaselineOracle

        return BaselineOracle(hf_model, tokenizer, retriever, cfg, name)

    return make


def fidelity_policy(name: str, cls):
    """The MethodSpec.make_policy of baseline `name`: `cls`, or its published-code loop under
    `fidelity: "published"` (fastrag.methods.baselines_published)."""
    def make(cfg, tokenizer):
        if cfg.fidelity == "published":
            from fastrag.methods.baselines_published import PUBLISHED

            return PUBLISHED[name](cfg, tokenizer)
        return cls(cfg, tokenizer)

    return make


def _spec(name: str, cls, description: str) -> MethodSpec:
    return register(MethodSpec(name=name, description=description,
                               make_config=lambda dataset, path: method_config(name, dataset, path),
                               make_policy=fidelity_policy(name, cls), make_oracle=baseline_oracle(name)))


_spec("wo-rag", WoRag, "no retrieval: one generation from the few-shot prompt")
_spec("sr-rag", SrRag, "single retrieval with the question before generating")
_spec("fl-rag", FlRag, "retrieve every n tokens (fix_length), the last chunk as the query")
_spec("fs-rag", FsRag, "retrieve every sentence, the last sentence as the query")
