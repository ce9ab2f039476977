"""Self-Ask with retrieval (Press et al., 2023, "Measuring and Narrowing the Compositionality Gap"), as FlashRAG's
SelfAskPipeline runs it: the model writes "Follow up: <question>" lines, each follow-up question is searched, and the
model writes the "Intermediate answer:" itself with those documents in its prompt, until "So the final answer is:".
(docs/methods.md, "Self-Ask"; the exemplars below are fastrag's own.)

Per question:
  docs = search(question)  (retrieve_first)
  up to max_iter generations, alternating two phases, each of at most L tokens and cut before the earliest of
  "Context:", "#" and the phase's stop string ("Intermediate answer:" in the follow-up phase, which comes first,
  then "Follow up:" in the answer phase):
    prompt = exemplars + "Context1: ..." lines of docs + "Question: q\\nAre follow up questions needed here: Yes.\\n"
             + transcript
    transcript += the cut text, one final newline dropped; an empty transcript ends the question
    a line of the cut text holding "Follow up: " -> docs = search(the text after its last "Follow up: ")
    the cut text holds "So the final answer is: " -> done
  answer = the text after "So the final answer is: " on the first transcript line that has it; without one, one more
  generation from the last prompt + "\\nSo the final answer is:" gives it (its first line).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastrag.config import (CONFIG_DEFAULTS, ConfigError, RagConfig, check_bools, check_int, method_config,
                            rag_defaults)
from fastrag.methods.common import generate, open_result, search, truncate_query
from fastrag.methods.registry import MethodSpec, register
from fastrag.trace import Round

FOLLOW_UP = "Follow up: "
INTERMEDIATE = "Intermediate answer:"
FINAL = "So the final answer is: "
ALWAYS_STOP = ("Context:", "#")  # FlashRAG's stops in both phases

# fastrag's own Self-Ask exemplars (the format of Press et al.; the questions and facts are ours)
EXEMPLARS = (
    ("What is the capital of the country where the Taj Mahal is located?",
     [("Where is the Taj Mahal located?", "The Taj Mahal is in Agra, India."),
      ("What is the capital of India?", "New Delhi.")], "New Delhi"),
    ("Which film came out first, Titanic or The Matrix?",
     [("When did Titanic come out?", "Titanic came out in 1997."),
      ("When did The Matrix come out?", "The Matrix came out in 1999.")], "Titanic"),
    ("Are the director of Jaws and the director of Alien from the same country?",
     [("Who directed Jaws?", "Steven Spielberg."),
      ("Which country is Steven Spielberg from?", "The United States."),
      ("Who directed Alien?", "Ridley Scott."),
      ("Which country is Ridley Scott from?", "England.")], "no"),
    ("Who was the president of the United States when the Eiffel Tower was completed?",
     [("When was the Eiffel Tower completed?", "The Eiffel Tower was completed in 1889."),
      ("Who was the president of the United States in 1889?", "Benjamin Harrison.")], "Benjamin Harrison"),
)


def exemplar_text(k: int, follow_ups: str = "Yes.") -> str:
    """The first k exemplars, each ending with a blank line."""
    out = []
    for q, steps, ans in EXEMPLARS[:k]:
        lines = [f"Question: {q}", f"Are follow up questions needed here: {follow_ups}"]
        for fq, fa in steps:
            lines += [f"{FOLLOW_UP}{fq}", f"{INTERMEDIATE} {fa}"]
        out.append("\n".join(lines + [f"{FINAL}{ans}"]) + "\n\n")
    return "".join(out)


@dataclass(slots=True)
class SelfAskConfig(RagConfig):
    """Self-Ask's fields; generate_max_length is the token cap of each generation (the text is cut at the stops)."""

    max_iter: int = 5  # generations per question (FlashRAG's max_iter)
    retrieve_first: bool = True  # FlashRAG searches the question before the first generation
    single_hop: bool = False  # FlashRAG's single_hop: the prompt answers "No." to the follow-up line, else "Yes."
    final_answer_generation: bool = True  # no final-answer line after max_iter: one more generation asks for it

    def __post_init__(self) -> None:
        # (its own exemplars, fewer than any dataset's: checked first, so RagConfig's count check always passes)
        check_int(self, "fewshot", 0)
        if self.fewshot > len(EXEMPLARS):
            raise ConfigError(f"fewshot is {self.fewshot} but self-ask has only {len(EXEMPLARS)} exemplars")
        RagConfig.__post_init__(self)
        check_int(self, "max_iter", 1)
        check_bools(self, "retrieve_first", "single_hop", "final_answer_generation")


def self_ask_defaults(dataset: str):
    return SelfAskConfig, {**rag_defaults(dataset), "fewshot": len(EXEMPLARS), "generate_max_length": 64}


CONFIG_DEFAULTS["self-ask"] = self_ask_defaults


# ---------------------------------------------------------------------------------------------- parsing


def cut_at_stops(text: str, stops) -> str:
    """text before the earliest occurrence of any of `stops` (all of it when none occurs)."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(ends)] if ends else text


def follow_up_question(text: str) -> str | None:
    """The question of the first line holding "Follow up: " (what follows its last "Follow up: "), or None."""
    for line in text.split("\n"):
        if FOLLOW_UP in line:
            return line.split(FOLLOW_UP)[-1]
    return None


def final_answer(text: str) -> str | None:
    """The stripped text after "So the final answer is: " on the first line that holds it, or None."""
    for line in text.split("\n"):
        if FINAL in line:
            return line.split(FINAL)[1].strip()
    return None


def references(docs) -> str:
    return "".join(f"Context{i}: {d.text}\n" for i, d in enumerate(docs, 1))


class SelfAsk:
    name = "self-ask"

    def __init__(self, cfg: SelfAskConfig, tokenizer):
        self.cfg, self.tok = cfg, tokenizer
        self.follow_ups = "No." if cfg.single_hop else "Yes."
        self.demos = exemplar_text(cfg.fewshot, self.follow_ups)

    @property
    def shared_prefix(self) -> str:
        return self.demos

    def prompt(self, q: str, docs, transcript: str) -> str:
        return (self.demos + references(docs) + f"Question: {q}\nAre follow up questions needed here: "
                f"{self.follow_ups}\n" + transcript)

    def retrieve(self, res, query: str, trigger: str | None):
        query = truncate_query(self.tok, query, self.cfg.max_query_tokens)
        docs = yield from search(res, query, self.cfg.retrieve_topk)
        res.rounds.append(Round(trigger_sentence=trigger, query=query, doc_ids=[str(d.id) for d in docs]))
        return docs

    def __call__(self, ex):
        cfg, tok = self.cfg, self.tok
        res = open_result(ex)
        q = ex.question
        docs = (yield from self.retrieve(res, q, None)) if cfg.retrieve_first else []
        transcript, stop = "", INTERMEDIATE
        for _ in range(cfg.max_iter):
            g = yield from generate(res, self.prompt(q, docs, transcript), cfg.generate_max_length)
            out = cut_at_stops(tok.decode(g.ids, skip_special_tokens=True), ALWAYS_STOP + (stop,))
            stop = "Follow up:" if stop == INTERMEDIATE else INTERMEDIATE
            transcript += out
            if not transcript:
                break
            if transcript.endswith("\n"):
                transcript = transcript[:-1]
            fq = follow_up_question(out)
            if fq is not None:
                docs = yield from self.retrieve(res, fq, FOLLOW_UP + fq)
            if FINAL in out:
                break
        res.text = transcript
        ans = final_answer(transcript)
        if ans is None and cfg.final_answer_generation:
            g = yield from generate(res, self.prompt(q, docs, transcript) + "\n" + FINAL.rstrip(),
                                    cfg.generate_max_length)
            ans = tok.decode(g.ids, skip_special_tokens=True).split("\n")[0].strip()
        res.prediction = f"So the answer is {ans or ''}"
        return res


def _oracle(hf_model, tokenizer, retriever, cfg):
    from fastrag.oracle.self_ask import SelfAskOracle

    return SelfAskOracle(hf_model, tokenizer, retriever, cfg)


register(MethodSpec(
    name="self-ask", description="Self-Ask (Press et al. 2023) as FlashRAG runs it: each \"Follow up:\" question "
    "is searched, the model writes the intermediate answer from those documents",
    make_config=lambda dataset, path: method_config("self-ask", dataset, path),
    make_policy=SelfAsk, make_oracle=_oracle))
