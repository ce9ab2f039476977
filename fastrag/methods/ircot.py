"""IRCoT on the engine (Trivedi et al., ACL 2023, "Interleaving Retrieval with Chain-of-Thought Reasoning").

Retrieve with the question; then, step by step: generate the next chain-of-thought sentence from demos + the
documents gathered so far + case + the CoT so far; stop when that sentence says "answer is" or after `max_steps`
sentences; otherwise retrieve with the sentence and add the documents not gathered yet after the others (first
retrieval order, duplicates dropped, at most `max_docs`). The CoT is the answer text (docs/methods.md, `ircot`).

The prompt format is the DRAGIN one the other policies use (`rag_prompt`), not FlashRAG's IRCoT instruction and
example: the prompts are the contract with the oracle and every dataset's exemplars already read as CoT.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastrag.config import CONFIG_DEFAULTS, RagConfig, check_int, method_config, rag_defaults
from fastrag.methods.common import FewShotMethod, finish_answer, generate, join, rag_prompt, search, sentences, \
    truncate_query
from fastrag.methods.registry import MethodSpec, register
from fastrag.trace import QuestionResult, Round

ANSWER_PHRASE = "answer is"  # the IRCoT paper's termination test (its exemplars end "So the answer is: X.")


@dataclass(slots=True)
class IrcotConfig(RagConfig):
    """IRCoT: the shared RagConfig fields (retrieve_topk documents per retrieval, queries cut to max_query_tokens;
    generate_max_length is not read: a step generates thought_max_tokens) and the loop's bounds."""

    # CoT sentences generated at most (the last one is never searched): the exemplars reason in 2 to 4 sentences
    # before their answer sentence. FlashRAG's IRCOTPipeline stops after max_iter=2.
    max_steps: int = 5
    # tokens generated per step, of which the first sentence is kept: an exemplar's sentence is well under 32
    thought_max_tokens: int = 32
    # documents gathered at most (the paper caps its reader at 15 paragraphs); later new ones are not added
    max_docs: int = 15

    def __post_init__(self) -> None:
        RagConfig.__post_init__(self)
        check_int(self, "max_steps", 1)
        check_int(self, "thought_max_tokens", 1)
        check_int(self, "max_docs", 1)


def says_answer(sentence: str) -> bool:
    """IRCoT's stop test on one CoT sentence: it contains "answer is", in any case."""
    return ANSWER_PHRASE in sentence.lower()


def gather(have: list, new, limit: int) -> list:
    """`have` followed by the documents of `new` whose id is not there yet, in `new`'s order, up to `limit` in all
    (first come, first kept: a prompt extends the previous step's, so its KV is reused)."""
    out, seen = list(have), {str(d.id) for d in have}
    for d in new:
        if len(out) >= limit:
            break
        if str(d.id) not in seen:
            seen.add(str(d.id))
            out.append(d)
    return out


def thought_text(generated: str) -> str:
    """The part of a step's generation its sentence comes from: up to the first newline (a CoT is one line; what
    follows a newline is the next exemplar the model imagines)."""
    return generated.split("\n", 1)[0]


class Ircot(FewShotMethod):
    name = "ircot"
    cfg: IrcotConfig

    def __call__(self, ex):
        cfg, tok = self.cfg, self.tok
        res, case = self.open(ex)
        docs = yield from self.retrieve(res, ex.question, [])
        cot = ""
        for step in range(1, cfg.max_steps + 1):
            g = yield from generate(res, rag_prompt(self.demos, docs, case, cot), cfg.thought_max_tokens)
            sents = yield from sentences(thought_text(tok.decode(g.ids, skip_special_tokens=True)))
            if not sents:  # the model wrote no further sentence: the CoT is over
                break
            cot = join(cot, sents[0].text)
            if says_answer(sents[0].text) or step == cfg.max_steps:
                break
            docs = yield from self.retrieve(res, sents[0].text, docs)
        return (yield from finish_answer(res, tok, self.demos, case, cot))

    def retrieve(self, res: QuestionResult, query: str, docs: list):
        """`docs = yield from self.retrieve(res, query, docs)`: search, record the round, gather the new ones."""
        query = truncate_query(self.tok, query, self.cfg.max_query_tokens)
        found = yield from search(res, query, self.cfg.retrieve_topk)
        res.rounds.append(Round(query=query, doc_ids=[str(d.id) for d in found]))
        return gather(docs, found, self.cfg.max_docs)


def decisions(r: QuestionResult) -> dict:
    """What `fastrag parity --method ircot` / `iter-retgen` compares: each round's query and documents, the answer."""
    return {
        "query": [x.query for x in r.rounds],
        "docs": [list(x.doc_ids) for x in r.rounds],
        "answer": (r.metrics or {}).get("answer") if r.error is None else f"error: {r.error}",
    }


def _oracle(hf_model, tokenizer, retriever, cfg):
    from fastrag.oracle.iterative import IrcotOracle

    return IrcotOracle(hf_model, tokenizer, retriever, cfg)


CONFIG_DEFAULTS["ircot"] = lambda dataset: (IrcotConfig, rag_defaults(dataset))
register(MethodSpec(
    name="ircot", description="IRCoT: one CoT sentence a step, each the next query; documents accumulate",
    make_config=lambda dataset, path: method_config("ircot", dataset, path),
    make_policy=Ircot, make_oracle=_oracle, decisions=decisions))
